"""Provisioning against a local stand-in for the Grafana HTTP API that checks every request."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from grafana_client import GrafanaApi
from grafana_client.client import GrafanaUnauthorizedError

from cluster.grafana import provision as prov
from cluster.grafana.dashboard import build_dashboard

TOKEN = "glsa_test_token"
ROOT = Path(__file__).resolve().parents[2]


@dataclass
class FakeGrafana:
    """In-memory state + request log of the emulated Grafana."""

    auth: str
    folders: dict[str, dict[str, Any]] = field(default_factory=dict)
    datasources: dict[str, dict[str, Any]] = field(default_factory=dict)
    dashboards: dict[str, dict[str, Any]] = field(default_factory=dict)
    requests: list[tuple[str, str, dict[str, str], Any]] = field(default_factory=list)

    def handle(self, method: str, path: str, body: Any) -> tuple[int, Any]:
        if method == "GET" and path == "/api/frontend/settings":
            return 200, {"buildInfo": {"version": "11.3.0", "edition": "Open Source"}}
        if method == "GET" and path.startswith("/api/folders/"):
            uid = path.rsplit("/", 1)[1]
            return (200, self.folders[uid]) if uid in self.folders else (404, {"message": "folder not found"})
        if method == "POST" and path == "/api/folders":
            uid = body["uid"]
            if uid in self.folders:
                return 409, {"message": "a folder with that uid already exists"}
            self.folders[uid] = {"uid": uid, "title": body["title"], "id": len(self.folders) + 1}
            return 200, self.folders[uid]
        if method == "GET" and path.startswith("/api/datasources/uid/"):
            uid = path.rsplit("/", 1)[1]
            return (200, self.datasources[uid]) if uid in self.datasources else (404, {"message": "Data source not found"})
        if method == "POST" and path == "/api/datasources":
            self.datasources[body["uid"]] = body
            return 200, {"id": len(self.datasources), "message": "Datasource added", "datasource": body}
        if method == "POST" and path == "/api/dashboards/db":
            dash = body["dashboard"]
            if body.get("folderUid") not in self.folders:
                return 400, {"message": "folder not found"}
            old = self.dashboards.get(dash["uid"])
            if old is not None and not body.get("overwrite"):
                return 412, {"status": "name-exists", "message": "dashboard exists"}
            version = (old["version"] + 1) if old else 1
            self.dashboards[dash["uid"]] = {"body": body, "version": version}
            return 200, {"id": 1, "uid": dash["uid"], "url": f"/d/{dash['uid']}/specserve",
                         "status": "success", "version": version}
        return 404, {"message": f"not emulated: {method} {path}"}


class _Handler(BaseHTTPRequestHandler):
    server: "_Server"

    def _serve(self, method: str) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        body = json.loads(raw) if raw else None
        fake = self.server.fake
        fake.requests.append((method, self.path, {k.lower(): v for k, v in self.headers.items()}, body))
        if self.headers.get("Authorization") != fake.auth:
            status, answer = 401, {"message": "Unauthorized"}
        else:
            status, answer = fake.handle(method, self.path.split("?")[0], body)
        data = json.dumps(answer).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802 (http.server naming)
        self._serve("GET")

    def do_POST(self) -> None:  # noqa: N802
        self._serve("POST")

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        return None


class _Server(ThreadingHTTPServer):
    fake: FakeGrafana


def _start(auth: str) -> tuple[_Server, threading.Thread]:
    server = _Server(("127.0.0.1", 0), _Handler)
    server.fake = FakeGrafana(auth=auth)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    return server, thread


@pytest.fixture()
def grafana() -> Iterator[tuple[str, FakeGrafana]]:
    server, thread = _start(f"Bearer {TOKEN}")
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", server.fake
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def _calls(fake: FakeGrafana) -> list[tuple[str, str]]:
    return [(method, path) for method, path, _, _ in fake.requests]


def test_provision_creates_folder_and_overwrites_dashboard(grafana: tuple[str, FakeGrafana]) -> None:
    url, fake = grafana
    assert prov.main(["--url", url, "--token", TOKEN, "--folder", "specserve"]) == 0
    assert _calls(fake) == [("GET", "/api/frontend/settings"), ("GET", "/api/folders/specserve"),
                            ("POST", "/api/folders"), ("POST", "/api/dashboards/db")]
    assert all(headers["authorization"] == f"Bearer {TOKEN}" for _, _, headers, _ in fake.requests)
    assert fake.requests[2][3] == {"title": "specserve", "uid": "specserve"}
    _, _, headers, body = fake.requests[3]
    assert headers["content-type"].startswith("application/json")
    assert body["overwrite"] is True and body["folderUid"] == "specserve"
    assert body["dashboard"] == build_dashboard()
    assert fake.dashboards["specserve"]["version"] == 1


def test_rerun_reuses_folder_and_overwrites(grafana: tuple[str, FakeGrafana]) -> None:
    url, fake = grafana
    api = GrafanaApi.from_url(url, credential=TOKEN)
    first = prov.provision(api, "Spec Serve")
    second = prov.provision(api, "Spec Serve")
    assert (first["version"], second["version"]) == (1, 2)
    assert _calls(fake).count(("POST", "/api/folders")) == 1
    assert list(fake.folders) == ["spec-serve"] and fake.folders["spec-serve"]["title"] == "Spec Serve"
    assert fake.dashboards["specserve"]["body"]["folderUid"] == "spec-serve"


def test_datasource_created_when_asked(grafana: tuple[str, FakeGrafana]) -> None:
    url, fake = grafana
    prom = "http://127.0.0.1:9090"
    assert prov.main(["--url", url, "--token", TOKEN, "--datasource-url", prom]) == 0
    ds = fake.datasources[prov.DEFAULT_DATASOURCE_UID]
    assert ds["type"] == "prometheus" and ds["url"] == prom and ds["access"] == "proxy"
    body = fake.dashboards["specserve"]["body"]
    (var,) = [v for v in body["dashboard"]["templating"]["list"] if v["name"] == "datasource"]
    assert var["current"]["value"] == prov.DEFAULT_DATASOURCE_UID
    # Second run finds the datasource and does not create it again.
    assert prov.main(["--url", url, "--token", TOKEN, "--datasource-url", prom]) == 0
    assert _calls(fake).count(("POST", "/api/datasources")) == 1


def test_wrong_token_is_refused(grafana: tuple[str, FakeGrafana]) -> None:
    url, fake = grafana
    with pytest.raises(GrafanaUnauthorizedError):
        prov.main(["--url", url, "--token", "wrong"])
    assert not fake.dashboards


def test_basic_auth_from_url() -> None:
    basic = "Basic " + base64.b64encode(b"admin:pw").decode()
    server, thread = _start(basic)
    try:
        port = server.server_address[1]
        assert prov.main(["--url", f"http://admin:pw@127.0.0.1:{port}"]) == 0
        assert "specserve" in server.fake.dashboards
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_module_cli(grafana: tuple[str, FakeGrafana]) -> None:
    url, fake = grafana
    proc = subprocess.run(
        [sys.executable, "-m", "cluster.grafana.provision", "--url", url, "--folder", "ops"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
        env={"GRAFANA_TOKEN": TOKEN, "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    assert "dashboard specserve version 1: success" in proc.stdout
    assert fake.dashboards["specserve"]["body"]["folderUid"] == "ops"


def test_folder_uid() -> None:
    assert prov.folder_uid("specserve") == "specserve"
    assert prov.folder_uid(" Spec Serve / prod ") == "spec-serve-prod"
    with pytest.raises(ValueError):
        prov.folder_uid("///")
