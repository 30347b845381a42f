"""A pass pads every row to its longest input (kv_cache.pack); `ModelRunner.forward(max_padding=)`
splits rows by input length instead of padding past a bound, with the same logits and caches, and
reports the tokens each forward computed (the engine's cost curve learns time against them)."""

from __future__ import annotations

import torch

from app.kv_cache import SequenceKV
from app.model_runner import length_groups


def test_length_groups_split_only_past_the_padding_bound() -> None:
    rows, lengths = [10, 11, 12, 13], [2, 20, 2, 1]
    assert length_groups(rows, lengths, None) == [rows]
    # shortest first; the 20-token row would pad the three short ones by 18 + 18 + 19 = 55 tokens
    assert length_groups(rows, lengths, 64) == [[13, 10, 12, 11]]
    assert length_groups(rows, lengths, 54) == [[13, 10, 12], [11]]
    assert length_groups(rows, [1, 2, 2, 2], 0) == [[10], [11, 12, 13]]
    assert length_groups([7], [100], 0) == [[7]]


def _cached(runner, prompts: list[list[int]]) -> list[SequenceKV]:
    caches = []
    for p in prompts:
        kv = SequenceKV()
        runner.forward([kv], [p])
        caches.append(kv)
    return caches


def test_split_pass_matches_the_padded_one(draft_runner, encode) -> None:
    prompts = [encode(p) for p in ("import os\n", "def f(x):\n    return", "class A:\n    pass\n", "x = [")]
    # one row catching up by 14 tokens among rows that feed 1-2 tokens
    inputs = [[40, 41], list(range(100, 114)), [50], [60, 61]]
    padded, split = _cached(draft_runner, prompts), _cached(draft_runner, prompts)
    want = draft_runner.forward(padded, inputs)
    assert draft_runner.last_padded_tokens == 4 * 14
    got = draft_runner.forward(split, inputs, max_padding=8)
    assert draft_runner.last_padded_tokens == 3 * 2 + 14  # the short rows apart from the long one
    for g, w, a, b in zip(got, want, split, padded):
        assert g.shape == w.shape
        torch.testing.assert_close(g, w, atol=1e-4, rtol=0)
        assert a.token_ids == b.token_ids
        for ka, kb in zip(a.keys, b.keys):
            torch.testing.assert_close(ka, kb, atol=1e-5, rtol=0)
