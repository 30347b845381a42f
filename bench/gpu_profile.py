"""Where does a batch-1 decode step spend its time? (GPU)

    python3 -m bench.gpu_profile [--out bench/out/gpu-profile.json]

For the 8B- and 1B-shaped random models of bench/gpu.py, side by side on one card: FastLlama's
step time (CUDA graph, width 1 = decode, width 5 = verify of k=4) with each attention variant
(`sdpa`: F.scaled_dot_product_attention with an explicit mask; `grouped`: two batched GEMMs and a
fused masked softmax per layer), how far their logits differ, and the top CUDA kernels of one
eager decode step under torch.profiler (the kernels a graph replays are the same).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from app.fast_llama import FastLlama
from bench.gpu import random_llama, step_time, weight_bytes, copy_bandwidth


def top_kernels(fast: FastLlama, n_top: int = 14) -> list[dict[str, object]]:
    tok = torch.zeros((1, 1), dtype=torch.long, device="cuda")
    pos = torch.full((1, 1), 300, device="cuda")
    for _ in range(3):
        fast.forward(tok, pos)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            fast.forward(tok, pos)
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if us > 0:
            rows.append({"kernel": e.key[:90], "us_per_step": us / 5, "calls_per_step": e.count / 5})
    rows.sort(key=lambda r: -r["us_per_step"])
    total = sum(r["us_per_step"] for r in rows)
    return [{"total_kernel_us_per_step": total}] + rows[:n_top]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("bench/out/gpu-profile.json"))
    args = ap.parse_args()
    bw = copy_bandwidth()
    res: dict[str, object] = {"card": torch.cuda.get_device_name(), "torch": torch.__version__, "bandwidth_TBs": bw / 1e12}
    for shape in ("8b", "1b"):
        model = random_llama(shape)
        roof_ms = weight_bytes(model) / bw * 1e3
        out: dict[str, object] = {"roofline_step_ms": roof_ms}
        logits = {}
        for attention in ("sdpa", "grouped"):
            fast = FastLlama(model, max_len=512, compile_elementwise=True, attention=attention)
            prompt = torch.randint(0, 128256, (1, 300), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
            fast.prefill(prompt, torch.arange(300, device="cuda").view(1, -1))
            fast.capture(1), fast.capture(5)
            t1, t5 = step_time(fast, 1, reps=100), step_time(fast, 5, reps=100)
            tok = prompt[:, -5:]
            logits[attention] = fast.run(tok, torch.arange(300, 305, device="cuda").view(1, -1)).float().clone()
            out[attention] = {"decode_ms": t1 * 1e3, "verify5_ms": t5 * 1e3, "of_roofline": roof_ms / (t1 * 1e3),
                              "kernels": top_kernels(fast)}
            print(shape, attention, json.dumps(out[attention], indent=1), flush=True)
            del fast
            torch.cuda.empty_cache()
        diff = (logits["sdpa"] - logits["grouped"]).abs()
        out["grouped_vs_sdpa_max_abs_logit_diff"] = float(diff.max())
        out["grouped_vs_sdpa_argmax_agree"] = float((logits["sdpa"].argmax(-1) == logits["grouped"].argmax(-1)).float().mean())
        res[shape] = out
        del model
        torch.cuda.empty_cache()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1))
    for shape in ("8b", "1b"):
        o = res[shape]
        for a in ("sdpa", "grouped"):
            print(f"{shape} {a:8} decode {o[a]['decode_ms']:.3f} ms ({o[a]['of_roofline']:.1%} of roofline), "
                  f"verify5 {o[a]['verify5_ms']:.3f} ms")


if __name__ == "__main__":
    main()
