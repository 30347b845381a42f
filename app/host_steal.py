"""CPU time the hypervisor stole from this machine: the one part of a shared VM host's slowdown the
guest can see.

On the 2-core CPU host (a Firecracker VM) one fixed policy's back-to-back benchmark cells spread at
CV 0.08-0.12 with the app's own CPU seconds constant; the share of the machine's CPU time stolen in
each cell explained three quarters of that spread (r = -0.87 over 14 cells, ~1.4 % of goodput lost
per point of steal; `bench.load` records each cell's steal). So measurements that compare two things in time
(a benchmark's cells, the mode arbiter's probe against the leader around it) read steal alongside
and refuse comparisons across which it moved.

Linux /proc/stat only; elsewhere the readings are None and nothing is refused.
"""

from __future__ import annotations

import time
from collections.abc import Callable

_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def host_cpu_jiffies(path: str = "/proc/stat") -> dict[str, int] | None:
    """The machine's CPU time so far, all cores, by kind (clock ticks); None where unreadable."""
    try:
        with open(path) as f:
            values = [int(v) for v in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    return dict(zip(_FIELDS, values)) if len(values) == len(_FIELDS) else None


def steal_share(before: dict[str, int] | None, after: dict[str, int] | None) -> float | None:
    """Share of all CPU time between two readings that was stolen (None without both readings, or
    when no tick passed between them)."""
    if before is None or after is None:
        return None
    total = sum(after[k] - before[k] for k in _FIELDS)
    return (after["steal"] - before["steal"]) / total if total > 0 else None


class StealMeter:
    """Stolen and total CPU ticks since the previous reading, for callers that account steal per step.

    Reads /proc/stat at most every `min_interval_s`: the kernel counts in 10-ms ticks, so a read per
    engine step (every 4-10 ms at one stream) mostly finds nothing new, and at ~30-150 us a read it
    costs 0.3-4 % of the engine thread there (measured with py-spy). A call in between
    returns (0, 0) and the ticks go to the next reading's step: the sums over a probe's window (a
    second or more) are the same."""

    def __init__(self, read: Callable[[], dict[str, int] | None] = host_cpu_jiffies,
                 clock: Callable[[], float] = time.monotonic, min_interval_s: float = 0.05) -> None:
        self._read, self._clock, self._min_interval_s = read, clock, min_interval_s
        self._last = read()
        self._last_t = clock()

    def since_last(self) -> tuple[int, int]:
        """(stolen ticks, all ticks) since the previous reading; (0, 0) between readings and where
        /proc/stat is unreadable."""
        now_t = self._clock()
        if now_t - self._last_t < self._min_interval_s:
            return 0, 0
        now = self._read()
        last, self._last, self._last_t = self._last, now, now_t
        if now is None or last is None:
            return 0, 0
        return now["steal"] - last["steal"], sum(now[k] - last[k] for k in _FIELDS)
