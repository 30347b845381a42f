"""ServeMetrics on a real local Ray: the series appear on Ray's metrics port under the names
app/metrics.py says they do, with the values recorded.

Ray's metrics export port can only be set by the `ray.init` that starts Ray, and the pytest
process already holds the session Ray of tests/serve/conftest.py. So the probe runs in a child
process with its own Ray (own RAY_TMPDIR, `address="local"`), which scrapes its metrics port on
127.0.0.1 and hands the parsed samples back as JSON; the assertions run here."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from app import metrics as m
from app.config import PROJECT_ROOT
from bench.app_process import free_port

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

pytestmark = pytest.mark.serve

SCRAPE_DEADLINE_S = 60.0
CHILD_TIMEOUT_S = 300.0
_SAMPLE_RE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)$")
_LABEL_RE = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')

# Two verify steps: 6 drafts, 20 draft tokens, 11 accepted.
STEPS = [
    dict(drafted=12, accepted=7, num_drafts=3, accepted_per_pos=[3, 2, 1, 1]),
    dict(drafted=8, accepted=4, num_drafts=3, accepted_per_pos=[2, 1, 1]),
]


def parse_exposition(text: str) -> list[tuple[str, dict[str, str], float]]:
    samples = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE_RE.match(line)
        if match:
            labels = dict(_LABEL_RE.findall(match.group(3) or ""))
            samples.append((match.group(1), labels, float(match.group(4))))
    return samples


def _total(samples: list[tuple[str, dict[str, str], float]], name: str, **want: str) -> float:
    return sum(v for n, labels, v in samples
               if n == name and all(labels.get(k) == val for k, val in want.items()))


def _midpoint(buckets: tuple[float, ...], value: float) -> float:
    """What Ray 2.60 adds to a histogram's _sum for `value` (OpenTelemetry recorder)."""
    lower = 0.0
    for upper in buckets:
        if value <= upper:
            return (lower + upper) / 2
        lower = upper
    return buckets[-1] * 2


@serve.deployment(ray_actor_options={"num_cpus": 0})
class MetricsProbe:
    def __init__(self) -> None:
        from deployments.metrics_ray import ServeMetrics

        self.metrics = ServeMetrics(model_name="meta-llama/Probe-1B")

    def __call__(self) -> str:
        for step in STEPS:
            self.metrics.record_step(**step)
        self.metrics.record_step(drafted=0, accepted=0, num_drafts=0)  # zero incs are skipped
        self.metrics.record_decision("speculate", "low_load_long_output")
        self.metrics.record_decision("speculate", "low_load_long_output")
        self.metrics.record_decision("plain", "high_load")
        self.metrics.observe_ttft(0.05)
        self.metrics.observe_tpot(0.004)
        for kind, seconds in (("verify", 0.02), ("draft", 0.003), ("exchange", 0.0002)):
            self.metrics.observe_step(kind, seconds)
        self.metrics.record_step_mode("on")
        self.metrics.set_load(running=3, queue=2, kv_tokens=512, kv_seqs=3)
        # request-level metrics (router side, then target side)
        self.metrics.record_prompt_tokens(17)
        self.metrics.record_prompt_tokens(0)  # skipped, like every zero increment
        self.metrics.record_generation_tokens(5)
        self.metrics.record_generation_tokens(3)
        self.metrics.observe_e2e(1.2)
        self.metrics.observe_itl(0.03)
        self.metrics.record_finished("length")
        self.metrics.record_finished("length")
        self.metrics.record_finished("abort")
        self.metrics.record_error(503)
        self.metrics.record_failover()
        self.metrics.observe_queue_time(0.002)
        self.metrics.set_kv_usage(0.25)
        self.metrics.record_draft_misses(2)
        self.metrics.record_plain_no_draft_step()
        return "ok"


def _wanted_series() -> list[str]:
    wanted = [series for d in m.ALL_METRICS for series in d.exported_series]
    wanted.append(m.SERVE_REPLICA_HEALTHY)
    return wanted


def _scrape_until(port: int, names: list[str]) -> tuple[list[tuple[str, dict[str, str], float]], str]:
    """Scrape until every name is present or the deadline passes; (samples, last text)."""
    deadline = time.monotonic() + SCRAPE_DEADLINE_S
    last = ""
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
                last = resp.read().decode()
        except (urllib.error.URLError, OSError):
            last = ""
        samples = parse_exposition(last)
        if set(names) <= {n for n, _, _ in samples}:
            return samples, last
        time.sleep(1.0)
    return parse_exposition(last), last


def _child_main(metrics_port: int, out_path: str) -> None:
    """In the child: own Ray with the export port, the probe deployed and called, one scrape."""
    ray.init(address="local", num_cpus=2, include_dashboard=False, _metrics_export_port=metrics_port,
             configure_logging=False, log_to_driver=False)
    try:
        serve.start(proxy_location="Disabled")
        handle = serve.run(MetricsProbe.bind(), name="metrics_probe", route_prefix=None)
        reply = handle.remote().result(timeout_s=60)
        samples, _ = _scrape_until(metrics_port, _wanted_series())
        Path(out_path).write_text(json.dumps({"reply": reply, "samples": samples}))
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


@pytest.fixture(scope="module")
def probe_result() -> dict:
    # Short temp path: Ray's unix sockets live under RAY_TMPDIR (108-byte limit).
    tmp = Path(tempfile.mkdtemp(prefix="ssm", dir="/tmp"))
    out = tmp / "samples.json"
    env = dict(os.environ, RAY_TMPDIR=str(tmp), PYTHONUNBUFFERED="1")
    env.pop("RAY_ADDRESS", None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PROJECT_ROOT), env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "tests.serve.test_ray_metrics_export", str(free_port()), str(out)]
    try:
        proc = subprocess.run(cmd, cwd=PROJECT_ROOT, env=env, capture_output=True, text=True,
                              timeout=CHILD_TIMEOUT_S)
        if proc.returncode != 0 or not out.exists():
            pytest.fail(f"metrics probe child failed ({proc.returncode}):\n"
                        f"{(proc.stdout + proc.stderr)[-4000:]}")
        return json.loads(out.read_text())
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def test_serve_metrics_are_exported_under_documented_names(probe_result: dict) -> None:
    assert probe_result["reply"] == "ok"
    samples = [(n, labels, v) for n, labels, v in probe_result["samples"]]
    missing = sorted(set(_wanted_series()) - {n for n, _, _ in samples})
    assert not missing, f"not exported within {SCRAPE_DEADLINE_S}s: {missing}"

    drafted = _total(samples, m.NUM_DRAFT_TOKENS.exported)
    accepted = _total(samples, m.NUM_ACCEPTED_TOKENS.exported)
    drafts = _total(samples, m.NUM_DRAFTS.exported)
    assert (drafted, accepted, drafts) == (20, 11, 6)
    assert accepted / drafted == pytest.approx(11 / 20)  # acceptance rate
    assert 1 + accepted / drafts == pytest.approx(1 + 11 / 6)  # mean acceptance length
    per_pos = [_total(samples, m.NUM_ACCEPTED_PER_POS.exported, position=str(i)) for i in range(4)]
    assert per_pos == [5, 3, 2, 1]

    assert _total(samples, m.ROUTER_DECISIONS.exported,
                  decision="speculate", reason="low_load_long_output") == 2
    assert _total(samples, m.ROUTER_DECISIONS.exported, decision="plain", reason="high_load") == 1
    assert _total(samples, m.STEP_TIME.series("count"), kind="verify") == 1
    assert _total(samples, m.TTFT.series("bucket"), le="+Inf") == 1
    # Ray exports every histogram bucket and approximates _sum by bucket midpoints.
    les = {lab["le"] for n, lab, _ in samples if n == m.TTFT.series("bucket")}
    assert {float(le) for le in les} == {*m.TTFT.buckets, float("inf")}
    assert _total(samples, m.TTFT.series("sum")) == pytest.approx(_midpoint(m.TTFT.buckets, 0.05))
    assert _total(samples, m.STEP_TIME.series("sum"), kind="verify") == pytest.approx(
        _midpoint(m.STEP_TIME.buckets, 0.02))
    assert _total(samples, m.KV_CACHED_TOKENS.exported) == 512

    # Issue 51's request-level series, each with the model_name label.
    assert _total(samples, m.PROMPT_TOKENS.exported) == 17
    assert _total(samples, m.GENERATION_TOKENS.exported) == 8
    assert _total(samples, m.REQUEST_SUCCESS.exported, finished_reason="length") == 2
    assert _total(samples, m.REQUEST_SUCCESS.exported, finished_reason="abort") == 1
    assert _total(samples, m.REQUEST_ERRORS.exported, status="503") == 1
    assert _total(samples, m.FAILOVERS.exported) == 1
    for hist in (m.E2E_LATENCY, m.ITL, m.QUEUE_TIME):
        assert _total(samples, hist.series("count")) == 1, hist.name
    assert _total(samples, m.E2E_LATENCY.series("bucket"), le="1.5") == 1
    assert _total(samples, m.E2E_LATENCY.series("bucket"), le="1.0") == 0
    assert _total(samples, m.KV_USAGE.exported) == 0.25
    assert _total(samples, m.DRAFT_MISSES.exported) == 2
    assert _total(samples, m.PLAIN_NO_DRAFT.exported) == 1
    ours = [lab for n, lab, _ in samples if n.startswith("ray_specserve_")]
    assert ours and all(lab.get("model_name") == "meta-llama/Probe-1B" for lab in ours)

    # Serve adds deployment/replica/application labels by itself.
    labels = next(lab for n, lab, _ in samples if n == m.RUNNING_SEQUENCES.exported)
    assert labels["deployment"] == "MetricsProbe"
    assert labels["application"] == "metrics_probe"
    assert labels["replica"]
    # The Serve series the dashboard reads exist too.
    assert any(n == m.SERVE_REPLICA_HEALTHY for n, _, _ in samples)


if __name__ == "__main__":
    _child_main(int(sys.argv[1]), sys.argv[2])
