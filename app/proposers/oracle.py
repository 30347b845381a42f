"""Benchmark/test proposers with controlled acceptance.

`OracleProposer` knows a reference continuation per sequence (the target's own greedy
output) and proposes it with per-token probability `alpha`, a wrong token otherwise.
alpha = 1 is "always right", alpha = 0 "always wrong". An optional `cost_proposer` is
run first so its time is real (DESIGN: random-weight GPU models agree on nothing, so
speed is measured at controlled acceptance while paying the real draft's cost).
"""

from __future__ import annotations

import random

from app.proposers.base import Proposal, ProposalRequest, Proposer
from app.spec.sampling import uniform


class OracleProposer(Proposer):
    def __init__(
        self,
        references: dict[str, list[int]],
        alpha: float,
        vocab_size: int,
        seed: int = 0,
        cost_proposer: Proposer | None = None,
    ) -> None:
        self.references = references  # seq_id -> full reference token ids (prompt + continuation)
        self.alpha = alpha
        self.vocab_size = vocab_size
        self.rng = random.Random(seed)
        self.cost_proposer = cost_proposer

    def propose(self, requests: list[ProposalRequest]) -> list[Proposal]:
        if self.cost_proposer is not None:
            self.cost_proposer.propose(requests)
        out = []
        for r in requests:
            ref = self.references[r.seq_id]
            pos = len(r.token_ids)
            tokens = []
            for j in range(r.k):
                right = ref[pos + j] if pos + j < len(ref) else 0
                if self.rng.random() < self.alpha:
                    tokens.append(right)
                else:
                    tokens.append((right + 1 + self.rng.randrange(self.vocab_size - 1)) % self.vocab_size)
            out.append(Proposal(tokens=tokens))
        return out

    def release(self, seq_id: str) -> None:
        if self.cost_proposer is not None:
            self.cost_proposer.release(seq_id)


class ReferenceProposer(Proposer):
    """The served benchmark's draft proposer: the real draft model runs every step (its cost is
    real, KV cache included), then for a sequence whose prompt has a loaded reference (the target's
    greedy continuation, from a plain run) the proposal at position p becomes reference[p] with
    probability alpha and a wrong token otherwise. References are keyed by the first KEY_TOKENS
    tokens of the prompt; a coin is fixed by (sequence, position). Without references or alpha it
    proposes what the draft proposes."""

    KEY_TOKENS = 32

    def __init__(self, draft: Proposer, vocab_size: int) -> None:
        self.draft = draft
        self.vocab_size = vocab_size
        self.references: dict[tuple[int, ...], list[int]] = {}
        self.alpha: float | None = None

    def set_references(self, references: list[list[int]], alpha: float | None) -> None:
        self.references = {tuple(r[:self.KEY_TOKENS]): list(r) for r in references}
        self.alpha = alpha

    def propose(self, requests: list[ProposalRequest]) -> list[Proposal]:
        proposals = self.draft.propose(requests)
        self.last_first_pass = self.draft.last_first_pass
        if self.alpha is None:
            return proposals
        out = []
        for r, p in zip(requests, proposals):
            ref = self.references.get(tuple(r.token_ids[:self.KEY_TOKENS]))
            if ref is None or not p.tokens:
                out.append(p)
                continue
            tokens = []
            for j in range(len(p.tokens)):
                pos = len(r.token_ids) + j
                right = ref[pos] if pos < len(ref) else 0
                coin = uniform(hash(r.seq_id) & (2**62 - 1), pos, "reference")
                tokens.append(right if coin < self.alpha else (right + 1) % self.vocab_size)
            out.append(Proposal(tokens))
        return out

    def release(self, seq_id: str) -> None:
        self.draft.release(seq_id)

    def num_cached_sequences(self) -> int:
        return self.draft.num_cached_sequences()
