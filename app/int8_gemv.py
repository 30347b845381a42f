"""A Triton GEMV for one or two rows against weight-only int8 weights (CUDA only).

Why: Inductor turns gpt-fast's `(x @ q.to(bf16).T) * scale` into a fused int8 GEMV for one row,
but not for two: the written-out reduction it compiles for two rows measured 0.5-0.6 ms more per
1B draft step than a one-row step on an H200 (bench/gpu.py `t_draft_pair_extra_ms`), against
0.15 ms for bf16 cuBLAS. A draft feeds two tokens after every fully accepted pass (the last
proposal and the target's bonus token), and the one-graph pass (app/fast_spec_graph.py) feeds two
every pass. Here each program loads a `[BLOCK_N, BLOCK_K]` tile of int8 weights once and
multiplies it into both rows, so two rows read the weights once, like one.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU build of torch comes without Triton: callers check AVAILABLE
    triton = None

AVAILABLE = triton is not None

if AVAILABLE:
    _CONFIGS = [triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w)
                for n, k, w in [(8, 256, 4), (16, 256, 4), (32, 128, 4), (16, 512, 4),
                                (32, 256, 8), (64, 128, 8), (8, 512, 4), (4, 512, 4)]]

    @triton.autotune(configs=_CONFIGS, key=["N", "K", "M"])
    @triton.jit
    def _int8_gemv_kernel(x_ptr, q_ptr, s_ptr, y_ptr, N: tl.constexpr, K: tl.constexpr,
                          M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # x [M, K] (M = 1 or 2), q [N, K] int8 row-major, s [N] -> y [M, N] = (x @ q.T) * s
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] output rows of this program
        n_ok = rn < N
        acc0 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        acc1 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)  # [BLOCK_K]
            k_ok = rk < K
            w = tl.load(q_ptr + rn[:, None] * K + rk[None, :], mask=n_ok[:, None] & k_ok[None, :],
                        other=0).to(tl.float32)  # [BLOCK_N, BLOCK_K], read once for both rows
            x0 = tl.load(x_ptr + rk, mask=k_ok, other=0.0).to(tl.float32)  # [BLOCK_K]
            acc0 += w * x0[None, :]
            if M == 2:
                x1 = tl.load(x_ptr + K + rk, mask=k_ok, other=0.0).to(tl.float32)
                acc1 += w * x1[None, :]
        s = tl.load(s_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)  # [BLOCK_N]
        tl.store(y_ptr + rn, (tl.sum(acc0, axis=1) * s).to(y_ptr.dtype.element_ty), mask=n_ok)
        if M == 2:
            tl.store(y_ptr + N + rn, (tl.sum(acc1, axis=1) * s).to(y_ptr.dtype.element_ty), mask=n_ok)


# (N, K, M) -> (BLOCK_N, BLOCK_K, num_warps) used instead of autotuning. Why: autotuning (Triton's here,
# Inductor's coordinate descent for its own one-row GEMV) times configs against the same weights over and
# over, which the 50 MB L2 of an H100/H200 then holds, but a decode step streams every matrix from HBM
# once. Tuned hot, the picks differed from start to start: the 1B draft's one-token step took
# 0.85-0.99 ms over six fresh starts on one H200, its GEMVs alone 627-697 us (bench/gpu_draft_step.py,
# bench/RESULTS.md section 2, session 17). The defaults below are the best of 14 configs timed with cold
# weights on an H200 (`python3 -m bench.gpu_draft_step --cold-table`) for the Llama-3.2-1B shapes; the
# kernel's result does not depend on the config, only its speed. Another card: re-measure and `pin`.
H200_1B_COLD: dict[tuple[int, int, int], tuple[int, int, int]] = {
    (3072, 2048, 1): (4, 512, 4), (3072, 2048, 2): (4, 1024, 4),  # wqkv
    (2048, 2048, 1): (2, 1024, 4), (2048, 2048, 2): (2, 1024, 4),  # wo
    (16384, 2048, 1): (4, 1024, 4), (16384, 2048, 2): (8, 1024, 4),  # w_gate_up
    (2048, 8192, 1): (2, 1024, 4), (2048, 8192, 2): (4, 1024, 4),  # w_down
    (128256, 2048, 1): (8, 256, 4), (128256, 2048, 2): (8, 1024, 4),  # lm_head
}
PINNED: dict[tuple[int, int, int], tuple[int, int, int]] = dict(H200_1B_COLD)


def pin(configs: dict[tuple[int, int, int], tuple[int, int, int]]) -> None:
    """Use these block configs for their (N, K, M) shapes from now on (no autotuning there)."""
    PINNED.update(configs)


def launch(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, y: torch.Tensor,
           config: tuple[int, int, int] | None = None) -> None:
    """One kernel launch writing y `[M, N]`: with `config` (BLOCK_N, BLOCK_K, num_warps), else the
    pinned one for the shape, else autotuned."""
    M, K = x.shape
    N = q.shape[0]
    config = config or PINNED.get((N, K, M))
    if config is None:
        _int8_gemv_kernel[lambda meta: (triton.cdiv(N, meta["BLOCK_N"]),)](x, q, scale, y, N, K, M)
        return
    block_n, block_k, warps = config
    _int8_gemv_kernel.fn[(triton.cdiv(N, block_n),)](x, q, scale, y, N, K, M, BLOCK_N=block_n, BLOCK_K=block_k,
                                                     num_warps=warps)


def int8_gemv(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x `[M, K]` (M = 1 or 2), q `[N, K]` int8, scale `[N]` -> `(x @ q.T) * scale` `[M, N]` in x's dtype.
    An unpinned (N, K, M) autotunes at its first call (outside any graph capture: warm up first)."""
    if not AVAILABLE:
        raise RuntimeError("int8_gemv needs Triton (it ships with CUDA builds of torch)")
    M, K = x.shape
    N = q.shape[0]
    if M not in (1, 2) or q.shape[1] != K or scale.shape != (N,):
        raise ValueError(f"int8_gemv takes x [1 or 2, K], q [N, K], scale [N]; got {tuple(x.shape)}, "
                         f"{tuple(q.shape)}, {tuple(scale.shape)}")
    x = x.contiguous()
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    launch(x, q, scale, y)
    return y
