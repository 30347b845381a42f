"""Acceptance tracker, length predictor and prompt classifier."""

import random

import pytest

from app.policy import AcceptanceTracker, LengthPredictor, classify_prompt


def _step(rng: random.Random, alpha: float, k: int) -> int:
    """Accepted prefix length of one verify step under i.i.d. acceptance alpha."""
    n = 0
    while n < k and rng.random() < alpha:
        n += 1
    return n


def test_unseen_class_uses_prior_then_pooled():
    t = AcceptanceTracker(prior_alpha=0.6)
    assert t.alpha("code") == pytest.approx(0.6)
    assert t.observations("code") == 0 and t.confidence("code") == 0.0
    for _ in range(200):
        t.observe("code", 4, 4)
    assert t.alpha("code") > 0.95
    assert t.alpha("prose") > 0.9  # an unseen class starts from what all classes show


def test_alpha_is_per_token_mle_not_accepted_over_drafted():
    rng = random.Random(1)
    t = AcceptanceTracker(half_life_tokens=1e9)
    accepted = drafted = 0
    for _ in range(3000):
        a = _step(rng, 0.7, 4)
        t.observe("prose", 4, a)
        accepted, drafted = accepted + a, drafted + 4
    assert t.alpha("prose") == pytest.approx(0.7, abs=0.02)
    assert accepted / drafted < 0.6  # the naive rate would understate alpha
    assert t.per_position("prose", 4) == pytest.approx([0.7] * 4, abs=0.05)
    assert t.observations("prose") == 3000 and t.confidence("prose") > 0.99


def test_acceptance_decays_toward_new_values():
    rng = random.Random(2)
    t = AcceptanceTracker(half_life_tokens=200)
    for _ in range(1000):
        t.observe("chat", 4, _step(rng, 0.9, 4))
    assert t.alpha("chat") > 0.85
    for _ in range(1000):
        t.observe("chat", 4, _step(rng, 0.3, 4))
    assert t.alpha("chat") == pytest.approx(0.3, abs=0.06)


def test_per_position_ignores_positions_after_first_rejection():
    t = AcceptanceTracker(prior_weight=1e-6)
    for _ in range(50):
        # position 0 always accepted, position 1 always rejected; position 2 "matched" but was
        # never judged conditionally on its prefix, so it must not count
        t.observe("code", 3, 1, [True, False, True])
    pos = t.per_position("code", 3)
    assert pos[0] == pytest.approx(1.0, abs=1e-3) and pos[1] == pytest.approx(0.0, abs=1e-3)
    assert pos[2] == pytest.approx(t.alpha("code"))  # no data: falls back to alpha
    with pytest.raises(ValueError):
        t.observe("code", 3, 1, [True])


def test_length_predictor_quantile_and_window():
    p = LengthPredictor(window=100, quantile=0.9, min_samples=8)
    assert p.predict("code") is None
    assert p.expected_length("code", 500) == 500
    for n in range(1, 101):
        p.observe("code", n, "stop")
    assert p.predict("code") == 90
    assert p.expected_length("code", 500) == 90
    assert p.expected_length("code", 40) == 40  # max_tokens still caps
    for _ in range(100):  # the window forgets the old regime
        p.observe("code", 10, "stop")
    assert p.predict("code") == 10
    assert p.count("code") == 100
    assert p.predict("prose") is not None  # unseen class falls back to all classes


def test_length_predictor_censored_lengths():
    p = LengthPredictor(quantile=0.9, min_samples=4)
    for _ in range(10):
        p.observe("prose", 64, "length")  # all cut by max_tokens: true length unknown
    assert p.predict("prose") is None
    assert p.expected_length("prose", 1000) == 1000
    q = LengthPredictor(quantile=0.5, min_samples=4)
    for n in (10, 20, 30, 40):
        q.observe("chat", n, "stop")
    for _ in range(4):
        q.observe("chat", 35, "length")
    # Kaplan-Meier: survival 7/8, 6/8, 5/8 after 10, 20, 30; the four censored at 35 leave one at
    # risk, which ends at 40. Counting the censored as ended at 35 would give a median of 35.
    assert q.predict("chat") == 40


def test_classify_prompt():
    code = "import os\n\ndef walk(path):\n    for root, dirs, files in os.walk(path):\n        yield root\n"
    prose = "The quick brown fox jumps over the lazy dog. It was a bright cold day in April."
    assert classify_prompt(code) == "code"
    assert classify_prompt(prose) == "prose"
    assert classify_prompt(code, chat=True) == "chat"
    assert classify_prompt("") == "prose"
