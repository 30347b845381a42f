"""Where a pass of the device-verdict branching loop (app/fast_branch_graph.py) spends its time, per GPU.

    python3 -m bench.gpu_branch_timeline [--k 3 --steps 3 --rows 5 --alpha 0.7 --beta 0.41,0.52] [--sequential] [--bench-setup]
        [--draft-weights int8 [--int8-few-rows triton] [--pins pins.json]]

Two GPUs of one host, the 8B/1B-shaped random models of bench.gpu_branches (target cuda:0, draft
cuda:1), controlled acceptance. Timing events on both GPUs' pass streams around every replay show,
per pass (median, ms): how long the verify, the verdict and the draft's pass ran, and how long each
GPU sat idle between its passes (events on two devices cannot be compared, so each GPU's idle time
is from its own events: it includes waiting for the other GPU's pass, the copies and the verdict).

--sequential also times the one-graph sequential loop (bf16 and int8 drafts beside the target, k 2-4,
the best taken) after the branching loop, so the ratio of bench.gpu_branches comes out of this process
too; --bench-setup prepares the process as bench.gpu_branches does before its first timing (Dynamo's
recompile limit 64, both HF drafts built, target graphs for widths 1..7, then one call of each row
the bench times before its device-verdict rows, whose last draft the timed loop reuses), to find why the 8B pass
ran ~7 % slower there (bench/RESULTS.md section 2, session 13). The target's (k+1)-token replay is
timed at the start and at the end of the process.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch

from app.fast_branch_graph import BranchingPassGraphs
from app.fast_branches import BranchingDraft, ControlledBranches, branching_generate
from app.fast_decode import ControlledAcceptance, GreedyLoop, plain_generate, speculative_generate
from app.fast_llama import FastLlama
from app.fast_spec_graph import SpeculativePassGraph
from bench.gpu import loop_step_time, random_llama, step_time, timed
from bench.gpu_branches import branch_step_time


def replay_bench_rows(target: FastLlama, drafts_hf: dict, prompt: torch.Tensor, ref: torch.Tensor, n: int,
                      max_len: int, k: int, steps: int, rows: int, alpha: float, beta: float) -> BranchingDraft:
    """What bench.gpu_branches runs before its device-verdict rows, one call each: the sequential
    loops (bf16 and int8 drafts beside the target), the one-chain overlapped loop, the branching
    draft's step at every row count 2..8 on one 8-row model, and the host-verdict branching loop on
    a model of exactly `rows` rows, which is returned (the bench's device loop reuses it)."""
    def draft(dev: str, weights: str = "bf16", r: int = 1) -> FastLlama:
        return FastLlama(drafts_hf[dev], max_batch=r, max_len=max_len, attention="grouped", weights=weights,
                         compile_elementwise=True)
    for weights in ("bf16", "int8"):
        loop = GreedyLoop(draft("cuda:0", weights), ControlledAcceptance(ref.to("cuda:0"), alpha, vocab=128256, seed=7))
        loop_step_time(loop)
        SpeculativePassGraph(target, loop, k).generate(prompt, n)
        del loop
    chain = GreedyLoop(draft("cuda:1"), ControlledAcceptance(ref.to("cuda:1"), alpha, vocab=128256, seed=7))
    loop_step_time(chain)
    speculative_generate(target, chain, prompt, n, k, overlap_steps=steps)
    del chain
    torch.cuda.empty_cache()
    propose = ControlledBranches(ref.to("cuda:1"), alpha, beta, vocab=128256, seed=7)
    shared = draft("cuda:1", r=8)
    for r in range(2, 9):
        branch_step_time(BranchingDraft(shared, r, propose))
    exact = BranchingDraft(draft("cuda:1", r=rows), rows, propose)
    for fork_graph in (True, False):
        exact.fork_graph = fork_graph
        branching_generate(target, exact, prompt, n, k, steps)
    exact.fork_graph = True
    return exact


class TimedPasses(BranchingPassGraphs):
    """_queue_pass with timing events: (verdict start, verdict end, verify end) on the target's
    stream, (draft start, draft end) on the draft's."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.marks: list[tuple[torch.cuda.Event, ...]] = []

    def _queue_pass(self) -> None:
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(5)]
        with torch.cuda.stream(self._x1), torch.cuda.stream(self._x0):
            self._x1.wait_event(self._e_draft)
            self._x0.wait_event(self._e_verdict)
            self._mirror()
        self._s0.wait_stream(self._x0)
        with torch.cuda.stream(self._s0):
            ev[0].record(self._s0)
            self._g_verdict.replay()
            self._e_verdict.record(self._s0)
            ev[1].record(self._s0)
            self._g_verify.replay()
            ev[2].record(self._s0)
        with torch.cuda.stream(self._x0), torch.cuda.stream(self._x1):
            self._x0.wait_event(self._e_verdict)
            self._x1.wait_event(self._e_draft)
            self._send_control()
        self._s1.wait_stream(self._x1)
        with torch.cuda.stream(self._s1):
            ev[3].record(self._s1)
            self._g_draft.replay()
            self._e_draft.record(self._s1)
            ev[4].record(self._s1)
        self.marks.append(tuple(ev))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rows", type=int, default=5)
    ap.add_argument("--alpha", type=float, default=0.7)
    ap.add_argument("--beta", default="0.41", help="runner-up hit rate; a comma list times the loop at each")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--model-rows", type=int, default=None, help="cache rows of the draft model (default: --rows)")
    ap.add_argument("--eager-too", action="store_true", help="also time the loop with its control ops uncompiled")
    ap.add_argument("--sequential", action="store_true", help="also time the one-graph sequential loop (k 2-4)")
    ap.add_argument("--bench-setup", action="store_true", help="set the process up as bench.gpu_branches does")
    ap.add_argument("--free-earlier", action="store_true",
                    help="with --bench-setup: free everything the replayed rows built (models, graphs, cached blocks) "
                         "and time the loop on a fresh draft, to tell what the rows leave behind from what they did")
    ap.add_argument("--draft-weights", choices=("bf16", "int8"), default="bf16",
                    help="the branching draft's weights (int8: its R-row steps through --int8-few-rows)")
    ap.add_argument("--int8-few-rows", choices=("triton", "inductor"), default="triton",
                    help="kernel of the int8 draft's 3-8 row matmuls (app/int8_gemv.py's or Inductor's)")
    ap.add_argument("--decode-attention", choices=("matmul", "triton"), default="matmul",
                    help="the branching draft's attention over its rows (triton: app/rows_attention.py, in place)")
    ap.add_argument("--pins", default="", metavar="JSON",
                    help="int8 block configs to pin first (bench.gpu_draft_step --cold-table)")
    ap.add_argument("--sequential-weights", default="bf16,int8",
                    help="with --sequential: the sequential drafts' weights, the best of all taken")
    ap.add_argument("--calls", type=int, default=5,
                    help="whole calls timed per loop; the coins run on between calls, so each call draws other "
                         "hits: the mean rate over many calls estimates the expected speed, a median of 5 varied ~5 %%")
    args = ap.parse_args()
    if args.bench_setup and not args.free_earlier and (args.draft_weights, args.decode_attention) != ("bf16", "matmul"):
        ap.error("--bench-setup times the bench's own bf16 draft: --draft-weights/--decode-attention need --free-earlier")
    if args.pins:
        from bench.gpu_draft_step import load_pins
        load_pins(args.pins)
    P, n = 128, args.new_tokens
    max_len = P + n + 96
    drafts_hf = {}
    if args.bench_setup:
        torch._dynamo.config.recompile_limit = 64
    target = FastLlama(random_llama("8b"), max_len=max_len, compile_elementwise=True, attention="grouped")
    if args.bench_setup:
        drafts_hf = {"cuda:0": random_llama("1b"), "cuda:1": random_llama("1b", "cuda:1")}
    for w in range(1, 8) if args.bench_setup else (1, args.k + 1):
        target.capture(w)
    t_start = step_time(target, args.k + 1) * 1e3
    print(f"target {args.k + 1}-token replay at the start: {t_start:.3f} ms (bench setup: {args.bench_setup})", flush=True)
    prompt = torch.randint(0, 128256, (1, P), device="cuda:0", generator=torch.Generator("cuda").manual_seed(1))
    reference = plain_generate(GreedyLoop(target), prompt, n + 48)
    ref = torch.zeros(max_len, dtype=torch.long)
    ref[P: P + len(reference)] = torch.tensor(reference)
    draft_model = FastLlama(drafts_hf.get("cuda:1") or random_llama("1b", "cuda:1"),
                            max_batch=args.model_rows or args.rows, max_len=max_len, attention="grouped",
                            compile_elementwise=True, weights=args.draft_weights, int8_few_rows=args.int8_few_rows,
                            decode_attention=args.decode_attention)
    betas = [float(b) for b in args.beta.split(",")]
    propose = ControlledBranches(ref.to("cuda:1"), args.alpha, betas[0], vocab=128256, seed=7)
    bench_draft = None
    if args.bench_setup:
        bench_draft = replay_bench_rows(target, drafts_hf, prompt, ref, n, max_len, args.k, args.steps, args.rows,
                                        args.alpha, betas[0])
        if args.free_earlier:
            bench_draft = None
            gc.collect()
            for dev in ("cuda:0", "cuda:1"):
                with torch.cuda.device(dev):
                    torch.cuda.empty_cache()
        print(f"after the bench's earlier rows: target {args.k + 1}-token replay {step_time(target, args.k + 1) * 1e3:.3f} ms",
              flush=True)
    branch_ms: dict[float, tuple[float, float]] = {}  # beta -> (median, mean) call ms of the last timed loop
    for compiled in (True, False) if args.eager_too else (True,):
        branch_draft = bench_draft or BranchingDraft(draft_model, args.rows, propose)
        if bench_draft is None:
            print(f"{args.draft_weights} draft step over {args.rows} rows: {branch_step_time(branch_draft) * 1e3:.3f} ms",
                  flush=True)
        loop = TimedPasses(target, branch_draft, args.k, args.steps, compile_control=compiled)
        for beta in betas:
            branch_draft.propose.reseed(args.alpha, beta, seed=7)  # as the bench: capturing drew coins
            loop.generate(prompt, n)  # warm-up
            walls = []
            for _ in range(args.calls):  # whole calls, as bench.gpu_branches times them (median of 5)
                t0 = time.perf_counter()
                loop.generate(prompt, n)
                walls.append(round((time.perf_counter() - t0) * 1e3, 1))
            print(f"{args.calls} more calls, ms: {walls}")
            branch_ms[beta] = statistics.median(walls), statistics.mean(walls)
            loop.marks.clear()
            t0 = time.perf_counter()
            out, stats = loop.generate(prompt, n)
            wall = time.perf_counter() - t0
            cycles = [a[0].elapsed_time(b[0]) for a, b in zip(loop.marks, loop.marks[1:])]
            span = loop.marks[0][0].elapsed_time(loop.marks[-1][2])
            assert out == reference[:n], "output differs from plain greedy decoding"
            m = loop.marks[2:-2]  # inside the run, away from its first and last passes
            ms = lambda a, b: statistics.median(a_.elapsed_time(b_) for a_, b_ in zip(a, b))  # noqa: E731
            col = lambda i, shift=0: [x[i] for x in m[shift:len(m) - 1 + shift]]  # noqa: E731
            print(f"compiled control ops: {compiled}; k {args.k}, steps {args.steps}, rows {args.rows}, "
                  f"alpha {args.alpha}, beta {beta}; {stats.passes} passes; median ms per pass:")
            print(f"  cycle (verdict start to next)  {ms(col(0), col(0, 1)):.3f}")
            print(f"  verdict                        {ms(col(0), col(1)):.3f}")
            print(f"  verify                         {ms(col(1), col(2)):.3f}")
            print(f"  draft pass                     {ms(col(3), col(4)):.3f}")
            print(f"  verify end -> next verdict     {ms(col(2), col(0, 1)):.3f}  (target idle)")
            print(f"  draft end -> next draft start  {ms(col(4), col(3, 1)):.3f}  (draft idle)")
            print(f"  whole call {wall * 1e3:.1f} ms; first verdict to last verify {span:.1f} ms over {len(loop.marks)} "
                  f"queued passes; cycle mean {statistics.mean(cycles):.3f}, max {max(cycles):.3f}; cycles over 6 ms: "
                  f"{[round(c, 2) for c in cycles if c > 6]}", flush=True)
        del loop
    if args.sequential:
        hf = drafts_hf.get("cuda:0") or random_llama("1b")
        best = None
        for weights in args.sequential_weights.split(","):
            seq_draft = GreedyLoop(FastLlama(hf, max_len=max_len, attention="grouped", compile_elementwise=True,
                                             weights=weights),
                                   ControlledAcceptance(ref.to("cuda:0"), 1.0, vocab=128256, seed=7))
            print(f"sequential {weights} draft step: {loop_step_time(seq_draft) * 1e3:.3f} ms", flush=True)
            for k in (2, 3, 4):
                graph = SpeculativePassGraph(target, seq_draft, k)
                seq_draft.propose.reseed(args.alpha, seed=7)
                graph.generate(prompt, n)  # warm-up
                calls = [timed(lambda: graph.generate(prompt, n)) * 1e3 for _ in range(args.calls)]
                med, mean = statistics.median(calls), statistics.mean(calls)
                print(f"sequential one-graph {weights} k {k}: median call {med:.1f} ms ({n / med * 1e3:.1f} tok/s), "
                      f"mean {mean:.1f} ms ({n / mean * 1e3:.1f} tok/s)", flush=True)
                best = (med, mean) if best is None else (min(best[0], med), min(best[1], mean))
            del seq_draft, graph
            torch.cuda.empty_cache()
        for beta, (call_ms, mean_ms) in branch_ms.items():
            print(f"branching at beta {beta} (last timed loop) over the best sequential: by median calls "
                  f"{best[0] / call_ms:.3f}, by mean rate over {args.calls} calls {best[1] / mean_ms:.3f}")
    t_end = step_time(target, args.k + 1) * 1e3
    print(f"target {args.k + 1}-token replay at the end: {t_end:.3f} ms (start {t_start:.3f})", flush=True)


if __name__ == "__main__":
    main()
