"""Acceptance of the embedded pair on held-out prompts, split by kind (code vs prose).

    .venv/bin/python -m bench.acceptance [--prompts 12] [--max-tokens 48] [--out bench/out/acceptance.json]

Prompts come from the standard-library files the trainer held out (same hash split):
"code" prompts start at a random line of a held-out module, "prose" prompts are the
opening of one of its docstrings. For k in {2, 4, 6}, greedy and temperature 0.7, the
draft model and the n-gram proposer, it reports acceptance rate (accepted / drafted) and
mean acceptance length (1 + accepted / drafts), as vLLM defines them.
"""

from __future__ import annotations

import argparse
import ast
import json
import random
from pathlib import Path

import torch
from tqdm import tqdm

from app.engine.acceptance import AcceptanceStats
from app.config import ModelSpec
from app.engine.spec_engine import SpecEngine
from app.engine.generate import generate
from app.runners.model_runner import ModelRunner
from app.proposers import DraftModelProposer, NgramProposer, Proposer
from app.protocol.sampling_params import SamplingParams
from app.train_pair import read_text, stdlib_files


def heldout_prompts(tokenizer, n: int, seed: int, prompt_tokens: int = 64) -> dict[str, list[list[int]]]:
    rng = random.Random(seed)
    _, heldout = stdlib_files()
    texts = [t for t in map(read_text, heldout) if t and len(t) > 2000]
    code: list[list[int]] = []
    prose: list[list[int]] = []
    for text in rng.sample(texts, len(texts)):
        lines = text.splitlines(keepends=True)
        if len(code) < n:
            start = rng.randrange(len(lines) // 4, max(len(lines) // 4 + 1, len(lines) - 40))
            ids = tokenizer("".join(lines[start:]), add_special_tokens=False)["input_ids"][:prompt_tokens]
            if len(ids) == prompt_tokens:
                code.append(ids)
        if len(prose) < n:
            doc = _a_docstring(text, rng)
            if doc:
                ids = tokenizer('"""' + doc, add_special_tokens=False)["input_ids"][:24]
                prose.append(ids)
        if len(code) >= n and len(prose) >= n:
            break
    return {"code": code, "prose": prose}


def _a_docstring(text: str, rng: random.Random) -> str | None:
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return None
    docs = [
        d for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))
        and (d := ast.get_docstring(node, clean=False)) and len(d) > 200
    ]
    return rng.choice(docs) if docs else None


def measure(engine: SpecEngine, prompts: list[list[int]], sampling: SamplingParams, k: int) -> AcceptanceStats:
    total = AcceptanceStats()
    for i, ids in enumerate(prompts):
        params = sampling.model_copy(update={"seed": i})
        r = generate(engine, ids, params, k)
        total.num_drafts += r.num_drafts
        total.num_draft_tokens += r.drafted_tokens
        total.num_accepted_tokens += r.accepted_tokens
    return total


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("bench/out/acceptance.json"))
    args = parser.parse_args()
    torch.set_num_threads(2)
    runner = ModelRunner(ModelSpec(path="models/target"), 32)
    proposers: dict[str, Proposer] = {
        "draft": DraftModelProposer(ModelSpec(path="models/draft")),
        "ngram": NgramProposer(1, 4),
    }
    prompts = heldout_prompts(runner.tokenizer, args.prompts, args.seed)
    rows = []
    grid = [
        (kind, proposer, k, temp)
        for kind in ("code", "prose")
        for proposer in proposers
        for temp in (0.0, 0.7)
        for k in (2, 4, 6)
    ]
    for kind, proposer, k, temp in tqdm(grid, desc="acceptance"):
        engine = SpecEngine(runner, proposers[proposer], max_k=8)
        sampling = SamplingParams(temperature=temp, max_tokens=args.max_tokens, ignore_eos=True)
        stats = measure(engine, prompts[kind], sampling, k)
        rows.append({
            "kind": kind, "proposer": proposer, "k": k, "temperature": temp,
            "acceptance_rate": round(stats.acceptance_rate or 0.0, 3),
            "mean_acceptance_length": round(stats.mean_acceptance_length or 1.0, 3),
            "drafted": stats.num_draft_tokens,
        })
    print(f"\n{'kind':6} {'proposer':8} {'temp':>4} {'k':>2} {'acc.rate':>8} {'mean len':>8} {'drafted':>7}")
    for r in rows:
        print(f"{r['kind']:6} {r['proposer']:8} {r['temperature']:>4} {r['k']:>2} "
              f"{r['acceptance_rate']:>8.3f} {r['mean_acceptance_length']:>8.3f} {r['drafted']:>7}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"prompts_per_kind": args.prompts, "max_tokens": args.max_tokens, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
