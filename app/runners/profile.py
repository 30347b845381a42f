"""Measure a replica's step costs at start-up, before traffic (app/policy/step_profile.py says why).

- `profile_target(runner, widths)`: the target's forward at every batch bucket of the runner and
  every pass width (1 = decode, k+1 = verify), each followed by one host read as the engine's
  verification ends a step, over scratch sequences with a short context, removed afterwards.
- `profile_draft(proposer, batches, depths)`: the draft proposer's whole step (one call: k tokens
  for each of b sequences, as the draft replica answers a target's step), on scratch sequences that
  accept everything they propose, after one call that prefills them and captures the step's graph.

Both need an empty model (start-up: the scratch sequences take the rows that traffic would) and
report the fastest of `repeats` timed runs per point: replicas sharing a card profile at the same
time, so a slow run is often the neighbour's work, not this step's cost (an H100 read the target's
1-row decode at 11.1 ms, median of 3, while the draft replica captured its graphs; in service it
took 5.6). The live steps then correct the profile either way (app/policy/step_profile.py).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

import numpy as np
import torch

from app.policy.step_profile import DraftTime, PassTime
from app.proposers.base import Proposer, ProposalRequest
from app.runners.model_runner import ModelRunner
from app.protocol.sampling_params import SamplingParams

SCRATCH = "__profile__"


def _tokens(rng: np.random.Generator, vocab: int, n: int) -> list[int]:
    return rng.integers(1, max(2, vocab - 1), size=n).tolist()


@torch.inference_mode()
def profile_target(runner: ModelRunner, widths: Iterable[int], *, repeats: int = 5, context: int = 32,
                   max_batch: int | None = None) -> list[PassTime]:
    """Seconds of the target's pass at each (batch bucket <= max_batch, width)."""
    if runner.num_sequences:
        raise RuntimeError("profile an empty runner: scratch sequences would shift the batch buckets")
    rng = np.random.default_rng(0)
    widths = sorted(set(widths))
    buckets = [b for b in runner.buckets if max_batch is None or b <= max_batch]
    context = max(1, min(context, runner.max_context - max(widths) - 1))
    ids: list[str] = []
    out: list[PassTime] = []
    try:
        for b in buckets:  # ascending: exactly b rows occupied, so the pass runs bucket b
            while len(ids) < b:
                ids.append(f"{SCRATCH}{len(ids)}")
                runner.add(ids[-1])
                runner.prefill(ids[-1], _tokens(rng, runner.vocab_size, context))
            for w in widths:
                inputs = [_tokens(rng, runner.vocab_size, w) for _ in ids]
                times = []
                for i in range(repeats + 1):  # the first run is a warm-up
                    t0 = time.perf_counter()
                    logits, _ = runner.step(ids, inputs)
                    logits[:len(ids), :w].argmax(-1).cpu()  # the step's host read
                    if i:
                        times.append(time.perf_counter() - t0)
                    for s in ids:
                        runner.truncate(s, context)
                out.append(PassTime(b, w, min(times)))
    finally:
        for s in ids:
            runner.remove(s)
    return out


def profile_draft(proposer: Proposer, vocab_size: int, batches: Sequence[int], depths: Iterable[int], *,
                  repeats: int = 5, context: int = 32, sampling: SamplingParams | None = None) -> list[DraftTime]:
    """Seconds of one draft call for b sequences proposing k tokens each, at every (b, k): the first
    call of each point prefills (a catch-up) and captures its graph, the next `repeats` are timed, each
    sequence having accepted its proposals and gained the target's token (the one or two tokens a
    drafting step feeds). Scratch sequences are released after each batch size."""
    rng = np.random.default_rng(1)
    sampling = sampling or SamplingParams(max_tokens=1)
    out: list[DraftTime] = []
    for b in sorted(set(batches)):
        ids = [f"{SCRATCH}{b}-{i}" for i in range(b)]
        seqs = {s: _tokens(rng, vocab_size, context) for s in ids}
        try:
            for k in sorted(set(depths)):
                times = []
                for i in range(repeats + 1):
                    requests = [ProposalRequest(s, list(seqs[s]), k, sampling, 0) for s in ids]
                    t0 = time.perf_counter()
                    proposals = proposer.propose(requests)
                    if i:
                        times.append(time.perf_counter() - t0)
                    for s, p in zip(ids, proposals):  # all accepted, plus the target's own token
                        seqs[s] += list(p.tokens) + _tokens(rng, vocab_size, 1)
                out.append(DraftTime(b, k, min(times)))
                for s in ids:  # back to the context: the next depth starts from a short sequence
                    del seqs[s][context:]
        finally:
            for s in ids:
                proposer.release(s)
    return out
