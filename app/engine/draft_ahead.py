"""Draft calls sent one step ahead: the draft replica works while the target replica does its host work.

A speculative step ends with host work on the target replica that needs no draft: emitting and
detokenizing, the replica's metrics and policy bookkeeping, handing tokens to the streams, the next
step's admission and planning (~1 ms at one sequence, several at eight). The next step's draft call
needs only each sequence's truth, known once this step has emitted, and its depth. So when the draft
runs elsewhere (a draft replica: its own process, its own share of the GPU, idle while the target
replica's host works), the engine sends the next call as soon as a speculative step has emitted, for
every sequence that drafted in it and goes on, at the depth it just drafted, and collects the answer
when the next step wants proposals. A sequence whose truth or planned depth no longer fits what was
sent (the planner chose a deeper draft, the sequence is new, its cache was rebuilt) gets a call of its
own then; a shallower plan takes the first proposals of the sent ones (the draft's cache holds all of
them: the next call rolls it back by length, as after any rejection). So the output is what drafting
on demand produces; only when the draft's answer arrives changes.

The call runs on one helper thread (its socket wait releases the GIL). Nothing else may talk to the
proposer while it runs: releases of finished or cancelled sequences wait for its end (`release`), as
does the idle flush (`settle`).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from app.proposers.base import FirstPass, Proposal, ProposalRequest, Proposer, ProposerUnavailable

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DraftCallTimes:
    """One proposer call for `batch` sequences, `depth` the deepest: its wall time, the proposer's own
    compute (the draft replica's, for a remote draft), the hop outside it, and its first pass (a
    catch-up when it fed more than 2 tokens a row). The cost model prices a draft step from these."""

    batch: int
    depth: int
    wall_s: float
    compute_s: float
    hop_s: float
    first_pass: FirstPass

    @staticmethod
    def of(proposer: Proposer, requests: list[ProposalRequest], wall_s: float) -> "DraftCallTimes":
        compute, hop = proposer.last_call_split(wall_s)
        return DraftCallTimes(len(requests), max((r.k for r in requests), default=0), wall_s, compute, hop,
                              proposer.last_first_pass)


@dataclass
class _Call:
    future: Future  # -> (proposals in request order, DraftCallTimes); raises ProposerUnavailable
    sent: dict[str, tuple[int, int]]  # seq_id -> (the truth's length, k) as sent, in request order


class DraftAhead:
    """The engine's one draft call in flight, if any, and the releases waiting for it to end."""

    def __init__(self, proposer: Proposer) -> None:
        self.proposer = proposer
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="draft-ahead")
        self._call: _Call | None = None
        self._releases: list[str] = []
        self.served = 0  # sequences whose proposals came from a call sent ahead

    @property
    def in_flight(self) -> bool:
        return self._call is not None

    def launch(self, requests: list[ProposalRequest]) -> None:
        """Send the next step's call now (after `settle`: one call at a time)."""
        if self._call is not None:
            raise RuntimeError("a draft call is already in flight: settle() it first")
        if requests:
            self._call = _Call(self._pool.submit(self._propose, requests),
                               {r.seq_id: (len(r.token_ids), r.k) for r in requests})

    def _propose(self, requests: list[ProposalRequest]) -> tuple[list[Proposal], DraftCallTimes]:
        t0 = time.perf_counter()
        proposals = self.proposer.propose(requests)
        # read here, on the call's own thread: a later call would overwrite the proposer's figures
        return proposals, DraftCallTimes.of(self.proposer, requests, time.perf_counter() - t0)

    def take(self, lengths: dict[str, int], ks: dict[str, int]) -> tuple[dict[str, Proposal], DraftCallTimes | None]:
        """Wait for the call in flight and return the proposals that serve this step: those of sequences
        sent with this truth length (`lengths`) and at least this depth (`ks`), cut to it, and the call's
        times. ({}, None) when none was in flight or the draft did not answer."""
        call = self._call
        if call is None:
            return {}, None
        released = set(self._releases)  # cancelled meanwhile: an id added again is another sequence
        proposals, times = self._wait(call)
        out: dict[str, Proposal] = {}
        for (seq_id, (length, k)), p in zip(call.sent.items(), proposals):
            want = ks.get(seq_id, 0)
            if want and lengths.get(seq_id) == length and want <= k and seq_id not in released:
                out[seq_id] = Proposal(p.tokens[:want], None if p.probs is None else p.probs[:want])
        self.served += len(out)
        return out, times

    def _wait(self, call: _Call) -> tuple[list[Proposal], DraftCallTimes | None]:
        """The call's answer ([] when the draft did not answer or the call failed); then nothing is in
        flight and the releases it held back are sent."""
        try:
            return call.future.result()
        except ProposerUnavailable:
            return [], None
        except Exception:  # noqa: BLE001 — a failed call costs its proposals, not the step's batch
            log.exception("a draft call sent ahead failed")
            return [], None
        finally:
            self._call = None
            self._release_waiting()

    def settle(self) -> None:
        """Wait for the call in flight (its answer is dropped) and send the releases it held back."""
        if self._call is not None:
            self._wait(self._call)
        self._release_waiting()

    def reap(self) -> None:
        """settle() if the call in flight has ended: a step that does not draft leaves it unclaimed, and
        the releases it holds back (and the histories of finished sequences) would wait for the next
        drafting step."""
        if self._call is not None and self._call.future.done():
            self.settle()

    def release(self, seq_id: str) -> None:
        """Free the sequence on the proposer now, or when the call in flight ends."""
        self.reap()
        if self._call is None:
            self.proposer.release(seq_id)
        else:
            self._releases.append(seq_id)

    def _release_waiting(self) -> None:
        while self._releases:
            self.proposer.release(self._releases.pop(0))

    def close(self) -> None:
        """settle(), and end the helper thread."""
        self.settle()
        self._pool.shutdown(wait=False)
