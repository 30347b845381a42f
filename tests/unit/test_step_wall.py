"""What an engine step stands for in the mode arbiter's goodput (app/policy/step_wall.py)."""

from __future__ import annotations

import pytest

from app.policy.step_wall import StepWall


def test_a_busy_engine_accounts_for_every_second_and_token() -> None:
    """At one stream a request's start is an idle turnaround and a prefill-only step: both belong to
    the next observed step, so the observed steps' seconds add up to the busy wall time."""
    wall = StepWall(idle_s=0.1)
    t, counted_s, counted_tokens = 0.0, 0.0, 0
    for _ in range(5):  # five requests of 10 decode steps at 5 ms, with a 20 ms turnaround and a 4 ms prefill
        t += 0.020 + 0.004
        assert wall.step(t, 0.004, 1, batch_size=0, observed=False) is None  # the prefill: the first token
        for _ in range(10):
            t += 0.005
            tokens, seconds = wall.step(t, 0.005, 1, batch_size=1, observed=True)
            counted_s, counted_tokens = counted_s + seconds, counted_tokens + tokens
    assert counted_tokens == 5 * 11
    assert counted_s == pytest.approx(t - 0.020)  # the first turnaround follows no step


def test_a_lull_is_nobodys_and_drops_what_came_before_it() -> None:
    wall = StepWall(idle_s=0.1)
    assert wall.step(1.0, 0.01, 1, batch_size=1, observed=True) == (1, pytest.approx(0.01))
    assert wall.step(1.02, 0.01, 1, batch_size=0, observed=False) is None  # a prefill, carried...
    # ... but the engine then sits empty for 3 s (a benchmark's pause between cells)
    assert wall.step(4.03, 0.01, 1, batch_size=0, observed=False) is None
    tokens, seconds = wall.step(4.04, 0.01, 1, batch_size=1, observed=True)
    assert (tokens, seconds) == (2, pytest.approx(0.02))  # the last prefill and itself, not the lull


def test_a_gap_as_long_as_a_slow_step_is_the_loops_own_time() -> None:
    """At 32 streams a step takes ~0.1 s and streaming its chunks takes a good part of that."""
    wall = StepWall(idle_s=0.1)
    wall.step(1.0, 0.3, 32, batch_size=32, observed=True)
    assert wall.step(1.55, 0.3, 32, batch_size=32, observed=True)[1] == pytest.approx(0.55)


def test_a_batch_measured_nowhere_takes_its_time_and_the_carry_with_it() -> None:
    wall = StepWall(idle_s=0.1)
    wall.step(1.0, 0.01, 1, batch_size=1, observed=True)
    wall.step(1.01, 0.01, 1, batch_size=0, observed=False)  # a prefill
    wall.step(1.02, 0.01, 2, batch_size=2, observed=False)  # a mixed forced batch, no mode's
    assert wall.step(1.03, 0.01, 2, batch_size=2, observed=True) == (2, pytest.approx(0.01))
