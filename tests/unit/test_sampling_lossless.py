"""Speculative sampling reproduces the target's processed distribution (statistical tests).

No model: a tiny vocabulary with hand-written logits. For each case the *first emitted
token* of the batched verifier (app/spec/verify.py) is collected over many trials (seed varies per trial, the draft
token is drawn from the draft distribution with its own RNG) and compared with the target's
processed distribution (temperature 0.7 with top_p 0.9, or with top_k) by a chi-square
goodness-of-fit test. The distribution is also checked independently of `processed_probs`
(hand-computed with numpy), so a bug shared by both sides cannot hide.

Negative controls run the same harness on deliberately wrong verifiers and must be
rejected, showing the test has the power to detect a biased sampler.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from app.protocol.sampling_params import SamplingParams
from app.engine.spec_engine import SpecEngine
from app.proposers import DraftModelProposer
from app.spec.sampling import inverse_cdf, processed_probs, uniform
from app.spec.verify import RowToVerify, Verified, verify_batch

TRIALS = 4000
P_MIN = 1e-3  # a correct sampler fails with probability 1e-3 per case (fixed seeds: never flaky)

TARGET_LOGITS = torch.tensor(
    [
        [2.0, 1.6, 1.1, 0.7, 0.2, -0.4, -1.0, -2.5],  # row 0: decides the first emitted token
        [0.1, 1.9, -0.5, 1.2, 0.8, -2.0, 0.4, 1.0],  # row 1: after proposal 0
        [1.0, 0.0, 0.5, -1.0, 2.0, 0.3, -0.2, 0.9],  # row 2: bonus after two accepted
    ]
)
# a draft that is deliberately unlike the target (it likes tokens the target dislikes)
DRAFT_LOGITS = torch.tensor(
    [
        [0.0, 0.3, 1.5, 0.1, 1.8, 0.9, -0.5, 0.4],
        [1.4, 0.2, 0.9, -0.3, 1.1, 0.6, 0.0, -1.0],
    ]
)
VOCAB = TARGET_LOGITS.shape[1]
# kept by every case's filtering, yet not the target's favourites (rows 0 and 1)
DETERMINISTIC_PROPOSALS = [1, 3]

CASES = {
    "t0.7-top_p0.9": SamplingParams(temperature=0.7, top_p=0.9, max_tokens=8),
    "t0.7-top_k3": SamplingParams(temperature=0.7, top_k=3, max_tokens=8),
    "t0.7-top_p0.9-top_k5": SamplingParams(temperature=0.7, top_p=0.9, top_k=5, max_tokens=8),
}


def reference_probs(logits: np.ndarray, temperature: float, top_p: float, top_k: int) -> np.ndarray:
    """Independent numpy statement of the processed distribution (one row)."""
    z = logits / temperature
    if top_k:
        z = np.where(z >= np.sort(z)[::-1][top_k - 1], z, -np.inf)
    p = np.exp(z - z.max())
    p /= p.sum()
    if top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        keep = np.zeros_like(p, dtype=bool)
        mass = 0.0
        for idx in order:  # the smallest prefix whose mass reaches top_p
            keep[idx] = True
            mass += p[idx]
            if mass >= top_p:
                break
        p = np.where(keep, p, 0.0)
        p /= p.sum()
    return p


# ---- the harness --------------------------------------------------------------------------
def verify_sampled(proposals, draft_probs, target_logits, params, seed, first_position) -> Verified:
    """One sampled row through the batched verifier: logits `[1, k+1, vocab]`."""
    logits = target_logits[: len(proposals) + 1].unsqueeze(0)
    return verify_batch(logits, [RowToVerify(0, list(proposals), draft_probs, params, seed, first_position)])[0]


def sample(probs: torch.Tensor, u: float) -> int:
    return int(inverse_cdf(probs.unsqueeze(0), torch.tensor([u], dtype=torch.float64))[0])


def verifier_under_test(proposals, draft_probs, target_logits, params, seed, first_position):
    return verify_sampled(proposals, draft_probs, target_logits, params, seed, first_position).tokens


def accept_always(proposals, draft_probs, target_logits, params, seed, first_position):
    """Negative control: trusts the draft (outputs follow q, not p)."""
    return list(proposals)


def resample_from_p_on_reject(proposals, draft_probs, target_logits, params, seed, first_position):
    """Negative control: the classic bug of drawing the correction from p instead of (p - q)+."""
    p = processed_probs(target_logits, params)
    x = proposals[0]
    q_x = float(draft_probs[0, x]) if draft_probs is not None else 1.0
    if uniform(seed, first_position, "accept") < min(1.0, float(p[0, x]) / q_x):
        return [x]
    return [sample(p[0], uniform(seed, first_position, "sample"))]


def emitted_counts(verifier, params, stochastic: bool, k: int, trials: int = TRIALS, seed: int = 1234):
    """Histograms of the first emitted token, and of the second one where the first was accepted."""
    rng = np.random.default_rng(seed)
    target = TARGET_LOGITS[: k + 1]
    q = processed_probs(DRAFT_LOGITS[:k], params) if stochastic else None
    first = np.zeros(VOCAB, dtype=np.int64)
    second = np.zeros(VOCAB, dtype=np.int64)
    for trial in range(trials):
        if stochastic:
            proposals = [int(rng.choice(VOCAB, p=q[i].double().numpy() / float(q[i].double().sum()))) for i in range(k)]
        else:
            # a deterministic proposer (n-gram, greedy draft): q = one-hot on its choice
            proposals = DETERMINISTIC_PROPOSALS[:k]
        tokens = verifier(proposals, q, target, params, seed * 1_000_003 + trial, 17)
        first[tokens[0]] += 1
        if len(tokens) > 1:
            second[tokens[1]] += 1
    return first, second


def gof_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Chi-square goodness of fit; a count where the target has zero mass is an outright failure."""
    support = probs > 0
    if counts[~support].sum() > 0:
        return 0.0
    expected = probs[support] * counts.sum()
    return float(chisquare(counts[support], expected).pvalue)


def target_row(params: SamplingParams, row: int) -> np.ndarray:
    p = reference_probs(TARGET_LOGITS[row].double().numpy(), params.temperature, params.top_p, params.top_k)
    np.testing.assert_allclose(processed_probs(TARGET_LOGITS[row : row + 1], params)[0].double().numpy(), p, atol=1e-6)
    return p


# ---- tests --------------------------------------------------------------------------------
@pytest.fixture(autouse=True)
def _one_thread_for_tiny_tensors(request):
    """8-entry tensors gain nothing from intra-op threads, and on a loaded 2-core machine the
    OpenMP hand-off makes every op ~50x slower. The model tests below keep the suite's 2."""
    if "target_runner" in request.fixturenames:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_min_p_drops_tokens_below_its_share_of_the_top_one():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]])  # softmax [.644, .237, .087, .032]
    p = processed_probs(logits, SamplingParams(temperature=1.0, min_p=0.1))[0]  # keeps >= .0644
    e = np.exp([3.0, 2.0, 1.0])
    np.testing.assert_allclose(p.numpy(), [*(e / e.sum()), 0.0], atol=1e-6)


def test_processed_probs_matches_hand_computation():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    top1 = processed_probs(logits, SamplingParams(temperature=1.0, top_k=1))[0]
    assert top1.tolist() == [1.0, 0.0, 0.0, 0.0]
    # softmax([3,2,1,0]) = [.644, .237, .087, .032]: top_p 0.85 keeps the first two (0.881 >= 0.85)
    p = processed_probs(logits, SamplingParams(temperature=1.0, top_p=0.85))[0]
    e = np.exp([3.0, 2.0])
    np.testing.assert_allclose(p.numpy(), [e[0] / e.sum(), e[1] / e.sum(), 0, 0], atol=1e-6)
    for params in CASES.values():
        for row in range(TARGET_LOGITS.shape[0]):
            target_row(params, row)  # asserts processed_probs == the numpy statement
    with pytest.raises(ValueError):
        processed_probs(logits, SamplingParams(temperature=0.0))


@pytest.mark.parametrize("stochastic", [True, False], ids=["draft-probs", "deterministic-draft"])
@pytest.mark.parametrize("case", list(CASES))
def test_first_emitted_token_follows_target(case, stochastic):
    params = CASES[case]
    first, second = emitted_counts(verifier_under_test, params, stochastic, k=2)
    p0 = target_row(params, 0)
    assert gof_pvalue(first, p0) > P_MIN, f"first token {first.tolist()} vs target {np.round(p0 * TRIALS)}"
    # given proposal 0 was accepted, the next emitted token follows target row 1
    p1 = target_row(params, 1)
    assert second.sum() > 300
    assert gof_pvalue(second, p1) > P_MIN, f"second token {second.tolist()} vs target {np.round(p1 * second.sum())}"


@pytest.mark.parametrize("stochastic", [True, False], ids=["draft-probs", "deterministic-draft"])
def test_bonus_token_follows_target(stochastic):
    """k=1: when the only proposal is accepted the bonus token is drawn from the last row."""
    params = CASES["t0.7-top_p0.9"]
    _, second = emitted_counts(verifier_under_test, params, stochastic, k=1, trials=3000)
    assert second.sum() > 300
    assert gof_pvalue(second, target_row(params, 1)) > P_MIN


@pytest.mark.parametrize(
    "control,stochastic",
    [(accept_always, True), (accept_always, False), (resample_from_p_on_reject, True), (resample_from_p_on_reject, False)],
    ids=["accept-always-draft-probs", "accept-always-deterministic", "p-not-residual-draft-probs", "p-not-residual-deterministic"],
)
@pytest.mark.parametrize("case", ["t0.7-top_p0.9", "t0.7-top_k3"])
def test_negative_control_is_detected(case, control, stochastic):
    """The same harness, same trial count, same threshold rejects a biased verifier."""
    params = CASES[case]
    first, _ = emitted_counts(control, params, stochastic, k=2)
    assert gof_pvalue(first, target_row(params, 0)) < 1e-6


def test_rejected_proposal_outside_top_k_is_never_emitted():
    """A deterministic proposal the target filtered out (p = 0) is always rejected."""
    params = SamplingParams(temperature=0.7, top_k=2)
    p = processed_probs(TARGET_LOGITS[:1], params)[0]
    outside = int(torch.argmin(TARGET_LOGITS[0]))
    assert p[outside] == 0
    for seed in range(300):
        result = verify_sampled([outside], None, TARGET_LOGITS[:2], params, seed, 5)
        assert result.num_accepted == 0 and p[result.tokens[0]] > 0 and result.tokens[0] != outside


def test_verify_sampled_is_deterministic_in_its_seed():
    params = CASES["t0.7-top_p0.9"]
    q = processed_probs(DRAFT_LOGITS, params)
    runs = {tuple(verify_sampled([2, 4], q, TARGET_LOGITS, params, 99, 40).tokens) for _ in range(5)}
    assert len(runs) == 1
    outcomes = {tuple(verify_sampled([2, 4], q, TARGET_LOGITS, params, s, 40).tokens) for s in range(50)}
    assert len(outcomes) > 3


# ---- seeded generation with the real model ------------------------------------------------
@pytest.mark.parametrize("speculate", [True, False], ids=["spec-on", "spec-off"])
def test_seeded_sampling_is_reproducible(speculate, target_runner, draft_runner, encode, drive):
    """Same seed -> same tokens (a fresh engine and proposer each time); another seed differs."""
    prompt = encode("The history of the module begins")

    def run(seed: int, seq_id: str = "s") -> list[int]:
        proposer = DraftModelProposer(runner=draft_runner) if speculate else None
        engine = SpecEngine(target_runner, proposer)
        params = SamplingParams(temperature=0.7, top_p=0.9, top_k=50, max_tokens=32, seed=seed)
        engine.add(seq_id, prompt, params, k=4 if speculate else 0)
        out = drive(engine)[seq_id]
        assert (out["drafted"] > 0) == speculate
        return out["tokens"]

    a = run(11)
    assert len(a) == 32
    assert run(11, seq_id="other-id") == a
    assert run(12) != a


@pytest.mark.parametrize("temperature", [5e-324, 1e-40, 1e-8])
def test_a_vanishing_temperature_gives_the_argmax_not_nan(temperature: float) -> None:
    """The fuzz test (tests/serve/test_fuzz.py) sent temperature 5e-324: logits / T was inf, softmax NaN,
    multinomial raised in the target, and the router answered 503 after its re-issues."""
    logits = torch.tensor([[1.0, 3.0, 2.0, -1.0], [0.5, -2.0, 0.25, 0.0]])
    probs = processed_probs(logits, SamplingParams(temperature=temperature))
    assert torch.isfinite(probs).all()
    assert torch.equal(probs, torch.nn.functional.one_hot(logits.argmax(-1), 4).float())
    assert sample(probs[0], uniform(1, 0, "sample")) == 1


@pytest.mark.parametrize("top_p", [5e-324, 1e-45, 1e-9])
def test_a_vanishing_top_p_keeps_the_most_likely_token(top_p: float) -> None:
    """The fuzz test sent top_p 5e-324 (0 in float32): every token was masked, 0 / 0 gave NaN and the
    router answered 503. The nucleus always keeps its first token."""
    logits = torch.tensor([[1.0, 3.0, 2.0, -1.0], [0.5, -2.0, 0.25, 0.0]])
    probs = processed_probs(logits, SamplingParams(temperature=0.7, top_p=top_p))
    assert torch.equal(probs, torch.nn.functional.one_hot(logits.argmax(-1), 4).float())
