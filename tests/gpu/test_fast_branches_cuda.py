"""On CUDA: branching overlapped drafting (bench/inproc/fast_branches.py) with its batched step captured as
one graph gives plain greedy output, with the draft on a second GPU when there is one; a controlled
runner-up that is always right is adopted at every branched rejection. The embedded pair in
float32. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

N_NEW = 64


def test_branching_equals_plain_on_cuda(fast_pair) -> None:
    from bench.inproc.fast_branches import BranchingDraft, ControlledBranches, branching_generate
    from bench.inproc.fast_decode import GreedyLoop, plain_generate

    draft_device = "cuda:1" if torch.cuda.device_count() > 1 else "cuda:0"
    # more cache rows than the draft uses: the fork graph works on the model's first 6
    target, draft_model, prompt = fast_pair(draft_device, draft_rows=8)
    plain = plain_generate(GreedyLoop(target), prompt, N_NEW + 16)
    draft = BranchingDraft(draft_model, 6)
    assert draft._graph is not None  # the batched step replays as a graph
    out, stats = branching_generate(target, draft, prompt, N_NEW, 4, 5)
    assert out == plain[:N_NEW]
    assert stats.accepted > 0 and stats.forks > 0
    ref = torch.zeros(target.max_len, dtype=torch.long)
    ref[prompt.shape[1]: prompt.shape[1] + len(plain)] = torch.tensor(plain)
    propose = ControlledBranches(ref.to(draft_device), alpha=0.6, beta=1.0, vocab=4096, seed=3)
    draft = BranchingDraft(draft_model, 6, propose)
    propose.reseed(0.6, 1.0, seed=3)  # capturing the step ran it (and drew coins): start the table over
    out, stats = branching_generate(target, draft, prompt, N_NEW, 4, 5)
    assert out == plain[:N_NEW]
    assert stats.branch_tries > 0 and stats.branch_hits == stats.branch_tries
    assert draft._fork_graph is not None  # a pass's forks replay as one graph ...
    draft.fork_graph = False  # ... and leave the rows as the eager fork does
    propose.reseed(0.6, 1.0, seed=3)
    eager_out, eager_stats = branching_generate(target, draft, prompt, N_NEW, 4, 5)
    assert eager_out == out and (eager_stats.passes, eager_stats.forks, eager_stats.branch_hits) == (
        stats.passes, stats.forks, stats.branch_hits)
    draft.fork_graph = True
    propose.reseed(0.6, 0.0, seed=3)  # in place: the captured graph must see it
    out, stats = branching_generate(target, draft, prompt, N_NEW, 4, 5)
    assert out == plain[:N_NEW] and stats.branch_hits == 0
