"""The draft <-> target step protocol: one call per target step for the whole batch.

Caches are caches: each sequence entry says what the draft should already hold
(`base_len` tokens with hash `base_hash`) and carries only the tokens after it. A draft
replica that does not hold that base (new, restarted, or replaced replica) answers
*miss* for the sequence, and the client resends it in full; the draft rebuilds its KV
by prefill. A wrong token is never possible, only a slower step.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable

from app.protocol.sampling_params import SamplingParams
from app.proposers.base import FirstPass, Proposal, ProposalRequest, Proposer, ProposerUnavailable, common_prefix


# A polynomial hash mod a Mersenne prime, extendable by the tokens a step appends: both sides keep the
# hash of what they hold and update it in O(new tokens) (hashing and comparing each history whole cost
# the two sides ~130 us per sequence per step at ~500 tokens: 4.1 ms a step at 32 sequences). It guards
# speed, not correctness: a collision would let the draft propose from the wrong history, which
# verification then rejects.
_HASH_MOD = (1 << 61) - 1
_HASH_BASE = 1_000_003


def extend_hash(h: int, tokens: Iterable[int]) -> int:
    """The hash of (what `h` hashes) + tokens."""
    for t in tokens:
        h = (h * _HASH_BASE + t + 1) % _HASH_MOD
    return h


def tokens_hash(tokens: Iterable[int]) -> int:
    return extend_hash(0, tokens)


@dataclass(frozen=True)
class DraftSeqDelta:
    seq_id: str
    base_len: int  # tokens the draft should already hold as this sequence's truth
    base_hash: int  # tokens_hash of those tokens (0 when base_len == 0)
    append: list[int]  # the tokens after the base
    k: int
    sampling: SamplingParams
    seed: int
    prompt_len: int = 0  # the truth's prompt tokens (ProposalRequest.prompt_len)


@dataclass
class DraftStepRequest:
    client_id: str  # the calling target replica (the affinity key)
    seqs: list[DraftSeqDelta]
    release: list[str] = field(default_factory=list)  # finished or cancelled sequences


@dataclass
class DraftStepResponse:
    proposals: dict[str, Proposal]
    misses: list[str]
    draft_time_s: float
    first_pass: FirstPass = FirstPass()  # the step's first forward (a catch-up when it fed > 1 token per sequence)


class DraftWorker:
    """The draft replica's side: resolves deltas against what it holds, proposes in one batch."""

    def __init__(self, proposer: Proposer) -> None:
        self.proposer = proposer
        self.truth: dict[str, tuple[list[int], int]] = {}  # per sequence: its tokens and their hash
        self.misses = 0

    def step(self, request: DraftStepRequest) -> DraftStepResponse:
        for seq_id in request.release:
            self.truth.pop(seq_id, None)
            self.proposer.release(seq_id)
        t0 = time.perf_counter()
        resolved: list[ProposalRequest] = []
        misses: list[str] = []
        for s in request.seqs:
            held, held_hash = self.truth.get(s.seq_id, (None, 0))
            if s.base_len == 0:
                tokens, h = list(s.append), tokens_hash(s.append)
            elif held is not None and len(held) == s.base_len and held_hash == s.base_hash:  # a step's usual case
                tokens, h = held + list(s.append), extend_hash(held_hash, s.append)
            elif held is not None and len(held) > s.base_len and tokens_hash(held[:s.base_len]) == s.base_hash:
                tokens, h = held[:s.base_len] + list(s.append), extend_hash(s.base_hash, s.append)
            else:
                misses.append(s.seq_id)
                self.misses += 1
                continue
            self.truth[s.seq_id] = (tokens, h)
            resolved.append(ProposalRequest(s.seq_id, tokens, s.k, s.sampling, s.seed, s.prompt_len))
        proposals = self.proposer.propose(resolved)
        return DraftStepResponse(
            proposals={r.seq_id: p for r, p in zip(resolved, proposals)},
            misses=misses,
            draft_time_s=time.perf_counter() - t0,
            first_pass=self.proposer.last_first_pass,
        )

    def num_sequences(self) -> int:
        return len(self.truth)


class DraftUnavailable(ProposerUnavailable):
    """No draft replica answered; the engine decodes plainly for this step."""


class DraftClient(Proposer):
    """The target replica's side: a Proposer that sends one delta-encoded call per step.

    `transport` carries a request to a draft replica and returns its response (a Serve
    handle call in production, a direct DraftWorker call in tests); it raises
    DraftUnavailable when no draft replica answers.
    """

    runs_elsewhere = True

    def __init__(self, client_id: str, transport: Callable[[DraftStepRequest], DraftStepResponse]) -> None:
        self.client_id = client_id
        self.transport = transport
        self.sent: dict[str, tuple[list[int], int]] = {}  # what we believe the draft holds, and its hash
        self.proposed: dict[str, list[int]] = {}  # its last proposals: it fed itself all but the last
        self.pending_release: list[str] = []
        self._release_lock = threading.Lock()  # release() and an idle flush() run on different threads
        self.resends = 0
        self.last_exchange_s = 0.0
        self.last_draft_s = 0.0

    def _delta(self, r: ProposalRequest, full: bool) -> DraftSeqDelta:
        sent, sent_hash = ([], 0) if full else self.sent.get(r.seq_id, ([], 0))
        ids = r.token_ids
        if len(sent) <= len(ids) and ids[:len(sent)] == sent:  # the truth only grows: the usual case
            base, base_hash = len(sent), sent_hash
        else:
            base = common_prefix(sent, ids)
            base_hash = tokens_hash(ids[:base])
        return DraftSeqDelta(r.seq_id, base, base_hash, ids[base:], r.k, r.sampling, r.seed, r.prompt_len)

    def propose(self, requests: list[ProposalRequest]) -> list[Proposal]:
        if not requests:
            return []
        by_id = {r.seq_id: r for r in requests}
        t0 = time.perf_counter()
        deltas = [self._delta(r, full=False) for r in requests]
        sent_deltas = {d.seq_id: d for d in deltas}
        response = self._call(deltas)
        proposals = dict(response.proposals)
        draft_s = response.draft_time_s
        first = response.first_pass
        if response.misses:
            # the draft lost (or never had) these sequences: resend them in full, once
            self.resends += len(response.misses)
            resent = [self._delta(by_id[m], full=True) for m in response.misses]
            sent_deltas.update((d.seq_id, d) for d in resent)
            retry = self._call(resent)
            proposals.update(retry.proposals)
            draft_s += retry.draft_time_s
            first = FirstPass(first.tokens + retry.first_pass.tokens, first.sequences + retry.first_pass.sequences,
                              first.seconds + retry.first_pass.seconds)
        self.last_draft_s = draft_s
        self.last_first_pass = first
        self.last_exchange_s = max(0.0, time.perf_counter() - t0 - draft_s)
        for r in requests:
            delta = sent_deltas[r.seq_id]
            self.sent[r.seq_id] = (list(r.token_ids), extend_hash(delta.base_hash, delta.append))
            self.proposed[r.seq_id] = proposals[r.seq_id].tokens if r.seq_id in proposals else []
        return [proposals.get(r.seq_id, Proposal([])) for r in requests]

    def last_call_split(self, wall_s: float) -> tuple[float, float]:
        return self.last_draft_s, self.last_exchange_s

    def catch_up_tokens(self, seq_id: str, token_ids: list[int]) -> int:
        entry = self.sent.get(seq_id)
        if entry is None:
            return max(0, len(token_ids) - 2)  # new to the draft (or it restarted): its whole context
        # the draft holds sent + its own proposals but the last; it feeds what follows the common prefix
        held = self.proposed.get(seq_id, [])[:-1]
        n = len(entry[0]) + common_prefix(held, token_ids[len(entry[0]):])
        return max(0, len(token_ids) - n - 2)

    def _call(self, seqs: list[DraftSeqDelta]) -> DraftStepResponse:
        with self._release_lock:
            request = DraftStepRequest(self.client_id, seqs, self.pending_release)
            self.pending_release = []
        try:
            return self.transport(request)
        except DraftUnavailable:
            self.sent.clear()  # whatever answers next may hold nothing
            self.proposed.clear()
            # a live but slow draft still holds these: tell it next time (unknown ids are ignored)
            with self._release_lock:
                self.pending_release = request.release + self.pending_release
            raise

    def release(self, seq_id: str) -> None:
        self.proposed.pop(seq_id, None)
        if self.sent.pop(seq_id, None) is not None:
            with self._release_lock:
                self.pending_release.append(seq_id)

    def flush(self) -> None:
        """Send pending releases now (they otherwise ride on the next step call, which an
        idle or non-speculating replica may never make); raises DraftUnavailable."""
        if self.pending_release:
            self._call([])
