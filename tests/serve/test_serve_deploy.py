"""`serve build` output, and configs/local.yaml, deploy with `serve deploy` onto a `ray start --head`
cluster and serve a completion — all through the CLIs, as an ops team would.

Independent of the session Ray the other serve tests start: this module never calls ray.init in
the pytest process; its cluster is a `ray start --head --block` child with its own --temp-dir
(so the `ray_current_cluster` address file other ray.init() calls read is not touched) and every
port chosen free. It is torn down by killing the processes of *that* cluster by pid — never with
`ray stop`, which kills every Ray process of this user on the machine (other engineers' tests too).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest
import yaml

from tests.serve.conftest import free_port

pytestmark = [pytest.mark.serve, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent  # the venv's bin: ray, serve
MODEL = "specserve-embedded"
START_TIMEOUT_S = 180
DEPLOY_TIMEOUT_S = 300


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    # Ray 2.60's `ray start` turns token auth on by default (token in ~/.ray/auth_token), but the
    # serve CLI sends the token only when RAY_AUTH_MODE=token says so: set it for both, explicitly.
    env["RAY_AUTH_MODE"] = "token"
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}".rstrip(os.pathsep)
    return env


def _auth_headers() -> dict[str, str]:
    token = os.environ.get("RAY_AUTH_TOKEN")
    path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH", Path.home() / ".ray" / "auth_token"))
    if token is None and path.exists():
        token = path.read_text().strip()
    return {"Authorization": f"Bearer {token}"} if token else {}


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / args[0]), *args[1:]], cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=timeout)


def _pids_of_cluster(marker: str, root_pid: int) -> list[int]:
    """Processes of our cluster only: descendants of `ray start`, or any whose command line names
    our private temp dir (raylet, gcs_server, dashboard, workers all carry the session dir)."""
    children: dict[int, list[int]] = {}
    mine: set[int] = {root_pid}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(pid)
        if marker in cmdline:
            mine.add(pid)
    stack = list(mine)
    while stack:
        for child in children.get(stack.pop(), []):
            if child not in mine:
                mine.add(child)
                stack.append(child)
    return sorted(mine)


def _kill_cluster(marker: str, proc: subprocess.Popen) -> None:
    pids = [p for p in _pids_of_cluster(marker, proc.pid) if p != os.getpid()]
    for sig, wait_s in ((signal.SIGTERM, 8.0), (signal.SIGKILL, 5.0)):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            pids = [p for p in pids if Path(f"/proc/{p}").exists() and _state(p) != "Z"]
            if not pids:
                break
            time.sleep(0.3)
        if not pids:
            break
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "X"


@pytest.fixture(scope="module")
def head_cluster() -> Iterator[dict]:
    """`ray start --head` with the dashboard on (serve deploy talks to its REST API), all ports free."""
    # Short path: Ray puts unix sockets under it (108-byte limit).
    temp_dir = tempfile.mkdtemp(prefix="ssd", dir="/tmp")
    ports = {name: free_port() for name in (
        "port", "dashboard-port", "ray-client-server-port", "node-manager-port", "object-manager-port",
        "dashboard-agent-listen-port", "dashboard-agent-grpc-port", "runtime-env-agent-port",
        "metrics-export-port")}
    log = open(Path(temp_dir) / "ray_start.log", "w")
    cmd = [str(BIN / "ray"), "start", "--head", "--block", "--num-cpus", "2", "--num-gpus", "0",
           "--include-dashboard=true", "--dashboard-host", "127.0.0.1", "--node-ip-address", "127.0.0.1",
           "--temp-dir", temp_dir, "--disable-usage-stats",
           *[a for name, port in ports.items() for a in (f"--{name}", str(port))]]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    dashboard = f"http://127.0.0.1:{ports['dashboard-port']}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            assert proc.poll() is None, f"ray start exited: {Path(log.name).read_text()[-3000:]}"
            try:
                # Up once the dashboard head answers. Ray 2.60 enables token auth by default (the
                # token lives in ~/.ray/auth_token, which the serve CLI sends), so 401 counts as up.
                if httpx.get(f"{dashboard}/api/version", timeout=3).status_code in (200, 401):
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"dashboard not up: {Path(log.name).read_text()[-3000:]}"
            time.sleep(1)
        yield {"dashboard": dashboard, "http_port": free_port(), "temp_dir": temp_dir}
    finally:
        _kill_cluster(temp_dir, proc)
        log.close()
        shutil.rmtree(temp_dir, ignore_errors=True)


def _pin_http(config: dict, port: int) -> dict:
    config["http_options"] = {**(config.get("http_options") or {}), "host": "127.0.0.1", "port": port}
    config["proxy_location"] = "HeadOnly"
    if "grpc_options" in config:
        config["grpc_options"]["port"] = free_port()
    return config


def _deploy_and_query(cluster: dict, config_path: Path, app_name: str) -> None:
    deployed = _cli("serve", "deploy", str(config_path), "-a", cluster["dashboard"])
    assert deployed.returncode == 0, deployed.stdout + deployed.stderr

    # Poll the dashboard's Serve REST API (what `serve status` reads) rather than spawning the CLI
    # every few seconds: each CLI start costs CPU seconds the replicas are starting on.
    deadline = time.monotonic() + DEPLOY_TIMEOUT_S
    apps: dict = {}
    while time.monotonic() < deadline:
        try:
            r = httpx.get(f"{cluster['dashboard']}/api/serve/applications/", headers=_auth_headers(), timeout=10)
            apps = r.json().get("applications", {}) if r.status_code == 200 else {}
        except (httpx.HTTPError, ValueError):
            apps = {}
        app = apps.get(app_name, {})
        assert app.get("status") not in ("DEPLOY_FAILED", "UNHEALTHY"), app
        if app.get("status") == "RUNNING" and set(apps) == {app_name}:
            break
        time.sleep(2)
    else:
        pytest.fail(f"{app_name} not RUNNING after {DEPLOY_TIMEOUT_S}s: {apps}")

    status = _cli("serve", "status", "-a", cluster["dashboard"])  # and the CLI agrees
    assert status.returncode == 0, status.stdout + status.stderr
    app = yaml.safe_load(status.stdout)["applications"][app_name]
    assert app["status"] == "RUNNING", status.stdout
    assert set(app["deployments"]) == {"Router", "TargetServer", "DraftServer"}, status.stdout
    assert all(d["status"] == "HEALTHY" for d in app["deployments"].values()), status.stdout

    base = f"http://127.0.0.1:{cluster['http_port']}"
    with httpx.Client(timeout=120) as client:
        assert client.get(f"{base}/health").status_code == 200
        r = client.post(f"{base}/v1/completions", json={
            "model": MODEL, "prompt": "def read_config(path):\n", "max_tokens": 16, "temperature": 0,
            "speculation": "on"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["text"]
    assert body["usage"]["completion_tokens"] >= 1
    assert body["usage"]["speculation"]["mode"] == "speculative"
    assert body["usage"]["speculation"]["drafted_tokens"] > 0  # the draft deployment answered


def test_serve_build_output_deploys(head_cluster: dict, tmp_path: Path) -> None:
    """`serve build deployments.local_app:app` → `serve deploy` → RUNNING → a completion."""
    # `serve build` imports an Application object; `deployments.builder:build_app` is a builder
    # function (it needs args), so build fails on it — deployments.local_app:app is the bound one.
    built_path = tmp_path / "built.yaml"
    built = _cli("serve", "build", "deployments.local_app:app", "-o", str(built_path))
    assert built.returncode == 0, built.stdout + built.stderr
    config = yaml.safe_load(built_path.read_text())
    (app,) = config["applications"]
    assert app["import_path"] == "deployments.local_app:app"
    assert {d["name"] for d in app["deployments"]} == {"Router", "TargetServer", "DraftServer"}
    patched = tmp_path / "built_pinned.yaml"
    patched.write_text(yaml.safe_dump(_pin_http(config, head_cluster["http_port"]), sort_keys=False))
    _deploy_and_query(head_cluster, patched, app["name"])


def test_serve_deploy_local_config(head_cluster: dict, tmp_path: Path) -> None:
    """`serve deploy configs/local.yaml` (import_path deployments.builder:build_app with args) works too;
    it replaces the previous test's application on the same cluster."""
    config = yaml.safe_load((ROOT / "configs" / "local.yaml").read_text())
    assert config["applications"][0]["import_path"] == "deployments.builder:build_app"
    patched = tmp_path / "local_pinned.yaml"
    patched.write_text(yaml.safe_dump(_pin_http(config, head_cluster["http_port"]), sort_keys=False))
    _deploy_and_query(head_cluster, patched, config["applications"][0]["name"])
