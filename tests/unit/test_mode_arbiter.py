"""The step-mode arbiter (app/policy/mode_arbiter.py): a bandit over planner / all on / all off
per batch bucket, on simulated steps whose goodput per mode is given."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import pytest
from pydantic import ValidationError

from app.policy import ModeArbiter, ModeArbiterConfig, PolicyConfig, batch_bucket
from app.policy.mode_arbiter import forced_mode, mode_ks

STEP_S = 0.01


def run(arb: ModeArbiter, steps: int, goodput: Callable[[str], float], batch: int = 4) -> Counter:
    """Drive `steps` engine steps; each mode's step emits goodput(mode) * STEP_S tokens."""
    chosen: Counter = Counter()
    for _ in range(steps):
        mode = arb.mode(batch)
        chosen[mode] += 1
        arb.observe(batch, mode, round(goodput(mode) * STEP_S * 100), STEP_S * 100)
    return chosen


def test_measures_every_mode_then_runs_the_best() -> None:
    arb = ModeArbiter(ModeArbiterConfig(probe_min_steps=10, probe_min_s=0.0, settle_steps=0))
    rates = {"plan": 100.0, "on": 130.0, "off": 90.0}
    assert arb.mode(4) == "plan"  # the planner is measured first
    arb.observe(4, "plan", 100, 1.0)
    run(arb, 40, rates.__getitem__)
    assert arb.snapshot()["b4"]["leader"] == "on"
    later = run(arb, 2000, rates.__getitem__)
    assert later["on"] / sum(later.values()) > 0.9


def test_a_clear_loser_is_probed_less_and_less() -> None:
    cfg = ModeArbiterConfig(probe_min_steps=8, probe_min_s=0.0, settle_steps=0, base_share=0.1, min_share=0.01)
    arb = ModeArbiter(cfg)
    rates = {"plan": 100.0, "on": 100.0, "off": 60.0}
    run(arb, 400, rates.__getitem__)
    assert arb.snapshot()["b4"]["probe_share"]["off"] < 0.1  # it halved
    late = run(arb, 20000, rates.__getitem__)
    assert arb.snapshot()["b4"]["probe_share"]["off"] == 0.01
    # at the floor, probes of 'off' take about 1 % of the time: a small share, but never none
    assert 0 < late["off"] / sum(late.values()) < 0.02


def test_probes_are_budgeted_in_time_not_steps() -> None:
    """Long steps (high load) get as small a probe share as short ones: a probe lasts
    max(probe_min_steps, probe_min_s) and the next waits probe time / share."""
    cfg = ModeArbiterConfig(probe_min_steps=4, probe_min_s=0.25, settle_steps=0, base_share=0.05, min_share=0.05)
    for step_s in (0.01, 0.4):
        arb = ModeArbiter(cfg)
        seconds = {"plan": 0.0, "on": 0.0, "off": 0.0}
        for _ in range(int(400 / step_s)):
            mode = arb.mode(32)
            arb.observe(32, mode, {"plan": 100, "on": 140, "off": 70}[mode], step_s)
            seconds[mode] += step_s
        total = sum(seconds.values())
        assert arb.snapshot()["b32"]["leader"] == "on"
        # two probed modes at a 5 % share each: about a tenth of the time, whatever the step length
        assert 0.05 < (seconds["plan"] + seconds["off"]) / total < 0.14, (step_s, seconds)


def test_a_close_mode_stays_probed_at_the_base_share() -> None:
    cfg = ModeArbiterConfig(probe_min_steps=8, probe_min_s=0.0, settle_steps=0, base_share=0.1)
    arb = ModeArbiter(cfg)
    rates = {"plan": 100.0, "on": 98.0, "off": 50.0}
    run(arb, 2000, rates.__getitem__)
    snap = arb.snapshot()["b4"]
    assert snap["leader"] == "plan"
    assert snap["probe_share"]["on"] == 0.1
    assert snap["probe_share"]["off"] < 0.1


def test_the_lead_moves_when_the_host_changes() -> None:
    arb = ModeArbiter(ModeArbiterConfig(probe_min_steps=8, probe_min_s=0.0, settle_steps=0, base_share=0.2,
                                        half_life_steps=32))
    run(arb, 1000, {"plan": 100.0, "on": 120.0, "off": 80.0}.__getitem__)
    assert arb.snapshot()["b4"]["leader"] == "on"
    # the host slows drafting: now plain decoding wins
    chosen = run(arb, 4000, {"plan": 85.0, "on": 70.0, "off": 95.0}.__getitem__)
    assert arb.snapshot()["b4"]["leader"] == "off"
    assert chosen["off"] > chosen["on"]


def test_forced_batches_are_free_measurements_and_settle_steps_are_not_counted() -> None:
    arb = ModeArbiter(ModeArbiterConfig(settle_steps=3))
    for _ in range(10):  # a forced-'off' cell: mode() is never asked
        arb.observe(8, "off", 8, 0.1, chosen=False)
    snap = arb.snapshot()["b8"]
    assert snap["steps"]["off"] == 10 and snap["measured_steps"]["off"] == 7  # the first 3 paid the switch
    assert snap["goodput"]["off"] == pytest.approx(80.0)
    # the planner and 'on' are still unmeasured: they are probed before anything is trusted
    assert arb.mode(8) == "plan"


def test_batch_buckets_are_separate() -> None:
    assert [batch_bucket(b) for b in (1, 2, 3, 4, 5, 8, 9, 16, 17, 32)] == [1, 2, 4, 4, 8, 8, 16, 16, 32, 32]
    arb = ModeArbiter(ModeArbiterConfig(probe_min_steps=4, probe_min_s=0.0, settle_steps=0))
    run(arb, 300, {"plan": 100.0, "on": 80.0, "off": 120.0}.__getitem__, batch=1)
    run(arb, 300, {"plan": 100.0, "on": 140.0, "off": 90.0}.__getitem__, batch=16)
    snap = arb.snapshot()
    assert snap["b1"]["leader"] == "off" and snap["b16"]["leader"] == "on"


def test_fixed_modes_set_only_the_adaptive_sequences() -> None:
    caps, adaptive = [8, 2, 3, 0], [True, True, False, True]
    assert mode_ks("on", caps, adaptive, default_k=4) == [4, 2, 3, 0]
    assert mode_ks("off", caps, adaptive, default_k=4) == [0, 0, 3, 0]
    assert mode_ks("plan", caps, adaptive, default_k=4) is None


def test_forced_mode_reads_only_uniform_forced_batches() -> None:
    assert forced_mode([0, 0], [False, False], 4) == "off"
    assert forced_mode([4, 4], [False, False], 4) == "on"
    assert forced_mode([4, 0], [False, False], 4) is None  # a mix measures no single mode
    assert forced_mode([3, 3], [False, False], 4) is None  # 'on' at another k is not the 'on' mode
    assert forced_mode([8, 0], [True, False], 4) is None  # adaptive sequences: the arbiter chose


def test_config_errors_say_what_to_fix() -> None:
    with pytest.raises(ValidationError, match="min_share=0.1 > base_share=0.05"):
        ModeArbiterConfig(min_share=0.1)
    with pytest.raises(ValidationError):
        PolicyConfig.model_validate({"mode_arbiter": {"probe_every": 3}})  # extra="forbid": a typo is an error
    assert PolicyConfig.model_validate({"mode_arbiter": {"enabled": False}}).mode_arbiter.enabled is False


def test_the_step_mode_metric_labels_are_the_arbiter_modes() -> None:
    from app import metrics as m
    from app.policy import MODES

    assert m.STEP_MODE_NAMES == MODES
    rec = m.InMemoryMetrics()
    rec.record_step_mode("on")
    assert rec.step_modes["on"] == 1
    with pytest.raises(ValueError, match="unknown step mode 'fast'"):
        rec.record_step_mode("fast")
