"""How much do back-to-back cells of ONE fixed policy differ on this host? The floor under #4's test.

    .venv/bin/python -m bench.cell_noise --policy off --streams 8 --cells 14 --duration 10

bench/load.py compares policies cell by cell; whatever two cells of the *same* policy differ by, run
one after the other on an unchanged app, no comparison of two policies can resolve. This deploys
the app (as `bench.load --start` does), runs `--cells` cells of one policy back to back (the same
closed-loop clients, prompts and lengths as bench.load) and reports each cell's goodput, their
coefficient of variation and the mean relative step between neighbours. With it, per cell, the CPU
seconds the app's processes used (Linux /proc: the app's child process and every `ray::` worker),
so a cell that is slower with the same CPU seconds points at the host's speed (or at a different
use of it), not at less work done.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
from pathlib import Path

from bench.app_process import AppProcess, local_args
from app.host_steal import host_cpu_jiffies, steal_share
from bench.host_cost import process_cpu_seconds
from bench.load import app_overrides, run_cell, wait_idle


def app_cpu_seconds() -> float:
    """CPU seconds (user + system) of this machine's Ray workers and the app's own process so far."""
    app = process_cpu_seconds(lambda cmd: "app" if "ray::" in cmd or "bench.app_process" in cmd else None)
    return app.get("app", 0.0)


async def cells(url: str, args: argparse.Namespace) -> list[dict]:
    out = []
    for i in range(args.cells):
        cpu0, host0 = app_cpu_seconds(), host_cpu_jiffies()
        cell = await run_cell(url, args.policy, args.streams, args.warmup, args.duration, args.max_tokens, i)
        cpu_s, steal = app_cpu_seconds() - cpu0, steal_share(host0, host_cpu_jiffies())
        wall_s = args.warmup + args.duration
        out.append({"cell": i, "goodput_tok_s": cell.goodput_tok_s, "completed": cell.completed,
                    "app_cpu_s_per_wall_s": round(cpu_s / wall_s, 3),
                    "host_steal_share": None if steal is None else round(steal, 3)})
        print(f"cell {i:>3}  {cell.goodput_tok_s:8.1f} tok/s  app CPU {cpu_s / wall_s:5.2f} cores  steal {steal if steal is not None else float('nan'):5.3f}", flush=True)
        await wait_idle(url)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policy", choices=("on", "off", "auto"), default="off")
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--cells", type=int, default=14)
    ap.add_argument("--duration", type=float, default=10.0)
    ap.add_argument("--warmup", type=float, default=2.0)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="where the embedded pair runs (cuda: one GPU shared by both replicas, as bench.load)")
    ap.add_argument("--json", help="write the cells and the summary here")
    args = ap.parse_args()
    if args.cells < 2:
        raise SystemExit("--cells must be at least 2: the spread needs two cells")
    with AppProcess(local_args(app_overrides(args.streams, device=args.device))) as app:
        rows = asyncio.run(cells(app.url, args))
    g = [r["goodput_tok_s"] for r in rows]
    mean = statistics.mean(g)
    summary = {"mean_tok_s": round(mean, 1), "cv": round(statistics.stdev(g) / mean, 3),
               "mean_neighbour_step": round(statistics.mean(abs(a - b) for a, b in zip(g, g[1:])) / mean, 3),
               "min_over_max": round(min(g) / max(g), 3)}
    print(json.dumps(summary))
    if args.json:
        Path(args.json).write_text(json.dumps({"config": vars(args), "cells": rows, "summary": summary}, indent=1) + "\n")


if __name__ == "__main__":
    main()
