"""bench.load's verdict from measured cells: medians per policy, and the paired reading (auto over the
level's better fixed policy within each round, then the mean over rounds); reports pooled into one."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest

from bench.load import Cell, plot, pooled_cells, verdict


def cell(policy: str, c: int, rnd: int, goodput: float) -> Cell:
    return Cell(policy=policy, concurrency=c, seconds=16.0, tokens=int(goodput * 16), goodput_tok_s=goodput,
                completed=10, failed=0, latency_p50_s=0.3, latency_p99_s=0.4, acceptance_rate=None, round=rnd)


def test_the_paired_ratio_divides_by_the_levels_better_fixed_policy_in_every_round() -> None:
    # round 0: on wins (100 vs 80), auto 99; round 1: off wins (60 vs 50), auto 57. The medians make
    # 'on' the better fixed policy (75 vs 70): auto is paired with 'on' in both rounds, not with the
    # better of the two in each (an oracle no fixed choice is)
    cells = [cell("on", 2, 0, 100.0), cell("off", 2, 0, 80.0), cell("auto", 2, 0, 99.0),
             cell("on", 2, 1, 50.0), cell("off", 2, 1, 60.0), cell("auto", 2, 1, 57.0)]
    level = verdict(cells, [2])["levels"][0]
    assert level["better_fixed"] == "on"
    assert level["paired_mean"] == pytest.approx((0.99 + 1.14) / 2, abs=1e-3)
    assert level["paired_se"] == pytest.approx(0.075, abs=1e-3)  # sd 0.106 over sqrt(2) rounds
    assert level["auto_over_best_fixed"] == pytest.approx(78.0 / 75.0, abs=1e-3)  # medians: 75, 70, 78


def test_the_target_is_read_on_the_medians_and_on_the_paired_rounds_apart() -> None:
    # the host's speed moves from round to round (on: 100, 60, 80 tok/s). Auto is 1.00, 1.00 and 0.95
    # of 'on' round by round (paired 0.983, within 3 %), but its median cell (76) is the slow round's
    # and the median of 'on' (80) another's: 0.95 on the medians. Each reading gives its own verdict
    cells = [cell(p, 8, r, g) for r, (on, off, auto) in enumerate([(100.0, 70.0, 100.0), (60.0, 40.0, 60.0),
                                                                   (80.0, 60.0, 76.0)])
             for p, g in (("on", on), ("off", off), ("auto", auto))]
    v = verdict(cells, [8])
    assert v["levels"][0]["auto_over_best_fixed"] == pytest.approx(0.95)
    assert v["levels"][0]["paired_mean"] == pytest.approx((1.0 + 1.0 + 0.95) / 3, abs=1e-3)
    assert v["auto_within_3pct_everywhere"] is False and v["auto_within_3pct_everywhere_paired"] is True
    assert v["auto_above_both_somewhere_paired"] is False
    cells[-1].goodput_tok_s = 70.0  # round 2 at 0.875 of 'on': paired 0.958 fails too
    assert verdict(cells, [8])["auto_within_3pct_everywhere_paired"] is False
    cells[2].goodput_tok_s = cells[5].goodput_tok_s = 110.0  # rounds 0 and 1 well above 'on'
    v = verdict(cells, [8])
    assert v["auto_above_both_somewhere_paired"] is True and v["levels"][0]["paired_mean"] > 1.0


def test_a_round_missing_a_policy_is_left_out_of_the_paired_mean() -> None:
    cells = [cell("on", 4, 0, 100.0), cell("off", 4, 0, 80.0), cell("auto", 4, 0, 97.0), cell("on", 4, 1, 120.0)]
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


def report(path: Path, cells: list[Cell], **config) -> str:
    cfg = {"levels": [2], "max_tokens": 64, "policy_overrides": {}, "duration_s": 16.0, "warmup_s": 3.0,
           "rounds": 1, **config}
    path.write_text(json.dumps({"commit": "abc", "date": "d", "config": cfg, "cells": [asdict(c) for c in cells]}))
    return str(path)


def two_sweeps(tmp_path: Path) -> list[str]:
    """Two reports of one round each (both numbered 0), the second on a host half as fast."""
    return [report(tmp_path / "a.json", [cell("on", 2, 0, 100.0), cell("off", 2, 0, 80.0), cell("auto", 2, 0, 99.0)]),
            report(tmp_path / "b.json", [cell("on", 2, 0, 50.0), cell("off", 2, 0, 40.0), cell("auto", 2, 0, 52.0)])]


def test_pooled_reports_keep_their_rounds_apart(tmp_path: Path) -> None:
    # each report has a round 0; pooled, they are two rounds, so auto pairs with its own sweep's cells
    cells, levels = pooled_cells(two_sweeps(tmp_path))
    assert levels == [2] and sorted({c.round for c in cells}) == [0, 1]
    level = verdict(cells, levels)["levels"][0]
    assert level["paired_mean"] == pytest.approx((0.99 + 1.04) / 2, abs=1e-3)
    assert level["rounds"] == 2


def test_reports_of_different_setups_are_not_pooled(tmp_path: Path) -> None:
    a = report(tmp_path / "a.json", [cell("on", 2, 0, 100.0)])
    b = report(tmp_path / "b.json", [cell("on", 2, 0, 100.0)], policy_overrides={"margin": 1.2})
    with pytest.raises(SystemExit, match="pool only sweeps of one setup"):
        pooled_cells([a, b])


def test_the_plot_is_drawn_from_pooled_cells(tmp_path: Path) -> None:
    out = tmp_path / "load.png"
    plot(*pooled_cells(two_sweeps(tmp_path)), out, "pooled")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_level_where_no_request_ended_inside_a_window_has_no_latency_not_zero(tmp_path: Path) -> None:
    """Run CJ, 32 streams 'off': every request outlasted its 10-s window, and the plot drew p50 = 0 s."""
    from bench.load import summarize

    slow = [Cell(policy="off", concurrency=32, seconds=10.0, tokens=2500, goodput_tok_s=250.0, completed=0,
                 failed=0, latency_p50_s=None, latency_p99_s=None, acceptance_rate=None, round=r) for r in (0, 1)]
    cells = slow + [cell("on", 32, r, 350.0) for r in (0, 1)] + [cell("auto", 32, r, 340.0) for r in (0, 1)]
    summary = summarize(cells, [32])
    assert summary[(32, "off")]["latency_p50_s"] is None and summary[(32, "off")]["latency_p99_s"] is None
    assert summary[(32, "on")]["latency_p50_s"] == 0.3
    plot(cells, [32], tmp_path / "load.png", "a gap, not a zero")  # draws the gap
    assert (tmp_path / "load.png").stat().st_size > 0


def test_the_gpu_target_reads_every_round_and_counts_the_loads_auto_is_above_both() -> None:
    """auto >= 0.97x the better fixed policy at every load on the medians and in every round, and above
    both fixed policies at two loads or more."""
    rounds = {1: [(100.0, 80.0, 104.0), (100.0, 80.0, 106.0)],   # auto above both at 1 stream
              4: [(200.0, 190.0, 210.0), (200.0, 190.0, 205.0)],  # and at 4
              16: [(300.0, 320.0, 318.0), (300.0, 320.0, 300.0)]}  # medians 309 / 320 = 0.966: missed
    cells = [cell(p, c, r, g) for c, rs in rounds.items() for r, trio in enumerate(rs)
             for p, g in zip(("on", "off", "auto"), trio)]
    v = verdict(cells, [1, 4, 16])
    assert v["levels_auto_above_both"] == [1, 4] and v["auto_above_both_at_2_levels"] is True
    assert v["levels"][2]["round_ratios"] == [pytest.approx(318 / 320, abs=1e-3), pytest.approx(300 / 320, abs=1e-3)]
    assert v["auto_within_3pct_everywhere"] is False and v["auto_within_3pct_every_round"] is False
    assert v["target_met"] is False
    cells[-1].goodput_tok_s = 316.0  # round 1 at 0.9875: medians 317 / 320 and every round within 3 %
    v = verdict(cells, [1, 4, 16])
    assert v["auto_within_3pct_everywhere"] and v["auto_within_3pct_every_round"] and v["target_met"]
    cells[2].goodput_tok_s = cells[5].goodput_tok_s = 99.0  # auto just below 'on' at 1 stream: above both at 4 only
    v = verdict(cells, [1, 4, 16])
    assert v["levels_auto_above_both"] == [4] and not v["auto_above_both_at_2_levels"] and not v["target_met"]


def test_mixed_traffic_cells_are_summarised_per_prompt_class() -> None:
    from bench.load import summarize

    a, b = cell("auto", 4, 0, 100.0), cell("auto", 4, 1, 90.0)
    a.by_class = {"code": {"requests": 6, "drafted_requests": 6, "drafted": 40, "accepted": 24},
                  "prose": {"requests": 6, "drafted_requests": 1, "drafted": 4, "accepted": 1}}
    b.by_class = {"code": {"requests": 4, "drafted_requests": 3, "drafted": 20, "accepted": 12},
                  "prose": {"requests": 4}}
    row = summarize([a, b], [4])[(4, "auto")]
    assert row["by_class"] == {"code": {"requests": 10, "drafted_share": 0.9, "acceptance_rate": 0.6},
                               "prose": {"requests": 10, "drafted_share": 0.1, "acceptance_rate": 0.25}}
    assert "by_class" not in summarize([cell("on", 4, 0, 1.0)], [4])[(4, "on")]  # one-class traffic: none
