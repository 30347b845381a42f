"""Run-to-run spread of the 1B int8 draft's one-token step, by one-row GEMV kernel (GPU, one card).

    python3 -m bench.gpu_draft_step [--trials 3] [--one-row inductor,triton] [--json PATH] [--profile]
    python3 -m bench.gpu_draft_step --cold-table pins.json [--rows 1,2]  # block configs timed with cold weights
    python3 -m bench.gpu_draft_step --trials 3 --one-row triton --pins pins.json
    python3 -m bench.gpu_draft_step --rows-breakdown 1,2,5 [--pins pins.json] [--json PATH]  # forward by rows

Why: with its GEMVs tuned at start (Inductor's coordinate descent for one row, `--one-row inductor`;
Triton's autotuning without pins), the int8 draft's one-token step took 0.84, 0.92 and 1.09 ms in
three `bench.gpu` runs minutes apart on one H200 while its two-token step held at ~1.28 ms, and the
sequential speedups followed the one-token step. app/runners/kernels/int8_gemv.py therefore pins block configs.
Each trial here is a fresh process with empty Inductor and Triton caches (as a new host starts), so
the spread across trials is what a start's tuning leaves to chance.

Per trial: the draft's one-token loop step (`bench.gpu.loop_step_time`: graph replay, argmax, the
controlled-acceptance proposer; median of 5 x 100 steps), its two-token extra, and each 1B weight
shape's one-row GEMV as that start compiled it (CUDA-graph timing of the same weights again and
again, so L2-hot: `bench.gpu_int8_gemv.micros`). `--profile`: the GPU time of one eager forward by
kernel, which is where the start-to-start spread shows. `--cold-table`: every candidate Triton block
config per shape and row count, timed with the weights cycled through enough copies to outgrow L2
(as a decode step reads them), the best written as pins (app/runners/kernels/int8_gemv.py's defaults came from it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from bench.gpu_int8_gemv import SHAPES  # the 1B draft's weight shapes (name -> (out, in))
from bench.int8_pins import load_pins

CANDIDATES = [(8, 256, 4), (16, 256, 4), (32, 128, 4), (16, 512, 4), (32, 256, 8), (64, 128, 8), (8, 512, 4),
              (4, 512, 4), (4, 1024, 4), (8, 1024, 4), (2, 512, 4), (4, 256, 2), (8, 256, 2), (2, 1024, 4)]
# the 3-8 row kernel: thin blocks reduce over K in registers; BLOCK_N >= 16 uses tl.dot on 16 padded rows
ROWS_CANDIDATES = [(2, 512, 4), (4, 256, 4), (4, 512, 4), (8, 128, 4), (8, 256, 4), (4, 128, 2), (8, 256, 8),
                   (2, 1024, 4), (16, 128, 4), (16, 256, 4), (32, 128, 4), (32, 256, 8), (64, 128, 4), (16, 512, 8)]


def cold_micros(n: int, k: int, m: int, config: tuple[int, int, int], min_bytes: int = 256 << 20) -> float:
    """GPU microseconds per call of the Triton int8 GEMV with `config`, each call on another copy of the
    weights (enough copies to outgrow L2, cycled in one CUDA graph): the weights come from HBM, as in
    a decode step, where each matrix is read once per step."""
    from app.runners.kernels import int8_gemv
    from bench.gpu_int8_gemv import micros

    copies = max(2, -(-min_bytes // (n * k)))
    qs = [torch.randint(-127, 128, (n, k), device="cuda", dtype=torch.int8) for _ in range(copies)]
    scale = torch.rand(n, device="cuda", dtype=torch.bfloat16) * 0.01
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    y = torch.empty((m, n), device="cuda", dtype=torch.bfloat16)
    turn = [0]

    def call() -> None:  # captured `reps` times: the graph holds one launch per copy, in turn
        int8_gemv.launch(x, qs[turn[0] % copies], scale, y, config)
        turn[0] += 1
    reps = copies * max(1, 64 // copies)
    us = micros(call, reps)
    del qs
    torch.cuda.empty_cache()
    return us


def cold_table(path: str, rows: tuple[int, ...] = (1, 2)) -> None:
    """Every candidate config on every 1B shape, per row count, cold; the best pinned to `path`."""
    print(f"{'shape':10} {'M':>2}  best config (us, cold)  all candidates (BLOCK_N x BLOCK_K w warps: us)", flush=True)
    table, pins = {}, []
    for name, (n, k) in SHAPES.items():
        for m in rows:
            candidates = CANDIDATES if m <= 2 else ROWS_CANDIDATES
            us = [round(cold_micros(n, k, m, c), 2) for c in candidates]
            best = min(range(len(us)), key=us.__getitem__)
            row = {f"{bn}x{bk}w{w}": t for (bn, bk, w), t in zip(candidates, us)}
            table[f"{name} M{m}"] = row
            pins.append([n, k, m, *candidates[best]])
            print(f"{name:10} {m:>2}  {list(row)[best]} ({us[best]:.2f})  {row}", flush=True)
    with open(path, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "pins": pins, "cold_us": table}, f, indent=1)


def kernel_profile(fd, steps: int = 20, rows: int = 1) -> dict[str, float]:
    """GPU microseconds per one-token forward of `rows` rows by kernel name (torch.profiler over eager
    forwards: launch gaps differ from a graph replay, each kernel's own duration does not), largest first."""
    from torch.profiler import ProfilerActivity, profile

    tok = torch.zeros((rows, 1), dtype=torch.long, device="cuda")
    pos = torch.full((rows, 1), 300, dtype=torch.long, device="cuda")
    with torch.inference_mode():
        for _ in range(3):
            fd.forward(tok, pos, last_only=True)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                fd.forward(tok, pos, last_only=True)
            torch.cuda.synchronize()
    totals: dict[str, float] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            totals[e.name[:90]] = totals.get(e.name[:90], 0.0) + e.device_time / steps
    return {k: round(v, 2) for k, v in sorted(totals.items(), key=lambda kv: -kv[1])}


def rows_breakdown(rows: list[int], variants: list[str]) -> list[dict]:
    """The 1B draft's one-token forward over R rows (as the branching draft steps its rows), per
    variant (bf16; int8 with the few-row kernel `int8-triton` or Inductor's `int8-inductor`; a `:in-place`
    suffix reads the caches in place for 2+ rows, app/runners/kernels/rows_attention.py; `:no-split-k` launches the unsplit
    configs where split-K ones are pinned, app/runners/kernels/int8_gemv.py; `:unaligned` pins the split-K configs without
    the K offsets' alignment, H200_1B_SPLIT_K_UNALIGNED): one CUDA graph's time per forward and its
    kernels' GPU time by name (eager, torch.profiler)."""
    from app.runners.kernels import int8_gemv
    from app.runners.lean_llama import FastLlama
    from bench.gpu import random_llama
    from bench.gpu_int8_gemv import micros

    hf, out = random_llama("1b"), []
    defaults = dict(int8_gemv.PINNED)
    for variant in variants:
        gemms, *flags = variant.split(":")
        weights, _, few = gemms.partition("-")
        int8_gemv.use_split_k("no-split-k" not in flags)  # read at each launch, i.e. when a graph is captured
        int8_gemv.PINNED.clear()  # ":unaligned": the unaligned split-K pins instead of the defaults
        int8_gemv.PINNED.update({**int8_gemv.H200_1B_COLD, **int8_gemv.H200_1B_SPLIT_K_UNALIGNED}
                                if "unaligned" in flags else defaults)
        fd = FastLlama(hf, max_batch=max(rows), max_len=512, attention="grouped", weights=weights,
                       compile_elementwise=True, int8_few_rows=few or "triton",
                       decode_attention="triton" if "in-place" in flags else "matmul")
        for r in rows:
            tok = torch.zeros((r, 1), dtype=torch.long, device="cuda")
            pos = torch.full((r, 1), 300, dtype=torch.long, device="cuda")
            with torch.inference_mode():
                us = micros(lambda: fd.forward(tok, pos, last_only=True), 50)
                kernels = kernel_profile(fd, rows=r)
            row = {"variant": variant, "rows": r, "forward_us": round(us, 1), "kernels_us": kernels}
            out.append(row)
            print(f"{variant:30} R {r}: forward {us:7.1f} us (graph); eager kernels sum {sum(kernels.values()):7.1f} us; "
                  f"top: {dict(list(kernels.items())[:6])}", flush=True)
        del fd
        torch.cuda.empty_cache()
    int8_gemv.use_split_k(True)
    int8_gemv.PINNED.clear()
    int8_gemv.PINNED.update(defaults)
    return out


def child(one_row: str, profile: bool = False) -> dict:
    from app.runners.kernels import int8_gemv
    from bench.inproc.fast_decode import ControlledAcceptance, GreedyLoop
    from app.runners.lean_llama import FastLlama, quantize_int8
    from bench.gpu import loop_step_time, pair_step_extra, random_llama
    from bench.gpu_int8_gemv import micros

    max_len = 512
    fd = FastLlama(random_llama("1b"), max_len=max_len, attention="grouped", weights="int8",
                   compile_elementwise=True, int8_one_row=one_row)
    loop = GreedyLoop(fd, ControlledAcceptance(torch.zeros(max_len, dtype=torch.long, device="cuda"), 1.0,
                                               vocab=128256, seed=7))
    steps = [loop_step_time(loop, reps=100) * 1e3 for _ in range(5)]
    out: dict = {"one_row": one_row, "step_ms": statistics.median(steps), "step_ms_all": steps,
                 "pair_extra_ms": pair_step_extra(loop) * 1e3, "gemv_us": {}}
    x = torch.randn(1, 2048, device="cuda", dtype=torch.bfloat16)
    for name, (n, k) in SHAPES.items():
        w = quantize_int8(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02)
        xk = x if k == 2048 else torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        fn = (lambda: int8_gemv.int8_gemv(xk, w.q, w.scale)) if one_row == "triton" else \
            (lambda f=fd._int8_fn((n, k)): f(xk, w.q, w.scale))
        out["gemv_us"][name] = round(micros(fn, 200), 2)
    if profile:
        out["kernels_us"] = kernel_profile(fd)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--one-row", default="inductor,triton")
    ap.add_argument("--json", default="")
    ap.add_argument("--profile", action="store_true",
                    help="per trial, also the GPU time of one eager forward by kernel")
    ap.add_argument("--cold-table", default="", metavar="JSON",
                    help="time every candidate block config with cold weights, write the best per shape here, exit")
    ap.add_argument("--rows", default="1,2", help="--cold-table: the row counts to time (3-8: the few-row kernel)")
    ap.add_argument("--pins", default="", metavar="JSON", help="trials use these block configs (from --cold-table)")
    ap.add_argument("--rows-breakdown", default="", metavar="R,R,...",
                    help="time the forward over these row counts per --variants and profile its kernels, then exit")
    ap.add_argument("--variants", default="bf16,int8-triton,int8-inductor")
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.cold_table:
        cold_table(args.cold_table, tuple(int(m) for m in args.rows.split(",")))
        return
    if args.pins:
        load_pins(args.pins)
    if args.rows_breakdown:
        res = rows_breakdown([int(r) for r in args.rows_breakdown.split(",")], args.variants.split(","))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), "pins": args.pins, "results": res}, f, indent=1)
        return
    if args.child:
        print("RESULT " + json.dumps(child(args.child, args.profile)), flush=True)
        return
    print(torch.cuda.get_device_name(), flush=True)
    results = []
    t0 = time.perf_counter()
    for trial in range(args.trials):
        for one_row in args.one_row.split(","):
            with tempfile.TemporaryDirectory() as tmp:  # empty caches: this start tunes anew
                env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=f"{tmp}/inductor", TRITON_CACHE_DIR=f"{tmp}/triton")
                cmd = ([sys.executable, "-m", "bench.gpu_draft_step", "--child", one_row] + (["--profile"] if args.profile else [])
                       + (["--pins", args.pins] if args.pins else []))
                proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            if proc.returncode or not lines:
                print(f"trial {trial} {one_row} failed ({proc.returncode}):\n{proc.stderr[-3000:]}", flush=True)
                continue
            r = json.loads(lines[-1][len("RESULT "):])
            r["trial"] = trial
            results.append(r)
            print(f"[{time.perf_counter() - t0:.0f}s] trial {trial} {one_row:8} one-token step {r['step_ms']:.3f} ms "
                  f"(5 reps {min(r['step_ms_all']):.3f}-{max(r['step_ms_all']):.3f}), two-token extra "
                  f"{r['pair_extra_ms']:+.3f} ms; one-row GEMV us {r['gemv_us']}", flush=True)
    for r in results:
        if "kernels_us" in r:
            total = sum(r["kernels_us"].values())
            print(f"trial {r['trial']} {r['one_row']} step {r['step_ms']:.3f} ms; eager forward's kernels {total:.1f} us:")
            for name, us in list(r["kernels_us"].items())[:14]:
                print(f"  {us:8.2f}  {name}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
