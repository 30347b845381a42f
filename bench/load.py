"""Concurrency sweep against the running application: speculation forced on, forced off, and auto.

    .venv/bin/python -m bench.load --start                      # deploys its own app (own Ray), ~9 min
    .venv/bin/python -m bench.load --url http://127.0.0.1:8000  # an app already running (make run)
    .venv/bin/python -m bench.load --start --levels 1,4,16 --duration 15
    .venv/bin/python -m bench.load --start --rounds 3 --duration 12   # repeated, median per cell
    .venv/bin/python -m bench.load --pool a.json b.json              # two sweeps' cells, one verdict
    .venv/bin/python -m bench.load --start --rounds 6 --max-steal 0.05   # cells re-run while the VM host steals
    source .gpu-carry/unpack-ray && python3 -m bench.load --device cuda   # one GPU: the 8B/1B-shaped pair, mixed traffic
    .venv/bin/python -m bench.load --shape tiny --device cpu --levels 1,2 --duration 2   # a smoke run of that code

For each concurrency level c (default 1,2,4,8,16,32) and each policy (`speculation` "on",
"off", "auto" in every request), c closed-loop clients stream completions for `--warmup` +
`--duration` seconds: each client sends a request, reads its SSE stream to the end, and sends
the next. Requests: code prompts, greedy, ignore_eos, `--max-tokens` tokens ("on" uses the
policy's default k). After each (level, policy) cell the clients stop and their open streams
are closed (the server aborts those sequences), so cells do not overlap. The order of the three
policies rotates from level to level (and round to round) so a drift in the machine's load does
not always hit the same one. With `--rounds R` every level runs R interleaved rounds of the three
policies and the verdict compares per-policy medians: single cells on a shared 2-core machine
vary by ±10-20 %, far more than the 3 % the target asks about. The app is shared by the cells: "auto" decides from what the router has measured so
far, including the forced cells' traffic (that is how it learns on a live service).

Per cell:
- goodput: output tokens streamed inside the measured window / window seconds (tokens counted
  as their SSE events arrive — `return_provenance` lists each event's tokens — so requests
  straddling the window edges count their share);
- latency p50/p99: end-to-end seconds of the requests that started and finished in the window;
- acceptance: accepted / drafted tokens over those requests;
- for auto: how many of its requests speculated, and the decision reasons.
Prints a table, writes `--json` (bench/results/load-cpu.json) and draws `--png` (bench/load-cpu.png;
the 8B pair on a GPU: load-gpu.json and bench/load.png),
with the target check: auto within 3% of the better fixed policy at every level, above both
somewhere; and, since goodput differences on a shared machine can be noise, whether most of
auto's requests took the mode (speculate or not) of the fixed policy that measured better.

`--max-steal S` gates cells on the host: a cell in whose measured window the hypervisor stole more
than S of the machine's CPU (Linux /proc/stat) is run again, up to `--steal-retries` times, and the
attempt with the least steal is kept (discarded attempts are in the report). On the 2-core VM host
the stolen share explained three quarters of one fixed policy's cell-to-cell spread (r = -0.87;
app/host_steal.py); the gate reads only the host, never goodput, and treats every policy alike.

`--start` runs the app in a child process with its own Ray (bench/app_process.AppProcess) and
configs/local.yaml's pair, with max_num_seqs raised to the largest level so every stream is in
the batch (the policy decides on batch size; a queue would be a different experiment).

`--shape 8b` (the default with `--device cuda`) or `tiny` starts the app with a random-weight pair
and mixed traffic instead (bench/load_mixed.py): code and prose prompts with their own controlled
acceptance (`--alphas`, default code 0.8, prose 0.35; the real draft model runs every step), output
lengths 16-512, levels 1/4/16/32/64, 2 rounds of 3 + 6 s cells run round by round over the levels:
about 8 minutes on one GPU. The plan is printed with its estimate first; `--time-limit` (540 s)
starts no cell that would end later, so the run ends inside a 10-minute device slot with what it
measured. Latency there counts every request that finished in the window (it may have started in
the warm-up: a 512-token request outlasts a window at 64 streams). The report
(bench/results/load-gpu.json) is rewritten after every cell, so a run cut short keeps what it
measured; each cell's requests, drafting and acceptance per prompt class are in it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import time
from collections import Counter
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Protocol

import httpx

from app.config import PROJECT_ROOT
from app.host_steal import host_cpu_jiffies, steal_share
from bench.load_report import (POLICIES, TARGET_RATIO, Cell, median, paired_ratio, percentile,  # noqa: F401
                               plot, pooled_cells, print_verdict, rescore, summarize, verdict, _r)

MODEL = "specserve-embedded"
PROMPTS = [
    "def read_config(path):\n",
    "import os\nimport sys\n\n\ndef main(",
    "class Stack:\n    def __init__(self):\n",
    "for index, value in enumerate(items):\n",
    "def fib(n):\n    if n < 2:\n",
    "    def __repr__(self):\n        return",
    'def parse_header(line):\n    """Split a header line into name and value."""\n',
    "import json\n\n\ndef load(path):\n    with open(path) as f:\n",
]
LEVELS = (1, 2, 4, 8, 16, 32)
# the random pair's sweep (bench/load_mixed.py): 1 to 64 streams, sized to run in ~8 min on one GPU
# (and under the device's 10-minute limit per command, which --time-limit keeps with room for shutdown)
MIXED_PLAN = {"levels": "1,4,16,32,64", "rounds": 2, "warmup": 3.0, "duration": 6.0, "time_limit": 540.0}
EMBEDDED_PLAN = {"levels": ",".join(map(str, LEVELS)), "rounds": 1, "warmup": 5.0, "duration": 20.0, "time_limit": None}


class Workload(Protocol):
    """What each client sends: request n of client i (the same sequence in every cell)."""

    model: str
    latency_from_cell_start: bool

    def request(self, client: int, n: int) -> tuple[dict[str, Any], str]:
        """(prompt and max_tokens of the body, the prompt's class)."""


@dataclass
class CodeWorkload:
    """The embedded pair's traffic: code prompts in turn, one length."""

    max_tokens: int
    model: str = MODEL
    latency_from_cell_start: bool = False

    def request(self, client: int, n: int) -> tuple[dict[str, Any], str]:
        return {"prompt": PROMPTS[(client + n) % len(PROMPTS)], "max_tokens": self.max_tokens}, "code"


def workload_of(args: argparse.Namespace) -> Workload:
    return getattr(args, "workload", None) or CodeWorkload(args.max_tokens)


class Window:
    def __init__(self, start: float, end: float, latency_from: float | None = None) -> None:
        self.start, self.end = start, end
        # a request's latency counts when it finished inside the window and started at or after this
        self.latency_from = start if latency_from is None else latency_from
        self.tokens = 0
        self.latencies: list[float] = []
        self.drafted = self.accepted = self.failed = self.speculated = self.drafted_requests = 0
        self.drafts = self.steps = 0
        self.reasons: Counter[str] = Counter()
        # per prompt class: requests, requests that drafted, drafted and accepted tokens
        self.by_class: dict[str, Counter[str]] = {}

    def inside(self, t: float) -> bool:
        return self.start <= t < self.end


async def stream_one(client: httpx.AsyncClient, url: str, body: dict[str, Any], w: Window,
                     klass: str = "code") -> None:
    """One streamed completion; tokens are credited to the window as their events arrive."""
    t0 = time.monotonic()
    usage = None
    done = False
    events = 0
    async with client.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as r:
        if r.status_code != 200:
            await r.aread()
            if w.inside(time.monotonic()):
                w.failed += 1
            return
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            payload = line[6:]
            if payload == "[DONE]":
                done = True
                break
            data = json.loads(payload)
            if "error" in data:
                if w.inside(time.monotonic()):
                    w.failed += 1
                return
            if data.get("usage"):
                usage = data["usage"]
                continue
            events += 1
            if w.inside(time.monotonic()):
                # one event per engine step; return_provenance lists its tokens (exact count)
                w.tokens += len((data.get("specserve") or {}).get("tokens", ()))
    t1 = time.monotonic()
    if done and usage and w.latency_from <= t0 and w.inside(t1):
        w.latencies.append(t1 - t0)
        spec = usage.get("speculation") or {}
        w.drafted += spec.get("drafted_tokens", 0)
        w.accepted += spec.get("accepted_tokens", 0)
        w.drafts += spec.get("num_drafts", 0)
        w.steps += events
        w.speculated += spec.get("mode") == "speculative"
        w.drafted_requests += spec.get("drafted_tokens", 0) > 0
        w.reasons[spec.get("reason", "?")] += 1
        per = w.by_class.setdefault(klass, Counter())
        per.update(requests=1, drafted_requests=int(spec.get("drafted_tokens", 0) > 0),
                   drafted=spec.get("drafted_tokens", 0), accepted=spec.get("accepted_tokens", 0))


async def run_cell(url: str, policy: str, c: int, warmup_s: float, duration_s: float, workload: Workload,
                   round_: int = 0) -> Cell:
    t_start = time.monotonic()
    w = Window(t_start + warmup_s, t_start + warmup_s + duration_s,
               latency_from=t_start if workload.latency_from_cell_start else None)
    stop = asyncio.Event()

    async def client_loop(i: int, client: httpx.AsyncClient) -> None:
        n = 0
        while not stop.is_set():
            fields, klass = workload.request(i, n)
            body = {"model": workload.model, **fields, "ignore_eos": True, "temperature": 0, "stream": True,
                    "speculation": policy, "return_provenance": True}
            n += 1
            try:
                await stream_one(client, url, body, w, klass)
            except (httpx.HTTPError, json.JSONDecodeError):
                if w.inside(time.monotonic()):
                    w.failed += 1
                await asyncio.sleep(0.2)

    limits = httpx.Limits(max_connections=c + 4, max_keepalive_connections=c + 4)
    async with httpx.AsyncClient(trust_env=False, limits=limits) as client:
        tasks = [asyncio.create_task(client_loop(i, client)) for i in range(c)]
        await asyncio.sleep(max(0.0, w.start - time.monotonic()))
        host0 = host_cpu_jiffies()
        await asyncio.sleep(max(0.0, w.end - time.monotonic()))
        steal = steal_share(host0, host_cpu_jiffies())
        stop.set()
        for t in tasks:  # close the open streams: the router cancels, the engine frees them
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    seconds = w.end - w.start
    return Cell(
        policy=policy, concurrency=c, seconds=round(seconds, 2), tokens=w.tokens,
        goodput_tok_s=round(w.tokens / seconds, 2), completed=len(w.latencies), failed=w.failed,
        latency_p50_s=_r(percentile(w.latencies, 50)), latency_p99_s=_r(percentile(w.latencies, 99)),
        acceptance_rate=round(w.accepted / w.drafted, 3) if w.drafted else None,
        speculated=w.speculated, reasons=dict(w.reasons), drafted_requests=w.drafted_requests, round=round_,
        drafted=w.drafted, drafts=w.drafts, steps=w.steps, host_steal=None if steal is None else round(steal, 4),
        by_class={k: dict(v) for k, v in sorted(w.by_class.items())},
    )


async def wait_idle(url: str) -> None:
    """Between cells: let the engine finish aborting the last cell's sequences."""
    await asyncio.sleep(1.0)



async def run_gated_cell(url: str, policy: str, c: int, args: argparse.Namespace, round_: int,
                         discarded: list[Cell]) -> Cell:
    """One cell; with --max-steal, re-run (up to --steal-retries times) while the hypervisor stole more
    than that share of the machine's CPU in its window, and keep the attempt with the least steal. Why:
    steal explained three quarters of one fixed policy's cell-to-cell spread here (app/host_steal.py).
    The gate reads only the host, never goodput, and applies alike to every policy. Discarded attempts
    go to `discarded` (written to the report)."""
    attempts: list[Cell] = []
    for attempt in range(args.steal_retries + 1 if args.max_steal is not None else 1):
        if attempt:
            await wait_idle(url)
        cell = await run_cell(url, policy, c, args.warmup, args.duration, workload_of(args), round_)
        cell.attempt = attempt
        attempts.append(cell)
        if args.max_steal is None or cell.host_steal is None or cell.host_steal <= args.max_steal:
            break
        print(f"{c:>5} {policy:<6}{cell.goodput_tok_s:>9.1f}  discarded: host steal {cell.host_steal:.3f} > "
              f"{args.max_steal}", flush=True)
    keep = min(attempts, key=lambda x: x.host_steal if x.host_steal is not None else 0.0)
    discarded += [x for x in attempts if x is not keep]
    return keep


async def sweep(url: str, levels: list[int], args: argparse.Namespace, discarded: list[Cell],
                on_cell: Callable[[list[Cell]], None] | None = None) -> list[Cell]:
    """Every (level, round, policy) cell; `on_cell(cells so far)` after each (the report is rewritten).
    Level by level, each level's rounds back to back; with `args.rounds_first`, round by round over
    every level instead, so a run stopped by `args.deadline` (a monotonic time: no cell starts that
    would end past it) has measured every level at least once rather than only the first ones."""
    cells: list[Cell] = []
    print(f"{'conc':>5} {'policy':<6}{'goodput':>9}{'p50 s':>8}{'p99 s':>8}{'accept':>8}{'done':>6}{'draft':>6}"
          f"{'depth':>6}{'share':>6}{'steal':>7}  reasons", flush=True)
    order = [(li, c, r) for r in range(args.rounds) for li, c in enumerate(levels)] if getattr(args, "rounds_first", False) \
        else [(li, c, r) for li, c in enumerate(levels) for r in range(args.rounds)]
    deadline = getattr(args, "deadline", None)
    for n, (li, c, r) in enumerate(order):
        shift = (li + r) % 3
        for pi, policy in enumerate(POLICIES[shift:] + POLICIES[:shift]):
            if deadline is not None and time.monotonic() + args.warmup + args.duration + 2.0 > deadline:
                left = (len(order) - n) * 3 - pi
                print(f"time limit: {left} cells not run (the report has the cells measured)", flush=True)
                return cells
            cell = await run_gated_cell(url, policy, c, args, r, discarded)
            cells.append(cell)
            acc = f"{cell.acceptance_rate:.2f}" if cell.acceptance_rate is not None else "-"
            p50 = f"{cell.latency_p50_s:.2f}" if cell.latency_p50_s is not None else "-"
            p99 = f"{cell.latency_p99_s:.2f}" if cell.latency_p99_s is not None else "-"
            reasons = ",".join(f"{k}:{v}" for k, v in sorted(cell.reasons.items())) if policy == "auto" else ""
            # depth: mean drafts per drafting sequence-step; share: of sequence-steps that drafted
            depth = f"{cell.drafted / cell.drafts:.2f}" if cell.drafts else "-"
            share = f"{cell.drafts / cell.steps:.2f}" if cell.steps else "-"
            steal = f"{cell.host_steal:.3f}" if cell.host_steal is not None else "-"
            classes = " ".join(f"{k}:{v.get('drafted_requests', 0)}/{v.get('requests', 0)}"
                               f"@{v['accepted'] / v['drafted']:.2f}" if v.get("drafted") else
                               f"{k}:0/{v.get('requests', 0)}" for k, v in cell.by_class.items())
            print(f"{c:>5} {policy:<6}{cell.goodput_tok_s:>9.1f}{p50:>8}{p99:>8}{acc:>8}{cell.completed:>6}"
                  f"{cell.drafted_requests:>6}{depth:>6}{share:>6}{steal:>7}  {reasons}"
                  f"{'  ' + classes if len(cell.by_class) > 1 else ''}", flush=True)
            if on_cell is not None:
                on_cell(cells)
            await wait_idle(url)
    return cells



def app_overrides(streams: int, policy: dict | None = None, device: str = "cpu") -> dict:
    """configs/local.yaml overrides for `streams` concurrent clients: all of them in one batch; with
    `policy`, PolicyConfig overrides too (deep-merged into the config's, as everything here).
    device "cuda": the pair on one GPU (bench.app_process.GPU_OVERRIDES)."""
    from bench.app_process import GPU_OVERRIDES, merged

    overrides: dict = {"engine": {"limits": {"max_num_seqs": streams, "max_queue": streams * 2}},
                       "target_deployment": {"max_ongoing_requests": streams * 2 + 8}}
    if device == "cuda":
        overrides = merged(overrides, GPU_OVERRIDES)
    if policy:
        overrides["policy"] = policy
        print(f"policy overrides {policy}", flush=True)
    return overrides


def _card_name() -> str:
    import torch  # only for a GPU run's plot title

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cuda (no device visible here)"


def _head_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=PROJECT_ROOT, capture_output=True,
                              text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _parse_alphas(text: str) -> dict[str, float]:
    return {k: float(v) for k, v in (x.split(":") for x in text.split(",") if x)}


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--start", action="store_true", help="deploy the app in a child process with its own Ray")
    ap.add_argument("--shape", choices=("embedded", "8b", "tiny"), default=None,
                    help="the pair: configs/local.yaml's embedded pair (default on the CPU) or a random-weight pair "
                         "with mixed traffic: 8b (default with --device cuda) or tiny (a CPU smoke run); implies --start")
    ap.add_argument("--levels", default=None, help=f"default {EMBEDDED_PLAN['levels']}; random pair {MIXED_PLAN['levels']}")
    ap.add_argument("--duration", type=float, default=None, help="measured seconds per (level, policy); default "
                                                                 f"{EMBEDDED_PLAN['duration']}, random pair {MIXED_PLAN['duration']}")
    ap.add_argument("--warmup", type=float, default=None, help=f"default {EMBEDDED_PLAN['warmup']}, random pair "
                                                               f"{MIXED_PLAN['warmup']}")
    ap.add_argument("--rounds", type=int, default=None, help="interleaved repetitions per level; medians compared "
                                                             f"(default {EMBEDDED_PLAN['rounds']}, random pair {MIXED_PLAN['rounds']})")
    ap.add_argument("--max-tokens", type=int, default=64, help="the embedded pair's output length")
    ap.add_argument("--time-limit", type=float, default=None,
                    help="seconds from the start: no cell starts that would end later (random pair: 540; rounds then "
                         "run over every level in turn, so a cut run has every level)")
    ap.add_argument("--lengths", type=lambda t: tuple(int(x) for x in t.split(",")), default=None,
                    help="random pair: the output lengths requests cycle through (default bench.load_mixed.LENGTHS, 16-512)")
    ap.add_argument("--prompts-per-class", type=int, default=None, help="random pair: distinct prompts of each class "
                                                                        "(default 24)")
    ap.add_argument("--alphas", type=_parse_alphas, default=None,
                    help="random pair: controlled acceptance per prompt class, e.g. code:0.8,prose:0.35 (the default)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="with --start: where the pair runs (cuda: one GPU shared by both replicas)")
    ap.add_argument("--policy", type=json.loads, default={},
                    help='with --start: PolicyConfig overrides as JSON, e.g. \'{"margin": 1.15}\' (an A/B of a setting)')
    ap.add_argument("--max-steal", type=float, default=None,
                    help="re-run a cell whose window had more than this share of the machine's CPU stolen by the "
                         "hypervisor (e.g. 0.03; default: no gate)")
    ap.add_argument("--steal-retries", type=int, default=3, help="with --max-steal: re-runs per cell at most")
    ap.add_argument("--json", default=None, help="the report (a sweep: default bench/results/load-cpu.json, "
                                                 "load-gpu.json for the 8b pair; --pool: only if given)")
    ap.add_argument("--png", default=None, help="the plot (a sweep: default bench/load.png for the 8b pair, "
                                                "bench/load-cpu.png on the CPU; --pool: only if given)")
    ap.add_argument("--pool", nargs="+", metavar="REPORT",
                    help="no measurement: the verdict of these reports' cells together (sweeps of one code)")
    args = ap.parse_args()
    args.shape = args.shape or ("8b" if args.device == "cuda" else "embedded")
    mixed = args.shape != "embedded"
    for key, value in (MIXED_PLAN if mixed else EMBEDDED_PLAN).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.start = args.start or mixed
    args.rounds_first = mixed
    if mixed:
        from bench.load_mixed import DEFAULT_ALPHAS, LENGTHS, PROMPTS_PER_CLASS

        args.alphas = args.alphas or dict(DEFAULT_ALPHAS)
        args.lengths = args.lengths or LENGTHS
        args.prompts_per_class = args.prompts_per_class or PROMPTS_PER_CLASS
    # the tiny pair is a smoke run: its report never replaces a measurement's
    results = PROJECT_ROOT / "bench" / ("out" if args.shape == "tiny" else "results")
    name = {"embedded": "load-cpu" if args.device == "cpu" else "load-embedded-gpu", "8b": "load-gpu",
            "tiny": "load-tiny"}[args.shape]
    args.json = args.json or str(results / f"{name}.json")
    # bench/load.png is the GPU sweep's (the policy's verdict); the CPU one is a regression check
    png = {"8b": "load.png", "tiny": "out/load-tiny.png"}.get(args.shape, f"{name}.png")
    args.png = args.png or str(PROJECT_ROOT / "bench" / png)
    return args


def main() -> None:
    args = _args()
    if args.pool:
        cells, levels = pooled_cells(args.pool)
        v = print_verdict(cells, levels)
        if args.json:
            rounds = len({c.round for c in cells})  # config.levels: rescore() reads the pool like one sweep
            Path(args.json).write_text(json.dumps({"bench": "load", "pooled": args.pool,
                                                   "config": {"levels": levels, "rounds": rounds},
                                                   "cells": [asdict(c) for c in cells], "verdict": v}, indent=1) + "\n")
        if args.png:
            plot(cells, levels, Path(args.png), f"specserve on CPU (embedded pair), closed-loop streams; pooled "
                                                f"{len(args.pool)} sweep{'' if len(args.pool) == 1 else 's'}: "
                                                f"{', '.join(Path(x).stem for x in args.pool)}")
        return
    levels = [int(x) for x in args.levels.split(",") if x]
    mixed = args.shape != "embedded"
    card = _card_name() if args.device == "cuda" else None
    load_before = os.getloadavg()
    t0 = time.monotonic()
    args.deadline = t0 + args.time_limit if args.time_limit else None
    commit = _head_commit()  # at the start: the code the run measured (commits may land while it runs)
    setup = None
    if mixed:
        from bench.load_mixed import MAX_K, plan_seconds

        plan = plan_seconds(args.shape, args.device, levels, args.rounds, args.warmup, args.duration,
                            MAX_K if args.device == "cuda" else 1, max(args.lengths))
        print(f"plan: {args.shape} pair on {args.device}, levels {levels}, {args.rounds} rounds x 3 policies = "
              f"{len(levels) * 3 * args.rounds} cells of {args.warmup:g} + {args.duration:g} s, alphas {args.alphas}; "
              "estimated " + ", ".join(f"{k} {v:.0f} s" for k, v in plan.items()) + f" ({plan['total'] / 60:.1f} min)",
              flush=True)
    app_ctx = None
    url = args.url
    discarded: list[Cell] = []
    cells: list[Cell] = []

    def report(cells: list[Cell], final: bool) -> dict[str, Any]:
        summary = summarize(cells, levels)
        load_now = os.getloadavg()
        return {
            "bench": "load", "partial": not final,
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "commit": commit,
            "wall_s": round(time.monotonic() - t0, 1),
            "host": {"machine": platform.machine(), "cpus": os.cpu_count(), "card": card,
                     "loadavg_before": [round(x, 2) for x in load_before],
                     "loadavg_after": [round(x, 2) for x in load_now]},
            "config": {"url": "started (bench.app_process)" if args.start else url, "levels": levels,
                       "duration_s": args.duration, "warmup_s": args.warmup, "rounds": args.rounds,
                       "max_tokens": None if mixed else args.max_tokens, "ignore_eos": True, "temperature": 0,
                       "prompts": "mixed code and prose" if mixed else "code",
                       "pair": f"random {args.shape}" if mixed else "configs/local.yaml embedded", "device": args.device,
                       "policy_overrides": args.policy, "max_steal": args.max_steal, "steal_retries": args.steal_retries,
                       "time_limit_s": args.time_limit, "rounds_first": args.rounds_first,
                       **({"alphas": args.alphas, "workload": setup.workload.describe(), "setup_s": setup.timings_s,
                           "references": setup.reference_lengths} if setup is not None else {})},
            "cells": [asdict(c) for c in cells],
            "discarded_cells": [asdict(c) for c in discarded],
            "summary": {f"{c}/{p}": row for (c, p), row in summary.items()},
            "verdict": verdict(cells, levels),
        }

    def write(cells: list[Cell], final: bool = False) -> None:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report(cells, final), indent=1) + "\n")

    try:
        if args.start:
            from bench.app_process import AppProcess, local_args

            if mixed:
                from bench.load_mixed import app_config, new_root

                config = app_config(args.shape, args.device, max(levels), args.policy, new_root(), args.lengths)
            else:
                config = local_args(app_overrides(max(levels), args.policy, args.device))
            app_ctx = AppProcess(config, startup_timeout_s=420.0)
            app_ctx.__enter__()
            url = app_ctx.url
            print(f"[{time.monotonic() - t0:.0f}s] app started", flush=True)
        if mixed:
            from bench.load_mixed import prepare

            setup = prepare(app_ctx, url, args.shape, args.device, levels, args.alphas, args.prompts_per_class,
                            args.lengths)
            args.workload = setup.workload
            print(f"[{time.monotonic() - t0:.0f}s] references and warm-up done: {setup.timings_s}", flush=True)
        cells = asyncio.run(sweep(url, levels, args, discarded, on_cell=write))
        # the report and the plot before the app's shutdown: a slow shutdown cut short loses neither
        print_verdict(cells, levels)
        write(cells, final=True)
        load_after = os.getloadavg()
        pair = f"random {args.shape} pair, mixed code (alpha {args.alphas.get('code')}) / prose (alpha " \
               f"{args.alphas.get('prose')}), {min(args.lengths)}-{max(args.lengths)} tokens" if mixed else \
            f"embedded pair, max_tokens {args.max_tokens}"
        plot(cells, levels, Path(args.png), f"specserve on {card or 'CPU'} ({pair}), closed-loop streams; load avg "
                                            f"{load_before[0]:.1f}->{load_after[0]:.1f} on {os.cpu_count()} cores")
        print(f"[{time.monotonic() - t0:.0f}s] wrote {args.json} and {args.png}", flush=True)
    finally:
        if app_ctx is not None:
            app_ctx.__exit__(None, None, None)


if __name__ == "__main__":
    main()
