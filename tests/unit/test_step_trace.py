"""bench/step_trace.py's accountings of a step's wall seconds, on constructed steps."""

from __future__ import annotations

import pytest

from bench.step_trace import goodput, mode_runs


def step(t: float, s: float, tok: int, *, bs: int = 1, new_tok: int = 0, prefill: float = 0.0,
         gap: float | None = 0.0, mode: str | None = "off") -> dict:
    return {"t": t, "s": s, "tok": tok, "bs": bs, "new_tok": new_tok, "prefill": prefill, "gap": gap, "mode": mode}


def test_the_clients_accounting_counts_the_turnaround_and_prefill_the_old_one_left_out() -> None:
    # one request at one stream: a 30-ms turnaround, a 5-ms prefill-only step (its first token), 3 decode steps
    steps = [step(0.035, 0.005, 0, bs=0, new_tok=1, prefill=0.005, gap=0.030, mode=None),
             step(0.040, 0.005, 1), step(0.045, 0.005, 1), step(0.050, 0.005, 1)]
    assert goodput(steps, "clients") == pytest.approx(4 / 0.050)  # every token over the busy wall time
    assert goodput(steps, "old") == pytest.approx(3 / 0.015)  # the turnaround and the prefill were nobody's


def test_a_lull_is_counted_by_neither() -> None:
    steps = [step(1.0, 0.01, 1), step(3.02, 0.01, 1, gap=2.01)]
    assert goodput(steps, "clients") == pytest.approx(2 / 0.02)
    assert goodput(steps, "old") == pytest.approx(2 / 0.02)


def test_mode_runs_split_on_mode_changes_and_keep_prefill_only_steps_in_their_run() -> None:
    steps = [step(0, 0.01, 1), step(0, 0.01, 0, bs=0, mode=None), step(0, 0.01, 4, mode="on"), step(0, 0.01, 1)]
    assert [(m, len(r)) for m, r in mode_runs(steps)] == [("off", 2), ("on", 1), ("off", 1)]
