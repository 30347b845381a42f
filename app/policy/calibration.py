"""What a step really costs against what the cost model predicted, per batch size and depth.

The step planner (step_plan.py) predicts a step's time from its parts: a target pass over so many
tokens, `depth` draft steps, the exchange, host time. Each part is measured, but their sum can
still miss the step's wall time in ways that depend on the depth: on a shared 2-core host the
draft's first pass (two tokens fed, sometimes a catch-up), the draft call's hop and the target's
verify contend differently at each depth. Measured at 16 streams on the CPU app without this
feedback, the planner drafted 5-6 deep with one host-cost setting and ~3.3 deep with another, and
lost 5-8 % against a fixed k = 4 both times.

So the engine feeds back, after every planned step, the step's wall time and what the plan said
it would take; the planner multiplies its predicted time for a plan of depth k by the realized /
predicted ratio learned for that (batch-size bucket, k). A depth whose real cost the parts
underestimate grows dearer until the planner leaves it. Depths never chosen take the bucket's
pooled ratio (against measured ones they keep the model's relative cost), and one step in
`probe_every` runs a depth next to the planned one or a plain step, so the neighbours and plain
decoding are measured too and the plan moves by measurement, not by guess.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def batch_bucket(batch_size: int) -> int:
    """1, 2, then the next power of two (3-4 -> 4, 9-16 -> 16): a closed-loop batch wavers by a
    sequence or two (c or c - 1 streams), and each bucket needs enough steps to learn."""
    return 1 << max(batch_size - 1, 0).bit_length()


@dataclass
class _Ratio:
    weighted: float = 0.0  # decayed sum of realized / predicted
    weight: float = 0.0  # decayed count


class StepTimeCalibration:
    """Decaying mean of realized / predicted step time per (batch bucket, depth), shrunk toward
    the bucket's pooled ratio.

    Batch buckets are powers of two (a batch of 9-16 sequences shares the bucket 16): the batch of
    a closed-loop load wavers by a few sequences and each bucket needs enough steps to learn.
    Used from the engine loop's thread only (plan and feedback both run there)."""

    def __init__(self, half_life_steps: float = 64.0, prior_steps: float = 2.0, max_factor: float = 4.0,
                 probe_every: int = 8) -> None:
        if half_life_steps <= 0 or prior_steps <= 0 or max_factor <= 1 or probe_every < 0:
            raise ValueError(f"calibration needs half_life_steps > 0, prior_steps > 0, max_factor > 1 and "
                             f"probe_every >= 0; got {half_life_steps}, {prior_steps}, {max_factor}, {probe_every}")
        self._lambda = 0.5 ** (1.0 / half_life_steps)
        self.prior_steps, self.max_factor, self.probe_every = prior_steps, max_factor, probe_every
        self._ratios: dict[tuple[int, int], _Ratio] = {}
        self._steps = 0
        self.probes = 0

    def probe_depth(self, depth: int, max_depth: int) -> int | None:
        """Every `probe_every`-th speculative plan, another depth to run instead, else None: in a
        cycle of four probes one shallower, one deeper, one shallower, then a plain step (depth 0).
        Pooling makes an unmeasured depth look like its measured neighbour *relative to the
        model*; only a step at that depth can say it is really cheaper or dearer, so the
        neighbours and plain decoding are kept measured, at a small cost (one step in probe_every
        at a depth next to the best): a replica that speculates at every step would otherwise
        never measure what a plain step of its batch really costs."""
        if depth <= 0 or not self.probe_every:
            return None
        self._steps += 1
        if self._steps % self.probe_every:
            return None
        self.probes += 1
        turn = self.probes % 4
        if turn == 0:
            return 0
        shallower = (turn != 2 and depth > 1) or depth >= max_depth
        probe = depth - 1 if shallower else depth + 1
        return probe if 0 <= probe <= max_depth and probe != depth else None

    bucket = staticmethod(batch_bucket)

    def observe(self, batch: int, depth: int, predicted_s: float, realized_s: float) -> None:
        """One step: a plan of `depth` (0: plain) for `batch` sequences, predicted vs measured seconds."""
        if batch <= 0 or depth < 0 or not (predicted_s > 0 and realized_s > 0):
            return
        if not (math.isfinite(predicted_s) and math.isfinite(realized_s)):
            return
        ratio = min(max(realized_s / predicted_s, 1.0 / self.max_factor), self.max_factor)
        r = self._ratios.setdefault((self.bucket(batch), depth), _Ratio())
        r.weighted = r.weighted * self._lambda + ratio
        r.weight = r.weight * self._lambda + 1.0

    def factor(self, batch: int, depth: int) -> float:
        """Realized / predicted for plans of `depth` at this batch size. A depth not measured yet
        takes the bucket's pooled ratio (1 for a bucket never measured), and a measured one is
        shrunk toward it: part of the error is common to every plan of a step (the engine's host
        time, say), and a depth must not look cheaper or dearer than its neighbours only because
        they were measured and it was not."""
        bucket = self.bucket(batch)
        entries = [(d, r) for (b, d), r in self._ratios.items() if b == bucket]
        if not entries:
            return 1.0
        pooled = sum(r.weighted for _, r in entries) / sum(r.weight for _, r in entries)
        r = self._ratios.get((bucket, depth))
        if r is None:
            return pooled
        return (r.weighted + self.prior_steps * pooled) / (r.weight + self.prior_steps)

    def factors(self, batch: int, max_depth: int) -> list[float]:
        """factor(batch, d) for d = 0..max_depth (what the planner reads for one step)."""
        return [self.factor(batch, d) for d in range(max_depth + 1)]

    def snapshot(self) -> dict[str, float]:
        """'b16/k4' -> factor, for logs and routing stats."""
        return {f"b{b}/k{k}": round(self.factor(b, k), 4) for (b, k) in sorted(self._ratios)}
