"""Overlapped drafting that survives a rejection: branches from the draft's runner-up tokens.

In the overlapped loop (fast_decode.speculative_generate) the draft extends one chain while the
target verifies; when the target rejects a proposal (or the chain's guess at the bonus token), the
chain is discarded and the next pass verifies nothing while the draft refills: one pass at
plain-decoding speed. That restart caps what overlap can gain, however cheap the draft
(bench/overlap_bound.py: 1.20x over sequential at alpha 0.7 as built, 1.28x with a free draft).

Here the draft keeps R batch rows of its cache. The `main` row extends the chain. While the target
verifies `[last] + ready[:p]`, up to R - 1 other rows each draft a *branch*: at one of the p + 1
positions being judged (the p proposals and the bonus guess), the branch starts from the draft's
runner-up token for that position and drafts on from it. If the target rejects position i and its
correction is that runner-up, the branch for i is already a block deep: it becomes the main row and
the next pass verifies it at once. Otherwise the loop restarts as before. The output is the
target's greedy output whatever happens: every token is still verified.

Why rows, not a token tree: FastLlama already keeps one cache row per batch row with its own
positions and mask, so a branch is a row whose cache below the branch point equals the main row's.
A fork copies only the positions the row has not synced with the main row yet (accepted positions
never change, so a row stays synced below them; a few positions per pass). A pass's forks are one
more CUDA graph replay, fed by one small copy of their arguments. The runner-up stays on the
device. The rows step together as one batch in one CUDA graph. The bf16 1B draft reads its
weights once for all rows: on an H200 a forward over 6-8 rows costs ~0.2 ms more than one row
(`python3 -m bench.gpu_draft_step --rows-breakdown 1,6,8 --variants bf16`). An int8 draft needs
app/runners/kernels/int8_gemv.py's few-row kernels for that (Inductor's int8 form costs 3x at 8 rows).
"""

from __future__ import annotations

from typing import Protocol

import torch

from bench.inproc.fast_decode import SpecStats, read_back, to_device, verify_host_ids
from app.runners.lean_llama import FastLlama, capture_graph

FORK_SPAN = 32  # positions a graph-replayed fork copies from the main row (wider: the eager path)


class BranchProposer(Protocol):
    def __call__(self, top2: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """top2 `[R, 2]`: each row's argmax and runner-up for `position` `[R]` -> the pair to use `[R, 2]`."""


class ControlledBranches:
    """Benchmark-only proposer for random-weight models (fast_decode.ControlledAcceptance, with a
    runner-up): each row's proposal for position p is the target's greedy token `reference[p]` with
    probability alpha, a wrong token otherwise; when the proposal is wrong, the runner-up is the
    target's token with probability beta (the draft's "second choice was right" rate), another
    wrong token otherwise. The draft model still runs and its top-2 is still computed, so the cost
    is real. Device-side and capture-safe: coins come from fixed tables indexed by a counter."""

    def __init__(self, reference: torch.Tensor, alpha: float, beta: float, vocab: int, seed: int = 0,
                 n_coins: int = 1 << 16) -> None:
        self.reference = reference  # [max_len]: the target's greedy token at each position
        dev = reference.device
        self.right = torch.zeros(n_coins, dtype=torch.bool, device=dev)  # [n_coins]: proposal right
        self.second = torch.zeros(n_coins, dtype=torch.bool, device=dev)  # [n_coins]: runner-up right
        self.counter = torch.zeros(1, dtype=torch.long, device=dev)
        self.vocab, self.n_coins = vocab, n_coins
        self.reseed(alpha, beta, seed)

    def reseed(self, alpha: float, beta: float, seed: int = 0) -> None:
        """New rates, in place: a captured graph keeps reading the same tensors."""
        gen = torch.Generator().manual_seed(seed)
        self.right.copy_(torch.rand(self.n_coins, generator=gen) < alpha)
        self.second.copy_(torch.rand(self.n_coins, generator=gen) < beta)
        self.counter.zero_()
        self.alpha, self.beta = alpha, beta

    def __call__(self, top2: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        rows = top2.shape[0]
        ref = self.reference[position]  # [R]
        idx = (self.counter + torch.arange(rows, device=ref.device)) % self.n_coins  # [R]
        self.counter.add_(rows)
        right, second = self.right[idx], self.second[idx]  # [R]
        wrong1, wrong2 = (ref + 1) % self.vocab, (ref + 2) % self.vocab
        proposal = torch.where(right, ref, wrong1)
        runner_up = torch.where(right, wrong1, torch.where(second, ref, wrong2))
        return torch.stack([proposal, runner_up], dim=-1)  # [R, 2]


class BranchingDraft:
    """The draft's greedy loop over R cache rows: one main chain and up to R - 1 branches.

    Every `advance()` step feeds each live row its current token at its own position, records the
    argmax (the row's proposal for the next position) and the runner-up, and feeds the proposal
    back, all rows in one batched forward (one CUDA graph replay). Rows not in use are parked at a
    scratch position near the cache's end that no sequence reaches."""

    def __init__(self, model: FastLlama, rows: int, propose: BranchProposer | None = None,
                 fork_graph: bool = True) -> None:
        if rows < 2:
            raise ValueError(f"rows={rows}: branching needs a main row and at least one branch row")
        if model.max_batch < rows:
            raise ValueError(f"the draft FastLlama holds {model.max_batch} cache rows, branching needs {rows}: "
                             f"build it with max_batch={rows}")
        self.model, self.rows, self.propose, self.device = model, rows, propose, model.device
        self.max_len = model.max_len
        self.park = self.max_len - 2  # parked rows feed here and propose for max_len - 1
        R, dev = rows, self.device
        self.tokens = torch.zeros((R, self.max_len), dtype=torch.long, device=dev)  # [R, max_len] proposals by position
        self.runner_up = torch.zeros((R, self.max_len), dtype=torch.long, device=dev)  # [R, max_len]
        self._tok = torch.zeros((R, 1), dtype=torch.long, device=dev)  # [R, 1] what each row feeds next
        self._pos = torch.full((R, 1), self.park, dtype=torch.long, device=dev)  # [R, 1] at which position
        self._live = torch.zeros(R, dtype=torch.bool, device=dev)  # [R]
        self._rows = torch.arange(R, device=dev)  # [R]
        self._others = ~torch.eye(R, dtype=torch.bool, device=dev)  # [R, R]: row m's "every row but m"
        self.main = 0
        self.next_position = [self.park + 1] * R  # host mirror: where each row's next proposal lands
        self._synced = [0] * R  # row r's K/V equals the main row's below this position
        # fork_graph: a pass's drop-and-fork as one graph replay fed by one small copy of its
        # arguments (the eager fork is a dozen indexing kernels, each ~20-40 us of host time, and
        # the host's time per pass is what the GPUs wait on in `bench.gpu_branches`).
        # It copies a fixed span of FORK_SPAN positions; a wider one (the first fork after a
        # prefill) takes the eager path.
        self.fork_graph = fork_graph
        self._span = torch.arange(FORK_SPAN, device=dev)  # [S]
        self._fork_args = torch.zeros(3 * R + 2, dtype=torch.long, device=dev)  # [drop R | fork R | pos R | lo | main]
        # a ring of pinned sources: a non-blocking copy reads its source when the stream reaches it,
        # so a buffer is reused only after the host has waited on later draft work (once per pass)
        self._fork_host = [torch.zeros(3 * R + 2, dtype=torch.long, pin_memory=dev.type == "cuda") for _ in range(4)]
        self._fork_turn = 0
        self._graph: torch.cuda.CUDAGraph | None = None
        self._fork_graph: torch.cuda.CUDAGraph | None = None
        if dev.type == "cuda":
            self._graph, _ = capture_graph(dev, self._step, self._park_all)
            self._fork_args[2 * R: 3 * R] = self.park  # captured as a no-op: nothing drops, nothing forks
            self._fork_graph, _ = capture_graph(dev, self._drop_and_fork)
            torch.cuda.synchronize(dev)

    # ---- the batched step -----------------------------------------------------------------
    def _step(self) -> None:
        nxt_pos = self._pos[:, 0] + 1  # [R]
        logits = self.model.forward(self._tok, self._pos, last_only=True)[:, -1]  # [R, vocab]
        top2 = logits.topk(2, dim=-1).indices  # [R, 2]
        if self.propose is not None:
            top2 = self.propose(top2, nxt_pos)
        self.tokens[self._rows, nxt_pos] = top2[:, 0]
        self.runner_up[self._rows, nxt_pos] = top2[:, 1]
        self._tok.copy_(top2[:, :1])
        self._pos.copy_(torch.where(self._live, nxt_pos, self.park).view(-1, 1))

    def _park_all(self) -> None:
        self._pos.fill_(self.park)

    def _drop_and_fork(self) -> None:
        """fork()'s work from `_fork_args`, fixed shapes (capturable): park the rows in `drop`, then
        every row in `fork` takes a copy of the main row's K/V and tokens over [lo, lo + S) and feeds
        the main row's runner-up at its `pos`. Copying past a row's own position is harmless: those
        entries are masked until the row overwrites them (and S may reach into the scratch slots)."""
        R, args = self.rows, self._fork_args
        drop, fork, pos = args[:R].bool(), args[R: 2 * R].bool(), args[2 * R: 3 * R]  # [R] each
        lo, main = args[3 * R], args[3 * R + 1: 3 * R + 2]  # [], [1]
        span = (lo + self._span).clamp(max=self.max_len - 1)  # [S]: clamped repeats all copy the same slot
        for cache in (self.model.k_cache[:, :R], self.model.v_cache[:, :R]):  # [layers, R, max_len, KV, D] views
            cur = cache.index_select(2, span)  # [layers, R, S, KV, D]
            src = cur.index_select(1, main)  # [layers, 1, S, KV, D]
            cache.index_copy_(2, span, torch.where(fork.view(1, R, 1, 1, 1), src, cur))
        cur_t = self.tokens.index_select(1, span)  # [R, S]
        self.tokens.index_copy_(1, span, torch.where(fork.view(R, 1), cur_t.index_select(0, main), cur_t))
        first = self.runner_up.index_select(0, main)[0].gather(0, pos)  # [R]: the main row's runner-up at pos
        at_pos = self.tokens.gather(1, pos.view(R, 1))[:, 0]  # [R]
        self.tokens.scatter_(1, pos.view(R, 1), torch.where(fork, first, at_pos).view(R, 1))
        self._tok.copy_(torch.where(fork, first, self._tok[:, 0]).view(R, 1))
        self._pos.copy_(torch.where(fork, pos, torch.where(drop, self.park, self._pos[:, 0])).view(R, 1))
        self._live.copy_((self._live & ~drop) | fork)

    # ---- row control (host side; no synchronisation) ---------------------------------------
    def prefill(self, prompt: torch.Tensor) -> None:
        """prompt `[1, P]`: K/V for positions 0..P-1 in row 0, which becomes the main row."""
        prompt = prompt.to(self.device)
        self._live.zero_()
        self._pos.fill_(self.park)
        self.next_position = [self.park + 1] * self.rows
        self.main = 0
        self._synced = [0] * self.rows
        self.tokens[0, : prompt.shape[1]] = prompt[0]
        self.model.prefill_last(prompt)

    def restart(self, token: int, position: int) -> None:
        """The main row feeds `token` at `position` next; its K/V below `position` must be valid.
        Every other row is parked (its branch, if any, is dropped)."""
        if position + 2 >= self.park:
            raise ValueError(f"position {position} runs into the draft cache's scratch slots ({self.park}): raise max_len")
        m = self.main
        self._live.zero_()
        self._live[m] = True
        self._pos.fill_(self.park)
        self._pos[m, 0] = position
        self._tok[m, 0] = token
        self.tokens[m, position] = token
        self.next_position = [self.park + 1] * self.rows
        self.next_position[m] = position + 1

    def fork(self, rows: list[int], positions: list[int], drop_others: bool = False) -> None:
        """Each of `rows` branches off the main row at its position: it feeds the main row's
        runner-up for that position, on a copy of the main row's K/V below it (the main row must
        have fed every position below it). `drop_others`: first park every other row but the main
        one (drop_branches). All of it in one graph replay (or, eagerly, a handful of kernels),
        whatever the number of rows: the host queues these while the target verifies, and the
        draft starts only after. One copy of the main row's span [lo, hi) serves every row: a
        row's entries past its own position are masked, then overwritten by its branch."""
        m = self.main
        if m in rows or len(set(rows)) != len(rows) or len(rows) != len(positions):
            raise ValueError(f"fork rows {rows} must be distinct, exclude the main row {m} and match {positions}")
        lo = min((min(self._synced[r], q) for r, q in zip(rows, positions)), default=self.park)
        hi = max(positions, default=self.park)
        if self.fork_graph and hi - lo <= FORK_SPAN:
            self._queue_drop_and_fork(rows, positions, lo, drop_others)
        else:
            if drop_others:
                self._park_others()
            if rows:
                self._fork_eagerly(rows, positions, lo, hi)
        # the host mirror, whichever way the device work went
        if drop_others:
            self._forget_others()
        for r, q in zip(rows, positions):
            self._synced[r] = q
            self.next_position[r] = q + 1

    def _fork_eagerly(self, rows: list[int], positions: list[int], lo: int, hi: int) -> None:
        """fork()'s device work as indexing kernels, for any span [lo, hi)."""
        m = self.main
        idx = to_device(rows, self.device)[0]  # [F]
        pos = to_device(positions, self.device)[0]  # [F]
        if lo < hi:
            span = slice(lo, hi)
            self.model.k_cache[:, idx, span] = self.model.k_cache[:, m, span].unsqueeze(1)  # [layers, F, hi-lo, KV, D]
            self.model.v_cache[:, idx, span] = self.model.v_cache[:, m, span].unsqueeze(1)
            self.tokens[idx, span] = self.tokens[m, span]
        first = self.runner_up[m, pos]  # [F]
        self.tokens[idx, pos] = first
        self._tok[idx, 0] = first
        self._pos[idx, 0] = pos
        self._live[idx] = True

    def _queue_drop_and_fork(self, rows: list[int], positions: list[int], lo: int, drop_others: bool) -> None:
        """fork()'s device work (and drop_branches', with drop_others) as one copy of its arguments
        and one replay of _drop_and_fork."""
        R, m = self.rows, self.main
        args = [1 if drop_others and r != m else 0 for r in range(R)] + [0] * R + [self.park] * R + [lo, m]
        for r, q in zip(rows, positions):
            args[R + r], args[2 * R + r] = 1, q
        host = self._fork_host[self._fork_turn]
        self._fork_turn = (self._fork_turn + 1) % len(self._fork_host)
        host.numpy()[:] = args
        self._fork_args.copy_(host, non_blocking=True)
        if self._fork_graph is not None:
            with torch.cuda.device(self.device):  # replay() uses the current device's stream
                self._fork_graph.replay()
        else:
            self._drop_and_fork()

    def drop_branches(self) -> None:
        """Park every row but the main one (last pass's branches)."""
        self._park_others()
        self._forget_others()

    def _park_others(self) -> None:
        """drop_branches' device work."""
        others = self._others[self.main]  # [R] bool
        self._live.masked_fill_(others, False)
        self._pos.masked_fill_(others.view(-1, 1), self.park)

    def _forget_others(self) -> None:
        """drop_branches' host mirror: every row but the main one is parked."""
        self.next_position = [p if r == self.main else self.park + 1 for r, p in enumerate(self.next_position)]

    def adopt(self, row: int) -> None:
        """The branch in `row` becomes the main chain; the old main row becomes a branch row."""
        old = self.main
        self.main = row
        self._synced[old] = self._synced[row]  # they agree below the branch point
        self._synced[row] = self.max_len

    def commit(self, position: int) -> None:
        """Positions below `position` are accepted (final): the main row never rewrites them, so a
        row synced past them stays synced only up to here (the main row may rewrite the rest)."""
        for r in range(self.rows):
            if r != self.main:
                self._synced[r] = min(self._synced[r], position)

    def advance(self, steps: int) -> None:
        """Queue `steps` batched steps (no host synchronisation)."""
        furthest = max(p for r, p in enumerate(self.next_position) if p <= self.park)
        if furthest + steps >= self.park:
            raise ValueError(f"advancing to {furthest + steps} runs into the draft cache's scratch slots "
                             f"({self.park}): raise max_len")
        if self._graph is not None:
            with torch.cuda.device(self.device):  # replay() uses the current device's stream
                for _ in range(steps):
                    self._graph.replay()
        else:
            for _ in range(steps):
                self._step()
        self.next_position = [p + steps if p <= self.park else p for p in self.next_position]

    def live_rows(self) -> list[int]:
        return [r for r, p in enumerate(self.next_position) if p <= self.park]


def branching_generate(target: FastLlama, draft: BranchingDraft, prompt: torch.Tensor, n_new: int, k: int,
                       overlap_steps: int, draft_first: bool = False) -> tuple[list[int], SpecStats]:
    """Overlapped greedy speculative decoding with runner-up branches; the output equals plain
    greedy decoding of the target. The rules are speculative_generate's overlapped ones, plus: at
    each pass, judged position i (0..p) gets a branch row when a row is free and the main row has
    already fed the position before it; a rejection (or a wrong bonus guess) at i whose correction
    is that branch's first token adopts the branch instead of restarting.

    `draft_first`: queue each pass's draft work (forks and steps) before the target's verify
    instead of after; the host reads the draft's rows only after both are queued. The draft is
    the busier GPU at the depths the chain picks, so it should start first. (Reading the rows
    before queueing the verify makes the target wait for the draft: 7.75 ms a pass against
    5.83-6.00 on two H200s, `bench.gpu_branches`.)"""
    if k < 1 or overlap_steps < 1:
        raise ValueError(f"k={k}, overlap_steps={overlap_steps}: branching needs k >= 1 and overlap_steps >= 1 "
                         "(it is the overlapped mode)")
    P = prompt.shape[1]
    needed = P + n_new + k + overlap_steps + 6
    if needed > min(target.max_len, draft.park):
        raise ValueError(f"prompt {P} + {n_new} new tokens needs caches of {needed}; target has {target.max_len}, "
                         f"draft {draft.park} usable: raise max_len")
    stats = SpecStats()
    draft_prompt = prompt.to(draft.device)
    first_dev = target.prefill_last(prompt.to(target.device))[0].argmax()  # []
    draft.prefill(draft_prompt)  # queued before the host waits on the target's prefill
    first = int(first_dev)
    draft.restart(first, P)
    out, last, n = [first], first, P  # `last` sits at position n and is not in the target's cache yet
    ready: list[int] = []  # the main chain after `last`: its tokens for positions n+1, n+2, ...
    while len(out) < n_new:
        p = min(k, len(ready))
        if not draft_first:
            choice_dev = verify_host_ids(target, [last] + ready[:p], n)
        # the main row has fed `last` and ready[:-1]: a branch at n+1+i needs positions <= n+i fed
        free = [r for r in range(draft.rows) if r != draft.main]
        forks = dict(zip(range(min(p + 1, len(ready))), free))  # judged index i -> row branching at n+1+i
        draft.fork(list(forks.values()), [n + 1 + i for i in forks], drop_others=True)  # last pass's branches go
        free = free[len(forks):]
        steps = min(overlap_steps, max(1, k + 2 - (len(ready) - p)))
        lo = draft.next_position[draft.main]
        if p == len(ready) and free:  # the bonus position is drafted by this pass's first step
            draft.advance(1)
            forks[p] = free.pop(0)
            draft.fork([forks[p]], [n + 1 + p])
            draft.advance(steps - 1)
        else:
            draft.advance(steps)
        stats.draft_steps += steps
        stats.forks += len(forks)
        if draft_first:
            choice_dev = verify_host_ids(target, [last] + ready[:p], n)
        hi = max(draft.next_position[r] for r in draft.live_rows())
        new = read_back(draft.tokens[:, n + 1: hi])  # [R, hi - n - 1]: every row's proposals, one copy
        choice = choice_dev.tolist()  # [p + 1]: waits for the target only
        rows = new.tolist()
        ready += rows[draft.main][lo - n - 1: draft.next_position[draft.main] - n - 1]
        a = stats.record_pass(choice, ready, p)
        if a == p:  # all accepted: the chain's next token was its guess at the bonus
            stats.guesses += 1
        if a < p or ready[p] != choice[p]:  # rejected at a (or the bonus guess was wrong)
            row = forks.get(a)
            if row is not None:
                stats.branch_tries += 1
            if row is not None and rows[row][a] == choice[a]:  # the branch started from the correction
                branch = rows[row][a + 1: draft.next_position[row] - n - 1]  # its proposals after it
                draft.adopt(row)
                ready = branch
                stats.branch_hits += 1
            else:
                draft.restart(choice[a], n + a + 1)
                ready = []
                stats.restarts += 1
        else:  # all accepted and the bonus guessed
            ready = ready[p + 1:]
            stats.guesses_right += 1
        out += choice[: a + 1]
        n += a + 1
        last = out[-1]
        draft.commit(n)
    return out[:n_new], stats
