"""Train the embedded draft/target pair on the Python standard library's sources.

No model hub is reachable, so specserve trains its own Llama-architecture pair:
a ~6 M parameter target and a ~1 M parameter draft sharing one byte-level BPE
tokenizer. The draft is distilled from the target (cross-entropy on the data plus
KL to the target's next-token distribution), which is what makes it a useful
proposer: acceptance is agreement with the target, not raw language-model quality.

Two steps, so the slow one can run on a GPU that has no standard library to read:

    python -m app.train_pair prepare --out data/corpus      # CPU, ~1 min: tokenizer + token arrays
    python -m app.train_pair train --data data/corpus --out models/  # GPU minutes, CPU hours

Everything is seeded; the held-out split is a hash of each file's relative path,
so it is the same on every machine with the same Python version.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

EOS = "<|endoftext|>"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
HELDOUT_PERCENT = 5


@dataclass(frozen=True)
class PairShape:
    """Sizes of the two models (Llama architecture, tied embeddings)."""

    vocab_size: int = 4096
    target_hidden: int = 256
    target_layers: int = 6
    target_heads: int = 4
    target_ffn: int = 768
    draft_hidden: int = 128
    draft_layers: int = 3
    draft_heads: int = 2
    draft_ffn: int = 384
    max_positions: int = 2048


def stdlib_files(stdlib_dir: Path | None = None) -> tuple[list[Path], list[Path]]:
    """(train, heldout) `.py` files of the standard library, site-packages excluded."""
    root = Path(stdlib_dir or sysconfig.get_paths()["stdlib"])
    train: list[Path] = []
    heldout: list[Path] = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if "site-packages" in rel or "dist-packages" in rel:
            continue
        bucket = int(hashlib.sha256(rel.encode()).hexdigest(), 16) % 100
        (heldout if bucket < HELDOUT_PERCENT else train).append(path)
    return train, heldout


def read_text(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None  # a few stdlib test files are deliberately not UTF-8


def train_tokenizer(texts: list[str], vocab_size: int):
    """Byte-level BPE (GPT-2 style) with one special token used as BOS, EOS and PAD."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS, "<|user|>", "<|assistant|>", "<|system|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=True,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=EOS, eos_token=EOS, pad_token=EOS, unk_token=None
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = PairShape.max_positions
    return fast


def encode(tokenizer, texts: list[str]) -> np.ndarray:
    """All texts as one uint16 stream, each file followed by EOS."""
    eos = tokenizer.eos_token_id
    chunks: list[np.ndarray] = []
    for text in tqdm(texts, desc="tokenize", unit="file"):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        chunks.append(np.asarray(ids + [eos], dtype=np.uint16))
    return np.concatenate(chunks)


def prepare(out: Path, vocab_size: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    train_files, heldout_files = stdlib_files()
    train_texts = [t for t in map(read_text, train_files) if t]
    heldout_texts = [t for t in map(read_text, heldout_files) if t]
    tokenizer = train_tokenizer(train_texts, vocab_size)
    tokenizer.save_pretrained(out / "tokenizer")
    train_ids = encode(tokenizer, train_texts)
    heldout_ids = encode(tokenizer, heldout_texts)
    np.savez_compressed(out / "tokens.npz", train=train_ids, heldout=heldout_ids)
    (out / "heldout_files.json").write_text(
        json.dumps([str(p) for p in heldout_files], indent=0)
    )
    print(
        f"{len(train_texts)} train files -> {len(train_ids):,} tokens; "
        f"{len(heldout_texts)} held-out files -> {len(heldout_ids):,} tokens; saved to {out}"
    )


def llama_config(shape: PairShape, hidden: int, layers: int, heads: int, ffn: int, tok):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=shape.vocab_size,
        hidden_size=hidden,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=shape.max_positions,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        rope_theta=10000.0,
    )


def batches(tokens: np.ndarray, batch: int, seq: int, steps: int, seed: int, device: str):
    """Random windows of seq+1 tokens: [batch, seq+1] int64 per step, seeded."""
    rng = np.random.default_rng(seed)
    data = torch.from_numpy(tokens.astype(np.int64))
    for _ in range(steps):
        starts = rng.integers(0, len(tokens) - seq - 1, size=batch)
        idx = torch.from_numpy(starts)[:, None] + torch.arange(seq + 1)[None, :]
        yield data[idx].to(device, non_blocking=True)


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def heldout_loss(model, tokens: np.ndarray, seq: int, device: str, amp: bool) -> float:
    model.eval()
    losses = []
    for window in batches(tokens, 16, seq, 8, seed=1234, device=device):
        with torch.autocast(device_type=device.split(":")[0], dtype=torch.bfloat16, enabled=amp):
            logits = model(window[:, :-1]).logits.float()
        losses.append(F.cross_entropy(logits.flatten(0, 1), window[:, 1:].flatten()).item())
    model.train()
    return float(np.mean(losses))


def fit(
    model,
    tokens: np.ndarray,
    heldout: np.ndarray,
    *,
    name: str,
    steps: int,
    batch: int,
    seq: int,
    lr: float,
    seed: int,
    device: str,
    teacher=None,
    distill_weight: float = 0.0,
) -> dict[str, float]:
    """AdamW with warmup + cosine; optional KL distillation from a frozen teacher."""
    amp = device.startswith("cuda")
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, betas=(0.9, 0.95))
    bar = tqdm(
        enumerate(batches(tokens, batch, seq, steps, seed, device)), total=steps, desc=name
    )
    for step, window in bar:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, lr, warmup=max(1, steps // 50))
        inputs, labels = window[:, :-1], window[:, 1:]  # [batch, seq] each
        with torch.autocast(device_type=device.split(":")[0], dtype=torch.bfloat16, enabled=amp):
            logits = model(inputs).logits.float()  # [batch, seq, vocab]
            loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
            if teacher is not None:
                with torch.no_grad():
                    t_logp = F.log_softmax(teacher(inputs).logits.float(), dim=-1)
                kl = F.kl_div(
                    F.log_softmax(logits, dim=-1), t_logp, log_target=True, reduction="batchmean"
                ) / seq
                loss = (1 - distill_weight) * loss + distill_weight * kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 50 == 0:
            bar.set_postfix(loss=f"{loss.item():.3f}")
    return {"heldout_loss": heldout_loss(model, heldout, seq, device, amp)}


def train(
    data: Path,
    out: Path,
    *,
    target_steps: int,
    draft_steps: int,
    batch: int,
    seq: int,
    seed: int,
    device: str,
    draft_only: bool = False,
    distill_weight: float = 0.9,
) -> None:
    from transformers import AutoTokenizer, LlamaForCausalLM

    torch.manual_seed(seed)
    shape = PairShape()
    tokenizer = AutoTokenizer.from_pretrained(data / "tokenizer")
    arrays = np.load(data / "tokens.npz")
    train_ids, heldout_ids = arrays["train"], arrays["heldout"]
    if len(tokenizer) != shape.vocab_size:
        raise ValueError(f"tokenizer has {len(tokenizer)} tokens, PairShape expects {shape.vocab_size}")

    report: dict[str, object] = {"seed": seed, "device": device, "train_tokens": int(len(train_ids))}
    if draft_only and (out / "TRAINING.json").exists():
        report = json.loads((out / "TRAINING.json").read_text())
    report.update({"draft_steps": draft_steps, "distill_weight": distill_weight, "batch": batch, "seq": seq})
    t0 = time.time()
    if draft_only:
        # keep the committed target; distill a new draft from it
        target = LlamaForCausalLM.from_pretrained(out / "target", dtype=torch.float32).to(device)
    else:
        target = LlamaForCausalLM(
            llama_config(shape, shape.target_hidden, shape.target_layers, shape.target_heads, shape.target_ffn, tokenizer)
        ).to(device)
        report["target"] = fit(
            target, train_ids, heldout_ids, name="target", steps=target_steps, batch=batch,
            seq=seq, lr=3e-3, seed=seed, device=device,
        )
        report["target_steps"] = target_steps
    target.eval().requires_grad_(False)

    draft = LlamaForCausalLM(
        llama_config(shape, shape.draft_hidden, shape.draft_layers, shape.draft_heads, shape.draft_ffn, tokenizer)
    ).to(device)
    report["draft"] = fit(
        draft, train_ids, heldout_ids, name="draft (distilled)", steps=draft_steps, batch=batch,
        seq=seq, lr=4e-3, seed=seed + 1, device=device, teacher=target, distill_weight=distill_weight,
    )
    report["params"] = {
        "target": sum(p.numel() for p in target.parameters()),
        "draft": sum(p.numel() for p in draft.parameters()),
    }
    report["train_seconds"] = round(time.time() - t0, 1)
    for name, model in (("draft", draft),) if draft_only else (("target", target), ("draft", draft)):
        # float16 keeps 10 mantissa bits (bf16 has 7) and halves the committed size;
        # the runner upcasts to float32 on CPU.
        model.to("cpu", dtype=torch.float16).save_pretrained(out / name)
        tokenizer.save_pretrained(out / name)
    (out / "TRAINING.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="train the tokenizer and tokenize the stdlib")
    p.add_argument("--out", type=Path, default=Path("data/corpus"))
    p.add_argument("--vocab-size", type=int, default=PairShape.vocab_size)
    t = sub.add_parser("train", help="train target, then distill the draft")
    t.add_argument("--data", type=Path, default=Path("data/corpus"))
    t.add_argument("--out", type=Path, default=Path("models"))
    t.add_argument("--target-steps", type=int, default=3000)
    t.add_argument("--draft-steps", type=int, default=2000)
    t.add_argument("--batch", type=int, default=64)
    t.add_argument("--seq", type=int, default=512)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    t.add_argument("--draft-only", action="store_true", help="keep --out/target, distill a new draft from it")
    t.add_argument("--distill-weight", type=float, default=0.9)
    args = parser.parse_args(argv)
    if args.cmd == "prepare":
        prepare(args.out, args.vocab_size)
    else:
        train(
            args.data, args.out, target_steps=args.target_steps, draft_steps=args.draft_steps,
            batch=args.batch, seq=args.seq, seed=args.seed, device=args.device,
            draft_only=args.draft_only, distill_weight=args.distill_weight,
        )


if __name__ == "__main__":
    main()
