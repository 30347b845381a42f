"""Concurrency through the served application on the CPU: the embedded pair of `make run`.

    .venv/bin/python -m bench.serve_cpu [--requests 24] [--max-tokens 64] [--rounds 2]

Starts configs/local.yaml's application in its own local Ray (bench/app_process.py), then in
alternating rounds sends `--requests` greedy completions one after another and all at once,
through HTTP on 127.0.0.1. Reports output tok/s of each, their ratio, and whether every
concurrent answer equals the sequential answer to the same prompt (it must: greedy decoding
does not depend on the batch).
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from bench.app_process import AppProcess, local_args

PROMPTS = ["def read_config(path):\n", "import os\nimport sys\n\n\ndef main(argv):\n", "class Stack:\n    def __init__(self):\n",
           "for index, value in enumerate(items):\n", "def parse_header(line):\n", "The quick brown fox",
           "with open(path) as f:\n", "if __name__ == '__main__':\n"]


def complete(url: str, prompt: str, max_tokens: int) -> tuple[str, int]:
    r = httpx.post(f"{url}/v1/completions", timeout=300, json={
        "model": "specserve-embedded", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True})
    r.raise_for_status()
    body = r.json()
    return body["choices"][0]["text"], body["usage"]["completion_tokens"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    prompts = [PROMPTS[i % len(PROMPTS)] + f"# {i}\n" for i in range(args.requests)]
    seq_s = con_s = 0.0
    tokens = 0
    identical = True
    with AppProcess(local_args()) as app:
        complete(app.url, prompts[0], 8)  # warm-up
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            sequential = [complete(app.url, p, args.max_tokens) for p in prompts]
            seq_s += time.perf_counter() - t0
            t0 = time.perf_counter()
            with ThreadPoolExecutor(args.requests) as pool:
                concurrent = list(pool.map(lambda p: complete(app.url, p, args.max_tokens), prompts))
            con_s += time.perf_counter() - t0
            tokens += sum(n for _, n in sequential)
            identical &= [t for t, _ in sequential] == [t for t, _ in concurrent]
    result = {"requests": args.requests, "max_tokens": args.max_tokens, "rounds": args.rounds,
              "sequential_tok_s": tokens / seq_s, "concurrent_tok_s": tokens / con_s,
              "concurrent_over_sequential": seq_s / con_s, "outputs_identical": identical}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
