"""Shared by the CUDA tests: the embedded pair on the GPUs as FastLlama models."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

MAX_LEN = 200
PROMPT = "def read_config(path):\n"


def load_fast_pair(draft_device: str, draft_rows: int = 1, max_len: int = MAX_LEN):
    """(target on cuda:0 with verify graphs for widths 1..8, draft on `draft_device` with
    `draft_rows` cache rows, the prompt's ids `[1, P]` on cuda:0), float32."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from app.runners.lean_llama import FastLlama

    load = lambda p, d: AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).to(d).eval()  # noqa: E731
    tok = AutoTokenizer.from_pretrained("models/target")
    prompt = torch.tensor([tok(PROMPT, add_special_tokens=False)["input_ids"]], device="cuda:0")
    target = FastLlama(load("models/target", "cuda:0"), max_len=max_len)
    for w in range(1, 9):
        target.capture(w)
    draft = FastLlama(load("models/draft", draft_device), max_batch=draft_rows, max_len=max_len)
    return target, draft, prompt


@pytest.fixture(scope="session")
def fast_pair() -> Callable[..., tuple]:
    """`fast_pair(draft_device, draft_rows=1)`: see load_fast_pair."""
    return load_fast_pair
