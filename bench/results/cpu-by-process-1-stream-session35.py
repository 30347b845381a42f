"""CPU seconds by process over cells of forced off and auto at one stream (session 35 diagnostic). Run from the repo root."""
import asyncio, os, sys, time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.* imports
from bench.app_process import AppProcess, local_args
from bench.load import app_overrides, run_cell, wait_idle
HZ = os.sysconf("SC_CLK_TCK")
def snap():
    out = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit(): continue
        try:
            stat = open(f"/proc/{pid}/stat").read()
            cmd = open(f"/proc/{pid}/cmdline").read().replace("\0", " ")[:60]
        except OSError: continue
        f = stat.rsplit(")", 1)[1].split()
        out[pid] = (cmd, (int(f[11]) + int(f[12])) / HZ)
    return out
async def main(url):
    await run_cell(url, "on", 1, 3, 10, 64, 0)
    await wait_idle(url)
    tot = {}
    for i, pol in enumerate(["off", "auto", "off", "auto", "auto", "off", "auto", "off"]):
        a = snap(); t = time.monotonic()
        cell = await run_cell(url, pol, 1, 3, 12, 64, i)
        b = snap(); dt = time.monotonic() - t
        await wait_idle(url)
        use = {}
        for pid, (cmd, cpu) in b.items():
            if pid in a: use[(pid, cmd)] = cpu - a[pid][1]
        top = sorted(use.items(), key=lambda x: -x[1])[:8]
        print(pol, cell.goodput_tok_s, f"{dt:.1f}s", " | ".join(f"{c[1][:38].strip()}:{v:.2f}" for c, v in top if v > 0.05), flush=True)
        for k, v in use.items(): tot.setdefault((pol, k[1][:38].strip()), []).append(v)
    names = sorted(set(k[1] for k in tot))
    for n in names:
        o, au = tot.get(("off", n), [0]), tot.get(("auto", n), [0])
        if max(sum(o), sum(au)) > 0.2: print(f"{n:40} off {sum(o)/len(o):.2f}  auto {sum(au)/len(au):.2f}")
with AppProcess(local_args(app_overrides(1))) as app:
    asyncio.run(main(app.url))
