"""A throwaway Prometheus on 127.0.0.1 scraping one Ray metrics port (tests, dashboard renders).

    with PrometheusProcess(metrics_port, scrape_interval_s=1.0) as prom:
        prom.query('up{job="ray"}')                       # instant vector, as a list of results
        prom.query_range(expr, start, end, step)           # matrix

The config is cluster/prometheus.yml rendered for loopback by
cluster.prometheus_test_config.render_prometheus_config; storage lives in a temp dir removed on
exit. The binary is $PROMETHEUS_BIN, else `prometheus` on PATH, else /usr/bin/prometheus
(Debian's package).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from cluster.prometheus_test_config import render_prometheus_config


def prometheus_binary() -> str | None:
    env = os.environ.get("PROMETHEUS_BIN")
    if env:
        return env if os.access(env, os.X_OK) else None
    found = shutil.which("prometheus")
    if found:
        return found
    return "/usr/bin/prometheus" if os.access("/usr/bin/prometheus", os.X_OK) else None


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PrometheusError(RuntimeError):
    pass


class PrometheusProcess:
    def __init__(self, metrics_port: int, scrape_interval_s: float = 1.0, binary: str | None = None,
                 startup_timeout_s: float = 60.0) -> None:
        binary = binary or prometheus_binary()
        if binary is None:
            raise FileNotFoundError("prometheus binary not found (apt-get install prometheus)")
        self.binary = binary
        self.metrics_port = metrics_port
        self.scrape_interval_s = scrape_interval_s
        self.startup_timeout_s = startup_timeout_s
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.tmp: Path | None = None
        self.proc: subprocess.Popen | None = None

    def log_tail(self, n: int = 3000) -> str:
        try:
            assert self.tmp is not None
            return (self.tmp / "prometheus.log").read_text(errors="replace")[-n:]
        except (OSError, AssertionError):
            return ""

    def __enter__(self) -> "PrometheusProcess":
        self.tmp = Path(tempfile.mkdtemp(prefix="specserve-prom-"))
        config = self.tmp / "prometheus.yml"
        config.write_text(render_prometheus_config(self.metrics_port, self.scrape_interval_s))
        cmd = [self.binary, f"--config.file={config}", f"--web.listen-address=127.0.0.1:{self.port}",
               f"--storage.tsdb.path={self.tmp / 'data'}", "--storage.tsdb.retention.time=1h",
               "--log.level=warn"]
        with open(self.tmp / "prometheus.log", "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, OSError):
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = self.log_tail()
                self.__exit__(None, None, None)
                raise PrometheusError(f"prometheus did not become ready:\n{tail}")
            time.sleep(0.3)

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)

    # ---- HTTP API ----------------------------------------------------------------------------
    def _api(self, path: str, params: dict[str, Any]) -> Any:
        data = urllib.parse.urlencode(params).encode()
        req = urllib.request.Request(f"{self.url}/api/v1/{path}", data=data, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=20) as r:
                body = json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise PrometheusError(f"{path} {params}: HTTP {e.code}: {e.read()[:500]!r}") from None
        if body.get("status") != "success":
            raise PrometheusError(f"{path} {params}: {body}")
        return body["data"]

    def version(self) -> str:
        with urllib.request.urlopen(f"{self.url}/api/v1/status/buildinfo", timeout=10) as r:
            return str(json.loads(r.read())["data"]["version"])

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        """Instant query (at a unix time, default now); returns the vector's results."""
        params: dict[str, Any] = {"query": expr}
        if at is not None:
            params["time"] = f"{at:.3f}"
        data = self._api("query", params)
        if data["resultType"] == "scalar":
            return [{"metric": {}, "value": data["result"]}]
        return data["result"]

    def scalar(self, expr: str, at: float | None = None) -> float | None:
        """One-element query result as a float; None when the result is empty."""
        result = self.query(expr, at)
        if not result:
            return None
        if len(result) != 1:
            raise PrometheusError(f"{expr}: expected one series, got {len(result)}")
        return float(result[0]["value"][1])

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
        return self._api("query_range", {"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}",
                                         "step": f"{step}"})["result"]
