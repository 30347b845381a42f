"""CPU seconds by thread of the target replica (and by process) over alternating forced 'off' and auto cells at one stream."""
import asyncio, os, sys, time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.* imports
from bench.app_process import AppProcess, local_args
from bench.load import app_overrides, run_cell, wait_idle
HZ = os.sysconf("SC_CLK_TCK")
def cpu(path):
    f = open(path).read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / HZ
def procs():
    out = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit(): continue
        try:
            cmd = open(f"/proc/{pid}/cmdline").read().replace("\0", " ")
            out[pid] = (cmd, cpu(f"/proc/{pid}/stat"))
        except OSError: continue
    return out
def threads(pid):
    out = {}
    for t in os.listdir(f"/proc/{pid}/task"):
        try:
            name = open(f"/proc/{pid}/task/{t}/comm").read().strip()
            out[t] = (name, cpu(f"/proc/{pid}/task/{t}/stat"))
        except OSError: continue
    return out
async def main(url):
    target = [p for p, (c, _) in procs().items() if "TargetServ" in c][0]
    await run_cell(url, "on", 1, 3, 10, 64, 0); await wait_idle(url)
    agg = {}
    for i, pol in enumerate(["off", "auto"] * 5):
        a, pa = threads(target), procs()
        cell = await run_cell(url, pol, 1, 3, 12, 64, i)
        b, pb = threads(target), procs()
        await wait_idle(url)
        by = {}
        for t, (n, c) in b.items():
            if t in a: by[n] = by.get(n, 0) + c - a[t][1]
        pr = {}
        for p, (cmd, c) in pb.items():
            if p in pa and c - pa[p][1] > 0.1: pr[cmd[:30].strip()] = round(c - pa[p][1], 2)
        print(pol, cell.goodput_tok_s, "threads:", {n: round(v, 2) for n, v in sorted(by.items(), key=lambda x: -x[1]) if v > 0.02}, "procs:", pr, flush=True)
        for n, v in by.items(): agg.setdefault((pol, n), []).append(v)
    for n in sorted(set(k[1] for k in agg)):
        o, au = agg.get(("off", n), [0]), agg.get(("auto", n), [0])
        if max(sum(o), sum(au)) > 0.1: print(f"{n:24} off {sum(o)/len(o):.2f}  auto {sum(au)/len(au):.2f}")
with AppProcess(local_args(app_overrides(1))) as app:
    asyncio.run(main(app.url))
