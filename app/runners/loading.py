"""Loading a Llama-family checkpoint (Llama 3.x, Qwen2.5) the way a user downloads it.

transformers reads the checkpoint directory (config, sharded safetensors, tokenizer); the lean
forward (app/runners/lean_llama.py) then takes the weights and the HF module is dropped. `random_weights`
builds the architecture from the directory's config.json with random weights on the device
instead (benchmarks of 8B-shaped models on a host without a model hub).
"""

from __future__ import annotations

import logging
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from app.config import ModelSpec

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
FAMILIES = ("llama", "qwen2")


def load_tokenizer(spec: ModelSpec) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(spec.resolved_path())


def load_model(spec: ModelSpec) -> PreTrainedModel:
    """The HF module on `spec.device`, in `spec.dtype`, eval mode, no grad."""
    path = spec.resolved_path()
    config = AutoConfig.from_pretrained(path)
    if config.model_type not in FAMILIES:
        raise ValueError(f"{path}: model_type {config.model_type!r} is not served; the lean forward covers "
                         f"{', '.join(FAMILIES)} (Llama 3.x, Qwen2.5)")
    t0 = time.perf_counter()
    dtype = DTYPES[spec.dtype]
    if spec.random_weights:
        torch.manual_seed(0)
        with torch.device(spec.device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        stabilise_random_argmax(model)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        model.to(spec.device)
    model.eval().requires_grad_(False)
    log.info("loaded %s (%s, %s%s) in %.1fs", path, spec.dtype, spec.device,
             ", random weights" if spec.random_weights else "", time.perf_counter() - t0)
    return model


@torch.no_grad()
def stabilise_random_argmax(model: PreTrainedModel) -> None:
    """Random weights make a chaotic function: a one-token pass and a (k+1)-token pass pick different
    argmaxes after tiny rounding differences, so a greedy reference continuation diverges for good
    after the first flip. Zeroing what each layer writes back into the residual stream makes the
    argmax a stable function of the current token; every weight is still read by the same dense
    GEMMs, so a step costs what it would with real weights."""
    for layer in model.model.layers:
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()


def eos_ids(tokenizer: PreTrainedTokenizerBase, model: PreTrainedModel) -> frozenset[int]:
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if isinstance(eos, int):
        ids.add(eos)
    elif eos:
        ids.update(eos)
    return frozenset(ids)
