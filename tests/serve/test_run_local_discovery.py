"""`make run`'s Ray is findable by Prometheus: `deployments.run_local.start_ray` starts the
dashboard, which writes Ray's file_sd JSON (`/tmp/ray/prom_metrics_service_discovery.json`, read
by cluster/prometheus/prometheus.yml) listing this node's metrics export port, and that port serves /metrics.

The Ray runs in a child process with its own RAY_TMPDIR, so it never meets the test session's
Ray (started without a dashboard) or any other Ray on the machine. No application is deployed:
discovery is Ray's, not the app's (tests/serve/test_metrics_app.py covers the app's series).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from bench.app_process import free_port

pytestmark = [pytest.mark.serve]
ROOT = Path(__file__).resolve().parents[2]

CHILD = textwrap.dedent("""
    import json, os, sys, time, urllib.request
    from pathlib import Path
    import ray
    from deployments.run_local import start_ray

    metrics_port, dashboard_port = int(sys.argv[1]), int(sys.argv[2])
    start_ray(metrics_port, dashboard_port=dashboard_port, num_cpus=1)
    link = Path(os.environ["RAY_TMPDIR"]) / "ray" / "prom_metrics_service_discovery.json"
    deadline, groups = time.monotonic() + 90, []
    while time.monotonic() < deadline:
        try:
            groups = json.loads(link.read_text())
        except (OSError, ValueError):
            groups = []
        if any(t.endswith(f":{metrics_port}") for g in groups for t in g["targets"]):
            break
        time.sleep(0.5)
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as r:
        status, body = r.status, r.read().decode()
    session = Path(ray._private.worker._global_node.get_session_dir_path())
    print("RESULT " + json.dumps({"groups": groups, "status": status, "ray_series": "ray_" in body,
                                  "in_session": link.resolve() == session / link.name}))
    ray.shutdown()
""")


def test_start_ray_writes_prometheus_service_discovery() -> None:
    metrics_port, dashboard_port = free_port(), free_port()
    tmp = tempfile.mkdtemp(prefix="rsd", dir="/tmp")  # short: Ray's socket paths live under it
    try:
        env = {**os.environ, "RAY_TMPDIR": tmp}
        proc = subprocess.run([sys.executable, "-c", CHILD, str(metrics_port), str(dashboard_port)], cwd=ROOT,
                              env=env, capture_output=True, text=True, timeout=180)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-2000:] + proc.stderr[-4000:]
    result = json.loads(lines[-1][len("RESULT "):])
    (group,) = [g for g in result["groups"] if any(t.endswith(f":{metrics_port}") for t in g["targets"])]
    assert group["labels"] == {"job": "ray"}  # cluster/prometheus/prometheus.yml's job
    assert result["in_session"]
    assert result["status"] == 200 and result["ray_series"]
