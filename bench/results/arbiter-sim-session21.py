"""Session 21: the mode arbiter's defaults on simulated one-stream steps (bench/RESULTS.md section 7).

One stream, 8 auto cells of 16 s with 40 s between them; each mode has a true goodput, an 'on' step
makes 1-5 tokens (uniform) in k / goodput seconds * U(0.8, 1.2), a plain step 1 token in
1 / goodput * U(0.7, 1.3). Prints auto's goodput over the best mode's, mean and minimum over 20 seeds.
Run: .venv/bin/python bench/results/arbiter-sim-session21.py
"""

import random
import statistics

from app.policy import ModeArbiter, ModeArbiterConfig


class Clock:
    t = 1000.0

    def __call__(self) -> float:
        return self.t


def sim(truth: dict[str, float], seed: int, cells: int = 8, cell_s: float = 16.0, gap_s: float = 40.0) -> float:
    rnd, clock = random.Random(seed), Clock()
    arb = ModeArbiter(ModeArbiterConfig(), clock=clock)
    got = tot = 0.0
    for _ in range(cells):
        end = clock.t + cell_s
        while clock.t < end:
            m = arb.mode(1)
            if m == "on":
                k = rnd.choice([1, 2, 3, 4, 5])
                dt = k / truth[m] * rnd.uniform(0.8, 1.2)
            else:
                k, dt = 1, 1 / truth[m] * rnd.uniform(0.7, 1.3)
            clock.t += dt
            arb.observe(1, m, k, dt)
            got, tot = got + k, tot + dt
        clock.t += gap_s
    return got / tot / max(truth.values())


if __name__ == "__main__":
    for truth in ({"plan": 100, "on": 95, "off": 100}, {"plan": 95, "on": 100, "off": 90},
                  {"plan": 100, "on": 110, "off": 92}, {"plan": 100, "on": 100, "off": 100}):
        rs = [sim(truth, s) for s in range(20)]
        print(truth, f"auto / best mode: mean {statistics.mean(rs):.3f}, min {min(rs):.3f}")
