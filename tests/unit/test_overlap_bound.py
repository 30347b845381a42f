"""The exact overlap model (bench.overlap_bound) against the loop's sampled cost model and hand cases."""

from __future__ import annotations

import pytest

from bench.inproc.fast_decode import predicted_tokens_per_second
from bench.overlap_bound import (PassCosts, accepted_distribution, best_overlapped, overlapped_ms_per_token,
                                 sequential_ms_per_token)

# step costs shaped like the H200 session-8 run (ms): decode 4.72, verify ~5.0, int8 draft 0.93
COSTS = PassCosts(t_verify={1: 4.72, 2: 4.99, 3: 5.0, 4: 5.0, 5: 5.02, 6: 5.03, 7: 5.04, 8: 5.04, 9: 5.04},
                  t_draft=0.93, t_pair_extra=0.35)


@pytest.mark.parametrize("alpha,k,steps", [(0.5, 2, 3), (0.7, 3, 4), (0.7, 4, 5), (0.9, 5, 6), (0.9, 7, 2)])
def test_exact_chain_matches_the_sampled_cost_model(alpha: float, k: int, steps: int) -> None:
    exact = overlapped_ms_per_token(alpha, k, steps, COSTS)
    sampled = 1 / predicted_tokens_per_second(alpha, k, steps, COSTS.t_draft, COSTS.t_verify, n_tokens=200_000)
    assert exact == pytest.approx(sampled, rel=0.01)


def test_sequential_pass_costs_its_parts_over_expected_tokens() -> None:
    alpha, k = 0.7, 3
    expected_tokens = (1 - alpha ** (k + 1)) / (1 - alpha)
    assert sum(accepted_distribution(alpha, k)) == pytest.approx(1.0)
    assert sequential_ms_per_token(alpha, k, COSTS) == pytest.approx((3 * 0.93 + 0.35 + 5.0) / expected_tokens)


def test_a_free_draft_is_never_slower_and_a_sure_branch_never_restarts() -> None:
    alpha, k, steps = 0.7, 4, 5
    # 5 steps of 0.93 ms hide inside a 5 ms verify; at 1.2 ms (a bf16 draft) they do not
    slow_draft = PassCosts(t_verify=COSTS.t_verify, t_draft=1.2)
    assert overlapped_ms_per_token(alpha, k, steps, COSTS, draft_free=True) == pytest.approx(
        overlapped_ms_per_token(alpha, k, steps, COSTS))
    assert overlapped_ms_per_token(alpha, k, steps, slow_draft, draft_free=True) < overlapped_ms_per_token(
        alpha, k, steps, slow_draft)
    # branch_hit = 1: every pass leaves k ready, so each pass is a full verify of k proposals
    expected_tokens = (1 - alpha ** (k + 1)) / (1 - alpha)
    assert overlapped_ms_per_token(alpha, k, steps, COSTS, draft_free=True, branch_hit=1.0) == pytest.approx(
        COSTS.t_verify[k + 1] / expected_tokens)


def test_pre_verify_charges_the_wait_even_with_a_free_draft() -> None:
    # alpha = 0: every pass restarts; with a wait of 2 the target idles 2 draft steps, verifies 2
    # proposals (both rejected) and emits one token
    ms = overlapped_ms_per_token(0.0, 3, 5, COSTS, draft_free=True, restart_wait=2)
    assert ms == pytest.approx(2 * COSTS.t_draft + COSTS.t_verify[3])


def test_best_overlapped_picks_the_cheapest_choice() -> None:
    ms, k, steps = best_overlapped(0.7, COSTS, max_k=5)
    assert ms == pytest.approx(overlapped_ms_per_token(0.7, k, steps, COSTS))
    assert all(ms <= overlapped_ms_per_token(0.7, kk, 5, COSTS) + 1e-12 for kk in range(1, 6))


def test_branches_help_only_as_far_as_their_rows_are_paid_for() -> None:
    plain = overlapped_ms_per_token(0.7, 4, 5, COSTS)
    free = overlapped_ms_per_token(0.7, 4, 5, COSTS, branch_hit=0.5)
    paid = overlapped_ms_per_token(0.7, 4, 5, COSTS, branch_hit=0.5, branch_step_extra=0.35)
    assert free < paid and free < plain
    # a branch that never hits is pure cost, and a free one that never hits changes nothing
    assert overlapped_ms_per_token(0.7, 4, 5, COSTS, branch_hit=0.0, branch_step_extra=0.35) == pytest.approx(plain)


def _sampled_branching_ms_per_token(alpha: float, beta: float, k: int, steps_cap: int, rows: int,
                                    n_passes: int = 200_000, seed: int = 1) -> float:
    """bench/inproc/fast_branches.branching_generate's rules, sampled pass by pass on the costs above: which
    judged indices get a branch row (from the start, or the bonus after the first step), what an
    adopted branch holds (the steps it drafted), and that the draft's steps bound the pass."""
    import random

    rng = random.Random(seed)
    ready, ms, tokens = 0, 0.0, 0
    for _ in range(n_passes):
        p = min(k, ready)
        steps = min(steps_cap, max(1, k + 2 - (ready - p)))
        forks = {i: steps for i in range(min(p + 1, ready, rows))}  # judged index -> steps its branch drafts
        if ready == p and len(forks) < rows:
            forks[p] = steps - 1
        ms += max(COSTS.t_verify[p + 1], steps * COSTS.t_draft)
        chain = ready + steps
        a = 0
        while a < p and rng.random() < alpha:
            a += 1
        tokens += a + 1
        if a == p and rng.random() < alpha:  # all accepted and the bonus guessed
            ready = chain - (a + 1)
        elif a in forks and rng.random() < beta:  # the branch started from the correction
            ready = forks[a]
        else:
            ready = 0
    return ms / tokens


@pytest.mark.parametrize("alpha,beta,k,steps,rows", [(0.7, 0.5, 4, 3, 5), (0.7, 0.5, 4, 5, 2), (0.5, 0.8, 3, 2, 4),
                                                     (0.9, 0.4, 6, 4, 7)])
def test_the_built_branching_loop_matches_its_sampled_rules(alpha, beta, k, steps, rows) -> None:
    exact = overlapped_ms_per_token(alpha, k, steps, COSTS, branch_hit=beta, branch_rows=rows)
    assert exact == pytest.approx(_sampled_branching_ms_per_token(alpha, beta, k, steps, rows), rel=0.01)
    # fewer rows, or branches only as deep as they drafted, never beat the session-10 what-if
    assert exact >= overlapped_ms_per_token(alpha, k, steps, COSTS, branch_hit=beta) - 1e-12
