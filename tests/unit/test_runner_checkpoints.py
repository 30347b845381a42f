"""The runner serves Llama 3.x and Qwen2.5 checkpoints as a user downloads them, with HF's logits.

Tiny random checkpoints of both families are built with transformers and saved as sharded
safetensors (the layout of a real download); the runner loads the directory and its lean
forward must give HF's own logits for a prefill, one-token decode steps and a multi-token verify
pass, for two sequences of different lengths sharing one batched pass. Llama: grouped KV heads,
llama3 rope scaling, untied embeddings; Qwen2: q/k/v biases, tied embeddings.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from app.config import PROJECT_ROOT, ModelSpec
from app.runners.model_runner import ModelRunner

TOL = 2e-4  # float32 on the CPU: same math, different op order
VOCAB = 4096  # the embedded tokenizer's, copied into each checkpoint


def _llama() -> LlamaForCausalLM:
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=8,
        num_key_value_heads=2, max_position_embeddings=256, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64},
        tie_word_embeddings=False))


def _qwen2() -> Qwen2ForCausalLM:
    return Qwen2ForCausalLM(Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, rope_theta=1000000.0, tie_word_embeddings=True))


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def checkpoint(request, tmp_path_factory) -> Path:
    torch.manual_seed(0)
    model = (_llama if request.param == "llama" else _qwen2)().eval()
    if request.param == "qwen2":
        for layer in model.model.layers:  # HF initialises biases to zero: make them matter
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.5)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path, max_shard_size="100KB")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (PROJECT_ROOT / "models" / "target" / name).exists():
            shutil.copy(PROJECT_ROOT / "models" / "target" / name, path / name)
    assert len(list(path.glob("*.safetensors"))) > 1, "expected a sharded checkpoint"
    return path


def _hf_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0]  # [T, vocab]


def test_runner_gives_hf_logits(checkpoint: Path) -> None:
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    runner = ModelRunner(ModelSpec(path=str(checkpoint), max_context=128), max_seqs=4)
    g = torch.Generator().manual_seed(1)
    a = torch.randint(0, VOCAB, (40,), generator=g).tolist()
    b = torch.randint(0, VOCAB, (25,), generator=g).tolist()
    ref_a, ref_b = _hf_logits(hf, a), _hf_logits(hf, b)
    runner.add("a")
    runner.add("b")
    torch.testing.assert_close(runner.prefill("a", a[:30]), ref_a[29], atol=TOL, rtol=TOL)
    torch.testing.assert_close(runner.prefill("b", b[:20]), ref_b[19], atol=TOL, rtol=TOL)
    for p in range(30, 33):  # one-token decode steps, both rows, different positions
        logits, rows = runner.step(["a", "b"], [[a[p]], [b[p - 10]]])
        torch.testing.assert_close(logits[rows[0], 0], ref_a[p], atol=TOL, rtol=TOL)
        torch.testing.assert_close(logits[rows[1], 0], ref_b[p - 10], atol=TOL, rtol=TOL)
    # a verify pass: 6 tokens for a, 2 for b, in one forward
    logits, rows = runner.step(["a", "b"], [a[33:39], b[23:25]])
    torch.testing.assert_close(logits[rows[0], :6], ref_a[33:39], atol=TOL, rtol=TOL)
    torch.testing.assert_close(logits[rows[1], :2], ref_b[23:25], atol=TOL, rtol=TOL)
    # roll a back past the pass and decode again: HF's logits at that position
    runner.truncate("a", 35)
    logits, rows = runner.step(["a"], [[a[35]]])
    torch.testing.assert_close(logits[rows[0], 0], ref_a[35], atol=TOL, rtol=TOL)


def test_an_unserved_family_is_refused_by_name(tmp_path: Path) -> None:
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="gpt2.*llama, qwen2"):
        ModelRunner(ModelSpec(path=str(tmp_path)), max_seqs=1)
