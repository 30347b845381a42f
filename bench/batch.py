"""Continuous batching on the in-process engine (no Ray): throughput and inter-token latency
versus concurrency, plain decoding vs speculative decoding, on the embedded CPU pair.

    .venv/bin/python -m bench.batch                                # 1,2,4,8,16,32; ~6 min
    .venv/bin/python -m bench.batch --levels 1,8,32 --duration 10 --rounds 2 --k 4

What runs: one `SpecEngine` (app.engine.generate.build_engine with configs/local.yaml's pair, the draft
in-process) with `max_num_seqs` raised to the largest level. For each mode and concurrency c it
keeps exactly c sequences in the engine (closed loop: when one finishes, a new one is added, so
sequences join and leave at step boundaries as in serving) and calls `engine.step()` for
`--duration` seconds, split into `--rounds` slices that alternate plain and speculative (each
slice starts from an empty engine and has an unmeasured `--warmup`), so that drift in the load
of a shared machine hits both modes alike. Requests: code prompts, greedy, ignore_eos,
max_tokens `--max-tokens`; plain = k 0, speculative = fixed k `--k` (no adaptive k: this
measures batching itself, not the policy).

Reported per (mode, c):
- throughput: output tokens emitted in the window / window seconds (prefills included: their
  cost is part of serving, and they emit each sequence's first token); and tokens per CPU-second
  of the (single-threaded) engine thread, which other processes on shared cores inflate far less
  than wall time — the intrinsic cost when the machine is busy;
- inter-token latency p50/p99: for each emission of n tokens after a gap g since the sequence's
  previous emission, n samples of g/n (a sequence's first token, its TTFT, is not an ITL);
  with speculation the tokens of one step arrive together, so per-token latency is the step
  gap shared among them — the figure a streaming client's tokens/s sees;
- acceptance (accepted / drafted) and mean tokens per step of speculating sequences;
- mean batch and mean step time.
At the end every sequence is aborted or finished and the memory-freed invariant is checked:
`engine.running` and `engine.waiting` empty, `cached_tokens() == 0`, the draft proposer's
cache count 0. Writes bench/results/batch-cpu.json and draws bench/batch.png.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch

from app.config import PROJECT_ROOT, load_engine_config
from app.engine.spec_engine import SpecEngine
from app.engine.generate import build_engine
from app.protocol.sampling_params import SamplingParams

from bench.load import PROMPTS  # the same code prompts as the load sweep
LEVELS = (1, 2, 4, 8, 16, 32)


@dataclass
class Cell:
    mode: str
    concurrency: int
    k: int
    seconds: float
    cpu_seconds: float
    output_tokens: int
    throughput_tok_s: float
    tok_per_cpu_s: float
    itl_p50_ms: float
    itl_p99_ms: float
    acceptance_rate: float | None
    tokens_per_spec_step: float | None
    mean_batch: float
    mean_step_ms: float
    steps: int
    finished_sequences: int


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    i = min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))
    return s[i]


class Tally:
    """What one (mode, concurrency) accumulates over its interleaved slices."""

    def __init__(self) -> None:
        self.itl: list[float] = []
        self.seconds = self.cpu = self.batch_sum = self.step_sum = 0.0
        self.tokens = self.drafted = self.accepted = self.spec_steps = self.spec_tokens = 0
        self.steps = self.finished = 0

    def cell(self, mode: str, c: int, k: int) -> Cell:
        t, steps = self, max(self.steps, 1)
        return Cell(
            mode=mode, concurrency=c, k=k, seconds=round(t.seconds, 2), cpu_seconds=round(t.cpu, 2),
            output_tokens=t.tokens, throughput_tok_s=round(t.tokens / t.seconds, 2),
            tok_per_cpu_s=round(t.tokens / t.cpu, 2) if t.cpu else float("nan"),
            itl_p50_ms=round(percentile(t.itl, 50) * 1e3, 2), itl_p99_ms=round(percentile(t.itl, 99) * 1e3, 2),
            acceptance_rate=round(t.accepted / t.drafted, 3) if t.drafted else None,
            tokens_per_spec_step=round(t.spec_tokens / t.spec_steps, 3) if t.spec_steps else None,
            mean_batch=round(t.batch_sum / steps, 2), mean_step_ms=round(t.step_sum / steps * 1e3, 2),
            steps=t.steps, finished_sequences=t.finished,
        )


def run_slice(engine: SpecEngine, encode, tally: Tally, tag: str, c: int, k: int, max_tokens: int,
              duration_s: float, warmup_s: float) -> None:
    """Keep exactly c sequences (depth k) in the engine for warmup + duration seconds; tally the
    measured part, then abort whatever is left (which frees its caches)."""
    ids = itertools.count()
    prompts = itertools.cycle(PROMPTS)
    last_emit: dict[str, float] = {}
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)

    def add_one() -> None:
        engine.add(f"{tag}-{next(ids)}", encode(next(prompts)), sampling, k=k)

    for _ in range(c):
        add_one()
    t_measure = time.perf_counter() + warmup_s
    t_end = t_measure + duration_s
    measuring = False
    cpu0 = 0.0
    while True:
        now = time.perf_counter()
        if not measuring and now >= t_measure:
            measuring, t_measure, cpu0 = True, now, time.thread_time()
        if now >= t_end:
            break
        t0 = time.perf_counter()
        updates = engine.step()
        t1 = time.perf_counter()
        for u in updates:
            n = len(u.token_ids)
            prev = last_emit.get(u.seq_id)
            last_emit[u.seq_id] = t1
            if measuring:
                tally.tokens += n
                if prev is not None and n:
                    tally.itl += [(t1 - prev) / n] * n
                if u.drafted:
                    tally.drafted += u.drafted
                    tally.accepted += u.accepted
                    tally.spec_steps += 1
                    tally.spec_tokens += n
            if u.finish_reason is not None:
                last_emit.pop(u.seq_id, None)
                tally.finished += measuring
                add_one()  # closed loop: keep exactly c sequences
        if measuring:
            tally.steps += 1
            tally.batch_sum += engine.last_times.batch_size
            tally.step_sum += t1 - t0
    tally.seconds += time.perf_counter() - t_measure
    tally.cpu += time.thread_time() - cpu0
    for sid in list(engine.running) + [s.seq_id for s in engine.waiting]:
        engine.abort(sid)


def memory_invariant(engine: SpecEngine) -> dict[str, int]:
    proposer = engine.proposer
    return {
        "running": len(engine.running),
        "waiting": len(engine.waiting),
        "cached_tokens": engine.cached_tokens(),
        "proposer_cached_sequences": proposer.num_cached_sequences() if proposer is not None else 0,
    }


def plot(cells: list[Cell], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for mode, color in (("plain", "tab:blue"), ("speculative", "tab:orange")):
        rows = sorted((c for c in cells if c.mode == mode), key=lambda c: c.concurrency)
        xs = [c.concurrency for c in rows]
        ax1.plot(xs, [c.throughput_tok_s for c in rows], "o-", color=color, label=f"{mode} (wall)")
        ax1.plot(xs, [c.tok_per_cpu_s for c in rows], "^:", color=color, alpha=0.6, label=f"{mode} (per CPU-s)")
        ax2.plot(xs, [c.itl_p50_ms for c in rows], "o-", color=color, label=f"{mode} p50")
        ax2.plot(xs, [c.itl_p99_ms for c in rows], "s--", color=color, alpha=0.6, label=f"{mode} p99")
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent sequences")
        ax.grid(alpha=0.3)
        ax.legend()
    ax1.set_ylabel("output tokens/s")
    ax1.set_title("throughput")
    ax2.set_ylabel("inter-token latency (ms)")
    ax2.set_yscale("log")
    ax2.set_title("inter-token latency")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(PROJECT_ROOT / "configs" / "local.yaml"))
    ap.add_argument("--levels", default=",".join(map(str, LEVELS)))
    ap.add_argument("--k", type=int, default=4, help="speculation depth of the speculative mode")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--duration", type=float, default=12.0, help="measured seconds per (mode, level)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved plain/speculative slices per level")
    ap.add_argument("--warmup", type=float, default=1.0, help="unmeasured seconds at the start of each slice")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (the replicas use 1)")
    ap.add_argument("--json", default=str(PROJECT_ROOT / "bench" / "results" / "batch-cpu.json"))
    ap.add_argument("--png", default=str(PROJECT_ROOT / "bench" / "batch.png"))
    args = ap.parse_args()
    levels = [int(x) for x in args.levels.split(",") if x]

    config = load_engine_config(args.config)
    limits = config.limits.model_copy(update={"max_num_seqs": max(levels), "max_queue": max(levels)})
    config = config.model_copy(update={"limits": limits})
    engine = build_engine(config, speculate=True)  # k 0 sequences never touch the proposer
    torch.set_num_threads(args.threads)
    tok = engine.runner.tokenizer

    def encode(text: str) -> list[int]:
        return tok(text, add_special_tokens=False)["input_ids"]

    load_before = os.getloadavg()
    cells: list[Cell] = []
    print(f"{'mode':<12}{'conc':>5}{'tok/s':>9}{'tok/CPU-s':>10}{'ITL p50':>9}{'ITL p99':>9}{'accept':>8}"
          f"{'tok/step':>9}{'batch':>7}{'step ms':>9}", flush=True)
    for c in levels:
        tallies = {"plain": Tally(), "speculative": Tally()}
        # interleave the two modes in short slices so drift in the machine's load (other
        # people's work on shared cores) hits both alike
        for r in range(args.rounds):
            order = ("plain", "speculative") if r % 2 == 0 else ("speculative", "plain")
            for mode in order:
                k = args.k if mode == "speculative" else 0
                run_slice(engine, encode, tallies[mode], f"{mode}-{c}-{r}", c, k, args.max_tokens,
                          args.duration / args.rounds, args.warmup)
        for mode in ("plain", "speculative"):
            cell = tallies[mode].cell(mode, c, args.k if mode == "speculative" else 0)
            cells.append(cell)
            acc = f"{cell.acceptance_rate:.2f}" if cell.acceptance_rate is not None else "-"
            tps = f"{cell.tokens_per_spec_step:.2f}" if cell.tokens_per_spec_step is not None else "-"
            print(f"{mode:<12}{c:>5}{cell.throughput_tok_s:>9.1f}{cell.tok_per_cpu_s:>10.1f}{cell.itl_p50_ms:>9.1f}"
                  f"{cell.itl_p99_ms:>9.1f}{acc:>8}{tps:>9}{cell.mean_batch:>7.1f}{cell.mean_step_ms:>9.1f}",
                  flush=True)
    invariant = memory_invariant(engine)
    ok = all(v == 0 for v in invariant.values())
    print(f"memory freed: {invariant} -> {'OK' if ok else 'LEAK'}")
    load_after = os.getloadavg()
    speedups, cpu_speedups = {}, {}
    for c in levels:
        p = next(x for x in cells if x.mode == "plain" and x.concurrency == c)
        s = next(x for x in cells if x.mode == "speculative" and x.concurrency == c)
        speedups[c] = round(s.throughput_tok_s / p.throughput_tok_s, 3) if p.throughput_tok_s else None
        cpu_speedups[c] = round(s.tok_per_cpu_s / p.tok_per_cpu_s, 3) if p.tok_per_cpu_s else None
    print("speculative/plain, wall tok/s:", " ".join(f"c={c}:{v}" for c, v in speedups.items()))
    print("speculative/plain, tok/CPU-s: ", " ".join(f"c={c}:{v}" for c, v in cpu_speedups.items()))
    report = {
        "bench": "batch",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "host": {"machine": platform.machine(), "cpus": os.cpu_count(), "torch_threads": args.threads,
                 "loadavg_before": [round(x, 2) for x in load_before],
                 "loadavg_after": [round(x, 2) for x in load_after]},
        "config": {"target": config.target.path, "draft": config.draft.path if config.draft else None,
                   "k": args.k, "max_tokens": args.max_tokens, "duration_s": args.duration,
                   "rounds": args.rounds, "warmup_s": args.warmup, "levels": levels, "ignore_eos": True, "temperature": 0},
        "cells": [asdict(c) for c in cells],
        "speculative_over_plain": speedups,
        "speculative_over_plain_per_cpu_s": cpu_speedups,
        "memory_freed": {**invariant, "ok": ok},
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    plot(cells, Path(args.png), f"in-process SpecEngine, embedded CPU pair, k={args.k}, "
                                f"max_tokens={args.max_tokens}, load avg {load_before[0]:.1f}->{load_after[0]:.1f} "
                                f"on {os.cpu_count()} cores")
    print(f"wrote {args.json} and {args.png}")
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
