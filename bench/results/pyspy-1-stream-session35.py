"""py-spy the target replica over alternating forced 'off' and auto cells at one stream.

Needs `.venv/bin/pip install py-spy` (not a project dependency); writes /tmp/spy-<cell>-<policy>.txt
(collapsed stacks, read by pyspy-1-stream-session35-analyze.py). Run from anywhere with the venv's python."""
import asyncio, os, subprocess, sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.* imports
from bench.app_process import AppProcess, local_args
from bench.load import app_overrides, run_cell, wait_idle
def target_pid():
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if "TargetServ" in open(f"/proc/{pid}/cmdline").read(): return pid
            except OSError: pass
async def main(url):
    pid = target_pid()
    await run_cell(url, "on", 1, 3, 10, 64, 0); await wait_idle(url)
    for i, pol in enumerate(["off", "auto", "off", "auto"]):
        spy = subprocess.Popen([str(Path(sys.executable).parent / "py-spy"), "record", "--pid", pid, "--duration", "11", "--rate", "200",
                                "--format", "raw", "--nonblocking", "--threads", "-o", f"/tmp/spy-{i}-{pol}.txt"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        cell = await run_cell(url, pol, 1, 1, 12, 64, i)
        spy.wait()
        print(pol, cell.goodput_tok_s, flush=True)
        await wait_idle(url)
with AppProcess(local_args(app_overrides(1))) as app:
    asyncio.run(main(app.url))
