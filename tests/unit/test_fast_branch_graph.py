"""Branching with the verdict on the device (bench/inproc/fast_branch_graph.py), run eagerly on the CPU with
the embedded pair: the same tensor ops the CUDA graphs replay.

Whatever the rows propose, the output must be the target's plain greedy output; the device
counters must say what happened (a runner-up that is always right is adopted at every branched
rejection, one that is never right never is)."""

from __future__ import annotations

import pytest
import torch

from bench.inproc.fast_branch_graph import BranchingPassGraphs
from bench.inproc.fast_branches import BranchingDraft, ControlledBranches
from bench.inproc.fast_decode import GreedyLoop, plain_generate
from app.runners.lean_llama import FastLlama

N_NEW = 40
MAX_LEN = 160


@pytest.fixture(scope="module")
def full(fast_hf_pair, code_prompt) -> list[int]:
    return plain_generate(GreedyLoop(FastLlama(fast_hf_pair[0], max_len=MAX_LEN)), code_prompt, N_NEW + 24)


def _loop(fast_hf_pair, k: int, steps: int, rows: int, propose=None, model_rows: int | None = None):
    target = FastLlama(fast_hf_pair[0], max_len=MAX_LEN)
    draft = BranchingDraft(FastLlama(fast_hf_pair[1], max_batch=model_rows or rows, max_len=MAX_LEN), rows, propose)
    return BranchingPassGraphs(target, draft, k, steps)


@pytest.mark.parametrize("k,steps,rows", [(1, 2, 2), (3, 3, 5), (4, 5, 3), (6, 4, 8)])
def test_the_pairs_own_proposals_give_the_plain_output(fast_hf_pair, code_prompt, full, k, steps, rows) -> None:
    loop = _loop(fast_hf_pair, k, steps, rows)
    out, stats = loop.generate(code_prompt, N_NEW)
    assert out == full[:N_NEW]
    assert stats.accepted > 0 and stats.passes > 0
    assert stats.accepted <= stats.checked <= stats.drafted
    assert stats.branch_hits <= stats.branch_tries
    again, _ = loop.generate(code_prompt, N_NEW)  # the loop's state is reset by each call
    assert again == out


@pytest.mark.parametrize("beta", [1.0, 0.0])
def test_a_runner_up_that_is_always_right_is_always_adopted(fast_hf_pair, code_prompt, full, beta) -> None:
    ref = torch.zeros(MAX_LEN, dtype=torch.long)
    P = code_prompt.shape[1]
    ref[P: P + len(full)] = torch.tensor(full)
    propose = ControlledBranches(ref, alpha=0.6, beta=beta, vocab=4096, seed=3)
    # more cache rows than the loop uses: forks touch only the first `rows`
    out, stats = _loop(fast_hf_pair, 3, 3, 5, propose, model_rows=7).generate(code_prompt, N_NEW)
    assert out == full[:N_NEW]
    assert stats.branch_tries > 0
    assert stats.branch_hits == (stats.branch_tries if beta == 1.0 else 0)
    # a pass that is neither continued nor rescued by a branch restarts the chain
    assert stats.restarts + stats.branch_hits + stats.guesses_right == stats.passes


def test_bad_shapes_are_refused(fast_hf_pair, code_prompt) -> None:
    with pytest.raises(ValueError, match="k >= 1"):
        _loop(fast_hf_pair, 0, 1, 3)
    with pytest.raises(ValueError, match="outgrow"):
        _loop(fast_hf_pair, 2, 4, 3)
    with pytest.raises(ValueError, match="raise max_len"):
        _loop(fast_hf_pair, 3, 3, 3).generate(code_prompt, MAX_LEN)
