"""One-token attention for a few sequences, read in place from FastLlama's position-major cache (CUDA).

Why: FastLlama keeps K and V as `[B, max_len, KV, D]` per layer, so that a step writes its new K/V in
place. Batched matmul over the `[B, KV, L, D]` view needs one stride per batch dimension, and (B, KV)
have two: for more than one sequence it copies both caches every layer. The branching draft steps
5 sequences a step, and there the copies take 0.28 of its 1.49 ms forward on an H200 (`python3 -m
bench.gpu_draft_step --rows-breakdown 5 --variants bf16,bf16:in-place`). Two copy-free products
are slower under Inductor's fusion.
Here (flash-decoding) each program takes one slice of one sequence's keys up to its position, for the
G query heads that share a KV head, with tl.dot on those heads padded to 16 and an online softmax; a
second kernel combines the slices. Without slices or tl.dot (one program per sequence and KV head,
products reduced in registers) the kernel takes 0.60 ms at 5 rows, twice the copies it replaces.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU build of torch comes without Triton: callers check AVAILABLE
    triton = None

AVAILABLE = triton is not None
BLOCK_G = 16  # query heads per KV head, padded to tl.dot's smallest M
SPLITS = 4  # slices of each sequence's keys, one program each (40 programs for 5 rows x 8 KV heads were too few)

if AVAILABLE:
    @triton.jit
    def _partial_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, acc_ptr, m_ptr, sum_ptr, stride_b, stride_l, stride_h, scale,
                        H: tl.constexpr, KV: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
                        BLOCK_G: tl.constexpr, BLOCK_L: tl.constexpr, SPLITS: tl.constexpr):
        # q [B, H, 1, D] contiguous; k, v [B, max_len, KV, D] (strides b, l, h; d contiguous); pos [B]:
        # sequence b sees keys 0..pos[b]. Program (b, kv, split) takes one slice of those keys for the G
        # query heads of KV head kv (HF's repeat_kv order), padded to BLOCK_G = 16 rows for tl.dot, and
        # leaves its softmax partials (max, sum, weighted values) for _combine_kernel.
        b, kv, sp = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        g, d = tl.arange(0, BLOCK_G), tl.arange(0, D)
        g_ok = g < G
        q = tl.load(q_ptr + b * H * D + (kv * G + g)[:, None] * D + d[None, :], mask=g_ok[:, None], other=0.0)
        end = tl.load(pos_ptr + b) + 1
        chunk = tl.cdiv(end, SPLITS)
        lo = sp * chunk
        hi = tl.minimum(lo + chunk, end)
        m = tl.full([BLOCK_G], -1e30, tl.float32)  # finite: an empty slice must not make exp(nan)
        total = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, D], tl.float32)
        base = b * stride_b + kv * stride_h
        for l0 in range(lo, hi, BLOCK_L):
            rl = l0 + tl.arange(0, BLOCK_L)  # [BLOCK_L]
            ok = rl < hi
            offs = base + rl[:, None] * stride_l + d[None, :]  # [BLOCK_L, D]
            k = tl.load(k_ptr + offs, mask=ok[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k)) * scale  # [BLOCK_G, BLOCK_L] fp32
            s = tl.where(ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            p = tl.exp(s - m_new[:, None])  # [BLOCK_G, BLOCK_L]
            corr = tl.exp(m - m_new)
            v = tl.load(v_ptr + offs, mask=ok[:, None], other=0.0)  # [BLOCK_L, D]
            acc = acc * corr[:, None] + tl.dot(p.to(v.dtype), v)  # [BLOCK_G, D]
            total = total * corr + tl.sum(p, axis=1)
            m = m_new
        row = ((b * KV + kv) * SPLITS + sp) * BLOCK_G + g  # [BLOCK_G]
        tl.store(m_ptr + row, m)
        tl.store(sum_ptr + row, total)
        tl.store(acc_ptr + row[:, None] * D + d[None, :], acc)

    @triton.jit
    def _combine_kernel(acc_ptr, m_ptr, sum_ptr, out_ptr, H: tl.constexpr, KV: tl.constexpr, G: tl.constexpr,
                        D: tl.constexpr, BLOCK_G: tl.constexpr, SPLITS: tl.constexpr):
        # the SPLITS partials of (b, kv) rescaled to their common max and summed -> out [B, H, 1, D]
        b, kv = tl.program_id(0), tl.program_id(1)
        sp, g, d = tl.arange(0, SPLITS), tl.arange(0, BLOCK_G), tl.arange(0, D)
        row = ((b * KV + kv) * SPLITS + sp)[:, None] * BLOCK_G + g[None, :]  # [SPLITS, BLOCK_G]
        m = tl.load(m_ptr + row)
        w = tl.exp(m - tl.max(m, axis=0)[None, :])  # [SPLITS, BLOCK_G]; empty slices weigh 0
        total = tl.sum(w * tl.load(sum_ptr + row), axis=0)  # [BLOCK_G]
        acc = tl.load(acc_ptr + row[:, :, None] * D + d[None, None, :])  # [SPLITS, BLOCK_G, D]
        out = tl.sum(w[:, :, None] * acc, axis=0) / total[:, None]  # [BLOCK_G, D]
        tl.store(out_ptr + b * H * D + (kv * G + g)[:, None] * D + d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=(g < G)[:, None])


def supports(n_heads: int, n_kv: int, head_dim: int) -> bool:
    """Whether the kernel takes this head layout (tl.arange needs powers of two, tl.dot 16+ wide)."""
    g = n_heads // n_kv
    return (AVAILABLE and n_heads % n_kv == 0 and g <= BLOCK_G and head_dim >= 16
            and head_dim & (head_dim - 1) == 0)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     positions: torch.Tensor) -> torch.Tensor:
    """q `[B, H, 1, D]`, k_cache / v_cache `[B, max_len, KV, D]` (this step's K/V already written),
    positions `[B]` (sequence b sees keys 0..positions[b]) -> attention output `[B, H, 1, D]`."""
    B, H, T, D = q.shape
    KV = k_cache.shape[2]
    if T != 1 or k_cache.stride() != v_cache.stride() or k_cache.stride(3) != 1:
        raise ValueError(f"decode_attention takes one token per sequence and K/V caches of one layout; got q "
                         f"{tuple(q.shape)}, k strides {k_cache.stride()}, v strides {v_cache.stride()}")
    q = q.contiguous()
    out = torch.empty_like(q)
    G = H // KV
    if G > BLOCK_G:
        raise ValueError(f"decode_attention takes up to {BLOCK_G} query heads per KV head; got {G}")
    part_acc = torch.empty((B * KV * SPLITS * BLOCK_G, D), dtype=torch.float32, device=q.device)
    part_m = torch.empty(B * KV * SPLITS * BLOCK_G, dtype=torch.float32, device=q.device)
    part_sum = torch.empty_like(part_m)
    _partial_kernel[(B, KV, SPLITS)](q, k_cache, v_cache, positions, part_acc, part_m, part_sum, k_cache.stride(0),
                                     k_cache.stride(1), k_cache.stride(2), D ** -0.5, H=H, KV=KV, G=G, D=D,
                                     BLOCK_G=BLOCK_G, BLOCK_L=64, SPLITS=SPLITS, num_warps=4)
    _combine_kernel[(B, KV)](part_acc, part_m, part_sum, out, H=H, KV=KV, G=G, D=D, BLOCK_G=BLOCK_G, SPLITS=SPLITS,
                             num_warps=4)
    return out
