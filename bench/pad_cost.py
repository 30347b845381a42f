"""What padding costs a batched forward on CPU (the embedded pair), and what splitting saves.

    .venv/bin/python -m bench.pad_cost

Rows of a pass are padded to the longest input (app/kv_cache.pack). For batch 2, 8 and 32 rows
with 120 cached tokens each, median of 9 timed forwards: the target with every row at 1 token,
every row at 5, and 1 row of 5 among 1-token rows (a verify pass where one sequence drafts); the
draft with 2-token rows, and one 20-token catch-up among them padded into one pass or run apart
(`ModelRunner.forward(max_padding=)`).
"""

from __future__ import annotations

import random
import statistics
import time

from app.config import ModelSpec
from app.kv_cache import SequenceKV
from app.model_runner import ModelRunner

PAST, REPS = 120, 9


def _median_ms(runner: ModelRunner, lengths: list[int], max_padding: int | None = None) -> float:
    rng = random.Random(0)
    times = []
    for _ in range(REPS):
        caches = []
        for _ in lengths:
            kv = SequenceKV()
            runner.forward([kv], [[rng.randrange(100, 4000) for _ in range(PAST)]])
            caches.append(kv)
        inputs = [[rng.randrange(100, 4000) for _ in range(n)] for n in lengths]
        t0 = time.perf_counter()
        runner.forward(caches, inputs, max_padding=max_padding)
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main() -> None:
    target = ModelRunner(ModelSpec(path="models/target", dtype="float32", device="cpu", num_threads=1))
    draft = ModelRunner(ModelSpec(path="models/draft", dtype="float32", device="cpu", num_threads=1))
    print(f"{'batch':>5} | target ms: all 1  all 5  one 5 | draft ms: all 2  one 20 padded  one 20 apart")
    for b in (2, 8, 32):
        t = [_median_ms(target, n) for n in ([1] * b, [5] * b, [1] * (b - 1) + [5])]
        d = [_median_ms(draft, [2] * b), _median_ms(draft, [2] * (b - 1) + [20]),
             _median_ms(draft, [2] * (b - 1) + [20], max_padding=0)]
        print(f"{b:>5} | {t[0]:14.1f} {t[1]:6.1f} {t[2]:6.1f} | {d[0]:15.1f} {d[1]:14.1f} {d[2]:13.1f}", flush=True)


if __name__ == "__main__":
    main()
