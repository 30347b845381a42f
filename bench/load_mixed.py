"""bench.load's mixed traffic on a random-weight pair: prompt classes with their own controlled
acceptance, output lengths of 16-512 tokens.

The pair is bench.serve_gpu's: Llama-3.1-8B / 3.2-1B shaped checkpoints with random weights and
the real vocabulary (128,256) on a GPU (`--shape 8b`), or a tiny pair of the same code for a smoke
run on the CPU (`--shape tiny`). Random weights agree on nothing, so acceptance is controlled: the
draft replica runs the real draft model every step (its cost is real) and then proposes the
target's own greedy continuation with probability alpha per token, alpha set per prompt class
(app/proposers/oracle.py ReferenceProposer). Code prompts get a high alpha and prose prompts a low
one by default: speculation pays for one class and not the other, which a per-request policy has
to learn from what it measures per class.

Prompts are words of the pair's word-level vocabulary ("t<id>"). A code prompt is lines of
`t<a> = t<b> t<c> ...` and a prose prompt lines of plain words, so the router's classifier
(app.policy.classify_prompt) puts them in "code" and "prose"; `prompt_classes` checks it. Every
client sends the same deterministic sequence in every cell: classes alternate, and each pair of a
code and a prose request shares a length from LENGTHS, so each class sees the same lengths and the
policies of a level see the same requests.

Set-up: write the checkpoints, start the app (bench.app_process), tokenize the prompts through the
router, take each prompt's greedy continuation (a plain run, the longest length) as its
reference, load references, classes and alphas into the draft replica, then warm up: 'on' bursts
at every level and every draft depth, so the draft's CUDA graphs (captured per batch bucket and
depth on first use) are not captured inside measured cells, and the router has seen both classes.
"""

from __future__ import annotations

import asyncio
import json
import random
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from app.policy import classify_prompt

MODEL = "bench"  # bench.serve_gpu.app_args' model name
CLASSES = ("code", "prose")
# output lengths, cycled; each code request and the prose request after it share one
LENGTHS = (16, 512, 32, 256, 64, 128, 24, 384, 48, 192, 96, 320)
DEFAULT_ALPHAS = {"code": 0.8, "prose": 0.35}
PROMPTS_PER_CLASS = 24
PROMPT_TOKENS = 64  # >= ReferenceProposer.KEY_TOKENS: references are keyed by the prompt's first 32 tokens
MAX_K = 8  # the draft's deepest step (engine.speculation.max_speculative_tokens); 'on' uses the policy's default_k
# seconds, for the plan's estimate: app start-up (8B random weights built on the GPU, every target
# graph captured: ~60 s in bench.serve_gpu on an H100 at 32 sequences; here 64, and both replicas
# profile their steps) and cell overhead (closing streams, the pause)
STARTUP_EST_S = {"8b": 110.0, "tiny": 25.0}
CELL_OVERHEAD_S = 1.5


def _words(rng: random.Random, vocab: int, n: int) -> list[str]:
    # away from the low ids (pad / unk is t0) and the top (EOS), as bench.serve_gpu's prompts
    return [f"t{rng.randrange(vocab // 64, vocab - vocab // 64)}" for _ in range(n)]


def make_prompts(vocab: int, per_class: int = PROMPTS_PER_CLASS, seed: int = 0) -> dict[str, list[str]]:
    """Prompt texts per class, each about PROMPT_TOKENS words of the word-level vocabulary."""
    rng = random.Random(seed)
    out: dict[str, list[str]] = {"code": [], "prose": []}
    for _ in range(per_class):
        # "t1 = t2 t3 t4": an assignment line to the classifier; "=" is one token (the unknown word)
        out["code"].append("\n".join(f"{a} = {' '.join(_words(rng, vocab, 3))}"
                                     for a in _words(rng, vocab, PROMPT_TOKENS // 5 + 1)) + "\n")
        out["prose"].append("\n".join(" ".join(_words(rng, vocab, 12)) for _ in range(PROMPT_TOKENS // 12 + 1)) + "\n")
    return out


def prompt_classes(prompts: dict[str, list[str]]) -> None:
    """Each prompt is in the class the router's classifier gives it (else the bench would not test
    what it says)."""
    for cls, texts in prompts.items():
        wrong = [t[:40] for t in texts if classify_prompt(t) != cls]
        if wrong:
            raise AssertionError(f"{len(wrong)} {cls} prompts classify otherwise, e.g. {wrong[0]!r}")


@dataclass
class MixedWorkload:
    """The request sequence of every client: request n of client i (the same in every cell)."""

    prompts: dict[str, list[str]]
    model: str = MODEL
    latency_from_cell_start: bool = True  # see bench.load.Window: long requests outlast a window
    lengths: tuple[int, ...] = LENGTHS

    def request(self, client: int, n: int) -> tuple[dict[str, Any], str]:
        j = client * 5 + n  # clients start at different places of the cycle
        cls = CLASSES[j % 2]
        pool = self.prompts[cls]
        return {"prompt": pool[(j // 2 + client) % len(pool)], "max_tokens": self.lengths[(j // 2) % len(self.lengths)]}, cls

    def describe(self) -> dict[str, Any]:
        return {"prompts": {c: len(p) for c, p in self.prompts.items()}, "lengths": list(self.lengths),
                "mean_length": round(sum(self.lengths) / len(self.lengths), 1)}


@dataclass
class Setup:
    """What the random-pair set-up did, for the report."""

    shape: str
    alphas: dict[str, float]
    workload: MixedWorkload
    timings_s: dict[str, float] = field(default_factory=dict)
    reference_lengths: dict[str, int] = field(default_factory=dict)


def app_config(shape: str, device: str, streams: int, policy: dict, root: Path,
               lengths: tuple[int, ...] = LENGTHS) -> dict:
    """The Serve app's args: bench.serve_gpu's pair and deployments, every stream in the batch (the
    policy decides on batch size; a queue would be another experiment), the shipped policy (with
    `policy` overrides), not bench.serve_gpu's fixed one."""
    from bench.app_process import merged
    from bench.serve_gpu import VOCAB, app_args, write_checkpoint

    vocab = VOCAB if shape == "8b" else 1024
    target = write_checkpoint(root / "target", "8b" if shape == "8b" else "tiny", vocab)
    draft = write_checkpoint(root / "draft", "1b" if shape == "8b" else "tiny", vocab)
    config = app_args(target, draft, device, MAX_K, "int8" if device == "cuda" else "none")
    context = config["engine"]["target"]["max_context"]
    if PROMPT_TOKENS + max(lengths) + MAX_K + 8 > context:
        raise ValueError(f"prompts of {PROMPT_TOKENS} + {max(lengths)} tokens do not fit max_context {context}")
    overrides: dict[str, Any] = {
        "engine": {"limits": {"max_num_seqs": streams, "max_cached_tokens": streams * context,
                              "max_queue": streams * 2}},
        "target_deployment": {"max_ongoing_requests": streams * 2 + 8},
    }
    if device == "cpu":  # 2 cores: one torch thread per replica
        overrides["engine"]["target"] = overrides["engine"]["draft"] = {"num_threads": 1}
    config = merged(config, overrides)
    config["policy"] = dict(policy)
    return config


async def _tokenize(client: httpx.AsyncClient, url: str, text: str) -> list[int]:
    r = await client.post(f"{url}/tokenize", json={"model": MODEL, "prompt": text}, timeout=60)
    r.raise_for_status()
    return list(r.json()["tokens"])


async def _generate(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> list[int]:
    """A streamed completion's token ids (return_provenance names each token's id)."""
    ids: list[int] = []
    async with client.stream("POST", f"{url}/v1/completions", json={**body, "stream": True, "return_provenance": True},
                             timeout=600) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if "error" in data:
                raise RuntimeError(f"stream error: {data['error']}")
            ids += [t["id"] for t in (data.get("specserve") or {}).get("tokens", ())]
    return ids


async def _bounded(coros: list, limit: int) -> list:
    sem = asyncio.Semaphore(limit)

    async def one(c):
        async with sem:
            return await c

    return await asyncio.gather(*(one(c) for c in coros))


async def references(url: str, prompts: dict[str, list[str]], concurrency: int,
                     longest: int) -> tuple[list[list[int]], list[str]]:
    """Every prompt's ids followed by its plain greedy continuation of the longest length (+ the
    deepest draft step, so a proposal at the end still has its reference token), and its class."""
    texts = [(cls, t) for cls, ts in prompts.items() for t in ts]
    async with httpx.AsyncClient(trust_env=False) as client:
        ids = await _bounded([_tokenize(client, url, t) for _, t in texts], concurrency)
        short = [len(x) for x in ids if len(x) < PROMPT_TOKENS // 2]
        if short:
            raise AssertionError(f"prompts of {short} tokens: references are keyed by their first 32")
        body = {"model": MODEL, "max_tokens": longest + MAX_K + 1, "temperature": 0, "ignore_eos": True,
                "speculation": "off"}
        outs = await _bounded([_generate(client, url, {**body, "prompt": t}) for _, t in texts], concurrency)
    return [p + o for p, o in zip(ids, outs)], [cls for cls, _ in texts]


async def warm_up(url: str, workload: MixedWorkload, levels: list[int], depths: list[int]) -> None:
    """'on' bursts at every level and draft depth: c requests at once, each a few steps long."""
    async with httpx.AsyncClient(trust_env=False, limits=httpx.Limits(max_connections=max(levels) + 4)) as client:
        for c in levels:
            for k in depths:
                bodies = []
                for i in range(c):
                    fields, _ = workload.request(i, k)  # k: both classes at every level, one stream included
                    bodies.append({"model": MODEL, "prompt": fields["prompt"], "max_tokens": 4 * (k + 1),
                                   "temperature": 0, "ignore_eos": True, "speculation": "on",
                                   "num_speculative_tokens": k})
                await asyncio.gather(*(_generate(client, url, b) for b in bodies))


def plan_seconds(shape: str, device: str, levels: list[int], rounds: int, warmup_s: float, duration_s: float,
                 depths: int, longest: int = max(LENGTHS)) -> dict[str, float]:
    """The run's estimated time by phase (printed before it starts)."""
    cells = len(levels) * 3 * rounds
    est = {"startup": STARTUP_EST_S[shape if device == "cuda" else "tiny"],
           # the references: one plain pass over the longest length at the largest level's batch
           "references": longest * (0.015 if shape == "8b" else 0.01) * 2 + 5,
           "warm_up": len(levels) * depths * (1.0 if device == "cuda" else 0.5),
           "cells": cells * (warmup_s + duration_s + CELL_OVERHEAD_S)}
    est["total"] = sum(est.values())
    return est


def prepare(app_ctx: Any, url: str, shape: str, device: str, levels: list[int], alphas: dict[str, float],
            prompts_per_class: int = PROMPTS_PER_CLASS, lengths: tuple[int, ...] = LENGTHS) -> Setup:
    """References, classes and alphas into the draft replica of a started app; then the warm-up."""
    import time

    from bench.serve_gpu import VOCAB

    t0 = time.monotonic()
    # the app answers once a target replica does; the draft replica may still be starting (on CUDA it
    # profiles its steps then): wait for it, so nothing the bench sends shares the GPU with that
    app_ctx.call("DraftServer", "num_cached_sequences", timeout_s=300.0)
    setup_wait = round(time.monotonic() - t0, 1)
    prompts = make_prompts(VOCAB if shape == "8b" else 1024, prompts_per_class)
    prompt_classes(prompts)
    workload = MixedWorkload(prompts, lengths=tuple(lengths))
    setup = Setup(shape, alphas, workload)
    refs, classes = asyncio.run(references(url, prompts, max(levels), max(lengths)))
    app_ctx.call("DraftServer", "set_references", refs, alphas, classes, timeout_s=300.0)
    setup.reference_lengths = {"min": min(map(len, refs)), "max": max(map(len, refs)), "count": len(refs)}
    setup.timings_s["draft_ready"] = setup_wait
    setup.timings_s["references"] = round(time.monotonic() - t0 - setup_wait, 1)
    t1 = time.monotonic()
    depths = list(range(1, MAX_K + 1)) if device == "cuda" else [4]  # no graphs to capture on the CPU
    asyncio.run(warm_up(url, workload, levels, depths))
    setup.timings_s["warm_up"] = round(time.monotonic() - t1, 1)
    return setup


def new_root() -> Path:
    return Path(tempfile.mkdtemp(prefix="load-pair-"))
