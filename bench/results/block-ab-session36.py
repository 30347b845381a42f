"""Block A/B at one stream (session 36): alternate blocks of BLOCK requests of two policies on one app,
closed loop; the first request of each block is dropped (the switch). Policies: auto | off | on[:k].
usage: .venv/bin/python bench/results/block-ab-session36.py PIN(off|on|none) A B SECONDS [BLOCK] [POLICY_JSON]"""
import asyncio, json, statistics, sys, time
import httpx
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.* imports
from bench.app_process import AppProcess, local_args
from bench.load import app_overrides, MODEL, PROMPTS

pin, A, B, seconds = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
block = int(sys.argv[5]) if len(sys.argv) > 5 else 6
extra = json.loads(sys.argv[6]) if len(sys.argv) > 6 else {}
policy = {} if pin == "none" else {"mode_arbiter": {"pinned_mode": pin}}
policy.update(extra)

async def one(client, url, pol, n):
    body = {"model": MODEL, "prompt": PROMPTS[n % len(PROMPTS)], "max_tokens": 64, "ignore_eos": True,
            "temperature": 0, "stream": True, "speculation": pol.split(":")[0], "return_provenance": True}
    if ":" in pol:
        body["num_speculative_tokens"] = int(pol.split(":")[1])
    toks = drafted = 0
    async with client.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line[6:] == "[DONE]":
                continue
            d = json.loads(line[6:])
            if d.get("usage"):
                drafted = (d["usage"].get("speculation") or {}).get("drafted_tokens", 0)
                continue
            toks += len((d.get("specserve") or {}).get("tokens", ()))
    return toks, drafted

async def main(url):
    rates = {A: [], B: []}
    drafted = {A: 0, B: 0}
    n = 0
    async with httpx.AsyncClient(trust_env=False) as client:
        t_end = time.monotonic() + 20
        while time.monotonic() < t_end:  # warm up both
            for p in (A, B):
                await one(client, url, p, n); n += 1
        t_end = time.monotonic() + seconds
        i = 0
        while time.monotonic() < t_end:
            p = A if i % 2 == 0 else B
            await one(client, url, p, n); n += 1  # dropped: the switch
            t0 = time.monotonic(); tok = 0
            for _ in range(block - 1):
                t, d = await one(client, url, p, n); n += 1; tok += t; drafted[p] += d
            rates[p].append(tok / (time.monotonic() - t0))
            i += 1
    k = min(len(rates[A]), len(rates[B]))
    ratios = [rates[A][j] / rates[B][j] for j in range(k)]
    # also pair each B with the mean of the A blocks around it (drift-robust)
    r2 = [((rates[A][j] + rates[A][j + 1]) / 2) / rates[B][j] for j in range(min(len(rates[A]) - 1, len(rates[B])))]
    m, se = statistics.mean(ratios), statistics.stdev(ratios) / len(ratios) ** 0.5
    m2, se2 = statistics.mean(r2), statistics.stdev(r2) / len(r2) ** 0.5
    print(f"pin={pin} {A}/{B}: {k} pairs, mean {m:.4f} ± {se:.4f}; bracketed {m2:.4f} ± {se2:.4f}; "
          f"rates {statistics.mean(rates[A]):.1f} / {statistics.mean(rates[B]):.1f} tok/s; drafted {drafted}", flush=True)

with AppProcess(local_args(app_overrides(1, policy))) as app:
    asyncio.run(main(app.url))
