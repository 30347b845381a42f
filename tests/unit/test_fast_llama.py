"""The GPU fast path's lean Llama forward computes HF's function (run eagerly on the CPU here).

A small random Llama with the Llama-3 rope scaling and grouped KV heads: FastLlama must give
HF's logits for a prefill, for one-token decode steps and for a multi-token verify pass over
its static cache, and a "rollback" (re-writing positions already written) must leave it as a
fresh prefill would: entries past a sequence's position are masked, then overwritten.
With int8 weights (a draft's option) the logits stay close to the unquantised ones.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from app.runners.lean_llama import FastLlama, Int8Weight, _int8_gemv, _int8_matmul, quantize_int8

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


@pytest.mark.parametrize("weights", ["bf16", "int8"])
def test_last_only_gives_the_last_rows_logits_and_the_same_cache(hf_model: LlamaForCausalLM, weights: str) -> None:
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 97, (24,), generator=g).tolist()
    full, last = FastLlama(hf_model, max_len=64, weights=weights), FastLlama(hf_model, max_len=64, weights=weights)
    _run(full, ids[:20], 0), _run(last, ids[:20], 0)
    pair, pos = torch.tensor([ids[20:22]]), torch.tensor([[20, 21]])  # a draft's 2-token step
    want = full.forward(pair, pos)  # [1, 2, vocab]
    got = last.forward(pair, pos, last_only=True)  # [1, 1, vocab]
    assert got.shape == (1, 1, 97)
    torch.testing.assert_close(got, want[:, -1:], atol=TOL, rtol=TOL)
    # both wrote K/V for both positions: the next step agrees
    torch.testing.assert_close(_run(last, ids[22:24], 22), _run(full, ids[22:24], 22), atol=TOL, rtol=TOL)


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
    with pytest.raises(ValueError, match="pick 'bf16', 'int8' or 'int8_layers'"):
        FastLlama(hf_model, weights="int4")  # type: ignore[arg-type]


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


def test_int8_round_trip_is_within_half_a_scale() -> None:
    g = torch.Generator().manual_seed(6)
    for dtype in (torch.float32, torch.bfloat16):
        w = (torch.randn(48, 80, generator=g) * torch.logspace(-3, 1, 48).view(-1, 1)).to(dtype)  # [out, in]
        w[5] = 0  # an all-zero row (the benches zero o_proj/down_proj)
        q, scale = quantize_int8(w)
        assert q.dtype == torch.int8 and q.shape == w.shape and scale.shape == (48,) and scale.dtype == dtype
        assert int(q.abs().max()) <= 127 and (q.abs().amax(dim=1)[torch.arange(48) != 5] == 127).all()
        err = (w.float() - q.float() * scale.float().view(-1, 1)).abs()  # [out, in]
        assert (err <= scale.float().view(-1, 1) / 2).all()
        assert (q[5] == 0).all()


def test_int8_gemv_form_equals_gpt_fast_form() -> None:
    """The reduction that CUDA compiles (a few rows) computes gpt-fast's `(x @ q.T) * scale`."""
    g = torch.Generator().manual_seed(7)
    q, scale = quantize_int8(torch.randn(40, 64, generator=g))
    for rows in (1, 2, 5):
        x = torch.randn(rows, 64, generator=g)
        want = _int8_matmul(x, q, scale)  # [rows, 40]
        got = _int8_gemv(x, q, scale)
        assert got.shape == (rows, 40) and got.is_contiguous()
        torch.testing.assert_close(got, want, atol=TOL, rtol=TOL)


@pytest.mark.parametrize("weights", ["int8", "int8_layers"])
def test_int8_weights_stay_close_to_the_model(hf_model: LlamaForCausalLM, weights: str) -> None:
    """A draft's int8 option: not HF's function any more, but close to it (the target's
    verification keeps the output exact; only acceptance can move). Prefill (the dequantise +
    matmul path) and decode steps (the few-row path) both."""
    g = torch.Generator().manual_seed(8)
    ids = torch.randint(0, 97, (40,), generator=g).tolist()
    fast = FastLlama(hf_model, max_len=64, weights=weights)  # type: ignore[arg-type]
    assert isinstance(fast.layers[0]["wqkv"], Int8Weight)
    assert isinstance(fast.lm_head, Int8Weight) == (weights == "int8")
    ref = _hf_logits(hf_model, ids)  # [40, vocab]
    got = torch.cat([_run(fast, ids[:32], 0)] + [_run(fast, [ids[p]], p) for p in range(32, 40)])  # [40, vocab]
    # per-row int8 moves each weight by <= scale/2 (~0.4% of the row's max): ~1% on these logits
    assert float((got - ref).norm() / ref.norm()) < 0.03
    assert float((got.argmax(-1) == ref.argmax(-1)).float().mean()) >= 0.9
    # half the bytes per weight read, or a quarter for fp32 (scales and norms aside)
    assert fast.weight_bytes_per_step() < 0.45 * FastLlama(hf_model, max_len=64).weight_bytes_per_step()


def test_a_few_rows_decode_alike_with_either_attention(hf_model: LlamaForCausalLM) -> None:
    """Four sequences at different lengths in one FastLlama, one decode step for all (the branching
    draft's step): grouped attention over the batch gives SDPA's logits."""
    g = torch.Generator().manual_seed(9)
    out = {}
    for attention in ("sdpa", "grouped"):
        fast = FastLlama(hf_model, max_batch=4, max_len=64, attention=attention)
        ids = torch.randint(0, 97, (4, 20), generator=g.manual_seed(9))
        fast.forward(ids, torch.arange(20).expand(4, 20))  # prefill all four rows
        tok = torch.randint(0, 97, (4, 1), generator=g)
        pos = torch.tensor([[20], [12], [17], [5]])  # each row decodes at its own position
        out[attention] = fast.forward(tok, pos, last_only=True)
    torch.testing.assert_close(out["grouped"], out["sdpa"], atol=TOL, rtol=TOL)
