"""Refuse a draft whose tokenizer does not speak the target's token ids.

Speculation compares token ids: a draft with a different vocabulary or special tokens
would propose ids that mean something else to the target. Checked once at load.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

SPECIALS = ("bos_token", "eos_token", "pad_token", "unk_token")


class IncompatibleDraft(ValueError):
    pass


def check_compatible(target: PreTrainedTokenizerBase, draft: PreTrainedTokenizerBase) -> None:
    """Raise IncompatibleDraft saying what differs and what to pick instead."""
    problems: list[str] = []
    if len(draft) != len(target):
        problems.append(f"draft tokenizer vocab {len(draft)} != target {len(target)}")
    for name in SPECIALS:
        t_tok, d_tok = getattr(target, name), getattr(draft, name)
        t_id, d_id = getattr(target, f"{name}_id"), getattr(draft, f"{name}_id")
        if (t_tok, t_id) != (d_tok, d_id):
            problems.append(f"{name}: draft {d_tok!r} (id {d_id}) != target {t_tok!r} (id {t_id})")
    if not problems:
        t_vocab, d_vocab = target.get_vocab(), draft.get_vocab()
        differing = [tok for tok, idx in t_vocab.items() if d_vocab.get(tok) != idx]
        if differing:
            problems.append(
                f"{len(differing)} tokens map to different ids (e.g. {differing[0]!r}: "
                f"target {t_vocab[differing[0]]}, draft {d_vocab.get(differing[0])})"
            )
    if problems:
        raise IncompatibleDraft(
            "draft and target tokenizers differ: " + "; ".join(problems)
            + ". Pick a draft of the same model family that shares the target's tokenizer "
            "(e.g. Llama-3.2-1B for Llama-3.1-8B, Qwen2.5-0.5B for Qwen2.5-7B), or use proposer: ngram."
        )
