"""ServeMetrics on a real local Ray: the series appear on Ray's metrics port under the names
app/metrics.py says they do, with the values recorded."""

from __future__ import annotations

import re
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from app import metrics as m

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

pytestmark = pytest.mark.serve

SCRAPE_DEADLINE_S = 60.0
_SAMPLE_RE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)$")
_LABEL_RE = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')

# Two verify steps: 6 drafts, 20 draft tokens, 11 accepted.
STEPS = [
    dict(drafted=12, accepted=7, num_drafts=3, accepted_per_pos=[3, 2, 1, 1]),
    dict(drafted=8, accepted=4, num_drafts=3, accepted_per_pos=[2, 1, 1]),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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


@pytest.fixture(scope="module")
def metrics_port() -> Iterator[int]:
    port = _free_port()
    ray.init(num_cpus=2, include_dashboard=False, _metrics_export_port=port,
             configure_logging=False, log_to_driver=False)
    try:
        serve.start(proxy_location="Disabled")
        yield port
    finally:
        serve.shutdown()
        ray.shutdown()


@serve.deployment(ray_actor_options={"num_cpus": 0})
class MetricsProbe:
    def __init__(self) -> None:
        from deployments.metrics_ray import ServeMetrics

        self.metrics = ServeMetrics()

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
        self.metrics.set_load(running=3, queue=2, kv_tokens=512, kv_seqs=3)
        return "ok"


def _scrape_until(port: int, names: list[str]) -> list[tuple[str, dict[str, str], float]]:
    deadline = time.monotonic() + SCRAPE_DEADLINE_S
    last = ""
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
                last = resp.read().decode()
        except (urllib.error.URLError, OSError):
            last = ""
        samples = parse_exposition(last)
        present = {n for n, _, _ in samples}
        if all(name in present for name in names):
            return samples
        time.sleep(1.0)
    found = sorted({n for n, _, _ in parse_exposition(last) if "specserve" in n})
    pytest.fail(f"metrics {names} not exported within {SCRAPE_DEADLINE_S}s; specserve series: {found}")


def test_serve_metrics_are_exported_under_documented_names(metrics_port: int) -> None:
    handle = serve.run(MetricsProbe.bind(), name="metrics_probe", route_prefix=None)
    assert handle.remote().result(timeout_s=60) == "ok"

    wanted = [series for d in m.ALL_METRICS for series in d.exported_series]
    wanted.append(m.SERVE_REPLICA_HEALTHY)
    samples = _scrape_until(metrics_port, wanted)

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

    # Serve adds deployment/replica/application labels by itself.
    labels = next(lab for n, lab, _ in samples if n == m.RUNNING_SEQUENCES.exported)
    assert labels["deployment"] == "MetricsProbe"
    assert labels["application"] == "metrics_probe"
    assert labels["replica"]
    # The Serve series the dashboard reads exist too.
    assert any(n == m.SERVE_REPLICA_HEALTHY for n, _, _ in samples)
