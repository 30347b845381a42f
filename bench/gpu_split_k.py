"""Split-K configs of the int8 few-row GEMV against the pinned unsplit ones, cold weights (GPU, one card).

    python3 -m bench.gpu_split_k [--rows 1,2,4,5,6] [--shapes wqkv,wo,w_down,w_gate_up] [--no-swap]
        [--json PATH] [--pins-out PATH]
    python3 -m bench.gpu_split_k --loop-steps 1,4,5,6 [--json PATH]  # the loops' draft step, split-K off / on

Why: the 1B draft's small matrices give the few-row kernel fewer programs than an H200 has SMs
(app/int8_gemv.py's docstring). Per 1B weight shape and row count M this times the shape's pinned
unsplit config (app/int8_gemv.py H200_1B_COLD) and every split-K candidate in both forms ("atomic":
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
        from app import int8_gemv
        from app.fast_llama import _int8_matmul

        x = torch.randn(m, self.k, device="cuda", dtype=torch.bfloat16)
        ref = _int8_matmul(x, self.qs[0], self.scale).float()
        err = 0.0
        for _ in range(3):
            y = torch.full((m, self.n), float("nan"), device="cuda", dtype=torch.bfloat16)
            int8_gemv.launch(x, self.qs[0], self.scale, y, config)
            err = max(err, (y.float() - ref).abs().max().item() / ref.abs().max().item())
        return err

    def micros(self, m: int, config: tuple) -> float:
        from app import int8_gemv

        x = torch.randn(m, self.k, device="cuda", dtype=torch.bfloat16)
        y = torch.empty((m, self.n), device="cuda", dtype=torch.bfloat16)
        for q in self.qs:  # eagerly once per copy: the atomic form's workspaces exist before the capture
            int8_gemv.launch(x, q, self.scale, y, config)
        turn = [0]

        def call() -> None:
            int8_gemv.launch(x, self.qs[turn[0] % self.copies], self.scale, y, config)
            turn[0] += 1
        return micros(call, self.copies * max(1, 64 // self.copies))


def loop_steps(rows: list[int], reps: int = 5) -> list[dict]:
    """The 1B int8 draft's step as the loops run it, split-K pins off then on: the branching draft's R-row
    step (app/fast_branches.BranchingDraft on a model with exactly R cache rows, in-place attention, as
    bench.gpu_branches runs it; `branch_step_time`) and, for R 1, the one-row greedy loop's step
    (`bench.gpu.loop_step_time`). Median of `reps` timings of 50 steps each, in ms."""
    import statistics

    from app import int8_gemv
    from app.fast_branches import BranchingDraft, ControlledBranches
    from app.fast_decode import ControlledAcceptance, GreedyLoop
    from app.fast_llama import FastLlama
    from bench.gpu import loop_step_time, random_llama
    from bench.gpu_branches import VOCAB, branch_step_time

    torch._dynamo.config.recompile_limit = 64  # a batch size per row count, as bench.gpu_branches
    hf, max_len, out = random_llama("1b"), 512, []
    ref = torch.zeros(max_len, dtype=torch.long, device="cuda")
    for r in rows:
        model = FastLlama(hf, max_batch=r, max_len=max_len, attention="grouped", weights="int8",
                          compile_elementwise=True, decode_attention="triton" if r > 1 else "matmul")
        for on in (False, True):
            int8_gemv.use_split_k(on)  # read when the step's graph is captured
            if r == 1:
                loop = GreedyLoop(model, ControlledAcceptance(ref, 1.0, vocab=VOCAB, seed=7))
                times = [loop_step_time(loop) * 1e3 for _ in range(reps)]
            else:
                draft = BranchingDraft(model, r, ControlledBranches(ref, 1.0, 0.0, vocab=VOCAB, seed=7))
                times = [branch_step_time(draft) * 1e3 for _ in range(reps)]
            out.append({"rows": r, "split_k": on, "step_ms": statistics.median(times), "step_ms_all": times})
            print(f"R {r} split-K {'on ' if on else 'off'}: step {statistics.median(times):.3f} ms "
                  f"({min(times):.3f}-{max(times):.3f} over {reps} x 50 steps)", flush=True)
        del model
        torch.cuda.empty_cache()
    int8_gemv.use_split_k(True)
    return out


def main() -> None:
    from app.int8_gemv import H200_1B_COLD

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,2,4,5,6")
    ap.add_argument("--shapes", default="wqkv,wo,w_down,w_gate_up")
    ap.add_argument("--no-swap", action="store_true", help="leave out the swapped-dot candidates")
    ap.add_argument("--json", default="", help="every timing and check")
    ap.add_argument("--pins-out", default="", help="the winning split-K configs, for bench.gpu_draft_step --pins")
    ap.add_argument("--loop-steps", default="", metavar="R,R",
                    help="instead: the draft's loop step at these row counts, split-K pins off and on")
    ap.add_argument("--pins", default="", help="--loop-steps: load these pins first (bench.gpu_draft_step --pins)")
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), flush=True)
    if args.loop_steps:
        if args.pins:
            from bench.gpu_draft_step import load_pins
            load_pins(args.pins)
        res = loop_steps([int(r) for r in args.loop_steps.split(",")])
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
