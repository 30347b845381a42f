"""Draft-model proposer: a small causal LM on the same runner as the target.

Per step, for the whole batch:
  1. bring each sequence's draft cache up to its truth: roll back by length to the longest
     prefix it already holds, prefill what is missing but the last one or two tokens (a new
     sequence, or one that decoded plainly for a while);
  2. one pass feeding every row its last one or two tokens (the last accepted proposal and the
     target's token), then k - 1 one-token passes feeding each row's proposal back on the
     device: for greedy requests all k passes are one CUDA graph (ModelRunner.draft_chain);
     with sampled requests in the batch, a graph per pass, no host read in between; with a
     response format in the batch, its rows' logits are masked by the grammar each pass (a
     matcher per sequence, rolled back after the step) and their tokens read each pass;
  3. one host read of every row's k proposals.
The k-th proposal is not fed back; if it is accepted it is fed at the next step's catch-up.
The cache is a cache: a sequence it does not hold (new, evicted, replica restarted) is rebuilt
from the token ids, and when every row is taken the least recently used sequence is evicted.
"""

from __future__ import annotations

import time
from collections import OrderedDict

import torch

from app.config import MAX_SPECULATIVE_TOKENS, ModelSpec
from app.proposers.base import FirstPass, Proposal, ProposalRequest, Proposer, common_prefix
from app.runners.model_runner import ModelRunner
from app.runners.transfer import to_device
from app.protocol.sampling_params import SamplingParams
from app.spec.grammar import GrammarState, LazyGrammars, apply_mask
from app.spec.sampling import inverse_cdf, processed_probs, uniforms


class DraftModelProposer(Proposer):
    def __init__(self, spec: ModelSpec | None = None, runner: ModelRunner | None = None, max_seqs: int = 64) -> None:
        if runner is None:
            if spec is None:
                raise ValueError("DraftModelProposer needs a ModelSpec or a loaded ModelRunner")
            runner = ModelRunner(spec, max_seqs, widths=(1, 2))
        self.runner = runner
        self.fed: OrderedDict[str, list[int]] = OrderedDict()  # per sequence: the tokens its cache holds, LRU order
        self.cache_misses = 0  # sequences rebuilt from scratch (new, evicted or replica restarted)
        self._grammars = LazyGrammars(runner.tokenizer, runner.vocab_size, runner.eos_ids, MAX_SPECULATIVE_TOKENS)
        self._grammar_states: dict[str, tuple[GrammarState, int]] = {}  # seq -> (matcher, output tokens it followed)

    def propose(self, requests: list[ProposalRequest]) -> list[Proposal]:
        limit = self.runner.max_context
        ks = [max(0, min(r.k, limit - len(r.token_ids))) for r in requests]
        active = [i for i, k in enumerate(ks) if k > 0]
        self.last_first_pass = FirstPass()
        if not active:
            return [Proposal([]) for _ in requests]
        t0 = time.perf_counter()
        ids = [requests[i].seq_id for i in active]
        keep = set(ids)
        feeds, behind = [], []  # each row's last 1 or 2 tokens; (row, tokens it has not fed) to prefill first
        for i in active:
            feed, missing = self._catch_up(requests[i], keep)
            feeds.append(feed)
            if missing:
                behind.append((requests[i].seq_id, missing))
        prefilled = sum(len(m) for _, m in behind)
        if behind:  # one pass for every row behind (per 8 rows where graphs are captured)
            self.runner.extend([s for s, _ in behind], [m for _, m in behind])
        device = self.runner.device
        depth = max(ks[i] for i in active)
        grammars = [self._grammar(requests[i]) for i in active]
        if all(requests[i].sampling.greedy for i in active) and not any(grammars):
            # the whole step as one graph, one host read
            t1 = time.perf_counter()
            chains = self.runner.draft_chain(ids, feeds, depth, [requests[i].forced for i in active]).tolist()
            # the first pass's share: the catch-up prefills and one of the chain's depth passes
            t2 = time.perf_counter()
            self.last_first_pass = FirstPass(prefilled + sum(len(f) for f in feeds), len(active),
                                             (t1 - t0) + (t2 - t1) / depth)
            return self._finish(requests, ks, active, chains, [[] for _ in active])
        logits, rows = self.runner.step(ids, feeds)  # [B, W, vocab]
        last = to_device([len(f) - 1 for f in feeds], device)
        rows_t = to_device(rows, device)
        step_logits = logits[rows_t, last]  # [n, vocab]
        # what the first proposal cost: the catch-up prefills and the first pass (timed on the CPU, where
        # the calls are synchronous; on CUDA the step's one host read is at the end)
        self.last_first_pass = FirstPass(prefilled + sum(len(f) for f in feeds), len(active), 0.0)
        drafted: list[torch.Tensor] = []  # per step [n]
        followed = [0] * len(active)  # proposals each row's grammar matcher has followed this step
        probs: list[list[torch.Tensor]] = [[] for _ in active]
        for step in range(depth):
            if step:
                logits, _ = self.runner.step_tokens(ids, drafted[-1])  # [B, 1, vocab]
                step_logits = logits[rows_t, 0]
            tokens = self._choose(step_logits, [requests[i] for i in active], step, probs, grammars, followed)
            for j, i in enumerate(active):  # fed back as the chain feeds them (model_runner.draft_chain)
                if step < len(requests[i].forced):
                    tokens[j] = requests[i].forced[step]
            drafted.append(tokens)
            if step == 0 and device.type != "cuda":
                self.last_first_pass = FirstPass(self.last_first_pass.tokens, len(active), time.perf_counter() - t0)
        ends = [depth] * len(active)  # a row whose grammar ended (its stop token proposed) proposes no further
        for j, (grammar, n) in enumerate(zip(grammars, followed)):
            if grammar is not None:
                if grammar.done and n:  # ended this step (one that ended before constrains nothing)
                    ends[j] = n
                grammar.rollback(n)  # back to the end of the output: the target decides what stays
        proposals = torch.stack(drafted, dim=1).tolist()  # [n, depth]: the one host read
        return self._finish(requests, ks, active, proposals, probs, ends)

    def _finish(self, requests: list[ProposalRequest], ks: list[int], active: list[int],
                proposals: list[list[int]], probs: list[list[torch.Tensor]],
                ends: list[int] | None = None) -> list[Proposal]:
        out = [Proposal([]) for _ in requests]
        for j, i in enumerate(active):
            r, k = requests[i], ks[i]
            # the cache holds the truth and the first k - 1 proposals (the rest were padding steps)
            self.runner.truncate(r.seq_id, len(r.token_ids) + k - 1)
            self.fed[r.seq_id] = list(r.token_ids) + proposals[j][:k - 1]
            n = k if ends is None else min(k, ends[j])
            out[i] = Proposal(proposals[j][:n], torch.stack(probs[j][:n]) if probs[j] else None)
        return out

    def _catch_up(self, r: ProposalRequest, keep: set[str]) -> tuple[list[int], list[int]]:
        """Roll the sequence's cache back to the longest prefix of its truth it holds; return the
        last one or two tokens to feed and the tokens before them it has not fed (a catch-up to
        prefill first: a new sequence, or one that decoded plainly for a while)."""
        runner, truth = self.runner, r.token_ids
        fed = self.fed.get(r.seq_id)
        if fed is None or r.seq_id not in runner:
            self.cache_misses += 1
            if r.seq_id not in runner:
                self._make_room(keep)
                runner.add(r.seq_id)
            fed = []
        if r.seq_id in self.fed:
            self.fed.move_to_end(r.seq_id)
        held = min(common_prefix(fed, truth), len(truth) - 1, runner.length(r.seq_id))  # feed at least one token
        runner.truncate(r.seq_id, held)
        missing: list[int] = []
        if len(truth) - held > 2:  # what the draft has not seen, but the last token
            missing = truth[held:len(truth) - 1]
            held = len(truth) - 1
        self.fed[r.seq_id] = list(truth[:held])
        return list(truth[held:]), missing

    def _make_room(self, keep: set[str]) -> None:
        """Evict the least recently used sequences not in this step while every row is taken."""
        while self.runner.num_sequences >= self.runner.max_seqs:
            victim = next((s for s in self.fed if s not in keep), None)
            if victim is None:
                raise RuntimeError(f"the draft's {self.runner.max_seqs} cache rows are all in one step: "
                                   "raise the draft's max_num_seqs")
            self.release(victim)

    @staticmethod
    def _choose(logits: torch.Tensor, requests: list[ProposalRequest], step: int, probs: list[list[torch.Tensor]],
                grammars: list[GrammarState | None], followed: list[int]) -> torch.Tensor:
        """This step's proposal per row `[n]` on the device: the argmax for greedy requests, a draw
        at (seed, position) from the processed distribution for sampled ones (kept in `probs`),
        among the tokens its response format allows (the matcher then follows the proposal)."""
        masks = [g.next_mask() if g is not None and followed[j] == step else None for j, g in enumerate(grammars)]
        if any(m is not None for m in masks):
            logits = logits.clone()
            for j, mask in enumerate(masks):
                if mask is not None:
                    logits[j:j + 1] = apply_mask(logits[j:j + 1], mask)
        tokens = torch.argmax(logits, dim=-1)  # [n]
        for j, r in enumerate(requests):
            if not r.sampling.greedy:
                q = processed_probs(logits[j:j + 1], r.sampling)  # [1, vocab]
                position = len(r.token_ids) + step
                tokens[j] = inverse_cdf(q, uniforms(r.seed, position, 1, "draft", logits.device))[0]
                probs[j].append(q[0])
        masked = [j for j, m in enumerate(masks) if m is not None]
        if masked:  # the matchers follow this pass's proposals: one host read for the masked rows
            for j, token in zip(masked, tokens[masked].tolist()):
                if grammars[j].try_accept(token):
                    followed[j] += 1
        return tokens

    def _grammar(self, r: ProposalRequest) -> GrammarState | None:
        """The sequence's response-format matcher at the end of its output; None without one, or
        where the output does not follow it, or while the format compiles in the background (then
        the draft proposes freely: only speed is lost)."""
        fmt = r.sampling.response_format
        if fmt is None:
            return None
        output = r.token_ids[r.prompt_len:]
        held = self._grammar_states.get(r.seq_id)
        try:
            if held is None or held[1] > len(output):
                if not self._grammars.ready(fmt):
                    return None
                held = (self._grammars.state(fmt), 0)
            state, consumed = held
            state.advance(output[consumed:])
        except (ValueError, RuntimeError):
            self._grammar_states.pop(r.seq_id, None)
            return None
        self._grammar_states[r.seq_id] = (state, len(output))
        return state

    def prepare(self, sampling: SamplingParams) -> None:
        """Compile the response format now (in-process use; a draft replica compiles in the
        background the first time a step brings it). A bad schema is the target's to report."""
        if sampling.response_format is not None:
            try:
                self._grammars.prepare(sampling.response_format)
            except ValueError:
                pass

    def release(self, seq_id: str) -> None:
        self.fed.pop(seq_id, None)
        self._grammar_states.pop(seq_id, None)
        self.runner.remove(seq_id)

    def num_cached_sequences(self) -> int:
        return sum(1 for s in self.fed if s in self.runner)

    def cached_tokens(self) -> int:
        return sum(self.runner.length(s) for s in self.fed)
