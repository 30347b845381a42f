"""Time to first token and request wall, auto (pinned 'off') against forced 'off', alternating requests at one
stream (session 36). usage: .venv/bin/python bench/results/ttft-ab-session36.py N [MAX_TOKENS]"""
import asyncio, json, sys, time, statistics as st
import httpx
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.* imports
from bench.app_process import AppProcess, local_args
from bench.load import app_overrides, MODEL, PROMPTS
N = int(sys.argv[1]); maxtok = int(sys.argv[2]) if len(sys.argv) > 2 else 64
async def one(client, url, pol, n):
    body = {"model": MODEL, "prompt": PROMPTS[n % len(PROMPTS)], "max_tokens": maxtok, "ignore_eos": True,
            "temperature": 0, "stream": True, "speculation": pol, "return_provenance": True}
    t0 = time.monotonic(); first = None
    async with client.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: ") and first is None:
                first = time.monotonic() - t0
    return first, time.monotonic() - t0
async def main(url):
    res = {"auto": [], "off": []}
    async with httpx.AsyncClient(trust_env=False) as client:
        for n in range(20):
            await one(client, url, ("auto", "off")[n % 2], n)
        for n in range(N):
            pol = ("auto", "off")[n % 2]
            res[pol].append(await one(client, url, pol, n))
    for p, v in res.items():
        print(p, "ttft mean %.2f ms median %.2f ms; total mean %.1f ms" % (st.mean(x[0] for x in v) * 1000,
              st.median(x[0] for x in v) * 1000, st.mean(x[1] for x in v) * 1000))
with AppProcess(local_args(app_overrides(1, {"mode_arbiter": {"pinned_mode": "off"}}))) as app:
    asyncio.run(main(app.url))
