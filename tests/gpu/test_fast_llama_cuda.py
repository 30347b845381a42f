"""On CUDA: a captured CUDA graph replays exactly what the eager forward computes (bf16), for a
decode width and a verify width, including the in-place static-cache writes. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_graph_replay_equals_eager() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from app.runners.lean_llama import FastLlama

    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to("cuda", torch.bfloat16).eval()
    prompt = torch.randint(0, 512, (1, 32), device="cuda")
    eager, graphed = FastLlama(model, max_len=128), FastLlama(model, max_len=128)
    fused = FastLlama(model, max_len=128, compile_elementwise=True, attention="grouped")
    for fast in (eager, graphed, fused):
        fast.forward(prompt, torch.arange(32, device="cuda").view(1, -1))
    for fast in (graphed, fused):
        fast.capture(1)
        fast.capture(5)
    for width, start in ((1, 32), (5, 33), (1, 38)):
        tokens = torch.randint(0, 512, (1, width), device="cuda")
        positions = torch.arange(start, start + width, device="cuda").view(1, -1)
        want = eager.forward(tokens, positions).clone()
        got = graphed.run(tokens, positions).clone()
        assert (width, 1) in [(w, b) for (b, w) in graphed.graphs]
        torch.testing.assert_close(got, want, atol=0, rtol=0)
        # the GPU benches' configuration (Inductor-fused ops, in-place cache writes) inside a graph:
        # same function up to bf16 rounding
        torch.testing.assert_close(fused.run(tokens, positions).float(), want.float(), atol=0.1, rtol=0.05)


# 9-16: a draft step of 8 sequences feeding 2 tokens each; 17-64: chunks of 16 rows (32 sequences)
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 12, 16, 17, 40, 64])
@pytest.mark.parametrize("n,k", [(40, 96), (3072, 2048), (2048, 8192), (33, 300)])
def test_triton_int8_gemv_equals_the_dequantised_matmul(m: int, n: int, k: int) -> None:
    from app.runners.lean_llama import _int8_matmul, quantize_int8
    from app.runners.kernels.int8_gemv import int8_gemv

    torch.manual_seed(0)
    qw = quantize_int8(torch.randn(n, k, device="cuda", dtype=torch.bfloat16))
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    ref = _int8_matmul(x, qw.q, qw.scale).float()
    got = int8_gemv(x, qw.q, qw.scale).float()
    assert got.shape == (m, n)
    assert (got - ref).abs().max().item() <= 1e-2 * ref.abs().max().item()  # bf16 rounding of the output


def test_every_pinned_block_config_gives_the_dequantised_matmul() -> None:
    """app/runners/kernels/int8_gemv.py launches the pinned 1B shapes with fixed block configs (no autotuning): each must
    still compute the matmul (a config only changes the speed), and an unpinned shape still autotunes."""
    from app.runners.lean_llama import _int8_matmul, quantize_int8
    from app.runners.kernels.int8_gemv import H200_1B_COLD, H200_1B_SPLIT_K, PINNED, launch

    # split-K pins take over some shapes (tests/gpu/test_int8_split_k_cuda.py); the unsplit ones stay the fallback
    assert {**H200_1B_COLD, **H200_1B_SPLIT_K}.items() <= PINNED.items()
    torch.manual_seed(0)
    for (n, k, m), config in H200_1B_COLD.items():
        qw = quantize_int8(torch.randn(n, k, device="cuda", dtype=torch.bfloat16))
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        ref = _int8_matmul(x, qw.q, qw.scale).float()
        got = torch.empty((m, n), device="cuda", dtype=torch.bfloat16)
        launch(x, qw.q, qw.scale, got, config)
        got = got.float()
        assert (got - ref).abs().max().item() <= 1e-2 * ref.abs().max().item(), (n, k, m, config)
    assert (40, 96, 1) not in PINNED  # test_triton_int8_gemv_equals_the_dequantised_matmul covers autotuning


def test_the_pins_past_eight_rows_give_the_dequantised_matmul() -> None:
    """9-16 rows (a draft step of 8 sequences feeding 2 tokens each) run the 1B shapes' split-K pins on
    16 padded rows, as 3-8 rows do: twice each, the atomic workspace (MAX_ROWS rows) reused."""
    from app.runners.lean_llama import _int8_matmul, quantize_int8
    from app.runners.kernels.int8_gemv import MAX_ROWS, PINNED, launch

    assert MAX_ROWS >= 16
    torch.manual_seed(0)
    for n, k in [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192), (128256, 2048)]:
        qw = quantize_int8(torch.randn(n, k, device="cuda", dtype=torch.bfloat16))
        for m in (9, 13, 16):
            assert (n, k, m) in PINNED
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = _int8_matmul(x, qw.q, qw.scale).float()
            for _ in range(2):
                y = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
                launch(x, qw.q, qw.scale, y)
                assert (y.float() - ref).abs().max().item() <= 1e-2 * ref.abs().max().item(), (n, k, m)


@pytest.mark.parametrize("m", [3, 4, 5, 8])
def test_every_few_row_block_config_gives_the_dequantised_matmul(m: int) -> None:
    """The 3-8 row kernel has two bodies (a reduction for thin blocks, tl.dot on 16 padded rows for
    BLOCK_N >= 16): every candidate config, as a pin would launch it, must compute the matmul."""
    from app.runners.lean_llama import _int8_matmul, quantize_int8
    from app.runners.kernels.int8_gemv import launch
    from bench.gpu_draft_step import ROWS_CANDIDATES

    torch.manual_seed(0)
    for n, k in [(2048, 8192), (3072, 2048), (40, 96)]:
        qw = quantize_int8(torch.randn(n, k, device="cuda", dtype=torch.bfloat16))
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        ref = _int8_matmul(x, qw.q, qw.scale).float()
        for config in ROWS_CANDIDATES:
            y = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
            launch(x, qw.q, qw.scale, y, config)
            assert (y.float() - ref).abs().max().item() <= 1e-2 * ref.abs().max().item(), (n, k, m, config)


@pytest.mark.parametrize("P", [20, 32])  # padded to a 32-bucket, and a prompt that fills its bucket
def test_graphed_prefill_equals_eager_prefill(P: int) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from app.runners.lean_llama import FastLlama

    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to("cuda", torch.bfloat16).eval()
    eager, graphed = FastLlama(model, max_len=128), FastLlama(model, max_len=128)
    for first in (True, False):  # the first call captures the bucket's graph, the second replays it
        prompt = torch.randint(0, 512, (1, P), device="cuda")
        want = eager.prefill(prompt, torch.arange(P, device="cuda").view(1, -1))[:, -1]  # [1, vocab]
        got = graphed.prefill_last(prompt)
        assert got.shape == want.shape and list(graphed._prefill_graphs) == [32]
        # a padded prompt is a taller GEMM (cuBLAS may pick another kernel): bf16 rounding apart
        tol = dict(atol=0, rtol=0) if P == 32 else dict(atol=0.1, rtol=0.05)
        torch.testing.assert_close(got.float(), want.float(), **tol)
        # the K/V the decode steps will read: positions 0..P-1 (pads only wrote past P)
        torch.testing.assert_close(graphed.k_cache[:, 0, :P].float(), eager.k_cache[:, 0, :P].float(), **tol)
        torch.testing.assert_close(graphed.v_cache[:, 0, :P].float(), eager.v_cache[:, 0, :P].float(), **tol)


@pytest.mark.parametrize("D,G", [(64, 4), (128, 4), (64, 1)])
def test_in_place_decode_attention_equals_the_masked_softmax(D: int, G: int) -> None:
    """app/runners/kernels/rows_attention.py: one token per sequence against a slice of a position-major cache with more
    rows than in use, each sequence at its own position (0, a block edge, the last slot)."""
    from app.runners.lean_llama import _sdpa_attention
    from app.runners.kernels.rows_attention import decode_attention

    torch.manual_seed(0)
    B, KV, ML = 5, 8, 300
    big_k, big_v = (torch.randn(B + 2, ML, KV, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    kc, vc = big_k[:B], big_v[:B]  # [B, ML, KV, D], as FastLlama slices a layer's cache
    q = torch.randn(B, KV * G, 1, D, device="cuda", dtype=torch.bfloat16)
    pos = torch.tensor([0, 17, 31, 32, ML - 1], device="cuda")
    mask = (torch.arange(ML, device="cuda")[None, :] <= pos[:, None]).view(B, 1, 1, ML)
    want = _sdpa_attention(q.float(), kc.transpose(1, 2).float(), vc.transpose(1, 2).float(), mask)
    got = decode_attention(q, kc, vc, pos).float()
    assert got.shape == want.shape
    assert (got - want).abs().max().item() <= 2e-2


def test_a_few_rows_step_alike_with_in_place_attention() -> None:
    """FastLlama over 5 rows at different positions: decode_attention='triton' gives the matmul path's logits."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from app.runners.lean_llama import FastLlama

    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=2)
    torch.manual_seed(0)
    hf = LlamaForCausalLM(config).to("cuda", torch.bfloat16).eval()
    out = {}
    for attn in ("matmul", "triton"):
        fast = FastLlama(hf, max_batch=5, max_len=96, attention="grouped", decode_attention=attn)
        ids = torch.randint(0, 512, (5, 40), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
        fast.forward(ids, torch.arange(40, device="cuda").expand(5, 40))
        tok = torch.randint(0, 512, (5, 1), device="cuda", generator=torch.Generator("cuda").manual_seed(2))
        pos = torch.tensor([[40], [3], [25], [39], [0]], device="cuda")
        out[attn] = fast.forward(tok, pos, last_only=True).float()
    assert (out["triton"] - out["matmul"]).abs().max().item() <= 5e-2 * out["matmul"].abs().max().item()
