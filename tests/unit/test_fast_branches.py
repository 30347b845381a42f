"""Branching overlapped drafting (bench/inproc/fast_branches.py), run eagerly on the CPU with the embedded pair.

Whatever the branches propose, the output must be the target's plain greedy output. The statistics
must say what happened: with the pair's own top-2 some rejections are caught by a branch; with
controlled acceptance, a runner-up that is always right turns every rejection at a branched
position into a branch hit, and one that is never right turns none.
"""

from __future__ import annotations

import pytest
import torch

from bench.inproc.fast_branches import BranchingDraft, ControlledBranches, branching_generate
from bench.inproc.fast_decode import GreedyLoop, plain_generate, speculative_generate
from app.runners.lean_llama import FastLlama

N_NEW = 40
MAX_LEN = 160


@pytest.fixture(scope="module")
def full(fast_hf_pair, code_prompt) -> list[int]:
    """The target's greedy output, long enough for a reference the draft can run ahead on."""
    return plain_generate(GreedyLoop(FastLlama(fast_hf_pair[0], max_len=MAX_LEN)), code_prompt, N_NEW + 16)


def _branching(fast_hf_pair, code_prompt, k: int, steps: int, rows: int, propose=None):
    target = FastLlama(fast_hf_pair[0], max_len=MAX_LEN)
    draft = BranchingDraft(FastLlama(fast_hf_pair[1], max_batch=rows, max_len=MAX_LEN), rows, propose)
    return branching_generate(target, draft, code_prompt, N_NEW, k, steps)


def _reference(code_prompt: torch.Tensor, tokens: list[int]) -> torch.Tensor:
    ref = torch.zeros(MAX_LEN, dtype=torch.long)
    ref[code_prompt.shape[1]: code_prompt.shape[1] + len(tokens)] = torch.tensor(tokens)
    return ref


@pytest.mark.parametrize("k,steps,rows", [(1, 2, 2), (3, 4, 5), (4, 5, 3), (6, 7, 8)])
def test_the_pairs_own_proposals_give_the_plain_output(fast_hf_pair, code_prompt, full, k, steps, rows) -> None:
    out, stats = _branching(fast_hf_pair, code_prompt, k, steps, rows)
    assert out == full[:N_NEW]
    assert stats.accepted > 0 and stats.forks > 0
    assert stats.drafted == sum(p * n for p, n in stats.widths.items()) and max(stats.widths) <= k
    assert stats.branch_hits <= stats.branch_tries


def test_the_pairs_runner_up_catches_some_rejections(fast_hf_pair, code_prompt, full) -> None:
    # the trained pair: its runner-up is the target's token in about half of the rejections on
    # code (bench/draft_agreement.py), so over 40 tokens at least one branch is adopted
    out, stats = _branching(fast_hf_pair, code_prompt, 4, 5, 6)
    assert out == full[:N_NEW]
    assert stats.branch_hits > 0
    # an adopted branch replaces a restart: fewer restarts than the one-chain loop's
    one_chain = GreedyLoop(FastLlama(fast_hf_pair[1], max_len=MAX_LEN))
    _, chain_stats = speculative_generate(FastLlama(fast_hf_pair[0], max_len=MAX_LEN), one_chain, code_prompt, N_NEW, 4,
                                          overlap_steps=5)
    assert stats.restarts < chain_stats.restarts


@pytest.mark.parametrize("beta", [0.0, 1.0])
def test_controlled_runner_up(fast_hf_pair, code_prompt, full, beta) -> None:
    propose = ControlledBranches(_reference(code_prompt, full), alpha=0.6, beta=beta, vocab=4096, seed=3)
    out, stats = _branching(fast_hf_pair, code_prompt, 3, 4, 5, propose)
    assert out == full[:N_NEW]
    assert 0 < stats.accepted < stats.drafted
    assert stats.branch_tries > 0
    if beta == 0.0:
        assert stats.branch_hits == 0
    else:  # every branched rejection is caught
        assert stats.branch_hits == stats.branch_tries


def test_queueing_the_draft_first_changes_nothing_but_the_order(fast_hf_pair, code_prompt, full) -> None:
    target = FastLlama(fast_hf_pair[0], max_len=MAX_LEN)
    draft = BranchingDraft(FastLlama(fast_hf_pair[1], max_batch=5, max_len=MAX_LEN), 5)
    out, stats = branching_generate(target, draft, code_prompt, N_NEW, 3, 4)
    out_first, stats_first = branching_generate(target, draft, code_prompt, N_NEW, 3, 4, draft_first=True)
    assert out == out_first == full[:N_NEW]
    assert (stats.passes, stats.branch_hits, stats.restarts) == (stats_first.passes, stats_first.branch_hits,
                                                                 stats_first.restarts)


@pytest.mark.parametrize("beta", [None, 0.0, 1.0])
def test_graph_fork_equals_the_eager_fork(fast_hf_pair, code_prompt, full, beta, monkeypatch) -> None:
    # the fixed-shape drop-and-fork (what the CUDA graph replays; eager here) must leave every row as
    # the eager fork does. beta None: the pair's own top-2, so a branch whose K/V or first token were
    # wrong would draft differently (and hit or miss differently) than the eager fork's
    ref = _reference(code_prompt, full)
    runs = {}
    graph_passes = []  # per pass-start fork (drop_others): taken by the fixed-shape path
    real = BranchingDraft._queue_drop_and_fork
    monkeypatch.setattr(BranchingDraft, "_queue_drop_and_fork",
                        lambda self, rows, positions, lo, drop: (graph_passes.append(drop), real(self, rows, positions, lo, drop)))
    for graph in (True, False):
        graph_passes.clear()
        target = FastLlama(fast_hf_pair[0], max_len=MAX_LEN)
        propose = None if beta is None else ControlledBranches(ref, alpha=0.6, beta=beta, vocab=4096, seed=3)
        # the model holds more cache rows than the draft uses (as bench.gpu_branches' does)
        draft = BranchingDraft(FastLlama(fast_hf_pair[1], max_batch=7, max_len=MAX_LEN), 5, propose, fork_graph=graph)
        out, stats = branching_generate(target, draft, code_prompt, N_NEW, 3, 4)
        runs[graph] = (out, stats.passes, stats.forks, stats.accepted, stats.branch_tries, stats.branch_hits,
                       stats.restarts)
        # a row's first fork copies from the prompt on (wider than FORK_SPAN): eager; every later pass: the graph
        assert sum(graph_passes) >= stats.passes - 4 if graph else not graph_passes
    assert runs[True] == runs[False]
    assert runs[True][0] == full[:N_NEW]
    if beta is None:
        assert runs[True][5] > 0  # the pair's runner-up was adopted: branch rows drafted from real K/V


def test_controlled_alpha_one_never_restarts(fast_hf_pair, code_prompt, full) -> None:
    propose = ControlledBranches(_reference(code_prompt, full), alpha=1.0, beta=0.0, vocab=4096)
    out, stats = _branching(fast_hf_pair, code_prompt, 3, 4, 4, propose)
    assert out == full[:N_NEW]
    assert stats.restarts == 0 and stats.branch_tries == 0 and stats.acceptance_rate == 1.0


def test_what_it_cannot_do_is_refused(fast_hf_pair, code_prompt) -> None:
    draft_model = FastLlama(fast_hf_pair[1], max_batch=2, max_len=MAX_LEN)
    with pytest.raises(ValueError, match="max_batch=4"):
        BranchingDraft(draft_model, 4)
    with pytest.raises(ValueError, match="at least one branch row"):
        BranchingDraft(draft_model, 1)
    draft = BranchingDraft(draft_model, 2)
    target = FastLlama(fast_hf_pair[0], max_len=MAX_LEN)
    with pytest.raises(ValueError, match="overlapped mode"):
        branching_generate(target, draft, code_prompt, N_NEW, 3, 0)
    with pytest.raises(ValueError, match="raise max_len"):
        branching_generate(target, draft, code_prompt, MAX_LEN, 3, 4)
