"""The GPU fast path's lean Llama forward computes HF's function (run eagerly on the CPU here).

A small random Llama with the Llama-3 rope scaling and grouped KV heads: FastLlama must give
HF's logits for a prefill, for one-token decode steps and for a multi-token verify pass over
its static cache, and a "rollback" (re-writing positions already written) must leave it as a
fresh prefill would: entries past a sequence's position are masked, then overwritten.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from app.fast_llama import FastLlama

TOL = 1e-4  # float32 on the CPU: same math, different op order


@pytest.fixture(scope="module")
def hf_model() -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=8,
        num_key_value_heads=2, max_position_embeddings=256, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64},
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def _hf_logits(model: LlamaForCausalLM, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0]  # [T, vocab]


def _run(fast: FastLlama, ids: list[int], start: int) -> torch.Tensor:
    tokens = torch.tensor([ids])
    positions = torch.arange(start, start + len(ids)).view(1, -1)
    return fast.forward(tokens, positions)[0]  # [T, vocab]


@pytest.mark.parametrize("attention", ["sdpa", "grouped"])
def test_prefill_decode_and_verify_match_hf(hf_model: LlamaForCausalLM, attention: str) -> None:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 97, (40,), generator=g).tolist()
    fast = FastLlama(hf_model, max_len=64, attention=attention)
    ref = _hf_logits(hf_model, ids)
    torch.testing.assert_close(_run(fast, ids[:30], 0), ref[:30], atol=TOL, rtol=TOL)  # prefill
    for p in range(30, 34):  # one-token decode steps
        torch.testing.assert_close(_run(fast, [ids[p]], p), ref[p:p + 1], atol=TOL, rtol=TOL)
    torch.testing.assert_close(_run(fast, ids[34:40], 34), ref[34:40], atol=TOL, rtol=TOL)  # verify, 6 wide


@pytest.mark.parametrize("attention", ["sdpa", "grouped"])
def test_rollback_rewrites_positions_as_a_fresh_prefill(hf_model: LlamaForCausalLM, attention: str) -> None:
    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, 97, (20,), generator=g).tolist()
    rejected = torch.randint(0, 97, (5,), generator=g).tolist()
    corrected = torch.randint(0, 97, (5,), generator=g).tolist()
    fast = FastLlama(hf_model, max_len=64, attention=attention)
    _run(fast, prompt, 0)
    _run(fast, rejected, 20)  # a verify pass whose proposals are then rejected
    # the next pass starts again at position 20: stale entries at 20..24 must not leak into it
    got = _run(fast, corrected, 20)
    torch.testing.assert_close(got, _hf_logits(hf_model, prompt + corrected)[20:], atol=TOL, rtol=TOL)


@pytest.mark.parametrize("attention", ["sdpa", "grouped"])
def test_batched_rows_at_different_positions(hf_model: LlamaForCausalLM, attention: str) -> None:
    g = torch.Generator().manual_seed(3)
    a = torch.randint(0, 97, (12,), generator=g).tolist()
    b = torch.randint(0, 97, (12,), generator=g).tolist()
    fast = FastLlama(hf_model, max_batch=2, max_len=64, attention=attention)
    fast.forward(torch.tensor([a[:10], b[:10]]), torch.arange(10).view(1, -1).expand(2, -1))
    # row 0 decodes at position 10, row 1 re-does position 9 (a rollback by one) with b[9]
    tokens = torch.tensor([[a[10]], [b[9]]])
    positions = torch.tensor([[10], [9]])
    out = fast.forward(tokens, positions)  # [2, 1, vocab]
    torch.testing.assert_close(out[0, 0], _hf_logits(hf_model, a[:11])[10], atol=TOL, rtol=TOL)
    torch.testing.assert_close(out[1, 0], _hf_logits(hf_model, b[:10])[9], atol=TOL, rtol=TOL)


def test_bad_options_are_refused(hf_model: LlamaForCausalLM) -> None:
    with pytest.raises(ValueError, match="one of the two"):
        FastLlama(hf_model, compile_elementwise=True, compile_forward="max-autotune-no-cudagraphs")
    with pytest.raises(ValueError, match="pick 'sdpa' or 'grouped'"):
        FastLlama(hf_model, attention="flash")  # type: ignore[arg-type]


def test_compiled_elementwise_path_matches_hf(hf_model: LlamaForCausalLM) -> None:
    """The GPU configuration's fused ops (rope + in-place cache writes, add + norm, masked softmax)
    compiled by Inductor: the cache mutations must land, so later steps still see earlier K/V."""
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 97, (40,), generator=g).tolist()
    fast = FastLlama(hf_model, max_len=64, compile_elementwise=True, attention="grouped")
    ref = _hf_logits(hf_model, ids)
    torch.testing.assert_close(_run(fast, ids[:30], 0), ref[:30], atol=TOL, rtol=TOL)
    for p in range(30, 34):
        torch.testing.assert_close(_run(fast, [ids[p]], p), ref[p:p + 1], atol=TOL, rtol=TOL)
    torch.testing.assert_close(_run(fast, ids[34:40], 34), ref[34:40], atol=TOL, rtol=TOL)
