"""The proposer interface: one batched `propose()` per engine step and a feedback hook."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from app.protocol.sampling_params import SamplingParams


@dataclass(frozen=True)
class ProposalRequest:
    """What a proposer needs for one sequence at one step."""

    seq_id: str
    token_ids: list[int]  # the sequence's truth: prompt + every token emitted so far
    k: int  # how many tokens to propose (>= 1)
    sampling: SamplingParams
    seed: int  # the request's resolved seed (per-position randomness derives from it)
    prompt_len: int = 0  # token_ids[prompt_len:] is the output: what a response format constrains
    # a benchmark's controlled acceptance (app/proposers/oracle.py): propose these tokens (up to k);
    # a proposer that runs a model still runs it and feeds them back instead of its own choice, so
    # its cost and its cache are those of a draft whose proposals these were
    forced: tuple[int, ...] = ()


@dataclass(frozen=True)
class Proposal:
    tokens: list[int]  # [k'] with 0 <= k' <= k
    # [k', vocab] the processed distributions the tokens were sampled from; None when the
    # proposals are deterministic (greedy draft, n-gram): verification then uses q = one-hot.
    probs: torch.Tensor | None = None


@dataclass(frozen=True)
class FirstPass:
    """The first forward of a proposer's step feeds every sequence what it has not seen yet (one
    token per sequence after a rejection, two after a full acceptance — the last proposal and the
    bonus token —, its whole context when it is new or has decoded plainly since) and proposes its
    first token. When it fed more than two tokens per sequence it was a catch-up (a prefill), whose
    time says nothing about the cost of a draft step."""

    tokens: int = 0  # tokens fed, all sequences together
    sequences: int = 0
    seconds: float = 0.0

    @property
    def caught_up(self) -> bool:
        return self.tokens > 2 * self.sequences


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens a and b share. A step's histories differ only near their ends (a draft's
    cache holds the truth and its own proposals, the truth gained the accepted ones and the target's),
    so the lists are compared in slices, in C, not token by token in Python (~50 us at 500 tokens)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
    if n > 32 and a[:n - 32] == b[:n - 32]:
        lo = n - 32
    while hi - lo > 8:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    while a[lo] == b[lo]:
        lo += 1
    return lo


class Proposer(ABC):
    """Proposes continuations for a batch of sequences; may keep per-sequence state as a cache."""

    last_first_pass: FirstPass = FirstPass()  # set by proposers that run a model (the draft)
    # proposes in another process (a draft replica): the engine may send a step's call ahead of time
    # (app/engine/draft_ahead.py); an in-process proposer would only compete with the engine's thread
    runs_elsewhere: bool = False

    @abstractmethod
    def propose(self, requests: list[ProposalRequest]) -> list[Proposal]:
        """One proposal per request, in order."""

    def catch_up_tokens(self, seq_id: str, token_ids: list[int]) -> int:
        """Tokens the next call would have to feed this sequence before its first proposal beyond
        the one or two of an ordinary drafting step: a prefill (its whole context when the proposer
        never saw it, the tokens of every plain step since it last drafted). 0 for proposers with
        nothing to catch up (n-gram)."""
        return 0

    def last_call_split(self, wall_s: float) -> tuple[float, float]:
        """The last propose() call's `wall_s` as (the proposer's own compute, the hop to it): all compute
        in process; a remote proposer says what its replica measured."""
        return wall_s, 0.0

    def prepare(self, sampling: SamplingParams) -> None:
        """Before a request is added: do what would otherwise stall a step the first time its
        settings are seen (compiling its response format). Nothing for most proposers."""

    def observe(self, seq_id: str, num_accepted: int) -> None:
        """Feedback after verification: how many of the last proposals were accepted."""

    def release(self, seq_id: str) -> None:
        """The sequence finished or was cancelled: free whatever is held for it."""

    def num_cached_sequences(self) -> int:
        return 0


class ProposerUnavailable(RuntimeError):
    """A remote proposer could not be reached; the engine decodes plainly for this step."""
