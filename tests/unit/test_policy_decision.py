"""The per-request decision on constructed snapshots, and its hand-over to the engine."""

import json

import pytest
from pydantic import ValidationError

from app.policy import (
    AcceptanceTracker,
    LoadSnapshot,
    PolicyConfig,
    PolicyRequest,
    SpeculationDecision,
    SpeculationPolicy,
)

IDLE = LoadSnapshot(running_sequences=0, queue_length=0, max_num_seqs=256)
BUSY = LoadSnapshot(running_sequences=120, queue_length=20, max_num_seqs=256)


def _policy(alpha: float | None = None, cls: str = "code", **cfg) -> SpeculationPolicy:
    """A policy, optionally with `cls` measured at per-token acceptance alpha."""
    pol = SpeculationPolicy(PolicyConfig(**cfg))
    if alpha is not None:
        for i in range(1000):  # single-token drafts, accepted evenly spread at rate alpha
            accepted = int((i + 1) * alpha) > int(i * alpha)
            pol.observe_verification(cls, 1, int(accepted))
        assert pol.acceptance.alpha(cls) == pytest.approx(alpha, abs=0.02)
    return pol


def _req(**kw) -> PolicyRequest:
    kw.setdefault("max_tokens", 512)
    kw.setdefault("prompt_class", "code")
    return PolicyRequest(**kw)


def test_long_output_low_load_speculates_deeper_with_higher_alpha():
    high = _policy(0.9).decide(_req(), IDLE)
    mid = _policy(0.65).decide(_req(), IDLE)
    assert high.speculate and high.reason == "low_load_long_output"
    assert mid.speculate and mid.reason == "low_load_long_output"
    assert high.k > mid.k
    assert high.expected_speedup > mid.expected_speedup > 1.05


def test_high_load_turns_it_off():
    d = _policy(0.9).decide(_req(), BUSY)
    assert (d.speculate, d.k, d.reason) == (False, 0, "high_load")
    assert d.batch_size == 141


def test_batch_is_capped_by_max_num_seqs():
    load = LoadSnapshot(running_sequences=4, queue_length=500, max_num_seqs=8)
    d = _policy(0.9).decide(_req(), load)
    assert d.batch_size == 8 and d.speculate  # 8 x (k+1) tokens is still below the knee


def test_short_output_turns_it_off():
    d = _policy(0.9).decide(_req(max_tokens=8), IDLE)
    assert (d.speculate, d.reason) == (False, "short_output")
    # learned: this class finishes short, so a large max_tokens does not help ...
    pol = _policy(0.9)
    for _ in range(50):
        pol.observe_finished("code", 5, "stop")
    assert pol.decide(_req(max_tokens=4096), IDLE).reason == "short_output"
    # ... unless the request cannot stop early
    assert pol.decide(_req(max_tokens=4096, has_stop=False), IDLE).speculate


def test_low_acceptance_turns_it_off():
    d = _policy(0.2).decide(_req(), IDLE)
    assert (d.speculate, d.reason) == (False, "low_acceptance")
    assert d.alpha == pytest.approx(0.2, abs=0.02)


def test_long_prompt_short_output_is_prefill_cost():
    d = _policy(0.7).decide(_req(max_tokens=20, prompt_tokens=20_000), IDLE)
    assert (d.speculate, d.reason) == (False, "prefill_cost")


def test_no_draft_and_stale_load():
    pol = _policy(0.9)
    assert pol.decide(_req(), IDLE.model_copy(update={"draft_available": False})).reason == "no_draft"
    assert pol.decide(_req(), IDLE.model_copy(update={"age_s": 60.0})).reason == "stale_load"


def test_overrides_always_win():
    low = _policy(0.1)
    d = low.decide(_req(mode="on", requested_k=3), BUSY)
    assert (d.speculate, d.k, d.reason) == (True, 3, "forced_on")
    assert low.decide(_req(mode="on", max_tokens=2), BUSY).k == 4  # default_k
    assert low.decide(_req(requested_k=5), BUSY).reason == "forced_on"  # k given under auto
    assert low.decide(_req(mode="on", requested_k=99), IDLE).k == 8  # capped at max_k
    high = _policy(0.95)
    assert high.decide(_req(mode="off"), IDLE).reason == "forced_off"
    assert high.decide(_req(requested_k=0), IDLE).reason == "forced_off"


def test_engine_depth_from_the_decision():
    pol = _policy(0.9)
    on = pol.decide(_req(), IDLE)
    assert on.reason == "low_load_long_output"
    assert pol.engine_depth(on, 512) == (8, True)  # the step planner picks 0..max_k
    assert pol.engine_depth(on, 5) == (4, True)  # never drafts past the output
    forced = pol.decide(_req(mode="on", requested_k=3), BUSY)
    assert pol.engine_depth(forced, 512) == (3, False)  # the override drafts its k every step
    assert pol.engine_depth(pol.decide(_req(mode="off"), IDLE), 512) == (0, False)
    short = pol.decide(_req(max_tokens=4), IDLE)
    assert short.reason == "short_output" and pol.engine_depth(short, 4) == (0, False)
    busy = pol.decide(_req(), BUSY)
    assert busy.reason == "high_load" and pol.engine_depth(busy, 512) == (8, True)  # load may fall
    low = _policy(0.1).decide(_req(), IDLE)
    assert low.reason == "low_acceptance" and _policy(0.1).engine_depth(low, 512) == (8, True)
    stale = pol.decide(_req(), IDLE.model_copy(update={"age_s": 60.0}))
    assert stale.reason == "stale_load" and pol.engine_depth(stale, 512) == (0, False)


def test_ingest_measured_times_once_per_publication():
    pol = _policy(0.9)
    # a replica measuring a steep, compute-bound target makes speculation stop paying at low load
    snap = IDLE.model_copy(update={"replica": "t0", "seq": 1, "decode_step_s": 0.01, "decode_tokens": 1,
                                   "verify_step_s": 0.05, "verify_tokens": 5})
    pol.ingest(snap)
    assert pol.costs.t_decode(1) == pytest.approx(0.01)
    assert pol.costs.t_verify(1, 4) == pytest.approx(0.05)
    pol.costs.observe_decode(1, 0.02)
    before = pol.costs.t_decode(1)
    pol.ingest(snap)  # same publication: not counted again
    assert pol.costs.t_decode(1) == before
    assert not pol.decide(_req(), snap).speculate


def test_ingest_per_kind_keeps_a_rare_measurement():
    """A kind re-published under its old counter is not counted again; a newer one of another
    kind is, even when the publication's overall `seq` moved on."""
    pol = _policy(0.9)
    seen: list[tuple[int, float]] = []
    pol.costs.observe_target = lambda tokens, seconds: seen.append((tokens, seconds))  # type: ignore[method-assign]
    wide = IDLE.model_copy(update={"replica": "t0", "seq": 1, "verify_seq": 1, "verify_step_s": 0.5,
                                   "verify_tokens": 75, "decode_seq": 1, "decode_step_s": 0.1, "decode_tokens": 25})
    pol.ingest(wide)
    assert sorted(seen) == [(25, 0.1), (75, 0.5)]
    pol.ingest(wide.model_copy(update={"seq": 2, "decode_seq": 2, "decode_step_s": 0.11}))
    assert sorted(seen) == [(25, 0.1), (25, 0.11), (75, 0.5)]  # the verify figures: same publication
    pol.ingest(wide.model_copy(update={"replica": "t1"}))  # another replica's figures count
    assert len(seen) == 5


def test_decision_schema():
    d = _policy(0.9).decide(_req(), IDLE)
    out = json.loads(json.dumps(d.as_dict()))
    assert out["reason"] == "low_load_long_output" and out["k"] == d.k and out["speculate"] is True
    with pytest.raises(ValidationError):
        SpeculationDecision(speculate=True, k=0, reason="forced_on")
    with pytest.raises(ValidationError):
        LoadSnapshot(running_sequences=1, bogus=2)
    with pytest.raises(ValidationError):
        PolicyRequest(max_tokens=10, mode="maybe")


def test_pooled_prior_for_unseen_class():
    pol = _policy()
    assert pol.acceptance.alpha("prose") == pytest.approx(PolicyConfig().prior_alpha)
    assert isinstance(pol.acceptance, AcceptanceTracker)
