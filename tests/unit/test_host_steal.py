"""Host CPU steal (app/host_steal.py) and bench.load's steal gate: cells run while the hypervisor
stole more than --max-steal of the machine are re-run, the least-stolen attempt kept."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

import pytest

import bench.load
from app.host_steal import StealMeter, host_cpu_jiffies, steal_share
from bench.load import Cell, run_gated_cell


def test_reads_proc_stat_and_the_stolen_share(tmp_path: Path) -> None:
    stat = tmp_path / "stat"
    stat.write_text("cpu  100 0 50 800 0 0 0 50 0 0\ncpu0 50 0 25 400 0 0 0 25 0 0\n")
    before = host_cpu_jiffies(str(stat))
    assert before == {"user": 100, "nice": 0, "system": 50, "idle": 800, "iowait": 0, "irq": 0, "softirq": 0,
                      "steal": 50}
    stat.write_text("cpu  200 0 70 860 0 0 0 70 0 0\n")
    after = host_cpu_jiffies(str(stat))
    assert steal_share(before, after) == pytest.approx(20 / 200)  # 200 ticks passed, 20 of them stolen
    assert host_cpu_jiffies(str(tmp_path / "missing")) is None
    assert steal_share(None, after) is None and steal_share(after, after) is None  # no reading, no tick


def test_the_meter_gives_ticks_since_its_previous_call() -> None:
    readings = iter([{"user": 0, "nice": 0, "system": 0, "idle": 0, "iowait": 0, "irq": 0, "softirq": 0, "steal": 0},
                     {"user": 80, "nice": 0, "system": 10, "idle": 0, "iowait": 0, "irq": 0, "softirq": 0, "steal": 10},
                     None])
    meter = StealMeter(read=lambda: next(readings), min_interval_s=0.0)
    assert meter.since_last() == (10, 100)
    assert meter.since_last() == (0, 0)  # unreadable: nothing to refuse


def test_the_meter_reads_at_most_every_min_interval_and_loses_no_tick() -> None:
    reads: list[int] = []

    def read() -> dict[str, int]:
        reads.append(1)
        n = len(reads)  # each reading: 10 more ticks, 1 more of them stolen
        return {"user": 9 * n, "nice": 0, "system": 0, "idle": 0, "iowait": 0, "irq": 0, "softirq": 0, "steal": n}

    t = [0.0]
    meter = StealMeter(read=read, clock=lambda: t[0], min_interval_s=0.045)
    got = []
    for _ in range(10):  # engine steps every 10 ms
        t[0] += 0.01
        got.append(meter.since_last())
    assert len(reads) == 3  # at construction, then at 50 and 100 ms only (45 ms apart at least)
    assert got[:4] == [(0, 0)] * 4 and got[4] == (1, 10) and got[9] == (1, 10)
    assert sum(s for s, _ in got) == 2 and sum(a for _, a in got) == 20  # every tick read lands in some step


def _cell(policy: str, steal: float, goodput: float) -> Cell:
    return Cell(policy=policy, concurrency=4, seconds=10.0, tokens=int(goodput * 10), goodput_tok_s=goodput,
                completed=5, failed=0, latency_p50_s=0.5, latency_p99_s=0.6, acceptance_rate=None, host_steal=steal)


def _args(max_steal: float | None, retries: int = 3) -> argparse.Namespace:
    return argparse.Namespace(max_steal=max_steal, steal_retries=retries, warmup=0.0, duration=1.0, max_tokens=8)


def _run(monkeypatch: pytest.MonkeyPatch, steals: list[float], args: argparse.Namespace) -> tuple[Cell, list[Cell]]:
    attempts = iter(_cell("on", s, 100.0 - 100 * s) for s in steals)

    async def fake_run_cell(*_a, **_k) -> Cell:
        return next(attempts)

    async def no_wait(_url: str) -> None:
        return None

    monkeypatch.setattr(bench.load, "run_cell", fake_run_cell)
    monkeypatch.setattr(bench.load, "wait_idle", no_wait)
    discarded: list[Cell] = []
    kept = asyncio.run(run_gated_cell("http://127.0.0.1:1", "on", 4, args, 0, discarded))
    return kept, discarded


def test_a_stolen_cell_is_run_again_until_quiet(monkeypatch: pytest.MonkeyPatch) -> None:
    kept, discarded = _run(monkeypatch, [0.10, 0.06, 0.01, 0.0], _args(0.03))
    assert kept.host_steal == 0.01 and kept.attempt == 2
    assert [c.host_steal for c in discarded] == [0.10, 0.06]


def test_retries_are_capped_and_the_least_stolen_attempt_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    kept, discarded = _run(monkeypatch, [0.10, 0.05, 0.08], _args(0.03, retries=2))
    assert kept.host_steal == 0.05 and kept.attempt == 1
    assert sorted(c.host_steal for c in discarded) == [0.08, 0.10]


def test_without_a_gate_the_first_cell_stands(monkeypatch: pytest.MonkeyPatch) -> None:
    kept, discarded = _run(monkeypatch, [0.20, 0.0], _args(None))
    assert kept.host_steal == 0.20 and discarded == []
