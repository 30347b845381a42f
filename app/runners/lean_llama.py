"""A lean Llama forward over a static KV cache, captured as CUDA graphs: the GPU fast path.

It loads the *same weights* as `LlamaForCausalLM` (taken from a loaded HF model) and
computes the same function with fewer, larger kernels:
  - q/k/v projections fused into one matmul, gate/up into another (4 GEMMs per layer);
  - a static cache `[layers, batch, max_len, kv_heads, head_dim]` written in place at the
    sequence positions, so rollback after a rejection is free: entries past a sequence's
    length are masked by position and overwritten later;
  - one CUDA graph per input width T (T=1 decode, T=k+1 verify), replayed with no host
    synchronisation; the caller reads back only the accepted count.
On the CPU it runs eagerly (used by the unit test that checks it against HF's logits).

`weights="int8"` stores the GEMM weights as weight-only int8 (per-output-row symmetric scales,
gpt-fast's recipe), halving the bytes a bandwidth-bound decode step reads. Meant for a *draft*:
a draft only proposes, and the target's verification keeps the output exact, so quantising the
draft can change only how many proposals are accepted, never what is generated.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Literal, NamedTuple, TypeVar

import torch
import torch.nn.functional as F

from app.runners.kernels import int8_gemv, rows_attention

Out = TypeVar("Out")
Weights = Literal["bf16", "int8", "int8_layers"]
# An int8 matmul over a few rows (batch x width: decode, the draft's 2-token catch-up, short verify
# passes) runs as a fused GEMV-like kernel reading int8: app/runners/kernels/int8_gemv.py's up to its
# MAX_CHUNKED_ROWS (the default), Inductor's up to GEMV_MAX_ROWS where asked for; a longer one (a
# prefill) dequantises the weight to the model's dtype and uses cuBLAS.
GEMV_MAX_ROWS = 8
# prefill_last captures a graph per power-of-two prompt bucket up to this length (longer prompts
# run eagerly: there the kernels, not the launches, dominate)
PREFILL_GRAPH_MAX_LEN = 2048


class Int8Weight(NamedTuple):
    """A weight `w [out, in]` stored as `q * scale[:, None]`."""
    q: torch.Tensor  # [out, in] int8, in [-127, 127]
    scale: torch.Tensor  # [out], the model's dtype


@torch.no_grad()
def quantize_int8(w: torch.Tensor) -> Int8Weight:
    """Symmetric per-output-row int8: scale = max|w_row| / 127 (rounded to w's dtype), q = round(w / scale).
    Every element comes back within scale / 2: |w - q * scale| <= scale / 2."""
    wf = w.detach().float()
    scale = (wf.abs().amax(dim=1) / 127).to(w.dtype)  # [out]
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row: q = 0 with any scale
    # the scale's rounding to bf16 moves max|w| / scale by at most 127 * 2^-9, so round() never passes 127
    q = (wf / scale.float()[:, None]).round().clamp(-127, 127).to(torch.int8)  # [out, in]
    return Int8Weight(q, scale)


class FastLlama:
    def __init__(self, hf_model: torch.nn.Module, max_batch: int = 1, max_len: int = 1024,
                 compile_elementwise: bool = False, compile_forward: str | None = None,
                 attention: Literal["sdpa", "grouped"] = "sdpa", weights: Weights = "bf16",
                 int8_one_row: Literal["inductor", "triton"] = "triton",
                 int8_few_rows: Literal["inductor", "triton"] = "triton",
                 decode_attention: Literal["matmul", "triton"] = "matmul") -> None:
        """weights: "bf16" keeps the model's weights as loaded (bf16 on the GPU; an fp32 model stays
        fp32); "int8" stores the four GEMMs of every layer (wqkv, wo, w_gate_up, w_down) and the
        lm_head as weight-only int8 with a per-output-row scale in the model's dtype; "int8_layers"
        quantises the layers' GEMMs and keeps the lm_head as loaded. For a draft model: its logits
        move slightly (acceptance may drop a little), the speculative output does not change,
        since the target verifies every proposal. On CUDA a few-row int8 matmul is one Triton kernel
        reading int8 and dequantising in registers (app/runners/kernels/int8_gemv.py's, or Inductor's where the options
        below say so); on the CPU it runs eagerly. int8_one_row: the kernel of a one-row int8 matmul on CUDA, app/runners/kernels/int8_gemv.py's
        with block configs pinned from cold-weight timings (default; two rows always use it) or
        Inductor's, tuned by coordinate descent at each start, which made the 1B draft's step vary
        0.85-0.99 ms from start to start (bench/gpu_draft_step.py).
        int8_few_rows: the kernel of a 3-64 row int8 matmul on CUDA (a branching draft's rows, a batched
        draft step, a short verify of an int8 target): app/runners/kernels/int8_gemv.py's few-row kernel
        (default), which reads each weight once per 16 rows, or Inductor's written-out reduction (up to
        GEMV_MAX_ROWS; more rows dequantise for cuBLAS), which made the 1B draft's forward over
        5 rows 2.61 ms against 1.49 (H200, bench.gpu_draft_step --rows-breakdown).
        decode_attention: a one-token step of 2+ sequences attends through `attention` (matmul: copies
        both caches per layer, see app/runners/kernels/rows_attention.py) or app/runners/kernels/rows_attention.py's kernel, which
        reads them in place (CUDA only)."""
        cfg = hf_model.config
        if compile_elementwise and compile_forward:
            raise ValueError("compile_forward already fuses the elementwise ops: pass one of the two")
        if attention not in ("sdpa", "grouped"):
            raise ValueError(f"attention={attention!r}: pick 'sdpa' or 'grouped'")
        for name, kernel in (("int8_one_row", int8_one_row), ("int8_few_rows", int8_few_rows)):
            if kernel not in ("inductor", "triton"):
                raise ValueError(f"{name}={kernel!r}: pick 'inductor' or 'triton'")
        if weights not in ("bf16", "int8", "int8_layers"):
            raise ValueError(f"weights={weights!r}: pick 'bf16', 'int8' or 'int8_layers'")
        if decode_attention not in ("matmul", "triton"):
            raise ValueError(f"decode_attention={decode_attention!r}: pick 'matmul' or 'triton'")
        # Fusing the small elementwise ops (RMSNorm, RoPE, SiLU*up) with torch.compile cuts
        # the kernels per layer roughly 3x; the GEMMs stay cuBLAS. Compiles in seconds, not minutes.
        fuse = (lambda f: torch.compile(f, dynamic=True, fullgraph=True)) if compile_elementwise else (lambda f: f)
        if compile_elementwise:
            # one compiled variant per (batch 1 or more) x (width 1 or more) x (rows read in place or
            # gathered) x cache shapes: more than Dynamo's default 8 per function, and past the limit a
            # fullgraph compile raises instead of running
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
            torch._dynamo.config.accumulated_recompile_limit = max(
                torch._dynamo.config.accumulated_recompile_limit, 1024)
        # compile_forward: a torch.compile mode for the whole forward (e.g. "max-autotune-no-cudagraphs":
        # Inductor may also pick Triton GEMM/GEMV kernels for the skinny decode shapes). One compile
        # per input shape, minutes for an 8B; CUDA graphs are still captured by capture().
        self._forward_fn = (torch.compile(self._forward, mode=compile_forward, fullgraph=True, dynamic=False)
                            if compile_forward else self._forward)
        self._norm, self._silu_mul = fuse(_rms_norm), fuse(_silu_mul)
        # per layer: rope on q and k plus both cache writes in one fused op, and each residual add
        # fused with the norm that follows it (these small kernels were ~20% of an 8B step)
        self._qkv_to_cache, self._add_norm = fuse(_qkv_to_cache), fuse(_add_norm)
        # "grouped": two batched GEMMs and one (fusable) masked softmax per layer, reading each KV
        # head once for its G query heads; SDPA with an explicit mask cannot use its flash kernel.
        self._attend = fuse(_grouped_attention) if attention == "grouped" else _sdpa_attention
        self.device = next(hf_model.parameters()).device
        self.dtype = next(hf_model.parameters()).dtype
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.eps = cfg.rms_norm_eps
        self.max_batch, self.max_len = max_batch, max_len
        self.weights = weights
        self.int8_one_row, self.int8_few_rows = int8_one_row, int8_few_rows
        self._rows_attention = decode_attention == "triton"
        if self._rows_attention and not (self.device.type == "cuda" and rows_attention.supports(
                cfg.num_attention_heads, cfg.num_key_value_heads, self.head_dim)):
            raise ValueError(f"decode_attention='triton' needs CUDA with Triton and power-of-two head groups and "
                             f"head_dim; this model is on {self.device}: use decode_attention='matmul'")
        # int8 matmul per weight shape: see _int8_fn
        self._int8_fns: dict[tuple[int, int], Callable[..., torch.Tensor]] = {}
        self._int8_inlined = bool(compile_forward)
        gemm = quantize_int8 if weights != "bf16" else (lambda w: w)
        m = hf_model.model
        self.embed = m.embed_tokens.weight  # [vocab, hidden]
        self.final_norm = m.norm.weight
        # [vocab, hidden] (tied or not; when tied and quantised, the embedding lookup keeps the original)
        lm_head = hf_model.lm_head.weight
        self.lm_head: torch.Tensor | Int8Weight = quantize_int8(lm_head) if weights == "int8" else lm_head
        self.layers: list[dict[str, torch.Tensor | Int8Weight]] = []
        for layer in m.layers:
            a, mlp = layer.self_attn, layer.mlp
            with torch.no_grad():
                self.layers.append({
                    "in_norm": layer.input_layernorm.weight,
                    "post_norm": layer.post_attention_layernorm.weight,
                    "wqkv": gemm(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])),  # [(H+2KV)*D, hidden]
                    # Qwen2 has q/k/v biases, Llama none: `[(H+2KV)*D]` or absent
                    **({"bqkv": torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias])}
                       if getattr(a.q_proj, "bias", None) is not None else {}),
                    "wo": gemm(a.o_proj.weight),  # [hidden, H*D]
                    "w_gate_up": gemm(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])),  # [2*ffn, hidden]
                    "w_down": gemm(mlp.down_proj.weight),  # [hidden, ffn]
                })
        self.ffn = m.layers[0].mlp.down_proj.weight.shape[1]
        # position-major, so a step's K/V rows are written in place (a head-major cache written
        # through a permuted view made Inductor copy the whole cache slice around the write)
        shape = (len(self.layers), max_batch, max_len, self.n_kv, self.head_dim)
        self.k_cache = torch.zeros(shape, device=self.device, dtype=self.dtype)
        self.v_cache = torch.zeros(shape, device=self.device, dtype=self.dtype)
        inv_freq, scale = _rope_inv_freq(hf_model, self.device)
        t = torch.arange(max_len, device=self.device, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # [max_len, D/2]
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos = (emb.cos() * scale).to(self.dtype)  # [max_len, D]
        self.sin = (emb.sin() * scale).to(self.dtype)
        self.key_pos = torch.arange(max_len, device=self.device)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        # run_from_host's pinned staging `[2, 64]` (ids, positions): a ring, because a non-blocking
        # copy reads its source only when the stream reaches it
        self._staging = [torch.zeros((2, 64), dtype=torch.long, pin_memory=self.device.type == "cuda")
                         for _ in range(4)]
        self._staging_turn = 0
        # prefill_last's graphs per prompt-length bucket: (graph, tokens, positions, hidden)
        self._prefill_graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    # ---- the forward ---------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, last_only: bool = False,
                rows: torch.Tensor | None = None, kv_len: int | None = None) -> torch.Tensor:
        """tokens, positions: `[B, T]` -> logits `[B, T, vocab]`; writes K/V at `positions`.
        rows: `[B]` cache rows to use (a prefill into one sequence's slot); None: rows 0..B-1.
        kv_len: attend over cache positions 0..kv_len-1 only (> every position; eager callers that
        know their lengths, e.g. on the CPU, where attention over all max_len keys dominates a
        small model's step); None: all max_len positions, masked (a captured graph's fixed shape).
        last_only: logits of the last position only, `[B, 1, vocab]` (a draft step feeding two tokens
        needs the next token after the second; the lm_head is the largest matrix of a 1B step)."""
        if rows is not None or kv_len is not None:
            return self._forward(tokens, positions, last_only, rows, kv_len)
        return self._forward_fn(tokens, positions, last_only)

    @torch.inference_mode()
    def prefill(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """forward() without the whole-forward compile: a prompt's shape is seen once, and
        compiling it (minutes with autotuning) would cost more than it saves."""
        return self._forward(tokens, positions)

    @torch.inference_mode()
    def prefill_last(self, prompt: torch.Tensor) -> torch.Tensor:
        """prompt `[1, P]` at positions 0..P-1 -> the logits of its last position `[1, vocab]`;
        K/V for 0..P-1 in batch row 0 (a batch-1 loop's whole sequence starts here).

        On CUDA the layers run as one CUDA graph per power-of-two length bucket, captured on
        first use: eagerly a batch-1 prefill is launch-bound (an 8B, 128-token prefill on an
        H200: ~7 ms of kernels in 23-32 ms of wall time). The prompt is padded to its bucket;
        the pads' K/V land at positions P.., where entries are stale (masked, then overwritten)
        anyway, and the causal mask keeps them out of the rows that matter. Capture writes row 0
        from position 0, which this prefill overwrites in any case."""
        P = prompt.shape[1]
        bucket = max(16, 1 << (P - 1).bit_length())
        if self.device.type != "cuda" or bucket > min(self.max_len - 1, PREFILL_GRAPH_MAX_LEN):
            positions = torch.arange(P, device=self.device).view(1, -1)
            return self._forward(prompt, positions, last_only=True)[:, -1]
        entry = self._prefill_graphs.get(bucket)
        if entry is None:
            tokens = torch.zeros((1, bucket), dtype=torch.long, device=self.device)
            positions = torch.arange(bucket, device=self.device).view(1, -1)
            graph, hidden = capture_graph(self.device, lambda: self._hidden(tokens, positions))
            # the graph reads `positions` by address: keep it alive with the graph
            entry = self._prefill_graphs[bucket] = (graph, tokens, positions, hidden)
        graph, tokens, _, hidden = entry  # tokens, positions [1, bucket]; hidden [1, bucket, hidden]
        tokens[:, :P].copy_(prompt)
        tokens[:, P:].zero_()
        with torch.cuda.device(self.device):  # replay() uses the current device's stream
            graph.replay()
        return self._mm(hidden[:, P - 1: P], self.lm_head)[:, 0]  # [1, vocab]

    def _forward(self, tokens: torch.Tensor, positions: torch.Tensor, last_only: bool = False,
                 rows: torch.Tensor | None = None, kv_len: int | None = None) -> torch.Tensor:
        h = self._hidden(tokens, positions, rows, kv_len)  # [B, T, hidden]
        if last_only:
            h = h[:, -1:]  # [B, 1, hidden]
        return self._mm(h, self.lm_head)  # [B, T or 1, vocab]

    def _hidden(self, tokens: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor | None = None,
                kv_len: int | None = None) -> torch.Tensor:
        """The layers: tokens, positions `[B, T]` -> final-normed hidden states `[B, T, hidden]`.
        rows `[B]`: the cache rows the batch reads and writes (written in place, read through a
        gathered copy: meant for a prefill's one or few rows); None: rows 0..B-1, read in place."""
        B, T = tokens.shape
        H, KV, D = self.n_heads, self.n_kv, self.head_dim
        x = F.embedding(tokens, self.embed)  # [B, T, hidden]
        cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)  # [B, 1, T, D]
        # key j is visible to query at position p iff j <= p: stale entries past p are masked
        L = self.max_len if kv_len is None else kv_len
        mask = self.key_pos[:L].view(1, 1, 1, -1) <= positions.view(B, 1, T, 1)  # [B, 1, T, L]
        batch_idx = (torch.arange(B, device=tokens.device) if rows is None else rows).view(B, 1).expand(B, T)
        h = self._norm(x, self.layers[0]["in_norm"], self.eps)
        for i, L in enumerate(self.layers):
            qkv = self._mm(h, L["wqkv"])  # [B, T, (H+2KV)*D]
            if "bqkv" in L:
                qkv = qkv + L["bqkv"]
            if rows is None:
                kc, vc = self.k_cache[i, :B], self.v_cache[i, :B]  # [B, max_len, KV, D]
                # rope, and this step's K/V written into the static cache at each row's positions
                q = self._qkv_to_cache(qkv, cos, sin, kc, vc, batch_idx, positions, H, KV, D)  # [B, H, T, D]
            else:  # written in place into the named rows, then those rows gathered for attention
                q = self._qkv_to_cache(qkv, cos, sin, self.k_cache[i], self.v_cache[i], batch_idx, positions, H, KV, D)
                kc, vc = self.k_cache[i].index_select(0, rows), self.v_cache[i].index_select(0, rows)
            if kv_len is not None:
                kc, vc = kc[:, :kv_len], vc[:, :kv_len]  # [B, L, KV, D]
            if self._rows_attention and T == 1 and B > 1 and rows is None:  # read the caches in place (app/runners/kernels/rows_attention.py)
                attn = rows_attention.decode_attention(q, kc, vc, positions.reshape(B))  # [B, H, 1, D]
            else:
                attn = self._attend(q, kc.transpose(1, 2), vc.transpose(1, 2), mask)  # [B, H, T, D]
            x, h = self._add_norm(x, self._mm(attn.transpose(1, 2).reshape(B, T, H * D), L["wo"]), L["post_norm"], self.eps)
            mlp = self._mm(self._silu_mul(self._mm(h, L["w_gate_up"]), self.ffn), L["w_down"])
            next_norm = self.layers[i + 1]["in_norm"] if i + 1 < len(self.layers) else self.final_norm
            x, h = self._add_norm(x, mlp, next_norm, self.eps)
        return h

    # ---- int8 weights --------------------------------------------------------------------
    def _mm(self, x: torch.Tensor, w: torch.Tensor | Int8Weight) -> torch.Tensor:
        """x `[..., in]` @ w.T -> `[..., out]`, for w `[out, in]` in the model's dtype or int8."""
        if isinstance(w, torch.Tensor):
            return x @ w.T
        x2 = x.reshape(-1, x.shape[-1])  # [M, in]
        m = x2.shape[0]
        own_kernel = m == 2 or (m == 1 and self.int8_one_row == "triton") or \
            (3 <= m <= int8_gemv.MAX_CHUNKED_ROWS and self.int8_few_rows == "triton")
        if own_kernel and self.device.type == "cuda" and int8_gemv.AVAILABLE and not self._int8_inlined:
            y = int8_gemv.int8_gemv(x2, w.q, w.scale)  # pinned block configs; two rows read the weights once
        elif m <= GEMV_MAX_ROWS:
            y = self._int8_fn(w.q.shape)(x2, w.q, w.scale)
        else:  # a prefill: dequantise once (a transient copy of this one matrix) and use cuBLAS
            y = _int8_matmul(x2, w.q, w.scale)
        return y.view(*x.shape[:-1], -1)  # [..., out]

    def _int8_fn(self, shape: tuple[int, int]) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
        """The few-row int8 matmul for weights of `shape`. CPU: eager. CUDA: `_int8_gemv` compiled
        (static shapes: a kernel per row count, its block sizes tuned by coordinate descent), one
        copy of it per weight shape. Dynamo keeps its compiled variants and its recompile limit (8)
        per code object: one shared function would see 5 weight shapes x row counts and fall back
        to eager. Inside a compile_forward compile, gpt-fast's form is traced into the forward's
        graph instead and the mode decides: the max-autotune modes turn coordinate descent tuning
        on (one row: the fused GEMV) and may fuse the conversion into a Triton GEMM (more rows);
        other modes dequantise and call cuBLAS. (The written-out few-row form traced there made
        Inductor hand cuDNN's SDPA a q without unit stride.)"""
        fn = self._int8_fns.get(shape)
        if fn is None:
            if self.device.type != "cuda":
                fn = _int8_matmul
            elif self._int8_inlined:
                fn = _int8_matmul
            else:
                # coordinate descent tuning, an Inductor option of this compile only (gpt-fast sets it
                # globally): it gates Inductor's one-row mm -> fused reduction, and tunes its blocks
                fn = torch.compile(_own_code(_int8_gemv), fullgraph=True, dynamic=False,
                                   options={"coordinate_descent_tuning": True})
            self._int8_fns[shape] = fn
        return fn

    def weight_bytes_per_step(self) -> int:
        """Bytes of weights one decode step reads: every matrix once (int8 and its scales where
        quantised) and the norms; the embedding's one row and the KV cache are left out."""
        def size(w: torch.Tensor | Int8Weight) -> int:
            return sum(t.numel() * t.element_size() for t in (w if isinstance(w, Int8Weight) else (w,)))
        return (sum(size(w) for L in self.layers for w in L.values()) + size(self.lm_head)
                + size(self.final_norm))

    # ---- CUDA graphs ---------------------------------------------------------------------
    def capture(self, width: int, batch: int = 1, pool: tuple | None = None) -> None:
        """Capture forward() for inputs `[batch, width]` as a CUDA graph (static buffers). `pool`: a
        memory pool (torch.cuda.graph_pool_handle()) shared with other graphs replayed one at a time."""
        tokens = torch.zeros((batch, width), dtype=torch.long, device=self.device)
        # Warm-up and capture write K/V at these positions: use the cache's last slots, which no
        # live sequence has reached (entries past a sequence's position are masked, then
        # overwritten), so capturing after a prefill does not corrupt it.
        positions = (torch.arange(self.max_len - width, self.max_len, device=self.device)
                     .view(1, -1).expand(batch, -1).contiguous())
        graph, logits = capture_graph(self.device, lambda: self.forward(tokens, positions), pool=pool)
        self.graphs[(batch, width)] = (graph, tokens, positions, logits)

    def run(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """forward() through a captured graph when one exists for this shape (else eagerly)."""
        entry = self.graphs.get(tuple(tokens.shape))
        if entry is None:
            return self.forward(tokens, positions)
        graph, tok_buf, pos_buf, logits = entry
        tok_buf.copy_(tokens)
        pos_buf.copy_(positions)
        with torch.cuda.device(self.device):  # replay() uses the current device's stream
            graph.replay()
        return logits

    def run_from_host(self, ids: list[int], position: int) -> torch.Tensor:
        """run() of host ids `[1, w]` at positions position.. : on CUDA with a graph for width w,
        two non-blocking copies from pinned staging straight into the graph's input buffers (no
        device tensors made, no arange kernel: the host's time per pass is what two GPUs in a
        loop wait on). Returns the logits `[1, w, vocab]`, still on the device."""
        w = len(ids)
        entry = self.graphs.get((1, w))
        if entry is None or w > self._staging[0].shape[1]:
            tokens = torch.tensor([ids], dtype=torch.long).to(self.device)
            return self.run(tokens, torch.arange(position, position + w, device=self.device).view(1, -1))
        graph, tok_buf, pos_buf, logits = entry
        stage = self._staging[self._staging_turn]
        self._staging_turn = (self._staging_turn + 1) % len(self._staging)
        host = stage.numpy()
        host[0, :w] = ids
        host[1, :w] = range(position, position + w)
        tok_buf.copy_(stage[:1, :w], non_blocking=True)
        pos_buf.copy_(stage[1:, :w], non_blocking=True)
        with torch.cuda.device(self.device):  # replay() uses the current device's stream
            graph.replay()
        return logits


def capture_graph(device: torch.device, step: Callable[[], Out], before: Callable[[], None] = lambda: None,
                  pool: tuple | None = None) -> tuple[torch.cuda.CUDAGraph, Out]:
    """Run `step` twice on a side stream (kernel selection, allocator warm-up), then capture it as a
    CUDA graph on `device`; `before` runs ahead of each of the three (e.g. to point the step's
    inputs at scratch cache slots). Returns the graph and what the captured `step` returned."""
    with torch.cuda.device(device):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                before()
                step()
        torch.cuda.current_stream().wait_stream(stream)
        before()
        graph = torch.cuda.CUDAGraph()
        # torch.cuda.graph's default capture stream is shared by the class and lives on
        # whichever device captured first: give it one on this device
        with torch.cuda.graph(graph, pool=pool, stream=torch.cuda.Stream(device)):
            out = step()
    return graph, out


def _int8_matmul(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x `[M, in]`, q `[out, in]` int8, scale `[out]` -> x @ (q * scale[:, None]).T `[M, out]`,
    gpt-fast's form (int8 -> x's dtype is exact). Eagerly this materialises the dequantised weight."""
    return (x @ q.to(x.dtype).T) * scale


def _int8_gemv(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """_int8_matmul for a few rows, compiled: one Triton reduction kernel that loads int8, converts,
    multiplies, sums in fp32 and scales. For one row Inductor makes it from gpt-fast's form itself,
    but only under coordinate descent tuning (its mm decomposition is gated on that option). For
    2+ rows it would convert the whole weight in one kernel and run cuBLAS on the copy (5 bytes
    moved per weight instead of 1), so the reduction is written out: rows are the inner index of
    the `[out, M]` result, so the M rows using a weight row read it together. Measured on an H200
    (1B shapes): gpt-fast's form is ~15% faster than the written-out one at one row, the
    written-out one ~2x faster at two. Eagerly the written-out form allocates `[out, M, in]` floats."""
    if x.shape[0] == 1:
        return _int8_matmul(x, q, scale)  # [1, out]
    y = (q.unsqueeze(1).float() * x.unsqueeze(0).float()).sum(-1) * scale.float().unsqueeze(1)  # [out, M]
    return y.to(x.dtype).T.contiguous()  # [M, out]


def _own_code(fn: Callable[..., Out]) -> Callable[..., Out]:
    """A copy of `fn` with its own code object (so Dynamo gives it its own cache of compiled variants)."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def _sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """q `[B, H, T, D]`, k/v `[B, KV, L, D]`, mask `[B, 1, T, L]` (True = visible) -> `[B, H, T, D]`."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=(q.shape[1] != k.shape[1]))


def _grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Same contract as _sdpa_attention. Query head h uses KV head h // G (HF's repeat_kv order),
    so the G query heads of one KV head fold into rows: `[B, KV, G*T, D]` against `[B, KV, L, D]`."""
    B, H, T, D = q.shape
    KV, L = k.shape[1], k.shape[2]
    G = H // KV
    qg = q.reshape(B, KV, G * T, D)
    scores = (qg @ k.transpose(-1, -2)).float() * D ** -0.5  # [B, KV, G*T, L]
    scores = scores.view(B, KV, G, T, L).masked_fill(~mask.view(B, 1, 1, T, L), float("-inf"))
    probs = scores.softmax(-1).to(q.dtype).view(B, KV, G * T, L)
    return (probs @ v).view(B, H, T, D)


def _qkv_to_cache(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, batch_idx: torch.Tensor, positions: torch.Tensor,
                  H: int, KV: int, D: int) -> torch.Tensor:
    """qkv `[B, T, (H+2KV)*D]` -> q `[B, H, T, D]` (roped); writes roped k and v into the caches
    `[B, max_len, KV, D]` at `positions` `[B, T]` (batch_idx `[B, T]` names each row)."""
    B, T, _ = qkv.shape
    q, k, v = qkv.split([H * D, KV * D, KV * D], dim=-1)
    q = _rope(q.view(B, T, H, D).transpose(1, 2), cos, sin)  # [B, H, T, D]
    k = _rope(k.view(B, T, KV, D).transpose(1, 2), cos, sin)  # [B, KV, T, D]
    k_cache[batch_idx, positions] = k.transpose(1, 2)
    v_cache[batch_idx, positions] = v.view(B, T, KV, D)
    return q


def _add_norm(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add and the RMSNorm after it: (x + y, norm(x + y))."""
    x = x + y
    return x, _rms_norm(x, weight, eps)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def _silu_mul(gate_up: torch.Tensor, ffn: int) -> torch.Tensor:
    gate, up = gate_up.split(ffn, dim=-1)
    return F.silu(gate) * up


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def _rope_inv_freq(hf_model: torch.nn.Module, device: torch.device) -> tuple[torch.Tensor, float]:
    """Take HF's own rotary frequencies (handles llama3 / linear scaling) so both agree exactly."""
    rotary = hf_model.model.rotary_emb
    inv_freq = rotary.inv_freq.to(device=device, dtype=torch.float32)
    return inv_freq, float(getattr(rotary, "attention_scaling", 1.0))
