"""CPU seconds the Serve processes spend per streamed chunk (the policy's `costs.chunk_s`).

    .venv/bin/python -m bench.host_cost

Starts the app in its own Ray (bench/app_process.py, configs/local.yaml with max_num_seqs 32),
runs 15-second closed-loop cells (bench/load.run_cell) with speculation off and on at 16 and 32
streams, and reads the utime+stime of the Router, ProxyActor, TargetServer and DraftServer
processes from /proc before and after each cell. With speculation off every streamed chunk
carries one token, so router+proxy CPU seconds / tokens is their CPU cost per chunk.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable

from bench.app_process import AppProcess, local_args
from bench.load import run_cell

ROLES = ("Router", "ProxyActor", "TargetServer", "DraftServer")
TICK = os.sysconf("SC_CLK_TCK")


def process_cpu_seconds(group: Callable[[str], str | None]) -> dict[str, float]:
    """CPU seconds (user + system) so far of this machine's processes, summed per group(cmdline)
    (None: not counted)."""
    out: dict[str, float] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().decode(errors="replace")
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # it exited between listing and reading
            continue
        key = group(cmd)
        if key is not None:
            out[key] = out.get(key, 0.0) + (int(fields[11]) + int(fields[12])) / TICK  # utime, stime
    return out


def _role(cmd: str) -> str | None:
    return next((role for role in ROLES if role in cmd), None) if "ray::" in cmd else None


def cpu_by_role() -> dict[str, float]:
    """CPU seconds (user + system) so far of the Ray worker processes of each role."""
    return process_cpu_seconds(_role)


async def measure(url: str, policy: str, streams: int) -> None:
    await run_cell(url, policy, streams, 3.0, 1.0, 64)  # warm up
    before = cpu_by_role()
    cell = await run_cell(url, policy, streams, 0.0, 15.0, 64)
    cpu = {k: round(v - before.get(k, 0.0), 2) for k, v in cpu_by_role().items()}
    print(policy, streams, "tokens", cell.tokens, "goodput", cell.goodput_tok_s, "cpu s", cpu, flush=True)


def main() -> None:
    overrides = {"engine": {"limits": {"max_num_seqs": 32, "max_queue": 64}},
                 "target_deployment": {"max_ongoing_requests": 72}}
    with AppProcess(local_args(overrides)) as app:
        for policy, streams in (("off", 16), ("on", 16), ("off", 32), ("on", 32)):
            asyncio.run(measure(app.url, policy, streams))


if __name__ == "__main__":
    main()
