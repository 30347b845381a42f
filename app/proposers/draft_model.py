"""Draft-model proposer: a small causal LM with its own per-sequence KV caches.

Per step and for the whole batch: bring each sequence's draft cache up to its truth
(crop to the common prefix, feed what is missing — usually the last accepted tokens and
the target's correction), then run k batched single-token steps. The k-th proposal is
not fed back; if it is accepted it is fed at the next step's catch-up.
"""

from __future__ import annotations

import time

import torch

from app.config import ModelSpec
from app.kv_cache import SequenceKV
from app.model_runner import ModelRunner
from app.proposers.base import FirstPass, Proposal, ProposalRequest, Proposer
from app.sampling import position_generator, processed_probs, sample


# Padding one pass by more tokens than this costs more than a second pass: on the embedded CPU draft
# a forward's fixed cost is ~2.5 ms and a padded token ~0.04 ms (bench/pad_cost.py, batch 32, KV 120:
# one 20-token catch-up padded into 31 two-token rows 32 ms, run apart 16 ms; two rows 3.8 ms padded, 5.0 apart).
CATCH_UP_MAX_PADDING = 64


class DraftModelProposer(Proposer):
    def __init__(self, spec: ModelSpec | None = None, runner: ModelRunner | None = None) -> None:
        if runner is None:
            if spec is None:
                raise ValueError("DraftModelProposer needs a ModelSpec or a loaded ModelRunner")
            runner = ModelRunner(spec)
        self.runner = runner
        self.caches: dict[str, SequenceKV] = {}
        self.cache_misses = 0  # sequences rebuilt from scratch (new, evicted or replica restarted)

    def propose(self, requests: list[ProposalRequest]) -> list[Proposal]:
        if not requests:
            return []
        limit = self.runner.max_context
        ks = [max(0, min(r.k, limit - len(r.token_ids))) for r in requests]
        feeds: list[list[int]] = []
        caches: list[SequenceKV] = []
        for r in requests:
            cache = self.caches.get(r.seq_id)
            if cache is None:
                cache = self.caches[r.seq_id] = SequenceKV()
                self.cache_misses += 1
            held = min(cache.common_prefix(r.token_ids), len(r.token_ids) - 1)  # feed >= 1 token
            cache.crop(held)
            caches.append(cache)
            feeds.append(r.token_ids[held:])
        tokens: list[list[int]] = [[] for _ in requests]
        probs: list[list[torch.Tensor]] = [[] for _ in requests]
        active = [i for i, k in enumerate(ks) if k > 0]
        step = 0
        t0 = time.perf_counter()
        self.last_first_pass = FirstPass()
        while active:
            # the first pass may catch some sequences up by many tokens: run those apart rather
            # than pad every row to them (later passes feed one token per row)
            logits = self.runner.forward([caches[i] for i in active], [feeds[i] for i in active],
                                         max_padding=CATCH_UP_MAX_PADDING if step == 0 else None)
            if step == 0:
                self.last_first_pass = FirstPass(sum(len(feeds[i]) for i in active), len(active),
                                                 time.perf_counter() - t0)
            for i, row in zip(active, logits):
                r = requests[i]
                position = len(r.token_ids) + step
                last = row[-1]  # [vocab]
                if r.sampling.greedy:
                    token = int(torch.argmax(last).item())
                else:
                    q = processed_probs(last.unsqueeze(0), r.sampling)[0]
                    token = sample(q, position_generator(r.seed, position, "draft"))
                    probs[i].append(q.cpu())
                tokens[i].append(token)
                feeds[i] = [token]
            step += 1
            active = [i for i in active if ks[i] > step]
        return [
            Proposal(tokens=t, probs=torch.stack(p) if p else None) for t, p in zip(tokens, probs)
        ]

    def release(self, seq_id: str) -> None:
        self.caches.pop(seq_id, None)

    def num_cached_sequences(self) -> int:
        return len(self.caches)

    def cached_tokens(self) -> int:
        return sum(c.length for c in self.caches.values())
