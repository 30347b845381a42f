"""Record every engine step of a few cells, to check the mode arbiter's goodput accounting against the cells'.

    .venv/bin/python -m bench.step_trace --streams 2 --out bench/results/step-trace-2.jsonl
    .venv/bin/python -m bench.step_trace --analyze bench/results/step-trace-2.jsonl.gz

Deploys the app (bench.app_process) with `policy.mode_arbiter.step_trace_path` set, runs the cells of
`--plan` (policy:seconds, e.g. off:15,on:15,auto:45) at `--streams` closed-loop clients, and writes the
engine's steps (one JSON line each, deployments/target_server.py) followed by one line per cell with its
window on the same clock (time.perf_counter: CLOCK_MONOTONIC, shared by the processes of one host) and
the goodput the clients measured. `--analyze` reads such a file (gzipped or not) and prints, per cell,
the clients' goodput against the engine's under two accountings of a step's wall seconds:

- `old`: the step less its newcomers' prefill, plus the loop's gap before it when under max(50 ms, the
  step) (the arbiter's until session 30);
- `clients`: the step with its prefill and newcomers' first tokens, plus any gap short of a lull
  (app/policy/step_wall.py, the arbiter's now);

and, for auto cells, every run of steps in one mode (the arbiter's probes and the leader's windows
between them) under both, its first two (settling) steps left out as the arbiter does.
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import tempfile
import time
from pathlib import Path

from app.policy.step_wall import StepWall
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


SETTLE_STEPS = 2  # the arbiter's settle_steps default


def goodput(steps: list[dict], accounting: str) -> float:
    """Output tokens over wall seconds of `steps` under `accounting`: 'old' (a step's own time less its
    prefill, a gap only when short, prefill-only steps nobody's) or 'clients' (the arbiter's own,
    app.policy.step_wall.StepWall, every step observed but the prefill-only ones)."""
    if accounting == "clients":
        first_gap = steps[0]["gap"] if steps else None
        # the step before the first one ended where its recorded gap says (a cell or a run starts mid-trace)
        wall = StepWall(last_end=steps[0]["t"] - steps[0]["s"] - first_gap if first_gap is not None else None)
        measured = [wall.step(x["t"], x["s"], x["tok"] + x["new_tok"], batch_size=x["bs"], observed=x["bs"] > 0)
                    for x in steps]
        tokens, seconds = sum(m[0] for m in measured if m), sum(m[1] for m in measured if m)
        return tokens / seconds if seconds > 0 else 0.0
    tokens = seconds = 0.0
    for x in steps:
        gap = x["gap"] if x["gap"] is not None else 0.0
        if x["bs"] == 0:  # a prefill-only step: nobody's
            continue
        tokens += x["tok"]
        seconds += x["s"] - x["prefill"] + (gap if 0.0 <= gap <= max(0.05, x["s"]) else 0.0)
    return tokens / seconds if seconds > 0 else 0.0


def mode_runs(steps: list[dict]) -> list[tuple[str, list[dict]]]:
    """Consecutive steps in one mode (prefill-only steps join the run they fall in)."""
    runs: list[tuple[str, list[dict]]] = []
    for x in steps:
        if x["mode"] is not None and (not runs or runs[-1][0] != x["mode"]):
            runs.append((x["mode"], []))
        if runs:
            runs[-1][1].append(x)
    return runs


def analyze(path: Path) -> None:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        rows = [json.loads(line) for line in f]
    steps, cells_ = [r for r in rows if "t" in r], [r for r in rows if "cell" in r]
    print(f"{'cell':<5}{'clients':>9}{'engine':>9}{'old':>9}{'clients-acct':>14}  (tok/s)")
    for c in cells_:
        inside = [x for x in steps if c["start"] <= x["t"] <= c["end"]]
        engine = sum(x["tok"] + x["new_tok"] for x in inside) / (c["end"] - c["start"])
        print(f"{c['cell']:<5}{c['goodput']:9.1f}{engine:9.1f}{goodput(inside, 'old'):9.1f}"
              f"{goodput(inside, 'clients'):14.1f}")
    for c in cells_:
        if c["cell"] != "auto":
            continue
        print(f"auto cell at {c['start']:.1f}: runs of one mode (settling steps left out)")
        for mode, run in mode_runs([x for x in steps if c["start"] <= x["t"] <= c["end"]]):
            body = run[SETTLE_STEPS:]
            print(f"  {mode:<4} {len(run):5d} steps {sum(x['s'] for x in run):6.2f} s   old {goodput(body, 'old'):7.1f}"
                  f"   clients {goodput(body, 'clients'):7.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=2)
    ap.add_argument("--plan", default="off:15,on:15,auto:45,off:15,on:15")
    ap.add_argument("--warmup", type=float, default=3.0)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--analyze", type=Path, help="print the accounting comparison of a trace file and exit")
    args = ap.parse_args()
    if args.analyze is not None:
        analyze(args.analyze)
        return
    if args.out is None:
        ap.error("--out is required to record a trace")
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
