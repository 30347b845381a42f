"""Triton GEMVs for a few rows (1 to MAX_ROWS) against weight-only int8 weights (CUDA only).

Why: Inductor turns gpt-fast's `(x @ q.to(bf16).T) * scale` into a fused int8 GEMV for one row,
but not for two: the written-out reduction it compiles for two rows measured 0.5-0.6 ms more per
1B draft step than a one-row step on an H200 (bench/gpu.py `t_draft_pair_extra_ms`), against
0.15 ms for bf16 cuBLAS. A draft feeds two tokens after every fully accepted pass (the last
proposal and the target's bonus token), and the one-graph pass (app/fast_spec_graph.py) feeds two
every pass. Here each program loads a `[BLOCK_N, BLOCK_K]` tile of int8 weights once and
multiplies it into both rows, so two rows read the weights once, like one.

Three to MAX_ROWS rows (the branching draft steps one row per branch, app/fast_branches.py) take a
second kernel: the same weight stripe per program, multiplied into all rows as a reduction (thin
blocks) or with tl.dot on 16 padded rows (BLOCK_N >= 16). Inductor's written-out form made an int8
draft step with 8 rows 3x its one-row cost (bench/RESULTS.md section 2, the widths table), which
ruled the int8 draft out of branching.
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

    _ROWS_CONFIGS = [triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w)
                     for n, k, w in [(4, 256, 4), (8, 128, 4), (8, 256, 4), (4, 512, 4), (2, 512, 4),
                                     (16, 256, 4), (32, 128, 4), (16, 128, 4)]]

    @triton.jit
    def _int8_rows_body(x_ptr, q_ptr, s_ptr, y_ptr, N: tl.constexpr, K: tl.constexpr, M: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # x [M, K] (3 <= M <= MAX_ROWS), q [N, K] int8, s [N] -> y [M, N] = (x @ q.T) * s. Each program
        # reads a [BLOCK_N, K] stripe of int8 weights once for all M rows.
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        rm = tl.arange(0, BLOCK_M)  # [BLOCK_M], rows past M masked
        n_ok, m_ok = rn < N, rm < M
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)  # [BLOCK_K]
            k_ok = rk < K
            w = tl.load(q_ptr + rn[:, None] * K + rk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0)
            x = tl.load(x_ptr + rm[:, None] * K + rk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            if BLOCK_N >= 16:  # tensor cores: int8 -> bf16 is exact (|q| <= 127), fp32 accumulation
                acc += tl.dot(x.to(tl.bfloat16), tl.trans(w.to(tl.bfloat16)))  # [BLOCK_M, BLOCK_N]
            else:  # a [BLOCK_M, BLOCK_N, BLOCK_K] product reduced over K: many thin programs, as the GEMV
                acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
        s = tl.load(s_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)  # [BLOCK_N]
        tl.store(y_ptr + rm[:, None] * N + rn[None, :], (acc * s[None, :]).to(y_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])

    _int8_rows_autotuned = triton.autotune(configs=_ROWS_CONFIGS, key=["N", "K", "M"])(
        triton.heuristics({"BLOCK_M": lambda a: rows_block(a["M"], a["BLOCK_N"])})(_int8_rows_body))

MAX_ROWS = 8  # the few-row kernel's limit; more rows (a prefill) are a GEMM's work


def rows_block(m: int, block_n: int) -> int:
    """The few-row kernel's BLOCK_M: tl.dot (BLOCK_N >= 16) needs 16 rows, the reduction the next power of two."""
    return 16 if block_n >= 16 else 1 << (m - 1).bit_length()


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
    # the few-row kernel (a branching draft's 4-6 rows; `--cold-table --rows 4,5,6`, session 18): tl.dot
    # blocks won every shape, 2-10x faster than the thin reduction blocks at these row counts
    **{(3072, 2048, m): (32, 256, 8) for m in (4, 5, 6)}, **{(2048, 2048, m): (16, 256, 4) for m in (4, 5, 6)},
    (16384, 2048, 4): (64, 128, 4), (16384, 2048, 5): (32, 128, 4), (16384, 2048, 6): (32, 128, 4),
    **{(2048, 8192, m): (16, 256, 4) for m in (4, 5, 6)}, **{(128256, 2048, m): (64, 128, 4) for m in (4, 5, 6)},
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
        kernel = _int8_gemv_kernel if M <= 2 else _int8_rows_autotuned
        kernel[lambda meta: (triton.cdiv(N, meta["BLOCK_N"]),)](x, q, scale, y, N, K, M)
        return
    block_n, block_k, warps = config
    grid = (triton.cdiv(N, block_n),)
    if M <= 2:
        _int8_gemv_kernel.fn[grid](x, q, scale, y, N, K, M, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps)
    else:
        _int8_rows_body[grid](x, q, scale, y, N, K, M, BLOCK_M=rows_block(M, block_n), BLOCK_N=block_n,
                              BLOCK_K=block_k, num_warps=warps)


def int8_gemv(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x `[M, K]` (1 <= M <= MAX_ROWS), q `[N, K]` int8, scale `[N]` -> `(x @ q.T) * scale` `[M, N]` in x's
    dtype. An unpinned (N, K, M) autotunes at its first call (outside any graph capture: warm up first)."""
    if not AVAILABLE:
        raise RuntimeError("int8_gemv needs Triton (it ships with CUDA builds of torch)")
    M, K = x.shape
    N = q.shape[0]
    if not 1 <= M <= MAX_ROWS or q.shape[1] != K or scale.shape != (N,):
        raise ValueError(f"int8_gemv takes x [1..{MAX_ROWS}, K], q [N, K], scale [N]; got {tuple(x.shape)}, "
                         f"{tuple(q.shape)}, {tuple(scale.shape)}")
    x = x.contiguous()
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    launch(x, q, scale, y)
    return y
