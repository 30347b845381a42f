"""Where a one-graph sequential pass spends its time, per draft weight format (one GPU).

    python3 -m bench.gpu_pass_parts [--k 3] [--weights bf16,int8] [--profile] [--generate] [--out bench/out/gpu-pass-parts.json]

The same 8B target / 1B draft random-weight models as bench/gpu.py. Every part is captured as a
CUDA graph and timed over 50 replays: the target's verify pass over k+1 tokens, the draft's
1-token and 2-token steps (the 2-token step with all logits and with the last row's only), the
draft's share of a pass (one 2-token step, then k-1 single steps) as one graph, and the whole
pass (app/fast_spec_graph.py). "Unexplained" = pass - (verify + draft share): what the pass
costs beyond its parts. With --profile, torch.profiler's kernel table over 10 replays of the
pass, of the draft share and of the draft's 1- and 2-token steps (GPU time per kernel name, summed).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from app.fast_decode import ControlledAcceptance, GreedyLoop
from app.fast_llama import FastLlama, capture_graph
from app.fast_spec_graph import SpeculativePassGraph
from bench.gpu import random_llama, step_time, sync, timed

REPS = 50


def replay_time(graph: torch.cuda.CUDAGraph, before=lambda: None, reps: int = REPS) -> float:
    """Seconds per replay of `graph` (`before` runs once ahead of the timed replays)."""
    before()
    graph.replay()
    before()
    return timed(lambda: [graph.replay() for _ in range(reps)]) / reps


def kernel_table(fn, reps: int = 10, top: int = 25) -> list[dict[str, object]]:
    """GPU time per kernel name over `reps` calls of fn, largest first (µs per call)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        sync()
    rows = []
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", None)
        if us is None:
            us = getattr(e, "self_cuda_time_total", 0.0)
        if us > 0:
            rows.append({"kernel": e.key[:110], "us_per_call": us / reps, "launches_per_call": e.count / reps})
    rows.sort(key=lambda r: -r["us_per_call"])
    return rows[:top]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--weights", default="bf16,int8")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--generate", action="store_true",
                    help="also time a whole SpeculativePassGraph.generate() of 256 tokens against its passes and prefills")
    ap.add_argument("--widths", default="",
                    help="also time the draft's forward over this many tokens of one sequence, all logits kept, "
                         "e.g. 1,2,4,8: what a step that drafts branches beside the chain costs (bench/overlap_bound.py)")
    ap.add_argument("--out", type=Path, default=Path("bench/out/gpu-pass-parts.json"))
    args = ap.parse_args()
    k, dev, max_len = args.k, torch.device("cuda"), 1024
    t0 = time.perf_counter()
    target_hf, draft_hf = random_llama("8b"), random_llama("1b")
    ft = FastLlama(target_hf, max_len=max_len, compile_elementwise=True, attention="grouped")
    ft.capture(k + 1)
    ft.capture(1)
    res: dict[str, object] = {"card": torch.cuda.get_device_name(), "torch": torch.__version__, "k": k,
                              "t_decode_ms": step_time(ft, 1) * 1e3, "t_verify_ms": step_time(ft, k + 1) * 1e3}
    print(f"[{time.perf_counter() - t0:.0f}s] target decode {res['t_decode_ms']:.3f} ms, verify of {k + 1}: "
          f"{res['t_verify_ms']:.3f} ms", flush=True)
    ref = torch.zeros(max_len, dtype=torch.long, device=dev)
    for weights in args.weights.split(","):
        fd = FastLlama(draft_hf, max_len=max_len, compile_elementwise=True, attention="grouped", weights=weights)
        loop = GreedyLoop(fd, ControlledAcceptance(ref, 0.7, vocab=128256, seed=7))
        row: dict[str, object] = {}
        park = lambda: loop._pos[2].copy_(torch.tensor([[300, 301]], device=dev))  # noqa: E731
        # a 1-token step feeds back its own output at the next position: start each timing at 300
        row["step1_ms"] = replay_time(loop._graphs[1], lambda: loop._pos[1].fill_(300)) * 1e3
        row["step2_last_only_ms"] = replay_time(loop._graphs[2], park) * 1e3
        tok2, pos2 = torch.zeros((1, 2), dtype=torch.long, device=dev), torch.tensor([[300, 301]], device=dev)
        g_full, _ = capture_graph(dev, lambda: fd.forward(tok2, pos2))
        row["step2_all_logits_forward_ms"] = replay_time(g_full) * 1e3
        tok1, pos1 = torch.zeros((1, 1), dtype=torch.long, device=dev), torch.tensor([[300]], device=dev)
        g_one, _ = capture_graph(dev, lambda: fd.forward(tok1, pos1))
        row["step1_forward_ms"] = replay_time(g_one) * 1e3

        widths = [int(w) for w in args.widths.split(",") if w]
        row["forward_ms_by_width"] = {}
        for w in widths:
            tok_w = torch.zeros((1, w), dtype=torch.long, device=dev)
            pos_w = torch.arange(300, 300 + w, device=dev).view(1, -1)
            g_w, _ = capture_graph(dev, lambda: fd.forward(tok_w, pos_w))
            row["forward_ms_by_width"][w] = replay_time(g_w) * 1e3
            del g_w

        def draft_share() -> None:
            loop._step(2)
            for _ in range(k - 1):
                loop._step(1)
        g_share, _ = capture_graph(dev, draft_share, park)
        row["draft_share_ms"] = replay_time(g_share, park) * 1e3
        row["draft_share_from_parts_ms"] = row["step2_last_only_ms"] + (k - 1) * row["step1_ms"]
        spec = SpeculativePassGraph(ft, loop, k)
        row["pass_ms"] = replay_time(spec._graph, lambda: spec.n.fill_(200)) * 1e3
        row["pass_from_parts_ms"] = res["t_verify_ms"] + row["draft_share_ms"]
        row["unexplained_ms"] = row["pass_ms"] - row["pass_from_parts_ms"]
        print(f"[{time.perf_counter() - t0:.0f}s] {weights}: "
              f"{json.dumps({n: (round(v, 4) if isinstance(v, float) else v) for n, v in row.items()})}", flush=True)
        if args.profile:
            row["kernels_pass"] = kernel_table(lambda: (spec.n.fill_(200), spec._graph.replay()))
            row["kernels_draft_share"] = kernel_table(lambda: (park(), g_share.replay()))
            row["kernels_step1"] = kernel_table(lambda: (loop._pos[1].fill_(300), loop._graphs[1].replay()), top=40)
            row["kernels_step2"] = kernel_table(lambda: (park(), loop._graphs[2].replay()), top=40)
            for name in ("kernels_pass", "kernels_draft_share", "kernels_step1", "kernels_step2"):
                print(f"--- {weights} {name} (µs per replay, launches per replay)")
                for r in row[name]:
                    print(f"{r['us_per_call']:9.1f} {r['launches_per_call']:6.1f}  {r['kernel']}")
        if args.generate:
            # where a whole generate() call spends what its passes do not: the two prefills, the rounds
            prompt = torch.randint(0, 128256, (1, 128), device=dev, generator=torch.Generator("cuda").manual_seed(1))
            positions = torch.arange(128, device=dev).view(1, -1)
            spec.generate(prompt, 32)  # warm-up
            # eager (FastLlama.prefill) against the bucket graph (prefill_last, what generate() runs);
            # medians of 5 single calls
            med = lambda fn: sorted(timed(fn) for _ in range(5))[2] * 1e3  # noqa: E731
            row["target_prefill_eager_ms"] = med(lambda: ft.prefill(prompt, positions)[0, -1].argmax())
            row["draft_prefill_eager_ms"] = med(lambda: fd.prefill(prompt, positions)[0, -1].argmax())
            row["target_prefill_ms"] = med(lambda: ft.prefill_last(prompt)[0].argmax())
            row["draft_prefill_ms"] = med(lambda: loop.prefill(prompt)[0].argmax())
            if args.profile:  # the eager prefills: kernels and launches per call
                for name, fn in (("kernels_target_prefill", lambda: ft.prefill(prompt, positions)),
                                 ("kernels_draft_prefill", lambda: fd.prefill(prompt, positions))):
                    row[name] = kernel_table(fn, reps=3, top=30)
                    print(f"--- {weights} {name} (µs per call, launches per call)")
                    for r in row[name]:
                        print(f"{r['us_per_call']:9.1f} {r['launches_per_call']:6.1f}  {r['kernel']}")
            out: dict[str, object] = {}
            row["generate_256_ms"] = timed(lambda: out.update(r=spec.generate(prompt, 256))) * 1e3
            passes = out["r"][1].passes
            row["generate_passes"] = passes
            row["generate_minus_passes_and_prefills_ms"] = (row["generate_256_ms"] - passes * row["pass_ms"]
                                                            - row["target_prefill_ms"] - row["draft_prefill_ms"])
            print(f"[{time.perf_counter() - t0:.0f}s] {weights} generate: " + json.dumps(
                {n: round(row[n], 3) for n in ("target_prefill_eager_ms", "draft_prefill_eager_ms",
                                               "target_prefill_ms", "draft_prefill_ms", "generate_256_ms",
                                               "generate_passes", "generate_minus_passes_and_prefills_ms")}), flush=True)
        res[weights] = row
        torch.cuda.empty_cache()
    res["wall_s"] = time.perf_counter() - t0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1))
    print(json.dumps({w: {n: v for n, v in r.items() if not n.startswith("kernels")} if isinstance(r, dict) else r
                      for w, r in res.items()}, indent=1))


if __name__ == "__main__":
    main()
