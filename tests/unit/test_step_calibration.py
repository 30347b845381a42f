"""Step-time calibration (app/policy/calibration.py): the planner learns what plans of each depth
really cost and moves to the depth that really pays."""

import random

import pytest

from app.policy import (PolicyConfig, SpeculationPolicy, StepCandidate, StepCosts, StepCostsConfig,
                        StepTimeCalibration, expected_tokens_per_step, plan_step)


def test_unmeasured_is_one_and_measurements_pull_toward_the_ratio() -> None:
    cal = StepTimeCalibration(half_life_steps=64, prior_steps=4)
    assert cal.factor(16, 4) == 1.0
    for _ in range(200):
        cal.observe(16, 4, predicted_s=0.010, realized_s=0.013)
    assert cal.factor(16, 4) == pytest.approx(1.3, abs=0.02)
    assert cal.factor(16, 3) == pytest.approx(1.3, abs=0.02)  # unmeasured: the bucket's level
    cal.observe(16, 2, 0.010, 0.020)
    assert 1.3 < cal.factor(16, 2) < 1.5  # one step is shrunk toward the bucket's level


def test_batches_share_power_of_two_buckets() -> None:
    cal = StepTimeCalibration()
    for _ in range(50):
        cal.observe(12, 4, 0.01, 0.02)
    assert cal.factor(9, 4) == cal.factor(16, 4) > 1.5
    assert cal.factor(17, 4) == 1.0 and cal.factor(8, 4) == 1.0  # other buckets: nothing measured
    assert StepTimeCalibration.bucket(1) == 1 and StepTimeCalibration.bucket(16) == 16
    assert StepTimeCalibration.bucket(17) == 32


def test_recent_steps_outweigh_old_ones() -> None:
    cal = StepTimeCalibration(half_life_steps=16)
    for _ in range(100):
        cal.observe(4, 2, 0.01, 0.02)
    for _ in range(100):
        cal.observe(4, 2, 0.01, 0.01)
    assert cal.factor(4, 2) < 1.05


def test_bad_feedback_is_ignored_and_ratios_are_clamped() -> None:
    cal = StepTimeCalibration(max_factor=4.0)
    for bad in [(0, 1, 0.01, 0.01), (4, -1, 0.01, 0.01), (4, 1, 0.0, 0.01), (4, 1, 0.01, float("nan"))]:
        cal.observe(*bad)
    assert cal.snapshot() == {}
    for _ in range(500):
        cal.observe(4, 1, 0.001, 10.0)
    assert cal.factor(4, 1) <= 4.0
    with pytest.raises(ValueError, match="half_life_steps"):
        StepTimeCalibration(half_life_steps=0)


def _batch(n: int = 16, alpha: float = 0.8) -> list[StepCandidate]:
    return [StepCandidate(8, alpha, True) for _ in range(n)]


def test_a_depth_that_costs_more_than_predicted_is_left() -> None:
    costs = StepCosts(StepCostsConfig())
    free = plan_step(_batch(4), costs)
    d = max(free.ks)
    assert d >= 2 and free.depth == d and free.step_s > 0
    dearer = [1.0] * d + [3.0] * 8  # plans of depth >= d really take 3x their parts
    plan = plan_step(_batch(4), costs, time_factors=dearer)
    assert 0 < max(plan.ks) < d
    plain = plan_step(_batch(4), costs, time_factors=[1.0] + [5.0] * 8)  # every speculative step 5x
    assert plan_step(_batch(4), costs).depth > 0 and plain.ks == [0] * 4


def _true_goodput(depth: int, batch: list[StepCandidate], costs: StepCosts, penalty, offset_s: float = 0.0) -> float:
    ks = [depth] * len(batch)
    plan_time = plan_step(batch, costs, time_factors=[1.0 if d == depth else 1e6 for d in range(9)]).step_s
    assert plan_step(batch, costs, time_factors=[1.0 if d == depth else 1e6 for d in range(9)]).ks == ks
    tokens = sum(expected_tokens_per_step(c.alpha, depth) for c in batch)
    return tokens / (plan_time * penalty(depth) - offset_s)


@pytest.mark.parametrize("offset", [0.0, 0.3])
def test_the_feedback_loop_settles_on_the_depth_that_really_pays(offset: float) -> None:
    """A world where the parts underestimate deep steps (each depth past 2 costs 12 % more than its
    parts per extra token of depth): uncalibrated, the planner drafts deeper than what really pays;
    fed each step's realized time (5 % noise), it ends within 3 % of the best depth's real goodput.
    `offset`: the model also counts host time that is not in any step's wall time (a share of the
    plain step's time, the same for every plan) — measured depths then look cheaper than
    unmeasured ones unless those take the bucket's level."""
    penalty = lambda d: 1.0 + 0.12 * max(0, d - 2)  # noqa: E731
    costs = StepCosts(StepCostsConfig(target_step_s=0.02, draft_ratio=0.1))
    batch = _batch(8, alpha=0.85)
    plain_s = plan_step(batch, costs, time_factors=[1.0] + [1e6] * 8).step_s
    true = {d: _true_goodput(d, batch, costs, penalty, offset * plain_s) for d in range(1, 9)}
    best = max(true, key=true.get)
    naive = plan_step(batch, costs).depth
    assert naive > best and true[naive] < 0.97 * true[best]  # the uncalibrated plan really loses

    policy = SpeculationPolicy(PolicyConfig(margin=1.0, calibration_half_life_steps=64), costs=costs)
    rng = random.Random(0)
    depths = []
    for _ in range(600):  # ~75 s of 16-stream steps on the CPU app
        plan = policy.plan_step(batch)
        realized = (plan.step_s * penalty(plan.depth) - offset * plain_s) * rng.uniform(0.95, 1.05)
        policy.observe_step(plan, len(batch), realized)
        depths.append(plan.depth)
    settled = max(set(depths[-100:]), key=depths[-100:].count)
    assert true[settled] >= 0.97 * true[best], (settled, best, true)
    assert true[settled] > true[naive]


def test_calibration_is_off_by_default_and_plans_on_the_parts_alone() -> None:
    policy = SpeculationPolicy(PolicyConfig())
    assert policy.calibration is None
    plan = policy.plan_step(_batch(4))
    policy.observe_step(plan, 4, 100.0)  # ignored
    assert policy.plan_step(_batch(4)).ks == plan.ks


def test_probes_cycle_shallower_deeper_shallower_plain() -> None:
    cal = StepTimeCalibration(probe_every=2)
    got = [cal.probe_depth(4, 8) for _ in range(8)]
    assert got == [None, 3, None, 5, None, 3, None, 0]
    assert [cal.probe_depth(8, 8) for _ in range(4)] == [None, 7, None, 7]  # never past max_depth
    assert cal.probe_depth(0, 8) is None  # plain plans are not probed
    assert StepTimeCalibration(probe_every=0).probe_depth(4, 8) is None


def test_where_speculation_really_costs_more_than_predicted_the_loop_goes_plain() -> None:
    """Every speculative step really takes 1.5x its parts (a slow draft hop, say): uncalibrated, one
    sequence speculates; measured, plain wins and the plan goes plain. The chunks' host time (the
    router's work, outside the engine step) is never calibrated: it is not in the step's wall time."""
    costs = StepCosts(StepCostsConfig(target_step_s=0.010, draft_ratio=0.3, chunk_s=0.004))
    batch = _batch(1, alpha=0.6)
    assert plan_step(batch, costs).depth > 0
    slow = lambda d: 1.5 if d else 1.0  # noqa: E731
    policy = SpeculationPolicy(PolicyConfig(margin=1.0, calibration_half_life_steps=64), costs=costs)
    rng = random.Random(1)
    depths = []
    for _ in range(600):
        plan = policy.plan_step(batch)
        policy.observe_step(plan, 1, plan.step_s * slow(plan.depth) * rng.uniform(0.95, 1.05))
        depths.append(plan.depth)
    only = lambda d: [1.0 if i == d else 1e6 for i in range(9)]  # noqa: E731
    real = {d: expected_tokens_per_step(0.6, d) / (plan_step(batch, costs, time_factors=only(d)).step_s * slow(d)
                                                   + costs.t_emit(1)) for d in range(9)}
    assert max(real, key=real.get) == 0  # plain really is best in this world
    assert depths[-100:].count(0) >= 90
