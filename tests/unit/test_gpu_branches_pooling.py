"""bench.gpu_branches pools a row's calls under several coin seeds: counts add, rates come from the sums."""

from __future__ import annotations

from bench.inproc.fast_decode import SpecStats
from bench.gpu_branches import pooled


def test_pooled_stats_add_counts_and_widths() -> None:
    a = SpecStats(passes=10, drafted=30, accepted=20, checked=28, guesses=4, guesses_right=3, restarts=2,
                  branch_tries=5, branch_hits=2, widths={3: 8, 0: 2})
    b = SpecStats(passes=6, drafted=18, accepted=6, checked=12, restarts=4, branch_tries=3, branch_hits=3,
                  widths={3: 6})
    p = pooled([a, b])
    assert (p.passes, p.drafted, p.accepted, p.checked, p.guesses, p.guesses_right) == (16, 48, 26, 40, 4, 3)
    assert (p.restarts, p.branch_tries, p.branch_hits) == (6, 8, 5)
    assert p.widths == {3: 14, 0: 2}
    # the pooled acceptance weighs each call by what it compared, not each call equally
    assert p.per_token_acceptance == (26 + 3) / (40 + 4)
    assert p.per_token_acceptance != (a.per_token_acceptance + b.per_token_acceptance) / 2
    assert a.widths == {3: 8, 0: 2}  # the inputs are left alone


def test_pooled_of_one_call_is_that_call() -> None:
    a = SpecStats(passes=3, drafted=6, accepted=4, checked=5, widths={2: 3})
    assert pooled([a]) == a
