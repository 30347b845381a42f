"""bench.load's verdict from measured cells: medians per policy, and the paired reading (auto over the
better fixed policy within each round, then the mean over rounds)."""

from __future__ import annotations

import pytest

from bench.load import Cell, verdict


def cell(policy: str, c: int, rnd: int, goodput: float) -> Cell:
    return Cell(policy=policy, concurrency=c, seconds=16.0, tokens=int(goodput * 16), goodput_tok_s=goodput,
                completed=10, failed=0, latency_p50_s=0.3, latency_p99_s=0.4, acceptance_rate=None, round=rnd)


def test_paired_ratio_follows_each_round_while_medians_mix_rounds() -> None:
    # round 0: on wins (100 vs 80), auto 99; round 1: the host is slower, off wins (60 vs 50), auto 57
    cells = [cell("on", 2, 0, 100.0), cell("off", 2, 0, 80.0), cell("auto", 2, 0, 99.0),
             cell("on", 2, 1, 50.0), cell("off", 2, 1, 60.0), cell("auto", 2, 1, 57.0)]
    level = verdict(cells, [2])["levels"][0]
    assert level["paired_mean"] == pytest.approx((0.99 + 0.95) / 2, abs=1e-3)
    assert level["paired_se"] == pytest.approx(0.02, abs=1e-3)  # sd 0.0283 over sqrt(2) rounds
    assert level["auto_over_best_fixed"] == pytest.approx(78.0 / 75.0, abs=1e-3)  # medians: 75, 70, 78


def test_a_round_missing_a_policy_is_left_out_of_the_paired_mean() -> None:
    cells = [cell("on", 4, 0, 100.0), cell("off", 4, 0, 80.0), cell("auto", 4, 0, 97.0), cell("on", 4, 1, 10.0)]
    level = verdict(cells, [4])["levels"][0]
    assert level["paired_mean"] == pytest.approx(0.97)
    assert level["paired_se"] is None  # one complete round: no spread to estimate


def test_auto_mode_is_read_from_its_drafting_steps_not_its_requests() -> None:
    """Every auto request drafted a little (exploration) but 3 % of its steps drafted: auto ran 'off'."""
    auto = cell("auto", 1, 0, 99.0)
    auto.reasons, auto.drafted_requests, auto.drafts, auto.steps = {"low_acceptance": 10}, 10, 30, 1000
    level = verdict([cell("on", 1, 0, 90.0), cell("off", 1, 0, 100.0), auto], [1])["levels"][0]
    assert (level["auto_mostly"], level["better_fixed"]) == ("off", "off")
    auto.drafts = 700  # now most steps drafted
    assert verdict([cell("on", 1, 0, 90.0), cell("off", 1, 0, 100.0), auto], [1])["levels"][0]["auto_mostly"] == "on"
