"""A draft whose tokenizer does not speak the target's ids is refused at load, saying what differs.

Modified tokenizers are built in tmp_path from models/target's tokenizer files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from app.config import PROJECT_ROOT, EngineConfig, ModelSpec
from app.engine.generate import build_engine
from app.runners.loading import load_tokenizer
from app.tokenizer_compat import IncompatibleDraft, check_compatible

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def tokenizer_copy(dst: Path, edit_json=None, edit_config=None) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        shutil.copy(PROJECT_ROOT / "models/target" / name, dst / name)
    for fname, edit in (("tokenizer.json", edit_json), ("tokenizer_config.json", edit_config)):
        if edit is not None:
            data = json.loads((dst / fname).read_text())
            edit(data)
            (dst / fname).write_text(json.dumps(data))
    return dst


def load(path: Path):
    return load_tokenizer(ModelSpec(path=str(path)))


def test_identical_tokenizers_are_compatible(tokenizer, tmp_path):
    check_compatible(tokenizer, load(tokenizer_copy(tmp_path / "same")))
    check_compatible(tokenizer, load_tokenizer(ModelSpec(path="models/draft")))


def test_extra_tokens_change_the_vocab_size(tokenizer, tmp_path):
    def add_tokens(data):
        for i, content in enumerate(["<|tool|>", "<|image|>"]):
            data["added_tokens"].append({"id": 4096 + i, "content": content, "single_word": False, "lstrip": False,
                                         "rstrip": False, "normalized": False, "special": True})

    draft = load(tokenizer_copy(tmp_path / "added", edit_json=add_tokens))
    assert len(draft) == len(tokenizer) + 2
    with pytest.raises(IncompatibleDraft) as err:
        check_compatible(tokenizer, draft)
    msg = str(err.value)
    assert f"vocab {len(tokenizer) + 2} != target {len(tokenizer)}" in msg
    assert "proposer: ngram" in msg  # says what to pick instead


@pytest.mark.parametrize("name", ["eos_token", "pad_token", "bos_token"])
def test_a_different_special_token_is_named(tokenizer, tmp_path, name):
    def change(config):
        config[name] = "<|user|>"

    draft = load(tokenizer_copy(tmp_path / name, edit_config=change))
    assert len(draft) == len(tokenizer)
    with pytest.raises(IncompatibleDraft) as err:
        check_compatible(tokenizer, draft)
    msg = str(err.value)
    assert f"{name}: draft '<|user|>' (id 1) != target '<|endoftext|>' (id 0)" in msg
    assert "vocab" not in msg  # the sizes agree: only the special token is reported


def test_same_size_but_permuted_ids(tokenizer, tmp_path):
    def swap(data):
        vocab = data["model"]["vocab"]
        vocab["!"], vocab['"'] = vocab['"'], vocab["!"]

    draft = load(tokenizer_copy(tmp_path / "swapped", edit_json=swap))
    assert len(draft) == len(tokenizer) and draft.eos_token_id == tokenizer.eos_token_id
    with pytest.raises(IncompatibleDraft, match=r"2 tokens map to different ids"):
        check_compatible(tokenizer, draft)


def test_build_engine_refuses_an_incompatible_draft(tmp_path):
    draft_dir = tmp_path / "draft"
    shutil.copytree(PROJECT_ROOT / "models/draft", draft_dir)

    def change(config):
        config["eos_token"] = "<|system|>"

    tokenizer_copy(draft_dir, edit_config=change)
    config = EngineConfig(target=ModelSpec(path="models/target"), draft=ModelSpec(path=str(draft_dir)))
    with pytest.raises(IncompatibleDraft, match=r"eos_token: draft '<\|system\|>' \(id 3\)"):
        build_engine(config)
    # the unmodified draft loads
    engine = build_engine(EngineConfig(target=ModelSpec(path="models/target"), draft=ModelSpec(path="models/draft")))
    assert engine.proposer is not None
