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
