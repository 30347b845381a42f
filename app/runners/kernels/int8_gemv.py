"""Triton GEMVs for a few rows (1 to MAX_ROWS) against weight-only int8 weights (CUDA only).

Why: Inductor turns gpt-fast's `(x @ q.to(bf16).T) * scale` into a fused int8 GEMV for one row,
but not for two: the written-out reduction it compiles for two rows measured 0.5-0.6 ms more per
1B draft step than a one-row step on an H200 (bench/gpu.py `t_draft_pair_extra_ms`), against
0.15 ms for bf16 cuBLAS. A draft feeds two tokens after every fully accepted pass (the last
proposal and the target's bonus token), and the one-graph pass (bench/inproc/fast_spec_graph.py) feeds two
every pass. Here each program loads a `[BLOCK_N, BLOCK_K]` tile of int8 weights once and
multiplies it into both rows, so two rows read the weights once, like one.

Three to MAX_ROWS rows (the branching draft steps one row per branch, bench/inproc/fast_branches.py) take a
second kernel: the same weight stripe per program, multiplied into all rows as a reduction (thin
blocks) or with tl.dot on 16 padded rows (BLOCK_N >= 16). Inductor's written-out form makes an int8
draft step with 8 rows 3x its one-row cost (`python3 -m bench.gpu_draft_step --rows-breakdown 1,8
--variants int8-inductor`), which would rule the int8 draft out of branching.

Split-K (`_int8_split_k_kernel`): the 1B draft's small matrices (wo 2048x2048, wqkv 2048->3072, w_down
8192->2048) have so few output columns that the few-row kernel's tl.dot blocks (BLOCK_N >= 16) give
96-128 programs for 132 SMs; they stream their weights at ~1 TB/s on an H200 (`python3 -m
bench.gpu_split_k`). A split-K config (BLOCK_N, BLOCK_K, num_warps, SPLIT_K, form) adds a second grid axis over K, each
program summing K / SPLIT_K of the columns in fp32. Two forms of the final sum: "atomic" adds the
partials into a per-weight fp32 workspace with tl.atomic_add, and the program that finishes a column
block last (a per-block counter) reads the sums back while zeroing them, scales and writes y, then
resets its counter: one kernel, and the workspace is zero again after every launch, so a CUDA graph
needs no zero_ kernel. The sum's order varies from launch to launch (fp32 rounding, then bf16).
"reduce" writes the partials to a `[SPLIT_K, M, N]` buffer and a second small kernel sums them in a
fixed order: deterministic, one more launch.

Form flags: "-aligned" tells the compiler that the K offsets are multiples of BLOCK_K (the host checks
K % (SPLIT_K * BLOCK_K) == 0; Triton knows K only as a multiple of 16, so without the flag K // SPLIT_K is a
multiple of 16 / SPLIT_K and the int8 loads are narrower than 16 bytes): w_down at 5 rows 10.8 -> 8.6 us with
8 splits on an H200. "-nsN" sets num_stages. The "fma" form (_int8_fma_kernel, thin blocks without tensor
cores, one accumulator per row) is correct but 1.6-4x slower on every 1B shape (`python3 -m bench.gpu_split_k
--search fma`), so nothing pins it.
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

    def _rows_autotuned(configs: list) -> object:
        return triton.autotune(configs=configs, key=["N", "K", "M"])(
            triton.heuristics({"BLOCK_M": lambda a: rows_block(a["M"], a["BLOCK_N"])})(_int8_rows_body))

    _int8_rows_autotuned = _rows_autotuned(_ROWS_CONFIGS)
    # past 8 rows only tl.dot blocks: a thin block's [BLOCK_M, BLOCK_N, BLOCK_K] product would hold 16 rows
    _int8_many_rows_autotuned = _rows_autotuned([c for c in _ROWS_CONFIGS if c.kwargs["BLOCK_N"] >= 16])

    @triton.jit
    def _int8_split_k_kernel(x_ptr, q_ptr, s_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, K, BLOCK_M: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                             ATOMIC: tl.constexpr, SWAP: tl.constexpr = False, ALIGNED: tl.constexpr = False):
        # x [M, K], q [N, K] int8, s [N] -> y [M, N] = (x @ q.T) * s; program (pid_n, pid_k) sums the
        # K / SPLIT_K columns [pid_k * K / SPLIT_K, ...) of BLOCK_N output columns. The host checks
        # K % (SPLIT_K * BLOCK_K) == 0, so K needs no mask. M, N, K are runtime values (not constexpr,
        # unlike the kernels above) so that one compile per config serves every shape and row count.
        pid_n, pid_k = tl.program_id(0), tl.program_id(1)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        rm = tl.arange(0, BLOCK_M)  # [BLOCK_M], rows past M masked
        n_ok, m_ok = rn < N, rm < M
        k_len = K // SPLIT_K
        k_begin = pid_k * k_len
        if ALIGNED:  # "-aligned": K % (SPLIT_K * BLOCK_K) == 0 told to the compiler, as _int8_fma_kernel does
            k_len = tl.multiple_of(k_len, BLOCK_K)
            k_begin = tl.multiple_of(k_begin, BLOCK_K)
        if SWAP:  # y.T = q @ x.T: the int8 weights as the dot's first operand (wgmma's m >= 64 side)
            acc_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        elif BLOCK_N >= 16:  # tensor cores on 16 padded rows, as _int8_rows_body
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        else:  # thin blocks (1-2 rows): products summed over K once, after the loop
            acc3 = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(k_begin, k_begin + k_len, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)  # [BLOCK_K]
            if ALIGNED:
                rk = tl.multiple_of(k0, BLOCK_K) + tl.arange(0, BLOCK_K)
            w = tl.load(q_ptr + rn[:, None] * K + rk[None, :], mask=n_ok[:, None], other=0)  # [BLOCK_N, BLOCK_K]
            x = tl.load(x_ptr + rm[:, None] * K + rk[None, :], mask=m_ok[:, None], other=0.0)  # [BLOCK_M, BLOCK_K]
            if SWAP:
                acc_t += tl.dot(w.to(tl.bfloat16), tl.trans(x.to(tl.bfloat16)))  # [BLOCK_N, BLOCK_M]
            elif BLOCK_N >= 16:
                acc += tl.dot(x.to(tl.bfloat16), tl.trans(w.to(tl.bfloat16)))  # [BLOCK_M, BLOCK_N]
            else:
                acc3 += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
        if SWAP:
            acc = tl.trans(acc_t)  # [BLOCK_M, BLOCK_N]
        elif BLOCK_N < 16:
            acc = tl.sum(acc3, axis=2)  # [BLOCK_M, BLOCK_N]
        out_ok = m_ok[:, None] & n_ok[None, :]
        offs = rm[:, None] * N + rn[None, :]  # [BLOCK_M, BLOCK_N] into a row-major [M, N]
        if SPLIT_K == 1:  # nothing to sum across programs (a swapped unsplit config)
            s = tl.load(s_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)  # [BLOCK_N]
            tl.store(y_ptr + offs, (acc * s[None, :]).to(y_ptr.dtype.element_ty), mask=out_ok)
        elif ATOMIC:  # ws [MAX_ROWS, N] fp32, zero between launches; cnt [>= cdiv(N, BLOCK_N)] int32, zero too
            tl.atomic_add(ws_ptr + offs, acc, mask=out_ok, sem="relaxed")
            # every thread's adds before the counter's release (one thread does a scalar atomic): the
            # CTA barrier, then acq_rel at GPU scope, the split-K semaphore pattern of CUTLASS
            tl.debug_barrier()
            done = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu")  # programs finished before
            last = done == SPLIT_K - 1  # this program is the column block's last: the sums are complete
            total = tl.atomic_xchg(ws_ptr + offs, tl.zeros_like(acc), mask=out_ok & last, sem="relaxed")
            s = tl.load(s_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)  # [BLOCK_N]
            tl.store(y_ptr + offs, (total * s[None, :]).to(y_ptr.dtype.element_ty), mask=out_ok & last)
            tl.store(cnt_ptr + pid_n, 0, mask=last)  # every program of the block has counted: reset
        else:  # ws [SPLIT_K, M, N] fp32: this program's partial sums, _split_k_reduce adds them up
            tl.store(ws_ptr + pid_k * M * N + offs, acc, mask=out_ok)

    @triton.jit
    def _split_k_reduce(ws_ptr, s_ptr, y_ptr, M, N, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
        # ws [SPLIT_K, M, N] fp32, s [N] -> y [M, N] = sum over SPLIT_K * s, flat over M * N, fixed order
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
        ok = offs < M * N
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for i in tl.static_range(SPLIT_K):
            acc += tl.load(ws_ptr + i * M * N + offs, mask=ok, other=0.0)
        s = tl.load(s_ptr + offs % N, mask=ok, other=0.0).to(tl.float32)
        tl.store(y_ptr + offs, (acc * s).to(y_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _int8_fma_kernel(x_ptr, q_ptr, s_ptr, y_ptr, ws_ptr, cnt_ptr, N, K, M: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         SPLIT_K: tl.constexpr):
        # x [M, K] (1 <= M <= 8), q [N, K] int8, s [N] -> y [M, N] = (x @ q.T) * s without tensor cores: the
        # one-row kernel's thin blocks ([BLOCK_N, BLOCK_K] of int8 read once per program, elementwise fp32
        # products summed over K once, after the loop), with one accumulator per row (M is a constexpr, so no
        # row is padded: the few-row kernel's thin blocks pad M to a power of two and reduce every iteration).
        # SPLIT_K > 1: program (pid_n, pid_k) sums K / SPLIT_K columns and the split-K kernel's atomic epilogue
        # adds the column blocks' partials up (ws [MAX_ROWS, N] fp32 and cnt [N] int32, zero between launches).
        # N and K are runtime values (one compile per config and row count); the host checks
        # K % (SPLIT_K * BLOCK_K) == 0, which tl.multiple_of tells the compiler (16-byte int8 loads: Triton
        # knows K only as a multiple of 16, so K // SPLIT_K alone would be a multiple of 16 / SPLIT_K).
        pid_n, pid_k = tl.program_id(0), tl.program_id(1)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        n_ok = rn < N
        k_len = tl.multiple_of(K // SPLIT_K, BLOCK_K)
        k_begin = tl.multiple_of(pid_k * k_len, BLOCK_K)
        a0 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        a1 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        a2 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        a3 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        a4 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        a5 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        a6 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        a7 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, k_len, BLOCK_K):
            rk = k_begin + k0 + tl.arange(0, BLOCK_K)  # [BLOCK_K]
            w = tl.load(q_ptr + rn[:, None] * K + rk[None, :], mask=n_ok[:, None], other=0).to(tl.float32)
            a0 += w * tl.load(x_ptr + rk).to(tl.float32)[None, :]
            if M > 1:
                a1 += w * tl.load(x_ptr + K + rk).to(tl.float32)[None, :]
            if M > 2:
                a2 += w * tl.load(x_ptr + 2 * K + rk).to(tl.float32)[None, :]
            if M > 3:
                a3 += w * tl.load(x_ptr + 3 * K + rk).to(tl.float32)[None, :]
            if M > 4:
                a4 += w * tl.load(x_ptr + 4 * K + rk).to(tl.float32)[None, :]
            if M > 5:
                a5 += w * tl.load(x_ptr + 5 * K + rk).to(tl.float32)[None, :]
            if M > 6:
                a6 += w * tl.load(x_ptr + 6 * K + rk).to(tl.float32)[None, :]
            if M > 7:
                a7 += w * tl.load(x_ptr + 7 * K + rk).to(tl.float32)[None, :]
        # the rows' sums as one [BLOCK_M, BLOCK_N] tile (rows past M stay zero and are masked)
        rm = tl.arange(0, BLOCK_M)  # [BLOCK_M]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc = tl.where(rm[:, None] == 0, tl.sum(a0, axis=1)[None, :], acc)
        if M > 1:
            acc = tl.where(rm[:, None] == 1, tl.sum(a1, axis=1)[None, :], acc)
        if M > 2:
            acc = tl.where(rm[:, None] == 2, tl.sum(a2, axis=1)[None, :], acc)
        if M > 3:
            acc = tl.where(rm[:, None] == 3, tl.sum(a3, axis=1)[None, :], acc)
        if M > 4:
            acc = tl.where(rm[:, None] == 4, tl.sum(a4, axis=1)[None, :], acc)
        if M > 5:
            acc = tl.where(rm[:, None] == 5, tl.sum(a5, axis=1)[None, :], acc)
        if M > 6:
            acc = tl.where(rm[:, None] == 6, tl.sum(a6, axis=1)[None, :], acc)
        if M > 7:
            acc = tl.where(rm[:, None] == 7, tl.sum(a7, axis=1)[None, :], acc)
        out_ok = (rm < M)[:, None] & n_ok[None, :]
        offs = rm[:, None] * N + rn[None, :]  # [BLOCK_M, BLOCK_N] into a row-major [M, N]
        s = tl.load(s_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)  # [BLOCK_N]
        if SPLIT_K == 1:
            tl.store(y_ptr + offs, (acc * s[None, :]).to(y_ptr.dtype.element_ty), mask=out_ok)
        else:  # the split-K kernel's atomic epilogue
            tl.atomic_add(ws_ptr + offs, acc, mask=out_ok, sem="relaxed")
            tl.debug_barrier()
            done = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
            last = done == SPLIT_K - 1
            total = tl.atomic_xchg(ws_ptr + offs, tl.zeros_like(acc), mask=out_ok & last, sem="relaxed")
            tl.store(y_ptr + offs, (total * s[None, :]).to(y_ptr.dtype.element_ty), mask=out_ok & last)
            tl.store(cnt_ptr + pid_n, 0, mask=last)

# The few-row kernels' limit; more rows (a prefill) are a GEMM's work. 16: a draft step of 8 sequences
# feeds 2 tokens each (the last proposal and the target's token), and past this limit its first pass
# dequantised every weight for cuBLAS (5 bytes moved per weight instead of 1): the served 1B draft's
# call at 8 sequences and depth 1 took 6.9 ms against 2.0 at 4 on an H100 (bench/RESULTS.md section 1).
# With tl.dot blocks 9-16 rows are the same 16 padded rows as 3-8, so the same kernels and pins serve
# them (Triton may compile a variant for M = 16, a multiple of 16).
MAX_ROWS = 16
# Up to this many rows (a draft step of 32 sequences, 64 rows in its first pass) int8_gemv runs the
# few-row kernels on chunks of MAX_ROWS rows: each chunk reads the weights once (2 bytes a weight at 32
# rows, 4 at 64), still less than dequantising them for cuBLAS (5 bytes and a transient copy).
MAX_CHUNKED_ROWS = 4 * MAX_ROWS
# (BLOCK_N, BLOCK_K, num_warps), or split-K (BLOCK_N, BLOCK_K, num_warps, SPLIT_K, "atomic" | "reduce", either
# with "-swap" for the weights as the dot's first operand; SPLIT_K 1 with "-swap": the swapped dot unsplit), or
# (BLOCK_N, BLOCK_K, num_warps, SPLIT_K, "fma"): _int8_fma_kernel, unsplit (SPLIT_K 1) or with the atomic epilogue
BlockConfig = tuple[int, int, int] | tuple[int, int, int, int, str]


def rows_block(m: int, block_n: int) -> int:
    """The few-row kernel's BLOCK_M: tl.dot (BLOCK_N >= 16) needs 16 rows, the reduction the next power of two."""
    return 16 if block_n >= 16 else 1 << (m - 1).bit_length()


# (N, K, M) -> (BLOCK_N, BLOCK_K, num_warps) used instead of autotuning. Why: autotuning (Triton's here,
# Inductor's coordinate descent for its own one-row GEMV) times configs against the same weights over and
# over, which the 50 MB L2 of an H100/H200 then holds, but a decode step streams every matrix from HBM
# once. Tuned hot, the picks differ from start to start: the 1B draft's one-token step takes 0.85-0.99 ms
# over six fresh starts on one H200, its GEMVs alone 627-697 us (`python3 -m bench.gpu_draft_step --trials 6`:
# each trial a fresh process with empty compile caches). The defaults below are the best of 14 configs timed with cold
# weights on an H200 (`python3 -m bench.gpu_draft_step --cold-table`) for the Llama-3.2-1B shapes; the
# kernel's result does not depend on the config, only its speed. Another card: re-measure and `pin`.
H200_1B_COLD: dict[tuple[int, int, int], BlockConfig] = {
    (3072, 2048, 1): (4, 512, 4), (3072, 2048, 2): (4, 1024, 4),  # wqkv
    (2048, 2048, 1): (2, 1024, 4), (2048, 2048, 2): (2, 1024, 4),  # wo
    (16384, 2048, 1): (4, 1024, 4), (16384, 2048, 2): (8, 1024, 4),  # w_gate_up
    (2048, 8192, 1): (2, 1024, 4), (2048, 8192, 2): (4, 1024, 4),  # w_down
    (128256, 2048, 1): (8, 256, 4), (128256, 2048, 2): (8, 1024, 4),  # lm_head
    # the few-row kernel (a branching draft's 4-6 rows; `--cold-table --rows 4,5,6`): tl.dot blocks win
    # every shape, 2-10x faster than the thin reduction blocks at these row counts
    **{(3072, 2048, m): (32, 256, 8) for m in (4, 5, 6)}, **{(2048, 2048, m): (16, 256, 4) for m in (4, 5, 6)},
    (16384, 2048, 4): (64, 128, 4), (16384, 2048, 5): (32, 128, 4), (16384, 2048, 6): (32, 128, 4),
    **{(2048, 8192, m): (16, 256, 4) for m in (4, 5, 6)}, **{(128256, 2048, m): (64, 128, 4) for m in (4, 5, 6)},
}
# Split-K configs (BLOCK_N, BLOCK_K, num_warps, SPLIT_K, form) without the K offsets' alignment ("-aligned"):
# the first split-K pins, kept as the "before" of `bench.gpu_split_k --before unaligned` and `bench.gpu_draft_step
# --variants ...:unaligned`; H200_1B_SPLIT_K below replaces them. Chosen against the configs above with cold
# weights (`python3 -m bench.gpu_split_k`, two runs on one H200 give the same picks), pinned where they beat
# them by > 3 %. 4-6 rows (tl.dot blocks padded to 16 rows): wqkv 7.2 -> 6.1 us, wo 6.0 -> 5.4, w_down
# 17.4 -> 10.8; the atomic form beats the reduce form by 0.4-0.6 us on every one, the swapped dot loses.
# Split-K loses or ties at 1-2 rows (thin blocks: 1.4-2x slower split) and for w_gate_up and lm_head at 4-6
# rows (already 512 and 2004 programs).
H200_1B_SPLIT_K_UNALIGNED: dict[tuple[int, int, int], BlockConfig] = {
    **{(3072, 2048, m): (32, 128, 4, 4, "atomic") for m in (4, 5, 6)},  # wqkv: 96 -> 384 programs
    **{(2048, 2048, m): (32, 128, 4, 4, "atomic") for m in (4, 5, 6)},  # wo: 128 -> 256
    **{(2048, 8192, m): (32, 256, 4, 4, "atomic") for m in (4, 5, 6)},  # w_down: 128 -> 256
}
# The split-K pins in use, with the K offsets' alignment told to the compiler ("-aligned"; without it Triton
# knows K only as a multiple of 16, so K // SPLIT_K is a multiple of 4: 4-byte int8 loads). From `python3 -m
# bench.gpu_split_k --search fma` then `--search aligned`, two runs on one H200, cold weights. 5 rows, µs,
# against the unaligned pins: wqkv 6.15 -> 5.75-5.80, wo 5.42 -> 5.14, w_down 10.81 -> 8.60 (8 splits instead
# of 4), w_gate_up 12.5 -> 12.0 (the split-K kernel unsplit, 64x256 blocks, against the few-row kernel's
# 32x128). Pinned for 3-8 rows, and for 9-16 (the same kernels on 16 padded rows; not timed there).
# lm_head: 64x256 unsplit is within 1 % of the few-row pin at 4-6 rows (not pinned there), pinned at 3 and
# 7-16. The fma form (_int8_fma_kernel) is 1.6-4x slower on every shape.
H200_1B_SPLIT_K: dict[tuple[int, int, int], BlockConfig] = {
    **{(3072, 2048, m): (32, 128, 4, 4, "atomic-aligned") for m in range(3, MAX_ROWS + 1)},  # wqkv
    **{(2048, 2048, m): (32, 256, 4, 4, "atomic-aligned") for m in range(3, MAX_ROWS + 1)},  # wo
    **{(2048, 8192, m): (32, 256, 4, 8, "atomic-aligned") for m in range(3, MAX_ROWS + 1)},  # w_down: 4 -> 8 splits
    **{(16384, 2048, m): (64, 256, 4, 1, "atomic-aligned") for m in range(3, MAX_ROWS + 1)},  # w_gate_up, unsplit
    **{(128256, 2048, m): (64, 256, 4, 1, "atomic-aligned") for m in (3, 7, *range(8, MAX_ROWS + 1))},  # lm_head
}
PINNED: dict[tuple[int, int, int], BlockConfig] = {**H200_1B_COLD, **H200_1B_SPLIT_K}
SPLIT_K_ENABLED = True  # False: every split-K pin falls back to H200_1B_COLD's config (benches' "before")


def pin(configs: dict[tuple[int, int, int], BlockConfig]) -> None:
    """Use these block configs for their (N, K, M) shapes from now on (no autotuning there)."""
    PINNED.update(configs)


def use_split_k(on: bool) -> None:
    """Turn the pinned split-K configs on or off (off: the shape's unsplit H200_1B_COLD config, or autotuning)."""
    global SPLIT_K_ENABLED
    SPLIT_K_ENABLED = on


def pinned_config(n: int, k: int, m: int) -> BlockConfig | None:
    config = PINNED.get((n, k, m))
    if config is not None and len(config) > 3 and not SPLIT_K_ENABLED:
        config = H200_1B_COLD.get((n, k, m))
    return config


# (device index, weight data_ptr, N) -> (fp32 sums [MAX_ROWS, N], int32 counters [N]), both zero between
# launches. Per weight matrix, so that two launches can only share one if they run the same weights at once
# on two streams (nothing here does: a model's forward runs on one stream).
_WORKSPACES: dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor]] = {}


def _workspace(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    key = (q.device.index or 0, q.data_ptr(), q.shape[0])
    ws = _WORKSPACES.get(key)
    if ws is None:
        if torch.cuda.is_current_stream_capturing():  # zeros made in a capture are only zeroed at replay
            raise RuntimeError("int8 split-K: run each weight once eagerly before capturing it in a CUDA graph")
        n = q.shape[0]
        ws = (torch.zeros((MAX_ROWS, n), dtype=torch.float32, device=q.device),
              torch.zeros(n, dtype=torch.int32, device=q.device))
        _WORKSPACES[key] = ws
    return ws


def _launch_split_k(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, y: torch.Tensor, block_n: int,
                    block_k: int, warps: int, split: int, form: str) -> None:
    M, K = x.shape
    N = q.shape[0]
    # "atomic" | "reduce" | "fma", then flags: "-swap" the weights as the dot's first operand, "-aligned" the K
    # offsets' alignment told to the compiler (the fma form always does that), "-nsN" N software-pipeline
    # stages (Triton's num_stages; without it Triton's default)
    kind, *flags = form.split("-")
    stages = [int(f[2:]) for f in flags if f[:2] == "ns" and f[2:].isdigit()]
    if K % (split * block_k) or kind not in ("atomic", "reduce", "fma") or len(stages) > 1 \
            or not {f for f in flags if f[:2] != "ns"} <= {"swap", "aligned"} or (kind == "fma" and flags):
        raise ValueError(f"split-K config {(block_n, block_k, warps, split, form)} does not fit K={K}")
    swap, aligned = "swap" in flags, "aligned" in flags
    grid = (triton.cdiv(N, block_n), split)
    if kind == "fma":  # no tensor cores, one accumulator per row; SPLIT_K > 1: the atomic epilogue
        if M > 8:
            raise ValueError(f"the fma form holds 8 rows' accumulators, got {M} rows")
        ws, counts = _workspace(q) if split > 1 else (y, y)
        _int8_fma_kernel[grid](x, q, scale, y, ws, counts, N, K, M, BLOCK_M=1 << (M - 1).bit_length(),
                               BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split, num_warps=warps)
        return
    meta = dict(BLOCK_M=rows_block(M, block_n), BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split, num_warps=warps,
                SWAP=swap, ALIGNED=aligned, **({"num_stages": stages[0]} if stages else {}))
    if split == 1:
        _int8_split_k_kernel[grid](x, q, scale, y, y, y, M, N, K, ATOMIC=False, **meta)
    elif kind == "atomic":
        ws, counts = _workspace(q)
        _int8_split_k_kernel[grid](x, q, scale, y, ws, counts, M, N, K, ATOMIC=True, **meta)
    else:
        part = torch.empty((split, M, N), dtype=torch.float32, device=x.device)  # [SPLIT_K, M, N]
        _int8_split_k_kernel[grid](x, q, scale, y, part, part, M, N, K, ATOMIC=False, **meta)
        _split_k_reduce[(triton.cdiv(M * N, 1024),)](part, scale, y, M, N, SPLIT_K=split, BLOCK=1024, num_warps=4)


def launch(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, y: torch.Tensor,
           config: BlockConfig | None = None) -> None:
    """Kernel launch(es) writing y `[M, N]`: with `config` (BLOCK_N, BLOCK_K, num_warps[, SPLIT_K, form]),
    else the pinned one for the shape, else autotuned (unsplit)."""
    M, K = x.shape
    N = q.shape[0]
    if not 1 <= M <= MAX_ROWS:
        raise ValueError(f"one launch takes 1..{MAX_ROWS} rows, got {M}: int8_gemv() chunks more")
    config = config or pinned_config(N, K, M)
    if config is None:
        kernel = _int8_gemv_kernel if M <= 2 else _int8_rows_autotuned if M <= 8 else _int8_many_rows_autotuned
        kernel[lambda meta: (triton.cdiv(N, meta["BLOCK_N"]),)](x, q, scale, y, N, K, M)
        return
    if len(config) > 3:
        _launch_split_k(x, q, scale, y, *config)
        return
    block_n, block_k, warps = config[:3]
    grid = (triton.cdiv(N, block_n),)
    if M <= 2:
        _int8_gemv_kernel.fn[grid](x, q, scale, y, N, K, M, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps)
    else:
        _int8_rows_body[grid](x, q, scale, y, N, K, M, BLOCK_M=rows_block(M, block_n), BLOCK_N=block_n,
                              BLOCK_K=block_k, num_warps=warps)


def int8_gemv(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x `[M, K]` (1 <= M <= MAX_CHUNKED_ROWS), q `[N, K]` int8, scale `[N]` -> `(x @ q.T) * scale` `[M, N]` in
    x's dtype; past MAX_ROWS rows, one launch per chunk of MAX_ROWS rows. An unpinned (N, K, M) autotunes at
    its first call (outside any graph capture: warm up first)."""
    if not AVAILABLE:
        raise RuntimeError("int8_gemv needs Triton (it ships with CUDA builds of torch)")
    M, K = x.shape
    N = q.shape[0]
    if not 1 <= M <= MAX_CHUNKED_ROWS or q.shape[1] != K or scale.shape != (N,):
        raise ValueError(f"int8_gemv takes x [1..{MAX_CHUNKED_ROWS}, K], q [N, K], scale [N]; got {tuple(x.shape)}, "
                         f"{tuple(q.shape)}, {tuple(scale.shape)}")
    x = x.contiguous()
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    for i in range(0, M, MAX_ROWS):  # row slices of contiguous x and y are contiguous
        launch(x[i:i + MAX_ROWS], q, scale, y[i:i + MAX_ROWS])
    return y
