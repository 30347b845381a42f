"""On CUDA: the graph-captured greedy loops give plain greedy output, sequentially and overlapped
(draft on a second GPU when there is one), and the captured proposer really follows alpha.
The embedded pair in float32. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

N_NEW = 64


@pytest.mark.parametrize("overlap_steps", [0, 3])
def test_speculative_equals_plain_on_cuda(overlap_steps: int, fast_pair) -> None:
    from bench.inproc.fast_decode import ControlledAcceptance, GreedyLoop, plain_generate, speculative_generate

    draft_device = "cuda:1" if overlap_steps and torch.cuda.device_count() > 1 else "cuda:0"
    target, draft_model, prompt = fast_pair(draft_device)
    plain = plain_generate(GreedyLoop(target), prompt, N_NEW + 16)
    out, stats = speculative_generate(target, GreedyLoop(draft_model), prompt, N_NEW, 4, overlap_steps=overlap_steps)
    assert out == plain[:N_NEW]
    assert stats.accepted > 0
    ref = torch.zeros(target.max_len, dtype=torch.long)
    ref[prompt.shape[1]: prompt.shape[1] + len(plain)] = torch.tensor(plain)
    propose = ControlledAcceptance(ref.to(draft_device), alpha=1.0, vocab=4096)
    loop = GreedyLoop(draft_model, propose)
    out, stats = speculative_generate(target, loop, prompt, N_NEW, 4, overlap_steps=overlap_steps)
    assert out == plain[:N_NEW] and stats.acceptance_rate == 1.0
    propose.reseed(0.0)  # in place: the captured graph must see it
    out, stats = speculative_generate(target, loop, prompt, N_NEW, 4, overlap_steps=overlap_steps)
    assert out == plain[:N_NEW] and stats.accepted == 0


def test_one_graph_pass_equals_plain_on_cuda(fast_pair) -> None:
    """bench/inproc/fast_spec_graph.py: draft steps, verify and the verdict captured as one graph per pass."""
    from bench.inproc.fast_decode import ControlledAcceptance, GreedyLoop, plain_generate, speculative_generate
    from bench.inproc.fast_spec_graph import SpeculativePassGraph

    target, draft_model, prompt = fast_pair("cuda:0")
    plain = plain_generate(GreedyLoop(target), prompt, N_NEW + 16)
    out, stats = SpeculativePassGraph(target, GreedyLoop(draft_model), 4).generate(prompt, N_NEW)
    _, host = speculative_generate(target, GreedyLoop(draft_model), prompt, N_NEW, 4)
    assert out == plain[:N_NEW] and stats.accepted > 0
    assert (stats.passes, stats.accepted) == (host.passes, host.accepted)
    ref = torch.zeros(target.max_len, dtype=torch.long)
    ref[prompt.shape[1]: prompt.shape[1] + len(plain)] = torch.tensor(plain)
    propose = ControlledAcceptance(ref.to("cuda:0"), alpha=1.0, vocab=4096)
    graph = SpeculativePassGraph(target, GreedyLoop(draft_model, propose), 3)
    out, stats = graph.generate(prompt, N_NEW)
    assert out == plain[:N_NEW] and stats.acceptance_rate == 1.0
    propose.reseed(0.0)  # in place: the captured pass must see it
    out, stats = graph.generate(prompt, N_NEW)
    assert out == plain[:N_NEW] and stats.accepted == 0 and stats.passes == N_NEW - 1


def test_int8_draft_loop_in_a_graph_equals_its_eager_steps() -> None:
    """An int8-weight draft (FastLlama(weights="int8"): Inductor-compiled int8 GEMV kernels) runs
    its greedy loop inside captured CUDA graphs, 1- and 2-token steps, and proposes exactly the
    tokens its own eager forward picks."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from bench.inproc.fast_decode import GreedyLoop
    from app.runners.lean_llama import FastLlama, Int8Weight

    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to("cuda", torch.bfloat16).eval()
    fast = FastLlama(model, max_len=128, compile_elementwise=True, attention="grouped", weights="int8")
    assert isinstance(fast.lm_head, Int8Weight)
    prompt = torch.randint(0, 512, (1, 20), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    P, n = prompt.shape[1], 24
    # eager: the prompt, then a 2-token step (the draft's catch-up after a full accept), then 1-token steps
    fast.prefill(prompt, torch.arange(P, device="cuda").view(1, -1))
    tok = torch.tensor([[5, 7]], device="cuda")
    eager: list[int] = []
    for step in range(n):
        pos = torch.arange(P, P + 2, device="cuda").view(1, -1) if step == 0 else torch.tensor([[P + 1 + step]], device="cuda")
        tok = fast.forward(tok, pos)[:, -1:].argmax(-1)  # [1, 1]
        eager.append(int(tok))
    loop = GreedyLoop(fast)  # captures its 1- and 2-token steps
    assert set(loop._graphs) == {1, 2}
    loop.prefill(prompt)
    loop.reset([5, 7], P)
    loop.advance(n)
    assert loop.read(P + 2, P + 2 + n).tolist() == eager
