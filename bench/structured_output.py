"""Speculation under response_format: acceptance and speed with a JSON schema vs free text.

    .venv/bin/python -m bench.structured_output [--prompts 12] [--rounds 3] [--max-tokens 64]
                                               [--out bench/results/structured-output-cpu.json]

The embedded pair, in one process (the engine the target replica runs), greedy, on held-out
code prompts (bench.acceptance's split). Three output formats — free text, `json_object` and a
JSON schema (a list of function signatures) — each decoded plainly and with the draft at k 4,
interleaved round by round so a drift of the machine hits every cell alike. The prompts run one
at a time (one stream). Per cell: generated tokens per second (median of the rounds, with the
rounds' range in the JSON), and for the speculative cells the acceptance rate
(accepted / drafted), the mean acceptance length (1 + accepted / drafts) and the speed-up over
plain decoding of the same format. The grammar's own cost is the plain constrained cell vs
plain free text. Constrained outputs end where the JSON value is complete (EOS); free text runs
to max_tokens.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
from tqdm import tqdm

from app.engine.acceptance import AcceptanceStats
from app.config import ModelSpec
from app.engine.spec_engine import SpecEngine
from app.proposers import DraftModelProposer
from app.runners.model_runner import ModelRunner
from app.protocol.sampling_params import SamplingParams, StructuredOutput
from bench.acceptance import heldout_prompts

SCHEMA = {
    "type": "object",
    "properties": {"functions": {"type": "array", "minItems": 1, "maxItems": 4, "items": {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 24},
                       "args": {"type": "array", "maxItems": 4, "items": {"type": "string", "maxLength": 16}},
                       "returns": {"type": "string", "enum": ["None", "int", "str", "bool", "list", "dict"]}},
        "required": ["name", "args", "returns"], "additionalProperties": False}}},
    "required": ["functions"], "additionalProperties": False,
}
FORMATS: dict[str, StructuredOutput | None] = {
    "text": None,
    "json_object": StructuredOutput(type="json_object"),
    "json_schema": StructuredOutput(type="json_schema", schema_text=json.dumps(SCHEMA)),
}
K = 4


def run_cell(engine: SpecEngine, prompts: list[list[int]], fmt: StructuredOutput | None, k: int,
             max_tokens: int) -> tuple[int, float, AcceptanceStats, int, int]:
    """The prompts one after another, one stream (where speculation pays): (generated tokens,
    seconds, acceptance, outputs that parse, proposals the grammar cut). One engine serves every cell, as a replica does:
    its compiled grammars are reused."""
    runner = engine.runner
    engine.stats = AcceptanceStats()
    engine.grammar_cut_tokens = 0
    params = SamplingParams(max_tokens=max_tokens, response_format=fmt, ignore_eos=fmt is None)
    tokens: dict[str, list[int]] = {}
    t0 = time.perf_counter()
    for i, ids in enumerate(prompts):
        engine.add(f"p{i}", ids, params, k=k)
        while engine.has_work():
            for u in engine.step():
                tokens.setdefault(u.seq_id, []).extend(u.token_ids)
    seconds = time.perf_counter() - t0
    parsed = 0
    for ids in tokens.values():
        try:
            json.loads(runner.tokenizer.decode(ids, skip_special_tokens=True))
            parsed += 1
        except ValueError:
            pass
    return sum(map(len, tokens.values())), seconds, engine.stats, parsed, engine.grammar_cut_tokens


def git_commit() -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=12, help="held-out code prompts, decoded one at a time")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved repetitions; medians reported")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("bench/results/structured-output-cpu.json"))
    args = parser.parse_args()
    torch.set_num_threads(2)
    runner = ModelRunner(ModelSpec(path="models/target"), 32)  # the engine's default max_num_seqs
    proposer = DraftModelProposer(ModelSpec(path="models/draft"), max_seqs=32)
    prompts = heldout_prompts(runner.tokenizer, args.prompts, args.seed)["code"]
    cells = [(name, k) for name in FORMATS for k in (0, K)]
    engine = SpecEngine(runner, proposer, max_k=K)
    for name, k in cells:  # warm-up, a whole round: compiled grammars, allocator and caches settle
        run_cell(engine, prompts, FORMATS[name], k, args.max_tokens)
    samples: dict[tuple[str, int], list[tuple[int, float, AcceptanceStats, int, int]]] = {c: [] for c in cells}
    for r in tqdm(range(args.rounds), desc="rounds"):
        for name, k in cells[r % len(cells):] + cells[:r % len(cells)]:  # rotate the order
            samples[name, k].append(run_cell(engine, prompts, FORMATS[name], k, args.max_tokens))
    rows = []
    for name, k in cells:
        runs = samples[name, k]
        tps = statistics.median(n / s for n, s, *_ in runs)
        stats = runs[-1][2]
        rows.append({"format": name, "k": k, "tok_per_s": round(tps, 1), "tokens": runs[-1][0],
                     "tok_per_s_range": [round(min(n / s for n, s, *_ in runs), 1),
                                         round(max(n / s for n, s, *_ in runs), 1)],
                     "parsed": f"{runs[-1][3]}/{len(prompts)}",
                     "acceptance_rate": round(stats.acceptance_rate, 3) if k else None,
                     # drafted counts the proposals verified; cut ones were forbidden (or followed one)
                     "drafted": stats.num_draft_tokens if k else None, "cut": runs[-1][4] if k else None,
                     "mean_acceptance_length": round(stats.mean_acceptance_length, 3) if k else None})
    plain = {r["format"]: r["tok_per_s"] for r in rows if r["k"] == 0}
    for r in rows:
        r["speedup_vs_plain"] = round(r["tok_per_s"] / plain[r["format"]], 3) if r["k"] else None
        r["vs_free_text_plain"] = round(r["tok_per_s"] / plain["text"], 3) if r["k"] == 0 else None
    print(f"\n{'format':12} {'k':>2} {'tok/s':>7} {'tokens':>6} {'parsed':>6} {'drafted':>7} {'cut':>5} "
          f"{'acc.rate':>8} {'mean len':>8} {'speed-up':>8}")
    for r in rows:
        fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
        print(f"{r['format']:12} {r['k']:>2} {r['tok_per_s']:>7.1f} {r['tokens']:>6} {r['parsed']:>6} "
              f"{fmt(r['drafted'], 'd'):>7} {fmt(r['cut'], 'd'):>5} "
              f"{fmt(r['acceptance_rate'], '.3f'):>8} {fmt(r['mean_acceptance_length'], '.3f'):>8} "
              f"{fmt(r['speedup_vs_plain'], '.3f'):>8}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {"date": datetime.now(timezone.utc).isoformat(timespec="minutes"), "commit": git_commit(),
              "machine": f"{platform.machine()} CPU, {torch.get_num_threads()} threads",
              "prompts": len(prompts), "rounds": args.rounds, "max_tokens": args.max_tokens, "k": K,
              "schema": SCHEMA, "rows": rows}
    args.out.write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
