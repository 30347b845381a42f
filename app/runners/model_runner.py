"""The runner: one model on one device and the KV cache it owns.

The engine holds sequence ids and token ids, never cache tensors. The runner gives each
sequence a row of a static cache `[layers, max_seqs, max_len, kv_heads, head_dim]`
(app/runners/lean_llama.py) and keeps how many tokens each row holds:

- `add(seq)` takes the next free row; `remove(seq)` frees it, moving the last occupied row
  into the hole (a copy of that row's cached tokens only), so the occupied rows are always
  0..n-1 and a batched pass is a plain prefix `[:B]` of the cache, read in place.
- `truncate(seq, n)` rolls back by length: entries past a row's length are masked by
  position (a query at position p sees keys 0..p) and overwritten by the next pass.
- `step(seqs, inputs)` feeds every stepping sequence its tokens (1 to decode, k+1 to verify)
  in one forward over rows 0..B-1, B the batch bucket >= the occupied rows; rows that do not
  step (or are padding) are fed at and past their own length, where writes are harmless.
  On CUDA each (bucket, width) replays a captured CUDA graph, all graphs sharing one memory
  pool; on the CPU it runs eagerly.
- `prefill_batch(seqs, chunks)` appends a prompt chunk to each sequence's row in one pass (a
  graph per (rows, power-of-two length bucket) on CUDA) and returns each chunk's last logits.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import numpy as np
import torch

from app.runners.kernels import rows_attention
from app.config import MAX_SPECULATIVE_TOKENS, ModelSpec
from app.runners.lean_llama import FastLlama, capture_graph
from app.runners.loading import eos_ids, load_model, load_tokenizer
from app.runners.transfer import copy_to, to_device

log = logging.getLogger(__name__)

MAX_WIDTH = MAX_SPECULATIVE_TOKENS + 1  # the widest pass: k proposals + the last token
PREFILL_MIN_BUCKET = 16
PREFILL_ROWS = (1, 2, 4, 8)  # sequences prefilled together in one graph
PREFILL_GRAPH_TOKENS = 2048  # prefill graphs up to rows x bucket tokens; larger passes run eagerly


class ContextOverflow(ValueError):
    def __init__(self, needed: int, limit: int) -> None:
        super().__init__(f"sequence needs {needed} tokens of context but the model allows {limit}")
        self.needed, self.limit = needed, limit


class CacheFull(RuntimeError):
    """Every row of the runner's cache holds a sequence (admission should have refused)."""


def batch_buckets(max_seqs: int) -> list[int]:
    """Batch sizes with a graph: powers of two, then steps of 8, up to max_seqs."""
    out, b = [], 1
    while b < min(max_seqs, 8):
        out.append(b)
        b *= 2
    b = 8
    while b < max_seqs:
        out.append(b)
        b += 8 if b < 64 else 32
    out.append(max_seqs)
    return sorted(set(out))


def prefill_bucket(n: int) -> int:
    return max(PREFILL_MIN_BUCKET, 1 << (n - 1).bit_length())


class ModelRunner:
    """A model, its tokenizer and the KV cache of up to `max_seqs` sequences.

    widths: the pass widths to capture graphs for (1 for decode, k+1 for verify, 2 for a
    draft's catch-up); others run eagerly."""

    def __init__(self, spec: ModelSpec, max_seqs: int, widths: Sequence[int] = (1,)) -> None:
        if spec.num_threads:
            torch.set_num_threads(spec.num_threads)
        self.spec = spec
        self.device = torch.device(spec.device)
        self.tokenizer = load_tokenizer(spec)
        hf = load_model(spec)
        cfg = hf.config
        self.vocab_size: int = cfg.vocab_size
        self.max_context: int = spec.max_context or cfg.max_position_embeddings
        self.pad_id: int = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.eos_ids: frozenset[int] = eos_ids(self.tokenizer, hf)
        cuda = self.device.type == "cuda"
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        # the in-place kernel's tl.dot rounds float32 to TF32: float32 (tests that compare outputs exactly)
        # keeps the exact masked attention
        in_place = cuda and spec.dtype != "float32" and rows_attention.supports(
            cfg.num_attention_heads, cfg.num_key_value_heads, head_dim)
        # one row more than sequences: the scratch row that a batched prefill's padding writes into
        self.model = FastLlama(hf, max_batch=max_seqs + 1, max_len=self.max_context + MAX_WIDTH,
                               weights="int8" if spec.quantization == "int8" else "bf16",
                               decode_attention="triton" if in_place else "matmul",
                               # on CUDA the small elementwise kernels (norms, rope, SiLU) are ~20% of an
                               # 8B step unfused; compiled, they fuse (seconds at start-up)
                               compile_elementwise=cuda)
        del hf
        self.max_seqs = max_seqs
        self._scratch_row = max_seqs
        self.buckets = batch_buckets(max_seqs)
        self._row: dict[str, int] = {}
        self._ids: list[str] = []  # row -> sequence id; rows 0..n-1 are occupied
        self._lengths: list[int] = []  # row -> tokens cached
        self._chain_graphs: dict[tuple[int, int], tuple] = {}  # (batch bucket, k) -> a greedy draft chain
        self._prefill_graphs: dict[tuple[int, int], tuple] = {}  # (rows, length bucket) -> graph and buffers
        self._pool = torch.cuda.graph_pool_handle() if cuda and spec.cuda_graphs else None
        if self._pool is not None:
            self._capture(sorted(set(widths)))

    # ---- sequences -----------------------------------------------------------------------
    def add(self, seq_id: str) -> None:
        if seq_id in self._row:
            raise ValueError(f"sequence {seq_id!r} already has a cache row")
        if len(self._ids) >= self.max_seqs:
            raise CacheFull(f"all {self.max_seqs} cache rows are taken")
        self._row[seq_id] = len(self._ids)
        self._ids.append(seq_id)
        self._lengths.append(0)

    def remove(self, seq_id: str) -> None:
        """Free a sequence's row; the last occupied row moves into it (only its cached tokens are copied)."""
        row = self._row.pop(seq_id, None)
        if row is None:
            return
        last = len(self._ids) - 1
        if row != last:
            moved, n = self._ids[last], self._lengths[last]
            if n:
                m = self.model
                m.k_cache[:, row, :n].copy_(m.k_cache[:, last, :n])  # [layers, n, KV, D]
                m.v_cache[:, row, :n].copy_(m.v_cache[:, last, :n])
            self._ids[row], self._lengths[row] = moved, n
            self._row[moved] = row
        self._ids.pop()
        self._lengths.pop()

    def clear(self) -> None:
        """Free every row (nothing is copied: rows are reused from 0)."""
        self._row.clear()
        self._ids.clear()
        self._lengths.clear()

    def __contains__(self, seq_id: str) -> bool:
        return seq_id in self._row

    def length(self, seq_id: str) -> int:
        """Tokens of the sequence whose K/V the cache holds (0 for an unknown sequence)."""
        row = self._row.get(seq_id)
        return 0 if row is None else self._lengths[row]

    def truncate(self, seq_id: str, length: int) -> None:
        """Roll back to the first `length` tokens: nothing moves, later entries are masked, then overwritten."""
        row = self._row[seq_id]
        if length > self._lengths[row]:
            raise ValueError(f"cannot roll a {self._lengths[row]}-token cache forward to {length}")
        self._lengths[row] = length

    def row(self, seq_id: str) -> int:
        return self._row[seq_id]

    @property
    def num_sequences(self) -> int:
        return len(self._ids)

    def cached_tokens(self) -> int:
        return sum(self._lengths)

    # ---- passes --------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self, seq_ids: Sequence[str], inputs: Sequence[Sequence[int]]) -> tuple[torch.Tensor, list[int]]:
        """Feed `inputs[i]` (1..MAX_WIDTH tokens) to sequence i at its cached length, in one forward.

        Returns the logits `[B, T, vocab]` on the device (B >= every occupied row, T the widest
        input; a row's inputs are left-aligned, so its logits are `[row, :len(inputs[i])]`) and
        each sequence's row. The logits stay valid until the runner's next pass."""
        n = len(self._ids)
        T = max(len(x) for x in inputs)
        if T > MAX_WIDTH:
            raise ValueError(f"a pass feeds at most {MAX_WIDTH} tokens per sequence, got {T}")
        B = next(b for b in self.buckets if b >= n)
        base = np.zeros(B, dtype=np.int64)
        base[:n] = self._lengths
        tokens = np.zeros((B, T), dtype=np.int64)
        rows = []
        for seq_id, toks in zip(seq_ids, inputs):
            row = self._row[seq_id]
            end = self._lengths[row] + len(toks)
            if end > self.max_context:
                raise ContextOverflow(end, self.max_context)
            tokens[row, :len(toks)] = toks
            rows.append(row)
        # rows that do not step (and padding rows) write at and past their own length: harmless
        positions = base[:, None] + np.arange(T)  # [B, T]
        logits = self._run(torch.from_numpy(tokens), torch.from_numpy(positions))
        for seq_id, row, toks in zip(seq_ids, rows, inputs):
            self._lengths[row] += len(toks)
        return logits, rows

    @torch.inference_mode()
    def draft_chain(self, seq_ids: Sequence[str], feeds: Sequence[Sequence[int]], k: int,
                    forced: Sequence[Sequence[int]] | None = None) -> torch.Tensor:
        """A greedy draft's whole step: feed each sequence its 1-2 tokens, then k - 1 times feed back its
        argmax, all k passes in one CUDA graph per (batch bucket, k) (on the CPU the same code runs
        eagerly). Returns the k proposals per sequence `[n, k]` on the device; each cache then holds
        its feeds and the first k - 1 proposals.

        `forced[i]` (up to k tokens, a benchmark's controlled acceptance): sequence i proposes these
        instead of its argmax at the first len(forced[i]) depths and feeds them back, so the passes
        cost what they cost and the cache holds what was proposed, as a draft's own accepted
        proposals would be held."""
        n = len(self._ids)
        B = next(b for b in self.buckets if b >= n)
        tokens = np.zeros((B, 2), dtype=np.int64)
        base = np.zeros(B, dtype=np.int64)
        base[:n] = self._lengths  # rows that do not draft write at and past their length: harmless
        fed = np.ones(B, dtype=np.int64)
        force = np.full((B, k), -1, dtype=np.int64)  # -1: the row's own argmax
        rows = [self._row[s] for s in seq_ids]
        for i, (row, feed) in enumerate(zip(rows, feeds)):
            if forced is not None and forced[i]:
                force[row, :len(forced[i])] = forced[i][:k]
            if not 1 <= len(feed) <= 2:
                raise ValueError(f"a draft chain feeds 1 or 2 tokens per sequence, got {len(feed)}")
            if self._lengths[row] + len(feed) + k - 1 > self.model.max_len:
                raise ContextOverflow(self._lengths[row] + len(feed) + k - 1, self.max_context)
            tokens[row, :len(feed)] = feed
            fed[row] = len(feed)
        entry = self._chain_graphs.get((B, k))
        if entry is None and self._pool is not None:
            entry = self._capture_chain(B, k)
        if entry is None:  # eagerly (CPU), attending only over the cached length
            out = torch.zeros((B, k), dtype=torch.long, device=self.device)
            self._chain(to_device(tokens, self.device), to_device(base, self.device), to_device(fed, self.device),
                        to_device(force, self.device), out, k, kv_len=self._kv_len(int(base.max()) + 2 + k))
        else:
            graph, tok_buf, base_buf, fed_buf, force_buf, out = entry
            copy_to(tok_buf, tokens)
            copy_to(base_buf, base)
            copy_to(fed_buf, fed)
            copy_to(force_buf, force)
            with torch.cuda.device(self.device):
                graph.replay()
        for row, feed in zip(rows, feeds):
            self._lengths[row] += len(feed) + k - 1
        return out[to_device(rows, self.device)]  # [n, k]

    def _chain(self, tokens: torch.Tensor, base: torch.Tensor, fed: torch.Tensor, force: torch.Tensor,
               out: torch.Tensor, k: int, kv_len: int | None = None) -> None:
        """tokens `[B, 2]` (left-aligned feeds), base `[B]` (cached lengths), fed `[B]` (1 or 2), force
        `[B, k]` (a proposal to make instead of the argmax, -1: none) -> out `[B, k]`."""
        B = tokens.shape[0]
        arange = torch.arange(B, device=tokens.device)
        logits = self.model.forward(tokens, base.unsqueeze(1) + torch.arange(2, device=tokens.device), kv_len=kv_len)
        token = logits[arange, fed - 1].argmax(-1)  # [B]: the proposal after each row's last fed token
        token = torch.where(force[:, 0] >= 0, force[:, 0], token)
        out[:, 0] = token
        position = base + fed  # [B]: where that proposal goes
        for j in range(1, k):
            logits = self.model.forward(token.unsqueeze(1), position.unsqueeze(1), kv_len=kv_len)  # [B, 1, vocab]
            token = logits[:, 0].argmax(-1)
            token = torch.where(force[:, j] >= 0, force[:, j], token)
            out[:, j] = token
            position = position + 1

    def _capture_chain(self, B: int, k: int) -> tuple:
        m = self.model
        tokens = torch.zeros((B, 2), dtype=torch.long, device=self.device)
        # capture writes near the end of every row's cache (masked for every live sequence)
        base = torch.full((B,), m.max_len - k - 2, dtype=torch.long, device=self.device)
        fed = torch.ones(B, dtype=torch.long, device=self.device)
        force = torch.full((B, k), -1, dtype=torch.long, device=self.device)
        out = torch.zeros((B, k), dtype=torch.long, device=self.device)
        graph, _ = capture_graph(self.device, lambda: self._chain(tokens, base, fed, force, out, k), pool=self._pool)
        entry = self._chain_graphs[(B, k)] = (graph, tokens, base, fed, force, out)
        return entry

    @torch.inference_mode()
    def step_tokens(self, seq_ids: Sequence[str], tokens: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """step() of one token per sequence given on the device (`[n]` long): a draft feeding its own
        last proposal back without a host read. Returns the logits `[B, 1, vocab]` and the rows."""
        n = len(self._ids)
        B = next(b for b in self.buckets if b >= n)
        rows = [self._row[s] for s in seq_ids]
        for row in rows:  # a draft's padding steps may pass max_context by < MAX_WIDTH: the cache has room
            if self._lengths[row] + 1 > self.model.max_len:
                raise ContextOverflow(self._lengths[row] + 1, self.max_context)
        positions = np.zeros((B, 1), dtype=np.int64)
        positions[:n, 0] = self._lengths
        rows_t = to_device(rows, self.device)
        entry = self.model.graphs.get((B, 1))
        if entry is None:
            tok = torch.zeros((B, 1), dtype=torch.long, device=self.device)
            tok[rows_t, 0] = tokens
            logits = self.model.forward(tok, to_device(positions, self.device),
                                        kv_len=self._kv_len(int(positions.max())))
        else:
            graph, tok_buf, pos_buf, logits = entry
            tok_buf.zero_()
            tok_buf[rows_t, 0] = tokens
            copy_to(pos_buf, positions)
            with torch.cuda.device(self.device):
                graph.replay()
        for row in rows:
            self._lengths[row] += 1
        return logits, rows

    def prefill(self, seq_id: str, tokens: Sequence[int]) -> torch.Tensor:
        """Append `tokens` to the sequence's cache; returns the logits of the last one `[vocab]` (device)."""
        return self.prefill_batch([seq_id], [tokens])[0]

    @torch.inference_mode()
    def prefill_batch(self, seq_ids: Sequence[str], chunks: Sequence[Sequence[int]]) -> torch.Tensor:
        """Append chunks[i] to sequence i's cache, all in one pass where a graph fits (newcomers of one
        step prefill together: one read of the weights for all). Returns each chunk's last logits
        `[n, vocab]` on the device."""
        return self.model._mm(self._prefill_hidden(seq_ids, chunks), self.model.lm_head)

    @torch.inference_mode()
    def extend(self, seq_ids: Sequence[str], chunks: Sequence[Sequence[int]]) -> None:
        """prefill_batch() without the logits: a draft catching up on tokens it did not feed needs
        only their K/V (the lm_head is the largest matrix of a 1B model's pass)."""
        self._prefill_hidden(seq_ids, chunks)

    def _prefill_hidden(self, seq_ids: Sequence[str], chunks: Sequence[Sequence[int]]) -> torch.Tensor:
        """Write the chunks' K/V; return each chunk's last final-normed hidden state `[n, hidden]`."""
        rows = [self._row[s] for s in seq_ids]
        starts = [self._lengths[r] for r in rows]
        lens = [len(c) for c in chunks]
        for start, n in zip(starts, lens):
            if start + n > self.max_context:
                raise ContextOverflow(start + n, self.max_context)
        m = self.model
        most = PREFILL_ROWS[-1]
        if self._pool is not None and len(rows) > most:  # graphs hold `most` rows: a pass per group
            return torch.cat([self._prefill_hidden(seq_ids[i:i + most], chunks[i:i + most])
                              for i in range(0, len(rows), most)])
        bucket = prefill_bucket(max(lens))
        height = next((h for h in PREFILL_ROWS if h >= len(rows)), None)
        if (self._pool is None or height is None or height * bucket > PREFILL_GRAPH_TOKENS
                or any(start + bucket > m.max_len for start in starts)):
            if len(rows) > 1:  # eagerly, one sequence at a time
                return torch.cat([self._prefill_hidden([s], [c]) for s, c in zip(seq_ids, chunks)])
            start, P = starts[0], lens[0]
            ids = to_device([list(chunks[0])], self.device)
            positions = torch.arange(start, start + P, device=self.device).view(1, -1)
            hidden = m._hidden(ids, positions, to_device(rows, self.device), self._kv_len(start + P - 1))
            self._lengths[rows[0]] = start + P
            return hidden[:, -1]  # [1, hidden]
        graph, tok_buf, pos_buf, row_buf, hidden = self._prefill_graph(height, bucket)
        tokens = np.zeros((height, bucket), dtype=np.int64)
        # the pads write past each chunk (harmless); padding sequences write into the scratch row
        positions = np.tile(np.arange(bucket, dtype=np.int64), (height, 1))
        row_ids = np.full(height, self._scratch_row, dtype=np.int64)
        for i, (row, start, chunk) in enumerate(zip(rows, starts, chunks)):
            tokens[i, :len(chunk)] = chunk
            positions[i] += start
            row_ids[i] = row
        copy_to(tok_buf, tokens)
        copy_to(pos_buf, positions)
        copy_to(row_buf, row_ids)
        with torch.cuda.device(self.device):
            graph.replay()
        for row, start, n in zip(rows, starts, lens):
            self._lengths[row] = start + n
        # [n, hidden]: a gather, a new tensor (the graph's buffer is overwritten by the next replay)
        return hidden[to_device(range(len(rows)), self.device), to_device([n - 1 for n in lens], self.device)]

    def _run(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """tokens, positions `[B, T]` on the host -> logits `[B, T, vocab]` on the device."""
        entry = self.model.graphs.get(tuple(tokens.shape))
        if entry is None:
            return self.model.forward(to_device(tokens, self.device), to_device(positions, self.device),
                                      kv_len=self._kv_len(int(positions.max())))
        graph, tok_buf, pos_buf, logits = entry
        copy_to(tok_buf, tokens)
        copy_to(pos_buf, positions)
        with torch.cuda.device(self.device):
            graph.replay()
        return logits

    def _kv_len(self, last_position: int) -> int:
        """Keys an eager pass attends over: past its last position, rounded up (fewer distinct shapes)."""
        return min(self.model.max_len, (last_position // 64 + 1) * 64)

    # ---- CUDA graphs ---------------------------------------------------------------------
    def _capture(self, widths: list[int]) -> None:
        t0 = time.perf_counter()
        # largest first: the shared pool is sized by the first capture, later ones fit in it
        for batch in sorted(self.buckets, reverse=True):
            for width in sorted(widths, reverse=True):
                self.model.capture(width, batch, pool=self._pool)
        for height in PREFILL_ROWS:
            for bucket in (16, 32, 64, 128, 256, 512, 1024):
                if height * bucket <= PREFILL_GRAPH_TOKENS and bucket <= self.model.max_len:
                    self._prefill_graph(height, bucket)
        log.info("captured %d step graphs (batch %s x width %s) and %d prefill graphs in %.1fs",
                 len(self.model.graphs), self.buckets, widths, len(self._prefill_graphs), time.perf_counter() - t0)

    def _prefill_graph(self, height: int, bucket: int) -> tuple:
        entry = self._prefill_graphs.get((height, bucket))
        if entry is None:
            m = self.model
            tokens = torch.zeros((height, bucket), dtype=torch.long, device=self.device)
            # capture writes at the last positions of the scratch row
            positions = torch.arange(m.max_len - bucket, m.max_len, device=self.device).view(1, -1).repeat(height, 1)
            rows = torch.full((height,), self._scratch_row, dtype=torch.long, device=self.device)
            graph, hidden = capture_graph(self.device, lambda: m._hidden(tokens, positions, rows), pool=self._pool)
            entry = self._prefill_graphs[(height, bucket)] = (graph, tokens, positions, rows, hidden)
        return entry
