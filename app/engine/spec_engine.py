"""The batched speculative engine: continuous batching where some sequences verify k+1
tokens and others decode one, all in one target forward per step.

Per step:
  1. choose k per decoding sequence (0 = plain decoding): the planner sees the whole batch,
     because one speculating sequence makes every sequence of the step wait for the draft
  2. one batched `proposer.propose()` for every speculating sequence
  3. one batched target forward (the runner's): input per sequence = [last token] + its proposals
  4. verify every row on the device with one host read (app/spec/verify.py), roll each
     sequence's cache back by length to what was accepted, emit tokens, stop on EOS /
     max_tokens / stop strings
  5. admit waiting requests while rows and the KV budget allow, and prefill prompts in chunks
     of at most `prefill_chunk` tokens a step, so a long prompt does not stall the batch; a
     sequence whose prompt is complete emits its first token and decodes from the next step

A sequence's truth is its token ids; the runner's cache holds all of them but the last (the
last emitted token is fed at the next step). The engine holds sequence ids, never cache
tensors. Synchronous and Ray-free: the Serve target deployment drives `step()` from its loop.
"""

from __future__ import annotations

import random
import time
from collections import deque
from typing import Callable

import torch

from app.engine import ahead
from app.engine.acceptance import AcceptanceStats
from app.engine.draft_ahead import DraftAhead, DraftCallTimes
from app.engine.detokenizer import StopChecker
from app.engine.sequence import FinishReason, SeqUpdate, Sequence, StepTimes
from app.config import EngineLimits
from app.protocol.sampling_params import SamplingParams
from app.proposers.base import Proposal, ProposalRequest, Proposer, ProposerUnavailable
from app.runners.model_runner import ContextOverflow, ModelRunner
from app.spec.grammar import GrammarState, LazyGrammars
from app.spec.sampling import sample_token
from app.spec.verify import RowToVerify, TokenLogprob, token_logprobs, verify_batch

__all__ = ["FinishReason", "Overloaded", "ProposerUnavailable", "SeqUpdate", "Sequence", "SpecEngine", "StepPlanner",
           "StepTimes"]

# Prompt tokens prefilled per engine step, all newcomers together: bounds how long a long prompt
# stalls the decoding batch (one chunk per step) while short prompts still finish in one step.
PREFILL_CHUNK = 512


class Overloaded(RuntimeError):
    """The waiting queue is full: the caller should answer 429 with Retry-After."""


# (batch, per-sequence caps) -> drafts per sequence this step, each in 0..cap. Lets the policy
# adapt k (to 0 included) as acceptance and load move. Without one, every sequence drafts its cap.
StepPlanner = Callable[[list[Sequence], list[int]], list[int]]


class SpecEngine:
    def __init__(
        self,
        runner: ModelRunner,
        proposer: Proposer | None,
        limits: EngineLimits = EngineLimits(),
        max_k: int = 8,
        plan_k: StepPlanner | None = None,
        prefill_chunk: int = PREFILL_CHUNK,
        launch_ahead: bool = True,
        draft_ahead: bool = True,
    ) -> None:
        if runner.max_seqs < limits.max_num_seqs:
            raise ValueError(f"the runner has {runner.max_seqs} cache rows but limits.max_num_seqs is "
                             f"{limits.max_num_seqs}: build the runner with max_seqs >= max_num_seqs")
        self.runner = runner
        self.proposer = proposer
        self.limits = limits
        self.max_k = max_k
        self.plan_k = plan_k
        self.prefill_chunk = prefill_chunk
        # plain passes launched before the last step's host work (app/engine/ahead.py); False: every step
        # waits for the one before (the A/B baseline of benchmarks and tests)
        self.launch_ahead = launch_ahead
        self._ahead: ahead.AheadPass | None = None
        # a remote draft's next call sent as soon as a speculative step has emitted (app/engine/draft_ahead.py);
        # False: each step calls it when it needs proposals (the A/B baseline)
        self.drafting: DraftAhead | None = None
        self.set_draft_ahead(draft_ahead)
        self.waiting: deque[Sequence] = deque()
        self.running: dict[str, Sequence] = {}  # admitted: prefilling or decoding, each with a cache row
        self.stats = AcceptanceStats()
        self.last_times = StepTimes()
        self.proposer_errors = 0  # steps that decoded plainly because the proposer was unavailable
        self.grammar_cut_tokens = 0  # proposals dropped because the response format forbids them (or what followed)
        self.queue_times: list[float] = []  # seconds admitted requests waited; the caller drains it
        self._special_ids = frozenset(getattr(runner.tokenizer, "all_special_ids", ()) or ())
        self._grammars = LazyGrammars(runner.tokenizer, runner.vocab_size, runner.eos_ids, max_rollback=max_k + 1)

    # ---- admission -------------------------------------------------------------------
    def add(
        self,
        seq_id: str,
        prompt_ids: list[int],
        sampling: SamplingParams,
        k: int = 0,
        adaptive: bool = False,
        alpha_prior: float | None = None,
        output_ids: list[int] | None = None,
    ) -> None:
        """Queue a request; raises ValueError for bad input and Overloaded when the queue is full.

        `k`: most drafts per step (0: never speculate). `adaptive`: the step planner may use any
        depth in 0..k at each step; otherwise the sequence drafts k every step (a forced 'on').
        `output_ids`: the output already streamed by a replica that failed; generation resumes
        after it as if uninterrupted (max_tokens, min_tokens, penalties and the response format
        count it; randomness is per position), and only new tokens are emitted."""
        if not prompt_ids:
            raise ValueError("prompt is empty")
        resumed = list(output_ids or [])
        if len(resumed) >= sampling.max_tokens:
            raise ValueError(f"{len(resumed)} tokens already generated, max_tokens is {sampling.max_tokens}")
        if seq_id in self.running or any(s.seq_id == seq_id for s in self.waiting):
            raise ValueError(f"sequence {seq_id!r} already exists")
        need = len(prompt_ids) + sampling.max_tokens
        if need > self.runner.max_context:
            raise ContextOverflow(need, self.runner.max_context)
        if need > self.limits.max_cached_tokens:
            raise ValueError(
                f"prompt + max_tokens = {need} tokens exceeds this replica's KV budget "
                f"({self.limits.max_cached_tokens}); lower max_tokens"
            )
        vocab = self.runner.vocab_size
        for name, ids in (("stop_token_ids", sampling.stop_token_ids), ("logit_bias", [t for t, _ in sampling.logit_bias])):
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"{name} has token ids outside this model's vocabulary of {vocab}: {bad[:5]}")
        if self._left_waiting(need) > self.limits.max_queue:
            raise Overloaded(f"{len(self.waiting)} requests already waiting")
        grammar = self._grammar(sampling, resumed)
        seed = sampling.seed if sampling.seed is not None else random.getrandbits(63)
        k = min(k, self.max_k) if self.proposer is not None else 0
        stop = StopChecker(self.runner.tokenizer, sampling.stop)
        self.waiting.append(Sequence(seq_id, list(prompt_ids), sampling, seed, k, stop, output_ids=resumed,
                                     prefill_len=len(prompt_ids) + len(resumed), grammar=grammar,
                                     adaptive=adaptive, alpha_prior=alpha_prior))

    def prepare(self, sampling: SamplingParams) -> None:
        """Compile the request's response format before add(), which then finds it cached: reading
        a large vocabulary and compiling a large schema take up to seconds, which a caller spends
        on its own thread instead of holding up every sequence's steps. ValueError for a bad schema."""
        if sampling.response_format is not None:
            self._grammars.prepare(sampling.response_format)
            if self.proposer is not None:
                self.proposer.prepare(sampling)

    def _grammar(self, sampling: SamplingParams, resumed: list[int]) -> GrammarState | None:
        """The response format's matcher after the output so far; ValueError for a bad schema."""
        if sampling.response_format is None:
            return None
        self.prepare(sampling)  # at once where prepare() ran before (the target replica calls it)
        grammar = self._grammars.state(sampling.response_format)
        try:
            grammar.advance(resumed)
        except RuntimeError as e:
            raise ValueError(f"the output to resume after does not follow the response format: {e}") from None
        return grammar

    def abort(self, seq_id: str) -> bool:
        """Drop a sequence wherever it is and free its caches on both sides."""
        seq = self.running.pop(seq_id, None)
        if seq is None:
            for s in self.waiting:
                if s.seq_id == seq_id:
                    self.waiting.remove(s)
                    return True
            return False
        self._release(seq)
        return True

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def cached_tokens(self) -> int:
        return self.runner.cached_tokens()

    def reserved_tokens(self) -> int:
        return sum(s.reserved_tokens() for s in self.running.values())

    def _left_waiting(self, need: int) -> int:
        """Requests (a new one needing `need` KV tokens included) the next admission leaves waiting."""
        slots = self.limits.max_num_seqs - len(self.running)
        budget = self.limits.max_cached_tokens - self.reserved_tokens()
        reserved = [s.reserved_tokens() for s in self.waiting] + [need]
        for i, r in enumerate(reserved):  # first come, first admitted, as in step()
            if slots <= 0 or r > budget:
                return len(reserved) - i
            slots, budget = slots - 1, budget - r
        return 0

    def _fits(self, need: int) -> bool:
        return (
            len(self.running) < self.limits.max_num_seqs
            and self.reserved_tokens() + need <= self.limits.max_cached_tokens
        )

    # ---- the step -------------------------------------------------------------------
    def step(self) -> list[SeqUpdate]:
        updates: list[SeqUpdate] = []
        times = StepTimes()
        t0 = time.perf_counter()
        # Decoding sequences step first; prompts are prefilled after, and join the next step.
        batch = [s for s in self.running.values() if not s.prefilling]
        if batch:
            updates += self._ahead_step(batch, times) if self._ahead is not None else self._decode_step(batch, times)
        t1 = time.perf_counter()
        times.overhead = max(0.0, t1 - t0 - times.draft - times.target)
        while self.waiting and self._fits(self.waiting[0].reserved_tokens()):
            seq = self.waiting.popleft()
            self.queue_times.append(time.monotonic() - seq.arrival)
            self.running[seq.seq_id] = seq
            self.runner.add(seq.seq_id)
        updates += self._prefill_chunks()
        times.prefill = time.perf_counter() - t1
        self.last_times = times
        return updates

    def _prefill_chunks(self) -> list[SeqUpdate]:
        """Prefill admitted prompts, oldest first, up to `prefill_chunk` tokens in all (a prompt longer
        than that advances a chunk a step), in one batched pass; emit each completed prompt's first
        token."""
        seqs, chunks, budget = [], [], self.prefill_chunk
        for seq in [s for s in self.running.values() if s.prefilling]:
            if budget <= 0:
                break
            n = min(seq.prefill_len - seq.prefilled, budget)
            seqs.append(seq)
            chunks.append(seq.token_ids[seq.prefilled:seq.prefilled + n])
            budget -= n
        if not seqs:
            return []
        logits = self.runner.prefill_batch([s.seq_id for s in seqs], chunks)  # [n, vocab]
        updates = []
        for i, (seq, chunk) in enumerate(zip(seqs, chunks)):
            seq.prefilled += len(chunk)
            if not seq.prefilling:
                mask = seq.grammar.next_mask() if seq.grammar is not None else None
                chosen = sample_token(logits[i], seq.sampling, seq.seed, seq.prefill_len, len(seq.output_ids),
                                      self._banned(seq), (seq.prompt_ids, seq.output_ids, []), mask)
                logprobs = None
                if seq.sampling.logprobs is not None:
                    lp, values, ids = token_logprobs(logits[i:i + 1], chosen.view(1), seq.sampling.logprobs)
                    logprobs = [(lp.item(), list(zip(ids[0].tolist(), values[0].tolist())))]
                updates.append(self._emit(seq, [int(chosen)], drafted=0, accepted=0, logprobs=logprobs))
        return updates

    def _decode_step(self, batch: list[Sequence], times: StepTimes) -> list[SeqUpdate]:
        caps = []
        for seq in batch:
            held = seq.length - 1
            if self.runner.length(seq.seq_id) != held:
                # the cache does not hold the truth: rebuild it by prefill (caches are only caches)
                self.runner.truncate(seq.seq_id, 0)
                for start in range(0, held, self.prefill_chunk):
                    self.runner.prefill(seq.seq_id, seq.token_ids[start:min(held, start + self.prefill_chunk)])
            caps.append(max(0, min(seq.k, self.max_k, self._room(seq))))
        # the planner sees every step, all-plain ones too (the target server measures those as a mode)
        ks = self.plan_k(batch, caps) if self.plan_k is not None else caps
        step_k: dict[str, int] = {}
        for seq, cap, k in zip(batch, caps, ks):
            step_k[seq.seq_id] = seq.step_k = max(0, min(k, cap))
        proposals = self._propose([s for s in batch if step_k[s.seq_id] > 0], step_k, times)
        props = [proposals.get(s.seq_id, Proposal([])) for s in batch]
        inputs = [[s.last_token] + p.tokens for s, p in zip(batch, props)]
        t0 = time.perf_counter()
        logits, rows = self.runner.step([s.seq_id for s in batch], inputs)  # [B, 1 + max k, vocab]
        # on a GPU the pass is queued, not done: the response formats' masks are built meanwhile
        masks = self._grammar_masks(batch, props)
        results = verify_batch(logits, [
            RowToVerify(row, p.tokens, p.probs, s.sampling, s.seed, s.length, len(s.output_ids), self._banned(s),
                        *((s.prompt_ids, s.output_ids) if s.sampling.penalised else (None, None)), mask)
            for s, p, row, mask in zip(batch, props, rows, masks)])
        times.target = time.perf_counter() - t0  # the pass and its verification: one host read ends both
        times.batch_size = len(batch)
        times.tokens_in_pass = len(batch) * max(len(x) for x in inputs)  # rows x widest input: what the pass computed
        for seq, proposal, result in zip(batch, props, results):
            before = seq.length - 1  # cached length before this step's inputs
            self.runner.truncate(seq.seq_id, before + 1 + result.num_accepted)
            if proposal.tokens and self.proposer is not None:
                self.proposer.observe(seq.seq_id, result.num_accepted)
        if all(len(r.tokens) == 1 and not p.tokens for r, p in zip(results, props)):  # a plain step
            self._launch_ahead([(seq, r.tokens[0], seq.length + 1) for seq, r in zip(batch, results)])
        updates = [self._emit(seq, result.tokens, drafted=len(proposal.tokens), accepted=result.num_accepted,
                              logprobs=result.logprobs) for seq, proposal, result in zip(batch, props, results)]
        if self.drafting is not None and any(p.tokens for p in props):
            self._draft_next(batch)
        return updates

    def _draft_next(self, batch: list[Sequence]) -> None:
        """Send the next step's draft call now, for the sequences that drafted in this step and go on, at
        the depth they drafted (app/engine/draft_ahead.py)."""
        going = [(seq, min(seq.step_k, self._room(seq))) for seq in batch if seq.finish_reason is None]
        self.drafting.launch([self._proposal_request(seq, k) for seq, k in going if k > 0])

    def _room(self, seq: Sequence) -> int:
        """Proposals the sequence may take: none past max_tokens (the target adds one) or past the context."""
        return min(seq.remaining - 1, self.runner.max_context - seq.length - 1)

    @staticmethod
    def _proposal_request(seq: Sequence, k: int) -> ProposalRequest:
        return ProposalRequest(seq.seq_id, seq.token_ids, k, seq.sampling, seq.seed, len(seq.prompt_ids))

    def _ahead_step(self, batch: list[Sequence], times: StepTimes) -> list[SeqUpdate]:
        """A step whose pass was launched by the step before (app/engine/ahead.py): read its tokens,
        launch the next pass, then emit. Sequences that joined since the launch wait for the next one."""
        pending, self._ahead = self._ahead, None
        if self.drafting is not None:
            self.drafting.reap()
        t0 = time.perf_counter()
        got = pending.tokens()
        times.target = time.perf_counter() - t0  # what the host waited for the pass
        stepped = [s for s in batch if s.seq_id in got]
        joined = [s for s in batch if s.seq_id not in got]
        times.batch_size = times.tokens_in_pass = len(stepped)
        for seq in stepped:
            seq.step_k = 0
        # the stepped sequences' tokens are not in their outputs yet: the next choice lands one further
        self._launch_ahead([(s, got[s.seq_id], s.length + 1) for s in stepped]
                           + [(s, s.last_token, s.length) for s in joined])
        return [self._emit(s, [got[s.seq_id]], drafted=0, accepted=0) for s in stepped]

    def _launch_ahead(self, feeds: list[tuple[Sequence, int, int]]) -> None:
        """Launch the next pass now when it is a plain one for every decoding sequence (`feeds`: each
        with the token it is fed and the position of the token the pass chooses), except those that
        their fed token ends."""
        if not self.launch_ahead:
            return
        go: list[ahead.Feed] = []
        for seq, token, position in feeds:
            sp = seq.sampling
            if ((token in self.runner.eos_ids and not sp.ignore_eos) or token in sp.stop_token_ids
                    or seq.remaining <= 1):
                continue  # this token ends the sequence
            if (seq.k or sp.adjusts_logits or seq.grammar is not None or sp.logprobs is not None
                    or self.runner.length(seq.seq_id) + 1 > self.runner.max_context):
                return  # the next step may speculate, adjust logits, mask or overflow: it runs as usual
            go.append(ahead.Feed(seq.seq_id, token, sp, seq.seed, position))
        if go:
            self._ahead = ahead.launch(self.runner, go)

    def _grammar_masks(self, batch: list[Sequence], props: list[Proposal]) -> list[torch.Tensor | None]:
        """Per sequence with a response format: its masks `[allowed + 1, words]` for the positions
        it verifies, and its proposal cut (in `props`) at the first one the grammar forbids: the
        draft ends there. The pass computed the cut positions too; their cache is rolled back
        with the rejected ones."""
        masks: list[torch.Tensor | None] = [None] * len(batch)
        for i, seq in enumerate(batch):
            if seq.grammar is not None:
                masks[i], allowed = seq.grammar.masks(props[i].tokens)
                if allowed < len(props[i].tokens):
                    p = props[i]
                    self.grammar_cut_tokens += len(p.tokens) - allowed
                    props[i] = Proposal(p.tokens[:allowed], None if p.probs is None else p.probs[:allowed])
        return masks

    def _propose(self, seqs: list[Sequence], step_k: dict[str, int], times: StepTimes) -> dict[str, Proposal]:
        if not seqs or self.proposer is None:
            if self.drafting is not None:
                self.drafting.reap()  # a plain step: a call sent ahead that has ended is dropped
            return {}
        t0 = time.perf_counter()
        got: dict[str, Proposal] = {}
        calls: list[DraftCallTimes] = []
        if self.drafting is not None and self.drafting.in_flight:
            got, ahead_call = self.drafting.take({s.seq_id: s.length for s in seqs}, step_k)
            if got and ahead_call is not None:  # a call none of whose proposals serve says nothing of this step
                calls.append(ahead_call)
        rest = [s for s in seqs if s.seq_id not in got]
        if rest:  # sequences the call sent ahead does not serve (or all of them, without one)
            requests = [self._proposal_request(s, step_k[s.seq_id]) for s in rest]
            t1 = time.perf_counter()
            try:
                proposals = self.proposer.propose(requests)
            except ProposerUnavailable:
                # a lost draft replica only costs speed: decode plainly this step
                self.proposer_errors += 1
                proposals = [Proposal([]) for _ in requests]
            else:
                calls.append(DraftCallTimes.of(self.proposer, requests, time.perf_counter() - t1))
            got.update((s.seq_id, p) for s, p in zip(rest, proposals))
        times.draft = time.perf_counter() - t0  # what the step waited for proposals
        times.draft_calls = tuple(calls)
        times.num_speculating = len(seqs)
        return got

    def set_draft_ahead(self, enabled: bool) -> None:
        """Send draft calls one step ahead (the default, with a remote draft) or only when a step needs
        them: benchmarks measure both side by side. Between steps."""
        if enabled and self.drafting is None and self.proposer is not None and self.proposer.runs_elsewhere:
            self.drafting = DraftAhead(self.proposer)
        elif not enabled and self.drafting is not None:
            self.drafting.close()
            self.drafting = None

    def flush_proposer(self) -> None:
        """Idle: let the draft call in flight end, then send the proposer's pending releases now."""
        if self.drafting is not None:
            self.drafting.settle()
        flush = getattr(self.proposer, "flush", None)
        if flush is not None:
            flush()

    def _banned(self, seq: Sequence) -> tuple[int, ...]:
        """The tokens masked while the output is shorter than min_tokens: EOS and stop_token_ids."""
        if not seq.sampling.min_tokens:
            return ()
        eos = () if seq.sampling.ignore_eos else tuple(self.runner.eos_ids)
        return eos + tuple(seq.sampling.stop_token_ids)

    def _emit(self, seq: Sequence, tokens: list[int], drafted: int, accepted: int,
              logprobs: list[TokenLogprob] | None = None) -> SeqUpdate:
        """Append verified tokens, stopping at EOS, max_tokens or a stop string."""
        if seq.grammar is not None:
            seq.grammar.advance(tokens)
        seq.stats.record(drafted, accepted)
        self.stats.record(drafted, accepted)
        kept: list[int] = []
        text = ""
        stopped_on_text = False
        for token in tokens:
            if token in self.runner.eos_ids and not seq.sampling.ignore_eos:
                seq.finish_reason = "stop"
                break
            if token in seq.sampling.stop_token_ids and token in self._special_ids:
                seq.finish_reason = "stop"  # a special stop token is not part of the text (as vLLM)
                break
            update = seq.stop.add([token])
            kept.append(token)
            seq.output_ids.append(token)
            text += update.delta
            if update.stopped:
                seq.finish_reason = "stop"
                stopped_on_text = True
                break
            if token in seq.sampling.stop_token_ids:
                seq.finish_reason = "stop"
                break
            if seq.remaining <= 0:
                seq.finish_reason = "length"
                break
        if seq.finish_reason is not None:
            if not stopped_on_text:  # held-back text can no longer become a stop string
                text += seq.stop.flush()
            self.running.pop(seq.seq_id, None)
            self._release(seq)
        return SeqUpdate(seq.seq_id, kept, text, seq.finish_reason, drafted, accepted, seq.step_k,
                         logprobs[:len(kept)] if logprobs is not None else None)

    def _release(self, seq: Sequence) -> None:
        self.runner.remove(seq.seq_id)
        if self.drafting is not None:
            self.drafting.release(seq.seq_id)  # after the call in flight, if one is
        elif self.proposer is not None:
            self.proposer.release(seq.seq_id)
