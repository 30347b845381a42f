"""The per-step batch plan (app/policy/step_plan.py) and step-level exploration."""

import itertools
import random

import pytest

from app.policy import StepCandidate, StepCosts, StepCostsConfig, StepExplorer, expected_tokens_per_step, plan_step


def _costs(**kw) -> StepCosts:
    """Memory-bound until 64 tokens in the pass; draft step 0.25 of the target's; 1 ms exchange."""
    return StepCosts(StepCostsConfig(**kw))


def _auto(alpha: float, n: int = 1, cap: int = 8) -> list[StepCandidate]:
    return [StepCandidate(cap, alpha, True) for _ in range(n)]


def _goodput(cands: list[StepCandidate], ks: list[int], costs: StepCosts, padded: bool = True) -> float:
    """The module doc's formula, written out independently of the planner's search."""
    es = [expected_tokens_per_step(c.alpha, k) for c, k in zip(cands, ks)]
    tokens = sum(es)
    pass_tokens = len(ks) * (max(ks) + 1) if padded else sum(k + 1 for k in ks)
    t = costs.t_pass(pass_tokens) + costs.t_overhead(any(ks)) + len(ks) * costs.config.chunk_s
    t += sum(c.catch_up_s * min(1.0, e / c.remaining) for c, k, e in zip(cands, ks, es) if k)
    spec = [k for k in ks if k]
    if spec:
        t += max(spec) * costs.t_draft(len(spec)) + costs.t_exchange
    return tokens / max(t, len(ks) * costs.config.chunk_beside_s)  # the router's share runs beside the step


def test_one_predictable_sequence_on_an_idle_replica_speculates_deep() -> None:
    plan = plan_step(_auto(0.9), _costs(), margin=1.05)
    assert plan.ks[0] >= 4
    assert plan.goodput > 1.5 * plan.plain_goodput


def test_compute_bound_batch_stays_plain() -> None:
    plan = plan_step(_auto(0.9, n=64), _costs(), margin=1.05)
    assert plan.ks == [0] * 64 and not plan.explored
    assert plan.goodput == plan.plain_goodput


def test_depth_shrinks_then_stops_as_the_batch_grows() -> None:
    deepest = [max(plan_step(_auto(0.8, n=b), _costs(), margin=1.05).ks) for b in (1, 4, 8, 16, 32, 64)]
    assert deepest[0] >= 3 and deepest[-1] == 0
    assert deepest == sorted(deepest, reverse=True)


def test_low_acceptance_does_not_pay_for_the_draft() -> None:
    assert plan_step(_auto(0.05, n=2), _costs(), margin=1.05).ks == [0, 0]


def test_the_most_predictable_sequences_speculate_first_in_a_ragged_pass() -> None:
    # 12 sequences near the knee: only the high-acceptance third is worth its extra pass tokens
    cands = _auto(0.95, 4) + _auto(0.1, 8)
    random.Random(0).shuffle(cands)
    plan = plan_step(cands, _costs(knee_tokens=16, draft_ratio=0.1, exchange_s=0.0), margin=1.05, padded=False)
    assert sorted(c.alpha for c, k in zip(cands, plan.ks) if k) == [0.95] * 4


def test_a_padded_pass_drafts_the_whole_batch_or_none_of_it() -> None:
    costs = _costs(knee_tokens=16, draft_ratio=0.1, exchange_s=0.0)
    cands = _auto(0.95, 4) + _auto(0.1, 8)
    random.Random(0).shuffle(cands)
    # drafting only the predictable third would pad the other rows' plain decode to its depth:
    # the ragged plan above is dearer than it looks, and plain beats it here
    ragged = plan_step(cands, costs, margin=1.0, padded=False)
    assert _goodput(cands, ragged.ks, costs) < _goodput(cands, [0] * 12, costs)
    assert plan_step(cands, costs, margin=1.0).ks == [0] * 12
    # on an idle replica (memory-bound pass) the rows that would sit in the padding draft too
    idle = plan_step(_auto(0.95, 2) + _auto(0.3, 2), _costs(draft_ratio=0.1), margin=1.0)
    assert all(idle.ks) and len(set(idle.ks)) == 1


def test_forced_sequences_always_draft_and_make_the_draft_call_cheap_to_join() -> None:
    # An expensive exchange: alone, a batch of 8 auto sequences does better plainly...
    costs = _costs(exchange_s=0.05)
    alone = plan_step(_auto(0.7, n=8), costs, margin=1.05)
    assert alone.ks == [0] * 8
    # ...but once a forced 'on' request pays for the draft call, joining it pays.
    forced = StepCandidate(3, 0.05, False)
    plan = plan_step([forced] + _auto(0.7, n=8), costs, margin=1.05)
    assert plan.ks[0] == 3  # the override wins even at near-zero acceptance
    assert all(k > 0 for k in plan.ks[1:])


def test_caps_are_respected_and_zero_cap_never_drafts() -> None:
    cands = [StepCandidate(2, 0.99, True), StepCandidate(0, 0.99, True), StepCandidate(0, 0.99, False)]
    plan = plan_step(cands, _costs(), margin=1.0)
    assert plan.ks == [2, 0, 0]


def test_margin_keeps_a_marginal_gain_plain() -> None:
    cands = _auto(0.6, n=8)
    costs = _costs()
    free = plan_step(cands, costs, margin=1.0)
    assert any(free.ks)
    gain = free.goodput / free.plain_goodput
    assert plan_step(cands, costs, margin=gain + 0.01).ks == [0] * 8
    assert any(plan_step(cands, costs, margin=gain - 0.01).ks)


@pytest.mark.parametrize("seed", range(12))
def test_plan_is_the_optimum_over_every_subset_and_depth(seed: int) -> None:
    """Brute force over every subset of the adaptive sequences and every common depth: the
    top-m-by-alpha search finds the same best goodput, and reports it correctly."""
    rng = random.Random(seed)
    costs = _costs(target_step_s=0.02, knee_tokens=rng.choice([4, 16, 64]), exchange_s=rng.choice([0.0, 0.004, 0.02]),
                   overhead_s=rng.choice([0.0, 0.01]), chunk_s=rng.choice([0.0, 0.002]),
                   chunk_beside_s=rng.choice([0.0, 0.01]))
    cands = [StepCandidate(rng.randint(0, 5), rng.random(), rng.random() < 0.8) for _ in range(rng.randint(1, 6))]
    for padded in (True, False):
        plan = plan_step(cands, costs, padded=padded)
        assert plan.goodput == pytest.approx(_goodput(cands, plan.ks, costs, padded))
        forced = [c.cap if not c.adaptive else 0 for c in cands]
        adaptive = [i for i, c in enumerate(cands) if c.adaptive and c.cap > 0]
        best = _goodput(cands, forced, costs, padded)
        for r in range(1, len(adaptive) + 1):
            for subset in itertools.combinations(adaptive, r):
                for k in range(1, 6):
                    ks = list(forced)
                    for i in subset:
                        ks[i] = min(k, cands[i].cap)
                    best = max(best, _goodput(cands, ks, costs, padded))
        assert plan.goodput == pytest.approx(best), f"padded={padded}"


def test_catch_up_is_charged_in_proportion_to_the_output_it_pays_for() -> None:
    costs = _costs()  # target step 20 ms; draft step 5 ms
    fresh = StepCandidate(8, 0.8, True, catch_up_s=0.0, remaining=64)
    assert max(plan_step([fresh] * 4, costs, margin=1.05).ks) >= 3
    # 0.5 s of draft prefill to catch up with 8 tokens left: not worth it this step...
    behind_short = StepCandidate(8, 0.8, True, catch_up_s=0.5, remaining=8)
    assert plan_step([behind_short] * 4, costs, margin=1.05).ks == [0] * 4
    # ...but over 4,000 remaining tokens it is a small share of each step
    behind_long = StepCandidate(8, 0.8, True, catch_up_s=0.5, remaining=4000)
    assert max(plan_step([behind_long] * 4, costs, margin=1.05).ks) >= 3
    # in a mixed batch at equal acceptance the caught-up sequences draft first
    mixed = [behind_short, fresh, behind_short, fresh]
    plan = plan_step(mixed, costs, margin=1.05)
    assert plan.ks[1] > 0 and plan.ks[3] > 0 and plan.ks[0] == plan.ks[2] == 0
    # forced sequences pay their catch-up in every plan, so it never tips an adaptive choice
    forced = StepCandidate(4, 0.8, False, catch_up_s=0.5, remaining=8)
    plan = plan_step([forced, fresh], costs, margin=1.05)
    assert plan.ks[0] == 4 and plan.ks[1] > 0
    assert plan.goodput == pytest.approx(_goodput([forced, fresh], plan.ks, costs))


@pytest.mark.parametrize("seed", range(6))
def test_plan_with_catch_ups_never_loses_to_all_plain_or_all_on(seed: int) -> None:
    rng = random.Random(100 + seed)
    costs = _costs(knee_tokens=rng.choice([4, 16, 64]))
    cands = [StepCandidate(rng.randint(1, 6), rng.random(), True, catch_up_s=rng.choice([0.0, 0.01, 0.3]),
                           remaining=rng.randint(1, 300)) for _ in range(rng.randint(1, 6))]
    plan = plan_step(cands, costs)
    assert plan.goodput == pytest.approx(_goodput(cands, plan.ks, costs))
    assert plan.goodput >= _goodput(cands, [0] * len(cands), costs) - 1e-9
    for k in range(1, 7):
        assert plan.goodput >= _goodput(cands, [min(k, c.cap) for c in cands], costs) - 1e-9


def test_host_overhead_per_step_favours_steps_that_emit_more() -> None:
    # a flat target at the knee with a costly draft call: plain wins without host overhead...
    cands = _auto(0.6, n=4)
    assert plan_step(cands, _costs(exchange_s=0.02), margin=1.05).ks == [0] * 4
    # ...but a large fixed host cost per step is amortised over E(k) tokens when speculating
    assert any(plan_step(cands, _costs(exchange_s=0.02, overhead_s=0.1), margin=1.05).ks)
    # the same for a host cost per streamed chunk, which grows with the batch
    assert any(plan_step(cands, _costs(exchange_s=0.02, chunk_s=0.03), margin=1.05).ks)


def test_host_overhead_is_measured_apart_for_plain_and_drafting_steps() -> None:
    # one sequence at acceptance 0.7: with no host overhead the planner drafts (margin 1.05)
    cands = _auto(0.7)
    costs = _costs()
    assert plan_step(cands, costs, margin=1.05).ks[0] > 0
    # a kind not yet measured is priced as the other: a measurement beats the prior
    costs.observe_overhead(0.003, speculative=False)
    assert costs.t_overhead(True) == costs.t_overhead(False) == pytest.approx(0.003)
    # drafting steps measured at 15 ms of host work, plain ones at 1 ms: each kind is priced at its own
    for _ in range(100):
        costs.observe_overhead(0.015, speculative=True)
        costs.observe_overhead(0.001, speculative=False)
    assert costs.t_overhead(True) == pytest.approx(0.015) and costs.t_overhead(False) == pytest.approx(0.001, abs=1e-5)
    plan = plan_step(cands, costs, margin=1.05)
    assert plan.ks == [0]
    best = plan_step(cands, costs, margin=1.0)  # with no margin: the best by the module's formula
    assert best.goodput == pytest.approx(_goodput(cands, best.ks, costs))
    assert all(best.goodput >= _goodput(cands, [k], costs) - 1e-9 for k in range(9))
    # one average of both (what the engine kept before) would have called the same step a draft
    assert plan_step(cands, _costs(overhead_s=0.008), margin=1.05).ks[0] > 0


def test_chunks_streamed_beside_the_step_cost_nothing_until_they_outlast_it() -> None:
    # one sequence, a 20 ms plain step, acceptance just short of paying for a 20 ms draft hop: plain
    cands = _auto(0.6)
    costs = _costs(exchange_s=0.02)
    assert plan_step(cands, costs, margin=1.0).ks == [0]
    # 5 ms of router work per chunk hides beside the step: the plan and its goodput do not move
    # (added to the step instead, it would favour the step that emits more tokens per chunk)
    hidden = plan_step(cands, _costs(exchange_s=0.02, chunk_beside_s=0.005), margin=1.0)
    assert hidden.ks == [0] and hidden.goodput == pytest.approx(plan_step(cands, costs, margin=1.0).goodput)
    assert plan_step(cands, _costs(exchange_s=0.02, chunk_s=0.005), margin=1.0).goodput < hidden.goodput
    # 40 ms per chunk outlasts a plain step but not a drafting one: speculating now pays
    assert plan_step(cands, _costs(exchange_s=0.02, chunk_beside_s=0.04), margin=1.0).ks[0] > 0


def test_explore_k_turns_an_all_plain_plan_into_a_shallow_one() -> None:
    cands = _auto(0.9, n=64) + [StepCandidate(0, 0.9, True)]
    plan = plan_step(cands, _costs(), margin=1.05, explore_k=2)
    assert plan.explored
    assert plan.ks == [2] * 64 + [0]
    # a plan that already speculates is not changed by exploration
    idle = plan_step(_auto(0.9), _costs(), explore_k=2)
    assert not idle.explored and idle.ks[0] >= 4


def test_explorer_asks_after_quiet_steps_and_resets_when_measured() -> None:
    ex = StepExplorer(every_steps=3, k=2)
    auto, costs = _auto(0.9, n=64), _costs()
    asked = []
    for _ in range(8):
        k = ex.explore_k(len(auto))
        asked.append(k)
        ex.record(plan_step(auto, costs, margin=1.05, explore_k=k), auto)
    assert asked == [None, None, None, 2, None, None, None, 2]
    assert ex.explorations == 2
    # steps with nothing adaptive to explore are not counted as missed measurements
    ex2 = StepExplorer(every_steps=1, k=2)
    forced_only = [StepCandidate(0, 0.5, True), StepCandidate(3, 0.5, False)]
    ex2.record(plan_step(forced_only, costs), forced_only)
    assert ex2.explore_k(len(forced_only)) is None
    with pytest.raises(ValueError, match="every_steps"):
        StepExplorer(every_steps=0, k=2)


def test_explorer_backs_off_while_explorations_confirm_plain_and_resets_when_the_planner_drafts() -> None:
    ex = StepExplorer(every_steps=2, k=2, max_every_steps=8)
    auto, costs = _auto(0.9, n=64), _costs()  # 64 sequences: plain wins, only explorations draft
    asked = []
    for _ in range(30):
        k = ex.explore_k(len(auto))
        asked.append(k)
        ex.record(plan_step(auto, costs, margin=1.05, explore_k=k), auto)
    # quiet gaps of 2, 4, 8, then 8 again (capped)
    assert [i for i, k in enumerate(asked) if k] == [2, 7, 16, 25]
    assert ex.interval(64) == 8 and ex.explorations == 4
    # another batch size has not backed off: a quiet spell of every_steps explores there
    assert ex.interval(4) == 2
    # four quiet steps since the last exploration: short of 64's interval, past 4's
    assert ex.explore_k(64) is None and ex.explore_k(4) == 2
    # the planner drafting on its own (one idle sequence at high acceptance) brings the interval back
    # once it has done so for every_steps steps since the last exploration: one burst step does not
    ex.record(plan_step(_auto(0.9), costs), _auto(0.9))
    assert ex.interval(64) == 8
    ex.record(plan_step(_auto(0.9), costs), _auto(0.9))
    assert ex.interval(64) == 2
    # ... and an exploration in between starts that count again
    for _ in range(3):  # two quiet steps, then an exploration
        ex.record(plan_step(auto, costs, margin=1.05, explore_k=ex.explore_k(len(auto))), auto)
    assert ex.interval(64) == 4 and ex.explorations == 5
    ex.record(plan_step(_auto(0.9), costs), _auto(0.9))
    assert ex.interval(64) == 4
    with pytest.raises(ValueError, match="max_every_steps"):
        StepExplorer(every_steps=4, k=2, max_every_steps=2)


def test_policy_config_refuses_a_max_exploration_interval_below_the_first() -> None:
    from pydantic import ValidationError

    from app.policy.decision import PolicyConfig

    with pytest.raises(ValidationError, match="explore_max_every_steps"):
        PolicyConfig(explore_every_steps=128, explore_max_every_steps=64)
    assert PolicyConfig(explore_every_steps=0, explore_max_every_steps=1).explore_every_steps == 0


def test_plain_hold_skips_planning_for_the_same_batch_after_a_plain_plan() -> None:
    from app.policy import PlainHold

    hold = PlainHold(steps=2)
    costs = _costs()
    plain = plan_step(_auto(0.9, n=64), costs, margin=1.05)
    drafting = plan_step(_auto(0.9), costs)
    assert plain.depth == 0 and drafting.depth > 0
    batch = ("a", "b")
    assert not hold.holds(batch)
    hold.record(batch, plain)
    assert [hold.holds(batch) for _ in range(3)] == [True, True, False]  # two steps, then plan again
    hold.record(batch, plain)
    assert not hold.holds(("a", "b", "c"))  # a new sequence joined: plan
    hold.record(batch, drafting)
    assert not hold.holds(batch)  # a drafting plan holds nothing
    assert not PlainHold(steps=0).holds(batch)
    with pytest.raises(ValueError, match="hold steps"):
        PlainHold(steps=-1)
