"""Per-sequence KV caches that can be rolled back, and their packing into one batch.

Each sequence owns its keys/values per layer (`[heads, length, head_dim]`), so rollback
after a rejected draft is a slice, and sequences of different lengths join and leave a
batch freely. For a batched forward they are packed *left-padded* into one HF
`DynamicCache` (`[batch, heads, max_len, head_dim]`) with an attention mask that hides
the padding; after the pass each row's new entries are cut back out. On the CPU pair
this copy costs far less than the forward (see bench/RESULTS.md); the GPU path uses a
preallocated static cache instead.

Caches are caches, never state: a `SequenceKV` records which token ids it holds, so a
caller can check it against the truth and rebuild by prefill when it does not match.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import DynamicCache


@dataclass
class SequenceKV:
    """Keys/values of one sequence: per layer two tensors `[heads, length, head_dim]`."""

    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)  # the tokens whose KV is held, in order

    @property
    def length(self) -> int:
        return len(self.token_ids)

    def crop(self, length: int) -> None:
        """Roll back to the first `length` tokens (after a rejection)."""
        if length > self.length:
            raise ValueError(f"cannot crop a {self.length}-token cache to {length}")
        self.keys = [k[:, :length] for k in self.keys]
        self.values = [v[:, :length] for v in self.values]
        del self.token_ids[length:]

    def append(self, new_keys: list[torch.Tensor], new_values: list[torch.Tensor], tokens: list[int]) -> None:
        """Append `[heads, n, head_dim]` per layer for `tokens`."""
        if not self.keys:
            self.keys, self.values = list(new_keys), list(new_values)
        else:
            self.keys = [torch.cat([k, nk], dim=1) for k, nk in zip(self.keys, new_keys)]
            self.values = [torch.cat([v, nv], dim=1) for v, nv in zip(self.values, new_values)]
        self.token_ids.extend(tokens)

    def common_prefix(self, tokens: list[int]) -> int:
        """How many leading tokens of `tokens` this cache already holds."""
        n = 0
        for held, want in zip(self.token_ids, tokens):
            if held != want:
                break
            n += 1
        return n


@dataclass
class PackedBatch:
    """Inputs of one batched forward over sequences with different cache and input lengths.

    Row layout (left-padded twice so every row's last input token is in the last column):
        [pad * (max_past - past_i)] [past_i cached] [pad * (max_new - new_i)] [new_i inputs]
    """

    input_ids: torch.Tensor  # [batch, max_new]
    position_ids: torch.Tensor  # [batch, max_new]
    attention_mask: torch.Tensor  # [batch, max_past + max_new]
    cache: DynamicCache | None
    max_past: int
    max_new: int
    new_lengths: list[int]
    past_lengths: list[int]


def pack(caches: list[SequenceKV], inputs: list[list[int]], pad_id: int, device: torch.device) -> PackedBatch:
    past = [c.length for c in caches]
    new = [len(x) for x in inputs]
    if min(new) < 1:
        raise ValueError("every sequence in a batch needs at least one input token")
    max_past, max_new, batch = max(past), max(new), len(caches)
    input_ids = torch.full((batch, max_new), pad_id, dtype=torch.long)
    position_ids = torch.zeros((batch, max_new), dtype=torch.long)
    mask = torch.zeros((batch, max_past + max_new), dtype=torch.long)
    for i, (p, n, toks) in enumerate(zip(past, new, inputs)):
        input_ids[i, max_new - n :] = torch.tensor(toks, dtype=torch.long)
        position_ids[i, max_new - n :] = torch.arange(p, p + n)
        # padded inputs sit at harmless positions; their outputs are dropped
        position_ids[i, : max_new - n] = p
        mask[i, max_past - p : max_past] = 1
        mask[i, max_past + max_new - n :] = 1
    if max_past > 0 and min(past) == 0:
        # A row with no past whose inputs are shorter than the longest has padded queries
        # that can attend to nothing: softmax over all -inf gives NaN, and NaN values in the
        # cache poison later rows through 0 * NaN. Callers run such rows on their own.
        raise ValueError("pack() needs every row to have a cache when any row has one")
    cache = None
    if max_past > 0:
        layers = [
            (
                _left_pad_stack([c.keys[layer] for c in caches], max_past),
                _left_pad_stack([c.values[layer] for c in caches], max_past),
            )
            for layer in range(len(caches[0].keys))
        ]
        cache = DynamicCache(ddp_cache_data=layers)
    return PackedBatch(
        input_ids=input_ids.to(device),
        position_ids=position_ids.to(device),
        attention_mask=mask.to(device),
        cache=cache,
        max_past=max_past,
        max_new=max_new,
        new_lengths=new,
        past_lengths=past,
    )


def unpack(batch: PackedBatch, cache: DynamicCache, caches: list[SequenceKV], inputs: list[list[int]]) -> None:
    """Append each row's new keys/values (the last `new_i` columns) to its SequenceKV."""
    total = batch.max_past + batch.max_new
    layer_kv = [(k, v) for k, v, _ in cache]  # each [batch, heads, total, head_dim]
    for i, (seq, toks) in enumerate(zip(caches, inputs)):
        n = len(toks)
        seq.append(
            [k[i, :, total - n :] for k, _ in layer_kv],
            [v[i, :, total - n :] for _, v in layer_kv],
            toks,
        )


def _left_pad_stack(tensors: list[torch.Tensor], max_len: int) -> torch.Tensor:
    """Stack `[heads, len_i, dim]` tensors into `[batch, heads, max_len, dim]`, zero-padded on the left."""
    if len(tensors) == 1:
        return tensors[0].unsqueeze(0)  # batch of one: no copy needed
    heads, _, dim = tensors[0].shape
    out = tensors[0].new_zeros((len(tensors), heads, max_len, dim))
    for i, t in enumerate(tensors):
        out[i, :, max_len - t.shape[1] :] = t
    return out
