"""The fast path's decoding loops (bench/inproc/fast_decode.py), run eagerly on the CPU with the embedded pair.

Plain decoding through the on-device loop must equal HF greedy decoding; speculative decoding,
sequential and overlapped, must emit exactly the plain output whatever the draft proposes (its own
argmax, or controlled acceptance at any alpha); and the statistics must say what happened
(alpha = 1: nothing rejected; alpha = 0: nothing accepted).
"""

from __future__ import annotations

import pytest
import torch

from bench.inproc.fast_decode import ControlledAcceptance, GreedyLoop, plain_generate, speculative_generate
from app.runners.lean_llama import FastLlama
from bench.inproc.fast_spec_graph import SpeculativePassGraph

N_NEW = 40
MAX_LEN = 160


@pytest.fixture(scope="module")
def plain(fast_hf_pair, code_prompt) -> list[int]:
    return plain_generate(GreedyLoop(FastLlama(fast_hf_pair[0], max_len=MAX_LEN)), code_prompt, N_NEW)


def test_plain_loop_equals_hf_greedy(fast_hf_pair, code_prompt, plain) -> None:
    with torch.no_grad():
        hf = fast_hf_pair[0].generate(code_prompt, max_new_tokens=N_NEW, min_new_tokens=N_NEW, do_sample=False)
    assert plain == hf[0, code_prompt.shape[1]:].tolist()


def _speculate(fast_hf_pair, code_prompt, k: int, overlap_steps: int, propose=None):
    target = FastLlama(fast_hf_pair[0], max_len=MAX_LEN)
    draft = GreedyLoop(FastLlama(fast_hf_pair[1], max_len=MAX_LEN), propose=propose)
    return speculative_generate(target, draft, code_prompt, N_NEW, k, overlap_steps=overlap_steps)


@pytest.mark.parametrize("k,overlap_steps", [(1, 0), (3, 0), (6, 0), (1, 2), (3, 2), (4, 5)])
def test_draft_model_proposals_give_the_plain_output(fast_hf_pair, code_prompt, plain, k, overlap_steps) -> None:
    out, stats = _speculate(fast_hf_pair, code_prompt, k, overlap_steps)
    assert out == plain
    assert stats.accepted > 0  # the trained pair agrees on code
    assert stats.drafted == sum(p * n for p, n in stats.widths.items())
    assert max(stats.widths) <= k
    if overlap_steps == 0:
        assert 0 not in stats.widths  # sequential never verifies an empty block


def _reference(code_prompt: torch.Tensor, plain: list[int]) -> torch.Tensor:
    ref = torch.zeros(MAX_LEN, dtype=torch.long)
    ref[code_prompt.shape[1]: code_prompt.shape[1] + len(plain)] = torch.tensor(plain)
    return ref


@pytest.mark.parametrize("overlap_steps", [0, 3])
def test_alpha_one_accepts_everything(fast_hf_pair, code_prompt, plain, overlap_steps) -> None:
    # the reference must reach past the output: the draft runs up to k + overlap ahead
    full = plain_generate(GreedyLoop(FastLlama(fast_hf_pair[0], max_len=MAX_LEN)), code_prompt, N_NEW + 12)
    ref = _reference(code_prompt, full)
    propose = ControlledAcceptance(ref, alpha=1.0, vocab=4096)
    out, stats = _speculate(fast_hf_pair, code_prompt, 3, overlap_steps, propose)
    assert out == plain
    assert stats.acceptance_rate == 1.0 and stats.per_token_acceptance == 1.0
    assert stats.restarts == 0 and stats.drafted > 0
    if overlap_steps == 0:
        assert stats.mean_acceptance_length == 4.0  # k + 1 per pass


@pytest.mark.parametrize("overlap_steps", [0, 3])
def test_alpha_zero_accepts_nothing(fast_hf_pair, code_prompt, plain, overlap_steps) -> None:
    propose = ControlledAcceptance(_reference(code_prompt, plain), alpha=0.0, vocab=4096)
    out, stats = _speculate(fast_hf_pair, code_prompt, 3, overlap_steps, propose)
    assert out == plain
    assert stats.accepted == 0 and stats.guesses_right == 0
    assert stats.drafted + stats.guesses > 0
    assert stats.acceptance_rate == 0.0 and stats.per_token_acceptance == 0.0


@pytest.mark.parametrize("overlap_steps", [0, 2, 4])
def test_controlled_acceptance_is_near_alpha_and_output_is_plain(fast_hf_pair, code_prompt, plain, overlap_steps) -> None:
    full = plain_generate(GreedyLoop(FastLlama(fast_hf_pair[0], max_len=MAX_LEN)), code_prompt, N_NEW + 12)
    propose = ControlledAcceptance(_reference(code_prompt, full), alpha=0.6, vocab=4096, seed=3)
    out, stats = _speculate(fast_hf_pair, code_prompt, 4, overlap_steps, propose)
    assert out == plain
    assert 0 < stats.accepted < stats.drafted
    # drafts past a miss are drafted but never compared
    assert stats.accepted < stats.checked <= stats.drafted
    assert 0 < stats.per_token_acceptance < 1


def test_bad_arguments_are_refused(fast_hf_pair, code_prompt) -> None:
    with pytest.raises(ValueError, match="k >= 1"):
        _speculate(fast_hf_pair, code_prompt, 0, 0)
    target = FastLlama(fast_hf_pair[0], max_len=48)
    draft = GreedyLoop(FastLlama(fast_hf_pair[1], max_len=48))
    with pytest.raises(ValueError, match="needs caches of"):
        speculative_generate(target, draft, code_prompt, N_NEW, 3)


# ---- the one-graph pass (bench/inproc/fast_spec_graph.py): the same algorithm with the verdict on the device ----

def _pass_graph(fast_hf_pair, k: int, propose=None, max_len: int = MAX_LEN) -> SpeculativePassGraph:
    target = FastLlama(fast_hf_pair[0], max_len=max_len)
    return SpeculativePassGraph(target, GreedyLoop(FastLlama(fast_hf_pair[1], max_len=max_len), propose=propose), k)


@pytest.mark.parametrize("k", [1, 3, 6])
def test_pass_graph_equals_plain_and_the_host_loop(fast_hf_pair, code_prompt, plain, k) -> None:
    out, stats = _pass_graph(fast_hf_pair, k).generate(code_prompt, N_NEW)
    assert out == plain
    # the host-verdict loop runs the same passes: the same proposals accepted, pass by pass
    _, host = _speculate(fast_hf_pair, code_prompt, k, 0)
    assert (stats.passes, stats.accepted, stats.checked, stats.restarts) == (host.passes, host.accepted, host.checked,
                                                                             host.restarts)
    assert stats.accepted > 0 and stats.drafted == k * stats.passes


def test_pass_graph_at_controlled_acceptance(fast_hf_pair, code_prompt, plain) -> None:
    full = plain_generate(GreedyLoop(FastLlama(fast_hf_pair[0], max_len=MAX_LEN)), code_prompt, N_NEW + 12)
    ref = _reference(code_prompt, full)
    out, stats = _pass_graph(fast_hf_pair, 3, ControlledAcceptance(ref, alpha=1.0, vocab=4096)).generate(code_prompt, N_NEW)
    assert out == plain and stats.restarts == 0 and stats.acceptance_rate == 1.0
    assert stats.passes == -(-(N_NEW - 1) // 4)  # k + 1 tokens per pass after the prefill's first
    out, stats = _pass_graph(fast_hf_pair, 3, ControlledAcceptance(ref, alpha=0.0, vocab=4096)).generate(code_prompt, N_NEW)
    assert out == plain and stats.accepted == 0 and stats.passes == N_NEW - 1 == stats.restarts
    # a second generation on the same object starts clean
    graph = _pass_graph(fast_hf_pair, 4, ControlledAcceptance(ref, alpha=0.6, vocab=4096, seed=3))
    first, s1 = graph.generate(code_prompt, N_NEW)
    second, s2 = graph.generate(code_prompt, N_NEW)
    assert first == second == plain and 0 < s1.accepted < s1.checked and s2.passes > 0  # coins differ: a counter


def test_pass_graph_refuses_what_it_cannot_do(fast_hf_pair, code_prompt) -> None:
    with pytest.raises(ValueError, match="k >= 1"):
        _pass_graph(fast_hf_pair, 0)
    with pytest.raises(ValueError, match="needs caches of"):
        _pass_graph(fast_hf_pair, 3, max_len=48).generate(code_prompt, N_NEW)
