"""Does auto's request path cost anything beyond its step choices? auto pinned to one mode vs that forced policy.

    .venv/bin/python -m bench.pinned_ab --streams 4 --pairs 7 --mode on
    python3 -m bench.pinned_ab --device cuda --streams 1 --pairs 7 --mode off   # the embedded pair on one GPU

With `policy.mode_arbiter.pinned_mode` set, every adaptive batch runs in that mode and the arbiter
never probes, so an `auto` request differs from a forced one only in its path: the router's
decision (load, length and acceptance trackers), `adaptive` sequences, the arbiter's bookkeeping.
This deploys the app with the pin, runs one auto cell to settle, then `--pairs` pairs of cells
(auto and the forced policy, the order alternating) and reports auto / forced per pair, their mean
and its standard error. A ratio near 1 puts any gap between auto and the forced policy in
bench/load.py on the arbiter's choices (its probes), not on the path.

`--free` leaves the arbiter free (no pin) and settles for `--settle` seconds of auto first, so that
its warm-up at this load is over before the pairs: auto / forced is then the steady-state cost of its
probes and switches at one load, apart from the warm-up a sweep's level also pays.

`--interleave on` runs a forced 'on' cell (not counted) before each pair, as a sweep's rounds put one
between auto's cells: whether what forced drafting leaves behind (the arbiter's stale leader, the
draft replica's state) is what costs auto at low load in bench/load.py but not in a plain A/B.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics

from bench.app_process import AppProcess, local_args
from bench.load import app_overrides, run_cell, wait_idle


async def pairs(url: str, args: argparse.Namespace) -> list[float]:
    await run_cell(url, "auto", args.streams, args.warmup, args.settle, args.max_tokens, 0)  # settle
    ratios = []
    for i in range(args.pairs):
        order = (args.mode, "auto") if i % 2 == 0 else ("auto", args.mode)
        if args.interleave is not None:
            cell = await run_cell(url, args.interleave, args.streams, args.warmup, args.duration, args.max_tokens, i)
            print(f"pair {i} {args.interleave:<4} {cell.goodput_tok_s:8.1f} tok/s  (interleaved, not counted)", flush=True)
            await wait_idle(url)
        goodput = {}
        for policy in order:
            cell = await run_cell(url, policy, args.streams, args.warmup, args.duration, args.max_tokens, i)
            goodput[policy] = cell.goodput_tok_s
            share = cell.drafts / cell.steps if cell.steps else 0.0
            print(f"pair {i} {policy:<4} {cell.goodput_tok_s:8.1f} tok/s  drafting share {share:.2f}  "
                  f"p50 {cell.latency_p50_s} s", flush=True)
            await wait_idle(url)
        ratios.append(goodput["auto"] / goodput[args.mode])
    return ratios


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--pairs", type=int, default=7)
    ap.add_argument("--mode", choices=("on", "off"), default="on", help="the pin, and the forced policy to compare")
    ap.add_argument("--duration", type=float, default=10.0)
    ap.add_argument("--warmup", type=float, default=2.0)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--free", action="store_true", help="no pin: the arbiter chooses (and probes) as in bench.load")
    ap.add_argument("--interleave", choices=("on", "off"), default=None,
                    help="a forced cell of this policy (not counted) before each pair, as in a sweep's rounds")
    ap.add_argument("--settle", type=float, default=8.0, help="seconds of auto before the pairs")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="where the embedded pair runs (cuda: one GPU shared by both replicas, as bench.load)")
    args = ap.parse_args()
    if args.pairs < 2:
        raise SystemExit("--pairs must be at least 2: the standard error needs two pairs")
    pin = None if args.free else {"mode_arbiter": {"pinned_mode": args.mode}}
    overrides = app_overrides(args.streams, pin, args.device)
    with AppProcess(local_args(overrides)) as app:
        ratios = asyncio.run(pairs(app.url, args))
    print("auto / " + args.mode + " per pair:", " ".join(f"{r:.3f}" for r in ratios))
    print(f"mean {statistics.mean(ratios):.3f} ± {statistics.stdev(ratios) / len(ratios) ** 0.5:.3f} (s.e.)")


if __name__ == "__main__":
    main()
