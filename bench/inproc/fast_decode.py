"""Greedy decoding on the fast path (FastLlama): plain, speculative sequential, speculative overlapped.

Batch 1, greedy, the whole algorithm in plain functions:

- `GreedyLoop` keeps a model's autoregressive loop on its device: each step feeds the current
  token, takes the argmax (or what a `Proposer` makes of it), records it at its position and feeds
  it back, all in one CUDA graph replay with no host synchronisation. Plain decoding is this loop
  on the target; drafting is this loop on the draft.
- `speculative_generate` alternates target passes (verify `[last] + proposals`) with the draft's
  chain of proposals. Sequential: the draft drafts k, then the target verifies them. Overlapped
  (draft and target on different GPUs): while the target verifies the proposals it was given, the
  draft keeps extending its chain as if all of them will be accepted, including a guess at the
  target's bonus token; if the target accepts everything and its bonus token equals that guess,
  the next block is already drafted, otherwise the draft restarts from the corrected token. The
  target never waits for the draft: right after a restart it verifies zero proposals (a plain
  step that still emits one token) while the draft refills. So overlap hides the draft's steps
  whenever the chain survives a pass; what it cannot hide is a restart, which costs one pass at
  plain-decoding speed (the drafted continuation of a rejected block is simply discarded).

The host reads back one small result per target pass (the target's argmax over the pass) and the
draft's new tokens (an asynchronous copy into pinned memory); nothing else synchronises. On the
CPU everything runs eagerly and in order (used by the unit tests).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Protocol

import torch

from app.runners.lean_llama import FastLlama, capture_graph


class Proposer(Protocol):
    def __call__(self, drafted: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """drafted `[1]`: the draft's argmax for `position` `[1]` -> the token to propose there `[1]`."""


class ControlledAcceptance:
    """Benchmark-only proposer for random-weight models, which agree on nothing: the draft model
    really runs (its cost is real), but the token it proposes for position p is the target's own
    greedy token `reference[p]` with probability alpha, a wrong one otherwise. Device-side and
    capture-safe: coins come from a fixed table indexed by a device counter."""

    def __init__(self, reference: torch.Tensor, alpha: float, vocab: int, seed: int = 0, n_coins: int = 1 << 16) -> None:
        self.reference = reference  # [max_len]: the target's greedy token at each position
        self.right = torch.zeros(n_coins, dtype=torch.bool, device=reference.device)  # [n_coins]
        self.counter = torch.zeros(1, dtype=torch.long, device=reference.device)
        self.vocab, self.n_coins = vocab, n_coins
        self.reseed(alpha, seed)

    def reseed(self, alpha: float, seed: int = 0) -> None:
        """New alpha, in place: a captured graph keeps reading the same tensors."""
        gen = torch.Generator().manual_seed(seed)
        self.right.copy_(torch.rand(self.n_coins, generator=gen) < alpha)
        self.counter.zero_()
        self.alpha = alpha

    def __call__(self, drafted: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        ref = self.reference[position]  # [1]
        right = self.right[self.counter % self.n_coins]  # [1]
        self.counter.add_(1)
        return torch.where(right, ref, (ref + 1) % self.vocab)


class Pending:
    """Token ids on their way to the host; `tolist()` waits for them and only them."""

    def __init__(self, values: torch.Tensor, event: torch.cuda.Event | None) -> None:
        self.values, self.event = values, event

    def tolist(self) -> list[int]:
        if self.event is not None:
            self.event.synchronize()
        return self.values.tolist()


def to_device(values: list[int], device: torch.device) -> torch.Tensor:
    """Host ids -> device `[1, len]` without a blocking copy (pinned source, stream-ordered)."""
    t = torch.tensor([values], dtype=torch.long)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def read_back(values: torch.Tensor) -> Pending:
    """Start copying device ids to the host; the copy is ordered after the work queued so far."""
    if values.device.type != "cuda":
        return Pending(values.clone(), None)
    host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
    host.copy_(values, non_blocking=True)
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(values.device))
    return Pending(host, event)


class GreedyLoop:
    """One model's greedy loop held on its device. `reset(tokens, position)` says what the next
    step feeds (one token, or two when the loop must catch up on a token it never fed); each
    `advance()` step then proposes the token for the next position and feeds it back."""

    def __init__(self, model: FastLlama, propose: Proposer | None = None) -> None:
        self.model, self.propose, self.device = model, propose, model.device
        self.max_len = model.max_len
        self.tokens = torch.zeros(self.max_len, dtype=torch.long, device=self.device)  # [max_len]
        # static inputs per step width: `[1, w]` ids and positions
        self._tok = {w: torch.zeros((1, w), dtype=torch.long, device=self.device) for w in (1, 2)}
        self._pos = {w: torch.zeros((1, w), dtype=torch.long, device=self.device) for w in (1, 2)}
        self._width = 1
        self.next_position = 0  # host mirror: the position the next proposed token will take
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        if self.device.type == "cuda":
            self._capture()

    def _step(self, width: int) -> None:
        tok, pos = self._tok[width], self._pos[width]  # [1, w]
        nxt_pos = pos[:, -1] + 1  # [1]
        nxt = self.model.forward(tok, pos, last_only=True)[:, -1].argmax(-1)  # [1]
        if self.propose is not None:
            nxt = self.propose(nxt, nxt_pos)
        self.tokens.index_copy_(0, nxt_pos, nxt)
        self._tok[1].copy_(nxt.view(1, 1))
        self._pos[1].copy_(nxt_pos.view(1, 1))

    def _capture(self) -> None:
        # Warm-up and capture run real steps: point them at the cache's last slots, which no
        # sequence reaches before it is reset (capture happens before any prefill anyway).
        for width in (1, 2):
            self._graphs[width], _ = capture_graph(self.device, lambda: self._step(width), lambda: self._park(width))
        torch.cuda.synchronize(self.device)

    def _park(self, width: int) -> None:
        start = self.max_len - width - 1
        self._pos[width].copy_(torch.arange(start, start + width, device=self.device).view(1, -1))

    def prefill(self, prompt: torch.Tensor) -> torch.Tensor:
        """prompt `[1, P]` -> the logits of its last position `[1, vocab]`; K/V for positions 0..P-1.
        No host synchronisation (a graph replay on CUDA: FastLlama.prefill_last)."""
        prompt = prompt.to(self.device)
        self.tokens[: prompt.shape[1]] = prompt[0]
        return self.model.prefill_last(prompt)

    def reset(self, tokens: list[int], position: int) -> None:
        """The next step feeds `tokens` (1 or 2) at `position`..; K/V below `position` must be valid.
        Entries at and past `position` are stale and are masked, then overwritten."""
        width = len(tokens)
        if width not in self._tok:
            raise ValueError(f"reset takes 1 or 2 tokens, got {width}")
        if position + width + 1 >= self.max_len:
            raise ValueError(f"position {position} + {width} runs past the cache ({self.max_len}): raise max_len")
        ids = to_device(tokens, self.device)  # [1, w]
        self._tok[width].copy_(ids)
        self._pos[width].copy_(torch.arange(position, position + width, device=self.device).view(1, -1))
        self.tokens[position: position + width] = ids[0]
        self._width = width
        self.next_position = position + width

    def advance(self, steps: int) -> None:
        """Queue `steps` steps (no host synchronisation)."""
        if self.next_position + steps >= self.max_len:
            raise ValueError(f"advancing to {self.next_position + steps} runs past the cache ({self.max_len})")
        for _ in range(steps):
            graph = self._graphs.get(self._width)
            if graph is not None:
                with torch.cuda.device(self.device):  # replay() uses the current device's stream
                    graph.replay()
            else:
                self._step(self._width)
            self._width = 1
            self.next_position += 1

    def read(self, lo: int, hi: int) -> Pending:
        """The tokens at positions [lo, hi), copied to the host after the steps queued so far."""
        return read_back(self.tokens[lo:hi])


def plain_generate(target: GreedyLoop, prompt: torch.Tensor, n_new: int) -> list[int]:
    """Greedy decoding: one graph replay per token, one host read at the end."""
    P = prompt.shape[1]
    first = int(target.prefill(prompt)[0].argmax())
    target.reset([first], P)
    target.advance(n_new - 1)
    return [first] + target.read(P + 1, P + n_new).tolist()


@dataclass
class SpecStats:
    passes: int = 0  # target passes
    drafted: int = 0  # proposals verified
    accepted: int = 0
    checked: int = 0  # proposals compared up to and including the first mismatch
    guesses: int = 0  # overlapped: the draft's guess at a pass's bonus token, checked after the pass
    guesses_right: int = 0
    restarts: int = 0  # times the draft's chain was discarded
    draft_steps: int = 0
    forks: int = 0  # branching: branch rows started (bench/inproc/fast_branches.py)
    branch_tries: int = 0  # rejections (or wrong bonus guesses) at a position that had a branch
    branch_hits: int = 0  # ... whose branch started from the correction: adopted instead of a restart
    widths: dict[int, int] = field(default_factory=dict)  # proposals per pass -> passes

    def record_pass(self, choice: list[int], ready: list[int], p: int) -> int:
        """Judge one target pass and count it: the target's choices `[p + 1]` against the p
        proposals `ready[:p]` it verified. Returns a, the number accepted (choice[a] is the
        correction when a < p, the bonus token when a == p)."""
        a = 0
        while a < p and choice[a] == ready[a]:
            a += 1
        self.passes += 1
        self.drafted += p
        self.accepted += a
        self.checked += min(a + 1, p)
        self.widths[p] = self.widths.get(p, 0) + 1
        return a

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted (vLLM's definition): proposals past a rejection count as drafted."""
        return self.accepted / max(1, self.drafted)

    @property
    def per_token_acceptance(self) -> float:
        """P(a proposal is right | all before it were): accepted / compared, bonus guesses included.
        The alpha of the cost model, estimated."""
        return (self.accepted + self.guesses_right) / max(1, self.checked + self.guesses)

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per target pass, 1 + accepted / passes (vLLM's definition when every
        pass carries proposals, as in sequential mode)."""
        return 1 + self.accepted / max(1, self.passes)


def verify_pass(target: FastLlama, ids: torch.Tensor, position: int) -> torch.Tensor:
    """Queue the target's pass over device ids `[1, w]` = `[last] + proposals` at `position`..;
    returns its argmax `[w]` (still on the device)."""
    ids = ids.to(target.device)
    positions = torch.arange(position, position + ids.shape[1], device=target.device).view(1, -1)
    return target.run(ids, positions)[0].argmax(-1)


def verify_host_ids(target: FastLlama, ids: list[int], position: int) -> torch.Tensor:
    """verify_pass for ids the host holds: they go straight into the graph's input buffers
    (FastLlama.run_from_host). Returns the argmax `[w]` (still on the device)."""
    return target.run_from_host(ids, position)[0].argmax(-1)


def speculative_generate(target: FastLlama, draft: GreedyLoop, prompt: torch.Tensor, n_new: int, k: int,
                         overlap_steps: int = 0) -> tuple[list[int], SpecStats]:
    """Greedy speculative decoding; the output equals plain greedy decoding of the target.

    overlap_steps = 0: sequential (draft k, then verify). overlap_steps = L > 0: the draft runs up
    to L steps of its chain during each target pass (L = what fits in one pass).
    """
    if k < 1:
        raise ValueError(f"k={k}: speculative decoding needs k >= 1 (use plain_generate for k=0)")
    P = prompt.shape[1]
    needed = P + n_new + k + max(overlap_steps, 1) + 4
    if needed > min(target.max_len, draft.max_len):
        raise ValueError(f"prompt {P} + {n_new} new tokens needs caches of {needed}; "
                         f"target has {target.max_len}, draft {draft.max_len}")
    stats = SpecStats()
    # both prefills are queued before the host waits on either, so on two GPUs they overlap (the
    # prompt is copied to the draft first: a copy from the target's GPU would wait for its prefill)
    draft_prompt = prompt.to(draft.device)
    first_dev = target.prefill_last(prompt.to(target.device))[0].argmax()  # []
    draft.prefill(draft_prompt)
    first = int(first_dev)
    draft.reset([first], P)
    out, last, n = [first], first, P  # `last` sits at position n and is not in the target's cache yet
    ready: list[int] = []  # the draft's chain after `last`: its tokens for positions n+1, n+2, ...
    while len(out) < n_new:
        if overlap_steps == 0:
            # sequential: the proposals go from the draft's token buffer (which holds `last` at n)
            # straight into the verify pass; the host reads them back with the target's choice
            draft.advance(k)
            stats.draft_steps += k
            p = k
            choice_dev = verify_pass(target, draft.tokens[n: n + k + 1].view(1, -1), n)
            both = read_back(torch.cat([choice_dev, draft.tokens[n + 1: n + k + 1].to(choice_dev.device)])).tolist()
            choice, ready = both[: k + 1], both[k + 1:]
        else:
            p = min(k, len(ready))
            choice_dev = verify_host_ids(target, [last] + ready[:p], n)
            # keep the chain k+1 deep past what this pass can consume (k proposals + a bonus guess)
            steps = min(overlap_steps, max(1, k + 2 - (len(ready) - p)))
            lo = draft.next_position
            draft.advance(steps)  # runs on the draft's device while the target verifies
            stats.draft_steps += steps
            new = draft.read(lo, draft.next_position)
            choice = choice_dev.tolist()  # [p + 1]: waits for the target only
            ready += new.tolist()
        a = stats.record_pass(choice, ready, p)
        if a < p:  # rejected at a: choice[a] corrects it; the draft fed ready[:a], so restart there
            draft.reset([choice[a]], n + a + 1)
            ready = []
            stats.restarts += 1
        elif len(ready) > p and ready[p] == choice[p]:  # all accepted and the bonus was guessed
            ready = ready[p + 1:]
            stats.guesses += 1
            stats.guesses_right += 1
        elif len(ready) > p:  # all accepted, bonus guessed wrong: the draft fed ready[:p+1]
            draft.reset([choice[p]], n + p + 1)
            stats.guesses += 1
            ready = []
            stats.restarts += 1
        else:  # all accepted, no guess (sequential): feed the last proposal and the bonus together
            draft.reset([ready[p - 1] if p else last, choice[p]], n + p)
            ready = []
        out += choice[: a + 1]
        n += a + 1
        last = out[-1]
    return out[:n_new], stats


def predicted_tokens_per_second(alpha: float, k: int, overlap_steps: int, t_draft: float,
                                t_verify: dict[int, float], n_tokens: int = 20000, seed: int = 0) -> float:
    """What `speculative_generate`'s rules yield with measured step costs and per-token acceptance
    alpha, ignoring host time: the cost model for choosing k (and the overlap depth) and the
    "predicted" figure the benchmark compares against. t_verify[w]: target pass over w tokens.

    Sequential: a pass costs k draft steps + t_verify[k+1] and yields E(k) = (1 - a^(k+1)) / (1 - a)
    tokens on average. Overlapped: a pass costs max(t_verify[p+1], steps * t_draft), where p is how
    many proposals were ready; a rejection (or a wrong bonus guess) empties the chain.
    """
    rng = random.Random(seed)
    ready = tokens = 0
    seconds = 0.0
    while tokens < n_tokens:
        if overlap_steps == 0:
            p, steps = k, k
            seconds += steps * t_draft + t_verify[p + 1]
        else:
            p = min(k, ready)
            steps = min(overlap_steps, max(1, k + 2 - (ready - p)))
            ready += steps
            seconds += max(t_verify[p + 1], steps * t_draft)
        a = 0
        while a < p and rng.random() < alpha:
            a += 1
        tokens += a + 1
        if overlap_steps and a == p and rng.random() < alpha:
            ready -= p + 1
        else:
            ready = 0
    return tokens / seconds
