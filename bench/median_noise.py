"""How often would a policy *identical* to the better fixed one pass #4's median test on this host?

The sweep (bench/load.py) compares, per level, the median over rounds of auto's goodput with the
median of the better fixed policy's, and asks for >= 0.97 at every level. The host's goodput moves
between cells, so even a policy that ran exactly the better fixed one's steps would fail that test
sometimes. This script measures how often, from the fixed policies' own cells in past sweeps:

  log goodput(policy, round) = mu_policy + d_round + e,   e ~ N(0, s_e), d_round ~ N(0, s_d)

- s_e, the cell's own noise: var(log on_r - log off_r) = 2 s_e^2 (the round's drift d cancels);
- s_d, the round's drift: var(round mean of log on, log off) - s_e^2 / 2.

Then it simulates pairs of identical policies (same mu, the round's d shared, own e) over the run's
rounds and counts how often median(A) / median(B) >= 0.97 at a level, and at every level of a sweep.

    .venv/bin/python -m bench.median_noise bench/results/load-cpu-runA{N,S,U}.json [--as-rounds 32]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

import numpy as np


def level_noise(cells: list[dict], level: int) -> tuple[float, float, int] | None:
    """(s_e, s_d, rounds) of one level from its forced cells; None without two full rounds."""
    by_round: dict[int, dict[str, float]] = {}
    for c in cells:
        if c["concurrency"] == level and c["policy"] in ("on", "off") and c["goodput_tok_s"] > 0:
            by_round.setdefault(c.get("round", 0), {})[c["policy"]] = math.log(c["goodput_tok_s"])
    rounds = [r for r in by_round.values() if len(r) == 2]
    if len(rounds) < 3:
        return None
    diff = [r["on"] - r["off"] for r in rounds]
    s_e = statistics.stdev(diff) / math.sqrt(2)
    means = [(r["on"] + r["off"]) / 2 for r in rounds]
    s_d = math.sqrt(max(statistics.variance(means) - s_e ** 2 / 2, 0.0))
    return s_e, s_d, len(rounds)


def pass_rate(s_e: float, s_d: float, rounds: int, sims: int, rng: np.random.Generator, bar: float = 0.97) -> np.ndarray:
    """Per simulated sweep: did identical policies A, B pass median(A) / median(B) >= bar?"""
    d = rng.normal(0.0, s_d, (sims, rounds))  # [sims, rounds] the rounds' shared drift
    a = np.median(np.exp(d + rng.normal(0.0, s_e, (sims, rounds))), axis=1)
    b = np.median(np.exp(d + rng.normal(0.0, s_e, (sims, rounds))), axis=1)
    return a / b >= bar


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+", type=Path, help="bench/load.py --json outputs")
    ap.add_argument("--sims", type=int, default=20000)
    ap.add_argument("--bar", type=float, default=0.97)
    ap.add_argument("--as-rounds", type=int, default=None,
                    help="simulate this many rounds per level instead of the run's (the noise as measured)")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    print(f"{'run':<22} {'level':>5} {'rounds':>6} {'s_e':>6} {'s_d':>6} {'P(level passes)':>16}")
    for path in args.runs:
        run = json.loads(path.read_text())
        every = np.ones(args.sims, dtype=bool)
        for level in run["config"]["levels"]:
            noise = level_noise(run["cells"], level)
            if noise is None:
                continue
            s_e, s_d, rounds = noise
            rounds = args.as_rounds or rounds
            ok = pass_rate(s_e, s_d, rounds, args.sims, rng, args.bar)
            every &= ok
            print(f"{path.stem:<22} {level:>5} {rounds:>6} {s_e:>6.3f} {s_d:>6.3f} {ok.mean():>16.2f}")
        print(f"{path.stem:<22} {'all':>5} {'':>6} {'':>6} {'':>6} {every.mean():>16.2f}")


if __name__ == "__main__":
    main()
