"""The proposer interface: one batched `propose()` per engine step and a feedback hook."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from app.config import SamplingParams


@dataclass(frozen=True)
class ProposalRequest:
    """What a proposer needs for one sequence at one step."""

    seq_id: str
    token_ids: list[int]  # the sequence's truth: prompt + every token emitted so far
    k: int  # how many tokens to propose (>= 1)
    sampling: SamplingParams
    seed: int  # the request's resolved seed (per-position randomness derives from it)


@dataclass(frozen=True)
class Proposal:
    tokens: list[int]  # [k'] with 0 <= k' <= k
    # [k', vocab] the processed distributions the tokens were sampled from; None when the
    # proposals are deterministic (greedy draft, n-gram): verification then uses q = one-hot.
    probs: torch.Tensor | None = None


class Proposer(ABC):
    """Proposes continuations for a batch of sequences; may keep per-sequence state as a cache."""

    @abstractmethod
    def propose(self, requests: list[ProposalRequest]) -> list[Proposal]:
        """One proposal per request, in order."""

    def observe(self, seq_id: str, num_accepted: int) -> None:
        """Feedback after verification: how many of the last proposals were accepted."""

    def release(self, seq_id: str) -> None:
        """The sequence finished or was cancelled: free whatever is held for it."""

    def num_cached_sequences(self) -> int:
        return 0


class ProposerUnavailable(RuntimeError):
    """A remote proposer could not be reached; the engine decodes plainly for this step."""
