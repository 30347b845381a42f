"""GPU batching: throughput and inter-token latency vs concurrency, plain and speculative.

    python3 -m bench.gpu_batch [--batches 1,2,4,8,16,32] [--steps 128] [--alpha 0.7] [--k 2]

Same 8B/1B-shaped random models and controlled-acceptance proposer as bench/gpu.py, with
b sequences decoding together: plain = one [b, 1] target pass per token; speculative =
per step, k batched draft passes [b, 1] then one batched verify pass [b, k+1], each row
accepting its own number of tokens (rows drift apart; positions are per row).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from app.runners.lean_llama import FastLlama
from bench.gpu import DEV, random_llama, sync


def plain(ft: FastLlama, prompts: torch.Tensor, steps: int) -> tuple[float, float, list[list[int]]]:
    b, P = prompts.shape
    out = torch.empty((steps, b), dtype=torch.long, device=DEV)
    positions = torch.arange(P, device=DEV).view(1, -1).expand(b, -1)
    tok = ft.forward(prompts, positions)[:, -1].argmax(-1).view(b, 1)
    pos = torch.full((b, 1), P, device=DEV)
    sync()
    t0 = time.perf_counter()
    for i in range(steps):
        out[i] = tok[:, 0]
        tok = ft.run(tok, pos)[:, -1].argmax(-1).view(b, 1)
        pos = pos + 1
    sync()
    seconds = time.perf_counter() - t0
    return b * steps / seconds, seconds / steps, out.T.tolist()


def speculative(ft: FastLlama, fd: FastLlama, prompts: torch.Tensor, steps: int, k: int, alpha: float,
                refs: list[list[int]], seed: int = 0) -> dict[str, float]:
    rng = random.Random(seed)
    b, P = prompts.shape
    vocab = ft.lm_head.shape[0]
    positions = torch.arange(P, device=DEV).view(1, -1).expand(b, -1)
    last = ft.forward(prompts, positions)[:, -1].argmax(-1).tolist()
    fd.forward(prompts, positions)
    emitted = [[t] for t in last]
    drafted = accepted = 0
    sync()
    t0 = time.perf_counter()
    gaps: list[float] = []
    for _ in range(steps):
        ts = time.perf_counter()
        n0 = torch.tensor([[P + len(e) - 1] for e in emitted], device=DEV)  # [b, 1] position of `last`
        tok = torch.tensor([[e[-1]] for e in emitted], device=DEV)
        pos = n0
        for _j in range(k):  # the draft's real cost: k batched passes
            tok = fd.run(tok, pos)[:, -1].argmax(-1).view(b, 1)
            pos = pos + 1
        props = []
        for r in range(b):
            row = []
            for j in range(k):
                right = refs[r][len(emitted[r]) + j]
                row.append(right if rng.random() < alpha else (right + 1 + rng.randrange(vocab - 1)) % vocab)
            props.append(row)
        inp = torch.tensor([[e[-1]] + p for e, p in zip(emitted, props)], device=DEV)  # [b, k+1]
        vpos = n0 + torch.arange(k + 1, device=DEV).view(1, -1)
        choice = ft.run(inp, vpos).argmax(-1)  # [b, k+1]
        acc = (choice[:, :k] == inp[:, 1:]).int().cumprod(1).sum(1)
        acc_l, choice_l = acc.tolist(), choice.tolist()  # the one host sync per step
        for r in range(b):
            a = acc_l[r]
            emitted[r] += props[r][:a] + [choice_l[r][a]]
            drafted += k
            accepted += a
        gaps.append((time.perf_counter() - ts) / (1 + sum(acc_l) / b))  # per-token latency this step
    sync()
    seconds = time.perf_counter() - t0
    tokens = sum(len(e) - 1 for e in emitted)
    gaps.sort()
    return {"tok_s": tokens / seconds, "itl_p50_ms": gaps[len(gaps) // 2] * 1e3,
            "itl_p99_ms": gaps[min(len(gaps) - 1, int(len(gaps) * 0.99))] * 1e3,
            "acceptance_rate": accepted / drafted}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", default="1,2,4,8,16,32")
    parser.add_argument("--steps", type=int, default=96)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--alpha", type=float, default=0.7)
    parser.add_argument("--k", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("bench/out/gpu_batch.json"))
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    P, steps, k = args.prompt_tokens, args.steps, args.k
    max_len = P + steps * (k + 1) + 2 * k + 8
    target, draft = random_llama("8b"), random_llama("1b")
    ft = FastLlama(target, max_batch=max(batches), max_len=max_len, compile_elementwise=True)
    fd = FastLlama(draft, max_batch=max(batches), max_len=max_len, compile_elementwise=True)
    gen = torch.Generator(DEV).manual_seed(1)
    rows = []
    for b in batches:
        for w in (1, k + 1):
            ft.capture(w, batch=b)
        fd.capture(1, batch=b)
        prompts = torch.randint(0, 128256, (b, P), device=DEV, generator=gen)
        plain(ft, prompts, 8)
        tok_s, itl, refs = plain(ft, prompts, steps * (k + 1) + k + 2)
        tok_s, itl, _ = plain(ft, prompts, steps)
        spec = speculative(ft, fd, prompts, steps, k, args.alpha, refs)
        rows.append({"batch": b, "plain_tok_s": tok_s, "plain_itl_ms": itl * 1e3,
                     **{f"spec_{key}": v for key, v in spec.items()}, "spec_over_plain": spec["tok_s"] / tok_s})
        print(rows[-1], flush=True)
    base = rows[0]["plain_tok_s"]
    res = {"card": torch.cuda.get_device_name() if DEV == "cuda" else "cpu", "alpha": args.alpha, "k": k,
           "steps": steps, "rows": rows, "plain_32_over_1": rows[-1]["plain_tok_s"] / base}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1))
    print(f"\n{'batch':>5} {'plain tok/s':>11} {'plain ITL ms':>12} {'spec tok/s':>10} {'spec p50/p99 ms':>16} {'acc':>5} {'spec/plain':>10}")
    for r in rows:
        print(f"{r['batch']:>5} {r['plain_tok_s']:>11.1f} {r['plain_itl_ms']:>12.2f} {r['spec_tok_s']:>10.1f} "
              f"{r['spec_itl_p50_ms']:>7.2f}/{r['spec_itl_p99_ms']:<8.2f} {r['spec_acceptance_rate']:>5.2f} {r['spec_over_plain']:>10.2f}")
    print(f"plain throughput at batch {rows[-1]['batch']} / batch 1: {res['plain_32_over_1']:.1f}x")


if __name__ == "__main__":
    main()
