"""Load a causal LM + tokenizer and run batched forwards against per-sequence KV caches.

One method does all the model work: `forward(caches, inputs)` feeds each sequence its
new tokens (a whole prompt for prefill, one token for decode, k+1 for verify) in one
batched pass and returns each sequence's logits `[n_i, vocab]`. Prefill, decode and
verify are the same call with different input lengths.
"""

from __future__ import annotations

import logging
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from app.config import ModelSpec
from app.kv_cache import SequenceKV, pack, unpack

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def load_tokenizer(spec: ModelSpec) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(spec.resolved_path())


class ModelRunner:
    """A model on one device, its tokenizer, and the batched forward."""

    def __init__(self, spec: ModelSpec) -> None:
        if spec.num_threads:
            torch.set_num_threads(spec.num_threads)
        self.spec = spec
        self.device = torch.device(spec.device)
        path = spec.resolved_path()
        t0 = time.perf_counter()
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[spec.dtype])
        self.model.to(self.device).eval().requires_grad_(False)
        config = self.model.config
        self.vocab_size: int = config.vocab_size
        self.max_context: int = spec.max_context or config.max_position_embeddings
        self.pad_id: int = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.eos_ids: frozenset[int] = _eos_ids(self.tokenizer, self.model)
        self.last_padded_tokens = 0  # tokens the last forward computed, padding included
        log.info("loaded %s (%s, %s) in %.1fs", path, spec.dtype, spec.device, time.perf_counter() - t0)

    @torch.inference_mode()
    def forward(self, caches: list[SequenceKV], inputs: list[list[int]], max_padding: int | None = None) -> list[torch.Tensor]:
        """Feed `inputs[i]` to sequence i, append to `caches[i]`; return float32 logits `[n_i, vocab]`.

        Rows are padded to the longest input of their pass (kv_cache.pack), so a pass costs
        rows x longest tokens: `last_padded_tokens` says how many it computed. Rows without a
        cache (fresh prefills) run one by one unless every row is fresh with equal length: their
        padded queries could attend to nothing (see kv_cache.pack). `max_padding`: run the cached
        rows in several passes, by input length, rather than pad more than this many tokens in one
        (a draft's catch-up of 20 tokens in a batch of 32 one-token rows would otherwise pad it 20x).
        """
        for cache, toks in zip(caches, inputs):
            if cache.length + len(toks) > self.max_context:
                raise ContextOverflow(cache.length + len(toks), self.max_context)
        fresh = [i for i, c in enumerate(caches) if c.length == 0]
        out: list[torch.Tensor | None] = [None] * len(caches)
        groups: list[list[int]] = [[i] for i in fresh]
        rest = [i for i in range(len(caches)) if caches[i].length > 0]
        if rest:
            groups += length_groups(rest, [len(inputs[i]) for i in rest], max_padding)
        self.last_padded_tokens = 0
        for group in groups:
            logits = self._forward_packed([caches[i] for i in group], [inputs[i] for i in group])
            self.last_padded_tokens += len(group) * max(len(inputs[i]) for i in group)
            for i, row in zip(group, logits):
                out[i] = row
        return out  # type: ignore[return-value]

    def _forward_packed(self, caches: list[SequenceKV], inputs: list[list[int]]) -> list[torch.Tensor]:
        batch = pack(caches, inputs, self.pad_id, self.device)
        result = self.model(
            input_ids=batch.input_ids,
            position_ids=batch.position_ids,
            attention_mask=batch.attention_mask,
            past_key_values=batch.cache,
            use_cache=True,
        )
        unpack(batch, result.past_key_values, caches, inputs)
        logits = result.logits.float()  # [batch, max_new, vocab]
        return [logits[i, batch.max_new - n :] for i, n in enumerate(batch.new_lengths)]


def length_groups(rows: list[int], lengths: list[int], max_padding: int | None) -> list[list[int]]:
    """Split `rows` (with input `lengths`) into passes, shortest inputs first, starting a new pass
    where joining the next row would pad the pass by more than `max_padding` tokens. None: one pass.
    Each extra pass costs a forward's fixed time (weights, dispatch), so only large padding is split."""
    if max_padding is None or len(rows) < 2:
        return [list(rows)]
    order = sorted(range(len(rows)), key=lambda j: lengths[j])
    groups: list[list[int]] = [[]]
    total = 0  # input tokens of the current pass
    for j in order:
        group = groups[-1]
        if group and (len(group) + 1) * lengths[j] - total - lengths[j] > max_padding:
            groups.append([])
            group, total = groups[-1], 0
        group.append(rows[j])
        total += lengths[j]
    return groups


class ContextOverflow(ValueError):
    def __init__(self, needed: int, limit: int) -> None:
        super().__init__(f"sequence needs {needed} tokens of context but the model allows {limit}")
        self.needed, self.limit = needed, limit


def _eos_ids(tokenizer: PreTrainedTokenizerBase, model: torch.nn.Module) -> frozenset[int]:
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    gen = getattr(model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None)
    if isinstance(eos, int):
        ids.add(eos)
    elif eos:
        ids.update(eos)
    return frozenset(ids)
