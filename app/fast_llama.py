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
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, TypeVar

import torch
import torch.nn.functional as F

Out = TypeVar("Out")


class FastLlama:
    def __init__(self, hf_model: torch.nn.Module, max_batch: int = 1, max_len: int = 1024,
                 compile_elementwise: bool = False, compile_forward: str | None = None,
                 attention: Literal["sdpa", "grouped"] = "sdpa") -> None:
        cfg = hf_model.config
        if compile_elementwise and compile_forward:
            raise ValueError("compile_forward already fuses the elementwise ops: pass one of the two")
        if attention not in ("sdpa", "grouped"):
            raise ValueError(f"attention={attention!r}: pick 'sdpa' or 'grouped'")
        # Fusing the small elementwise ops (RMSNorm, RoPE, SiLU*up) with torch.compile cuts
        # the kernels per layer roughly 3x; the GEMMs stay cuBLAS. Compiles in seconds, not minutes.
        fuse = (lambda f: torch.compile(f, dynamic=True, fullgraph=True)) if compile_elementwise else (lambda f: f)
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
        m = hf_model.model
        self.embed = m.embed_tokens.weight  # [vocab, hidden]
        self.final_norm = m.norm.weight
        self.lm_head = hf_model.lm_head.weight  # [vocab, hidden] (tied or not)
        self.layers = []
        for layer in m.layers:
            a, mlp = layer.self_attn, layer.mlp
            self.layers.append({
                "in_norm": layer.input_layernorm.weight,
                "post_norm": layer.post_attention_layernorm.weight,
                "wqkv": torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]),  # [(H+2KV)*D, hidden]
                "wo": a.o_proj.weight,
                "w_gate_up": torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]),  # [2*ffn, hidden]
                "w_down": mlp.down_proj.weight,
            })
        self.ffn = self.layers[0]["w_down"].shape[1]
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
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    # ---- the forward ---------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """tokens, positions: `[B, T]` -> logits `[B, T, vocab]`; writes K/V at `positions`."""
        return self._forward_fn(tokens, positions)

    @torch.inference_mode()
    def prefill(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """forward() without the whole-forward compile: a prompt's shape is seen once, and
        compiling it (minutes with autotuning) would cost more than it saves."""
        return self._forward(tokens, positions)

    def _forward(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        B, T = tokens.shape
        H, KV, D = self.n_heads, self.n_kv, self.head_dim
        x = F.embedding(tokens, self.embed)  # [B, T, hidden]
        cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)  # [B, 1, T, D]
        # key j is visible to query at position p iff j <= p: stale entries past p are masked
        mask = self.key_pos.view(1, 1, 1, -1) <= positions.view(B, 1, T, 1)  # [B, 1, T, max_len]
        batch_idx = torch.arange(B, device=tokens.device).view(B, 1).expand(B, T)
        h = self._norm(x, self.layers[0]["in_norm"], self.eps)
        for i, L in enumerate(self.layers):
            qkv = h @ L["wqkv"].T  # [B, T, (H+2KV)*D]
            kc, vc = self.k_cache[i, :B], self.v_cache[i, :B]  # [B, max_len, KV, D]
            # rope, and this step's K/V written into the static cache at each row's positions
            q = self._qkv_to_cache(qkv, cos, sin, kc, vc, batch_idx, positions, H, KV, D)  # [B, H, T, D]
            attn = self._attend(q, kc.transpose(1, 2), vc.transpose(1, 2), mask)  # [B, H, T, D]
            x, h = self._add_norm(x, attn.transpose(1, 2).reshape(B, T, H * D) @ L["wo"].T, L["post_norm"], self.eps)
            mlp = self._silu_mul(h @ L["w_gate_up"].T, self.ffn) @ L["w_down"].T
            next_norm = self.layers[i + 1]["in_norm"] if i + 1 < len(self.layers) else self.final_norm
            x, h = self._add_norm(x, mlp, next_norm, self.eps)
        return h @ self.lm_head.T  # [B, T, vocab]

    # ---- CUDA graphs ---------------------------------------------------------------------
    def capture(self, width: int, batch: int = 1) -> None:
        """Capture forward() for inputs `[batch, width]` as a CUDA graph (static buffers)."""
        tokens = torch.zeros((batch, width), dtype=torch.long, device=self.device)
        # Warm-up and capture write K/V at these positions: use the cache's last slots, which no
        # live sequence has reached (entries past a sequence's position are masked, then
        # overwritten), so capturing after a prefill does not corrupt it.
        positions = (torch.arange(self.max_len - width, self.max_len, device=self.device)
                     .view(1, -1).expand(batch, -1).contiguous())
        graph, logits = capture_graph(self.device, lambda: self.forward(tokens, positions))
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


def capture_graph(device: torch.device, step: Callable[[], Out], before: Callable[[], None] = lambda: None,
                  ) -> tuple[torch.cuda.CUDAGraph, Out]:
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
        with torch.cuda.graph(graph, stream=torch.cuda.Stream(device)):
            out = step()
    return graph, out


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
