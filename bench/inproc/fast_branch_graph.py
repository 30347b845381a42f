"""Branching overlapped drafting with the verdict on the device: the host never waits inside the loop.

`branching_generate` (bench/inproc/fast_branches.py) reads every pass's verdict and the draft's rows back
to the host, decides there which row continues and where the next branches start, and only then
queues the next verify and the next draft steps. Both GPUs idle through that turn-around: on a
2x H200 host ~0.4 ms of a ~5.3 ms pass (`bench.gpu_branches`). Here the same
decisions are tensor ops on the target's GPU, and the host queues pass after pass:

    target GPU  [mirror the draft's rows] -> verdict of the last pass + next verify inputs -> verify
    draft GPU                       [control vector] -> restart/adopt + forks -> 1 step -> bonus fork -> L-1 steps

The verdict of pass t needs the target's choices of pass t and the draft's rows after pass t (the
chain and the branches it drafted meanwhile); both GPUs' pass t+1 need the verdict. So a pass is
bracketed by two small cross-GPU copies: the draft's token rows and positions (R x max_len ids,
~20 KB) to the target's GPU, and a control vector (3R + 5 ids) back. Nothing goes through the host.

Fixed shapes, so a pass is two graph replays per GPU (on CUDA; eagerly on the CPU for the tests):
- the verify always feeds k + 1 tokens, `[last] + chain[:k]`; only the first p = min(k, ready)
  proposals are judged (the rest are whatever the row holds, and the target's K/V written for
  them is stale and masked, as after any rejection). A restart pass costs a verify, not a decode.
- the draft runs L steps every pass, on all R rows at once.
- every row but the main one forks every pass, at judged index min(j, p) for the j-th non-main
  row (rows past p repeat the last index: a duplicate costs nothing, rows step as one batch). So
  every row agrees with the main row below the last pass's n + 1, and a fork copies a fixed window
  of the main row's K/V, [n_prev + 1, n_prev + 1 + 2k + 4), that covers every position it can need.

The rules are branching_generate's otherwise: the chain continues when every judged proposal and
the bonus guess are right; else the branch that started from the correction is adopted; else the
main row restarts from the correction. The output is the target's greedy output.
"""

from __future__ import annotations

import math

import torch

from bench.inproc.fast_branches import BranchingDraft
from bench.inproc.fast_decode import SpecStats
from app.runners.lean_llama import FastLlama, capture_graph

# control vector sent to the draft's GPU each pass: restart, token, n, main, lo | pre-fork [R] | post-fork [R] | fork position [R]
_HEAD = 5
# device counters: passes, proposals judged, accepted, guesses (a == p with a proposal there), guesses right,
# branch tries, branch hits, restarts, proposals compared up to the first miss
_COUNTS = 9


class BranchingPassGraphs:
    """Greedy overlapped speculative decoding with runner-up branches, target and draft each on its own
    device, the loop's decisions on the target's device (see the module doc)."""

    def __init__(self, target: FastLlama, draft: BranchingDraft, k: int, steps: int, compile_control: bool = True) -> None:
        """compile_control: on CUDA, compile the verdict and the draft's row control with Inductor
        before capturing them (a few fused kernels instead of ~60 and ~30 tiny ones: those run
        between the two GPUs' passes, so every microsecond of them is a microsecond of idle GPU)."""
        if k < 1 or steps < 1:
            raise ValueError(f"k={k}, steps={steps}: the loop needs k >= 1 proposals and steps >= 1 draft steps a pass")
        if steps > k + 1:
            raise ValueError(f"steps={steps} > k + 1 = {k + 1}: the chain would outgrow what a pass can verify")
        if target.device.type != draft.device.type:
            raise ValueError(f"target on {target.device}, draft on {draft.device}: put both on CUDA devices "
                             "(or both on the CPU, which runs the same ops eagerly)")
        self.target, self.draft, self.k, self.steps = target, draft, k, steps
        self.td, self.dd = target.device, draft.device
        # both on one GPU: it runs, with each side's pass on its own stream, but there is nothing to overlap
        # onto; the sequential pass (bench/inproc/fast_spec_graph.py) is the mode for one GPU
        self._one_gpu = self.td.type == "cuda" and self.td == self.dd
        R, W, ML = draft.rows, k + 1, draft.max_len
        self.rows, self.width, self.span = R, W, 2 * k + 4
        self.max_len = min(target.max_len, draft.park)
        t, d = self.td, self.dd
        i64 = dict(dtype=torch.long)
        # ---- loop state, on the target's device ----
        self.seq = torch.zeros(target.max_len, device=t, **i64)  # [max_len] x_0, x_1, ...: the output
        self.n = torch.zeros(1, device=t, **i64)  # [1] position of `last` (the newest accepted token)
        self.p = torch.zeros(1, device=t, **i64)  # [1] proposals judged in the pass in flight
        self.main = torch.zeros(1, device=t, **i64)  # [1] the draft row holding the chain
        self.fork_pos = torch.full((R,), -1, device=t, **i64)  # [R] where each row branched this pass (-1: main)
        self.choice = torch.zeros(W, device=t, **i64)  # [W] the target's argmax over the pass in flight
        self.counts = torch.zeros(_COUNTS, device=t, **i64)
        self.ids = torch.zeros((1, W), device=t, **i64)  # [1, W] the verify's inputs
        self.pos = torch.zeros((1, W), device=t, **i64)  # [1, W] ... at these positions
        self.ctrl = torch.zeros(_HEAD + 3 * R, device=t, **i64)
        # mirror of the draft's rows: its proposals [R, max_len] and the position each row feeds next [R]
        self.m_state = torch.zeros((R, ML + 1), device=t, **i64)
        self.m_tokens, self.m_pos = self.m_state[:, :ML], self.m_state[:, ML]
        self._offsets = torch.arange(W, device=t)  # [W]
        self._rows_t = torch.arange(R, device=t)  # [R]
        # ---- on the draft's device ----
        self.ctrl_d = torch.zeros(_HEAD + 3 * R, device=d, **i64)
        self.state_d = torch.zeros((R, ML + 1), device=d, **i64)  # what m_state copies, written by each draft pass
        self._window = torch.arange(self.span, device=d)  # [S]
        self._g_verdict = self._g_verify = self._g_draft = None
        self._verdict_fn, self._control_fn, self._post_fn = self._verdict, self._control, self._post_rows
        if t.type == "cuda" and compile_control:
            self._verdict_fn, self._control_fn, self._post_fn = (
                torch.compile(f, fullgraph=True, dynamic=False) for f in (self._verdict, self._control, self._post_rows))
        if t.type == "cuda":
            self._s0, self._s1 = torch.cuda.Stream(t), torch.cuda.Stream(d)  # the passes
            self._x0, self._x1 = torch.cuda.Stream(t), torch.cuda.Stream(d)  # the two copies
            self._e_draft, self._e_verdict = torch.cuda.Event(), torch.cuda.Event()
            self._capture()

    # ---- the target's side -------------------------------------------------------------------
    def _verdict(self) -> None:
        """Judge the pass in flight against the mirrored rows, move the state on, and write the next
        verify's inputs and the draft's control vector."""
        k, R, W = self.k, self.rows, self.width
        last_col = min(self.seq.shape[0], self.m_tokens.shape[1]) - 1
        n, p, main = self.n, self.p, self.main  # [1] each
        row = self.m_tokens.index_select(0, main)[0]  # [max_len] the chain's row
        at = (n + 1 + self._offsets).clamp(max=last_col)  # [W] positions n+1..n+W
        props = row.index_select(0, at[:k])  # [k]
        agree = (self.choice[:k] == props) & (self._offsets[:k] < p)  # [k] judged and right
        a = agree.long().cumprod(0).sum().view(1)  # [1] accepted prefix
        c = self.choice.index_select(0, a)  # [1] the correction (or the bonus token when a == p)
        q = n + a + 1  # [1] where c lands
        ready = self.m_pos.index_select(0, main) - n  # [1] the chain's proposals: positions n+1..n+ready
        guessed = (a == p) & (p < ready)  # [1] the chain holds a guess at c's position
        chain_ok = guessed & (row.index_select(0, q.clamp(max=last_col)) == c)  # [1]
        first = self.m_tokens.gather(1, q.clamp(max=last_col).expand(R).view(R, 1))[:, 0]  # [R] each row's token at q
        branch = (self.fork_pos == q) & (first == c)  # [R] rows that branched at q from c
        tried = ~chain_ok & (self.fork_pos == q).any()  # [1]
        hit = ~chain_ok & branch.any()  # [1]
        restart = ~chain_ok & ~hit  # [1]
        new_main = torch.where(hit, branch.long().argmax().view(1), main)  # [1] the first such row
        self.seq.index_copy_(0, at, self.choice)  # x_{n+1..n+W}; only up to x_q is kept
        ready = torch.where(restart, torch.zeros_like(ready), self.m_pos.index_select(0, new_main) - q)  # [1]
        p_next = ready.clamp(max=k)  # [1]
        # the next pass's forks: the j-th row but the main one branches at judged index min(j, p)
        rows = self._rows_t
        j = torch.where(rows < new_main, rows, rows - 1)  # [R]
        index = torch.minimum(j, p_next)  # [R]
        is_main = rows == new_main  # [R]
        pre = ~is_main & (index < ready)  # [R] the chain already fed the position before: fork now
        post = ~is_main & ~pre  # [R] the bonus index p == ready: fork after the first step
        fork_at = q + 1 + index  # [R]
        self.fork_pos.copy_(torch.where(is_main, -1, fork_at))
        self.ctrl.copy_(torch.cat([restart.long(), c, q, new_main, n + 1, pre.long(), post.long(), fork_at]))
        one = torch.ones_like(a)
        self.counts += torch.cat([one, p, a, guessed.long(), chain_ok.long(), tried.long(), hit.long(), restart.long(),
                                  torch.minimum(a + 1, p)])
        # the verify of the next pass: [c] + the chain after it, at q..q+k
        nxt = self.m_tokens.index_select(0, new_main)[0].index_select(0, (q + 1 + self._offsets[:k]).clamp(max=last_col))
        self.ids.copy_(torch.cat([c, nxt]).view(1, W))
        self.pos.copy_((q + self._offsets).view(1, W))
        self.n.copy_(q)
        self.p.copy_(p_next)
        self.main.copy_(new_main)

    def _verify(self) -> None:
        self.choice.copy_(self.target.forward(self.ids, self.pos)[0].argmax(-1))  # [W]

    # ---- the draft's side --------------------------------------------------------------------
    def _draft_pass(self) -> None:
        """Apply the control vector (restart or adopt; every other row dropped, then forked), draft
        L steps, and leave the rows where the target's side copies them from."""
        d, R, ctrl = self.draft, self.rows, self.ctrl_d
        pre, post = ctrl[_HEAD: _HEAD + R].bool(), ctrl[_HEAD + R: _HEAD + 2 * R].bool()  # [R]
        self._control_fn()
        self._fork_kv(pre)
        d._step()
        self._post_fn()
        self._fork_kv(post)
        for _ in range(self.steps - 1):
            d._step()
        self.state_d[:, :-1].copy_(d.tokens)
        self.state_d[:, -1].copy_(d._pos[:, 0])

    def _control(self) -> None:
        """The rows' ids and positions before the first step: the main row restarts or goes on,
        every other row is dropped, and the rows that branch now take the main row's tokens."""
        d, R, ctrl = self.draft, self.rows, self.ctrl_d
        restart, c, q, main = ctrl[0:1].bool(), ctrl[1:2], ctrl[2:3], ctrl[3:4]  # [1] each
        is_main = d._rows == main  # [R]
        again = is_main & restart  # [R] the main row feeds c at q
        d._tok.copy_(torch.where(again, c, d._tok[:, 0]).view(R, 1))
        d._pos.copy_(torch.where(again, q, torch.where(is_main, d._pos[:, 0], d.park)).view(R, 1))
        d._live.copy_(is_main)
        at_q = d.tokens.gather(1, q.expand(R).view(R, 1))[:, 0]  # [R]
        d.tokens.scatter_(1, q.expand(R).view(R, 1), torch.where(again, c, at_q).view(R, 1))
        self._fork_rows(ctrl[_HEAD: _HEAD + R].bool())

    def _post_rows(self) -> None:
        self._fork_rows(self.ctrl_d[_HEAD + self.rows: _HEAD + 2 * self.rows].bool())

    def _fork_rows(self, mask: torch.Tensor) -> None:
        """Rows in `mask` take the main row's tokens over the window [lo, lo + S) and feed the main
        row's runner-up at their fork position (BranchingDraft._drop_and_fork's fork, fixed window)."""
        d, R, ctrl = self.draft, self.rows, self.ctrl_d
        main, lo, fork_at = ctrl[3:4], ctrl[4:5], ctrl[_HEAD + 2 * R: _HEAD + 3 * R]
        where = fork_at.clamp(max=d.max_len - 1)  # [R]
        span = (lo + self._window).clamp(max=d.max_len - 1)  # [S]
        cur_t = d.tokens.index_select(1, span)  # [R, S]
        d.tokens.index_copy_(1, span, torch.where(mask.view(R, 1), cur_t.index_select(0, main), cur_t))
        first = d.runner_up.index_select(0, main)[0].gather(0, where)  # [R] the main row's runner-up there
        at = d.tokens.gather(1, where.view(R, 1))[:, 0]  # [R]
        d.tokens.scatter_(1, where.view(R, 1), torch.where(mask, first, at).view(R, 1))
        d._tok.copy_(torch.where(mask, first, d._tok[:, 0]).view(R, 1))
        d._pos.copy_(torch.where(mask, where, d._pos[:, 0]).view(R, 1))
        d._live.copy_(d._live | mask)

    def _fork_kv(self, mask: torch.Tensor) -> None:
        """Rows in `mask` take the main row's K/V over the window [lo, lo + S)."""
        d, R, ctrl = self.draft, self.rows, self.ctrl_d
        main = ctrl[3:4]
        span = (ctrl[4:5] + self._window).clamp(max=d.max_len - 1)  # [S]
        for cache in (d.model.k_cache[:, :R], d.model.v_cache[:, :R]):  # [layers, R, max_len, KV, D] views
            cur = cache.index_select(2, span)  # [layers, R, S, KV, D]
            cache.index_copy_(2, span, torch.where(mask.view(1, R, 1, 1, 1), cur.index_select(1, main), cur))

    # ---- the loop ----------------------------------------------------------------------------
    def _mirror(self) -> None:
        self.m_state.copy_(self.state_d, non_blocking=True)

    def _send_control(self) -> None:
        self.ctrl_d.copy_(self.ctrl, non_blocking=True)

    def _queue_pass(self) -> None:
        if self._g_verdict is None:
            self._mirror()
            self._verdict_fn()
            self._verify()
            self._send_control()
            self._draft_pass()
            return
        # the draft's rows, once its last pass is done and the last verdict has read the old mirror
        # (a copy between devices runs on both devices' current streams: torch's Copy.cu)
        # On one GPU only the inner context's stream is current, so the stream that runs the copy must
        # itself wait for both events (otherwise the mirror races the draft's pass and the control
        # copy the verdict).
        with torch.cuda.stream(self._x1), torch.cuda.stream(self._x0):
            self._x1.wait_event(self._e_draft)
            self._x0.wait_event(self._e_verdict)
            if self._one_gpu:
                self._x0.wait_event(self._e_draft)
            self._mirror()
        self._s0.wait_stream(self._x0)
        with torch.cuda.stream(self._s0):
            self._g_verdict.replay()
            self._e_verdict.record(self._s0)
            self._g_verify.replay()
        # the control vector, once written and once the draft's last pass has read the old one
        with torch.cuda.stream(self._x0), torch.cuda.stream(self._x1):
            self._x0.wait_event(self._e_verdict)
            self._x1.wait_event(self._e_draft)
            if self._one_gpu:
                self._x1.wait_event(self._e_verdict)
            self._send_control()
        self._s1.wait_stream(self._x1)
        with torch.cuda.stream(self._s1):
            self._g_draft.replay()
            self._e_draft.record(self._s1)

    def _capture(self) -> None:
        """One graph each: the verdict, the verify (target's device), the draft's pass (draft's)."""
        park = self.target.max_len - 2 * self.width - 2  # capture passes write near the caches' ends
        dpark = self.draft.park - self.span - 2 * self.steps - self.k - 4

        def target_scratch() -> None:
            self.n.fill_(park)
            self.p.zero_()
            self.main.zero_()
            self.m_pos.fill_(park)
            self.fork_pos.fill_(-1)

        def draft_scratch() -> None:  # the main row restarts at dpark, nothing forks
            self.ctrl_d.zero_()
            self.ctrl_d[0:5] = torch.tensor([1, 0, dpark, 0, dpark])
            self.ctrl_d[_HEAD + 2 * self.rows:] = dpark + 1

        self._g_verdict, _ = capture_graph(self.td, self._verdict_fn, target_scratch)
        self._g_verify, _ = capture_graph(self.td, self._verify, target_scratch)
        self._g_draft, _ = capture_graph(self.dd, self._draft_pass, draft_scratch)
        torch.cuda.synchronize(self.td)
        torch.cuda.synchronize(self.dd)

    def generate(self, prompt: torch.Tensor, n_new: int) -> tuple[list[int], SpecStats]:
        """prompt `[1, P]` -> the target's greedy continuation of n_new tokens (as plain decoding)."""
        k, P, d = self.k, prompt.shape[1], self.draft
        if P < 1:
            raise ValueError("an empty prompt: give at least one token")
        goal = P + n_new - 1  # position of the last token wanted
        needed = goal + 3 * k + 2 * self.steps + self.span + 8
        if needed > self.max_len:
            raise ValueError(f"prompt {P} + {n_new} new tokens at k={k}, steps={self.steps} needs caches of {needed}; "
                             f"target holds {self.target.max_len}, draft {d.park} usable: raise max_len")
        self._sync()  # a previous call's last passes are still in flight on both devices
        first = self.target.prefill_last(prompt.to(self.td))[0].argmax()  # []
        d.prefill(prompt.to(self.dd))
        # every row starts as a copy of the prompt's K/V: rows must agree with the main row below P
        for cache in (d.model.k_cache, d.model.v_cache):
            cache[:, 1:self.rows, :P] = cache[:, :1, :P]
        d._pos.fill_(d.park)
        d._pos[0, 0] = P - 1  # an empty chain at n = P - 1 ...
        self.state_d[:, :-1].copy_(d.tokens)  # what the first pass mirrors
        self.state_d[:, -1].copy_(d._pos[:, 0])
        self.seq[:P] = prompt[0].to(self.td)
        self.n.fill_(P - 1)
        self.p.zero_()
        self.main.zero_()
        self.fork_pos.fill_(-1)
        self.choice.zero_()
        self.choice[0] = first  # ... whose pass "chose" the first token: the first verdict restarts there
        self.counts.zero_()
        if self._g_verdict is not None:
            self._sync()
            self._e_draft.record(self._s1)
            self._e_verdict.record(self._s0)
        done = P - 1
        while done < goal:
            for _ in range(max(1, math.ceil((goal - done) / (k + 1)))):
                self._queue_pass()
            # the round's one host synchronisation; the pass in flight is judged by the next round's first verdict
            done = int(self.n.item()) if self._g_verdict is None else self._read_n()
        self._sync()
        passes, judged, accepted, guesses, right, tries, hits, restarts, checked = self.counts.tolist()
        # the first verdict judged no pass: it only restarted the chain at the first token
        passes, restarts = passes - 1, restarts - 1
        stats = SpecStats(passes=passes, drafted=judged, accepted=accepted, checked=checked, guesses=guesses,
                          guesses_right=right, restarts=restarts, draft_steps=passes * self.steps,
                          forks=passes * (self.rows - 1), branch_tries=tries, branch_hits=hits)
        return self.seq[P: P + n_new].tolist(), stats

    def _read_n(self) -> int:
        with torch.cuda.stream(self._s0):
            return int(self.n.item())

    def _sync(self) -> None:
        if self.td.type == "cuda":
            torch.cuda.synchronize(self.dd)
            torch.cuda.synchronize(self.td)
