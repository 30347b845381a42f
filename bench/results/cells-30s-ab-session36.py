"""Alternating 30-s cells of forced 'off' and auto (pinned or free) at one stream, order swapped each pair (session 36).
usage: .venv/bin/python bench/results/cells-30s-ab-session36.py PIN(off|on|none) SECONDS PAIRS [STREAMS]"""
import asyncio, sys, time, json
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.* imports
from bench.app_process import AppProcess, local_args
from bench.load import app_overrides, run_cell, wait_idle
pin = sys.argv[1]; dur = float(sys.argv[2]); n = int(sys.argv[3]); streams = int(sys.argv[4]) if len(sys.argv) > 4 else 1
policy = {} if pin == "none" else {"mode_arbiter": {"pinned_mode": pin}}
async def main(url):
    await run_cell(url, "auto", streams, 2, 8, 64, 0)
    for i in range(n):
        for pol in (("off", "auto") if i % 2 == 0 else ("auto", "off")):
            t0 = time.time()
            c = await run_cell(url, pol, streams, 2, dur, 64, i)
            print(json.dumps({"pol": pol, "t0": t0, "t1": time.time(), "goodput": c.goodput_tok_s,
                              "drafts": c.drafts, "steps": c.steps}), flush=True)
            await wait_idle(url)
with AppProcess(local_args(app_overrides(streams, policy))) as app:
    asyncio.run(main(app.url))
