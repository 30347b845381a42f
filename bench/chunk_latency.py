"""Time to first chunk and time per streamed chunk, one request at a time, 'off' against 'auto' (CPU).

    PYTHONPATH=. .venv/bin/python -m bench.chunk_latency [--blocks 8] [--per-block 20] [--policy JSON]

Starts the app in a child process with its own Ray (as bench.load --start), sends one streamed
64-token request at a time in alternating blocks of `--per-block` requests per policy, and prints
per policy the medians of: time to the first chunk, time per chunk after it (one chunk per engine
step), the tail after the last chunk, and the whole request. At 1 stream every chunk is one plain
step of one sequence, so a policy's per-chunk time is what its plain step costs in the served app
(bench/RESULTS.md section 7, session 14: the planner's cost there).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import httpx

from bench.app_process import AppProcess, local_args
from bench.load import PROMPTS, app_overrides


async def one(http: httpx.AsyncClient, url: str, policy: str, prompt: str) -> tuple[float, float, float, float]:
    """(first chunk, per later chunk, tail, whole) in seconds for one streamed request."""
    body = {"model": "specserve-embedded", "prompt": prompt, "max_tokens": 64, "temperature": 0,
            "ignore_eos": True, "speculation": policy, "stream": True}
    t0 = time.perf_counter()
    first = last = None
    n = 0
    async with http.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if json.loads(line[6:]).get("usage"):
                continue
            last = time.perf_counter()
            first = first or last
            n += 1
    t1 = time.perf_counter()
    if first is None or last is None:
        raise RuntimeError(f"no chunk came back for a {policy} request")
    return first - t0, (last - first) / max(n - 1, 1), t1 - last, t1 - t0


async def run(url: str, blocks: int, per_block: int) -> dict[str, list[tuple[float, float, float, float]]]:
    res: dict[str, list[tuple[float, float, float, float]]] = {"off": [], "auto": []}
    async with httpx.AsyncClient(trust_env=False) as http:
        for _ in range(3):  # warm-up
            await one(http, url, "off", PROMPTS[0])
        for block in range(blocks):
            policy = "off" if block % 2 == 0 else "auto"
            for i in range(per_block):
                res[policy].append(await one(http, url, policy, PROMPTS[i % len(PROMPTS)]))
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=8, help="alternating blocks, off first")
    ap.add_argument("--per-block", type=int, default=20)
    ap.add_argument("--policy", type=json.loads, default={},
                    help='PolicyConfig overrides as JSON, e.g. \'{"explore_every_steps": 0}\'')
    args = ap.parse_args()
    with AppProcess(local_args(app_overrides(1, args.policy))) as app:
        res = asyncio.run(run(app.url, args.blocks, args.per_block))
    for policy, rows in res.items():
        first, per_chunk, tail, whole = (statistics.median(col) * 1e3 for col in zip(*rows))
        print(f"{policy:4} n {len(rows)}  first chunk {first:.2f} ms  per chunk {per_chunk:.3f} ms  "
              f"tail {tail:.2f} ms  whole {whole:.1f} ms", flush=True)


if __name__ == "__main__":
    main()
