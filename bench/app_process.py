"""Run the specserve application in its own local Ray, in a child process.

Tests and benches that need Ray's metrics export port (which only `ray.init` can set) must not
share the pytest process's Ray session (tests/serve/conftest.py), and must not be found by other
`ray.init()` calls on the machine. So the child:

- uses its own Ray temp dir (RAY_TMPDIR under a fresh short /tmp dir; that is also where Ray
  writes `ray_current_cluster`, so no other `ray.init()` connects to it),
- starts Ray with `address="local"` and `_metrics_export_port` on a free loopback port,
- runs Serve's HTTP proxy on another free 127.0.0.1 port and deploys `build_app(args)`,
- stays up until its stdin closes, then shuts Serve and Ray down.

    with AppProcess({"engine": {...overrides...}}) as app:
        httpx.post(f"{app.url}/v1/completions", json=...)
        urllib.request.urlopen(f"http://127.0.0.1:{app.metrics_port}/metrics")

The child's output goes to `app.log_path`; it is printed into the error when start-up fails.
`app.call("DraftServer", "set_references", refs, alpha)` calls a deployment's method in the child
(a benchmark's hook into a replica, e.g. controlled acceptance) and returns its result.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from app.config import PROJECT_ROOT, load_yaml, serve_config_args

LOCAL_CONFIG = PROJECT_ROOT / "configs" / "local.yaml"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def merged(base: dict, overrides: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merged(out[key], value)
        else:
            out[key] = value
    return out


# The embedded pair on one GPU: both models on CUDA at torch's own thread count, target and draft
# replicas on fractions of the card (bench/serve_gpu.py, bench.load --device cuda).
GPU_OVERRIDES: dict[str, Any] = {
    "engine": {"target": {"device": "cuda", "num_threads": None}, "draft": {"device": "cuda", "num_threads": None}},
    "target_deployment": {"num_gpus": 0.5},
    "draft_deployment": {"num_gpus": 0.4},
}


def local_args(overrides: dict | None = None) -> dict[str, Any]:
    """configs/local.yaml's AppConfig mapping with deep-merged overrides."""
    return merged(serve_config_args(load_yaml(LOCAL_CONFIG)["applications"][0]), overrides or {})


Sample = tuple[str, dict[str, str], float]


def scrape(metrics_port: int, timeout_s: float = 5.0) -> list[Sample]:
    """Ray's /metrics on 127.0.0.1 as (series name, labels, value); [] when unreachable."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=timeout_s) as r:
            text = r.read().decode()
    except (urllib.error.URLError, OSError):
        return []
    return [(s.name, dict(s.labels), float(s.value))
            for family in text_string_to_metric_families(text) for s in family.samples]


def total(samples: list[Sample], name: str, **labels: str) -> float:
    """Sum of a series over every label set matching `labels` (e.g. across replicas)."""
    return sum(v for n, lab, v in samples if n == name and all(lab.get(k) == x for k, x in labels.items()))


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


class AppProcess:
    """Context manager: the app in a child process with its own Ray; see the module doc."""

    def __init__(self, args: dict[str, Any] | None = None, *, num_cpus: int = 4,
                 startup_timeout_s: float = 240.0, name: str = "specserve") -> None:
        self.args = args if args is not None else local_args()
        self.num_cpus = num_cpus
        self.startup_timeout_s = startup_timeout_s
        self.name = name
        self.http_port = free_port()
        self.metrics_port = free_port()
        self.url = f"http://127.0.0.1:{self.http_port}"
        self.tmp: Path | None = None
        self.proc: subprocess.Popen | None = None
        self._calls = 0  # call() requests sent to the child

    @property
    def log_path(self) -> Path:
        assert self.tmp is not None
        return self.tmp / "child.log"

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def __enter__(self) -> "AppProcess":
        # Short path: Ray's unix sockets live under it (108-byte limit).
        self.tmp = Path(tempfile.mkdtemp(prefix="ssq", dir="/tmp"))
        (self.tmp / "args.json").write_text(json.dumps(self.args))
        env = dict(os.environ, RAY_TMPDIR=str(self.tmp), PYTHONUNBUFFERED="1")
        env.pop("RAY_ADDRESS", None)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PROJECT_ROOT), env.get("PYTHONPATH")) if p)
        cmd = [sys.executable, "-m", "bench.app_process", "--args", str(self.tmp / "args.json"),
               "--http-port", str(self.http_port), "--metrics-port", str(self.metrics_port),
               "--num-cpus", str(self.num_cpus), "--name", self.name]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, cwd=PROJECT_ROOT, env=env, stdin=subprocess.PIPE,
                                         stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.startup_timeout_s
        while not _healthy(self.url):
            if self.proc.poll() is not None:
                tail = self.log_tail()
                self.__exit__(None, None, None)
                raise RuntimeError(f"app process exited ({self.proc.returncode}):\n{tail}")
            if time.monotonic() > deadline:
                tail = self.log_tail()
                self.__exit__(None, None, None)
                raise TimeoutError(f"app not healthy after {self.startup_timeout_s:.0f}s:\n{tail}")
            time.sleep(0.5)
        return self

    def call(self, deployment: str, method: str, *args: Any, timeout_s: float = 120.0) -> Any:
        """`deployment.method(*args)` through a Serve handle in the child, its JSON result returned.
        The arguments travel as a JSON file (references of a benchmark run to megabytes), the
        request as its number on the child's stdin, the answer as a file the child renames into place."""
        assert self.proc is not None and self.proc.stdin is not None and self.tmp is not None
        self._calls += 1
        n = self._calls
        (self.tmp / f"call-{n}.json").write_text(json.dumps({"deployment": deployment, "method": method,
                                                            "args": list(args)}))
        self.proc.stdin.write(f"{n}\n".encode())
        self.proc.stdin.flush()
        reply = self.tmp / f"reply-{n}.json"
        deadline = time.monotonic() + timeout_s
        while not reply.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"app process exited ({self.proc.returncode}) during {deployment}.{method}:\n"
                                   f"{self.log_tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{deployment}.{method} did not answer in {timeout_s:.0f}s")
            time.sleep(0.05)
        answer = json.loads(reply.read_text())
        if "error" in answer:
            raise RuntimeError(f"{deployment}.{method}: {answer['error']}")
        return answer["result"]

    def __exit__(self, *exc: object) -> None:
        proc = self.proc
        if proc is not None and proc.poll() is None:
            try:
                assert proc.stdin is not None
                proc.stdin.close()  # the child shuts Serve and Ray down
                proc.wait(timeout=90)
            except (subprocess.TimeoutExpired, OSError):
                proc.terminate()
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=10)
        if self.tmp is not None and os.environ.get("SPECSERVE_KEEP_TMP") != "1":
            shutil.rmtree(self.tmp, ignore_errors=True)


def _child(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--args", required=True)
    parser.add_argument("--http-port", type=int, required=True)
    parser.add_argument("--metrics-port", type=int, required=True)
    parser.add_argument("--num-cpus", type=int, default=4)
    parser.add_argument("--name", default="specserve")
    opts = parser.parse_args(argv)

    import ray
    from ray import serve

    from deployments.builder import build_app

    app_args = json.loads(Path(opts.args).read_text())
    ray.init(address="local", num_cpus=opts.num_cpus, include_dashboard=False,
             _metrics_export_port=opts.metrics_port, log_to_driver=False)
    try:
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": opts.http_port})
        serve.run(build_app(app_args), name=opts.name, route_prefix="/", blocking=False)
        print(f"deployed {opts.name} on 127.0.0.1:{opts.http_port}, metrics on :{opts.metrics_port}", flush=True)
        # until the parent closes our stdin (or dies); each line is the number of a call() to answer
        for line in sys.stdin:
            if line.strip():
                _answer(Path(opts.args).parent, int(line), opts.name)
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


def _answer(tmp: Path, n: int, app_name: str) -> None:
    """Run call number n (its request in tmp/call-n.json) and write tmp/reply-n.json."""
    from ray import serve

    try:
        request = json.loads((tmp / f"call-{n}.json").read_text())
        handle = serve.get_deployment_handle(request["deployment"], app_name=app_name)
        answer = {"result": getattr(handle, request["method"]).remote(*request["args"]).result()}
    except Exception as e:  # noqa: BLE001 — the parent raises it
        answer = {"error": f"{type(e).__name__}: {e}"}
    part = tmp / f"reply-{n}.part"
    part.write_text(json.dumps(answer))
    part.rename(tmp / f"reply-{n}.json")


if __name__ == "__main__":
    _child()
