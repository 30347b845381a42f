"""Placement and autoscaling on a local multi-node Ray cluster (`ray.cluster_utils.Cluster`).

Three nodes: a head (CPU only) and two workers declaring one GPU each plus a custom resource,
`draft_node` on one and `target_node` on the other. configs/autoscale-local.yaml is deployed with
the draft and target pools asking for 0.25 GPU and 0.25 of their node resource per replica
(engines stay on device "cpu": nothing here has a real GPU; the GPU is Ray's accounting only).

The scenario runs in a child process (`python -m tests.serve.test_autoscaling_placement`): the
cluster is its own Ray and must not meet the session Ray of tests/serve/conftest.py. It uses its
own RAY_TMPDIR so no other `ray.init()` on the machine finds it. It writes a JSON report that the
test checks:
- every TargetServer replica runs on the target GPU node, every DraftServer replica on the draft
  GPU node, and those nodes' GPU accounting shows 0.25 GPU held per replica;
- under sustained streaming load, router, target and draft pools each scale above 1 replica;
- after the load stops they scale back to 1.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "autoscale-local.yaml"
GPU_PER_REPLICA = 0.25
PLACEMENT = {
    "target_deployment": {"num_gpus": GPU_PER_REPLICA, "resources": {"target_node": GPU_PER_REPLICA}},
    "draft_deployment": {"num_gpus": GPU_PER_REPLICA, "resources": {"draft_node": GPU_PER_REPLICA}},
}
DEPLOYMENTS = ("Router", "TargetServer", "DraftServer")
STARTUP_DEADLINE_S = 150.0
UPSCALE_DEADLINE_S = 150.0
DOWNSCALE_DEADLINE_S = 90.0
CLIENTS = 8
PROMPTS = ("def read_config(path):\n", "import os\nimport sys\n\n\nclass ", "    for i in range(len(items)):\n")


# ------------------------------------------------------------------------------- child process
def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _replicas(app: str = "specserve") -> dict[str, int]:
    """RUNNING replicas per deployment, from serve.status()."""
    from ray import serve

    status = serve.status().applications.get(app)
    if status is None:
        return {}
    return {name: int(d.replica_states.get("RUNNING", 0)) for name, d in status.deployments.items()}


def _placement() -> dict[str, list[str]]:
    """Deployment -> node ids of its alive replica actors (GCS actor table; no dashboard needed)."""
    import ray

    out: dict[str, list[str]] = {d: [] for d in DEPLOYMENTS}
    for info in ray._private.state.actors().values():
        if info["State"] != "ALIVE":
            continue
        cls = info["ActorClassName"]  # ServeReplica:<app>:<deployment>
        for d in DEPLOYMENTS:
            if cls.endswith(f":{d}"):
                out[d].append(info["Address"]["NodeID"])
    return out


class _Traffic:
    """CLIENTS threads streaming long speculating completions back to back until stopped."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.stop = threading.Event()
        self.done = 0
        self.errors: list[str] = []
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(CLIENTS)]

    def _run(self, i: int) -> None:
        import httpx

        n = 0
        with httpx.Client(timeout=180) as client:
            while not self.stop.is_set():
                body = {"model": "specserve-embedded", "prompt": PROMPTS[(i + n) % len(PROMPTS)],
                        "max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": True,
                        "speculation": "on"}
                try:
                    with client.stream("POST", f"{self.url}/v1/completions", json=body) as r:
                        if r.status_code != 200:
                            self.errors.append(f"HTTP {r.status_code}")
                            time.sleep(1)
                        for _ in r.iter_lines():
                            if self.stop.is_set():
                                break
                except Exception as e:  # noqa: BLE001 — counted, reported
                    self.errors.append(repr(e))
                    time.sleep(1)
                self.done += 1
                n += 1

    def __enter__(self) -> "_Traffic":
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=30)


def scenario(out_path: Path) -> None:
    import httpx
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    from app.config import load_yaml, serve_config_args
    from bench.app_process import merged
    from deployments.builder import build_app

    report: dict[str, Any] = {"timeline": [], "phase": "start"}

    def save() -> None:
        out_path.write_text(json.dumps(report, indent=1))

    def sample(phase: str) -> dict[str, int]:
        reps = _replicas()
        report["timeline"].append({"t": round(time.monotonic() - t0, 1), "phase": phase, "running": reps})
        return reps

    t0 = time.monotonic()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        draft_node = cluster.add_node(num_cpus=1, num_gpus=1, resources={"draft_node": 1})
        target_node = cluster.add_node(num_cpus=1, num_gpus=1, resources={"target_node": 1})
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        report["nodes"] = {"head": cluster.head_node.node_id, "draft": draft_node.node_id,
                           "target": target_node.node_id}
        report["node_resources"] = {n["NodeID"]: n["Resources"] for n in ray.nodes() if n["Alive"]}

        port = _free_port()
        url = f"http://127.0.0.1:{port}"
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
        args = merged(serve_config_args(load_yaml(CONFIG)["applications"][0]), PLACEMENT)
        report["app_args"] = args
        serve.run(build_app(args), name="specserve", route_prefix="/", blocking=False)

        report["phase"] = "startup"
        deadline = time.monotonic() + STARTUP_DEADLINE_S
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"app not healthy after {STARTUP_DEADLINE_S:.0f}s")
            time.sleep(1)
        report["ready_s"] = round(time.monotonic() - t0, 1)
        sample("idle")

        report["phase"] = "load"
        peak: dict[str, int] = {}
        with _Traffic(url) as traffic:
            deadline = time.monotonic() + UPSCALE_DEADLINE_S
            while time.monotonic() < deadline:
                reps = sample("load")
                for d, n in reps.items():
                    peak[d] = max(peak.get(d, 0), n)
                if all(peak.get(d, 0) >= 2 for d in DEPLOYMENTS):
                    # Placement and GPU accounting while every pool is scaled out, from a snapshot
                    # in which no replica is starting or stopping (alive actors == RUNNING replicas).
                    for _ in range(20):
                        placed, reps = _placement(), _replicas()
                        avail = ray._private.state.available_resources_per_node()
                        if all(len(placed[d]) == reps.get(d) for d in DEPLOYMENTS) and placed == _placement():
                            break
                        time.sleep(0.5)
                    report["placement_at_peak"] = placed
                    report["available_at_peak"] = {k: dict(v) for k, v in avail.items()}
                    report["running_at_peak"] = reps
                    break
                time.sleep(1)
            report["requests_done"] = traffic.done
        report["traffic_errors"] = traffic.errors[:20]
        report["peak"] = peak
        save()

        report["phase"] = "drain"
        deadline = time.monotonic() + DOWNSCALE_DEADLINE_S
        while time.monotonic() < deadline:
            reps = sample("after")
            if reps and all(reps.get(d) == 1 for d in DEPLOYMENTS) and \
                    all(len(v) == 1 for v in _placement().values()):
                break
            time.sleep(1)
        report["final"] = _replicas()
        report["placement_final"] = _placement()
        report["phase"] = "done"
    except BaseException as e:
        report["error"] = repr(e)
        raise
    finally:
        report["elapsed_s"] = round(time.monotonic() - t0, 1)
        save()
        try:
            serve.shutdown()
            ray.shutdown()
        finally:
            cluster.shutdown()


# ------------------------------------------------------------------------------------- the test
@pytest.mark.serve
@pytest.mark.slow
@pytest.mark.timeout(560)
def test_draft_and_target_on_separate_gpu_nodes_and_autoscale(tmp_path: Path) -> None:
    # Short: Ray's unix socket paths live under RAY_TMPDIR (108-byte limit).
    ray_tmp = tempfile.mkdtemp(prefix="ssa", dir="/tmp")
    out = tmp_path / "report.json"
    env = dict(os.environ, RAY_TMPDIR=ray_tmp, PYTHONUNBUFFERED="1")
    env.pop("RAY_ADDRESS", None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    try:
        proc = subprocess.run([sys.executable, "-m", "tests.serve.test_autoscaling_placement", "--out", str(out)],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=540)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    report = json.loads(out.read_text()) if out.exists() else {}
    context = (f"rc={proc.returncode}\nreport={json.dumps(report)[-3000:]}\n"
               f"stderr tail:\n{proc.stderr[-3000:]}")
    assert proc.returncode == 0, context

    nodes = report["nodes"]
    res = report["node_resources"]
    assert res[nodes["draft"]].get("GPU") == 1 and res[nodes["draft"]].get("draft_node") == 1
    assert res[nodes["target"]].get("GPU") == 1 and res[nodes["target"]].get("target_node") == 1
    assert "GPU" not in res[nodes["head"]]

    # Scaled out under load: every pool above one replica.
    peak = report["peak"]
    assert all(peak.get(d, 0) >= 2 for d in DEPLOYMENTS), context
    assert report["traffic_errors"] == [], context

    # Placement while scaled out: draft and target replicas on different nodes' GPUs.
    placed = report["placement_at_peak"]
    assert len(placed["TargetServer"]) >= 2 and len(placed["DraftServer"]) >= 2, placed
    assert set(placed["TargetServer"]) == {nodes["target"]}, placed
    assert set(placed["DraftServer"]) == {nodes["draft"]}, placed
    assert nodes["head"] not in set(placed["TargetServer"]) | set(placed["DraftServer"])
    # GPU accounting: each replica alive on a GPU node holds GPU_PER_REPLICA of that node's GPU.
    avail = report["available_at_peak"]
    for node, deployment in ((nodes["target"], "TargetServer"), (nodes["draft"], "DraftServer")):
        n = placed[deployment].count(node)
        assert avail[node].get("GPU", 0.0) == pytest.approx(1 - GPU_PER_REPLICA * n), (deployment, avail[node])
    assert report["running_at_peak"]["TargetServer"] >= 2

    # Back down to one replica each once the load is gone.
    assert report["final"] == {d: 1 for d in DEPLOYMENTS}, context
    assert set(report["placement_final"]["TargetServer"]) == {nodes["target"]}
    assert set(report["placement_final"]["DraftServer"]) == {nodes["draft"]}


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    scenario(parser.parse_args().out)
