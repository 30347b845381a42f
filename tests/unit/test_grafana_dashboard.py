"""Structure of the generated Grafana dashboard; the committed JSON is up to date."""

from __future__ import annotations

import itertools
import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from app import metrics as m
from cluster.grafana import dashboard as dash

COMMITTED = Path(__file__).resolve().parents[2] / "cluster" / "grafana" / "specserve.json"
RAY_NAME_RE = re.compile(r"\bray_[a-z0-9_]+")
KNOWN_SERIES = {s for d in m.ALL_METRICS for s in d.exported_series} | {
    m.SERVE_REPLICA_HEALTHY, m.SERVE_TARGET_REPLICAS, m.SERVE_ONGOING_REQUESTS, *m.RAY_NODE_SERIES}
NODE_PANELS = {"GPU utilization", "GPU memory used", "CPU utilization per node"}


@pytest.fixture(scope="module")
def model() -> dict[str, Any]:
    return dash.build_dashboard()


def _data_panels(model: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in model["panels"] if p["type"] != "row"]


def _exprs(model: dict[str, Any]) -> list[str]:
    return [t["expr"] for p in _data_panels(model) for t in p["targets"]]


def test_top_level(model: dict[str, Any]) -> None:
    assert model["uid"] == "specserve" and model["title"]
    assert "id" not in model  # Grafana assigns ids; uid is what overwrite matches on
    names = [v["name"] for v in model["templating"]["list"]]
    assert names == ["datasource", "application"]
    assert model["templating"]["list"][0]["query"] == "prometheus"
    json.dumps(model)  # serialisable


def test_every_panel_has_a_datasource_and_targets(model: dict[str, Any]) -> None:
    for panel in model["panels"]:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
    for panel in _data_panels(model):
        assert panel["targets"], panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert len(set(refs)) == len(refs)
        for target in panel["targets"]:
            assert target["datasource"] == panel["datasource"]
            assert target["expr"].strip() and target["legendFormat"]


def test_exprs_reference_defined_metrics_only(model: dict[str, Any]) -> None:
    for panel in _data_panels(model):
        for expr in (t["expr"] for t in panel["targets"]):
            referenced = set(RAY_NAME_RE.findall(expr))
            assert referenced, expr
            assert referenced <= KNOWN_SERIES, referenced - KNOWN_SERIES
            if panel["title"] in NODE_PANELS:  # Ray's node series have no application label
                assert referenced <= set(m.RAY_NODE_SERIES), expr
            else:
                assert 'application=~"$application"' in expr


def test_every_metric_is_on_the_dashboard(model: dict[str, Any]) -> None:
    text = "\n".join(_exprs(model))
    for d in m.ALL_METRICS:
        assert any(s in text for s in d.exported_series), d.name


def test_required_panels(model: dict[str, Any]) -> None:
    titles = {p["title"] for p in model["panels"]}
    assert {"Acceptance rate", "Mean acceptance length", "Acceptance by draft position",
            "Router decisions by reason", "Time to first token", "Time per output token",
            "Step time by kind", "Running sequences", "Queue length", "KV cached tokens",
            "Replicas per deployment"} <= titles
    by_title = {p["title"]: p for p in model["panels"]}
    decisions = by_title["Router decisions by reason"]
    assert decisions["fieldConfig"]["defaults"]["custom"]["stacking"]["mode"] == "normal"
    assert "by (decision, reason)" in decisions["targets"][0]["expr"]
    for title in ("Time to first token", "Time per output token"):
        exprs = [t["expr"] for t in by_title[title]["targets"]]
        assert [e.split(",")[0] for e in exprs] == ["histogram_quantile(0.5", "histogram_quantile(0.99"]


def test_request_level_panels(model: dict[str, Any]) -> None:
    """Issue 51: throughput, errors and latency from the request-level metrics."""
    by_title = {p["title"]: p for p in model["panels"]}
    rows = [p["title"] for p in model["panels"] if p["type"] == "row"]
    assert rows[:3] == ["Throughput", "Errors", "Speculation"] and "Latency" in rows
    want = {
        "Requests by finish reason": [m.REQUEST_SUCCESS],
        "Tokens per second": [m.GENERATION_TOKENS, m.PROMPT_TOKENS],
        "Errors by status": [m.REQUEST_ERRORS],
        "5xx error ratio": [m.REQUEST_ERRORS, m.REQUEST_SUCCESS],
        "Failovers, draft misses, plain steps (draft down)": [m.FAILOVERS, m.DRAFT_MISSES, m.PLAIN_NO_DRAFT],
        "End-to-end request latency": [m.E2E_LATENCY],
        "Inter-token latency": [m.ITL],
        "Queue time (target replica)": [m.QUEUE_TIME],
        "KV cache usage": [m.KV_USAGE],
    }
    for title, metrics in want.items():
        text = " ".join(t["expr"] for t in by_title[title]["targets"])
        for d in metrics:
            assert d.exported in text, (title, d.name)
    assert "by (finished_reason)" in by_title["Requests by finish reason"]["targets"][0]["expr"]
    assert "by (status)" in by_title["Errors by status"]["targets"][0]["expr"]
    assert by_title["KV cache usage"]["fieldConfig"]["defaults"]["unit"] == "percentunit"


def test_gpu_panels(model: dict[str, Any]) -> None:
    """Issue 51: GPU utilization and memory per GPU, from Ray's node series."""
    rows = [p["title"] for p in model["panels"] if p["type"] == "row"]
    assert rows[-1] == "GPU and nodes"
    by_title = {p["title"]: p for p in model["panels"]}
    assert NODE_PANELS <= set(by_title)
    util = by_title["GPU utilization"]
    assert util["targets"][0]["expr"] == f"max by (ip, GpuIndex, GpuDeviceName) ({m.RAY_NODE_GPU_UTILIZATION})"
    assert util["fieldConfig"]["defaults"]["unit"] == "percent"
    mem = by_title["GPU memory used"]
    assert all(t["expr"].endswith("* 1048576") for t in mem["targets"])  # MiB -> bytes
    assert m.RAY_NODE_GPU_MEMORY_USED in mem["targets"][0]["expr"]


def test_ids_unique_and_grid_without_overlap(model: dict[str, Any]) -> None:
    ids = [p["id"] for p in model["panels"]]
    assert len(set(ids)) == len(ids)
    boxes = []
    for p in model["panels"]:
        g = p["gridPos"]
        assert g["w"] > 0 and g["h"] > 0 and g["x"] >= 0 and g["y"] >= 0
        assert g["x"] + g["w"] <= dash.GRID_WIDTH, p["title"]
        boxes.append((p["title"], g))
    for (ta, a), (tb, b) in itertools.combinations(boxes, 2):
        overlap = (a["x"] < b["x"] + b["w"] and b["x"] < a["x"] + a["w"]
                   and a["y"] < b["y"] + b["h"] and b["y"] < a["y"] + a["h"])
        assert not overlap, (ta, tb)


def test_committed_json_is_current(model: dict[str, Any]) -> None:
    assert COMMITTED.read_text() == dash.render(model), (
        "regenerate: python -m cluster.grafana.dashboard --out cluster/grafana/specserve.json")


def test_cli_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "d.json"
    assert dash.main(["--out", str(out)]) == 0
    assert json.loads(out.read_text())["uid"] == "specserve"


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Debian prometheus) missing")
def test_exprs_parse_with_promtool(model: dict[str, Any], tmp_path: Path) -> None:
    lines = ["groups:", "  - name: dashboard", "    rules:"]
    for i, expr in enumerate(_exprs(model)):
        concrete = expr.replace("$__rate_interval", "1m").replace("$application", ".*")
        lines += [f"      - record: dashboard:check_{i}", f"        expr: '{concrete}'"]
    path = tmp_path / "rules.yml"
    path.write_text("\n".join(lines) + "\n")
    proc = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
