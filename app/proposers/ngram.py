"""Prompt-lookup (n-gram) proposer: no model, proposes what followed the last n tokens before."""

from __future__ import annotations

from app.proposers.base import Proposal, ProposalRequest, Proposer


def ngram_lookup(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """The k tokens that followed the most recent earlier occurrence of the longest matching suffix."""
    for n in range(min(n_max, len(tokens) - 1), n_min - 1, -1):
        suffix = tokens[-n:]
        # scan right to left so the most recent match wins
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                follow = tokens[start + n : start + n + k]
                if follow:
                    return follow
    return []


class NgramProposer(Proposer):
    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min, self.n_max = n_min, n_max

    def propose(self, requests: list[ProposalRequest]) -> list[Proposal]:
        return [Proposal(ngram_lookup(r.token_ids, r.k, self.n_min, self.n_max)) for r in requests]
