"""Split-K configs of the int8 few-row GEMV against the pinned unsplit ones, cold weights (GPU, one card).

    python3 -m bench.gpu_split_k [--rows 1,2,4,5,6] [--shapes wqkv,wo,w_down,w_gate_up] [--no-swap]
        [--json PATH] [--pins-out PATH]
    python3 -m bench.gpu_split_k --loop-steps 1,4,5,6 [--json PATH]  # the loops' draft step, split-K off / on
    python3 -m bench.gpu_split_k --search fma --rows 5,4,6,3,7,8 --full-rows 5 --top 10 [--shapes ...]
        [--json PATH] [--pins-out PATH]  # the fma form and aligned dots against the current pins
    python3 -m bench.gpu_split_k --loop-steps 4,5,6 --before unaligned [--pins PATH]  # the unaligned
        split-K pins against the current defaults (plus PATH's pins)

Why: the 1B draft's small matrices give the few-row kernel fewer programs than an H200 has SMs
(app/runners/kernels/int8_gemv.py's docstring). Per 1B weight shape and row count M this times the shape's pinned
unsplit config (app/runners/kernels/int8_gemv.py H200_1B_COLD) and every split-K candidate in both forms ("atomic":
one kernel, fp32 atomics and a last-program epilogue; "reduce": partials, then a second kernel; and for
3+ rows "atomic-swap", the dot turned round so the weights are its first, 64+ wide operand), each
with the weights cycled through enough copies to outgrow L2, as a decode step streams them
(bench.gpu_draft_step --cold-table does the same for the unsplit configs). Each candidate's result is
checked against `(x @ q.to(bf16).T) * scale` first; a wrong one is reported and never pinned. The best
candidate is pinned where it beats the unsplit pin by more than 3 % (--pins-out, the format of
bench.gpu_draft_step --pins).
"""

from __future__ import annotations

import argparse
import json

import torch

from bench.gpu_int8_gemv import SHAPES, micros

# tl.dot blocks (BLOCK_N >= 16: 3-8 rows) and thin reduction blocks (1-2 rows), x SPLIT_K, x both forms
DOT_CANDIDATES = ([(bn, bk, 4, s) for bn in (16, 32) for bk in (128, 256) for s in (2, 4, 8)]
                  + [(64, 128, 4, 2), (64, 128, 4, 4), (32, 256, 8, 2), (32, 256, 8, 4), (16, 512, 8, 2), (16, 512, 8, 4)])
THIN_CANDIDATES = [(bn, bk, 4, s) for bn, bk in ((2, 512), (4, 256), (4, 512), (8, 256)) for s in (2, 4)]
FORMS = ("atomic", "reduce")
# the weights as the dot's first operand (BLOCK_N >= 64, wgmma's m side), the atomic form (SPLIT_K 1: no sum)
SWAP_CANDIDATES = [(bn, bk, w, s, "atomic-swap") for bn, bk, w in ((64, 128, 4), (64, 256, 4), (128, 64, 4),
                                                                    (128, 128, 4), (128, 128, 8)) for s in (1, 2, 4, 8)]


# search "fma": _int8_fma_kernel's thin blocks (no tensor cores, one accumulator per row), unsplit or split
# (atomic epilogue), and the best unaligned tl.dot split configs and their neighbours, each with and
# without the K offsets' alignment told to the compiler ("-aligned")
FMA_BLOCKS = [(1, 1024, 4), (2, 1024, 4), (2, 512, 4), (4, 512, 4), (4, 256, 4), (8, 256, 4), (2, 2048, 8),
              (4, 1024, 8), (8, 512, 8), (2, 256, 2), (4, 512, 8), (8, 128, 4)]
ALIGNED_DOT = [(32, 128, 4, 4), (32, 256, 4, 2), (32, 256, 4, 4), (64, 128, 4, 4), (32, 128, 4, 8), (32, 64, 4, 8),
               (64, 64, 4, 4), (16, 256, 4, 4), (16, 128, 4, 8), (32, 128, 8, 4), (64, 128, 4, 2), (32, 128, 2, 4)]


# search "aligned": aligned dots only (the fma form loses 1.6-4x on every 1B shape), unsplit
# (SPLIT_K 1) and split, larger tiles, and Triton's num_stages
DOT_ALIGNED = [(32, 128, 4, 4), (32, 256, 4, 4), (32, 128, 4, 8), (32, 64, 4, 8), (64, 128, 4, 2), (64, 128, 4, 4),
            (64, 256, 4, 2), (128, 128, 4, 2), (128, 128, 8, 2), (128, 64, 4, 4), (64, 64, 4, 8), (32, 128, 4, 16),
            (32, 64, 4, 16), (16, 128, 4, 16), (64, 128, 8, 4), (32, 256, 4, 8), (64, 128, 4, 1), (128, 128, 4, 1),
            (64, 256, 4, 1), (128, 128, 8, 1), (128, 256, 8, 1), (256, 128, 8, 1)]
STAGES_ALIGNED = ("", "-ns1", "-ns2", "-ns4")


def candidates_aligned(m: int, k: int) -> list[tuple]:
    return [(*d, "atomic-aligned" + ns) for d in DOT_ALIGNED for ns in STAGES_ALIGNED
            if not k % (d[3] * d[1])] if m >= 3 else []


# search "swap-aligned" (run against the pins the first two found): the swapped dot with the K offsets
# aligned, and more tiles and pipeline depths around the winners
SWAP_ALIGNED = [(bn, bk, w, s) for bn, bk, w in ((64, 128, 4), (64, 256, 4), (128, 128, 4), (128, 128, 8), (64, 64, 4))
             for s in (1, 2, 4, 8)]
DOT_AROUND_PINS = [(32, 128, 4, 4), (32, 256, 4, 4), (64, 64, 4, 8), (32, 256, 4, 8), (32, 128, 4, 8), (64, 256, 4, 1),
            (64, 128, 4, 1), (64, 512, 4, 1), (128, 256, 8, 1), (64, 256, 8, 1), (64, 256, 4, 2), (32, 512, 4, 4),
            (32, 512, 4, 2), (32, 512, 4, 8)]


def candidates_swap_aligned(m: int, k: int) -> list[tuple]:
    if m < 3:
        return []
    return ([(*d, "atomic-swap-aligned") for d in SWAP_ALIGNED if not k % (d[3] * d[1])]
            + [(*d, "atomic-aligned" + ns) for d in DOT_AROUND_PINS for ns in ("", "-ns1", "-ns2", "-ns3", "-ns5")
               if not k % (d[3] * d[1])])


def candidates_fma(m: int, k: int) -> list[tuple]:
    """Search "fma": the configs for m rows and inner size k (those that divide k)."""
    out = [(bn, bk, w, s, "fma") for bn, bk, w in FMA_BLOCKS for s in (1, 2, 4) if not k % (s * bk)
           and (s < 4 or k >= 8192)]
    if m >= 3:
        out += [(*d, f) for d in ALIGNED_DOT for f in ("atomic", "atomic-aligned") if not k % (d[3] * d[1])]
    return out


SEARCHES = {"fma": candidates_fma, "aligned": candidates_aligned, "swap-aligned": candidates_swap_aligned}


def label_of(cfg: tuple) -> str:
    if len(cfg) == 3:
        return f"{cfg[0]}x{cfg[1]}w{cfg[2]}"
    bn, bk, w, s, form = cfg
    return f"{bn}x{bk}w{w}s{s}{form}"


def candidates(m: int, swap: bool) -> list[tuple]:
    """The split-K configs (BLOCK_N, BLOCK_K, num_warps, SPLIT_K, form) tried for m rows."""
    if m <= 2:
        return [(*c, f) for c in THIN_CANDIDATES for f in FORMS]
    return [(*c, f) for c in DOT_CANDIDATES for f in FORMS] + (SWAP_CANDIDATES if swap else [])


class ColdWeights:
    """Copies of one random int8 weight `[n, k]` (enough to outgrow L2) and its scale; `micros(m, config)`
    times the GEMV of m rows with each call on the next copy, in one CUDA graph."""

    def __init__(self, n: int, k: int, min_bytes: int = 256 << 20) -> None:
        self.n, self.k = n, k
        self.copies = max(2, -(-min_bytes // (n * k)))
        self.qs = [torch.randint(-127, 128, (n, k), device="cuda", dtype=torch.int8) for _ in range(self.copies)]
        self.scale = torch.rand(n, device="cuda", dtype=torch.bfloat16) * 0.01

    def check(self, m: int, config: tuple) -> float:
        """Relative max error of the config's result on copy 0, over three launches (the atomic form's
        workspace must be zero again after each)."""
        from app.runners.kernels import int8_gemv
        from app.runners.lean_llama import _int8_matmul

        x = torch.randn(m, self.k, device="cuda", dtype=torch.bfloat16)
        ref = _int8_matmul(x, self.qs[0], self.scale).float()
        err = 0.0
        for _ in range(3):
            y = torch.full((m, self.n), float("nan"), device="cuda", dtype=torch.bfloat16)
            int8_gemv.launch(x, self.qs[0], self.scale, y, config)
            err = max(err, (y.float() - ref).abs().max().item() / ref.abs().max().item())
        return err

    def micros(self, m: int, config: tuple) -> float:
        from app.runners.kernels import int8_gemv

        x = torch.randn(m, self.k, device="cuda", dtype=torch.bfloat16)
        y = torch.empty((m, self.n), device="cuda", dtype=torch.bfloat16)
        for q in self.qs:  # eagerly once per copy: the atomic form's workspaces exist before the capture
            int8_gemv.launch(x, q, self.scale, y, config)
        turn = [0]

        def call() -> None:
            int8_gemv.launch(x, self.qs[turn[0] % self.copies], self.scale, y, config)
            turn[0] += 1
        return micros(call, self.copies * max(1, 64 // self.copies))


def before_pins(spec: str) -> dict:
    """The whole pin table of a "before": "unaligned" (app/runners/kernels/int8_gemv.py's H200_1B_COLD and its split-K pins
    without the K offsets' alignment), else H200_1B_COLD plus a pins file's configs."""
    from app.runners.kernels import int8_gemv

    if spec == "unaligned":
        return {**int8_gemv.H200_1B_COLD, **int8_gemv.H200_1B_SPLIT_K_UNALIGNED}
    return {**int8_gemv.H200_1B_COLD, **read_pins(spec)}


def read_pins(paths: str) -> dict:
    """Comma-separated pins files (bench.gpu_draft_step --pins format), merged in order (later ones win)."""
    out = {}
    for path in paths.split(","):
        with open(path) as f:
            out.update({(n, k, m): tuple(config) for n, k, m, *config in json.load(f)["pins"]})
    return out


def loop_steps(rows: list[int], reps: int = 5, variants: list[tuple[str, dict | None]] | None = None) -> list[dict]:
    """The 1B int8 draft's step as the loops run it, split-K pins off then on: the branching draft's R-row
    step (bench/inproc/fast_branches.BranchingDraft on a model with exactly R cache rows, in-place attention, as
    bench.gpu_branches runs it; `branch_step_time`) and, for R 1, the one-row greedy loop's step
    (`bench.gpu.loop_step_time`). Median of `reps` timings of 50 steps each, in ms. `variants`: (label, the
    whole pin table, or None for the defaults with split-K off) per timing instead of split-K off / on."""
    import statistics

    from app.runners.kernels import int8_gemv
    from bench.inproc.fast_branches import BranchingDraft, ControlledBranches
    from bench.inproc.fast_decode import ControlledAcceptance, GreedyLoop
    from app.runners.lean_llama import FastLlama
    from bench.gpu import loop_step_time, random_llama
    from bench.gpu_branches import VOCAB, branch_step_time

    torch._dynamo.config.recompile_limit = 64  # a batch size per row count, as bench.gpu_branches
    hf, max_len, out = random_llama("1b"), 512, []
    ref = torch.zeros(max_len, dtype=torch.long, device="cuda")
    defaults = dict(int8_gemv.PINNED)
    variants = variants or [("split-K off", None), ("split-K on", defaults)]
    for r in rows:
        model = FastLlama(hf, max_batch=r, max_len=max_len, attention="grouped", weights="int8",
                          compile_elementwise=True, decode_attention="triton" if r > 1 else "matmul")
        for label, table in variants:
            on = table is not None
            int8_gemv.PINNED.clear()  # read when the step's graph is captured
            int8_gemv.PINNED.update(defaults if table is None else table)
            int8_gemv.use_split_k(on)
            if r == 1:
                loop = GreedyLoop(model, ControlledAcceptance(ref, 1.0, vocab=VOCAB, seed=7))
                times = [loop_step_time(loop) * 1e3 for _ in range(reps)]
            else:
                draft = BranchingDraft(model, r, ControlledBranches(ref, 1.0, 0.0, vocab=VOCAB, seed=7))
                times = [branch_step_time(draft) * 1e3 for _ in range(reps)]
            used = {name: int8_gemv.pinned_config(n, k, r) for name, (n, k) in SHAPES.items()}
            out.append({"rows": r, "variant": label, "split_k": on, "step_ms": statistics.median(times),
                        "step_ms_all": times, "configs": {k: list(v) if v else None for k, v in used.items()}})
            print(f"R {r} {label}: step {statistics.median(times):.3f} ms "
                  f"({min(times):.3f}-{max(times):.3f} over {reps} x 50 steps); configs {used}", flush=True)
        del model
        torch.cuda.empty_cache()
    int8_gemv.PINNED.clear()
    int8_gemv.PINNED.update(defaults)
    int8_gemv.use_split_k(True)
    return out


def search(shapes: list[str], rows: list[int], full_rows: set[int], top: int, json_path: str,
           deadline_s: float, which: str = "fma") -> list[list]:
    """A config search (`which`: a candidate set of SEARCHES): per shape and row count, the current pin
    (app/int8_gemv.pinned_config), H200_1B_COLD's unsplit config where it differs, and the set's
    candidates, cold (ColdWeights); rows in
    `full_rows` try every candidate, the others only the shape's `top` best of the full rows. A candidate
    that fails to compile or to match the matmul is reported and never pinned. The best is pinned where it
    beats the current pin by more than 3 % (or where nothing is pinned: there Triton autotunes hot).
    Returns the pins; writes every timing to json_path after each row."""
    import time

    from app.runners.kernels import int8_gemv

    t0, table, pins = time.perf_counter(), [], []
    for name in shapes:
        n, k = SHAPES[name]
        cold = ColdWeights(n, k)
        ranked: list[str] = []
        for m in rows:
            if time.perf_counter() - t0 > deadline_s:
                print(f"deadline: {name} M {m} and later not timed", flush=True)
                break
            current = int8_gemv.pinned_config(n, k, m)
            base = [("current", current)] if current else []
            if int8_gemv.H200_1B_COLD.get((n, k, m)) not in (None, current):
                base.append(("unsplit", int8_gemv.H200_1B_COLD[(n, k, m)]))
            pick = SEARCHES[which]
            cands = {label_of(c): c for c in pick(m, k)}
            if m not in full_rows and ranked:
                cands = {lb: cands[lb] for lb in ranked[:top] if lb in cands}
            row = {"shape": name, "n": n, "k": k, "m": m, "current_config": current, "us": {}, "bad": {}}
            for lb, cfg in [(f"{tag}:{label_of(c)}", c) for tag, c in base] + list(cands.items()):
                try:
                    err = cold.check(m, cfg)
                    if not err <= 1e-2:
                        row["bad"][lb] = err
                        continue
                    row["us"][lb] = round(cold.micros(m, cfg), 2)
                except Exception as e:  # a config that does not compile or launch
                    row["bad"][lb] = repr(e)[:300]
            cur_us = row["us"].get(f"current:{label_of(current)}") if current else None
            ranking = sorted((lb for lb in row["us"] if ":" not in lb), key=row["us"].get)
            if m in full_rows and not ranked:
                ranked = ranking
            best = ranking[0] if ranking else None
            row["best"], row["current_us"] = best, cur_us
            pinned = best is not None and (cur_us is None or row["us"][best] < 0.97 * cur_us)
            if pinned:
                pins.append([n, k, m, *cands[best]])
            row["pinned"] = pinned
            table.append(row)
            top5 = {lb: row["us"][lb] for lb in ranking[:5]}
            print(f"[{time.perf_counter() - t0:.0f}s] {name:10} M {m}: current {current} {cur_us} us; best {best} "
                  f"{row['us'].get(best)} us{' PIN' if pinned else ''}; top {top5}; bad {row['bad'] or 'none'}",
                  flush=True)
            if json_path:
                with open(json_path, "w") as f:
                    json.dump({"device": torch.cuda.get_device_name(), "table": table, "pins": pins}, f, indent=1)
        del cold
        torch.cuda.empty_cache()
    return pins


def main() -> None:
    from app.runners.kernels.int8_gemv import H200_1B_COLD

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,2,4,5,6")
    ap.add_argument("--shapes", default="wqkv,wo,w_down,w_gate_up")
    ap.add_argument("--no-swap", action="store_true", help="leave out the swapped-dot candidates")
    ap.add_argument("--json", default="", help="every timing and check")
    ap.add_argument("--pins-out", default="", help="the winning split-K configs, for bench.gpu_draft_step --pins")
    ap.add_argument("--loop-steps", default="", metavar="R,R",
                    help="instead: the draft's loop step at these row counts, split-K pins off and on")
    ap.add_argument("--pins", default="", help="--loop-steps, --search: load these pins first (bench.gpu_draft_step "
                                               "--pins; with --before or --search: comma-separated files)")
    ap.add_argument("--before", default="", metavar="unaligned|PATH",
                    help="--loop-steps: time this pin table (before_pins) against the defaults (and the defaults "
                         "plus --pins) instead of split-K off / on")
    ap.add_argument("--search", default="", choices=["", *SEARCHES],
                    help="a config search against the current pins: fma (the fma form and aligned dots), "
                         "aligned (aligned dots, larger tiles, num_stages), swap-aligned (the swapped dot, aligned)")
    ap.add_argument("--full-rows", default="5", help="--search: rows that try every candidate")
    ap.add_argument("--top", type=int, default=10, help="--search: other rows try the full rows' best this many")
    ap.add_argument("--deadline-s", type=float, default=1e9, help="--search: stop starting rows after this long")
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), flush=True)
    if args.search:
        if args.pins:  # "current" is then the defaults plus these pins
            from app.runners.kernels import int8_gemv
            int8_gemv.pin(read_pins(args.pins))
        pins = search(args.shapes.split(","), [int(r) for r in args.rows.split(",")],
                          {int(r) for r in args.full_rows.split(",")}, args.top, args.json, args.deadline_s,
                          args.search)
        print("pins " + json.dumps(pins), flush=True)
        if args.pins_out:
            with open(args.pins_out, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), "pins": pins}, f, indent=1)
        return
    if args.loop_steps:
        variants = None
        if args.before:
            from app.runners.kernels import int8_gemv
            variants = [(f"before ({args.before})", before_pins(args.before)), ("after (defaults)", dict(int8_gemv.PINNED))]
            if args.pins:
                variants.append((f"after (defaults + {args.pins})", {**int8_gemv.PINNED, **read_pins(args.pins)}))
        elif args.pins:
            from bench.int8_pins import load_pins
            load_pins(args.pins)
        res = loop_steps([int(r) for r in args.loop_steps.split(",")], variants=variants)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), "pins": args.pins, "loop_steps": res}, f, indent=1)
        return
    table, pins = [], []
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        cold = ColdWeights(n, k)
        for m in (int(r) for r in args.rows.split(",")):
            base_cfg = H200_1B_COLD.get((n, k, m))
            base = cold.micros(m, base_cfg) if base_cfg else None
            row = {"shape": name, "n": n, "k": k, "m": m, "unsplit_config": base_cfg, "unsplit_us": base,
                   "split_us": {}, "bad": {}}
            configs = {}
            for cfg in candidates(m, not args.no_swap):
                bn, bk, w, s, form = cfg
                if k % (s * bk):
                    continue
                label = f"{bn}x{bk}w{w}s{s}{form}"
                configs[label] = cfg
                err = cold.check(m, cfg)
                if not err <= 1e-2:  # bf16 rounding of the output; NaN: a block never written
                    row["bad"][label] = err
                    continue
                row["split_us"][label] = round(cold.micros(m, cfg), 2)
            best = min(row["split_us"], key=row["split_us"].get) if row["split_us"] else None
            row["best"] = best
            if best is not None and base is not None and row["split_us"][best] < 0.97 * base:
                pins.append([n, k, m, *configs[best]])

            def best_of(form: str) -> float | None:
                return min((v for lb, v in row["split_us"].items() if configs[lb][4] == form), default=None)
            best_atomic, best_reduce, best_swap = best_of("atomic"), best_of("reduce"), best_of("atomic-swap")
            table.append(row)
            print(f"{name:10} M {m}: unsplit {base_cfg} {base if base is None else round(base, 2)} us; best split "
                  f"{best} {row['split_us'].get(best)} us (best atomic {best_atomic}, reduce {best_reduce}, swapped {best_swap}); "
                  f"bad {row['bad'] or 'none'}", flush=True)
        del cold
        torch.cuda.empty_cache()
    print("pins " + json.dumps(pins), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "table": table}, f, indent=1)
    if args.pins_out:
        with open(args.pins_out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "pins": pins}, f, indent=1)


if __name__ == "__main__":
    main()
