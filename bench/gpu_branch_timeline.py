"""Where a pass of the device-verdict branching loop (app/fast_branch_graph.py) spends its time, per GPU.

    python3 -m bench.gpu_branch_timeline [--k 3 --steps 3 --rows 5 --alpha 0.7 --beta 0.41]

Two GPUs of one host, the 8B/1B-shaped random models of bench.gpu_branches (target cuda:0, draft
cuda:1), controlled acceptance. Timing events on both GPUs' pass streams around every replay show,
per pass (median, ms): how long the verify, the verdict and the draft's pass ran, and how long each
GPU sat idle between its passes (events on two devices cannot be compared, so each GPU's idle time
is from its own events: it includes waiting for the other GPU's pass, the copies and the verdict).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from app.fast_branch_graph import BranchingPassGraphs
from app.fast_branches import BranchingDraft, ControlledBranches
from app.fast_decode import GreedyLoop, plain_generate
from app.fast_llama import FastLlama
from bench.gpu import random_llama


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
    ap.add_argument("--beta", type=float, default=0.41)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--model-rows", type=int, default=None, help="cache rows of the draft model (default: --rows)")
    ap.add_argument("--eager-too", action="store_true", help="also time the loop with its control ops uncompiled")
    args = ap.parse_args()
    P, n = 128, args.new_tokens
    max_len = P + n + 96
    target = FastLlama(random_llama("8b"), max_len=max_len, compile_elementwise=True, attention="grouped")
    for w in (1, args.k + 1):
        target.capture(w)
    prompt = torch.randint(0, 128256, (1, P), device="cuda:0", generator=torch.Generator("cuda").manual_seed(1))
    reference = plain_generate(GreedyLoop(target), prompt, n + 48)
    ref = torch.zeros(max_len, dtype=torch.long)
    ref[P: P + len(reference)] = torch.tensor(reference)
    draft_model = FastLlama(random_llama("1b", "cuda:1"), max_batch=args.model_rows or args.rows, max_len=max_len, attention="grouped",
                            compile_elementwise=True)
    propose = ControlledBranches(ref.to("cuda:1"), args.alpha, args.beta, vocab=128256, seed=7)
    for compiled in (True, False) if args.eager_too else (True,):
        loop = TimedPasses(target, BranchingDraft(draft_model, args.rows, propose), args.k, args.steps,
                           compile_control=compiled)
        loop.generate(prompt, n)  # warm-up
        walls = []
        for _ in range(3):  # whole calls, as bench.gpu_branches times them
            t0 = time.perf_counter()
            loop.generate(prompt, n)
            walls.append(round((time.perf_counter() - t0) * 1e3, 1))
        print(f"three more calls, ms: {walls}")
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
              f"alpha {args.alpha}, beta {args.beta}; {stats.passes} passes; median ms per pass:")
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


if __name__ == "__main__":
    main()
