"""Benchmark/test proposers with controlled acceptance.

`OracleProposer` knows a reference continuation per sequence (the target's own greedy
output) and proposes it with per-token probability `alpha`, a wrong token otherwise.
alpha = 1 is "always right", alpha = 0 "always wrong". An optional `cost_proposer` is
run first so its time is real (DESIGN: random-weight GPU models agree on nothing, so
speed is measured at controlled acceptance while paying the real draft's cost).
"""

from __future__ import annotations

import random
import zlib
from dataclasses import replace

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
    tokens of the prompt (prompts must be at least that long); a coin is fixed by (sequence,
    position). Without references or alpha it proposes what the draft proposes.

    Alpha may differ per prompt class (`set_references(refs, {"code": 0.8, "prose": 0.35},
    classes)`), each reference naming its prompt's class as the router's classifier
    (app.policy.classify_prompt) sees the prompt: mixed traffic where speculation pays for one
    class and not for another, which a per-request policy has to tell apart. A reference whose
    class has no alpha gets the draft's own proposals."""

    KEY_TOKENS = 32

    def __init__(self, draft: Proposer, vocab_size: int) -> None:
        self.draft = draft
        self.vocab_size = vocab_size
        # prompt key -> (reference ids, that reference's alpha)
        self.references: dict[tuple[int, ...], tuple[list[int], float]] = {}
        self.alpha: float | dict[str, float] | None = None

    def set_references(self, references: list[list[int]], alpha: float | dict[str, float] | None,
                       classes: list[str] | None = None) -> None:
        """`alpha`: one probability for every reference, or one per prompt class with `classes`
        giving each reference's class (the same length as `references`); None turns it off."""
        if isinstance(alpha, dict):
            if classes is None or len(classes) != len(references):
                raise ValueError("a per-class alpha needs one class per reference")
            per_ref: list[float | None] = [alpha.get(c) for c in classes]
        else:
            per_ref = [alpha] * len(references)
        for a in per_ref:
            if a is not None and not 0.0 <= a <= 1.0:
                raise ValueError(f"alpha must be in [0, 1], got {a}")
        self.references = {tuple(r[:self.KEY_TOKENS]): (list(r), a) for r, a in zip(references, per_ref)
                           if a is not None}
        self.alpha = alpha

    def propose(self, requests: list[ProposalRequest]) -> list[Proposal]:
        if self.alpha is None:
            proposals = self.draft.propose(requests)
            self.last_first_pass = self.draft.last_first_pass
            return proposals
        # the draft runs with the chosen tokens forced: it feeds them back and its cache holds them, so a
        # step after an acceptance costs what a real draft's does (no catch-up of tokens it never fed)
        forced = [self._choose(r) for r in requests]
        proposals = self.draft.propose([replace(r, forced=f) if f else r for r, f in zip(requests, forced)])
        self.last_first_pass = self.draft.last_first_pass
        # a draft that does not feed forced tokens back (or drew them from a distribution) still
        # proposes exactly them
        return [Proposal(list(f[:len(p.tokens)])) if f and p.tokens else p for p, f in zip(proposals, forced)]

    def _choose(self, r: ProposalRequest) -> tuple[int, ...]:
        """The sequence's k proposals: at position p, reference[p] with its class's alpha, a wrong
        token otherwise; () for a prompt without a reference."""
        found = self.references.get(tuple(r.token_ids[:self.KEY_TOKENS]))
        if found is None:
            return ()
        ref, alpha = found
        # a stable hash of the sequence id (Python's str hash changes per process): the coins of a
        # sequence are the same in every replica and every run
        seed = zlib.crc32(r.seq_id.encode())
        tokens = []
        for pos in range(len(r.token_ids), len(r.token_ids) + r.k):
            right = ref[pos] if pos < len(ref) else 0
            tokens.append(right if uniform(seed, pos, "reference") < alpha else (right + 1) % self.vocab_size)
        return tuple(tokens)

    def release(self, seq_id: str) -> None:
        self.draft.release(seq_id)

    def num_cached_sequences(self) -> int:
        return self.draft.num_cached_sequences()
