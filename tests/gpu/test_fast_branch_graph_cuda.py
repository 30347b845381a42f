"""On CUDA: branching with the verdict on the device (bench/inproc/fast_branch_graph.py), each side's pass
captured as graphs, the draft on a second GPU (or beside the target on one): plain greedy output, and a
controlled runner-up that is always right adopted at every branched rejection. The embedded pair
in float32. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

N_NEW = 64


def test_device_verdict_branching_equals_plain_on_cuda(fast_pair) -> None:
    from bench.inproc.fast_branch_graph import BranchingPassGraphs
    from bench.inproc.fast_branches import BranchingDraft, ControlledBranches
    from bench.inproc.fast_decode import GreedyLoop, plain_generate

    draft_device = "cuda:1" if torch.cuda.device_count() > 1 else "cuda:0"
    target, draft_model, prompt = fast_pair(draft_device, draft_rows=7)
    plain = plain_generate(GreedyLoop(target), prompt, N_NEW + 24)
    loop = BranchingPassGraphs(target, BranchingDraft(draft_model, 5), 3, 3)
    assert loop._g_draft is not None  # each side's pass replays as graphs
    out, stats = loop.generate(prompt, N_NEW)
    assert out == plain[:N_NEW]
    assert stats.accepted > 0 and stats.passes > 0
    assert loop.generate(prompt, N_NEW)[0] == out  # a second call starts clean
    ref = torch.zeros(target.max_len, dtype=torch.long)
    ref[prompt.shape[1]: prompt.shape[1] + len(plain)] = torch.tensor(plain)
    propose = ControlledBranches(ref.to(draft_device), alpha=0.6, beta=1.0, vocab=4096, seed=3)
    loop = BranchingPassGraphs(target, BranchingDraft(draft_model, 5, propose), 3, 3)
    for beta in (1.0, 0.0):
        propose.reseed(0.6, beta, seed=3)  # in place: the captured graphs read the same tables
        out, stats = loop.generate(prompt, N_NEW)
        assert out == plain[:N_NEW]
        assert stats.branch_tries > 0
        assert stats.branch_hits == (stats.branch_tries if beta == 1.0 else 0)
        assert stats.restarts + stats.branch_hits + stats.guesses_right == stats.passes
