"""How deep does auto draft at one load level, against "on"? (CPU, the embedded pair)

    .venv/bin/python -m bench.depth_probe [--streams 32] [--seconds 30] [--order auto,on,auto,on,on:6] [--stream]

Starts the app in a child process with its own Ray (as `bench.load --start` does, max_num_seqs =
streams), then runs closed-loop non-streaming clients for `--seconds` per policy in the given order
and reads every answer's `usage.speculation`: tokens per drafting step (drafted_tokens /
num_drafts), drafting steps per request, acceptance (accepted / drafted) and goodput. The first
window of a fresh app shows the policy before its cost curves have measured wide passes.
"on:K" forces speculation at depth K (`num_speculative_tokens`), to find the best fixed depth.
`--stream`: the clients stream instead (SSE, one chunk per sequence per step, as bench.load's do),
so the router's, proxy's and clients' work per chunk is in the figure.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import httpx

from bench.app_process import AppProcess, local_args
from bench.load import PROMPTS, Window, app_overrides, stream_one


def _body(policy: str, prompt: str) -> dict:
    mode, _, depth = policy.partition(":")
    body = {"model": "specserve-embedded", "prompt": prompt, "max_tokens": 64,
            "temperature": 0, "ignore_eos": True, "speculation": mode}
    if depth:
        body["num_speculative_tokens"] = int(depth)
    return body


async def _client(http: httpx.AsyncClient, url: str, policy: str, i: int, stop: float, out: list[dict]) -> None:
    n = 0
    while time.monotonic() < stop:
        body = _body(policy, PROMPTS[(i + n) % len(PROMPTS)])
        r = await http.post(f"{url}/v1/completions", json=body, timeout=120)
        r.raise_for_status()
        out.append(r.json()["usage"])
        n += 1


async def window(url: str, policy: str, streams: int, seconds: float) -> dict[str, float]:
    out: list[dict] = []
    stop = time.monotonic() + seconds
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=2 * streams)) as http:
        await asyncio.gather(*(_client(http, url, policy, i, stop, out) for i in range(streams)))
    spec = [u["speculation"] for u in out]
    drafted = sum(s["drafted_tokens"] for s in spec)
    drafts = sum(s["num_drafts"] for s in spec)
    return {"requests": len(out), "tok_s": sum(u["completion_tokens"] for u in out) / seconds,
            "depth_per_drafting_step": drafted / max(1, drafts), "drafting_steps_per_request": drafts / max(1, len(out)),
            "acceptance": sum(s["accepted_tokens"] for s in spec) / max(1, drafted)}


async def stream_window(url: str, policy: str, streams: int, seconds: float) -> dict[str, float]:
    """The same window with streaming clients; tokens count as their chunks arrive (bench.load)."""
    start = time.monotonic()
    w = Window(start, start + seconds)

    async def client(i: int, http: httpx.AsyncClient) -> None:
        n = 0
        while time.monotonic() < w.end:
            body = {**_body(policy, PROMPTS[(i + n) % len(PROMPTS)]), "stream": True, "return_provenance": True}
            n += 1
            await stream_one(http, url, body, w)

    async with httpx.AsyncClient(trust_env=False, limits=httpx.Limits(max_connections=2 * streams)) as http:
        await asyncio.gather(*(client(i, http) for i in range(streams)))
    return {"requests": len(w.latencies), "tok_s": w.tokens / seconds,
            "depth_per_drafting_step": w.drafted / max(1, w.drafts),
            "drafting_share": w.drafts / max(1, w.steps), "acceptance": w.accepted / max(1, w.drafted)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--order", default="auto,on,auto,on")
    ap.add_argument("--stream", action="store_true", help="streaming clients (SSE), as bench.load's")
    ap.add_argument("--chunk-s", type=float, default=None,
                    help="override policy.costs.chunk_s (configs/local.yaml's host cost per streamed chunk)")
    args = ap.parse_args()
    chunk = {"costs": {"chunk_s": args.chunk_s}} if args.chunk_s is not None else None
    with AppProcess(local_args(app_overrides(args.streams, chunk))) as app:
        for policy in args.order.split(","):
            run = stream_window if args.stream else window
            r = asyncio.run(run(app.url, policy, args.streams, args.seconds))
            print(f"{policy:6} " + "  ".join(f"{k} {v:.3g}" for k, v in r.items()), flush=True)


if __name__ == "__main__":
    main()
