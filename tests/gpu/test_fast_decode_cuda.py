"""On CUDA: the graph-captured greedy loops give plain greedy output, sequentially and overlapped
(draft on a second GPU when there is one), and the captured proposer really follows alpha.
The embedded pair in float32. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

N_NEW, MAX_LEN = 64, 200


def _pair(draft_device: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from app.fast_llama import FastLlama

    load = lambda p, d: AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).to(d).eval()  # noqa: E731
    tok = AutoTokenizer.from_pretrained("models/target")
    prompt = torch.tensor([tok("def read_config(path):\n", add_special_tokens=False)["input_ids"]], device="cuda:0")
    target = FastLlama(load("models/target", "cuda:0"), max_len=MAX_LEN)
    for w in range(1, 9):
        target.capture(w)
    return target, FastLlama(load("models/draft", draft_device), max_len=MAX_LEN), prompt


@pytest.mark.parametrize("overlap_steps", [0, 3])
def test_speculative_equals_plain_on_cuda(overlap_steps: int) -> None:
    from app.fast_decode import ControlledAcceptance, GreedyLoop, plain_generate, speculative_generate

    draft_device = "cuda:1" if overlap_steps and torch.cuda.device_count() > 1 else "cuda:0"
    target, draft_model, prompt = _pair(draft_device)
    plain = plain_generate(GreedyLoop(target), prompt, N_NEW + 16)
    out, stats = speculative_generate(target, GreedyLoop(draft_model), prompt, N_NEW, 4, overlap_steps=overlap_steps)
    assert out == plain[:N_NEW]
    assert stats.accepted > 0
    ref = torch.zeros(MAX_LEN, dtype=torch.long)
    ref[prompt.shape[1]: prompt.shape[1] + len(plain)] = torch.tensor(plain)
    propose = ControlledAcceptance(ref.to(draft_device), alpha=1.0, vocab=4096)
    loop = GreedyLoop(draft_model, propose)
    out, stats = speculative_generate(target, loop, prompt, N_NEW, 4, overlap_steps=overlap_steps)
    assert out == plain[:N_NEW] and stats.acceptance_rate == 1.0
    propose.reseed(0.0)  # in place: the captured graph must see it
    out, stats = speculative_generate(target, loop, prompt, N_NEW, 4, overlap_steps=overlap_steps)
    assert out == plain[:N_NEW] and stats.accepted == 0
