"""On CUDA: the split-K form of the int8 few-row GEMV (app/runners/kernels/int8_gemv.py) computes `(x @ q.to(bf16).T) * scale`
for 1-8 rows on the Llama-3.2-1B shapes, in each form, launch after launch (the atomic form's workspace
must be zero again after each) and inside a replayed CUDA graph. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SHAPES_1B = [(3072, 2048), (2048, 2048), (2048, 8192), (16384, 2048)]  # wqkv, wo, w_down, w_gate_up
# a tl.dot block and a thin block (both work for any row count), and a block past N's end (N = 40)
CONFIGS = [(16, 256, 4, 4), (32, 128, 4, 8), (4, 256, 4, 2)]
SWAP_CONFIGS = [(64, 128, 4, 4), (128, 64, 4, 1), (128, 128, 8, 2)]  # the swapped dot; SPLIT_K 1: one store
# _int8_fma_kernel (session 21): unsplit, split (atomic epilogue), one-column blocks, blocks past N's end
FMA_CONFIGS = [(2, 512, 4, 1), (4, 256, 4, 2), (8, 128, 4, 4), (1, 1024, 4, 1), (2, 1024, 8, 1)]


def _err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return (got.float() - ref).abs().max().item() / ref.abs().max().item()


@pytest.mark.parametrize("form", ["atomic", "reduce", "atomic-swap", "atomic-aligned", "atomic-aligned-ns2", "fma"])
@pytest.mark.parametrize("n,k", SHAPES_1B + [(40, 1024)])
def test_int8_split_k_equals_the_dequantised_matmul(n: int, k: int, form: str) -> None:
    from app.runners.lean_llama import _int8_matmul, quantize_int8
    from app.runners.kernels.int8_gemv import launch

    torch.manual_seed(0)
    qw = quantize_int8(torch.randn(n, k, device="cuda", dtype=torch.bfloat16))
    for m in range(1, 9):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        ref = _int8_matmul(x, qw.q, qw.scale).float()
        for bn, bk, w, s in (SWAP_CONFIGS if form.endswith("swap") else FMA_CONFIGS if form == "fma" else CONFIGS):
            for _ in range(2):  # the second launch finds the atomic workspace as the first left it
                y = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
                launch(x, qw.q, qw.scale, y, (bn, bk, w, s, form))
                assert _err(y, ref) <= 1e-2, (m, bn, bk, w, s, form)  # bf16 rounding of the output


@pytest.mark.parametrize("form", ["atomic", "reduce", "atomic-aligned", "fma"])
def test_int8_split_k_in_a_cuda_graph(form: str) -> None:
    """Captured after one eager launch (which makes the atomic form's workspace), replayed on new inputs."""
    from app.runners.lean_llama import _int8_matmul, quantize_int8
    from app.runners.kernels.int8_gemv import launch

    torch.manual_seed(0)
    n, k, m = 2048, 8192, 5
    qw = quantize_int8(torch.randn(n, k, device="cuda", dtype=torch.bfloat16))
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    y = torch.empty((m, n), device="cuda", dtype=torch.bfloat16)
    config = (4, 256, 4, 4, form) if form == "fma" else (16, 256, 4, 8, form)
    launch(x, qw.q, qw.scale, y, config)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(3):  # three launches on one workspace within a replay
            launch(x, qw.q, qw.scale, y, config)
    for _ in range(3):
        x.copy_(torch.randn(m, k, device="cuda", dtype=torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        assert _err(y, _int8_matmul(x, qw.q, qw.scale).float()) <= 1e-2


def test_int8_split_k_pins_and_the_switch() -> None:
    """Every pinned split-K config gives the matmul; use_split_k(False) launches the unsplit pin instead."""
    from app.runners.kernels import int8_gemv
    from app.runners.lean_llama import _int8_matmul, quantize_int8

    assert {**int8_gemv.H200_1B_COLD, **int8_gemv.H200_1B_SPLIT_K}.items() <= int8_gemv.PINNED.items()
    torch.manual_seed(0)
    for (n, k, m), config in int8_gemv.H200_1B_SPLIT_K.items():
        assert len(config) == 5 and k % (config[3] * config[1]) == 0
        qw = quantize_int8(torch.randn(n, k, device="cuda", dtype=torch.bfloat16))
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        ref = _int8_matmul(x, qw.q, qw.scale).float()
        for on in (True, False):
            int8_gemv.use_split_k(on)
            try:
                assert int8_gemv.pinned_config(n, k, m) == (config if on else int8_gemv.H200_1B_COLD.get((n, k, m)))
                assert _err(int8_gemv.int8_gemv(x, qw.q, qw.scale), ref) <= 1e-2, (n, k, m, config, on)
            finally:
                int8_gemv.use_split_k(True)


def test_int8_split_k_refuses_a_config_that_does_not_divide_k() -> None:
    from app.runners.kernels.int8_gemv import launch

    x = torch.randn(2, 1000, device="cuda", dtype=torch.bfloat16)
    q = torch.zeros((64, 1000), device="cuda", dtype=torch.int8)
    with pytest.raises(ValueError, match="does not fit"):
        launch(x, q, torch.ones(64, device="cuda", dtype=torch.bfloat16), torch.empty(2, 64, device="cuda",
               dtype=torch.bfloat16), (16, 256, 4, 4, "atomic"))
