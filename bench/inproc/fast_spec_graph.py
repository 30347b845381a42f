"""Sequential speculative decoding with the whole pass on the device: one CUDA graph per pass.

`speculative_generate` (bench/inproc/fast_decode.py) reads every pass's verdict back to the host and
decides there what the draft feeds next. The GPU idles through that turn-around: on a 2x H200
host it measured 0.7-0.9 ms per pass (wall minus draft and target busy time), about a tenth of a
sequential pass at alpha 0.7. Here the verdict is computed on the device as well, so a pass is
one graph replay and the host never waits inside the loop:

    draft   feed [x_{n-1}, x_n] at n-1, n, then k-1 single steps -> p_1..p_k at n+1..n+k
            (always two tokens first: re-feeding x_{n-1} rewrites the K/V it already holds,
            and one graph serves both the rejected and the fully accepted case; feeding k+1 single
            steps instead, the last one feeding p_k, measured slower with both bf16 and int8 drafts)
    verify  target over [x_n, p_1..p_k] at n..n+k -> its choices c_0..c_k
    accept  a = length of the prefix where p agrees with c; x_{n+1..n+a+1} = c_0..c_a; n += a+1

with n held in a device scalar. Entries written past the new n (the rest of c, the draft's K/V
for rejected proposals, the target's K/V of the verify pass) are stale: attention masks keys by
position and later passes overwrite them. The host replays passes in rounds and reads n once
per round; a pass emits at most k+1 tokens, so a round of ceil(remaining / (k+1)) passes never
runs past the requested length by more than one pass.

Same device only (the sequential mode); the overlapped mode stays in bench/inproc/fast_decode.py.
"""

from __future__ import annotations

import math

import torch

from bench.inproc.fast_decode import GreedyLoop, SpecStats
from app.runners.lean_llama import FastLlama, capture_graph


class SpeculativePassGraph:
    """Greedy speculative decoding at depth k with draft and target on one device."""

    def __init__(self, target: FastLlama, draft: GreedyLoop, k: int) -> None:
        if k < 1:
            raise ValueError(f"k={k}: speculative decoding needs k >= 1 (use plain_generate for k=0)")
        if draft.device != target.device:
            raise ValueError(f"draft on {draft.device}, target on {target.device}: the one-graph pass needs "
                             "one device (use speculative_generate's overlapped mode across two)")
        self.target, self.draft, self.k, self.device = target, draft, k, target.device
        self.max_len = min(target.max_len, draft.max_len)
        self.seq = torch.zeros(self.max_len, dtype=torch.long, device=self.device)  # [max_len] x_0, x_1, ...
        self.n = torch.zeros(1, dtype=torch.long, device=self.device)  # [1] position of the last token
        self.offsets = torch.arange(k + 1, device=self.device)  # [k+1]
        self.pair = torch.arange(-1, 1, device=self.device)  # [2]
        # passes, accepted, checked, passes with a rejection
        self.counts = torch.zeros(4, dtype=torch.long, device=self.device)
        self._graph: torch.cuda.CUDAGraph | None = None
        if self.device.type == "cuda":
            park = self.max_len - 2 * k - 4  # warm-up/capture passes write near the cache's end
            self._graph, _ = capture_graph(self.device, self._pass, lambda: self.n.fill_(park))
            torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def _pass(self) -> None:
        k, d = self.k, self.draft
        two = self.n + self.pair  # [2] positions n-1, n
        d._tok[2].copy_(self.seq.index_select(0, two).view(1, 2))
        d._pos[2].copy_(two.view(1, 2))
        d._step(2)
        for _ in range(k - 1):
            d._step(1)
        at = self.n + self.offsets  # [k+1] positions n..n+k
        proposals = d.tokens.index_select(0, at[1:])  # [k]
        ids = torch.cat([self.seq.index_select(0, at[:1]), proposals]).view(1, k + 1)  # [1, k+1]
        choice = self.target.forward(ids, at.view(1, k + 1))[0].argmax(-1)  # [k+1]
        accepted = (choice[:k] == proposals).long().cumprod(0).sum()  # [] agreeing prefix length a
        self.seq.index_copy_(0, at + 1, choice)  # x_{n+1..n+k+1}; only up to n+a+1 is kept
        checked = torch.clamp(accepted + 1, max=k)  # compared up to and including the first miss
        self.counts += torch.stack([torch.ones_like(accepted), accepted, checked, (accepted < k).long()])
        self.n += accepted + 1

    def generate(self, prompt: torch.Tensor, n_new: int) -> tuple[list[int], SpecStats]:
        """prompt `[1, P]` -> the target's greedy continuation of n_new tokens (as plain decoding)."""
        k, P = self.k, prompt.shape[1]
        goal = P + n_new - 1  # position of the last token wanted
        if goal + 2 * k + 2 > self.max_len:  # the last pass may start at goal-1 and write k+2 past it
            raise ValueError(f"prompt {P} + {n_new} new tokens at k={k} needs caches of {goal + 2 * k + 2}; "
                             f"they hold {self.max_len}")
        if P < 1:
            raise ValueError("an empty prompt: give at least one token")
        prompt = prompt.to(self.device)
        first = self.target.prefill_last(prompt)[0].argmax()  # []
        self.draft.prefill(prompt)
        self.seq[:P] = prompt[0]
        self.seq[P] = first
        self.n.fill_(P)
        self.counts.zero_()
        done = P
        while done < goal:
            for _ in range(max(1, math.ceil((goal - done) / (k + 1)))):
                if self._graph is not None:
                    with torch.cuda.device(self.device):  # replay() uses the current device's stream
                        self._graph.replay()
                else:
                    self._pass()
            done = int(self.n.item())  # the round's one host synchronisation
        passes, accepted, checked, rejected = self.counts.tolist()
        stats = SpecStats(passes=passes, drafted=passes * k, accepted=accepted, checked=checked, restarts=rejected,
                          draft_steps=passes * k, widths={k: passes})
        return self.seq[P: P + n_new].tolist(), stats
