"""Record every engine step of a few cells, to check the mode arbiter's goodput accounting against the cells'.

    .venv/bin/python -m bench.step_trace --streams 2 --out bench/results/step-trace-2.jsonl

Deploys the app (bench.app_process) with `policy.mode_arbiter.step_trace_path` set, runs the cells of
`--plan` (policy:seconds, e.g. off:15,on:15,auto:45) at `--streams` closed-loop clients, and writes the
engine's steps (one JSON line each, deployments/target_server.py) followed by one line per cell with its
window on the same clock (time.perf_counter: CLOCK_MONOTONIC, shared by the processes of one host) and
the goodput the clients measured. The arbiter's windows can then be recomputed from the steps under any
accounting and compared with what the cells measured.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

from bench.app_process import AppProcess, local_args
from bench.load import app_overrides, run_cell, wait_idle


async def cells(url: str, plan: list[tuple[str, float]], args: argparse.Namespace) -> list[dict]:
    out = []
    for i, (policy, seconds) in enumerate(plan):
        t0 = time.perf_counter()
        cell = await run_cell(url, policy, args.streams, args.warmup, seconds, args.max_tokens, i)
        out.append({"cell": policy, "start": t0 + args.warmup, "end": t0 + args.warmup + seconds,
                    "goodput": cell.goodput_tok_s, "completed": cell.completed})
        print(f"{policy:<4} {seconds:5.1f} s  {cell.goodput_tok_s:7.1f} tok/s", flush=True)
        await wait_idle(url)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=2)
    ap.add_argument("--plan", default="off:15,on:15,auto:45,off:15,on:15")
    ap.add_argument("--warmup", type=float, default=3.0)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    plan = [(p, float(s)) for p, s in (item.split(":") for item in args.plan.split(","))]
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "steps.jsonl"
        overrides = app_overrides(args.streams, {"mode_arbiter": {"step_trace_path": str(trace)}})
        with AppProcess(local_args(overrides)) as app:
            result = asyncio.run(cells(app.url, plan, args))
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with args.out.open("w") as f:
            f.write(trace.read_text())
            for row in result:
                f.write(json.dumps(row) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
