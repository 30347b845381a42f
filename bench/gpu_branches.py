"""Overlapped drafting with runner-up branches against the sequential and one-chain overlapped loops.

    python3 -m bench.gpu_branches [--alphas 0.5,0.7,0.9] [--betas 0.41,0.52] [--device-verdict-only]
        [--branch-weights int8|bf16] [--decode-attention triton|matmul] [--branch-rows R,R] [--seeds N]
        [--out bench/out/gpu-branches.json]

Needs two GPUs of one host: the target (Llama-3.1-8B shaped, random bf16 weights) on cuda:0, the
overlapped drafts (Llama-3.2-1B shaped) on cuda:1; the sequential drafts run on cuda:0 beside the
target, as bench.gpu's do. Speed is measured at controlled acceptance, as in bench.gpu: the draft
model really runs, but proposes the target's own token with probability alpha. Branching also needs
a runner-up rate: when a proposal is wrong, the runner-up is the target's token with probability
beta (`bench.inproc.fast_branches.ControlledBranches`). The embedded trained pair's measured rates
(bench/draft_agreement.py): 0.52 on code, 0.41 on prose.

Rows, per alpha, all in one run on one card pair:
- sequential, one CUDA graph per pass (bench/inproc/fast_spec_graph.py), bf16 and int8 drafts: the baselines;
- overlapped as built (one chain; fast_decode.speculative_generate), bf16 draft;
- overlapped with branches (bench/inproc/fast_branches.py), int8 draft (--branch-weights) whose R-row step attends in
  place (--decode-attention), R cache rows (1 main + R - 1 branches), at each beta:
  as built (a pass's forks as one graph replay), with the eager fork, and (--both-orders) with the
  draft's work queued before the target's verify;
- the same branches with the verdict on the device (bench/inproc/fast_branch_graph.py), same k and R.
k and the overlap depth are chosen from this run's measured step costs by the loop's Markov chain
(bench/overlap_bound.py; for branches also R, the loop as built with its draft step priced at its R-row
cost). Each row's
output is checked against plain greedy decoding.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench.inproc.fast_branch_graph import BranchingPassGraphs
from bench.inproc.fast_branches import BranchingDraft, ControlledBranches, branching_generate
from bench.inproc.fast_decode import ControlledAcceptance, GreedyLoop, SpecStats, plain_generate, speculative_generate
from app.runners.lean_llama import FastLlama
from bench.inproc.fast_spec_graph import SpeculativePassGraph
from bench.gpu import BusyTimer, loop_step_time, random_llama, step_time, timed
from bench.overlap_bound import PassCosts, overlapped_ms_per_token, sequential_ms_per_token

VOCAB = 128256


def branch_step_time(draft: BranchingDraft, reps: int = 50) -> float:
    """One batched step over all of the draft's rows (seconds): parked rows cost the same as live ones."""
    draft.restart(1, 200)
    draft.advance(5)
    draft.restart(1, 200)
    return timed(lambda: draft.advance(reps)) / reps


def measure(fn, n: int, reps: int = 5) -> tuple[float, object]:
    """(tok/s of the median call, result) of `reps` calls of fn() after one warm-up call. The calls
    are identical (seeded coins: the same passes, branches and hits), yet one call's wall time
    varies by up to 12 % from run to run, so one call is not a measurement."""
    fn()
    out: dict[str, object] = {}
    seconds = sorted(timed(lambda: out.update(r=fn())) for _ in range(reps))
    return n / seconds[reps // 2], out["r"]


def pooled(stats: list[SpecStats]) -> SpecStats:
    """One SpecStats summing the counts of several calls (one per coin seed)."""
    total = SpecStats()
    for st in stats:
        for f in dataclasses.fields(SpecStats):
            if f.name != "widths":
                setattr(total, f.name, getattr(total, f.name) + getattr(st, f.name))
        for w, c in st.widths.items():
            total.widths[w] = total.widths.get(w, 0) + c
    return total


def measure_seeds(fn, reseed, n: int, seeds: list[int]) -> tuple[float, tuple[list[int], SpecStats], bool]:
    """measure() under each coin seed: (tokens over the summed median call times, (the first seed's
    output, the pooled stats), every seed's output identical to the first's). One seed's 256 tokens
    give a per-token acceptance within about ±0.03 of the nominal alpha, and two loops draw their coins
    in different orders, so a single seed can favour one loop by several percent."""
    seconds, stats, outs = 0.0, [], []
    for seed in seeds:
        reseed(seed)
        tok_s, (out, st) = measure(fn, n)
        seconds += n / tok_s
        stats.append(st)
        outs.append(out)
    return n * len(seeds) / seconds, (outs[0], pooled(stats)), all(o == outs[0] for o in outs)


def busy_per_pass(target: FastLlama, draft, fn) -> dict[str, float]:
    """One more call of fn() with CUDA events around every target pass and every batch of draft
    steps (bench.gpu.BusyTimer): ms per pass of wall time, target busy and draft busy. Where the
    wall time exceeds the target's busy time the target waited: for the draft, or for the host."""
    timer = BusyTimer(target, draft)
    out: dict[str, object] = {}
    wall = timed(lambda: out.update(r=fn()))
    busy = timer.finish()
    passes = out["r"][1].passes
    return {"wall_ms_per_pass": wall / passes * 1e3, "target_busy_ms_per_pass": busy["target_busy_s"] / passes * 1e3,
            "draft_busy_ms_per_pass": busy["draft_busy_s"] / passes * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--alphas", default="0.5,0.7,0.9")
    parser.add_argument("--betas", default="0.41,0.52")
    parser.add_argument("--max-k", type=int, default=6)
    parser.add_argument("--both-orders", action="store_true",
                        help="also run each branching row with the draft's work queued before the target's verify")
    parser.add_argument("--branch-weights", choices=("bf16", "int8"), default="int8",
                        help="weights of the branching draft (int8: the 3-8 row Triton GEMV of app/runners/kernels/int8_gemv.py)")
    parser.add_argument("--decode-attention", choices=("matmul", "triton"), default="triton",
                        help="the branching draft's R-row step attends in place (triton, app/runners/kernels/rows_attention.py) "
                             "or through batched matmuls over copied caches (matmul)")
    parser.add_argument("--device-verdict-only", action="store_true",
                        help="time only the device-verdict branching loop (skip the host-verdict variants)")
    parser.add_argument("--branch-rows", default="", metavar="R,R",
                        help="time the branching loop at these row counts (best k and L for each) instead of the best R")
    parser.add_argument("--seeds", type=int, default=1,
                        help="time every row under this many coin seeds (7, 8, ...) and pool them")
    parser.add_argument("--out", type=Path, default=Path("bench/out/gpu-branches.json"))
    args = parser.parse_args()
    seeds = list(range(7, 7 + args.seeds))
    branch_rows = [int(r) for r in args.branch_rows.split(",") if r]
    # the drafts' fused elementwise ops (compile_elementwise, dynamic shapes) meet a new batch size per
    # row count and per weights: more variants than Dynamo's default limit of 8 per function
    torch._dynamo.config.recompile_limit = 64
    if torch.cuda.device_count() < 2:
        raise SystemExit("bench.gpu_branches needs two GPUs of one host (the overlapped draft runs on cuda:1)")
    n, P, max_k = args.new_tokens, args.prompt_tokens, args.max_k
    t0 = time.perf_counter()
    log = lambda msg: print(f"[{time.perf_counter() - t0:.0f}s] {msg}", flush=True)  # noqa: E731
    res: dict[str, object] = {"card": torch.cuda.get_device_name(), "gpus": torch.cuda.device_count(),
                              "torch": torch.__version__, "new_tokens": n, "prompt_tokens": P}
    target_hf, draft_hf0, draft_hf1 = random_llama("8b"), random_llama("1b"), random_llama("1b", "cuda:1")
    prompt = torch.randint(0, VOCAB, (1, P), device="cuda:0", generator=torch.Generator("cuda").manual_seed(1))
    max_len = P + n + 3 * max_k + 64  # room for the device-verdict loop's fixed window and steps
    ft = FastLlama(target_hf, max_len=max_len, compile_elementwise=True, attention="grouped")
    for w in range(1, max_k + 2):
        ft.capture(w)
    t_ver = {w: step_time(ft, w) * 1e3 for w in range(1, max_k + 2)}  # ms
    plain_loop = GreedyLoop(ft)
    plain_generate(plain_loop, prompt, 32)  # warm-up: the prefill's graph is captured on first use
    reference: list[int] = []
    plain_tok_s = (n + 3 * max_k + 16) / timed(lambda: reference.extend(plain_generate(plain_loop, prompt, n + 3 * max_k + 16)))
    ref0 = torch.zeros(max_len, dtype=torch.long)
    ref0[P: P + len(reference)] = torch.tensor(reference)
    res.update(t_verify_8b_ms=t_ver, ours_plain_8b_tok_s=plain_tok_s)
    log(f"plain 8B {plain_tok_s:.1f} tok/s; target pass ms by width { {w: round(t, 3) for w, t in t_ver.items()} }")

    def fast_draft(device: str, weights: str, rows: int = 1) -> FastLlama:
        hf = draft_hf0 if device == "cuda:0" else draft_hf1
        return FastLlama(hf, max_batch=rows, max_len=max_len, attention="grouped", weights=weights,
                         compile_elementwise=True, decode_attention=args.decode_attention if rows > 1 else "matmul")

    alphas = [float(a) for a in args.alphas.split(",")]
    betas = [float(b) for b in args.betas.split(",")]
    rows: list[dict[str, object]] = []

    def record(mode: str, weights: str, alpha: float, beta: float | None, k: int, L: int, tok_s: float,
               out: list[int], stats, predicted_ms: float, same_every_seed: bool,
               model_ms: Callable[[float, float], float]) -> None:
        """model_ms(alpha, branch hit rate) -> the row's modelled ms per token, here taken again at
        the measured per-token acceptance and hit rate: what the coins dealt, separated from the loop."""
        row = {"mode": mode, "draft_weights": weights, "alpha": alpha, "beta": beta, "k": k, "overlap_steps": L,
               "tok_s": tok_s, "speedup_vs_plain": tok_s / plain_tok_s, "seeds": len(seeds),
               "identical_to_plain": out == reference[:n] and same_every_seed,
               "predicted_speedup": t_ver[1] / predicted_ms, "per_token_acceptance": stats.per_token_acceptance,
               "predicted_speedup_at_measured": t_ver[1] / model_ms(stats.per_token_acceptance,
                                                                    stats.branch_hits / max(1, stats.branch_tries)),
               "passes": stats.passes, "restarts": stats.restarts, "forks": stats.forks,
               "branch_tries": stats.branch_tries, "branch_hits": stats.branch_hits,
               "branch_hit_rate": stats.branch_hits / max(1, stats.branch_tries)}
        rows.append(row)
        log(json.dumps(row))

    # sequential baselines (draft beside the target on cuda:0), one graph per pass
    for weights in ("bf16", "int8"):
        loop = GreedyLoop(fast_draft("cuda:0", weights), ControlledAcceptance(ref0.to("cuda:0"), 1.0, vocab=VOCAB, seed=7))
        t_d = loop_step_time(loop) * 1e3
        res[f"t_draft_ms_sequential_{weights}"] = t_d
        costs = PassCosts(t_verify=t_ver, t_draft=t_d, t_pair_extra=0.0)
        for alpha in alphas:
            ms, k = min((sequential_ms_per_token(alpha, k, costs), k) for k in range(1, max_k + 1))
            graph = SpeculativePassGraph(ft, loop, k)
            tok_s, (out, stats), same = measure_seeds(lambda: graph.generate(prompt, n),
                                                      functools.partial(loop.propose.reseed, alpha), n, seeds)
            record("sequential-graph", weights, alpha, None, k, 0, tok_s, out, stats, ms, same,
                   lambda a, _h: sequential_ms_per_token(a, k, costs))
        del loop
        torch.cuda.empty_cache()

    # overlapped, one chain, bf16 draft on cuda:1
    ref1 = ref0.to("cuda:1")
    chain = GreedyLoop(fast_draft("cuda:1", "bf16"), ControlledAcceptance(ref1, 1.0, vocab=VOCAB, seed=7))
    t_d1 = loop_step_time(chain) * 1e3
    res["t_draft_ms_overlapped_bf16"] = t_d1
    log(f"draft step (ms): sequential bf16 {res['t_draft_ms_sequential_bf16']:.3f}, int8 "
        f"{res['t_draft_ms_sequential_int8']:.3f}; overlapped bf16 one row {t_d1:.3f}")
    one_row = PassCosts(t_verify=t_ver, t_draft=t_d1)
    for alpha in alphas:
        ms, k, L = min((overlapped_ms_per_token(alpha, k, L, one_row), k, L)
                       for k in range(1, max_k + 1) for L in range(1, k + 3))
        go = functools.partial(speculative_generate, ft, chain, prompt, n, k, overlap_steps=L)
        tok_s, (out, stats), same = measure_seeds(go, functools.partial(chain.propose.reseed, alpha), n, seeds)
        record("overlapped", "bf16", alpha, None, k, L, tok_s, out, stats, ms, same,
               lambda a, _h: overlapped_ms_per_token(a, k, L, one_row))
        chain.propose.reseed(alpha, seed=7)
        rows[-1]["busy"] = busy_per_pass(ft, chain, go)
        log(f"  per pass: {rows[-1]['busy']}")
    del chain
    torch.cuda.empty_cache()

    # overlapped with branches: one draft model with max_k + 2 cache rows, a BranchingDraft per row count
    bw = args.branch_weights
    model = fast_draft("cuda:1", bw, rows=max_k + 2)
    propose = ControlledBranches(ref1, 1.0, 0.0, vocab=VOCAB, seed=7)
    drafts = {r: BranchingDraft(model, r, propose) for r in range(2, max_k + 3)}
    t_rows = {r: branch_step_time(d) * 1e3 for r, d in drafts.items()}
    res[f"t_draft_ms_by_rows_{bw}"] = t_rows
    res["branch_decode_attention"] = args.decode_attention
    exact: dict[int, BranchingDraft] = {}
    log(f"{bw} draft step by rows, {args.decode_attention} attention (ms): "
        f"{ {r: round(t, 3) for r, t in t_rows.items()} }")

    def branch_ms(a: float, hit: float, k: int, L: int, R: int) -> float:
        """The loop as built (branch_rows), modelled ms per token: the draft step priced at its R-row cost."""
        return overlapped_ms_per_token(a, k, L, PassCosts(t_verify=t_ver, t_draft=t_rows[R]),
                                       branch_hit=hit, branch_rows=R - 1)

    shapes = [(k, L, R) for k in range(1, max_k + 1) for L in range(1, k + 3) for R in range(2, k + 3)]
    for alpha in alphas:
        for beta in betas:
            # k, overlap steps and rows (1 main + R - 1 branches) from this run's costs: the best (k, L, R)
            # overall, or (--branch-rows) the best k and L at each R asked for
            configs = ([min((branch_ms(alpha, beta, *c), *c) for c in shapes)] if not branch_rows else
                       [min((branch_ms(alpha, beta, *c), *c) for c in shapes if c[2] == R) for R in branch_rows])
            for ms, k, L, R in configs:
                # the loop as built (fork graph, verify queued first) and two variants side by side:
                # the eager fork and the draft's work queued before the verify
                if R not in exact:  # a draft model with exactly R cache rows, as a loop with R rows builds it
                    exact[R] = BranchingDraft(fast_draft("cuda:1", bw, rows=R), R, propose)
                drafts[R] = exact[R]
                variants = [] if args.device_verdict_only else [("branching", True, False), ("branching, eager fork", False, False)]
                if args.both_orders and not args.device_verdict_only:
                    variants.append(("branching, draft first", True, True))
                for mode, fork_graph, draft_first in variants:
                    drafts[R].fork_graph = fork_graph
                    go = lambda: branching_generate(ft, drafts[R], prompt, n, k, L, draft_first=draft_first)  # noqa: E731
                    tok_s, (out, stats), same = measure_seeds(go, lambda seed: propose.reseed(alpha, beta, seed=seed), n, seeds)
                    record(mode, bw, alpha, beta, k, L, tok_s, out, stats, ms, same,
                           lambda a, hit: branch_ms(a, hit, k, L, R))
                    propose.reseed(alpha, beta, seed=7)
                    rows[-1]["rows"] = R
                    rows[-1]["busy"] = busy_per_pass(ft, drafts[R], go)
                    log(f"  per pass: {rows[-1]['busy']}")
                drafts[R].fork_graph = True
                # the same k and R with the verdict on the device (bench/inproc/fast_branch_graph.py): the host only
                # queues graph replays; its draft runs L steps every pass, L <= k + 1
                # (as built: its small control ops compiled into a few kernels; and without compiling them)
                L_dev = min(L, k + 1)
                for mode, compiled in (("branching, device verdict", True), ("branching, device verdict, eager ops", False)):
                    device_loop = BranchingPassGraphs(ft, drafts[R], k, L_dev, compile_control=compiled)
                    # (reseeded after capture: capturing the draft's pass drew coins)
                    tok_s, (out, stats), same = measure_seeds(functools.partial(device_loop.generate, prompt, n),
                                                              lambda seed: propose.reseed(alpha, beta, seed=seed), n, seeds)
                    record(mode, bw, alpha, beta, k, L_dev, tok_s, out, stats, ms, same,
                           lambda a, hit: branch_ms(a, hit, k, L_dev, R))
                    rows[-1]["rows"] = R
                    del device_loop
    res["rows"] = rows
    res["wall_s"] = time.perf_counter() - t0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1))
    seq = {(r["draft_weights"], r["alpha"]): r["tok_s"] for r in rows if r["mode"] == "sequential-graph"}
    print(f"\n{res['card']} x{res['gpus']}, {n} new tokens after a {P}-token prompt, batch 1, greedy; "
          f"plain 8B {plain_tok_s:.1f} tok/s")
    print(f"{'mode':36} {'draft':5} {'α':>4} {'β':>5} {'k':>2} {'L':>2} {'R':>2} {'tok/s':>7} {'vs plain':>8} {'pred.':>6} "
          f"{'α̂':>5} {'pred@α̂':>6} {'/ seq bf16':>10} {'/ seq int8':>10} {'hits':>9} same")
    for r in rows:
        beta = "-" if r["beta"] is None else f"{r['beta']:.2f}"
        print(f"{r['mode']:36} {r['draft_weights']:5} {r['alpha']:4.1f} {beta:>5} {r['k']:2d} {r['overlap_steps']:2d} "
              f"{r.get('rows', 1):2d} "
              f"{r['tok_s']:7.1f} {r['speedup_vs_plain']:8.2f} {r['predicted_speedup']:6.2f} "
              f"{r['per_token_acceptance']:5.3f} {r['predicted_speedup_at_measured']:6.2f} "
              f"{r['tok_s'] / seq['bf16', r['alpha']]:10.2f} {r['tok_s'] / seq['int8', r['alpha']]:10.2f} "
              f"{r['branch_hits']:4d}/{r['branch_tries']:<4d} {r['identical_to_plain']}")


if __name__ == "__main__":
    main()
