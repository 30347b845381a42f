"""The specserve Grafana dashboard, as code (plain dicts -> Grafana dashboard JSON model).

    python -m cluster.grafana.dashboard --out cluster/grafana/specserve.json
    python -m cluster.k8s_monitoring      # the same JSON as a Grafana sidecar ConfigMap

Every query is built from `app.metrics` (the names Ray 2.60 actually exports, `ray_` prefix
included), so the dashboard cannot drift from the metric definitions. The datasource is a
dashboard variable (`${datasource}`, any Prometheus datasource) and `$application` filters by
Serve application. Plain dicts rather than grafana-foundation-sdk: no extra dependency, and the
JSON model is stable across Grafana 9-11.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from app import metrics as m

DASHBOARD_UID = "specserve"
DASHBOARD_TITLE = "specserve: speculative decoding on Ray Serve"
SCHEMA_VERSION = 39
DATASOURCE: dict[str, str] = {"type": "prometheus", "uid": "${datasource}"}
WINDOW = "$__rate_interval"
APP = 'application=~"$application"'
GRID_WIDTH = 24
STEP_TIME_HELP = ("Engine step time: decode, verify, draft, exchange, prefill. Means are approximate: "
                  "Ray 2.60 exports a histogram's _sum from bucket midpoints, not observed values.")

NODES_HELP = ("Per Ray node (the dashboard agent's reporter), not filtered by Serve application: every node "
              "Prometheus scrapes. GPU series exist only on nodes with GPUs.")

Panel = dict[str, Any]


class _Layout:
    """Places panels left to right in rows of GRID_WIDTH columns; ids are assigned in order."""

    def __init__(self) -> None:
        self.panels: list[Panel] = []
        self._x = 0
        self._y = 0
        self._row_h = 0

    def add(self, panel: Panel, w: int, h: int = 8) -> None:
        if self._x + w > GRID_WIDTH:
            self._x, self._y, self._row_h = 0, self._y + self._row_h, 0
        panel["id"] = len(self.panels) + 1
        panel["gridPos"] = {"x": self._x, "y": self._y, "w": w, "h": h}
        self._x += w
        self._row_h = max(self._row_h, h)
        self.panels.append(panel)

    def row(self, title: str) -> None:
        self._x, self._y, self._row_h = GRID_WIDTH, self._y + self._row_h, 0
        self.add({"type": "row", "title": title, "collapsed": False, "panels": [],
                  "datasource": DATASOURCE}, GRID_WIDTH, 1)


def _target(expr: str, legend: str, ref: str) -> dict[str, Any]:
    return {"datasource": DATASOURCE, "expr": expr, "legendFormat": legend, "refId": ref,
            "range": True, "instant": False}


def timeseries(title: str, targets: list[tuple[str, str]], unit: str = "short",
               description: str = "", stacked: bool = False,
               minmax: tuple[float | None, float | None] = (None, None)) -> Panel:
    defaults: dict[str, Any] = {
        "unit": unit,
        "custom": {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 30 if stacked else 10,
                   "stacking": {"mode": "normal" if stacked else "none", "group": "A"},
                   "showPoints": "never", "spanNulls": False},
    }
    if minmax[0] is not None:
        defaults["min"] = minmax[0]
    if minmax[1] is not None:
        defaults["max"] = minmax[1]
    return {
        "type": "timeseries", "title": title, "description": description, "datasource": DATASOURCE,
        "targets": [_target(e, legend, chr(ord("A") + i)) for i, (e, legend) in enumerate(targets)],
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                    "tooltip": {"mode": "multi", "sort": "desc"}},
    }


def _by_replica(metric: m.MetricDef) -> str:
    return f"sum by (deployment, replica) ({metric.exported}{{{APP}}})"


def _rate_by(metric: m.MetricDef, by: str = "") -> str:
    grouping = f" by ({by})" if by else ""
    return f"sum{grouping} (rate({metric.exported}{{{APP}}}[{WINDOW}]))"


def _quantiles(metric: m.MetricDef) -> list[tuple[str, str]]:
    return [(m.histogram_quantile_promql(metric, q, WINDOW, APP), f"p{round(q * 100)}") for q in (0.5, 0.99)]


def build_panels() -> list[Panel]:
    lay = _Layout()
    lay.row("Throughput")
    lay.add(timeseries(
        "Requests by finish reason", [(_rate_by(m.REQUEST_SUCCESS, "finished_reason"), "{{finished_reason}}")],
        unit="reqps", stacked=True,
        description="requests ended per second: stop / length (the engine finished them), abort (client gone)"),
        w=8)
    lay.add(timeseries(
        "Tokens per second", [(_rate_by(m.GENERATION_TOKENS), "generated"), (_rate_by(m.PROMPT_TOKENS), "prompt")],
        unit="short", description="generated tokens streamed to clients, and prompt tokens of requests that "
                                  "started generating, per second"), w=8)
    lay.add(timeseries(
        "Generated tokens per second by model", [(_rate_by(m.GENERATION_TOKENS, "model_name"), "{{model_name}}")],
        unit="short", stacked=True), w=8)

    lay.row("Errors")
    lay.add(timeseries(
        "Errors by status", [(_rate_by(m.REQUEST_ERRORS, "status"), "{{status}}")], unit="reqps", stacked=True,
        description="requests answered with a 4xx/5xx per second (429/503: overloaded, 504: deadline)"), w=8)
    lay.add(timeseries(
        "5xx error ratio", [(m.error_ratio_promql(WINDOW, APP), "5xx / ended")], unit="percentunit",
        minmax=(0, 1), description="5xx answers / (finished + failed requests)"), w=8)
    lay.add(timeseries(
        "Failovers, draft misses, plain steps (draft down)",
        [(_rate_by(m.FAILOVERS), "target failovers"), (_rate_by(m.DRAFT_MISSES), "draft cache misses"),
         (_rate_by(m.PLAIN_NO_DRAFT), "plain steps: no draft")],
        unit="short", description="per second: requests re-issued after a target replica failed; sequences "
                                  "a draft replica rebuilt by prefill; engine steps decoded plainly because "
                                  "no draft replica answered"), w=8)

    lay.row("Speculation")
    lay.add(timeseries(
        "Acceptance rate", [(m.acceptance_rate_promql(WINDOW, APP), "acceptance rate")],
        unit="percentunit", minmax=(0, 1),
        description="accepted draft tokens / proposed draft tokens"), w=8)
    lay.add(timeseries(
        "Mean acceptance length", [(m.mean_acceptance_length_promql(WINDOW, APP), "tokens / verify")],
        minmax=(1, None),
        description="1 + accepted / drafts: tokens emitted per target verify pass, bonus included"), w=8)
    lay.add(timeseries(
        "Acceptance by draft position", [(m.per_position_acceptance_promql(WINDOW, APP), "pos {{position}}")],
        unit="percentunit", minmax=(0, 1),
        description="share of drafts whose token at this position was accepted"), w=8)
    lay.add(timeseries(
        "Router decisions by reason",
        [(f"sum by (decision, reason) (rate({m.ROUTER_DECISIONS.exported}{{{APP}}}[{WINDOW}]))",
          "{{decision}} / {{reason}}")],
        unit="reqps", stacked=True, description="speculate / plain decisions per second, by reason"), w=8)
    lay.add(timeseries(
        "Engine step modes",
        [(f"sum by (mode) (rate({m.STEP_MODES.exported}{{{APP}}}[{WINDOW}]))", "{{mode}}")],
        unit="short", stacked=True,
        description="engine steps per second with 'auto' sequences, by the mode the measured-goodput arbiter ran: "
                    "plan (the step planner), on (all at default k), off (all plain)"), w=8)
    lay.add(timeseries(
        "Replicas per deployment",
        [(f"sum by (application, deployment) ({m.SERVE_REPLICA_HEALTHY}{{{APP}}})",
          "{{deployment}} healthy"),
         (f"max by (application, deployment) ({m.SERVE_TARGET_REPLICAS}{{{APP}}})",
          "{{deployment}} autoscaling target")],
        description="Ray Serve's own series: healthy replicas and the autoscaler's target"), w=8)

    lay.row("Latency")
    for metric, title in ((m.E2E_LATENCY, "End-to-end request latency"), (m.TTFT, "Time to first token"),
                          (m.TPOT, "Time per output token"), (m.ITL, "Inter-token latency"),
                          (m.QUEUE_TIME, "Queue time (target replica)")):
        lay.add(timeseries(title, _quantiles(metric), unit="s", description=metric.description), w=8)
    step = m.STEP_TIME
    lay.add(timeseries("Step time by kind", [
        (f"sum by (kind) (rate({step.series('sum')}{{{APP}}}[{WINDOW}]))"
         f" / sum by (kind) (rate({step.series('count')}{{{APP}}}[{WINDOW}]))", "{{kind}} mean"),
        (m.histogram_quantile_promql(step, 0.99, WINDOW, APP, by=("kind",)), "{{kind}} p99")],
        unit="s", description=STEP_TIME_HELP), w=8)

    lay.row("Load per replica")
    for metric, title in ((m.RUNNING_SEQUENCES, "Running sequences"), (m.QUEUE_LENGTH, "Queue length"),
                          (m.KV_CACHED_TOKENS, "KV cached tokens"),
                          (m.KV_CACHED_SEQUENCES, "KV cached sequences")):
        lay.add(timeseries(title, [(_by_replica(metric), "{{deployment}} {{replica}}")]), w=6)
    lay.add(timeseries("KV cache usage", [(_by_replica(m.KV_USAGE), "{{deployment}} {{replica}}")],
                       unit="percentunit", minmax=(0, 1), description=m.KV_USAGE.description), w=8)

    # Ray's node series carry no Serve application label: these panels show every node Prometheus
    # scrapes (NODES_HELP).
    lay.row("GPU and nodes")
    lay.add(timeseries(
        "GPU utilization", [(f"max by (ip, GpuIndex, GpuDeviceName) ({m.RAY_NODE_GPU_UTILIZATION})",
                             "{{ip}} GPU {{GpuIndex}} {{GpuDeviceName}}")],
        unit="percent", minmax=(0, 100), description=NODES_HELP), w=8)
    lay.add(timeseries(
        "GPU memory used", [
            (f"max by (ip, GpuIndex) ({m.RAY_NODE_GPU_MEMORY_USED}) * 1048576", "{{ip}} GPU {{GpuIndex}} used"),
            (f"max by (ip, GpuIndex) ({m.RAY_NODE_GPU_MEMORY_USED} + {m.RAY_NODE_GPU_MEMORY_AVAILABLE}) * 1048576",
             "{{ip}} GPU {{GpuIndex}} total")],
        unit="bytes", description=NODES_HELP + " Ray reports GPU memory in MiB; shown in bytes."), w=8)
    lay.add(timeseries(
        "CPU utilization per node", [(f"max by (ip) ({m.RAY_NODE_CPU_UTILIZATION})", "{{ip}}")],
        unit="percent", minmax=(0, 100), description=NODES_HELP), w=8)
    return lay.panels


def _templating() -> dict[str, Any]:
    return {"list": [
        {"name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus",
         "current": {}, "hide": 0, "refresh": 1, "regex": "", "options": []},
        {"name": "application", "label": "Serve application", "type": "query",
         "datasource": DATASOURCE,
         "query": {"query": f"label_values({m.SERVE_REPLICA_HEALTHY}, application)",
                   "refId": "application"},
         "definition": f"label_values({m.SERVE_REPLICA_HEALTHY}, application)",
         "includeAll": True, "allValue": ".*", "multi": True, "refresh": 2, "sort": 1,
         "current": {"selected": True, "text": ["All"], "value": ["$__all"]}, "hide": 0,
         "options": [], "regex": ""},
    ]}


def build_dashboard() -> dict[str, Any]:
    """The Grafana dashboard JSON model (no `id`: Grafana assigns it; `uid` is stable)."""
    return {
        "uid": DASHBOARD_UID,
        "title": DASHBOARD_TITLE,
        "tags": ["specserve", "ray-serve", "speculative-decoding"],
        "timezone": "browser",
        "schemaVersion": SCHEMA_VERSION,
        "version": 1,
        "editable": True,
        "graphTooltip": 1,
        "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"},
        "templating": _templating(),
        "annotations": {"list": []},
        "links": [],
        "panels": build_panels(),
    }


def render(dashboard: dict[str, Any] | None = None) -> str:
    return json.dumps(dashboard if dashboard is not None else build_dashboard(), indent=2) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="write here (default: stdout)")
    args = parser.parse_args(argv)
    text = render()
    if args.out is None:
        print(text, end="")
    else:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
