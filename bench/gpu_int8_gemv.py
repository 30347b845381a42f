"""int8 GEMV kernels for one and two rows on the 1B draft's weight shapes (GPU, one card).

    python3 -m bench.gpu_int8_gemv [--reps 200]

Per shape and row count M: bf16 cuBLAS (`x @ w.T`), Inductor's compiled int8 form
(`app.runners.lean_llama._int8_gemv`, coordinate descent tuning on, as FastLlama compiles it) and the
Triton kernel of `app/runners/kernels/int8_gemv.py`; microseconds per call (CUDA events over `reps` calls, after
warm-up) and the fraction of the int8 weight-read roofline. Checks each int8 result against
`(x @ q.to(bf16).T) * scale`.
"""

from __future__ import annotations

import argparse

import torch

from app.runners.lean_llama import _int8_gemv, _int8_matmul, _own_code, quantize_int8
from app.runners.kernels.int8_gemv import int8_gemv
from bench.gpu import copy_bandwidth

SHAPES = {"wqkv": (3072, 2048), "wo": (2048, 2048), "w_gate_up": (16384, 2048), "w_down": (2048, 8192),
          "lm_head": (128256, 2048)}


def micros(fn, reps: int) -> float:
    """GPU time per call: `reps` calls captured in one CUDA graph (as the decode loops run them, so
    host launch overhead, large for Triton's Python launcher, is not counted), replayed and timed."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # compile / autotune outside the capture
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=200)
    args = ap.parse_args()
    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}, copy bandwidth {bw / 1e12:.2f} TB/s")
    print(f"{'shape':10} {'M':>2} {'bf16 us':>8} {'inductor int8':>14} {'triton int8':>12} {'triton % roofline':>18} {'max err':>8}")
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        qw = quantize_int8(w)
        inductor = torch.compile(_own_code(_int8_gemv), fullgraph=True, dynamic=False,
                                 options={"coordinate_descent_tuning": True})
        for m in (1, 2):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = _int8_matmul(x, qw.q, qw.scale).float()
            err = (int8_gemv(x, qw.q, qw.scale).float() - ref).abs().max().item() / ref.abs().max().item()
            t_bf16 = micros(lambda: x @ w.T, args.reps)
            t_ind = micros(lambda: inductor(x, qw.q, qw.scale), args.reps)
            t_tri = micros(lambda: int8_gemv(x, qw.q, qw.scale), args.reps)
            ideal = (n * k + 2 * n) / bw * 1e6
            print(f"{name:10} {m:>2} {t_bf16:8.1f} {t_ind:14.1f} {t_tri:12.1f} {ideal / t_tri:18.1%} {err:8.1e}", flush=True)


if __name__ == "__main__":
    main()
