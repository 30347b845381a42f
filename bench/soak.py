"""Soak: mixed traffic against specserve on loopback, optionally killing a replica mid-run.

    .venv/bin/python -m bench.soak --start --duration 600 --kill target      # starts its own Ray + app
    .venv/bin/python -m bench.soak --url http://127.0.0.1:8000 --duration 60   # an app already running

Traffic: `--concurrency` closed-loop clients, each request drawn at random: completion or chat,
streaming or not, speculation on/off/auto, greedy or sampled (seeded), max_tokens uniform in
[--min-tokens, --max-tokens]. Stops at --duration seconds or --max-requests requests, whichever
comes first. With --kill {draft,target,both}, `ray.kill`s one replica actor of that deployment at
half time (the driver must reach the app's Ray: --start, or --ray-address). A request counts as
completed only when it got 200 and, when streaming, every event parsed and `[DONE]` arrived with
no error event; anything else is failed (with its status and message kept in the report).

At the end: completed / failed / rejected (429/503), p50/p99/max latency of completed requests,
and the resident memory of the Ray worker processes (start and end) when they can be found.
`--json PATH` writes the report; the exit status is 1 when any request failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import socket
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

MODEL = "specserve-embedded"
PROMPTS = [
    "def read_config(path):\n",
    "import os\nimport sys\n\n\ndef main(",
    "class Stack:\n    def __init__(self):\n",
    "for i in range(",
    "# Parse the command line arguments\n",
    "def fib(n):\n    if n < 2:\n",
    "Return the number of",
    "    def __repr__(self):\n        return",
]
REJECTED = (429, 503)


# ---- one request --------------------------------------------------------------------------
@dataclass
class Result:
    status: int
    text: str = ""
    error: str | None = None  # an error event, a bad body, or the transport error
    done: bool = False  # streaming: [DONE] arrived (non-streaming: the JSON body parsed)
    latency_s: float = 0.0
    stream: bool = False
    retry_after: str | None = None
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.done and self.error is None


async def call(client: httpx.AsyncClient, base: str, body: dict[str, Any], chat: bool = False,
               timeout_s: float = 120.0) -> Result:
    """POST one completion (SSE parsed when body['stream']); never raises for HTTP or transport errors."""
    url = f"{base}/v1/chat/completions" if chat else f"{base}/v1/completions"
    stream = bool(body.get("stream"))
    t0 = time.monotonic()
    try:
        if not stream:
            r = await client.post(url, json=body, timeout=timeout_s)
            res = Result(r.status_code, latency_s=time.monotonic() - t0, retry_after=r.headers.get("retry-after"))
            try:
                data = r.json()
            except ValueError:
                res.error = f"non-JSON body: {r.text[:200]!r}"
                return res
            if r.status_code != 200:
                res.error = str(data.get("error", data))
                return res
            choice = data["choices"][0]
            res.text = choice["message"]["content"] if chat else choice["text"]
            res.finish_reason, res.usage, res.done = choice.get("finish_reason"), data.get("usage"), True
            return res
        async with client.stream("POST", url, json=body, timeout=timeout_s) as r:
            res = Result(r.status_code, stream=True, retry_after=r.headers.get("retry-after"))
            if r.status_code != 200:
                raw = (await r.aread()).decode("utf-8", "replace")
                res.error, res.latency_s = raw[:300], time.monotonic() - t0
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                payload = line[6:]
                if payload == "[DONE]":
                    res.done = True
                    break
                data = json.loads(payload)
                if "error" in data:
                    res.error = str(data["error"])
                    continue
                if data.get("usage"):
                    res.usage = data["usage"]
                for choice in data.get("choices", []):
                    res.text += (choice.get("delta", {}).get("content") or "") if chat else choice.get("text", "")
                    res.finish_reason = choice.get("finish_reason") or res.finish_reason
        res.latency_s = time.monotonic() - t0
        return res
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        return Result(0, error=f"{type(e).__name__}: {e}", latency_s=time.monotonic() - t0, stream=stream)


def random_request(rng: random.Random, min_tokens: int, max_tokens: int) -> tuple[dict[str, Any], bool]:
    chat = rng.random() < 0.3
    prompt = rng.choice(PROMPTS)
    body: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": rng.randint(min_tokens, max_tokens),
        "stream": rng.random() < 0.5,
        "speculation": rng.choice(["on", "off", "auto"]),
    }
    if rng.random() < 0.5:
        body["temperature"] = 0
    else:
        body.update(temperature=0.8, seed=rng.randrange(2**31))
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body, chat


# ---- Ray side: replicas and memory ---------------------------------------------------------
def replica_actor_names(deployment: str, app: str = "specserve") -> list[str]:
    import ray

    prefix = f"SERVE_REPLICA::{app}#{deployment}#"
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix))


def kill_replica(deployment: str, app: str = "specserve", name: str | None = None) -> str:
    """`ray.kill` one replica actor of `deployment` (Serve's controller starts a replacement)."""
    import ray

    names = [name] if name else replica_actor_names(deployment, app)
    if not names:
        raise RuntimeError(f"no live replica of {app}#{deployment}")
    ray.kill(ray.get_actor(names[0], namespace="serve"), no_restart=True)
    return names[0]


def ray_worker_memory() -> dict[str, int]:
    """RSS (bytes) of this Ray session's worker processes, by process title (`ray::...`).

    Workers are found as descendants of this driver's raylet when the driver is connected
    (ray.init), else as every process titled `ray::...` on the machine.
    """
    import psutil

    procs: list[psutil.Process] = []
    try:
        import ray

        node = ray._private.worker.global_worker.node  # noqa: SLF001 — no public API for the raylet pid
        raylet = psutil.Process(node.all_processes["raylet"][0].process.pid)
        procs = raylet.children(recursive=True)
    except Exception:  # noqa: BLE001 — not the head's driver: fall back to process titles
        procs = list(psutil.process_iter())
    out: dict[str, int] = {}
    for p in procs:
        try:
            cmd = p.cmdline()
            title = cmd[0] if cmd else ""
            if not title.startswith("ray::"):
                continue
            key = title.split()[0]
            if key in out:
                key = f"{key}#{p.pid}"
            out[key] = p.memory_info().rss
        except (psutil.Error, IndexError):
            continue
    return out


# ---- the soak ------------------------------------------------------------------------------
@dataclass
class Report:
    duration_s: float = 0.0
    requests: int = 0
    completed: int = 0
    failed: int = 0
    rejected: int = 0  # 429/503 with Retry-After: overload answered as promised, not a failure
    latency_p50_s: float | None = None
    latency_p99_s: float | None = None
    latency_max_s: float | None = None
    by_kind: dict[str, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    killed: list[str] = field(default_factory=list)
    worker_rss_start_mb: float | None = None
    worker_rss_end_mb: float | None = None
    worker_rss_end_by_process_mb: dict[str, float] = field(default_factory=dict)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


async def soak(base: str, duration_s: float = 60.0, max_requests: int = 10_000, concurrency: int = 4,
               kill: str = "none", min_tokens: int = 8, max_tokens: int = 96, seed: int = 0,
               measure_memory: bool = True, request_timeout_s: float = 180.0) -> Report:
    rng = random.Random(seed)
    report = Report()
    latencies: list[float] = []
    mem0 = ray_worker_memory() if measure_memory else {}
    t0 = time.monotonic()
    stop_at = t0 + duration_s
    issued = 0

    async def client_loop(client: httpx.AsyncClient) -> None:
        nonlocal issued
        while time.monotonic() < stop_at and issued < max_requests:
            issued += 1
            body, chat = random_request(rng, min_tokens, max_tokens)
            kind = f"{'chat' if chat else 'completion'}/{'stream' if body['stream'] else 'json'}/{body['speculation']}"
            res = await call(client, base, body, chat=chat, timeout_s=request_timeout_s)
            report.requests += 1
            report.by_kind[kind] = report.by_kind.get(kind, 0) + 1
            if res.ok:
                report.completed += 1
                latencies.append(res.latency_s)
            elif res.status in REJECTED and res.retry_after:
                report.rejected += 1
                await asyncio.sleep(float(res.retry_after))
            else:
                report.failed += 1
                if len(report.failures) < 20:
                    report.failures.append(f"{kind}: status {res.status}: {res.error}")

    async def killer() -> None:
        if kill == "none":
            return
        await asyncio.sleep(duration_s / 2)
        for deployment in {"draft": ["DraftServer"], "target": ["TargetServer"],
                           "both": ["DraftServer", "TargetServer"]}[kill]:
            report.killed.append(kill_replica(deployment))

    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(limits=limits, trust_env=False) as client:
        await asyncio.gather(killer(), *(client_loop(client) for _ in range(concurrency)))
    report.duration_s = round(time.monotonic() - t0, 2)
    report.latency_p50_s = percentile(latencies, 50)
    report.latency_p99_s = percentile(latencies, 99)
    report.latency_max_s = max(latencies) if latencies else None
    if measure_memory:
        mem1 = ray_worker_memory()
        report.worker_rss_start_mb = round(sum(mem0.values()) / 2**20, 1) if mem0 else None
        report.worker_rss_end_mb = round(sum(mem1.values()) / 2**20, 1) if mem1 else None
        report.worker_rss_end_by_process_mb = {k: round(v / 2**20, 1) for k, v in sorted(mem1.items())}
    return report


# ---- starting an app -----------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_app(config: str, overrides: dict[str, Any], num_cpus: int) -> str:
    """A fresh local Ray (never an existing one) with the app on a free loopback port.

    Ray gets its own temp dir (RAY_TMPDIR): that is where it writes `ray_current_cluster`, so
    other `ray.init()` calls on the machine (tests running beside the soak) never find this one.
    """
    os.environ["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="soak", dir="/tmp")
    import ray
    from ray import serve

    from deployments.builder import build_app, parse_args
    from deployments.run_local import wait_healthy

    args = parse_args({"config": config}).model_dump(mode="json")
    for key, value in overrides.items():
        args[key] = {**args.get(key, {}), **value}
    port = _free_port()
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(args), name="specserve", route_prefix="/", blocking=False)
    base = f"http://127.0.0.1:{port}"
    wait_healthy(f"{base}/health")
    return base


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000", help="a running app (ignored with --start)")
    p.add_argument("--start", action="store_true", help="start a local Ray and the app (--config) first")
    p.add_argument("--config", default="configs/local.yaml")
    p.add_argument("--replicas", type=int, default=2, help="with --start: target and draft replicas each")
    p.add_argument("--ray-address", default="auto", help="without --start: the app's Ray, for --kill/memory")
    p.add_argument("--duration", type=float, default=60.0, help="seconds")
    p.add_argument("--max-requests", type=int, default=10_000)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--min-tokens", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--kill", choices=["none", "draft", "target", "both"], default="none")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the report here")
    a = p.parse_args(argv)
    if not a.url.startswith(("http://127.0.0.1", "http://localhost")) and not a.start:
        p.error("--url must be a loopback address")
    if a.start:
        cpus = os.cpu_count() or 2
        n = a.replicas
        base = start_app(a.config, {
            "target_deployment": {"num_replicas": n, "num_cpus": round(min(1.0, cpus / (2 * n)), 2)},
            "draft_deployment": {"num_replicas": n, "num_cpus": round(min(0.5, cpus / (4 * n)), 2)},
            "router_deployment": {"num_cpus": 0.25},
        }, cpus)
    else:
        base = a.url.rstrip("/")
        if a.kill != "none":
            import ray

            ray.init(address=a.ray_address, log_to_driver=False)
    print(f"soak: {base} for {a.duration:.0f}s (cap {a.max_requests} requests), concurrency {a.concurrency}, "
          f"kill={a.kill}", flush=True)
    report = asyncio.run(soak(base, a.duration, a.max_requests, a.concurrency, a.kill, a.min_tokens,
                              a.max_tokens, a.seed))
    out = asdict(report)
    print(json.dumps(out, indent=2))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)
    if a.start:
        from ray import serve
        import ray

        serve.shutdown()
        ray.shutdown()
        shutil.rmtree(os.environ["RAY_TMPDIR"], ignore_errors=True)
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
