"""Does compiling the whole lean forward beat fusing only its elementwise ops? (GPU, batch 1)

    python3 -m bench.gpu_compile [--mode max-autotune-no-cudagraphs] [--new-tokens 256] [--out F]

For the 8B- and 1B-shaped random models of bench/gpu.py, side by side in one run on one card:
FastLlama as bench/gpu.py uses it (elementwise ops fused by torch.compile, cuBLAS GEMMs) and
FastLlama with the whole forward compiled (`compile_forward`: Inductor may pick Triton kernels
for the skinny decode GEMMs), both captured as CUDA graphs. Reports the decode step time, plain
greedy tok/s over `--new-tokens`, the fraction of the copy-bandwidth roofline, the 1B/8B step
ratio (what a draft costs), and the compile time. The greedy tokens of both variants are compared.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from app.fast_llama import FastLlama
from app.fast_decode import GreedyLoop, plain_generate
from bench.gpu import copy_bandwidth, random_llama, step_time, timed, weight_bytes


def measure(model, prompt: torch.Tensor, n: int, **fast_kw) -> dict[str, object]:
    t0 = time.perf_counter()
    fast = FastLlama(model, max_len=prompt.shape[1] + n + 16, **fast_kw)
    fast.capture(1)  # the compile happens in capture's warm-up runs
    compile_s = time.perf_counter() - t0
    t_step = step_time(fast, 1, reps=100)
    loop = GreedyLoop(fast)
    plain_generate(loop, prompt, 16)
    tokens: list[int] = []
    tok_s = n / timed(lambda: tokens.extend(plain_generate(loop, prompt, n)))
    del fast
    torch.cuda.empty_cache()
    return {"step_ms": t_step * 1e3, "plain_tok_s": tok_s, "setup_s": compile_s, "tokens": tokens}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", default="max-autotune-no-cudagraphs")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--out", type=Path, default=Path("bench/out/gpu-compile.json"))
    args = ap.parse_args()
    bw = copy_bandwidth()
    res: dict[str, object] = {"card": torch.cuda.get_device_name(), "torch": torch.__version__,
                              "mode": args.mode, "bandwidth_TBs": bw / 1e12, "new_tokens": args.new_tokens}
    prompt = torch.randint(0, 128256, (1, args.prompt_tokens), device="cuda",
                           generator=torch.Generator("cuda").manual_seed(1))
    for shape in ("8b", "1b"):
        model = random_llama(shape)
        roofline = bw / weight_bytes(model)
        row: dict[str, object] = {"roofline_tok_s": roofline}
        for name, kw in (("elementwise", {"compile_elementwise": True}), ("whole_forward", {"compile_forward": args.mode})):
            try:
                r = measure(model, prompt, args.new_tokens, **kw)
            except Exception as e:  # noqa: BLE001 — a failed compile is a result to report, not a crash
                row[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                continue
            r["fraction_of_roofline"] = r["plain_tok_s"] / roofline
            row[name] = r
            print(shape, name, {k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items() if k != "tokens"},
                  flush=True)
        both = [row.get(n) for n in ("elementwise", "whole_forward")]
        if all(isinstance(b, dict) and "tokens" in b for b in both):
            row["same_greedy_tokens"] = sum(a == b for a, b in zip(both[0]["tokens"], both[1]["tokens"]))
        for b in both:
            if isinstance(b, dict):
                b.pop("tokens", None)
        res[shape] = row
        del model
        torch.cuda.empty_cache()
    for name in ("elementwise", "whole_forward"):
        try:
            res[f"draft_over_target_{name}"] = res["1b"][name]["step_ms"] / res["8b"][name]["step_ms"]
        except (KeyError, TypeError):
            pass
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
