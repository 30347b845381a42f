"""A sequence's own acceptance estimate (app/engine/acceptance.py) as the step planner reads it: the
mean shrunk to its class prior, and the optimistic estimate that keeps an unlucky start from
freezing the sequence plain."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from app.engine.acceptance import AcceptanceStats
from app.policy import StepCandidate, StepCosts, StepCostsConfig, plan_step, plan_step_optimistic


def _costs_break_even_073() -> StepCosts:
    """Two sequences, the pass memory-bound: drafting pays from a per-token acceptance of ~0.73."""
    return StepCosts(StepCostsConfig(target_step_s=0.01, knee_tokens=16, draft_ratio=0.3, exchange_s=0.01,
                                     chunk_s=0.0013))


def _stats(steps: list[tuple[int, int]]) -> AcceptanceStats:
    st = AcceptanceStats()
    for drafted, accepted in steps:
        st.record(drafted, accepted)
    return st


def test_upper_estimate_is_the_mean_at_zero_optimism_and_never_above_one() -> None:
    st = _stats([(4, 2), (4, 4)])
    assert st.token_alpha_upper(0.8, 0.0) == pytest.approx(st.token_alpha(0.8))
    assert st.token_alpha_upper(0.8, 1.0) > st.token_alpha(0.8)
    assert _stats([(4, 4)] * 50).token_alpha_upper(0.99, 3.0) <= 1.0


def test_upper_estimate_converges_to_the_mean_as_the_sequence_drafts() -> None:
    rng = random.Random(0)
    st, gaps = AcceptanceStats(), []
    for _ in range(60):
        accepted = next((i for i in range(4) if rng.random() > 0.6), 4)  # per-token acceptance 0.6
        st.record(4, accepted)
        gaps.append(st.token_alpha_upper(0.8, 1.0) - st.token_alpha(0.8))
    assert gaps[-1] < 0.06 < gaps[0]
    assert st.token_alpha_upper(0.8, 1.0) == pytest.approx(0.6, abs=0.1)


def test_one_unlucky_first_step_does_not_freeze_a_sequence_plain() -> None:
    costs = _costs_break_even_073()
    unlucky = _stats([(4, 0)])  # its first draft rejected at once; the class prior is 0.8
    mean, upper = unlucky.token_alpha(0.8), unlucky.token_alpha_upper(0.8, 1.0)

    def plan(alpha: float) -> list[int]:
        return plan_step([StepCandidate(4, alpha, True, remaining=60)] * 2, costs, margin=1.05).ks

    assert plan(mean) == [0, 0]  # on the mean it would never draft again (its estimate cannot move)
    assert plan(upper) == [4, 4]
    # a sequence that has shown a low acceptance over many steps stays plain under optimism too
    poor = _stats([(4, 1), (4, 0), (4, 2), (4, 0)] * 8)
    assert plan(poor.token_alpha_upper(0.8, 1.0)) == [0, 0]


def test_optimism_decides_whether_and_the_mean_how_deep() -> None:
    costs = _costs_break_even_073()
    unlucky = _stats([(4, 0)])
    cand = StepCandidate(8, unlucky.token_alpha(0.8), True, remaining=60,
                         alpha_upper=unlucky.token_alpha_upper(0.8, 1.0))
    # alone, only optimism would start the draft call: the step stays plain
    assert plan_step_optimistic([cand] * 2, costs, margin=1.05).ks == [0, 0]
    assert plan_step([replace(cand, alpha=cand.alpha_upper)] * 2, costs, margin=1.05).ks[0] > 0  # (it would)
    # beside a sequence that pays on its mean, the call is paid anyway: the unlucky ones join it
    good = StepCandidate(8, 0.9, True, remaining=60, alpha_upper=0.93)
    batch = [good, cand, cand]
    plan = plan_step_optimistic(batch, costs, margin=1.05)
    assert all(plan.ks)
    # ...at the depth that is best on the mean, not the (deeper) one best on the optimistic estimate
    on_mean = {k: plan_step([replace(c, cap=k, adaptive=False) for c in batch], costs).goodput for k in range(1, 9)}
    assert plan.ks[1] == max(on_mean, key=on_mean.get)
    deep = plan_step([replace(c, alpha=c.alpha_upper) for c in batch], costs, margin=1.05)
    assert deep.ks[1] > plan.ks[1]
    assert plan.goodput == pytest.approx(on_mean[plan.ks[1]])
    # with no optimism the plan is plan_step's on the mean; a sequence proven poor stays plain
    no_optimism = [replace(c, alpha_upper=None) for c in batch]
    assert plan_step_optimistic(no_optimism, costs, margin=1.05).ks == plan_step(no_optimism, costs, margin=1.05).ks
    poor = _stats([(4, 1), (4, 0), (4, 2), (4, 0)] * 8)
    poor_cand = replace(cand, alpha=poor.token_alpha(0.8), alpha_upper=poor.token_alpha_upper(0.8, 1.0))
    assert plan_step_optimistic([poor_cand] * 2, costs, margin=1.05).ks == [0, 0]


def test_a_heavier_class_prior_stops_the_planner_choosing_sequences_for_their_luck() -> None:
    """Sequences of one class differ a little (per-token acceptance 0.75 ± 0.07, as the embedded
    pair's prompts do: bench/draft_agreement.py); each has drafted three steps. Those whose estimate
    clears a break-even of 0.82 are the ones a planner would draft on. With the old weight of 8
    pseudo-trials they look far better than they are and are on average below break-even (chosen
    for luck); with the configured weight the chosen ones' estimate stays near their truth."""
    from app.policy import PolicyConfig

    rng = random.Random(3)
    seqs = []
    for _ in range(3000):
        truth = min(0.97, max(0.4, rng.gauss(0.75, 0.07)))
        steps = [(4, next((i for i in range(4) if rng.random() > truth), 4)) for _ in range(3)]
        seqs.append((truth, _stats(steps)))

    def chosen(weight: float) -> tuple[float, float, int]:
        """(mean estimate - truth, mean truth, count) of the sequences whose estimate clears 0.82."""
        picked = [(st.token_alpha(0.75, weight), truth) for truth, st in seqs if st.token_alpha(0.75, weight) > 0.82]
        n = max(len(picked), 1)
        return sum(e - t for e, t in picked) / n, sum(t for _, t in picked) / n, len(picked)

    light_over, light_truth, n_light = chosen(8.0)
    over, truth, n = chosen(PolicyConfig().sequence_prior_weight)
    assert n_light > 300 and light_over > 0.04 and light_truth < 0.80  # drafting them loses
    assert n > 50 and over < 0.03 and truth > 0.81  # fewer, and about as good as they look
