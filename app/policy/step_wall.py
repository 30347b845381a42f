"""The wall seconds an engine step stands for, as the mode arbiter measures goodput with them.

The arbiter (mode_arbiter.py) compares modes by output tokens over wall seconds, and its verdict is
only as good as the agreement of those seconds with what a client sees. Counting only a step's
own time less its newcomers' prefill, plus the loop's short gap before it, leaves a step that only
prefilled (the engine held no running sequence) and the idle turnaround before it counted nowhere.
At one stream that is every request's start: ~11 ms a request uncounted under forced 'off' and
~35 ms under forced 'on' (2-core CPU: the arbiter's windows put 'on' at 0.988 of 'off' where the
benchmark's cells measured 0.935), so probes of the drafting modes looked better than they were,
and auto ran them for 12 % of its time at one stream.

So every second of a busy engine, and every token it emits, is some observed step's: a step's own
time (its prefill included) and tokens (its newcomers' first ones included), the loop's gap before
it when short (streaming, the next request's turnaround at low load), and a prefill-only step's
time and tokens carried to the next observed step: what the benchmark's cells count. Only a lull, an idle gap
longer than `max(idle_s, the step's own time)`, is nobody's: the engine sat empty (a client's think
time, a benchmark's pause between cells), which no mode is to blame for.

A step trace (every engine step's times and tokens, 2-core CPU, 1/2/4 streams) checked it against
the clients: over every cell this accounting gives the clients' goodput to within 0.2 %, while the
one above without prefill-only steps and turnarounds reads forced 'off' 5-7 % high at 1 and 2
streams (the turnaround of a lockstep batch, where every sequence ends on one step, and its prefill
go uncounted) and forced 'on' 1-3 % high, mode against mode not alike.

Ray-free; the target server calls `step` once per engine step with the loop's clock.
"""

from __future__ import annotations


class StepWall:
    def __init__(self, idle_s: float = 0.1, last_end: float | None = None) -> None:
        self.idle_s = idle_s  # a longer idle gap before a step is a lull, not the step's
        self._last_end = last_end  # when the step before ended (None: no step yet, no gap)
        # tokens and seconds of prefill-only steps (and the turnaround before them) not yet counted
        self._carry_tokens, self._carry_s = 0, 0.0

    def step(self, now: float, step_s: float, tokens: int, *, batch_size: int,
             observed: bool) -> tuple[int, float] | None:
        """One engine step that ended at `now`, ran `step_s` seconds (prefill included) and emitted
        `tokens` (newcomers' first tokens included), with `batch_size` running sequences before its
        newcomers; `observed`: its goodput is measured. Returns the (tokens, wall seconds) it stands
        for when observed, else None."""
        gap = now - self._last_end - step_s if self._last_end is not None else 0.0
        self._last_end = now
        lull = gap > max(self.idle_s, step_s)
        wall = step_s + (gap if gap >= 0.0 and not lull else 0.0)
        if lull:  # the engine emptied: what it did before the lull is no later step's
            self._carry_tokens, self._carry_s = 0, 0.0
        if not observed:
            # a step that only prefilled newcomers is part of the next step's cost; a batch that is
            # measured nowhere (a mixed forced batch) takes its time with it
            if batch_size == 0:
                self._carry_tokens, self._carry_s = self._carry_tokens + tokens, self._carry_s + wall
            else:
                self._carry_tokens, self._carry_s = 0, 0.0
            return None
        out = (tokens + self._carry_tokens, wall + self._carry_s)
        self._carry_tokens, self._carry_s = 0, 0.0
        return out
