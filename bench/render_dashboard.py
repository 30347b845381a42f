"""Render the Grafana dashboard's panels to a PNG from real metrics, without Grafana.

    python -m bench.render_dashboard                       # ~5 min: run, query, plot
    python -m bench.render_dashboard --from-data bench/results/dashboard-data.json   # re-plot only

What it does:
1. starts the app (default configs/autoscale-local.yaml, so the replica panel moves) in its own
   Ray with a metrics port (bench/app_process.py), and Debian's Prometheus scraping it every
   second on loopback (bench/prometheus_process.py, config rendered from cluster/prometheus.yml);
2. sends a traffic profile through the OpenAI API: a single client, a burst of concurrent
   streaming clients (the autoscaler and the router policy react), forced speculation on/off,
   then idle (scale-down);
3. evaluates every query of every panel of cluster/grafana/dashboard.py (the same PromQL Grafana
   would run, with $__rate_interval and $application filled in) through Prometheus' range API;
4. plots them with matplotlib in the dashboard's own grid layout, and saves the query results
   as JSON next to it so the figure can be re-plotted or checked.
"""

from __future__ import annotations

import argparse
import json
import re
import threading
import time
from pathlib import Path
from typing import Any

from app.config import PROJECT_ROOT, load_yaml, serve_config_args

RATE_WINDOW = "15s"  # $__rate_interval: >= 4 scrape intervals (1 s) and smooth enough to read
STEP_S = 2.0
PROMPTS = (
    "def read_config(path):\n",
    "import os\nimport sys\n\n\nclass ",
    "    for i in range(len(items)):\n",
    "def __init__(self, name, value=None):\n        self.",
)
# (seconds, clients, speculation, stream, max_tokens)
PROFILE: tuple[tuple[float, int, str, bool, int], ...] = (
    (25, 1, "auto", False, 64),
    (70, 6, "auto", True, 160),
    (35, 2, "on", True, 96),
    (25, 2, "off", False, 64),
    (45, 0, "auto", False, 0),  # idle: scale-down
)


# ------------------------------------------------------------------------------------- traffic
def _client(url: str, stop: threading.Event, i: int, speculation: str, stream: bool, max_tokens: int,
            stats: dict[str, int]) -> None:
    import httpx

    n = 0
    with httpx.Client(timeout=180) as client:
        while not stop.is_set():
            body = {"model": "specserve-embedded", "prompt": PROMPTS[(i + n) % len(PROMPTS)],
                    "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                    "speculation": speculation, "stream": stream}
            try:
                if stream:
                    with client.stream("POST", f"{url}/v1/completions", json=body) as r:
                        for _ in r.iter_lines():
                            pass
                        ok = r.status_code == 200
                else:
                    ok = client.post(f"{url}/v1/completions", json=body).status_code == 200
            except httpx.HTTPError:
                ok = False
            stats["ok" if ok else "failed"] += 1
            n += 1


def run_profile(url: str) -> dict[str, int]:
    stats = {"ok": 0, "failed": 0}
    for seconds, clients, speculation, stream, max_tokens in PROFILE:
        print(f"  {seconds:.0f}s: {clients} clients, speculation={speculation}, stream={stream}", flush=True)
        stop = threading.Event()
        threads = [threading.Thread(target=_client, args=(url, stop, i, speculation, stream, max_tokens, stats),
                                    daemon=True) for i in range(clients)]
        for t in threads:
            t.start()
        time.sleep(seconds)
        stop.set()
        for t in threads:
            t.join(timeout=180)
    return stats


# ------------------------------------------------------------------------------------- queries
def _fill(expr: str) -> str:
    return expr.replace("$__rate_interval", RATE_WINDOW).replace("$application", "specserve")


def _legend(fmt: str, labels: dict[str, str]) -> str:
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda mt: labels.get(mt.group(1), ""), fmt) or "value"


def collect(prom: Any, start: float, end: float) -> list[dict[str, Any]]:
    from cluster.grafana.dashboard import build_panels

    panels = []
    for panel in build_panels():
        entry: dict[str, Any] = {k: panel.get(k) for k in ("type", "title", "gridPos", "description")}
        if panel["type"] != "row":
            defaults = panel["fieldConfig"]["defaults"]
            entry.update(unit=defaults.get("unit"), min=defaults.get("min"), max=defaults.get("max"),
                         stacked=defaults["custom"]["stacking"]["mode"] == "normal", series=[])
            for target in panel["targets"]:
                expr = _fill(target["expr"])
                for result in prom.query_range(expr, start, end, STEP_S):
                    entry["series"].append({
                        "legend": _legend(target["legendFormat"], result["metric"]), "expr": expr,
                        "points": [[float(t) - start, float(v)] for t, v in result["values"]],
                    })
        panels.append(entry)
    return panels


# ---------------------------------------------------------------------------------------- plot
def _short_legend(text: str) -> str:
    # replica ids make long legends; keep them recognisable
    return text if len(text) <= 34 else text[:31] + "..."


def plot(data: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, PercentFormatter

    panels = data["panels"]
    rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels)
    fig = plt.figure(figsize=(22, rows * 0.52), facecolor="#111217")
    grid = fig.add_gridspec(rows, 24, hspace=1.6, wspace=1.2, left=0.03, right=0.99, top=0.95, bottom=0.03)
    fig.suptitle(f"{data['title']}  (rendered from Prometheus: {data['source']})", color="#d8d9da",
                 fontsize=14, x=0.01, ha="left")
    # traffic phases: dashed lines in every panel, described once at the top
    bounds, phases, t = [], [], 0.0
    for seconds, clients, speculation, stream, _ in data["profile"]:
        phases.append(f"{t:.0f}-{t + seconds:.0f}s: " + (f"{clients} {'streaming ' if stream else ''}client"
                      f"{'s' if clients != 1 else ''}, speculation={speculation}" if clients else "idle"))
        t += seconds
        bounds.append(t)
    fig.text(0.01, 0.962, "traffic (OpenAI API, greedy): " + " | ".join(phases) +
             f" | {data['requests']['ok']} requests, {data['requests']['failed']} failed;"
             f" rate window {data['rate_window']}", color="#8e8e8e", fontsize=9)
    text_color, grid_color = "#ccccdc", "#2c3235"
    for p in panels:
        g = p["gridPos"]
        if p["type"] == "row":
            ax = fig.add_subplot(grid[g["y"]:g["y"] + 1, :])
            ax.axis("off")
            ax.text(0, 0.2, p["title"], color="#d8d9da", fontsize=13, fontweight="bold", transform=ax.transAxes)
            continue
        ax = fig.add_subplot(grid[g["y"] + 1:g["y"] + g["h"], g["x"]:g["x"] + g["w"]])
        ax.set_facecolor("#181b1f")
        ax.set_title(p["title"], color=text_color, fontsize=10, loc="left")
        ax.tick_params(colors=text_color, labelsize=7)
        for spine in ax.spines.values():
            spine.set_color(grid_color)
        ax.grid(color=grid_color, linewidth=0.6)
        series = [s for s in p["series"] if s["points"]]
        if not series:
            ax.text(0.5, 0.5, "No data", color=text_color, ha="center", va="center", transform=ax.transAxes)
            continue
        if p["stacked"]:
            times = sorted({t for s in series for t, _ in s["points"]})
            ys = [[dict(s["points"]).get(t, 0.0) for t in times] for s in series]
            ax.stackplot(times, ys, labels=[_short_legend(s["legend"]) for s in series], alpha=0.75)
        else:
            for s in series:
                ts, vs = zip(*s["points"])
                ax.plot(ts, vs, linewidth=1.3, label=_short_legend(s["legend"]))
        for b in bounds[:-1]:
            ax.axvline(b, color="#5a5f66", linestyle="--", linewidth=0.8)
        unit = p.get("unit")
        if unit == "percentunit":
            ax.yaxis.set_major_formatter(PercentFormatter(1.0))
        elif unit == "s":
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v * 1000:.0f} ms" if v < 1 else f"{v:.1f} s"))
        lo, hi = p.get("min"), p.get("max")
        if lo is not None or hi is not None:
            ax.set_ylim(bottom=lo, top=hi)
        ax.set_xlabel("seconds since start of traffic", color=text_color, fontsize=7)
        legend = ax.legend(fontsize=6, loc="upper left", framealpha=0.3, ncol=2 if len(series) > 4 else 1)
        for t in legend.get_texts():
            t.set_color(text_color)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=80, facecolor=fig.get_facecolor())
    plt.close(fig)


# ---------------------------------------------------------------------------------------- main
def record(config: Path) -> dict[str, Any]:
    from bench.app_process import AppProcess
    from bench.prometheus_process import PrometheusProcess
    from cluster.grafana.dashboard import DASHBOARD_TITLE

    args = serve_config_args(load_yaml(config)["applications"][0])
    with AppProcess(args, num_cpus=2) as app, PrometheusProcess(app.metrics_port, 1.0) as prom:
        print(f"app on {app.url}, Ray metrics on :{app.metrics_port}, Prometheus on {prom.url}", flush=True)
        while prom.scalar('up{job="ray"}') != 1.0:
            time.sleep(1)
        start = time.time()
        stats = run_profile(app.url)
        end = time.time()
        time.sleep(3)
        panels = collect(prom, start, end)
        version = prom.version()
    return {"title": DASHBOARD_TITLE, "source": f"{config.name} on CPU, Prometheus {version}",
            "config": str(config.relative_to(PROJECT_ROOT)), "start": start, "end": end,
            "rate_window": RATE_WINDOW, "step_s": STEP_S, "profile": [list(p) for p in PROFILE],
            "requests": stats, "panels": panels}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=PROJECT_ROOT / "configs" / "autoscale-local.yaml")
    parser.add_argument("--out", type=Path, default=PROJECT_ROOT / "docs" / "dashboard.png")
    parser.add_argument("--data", type=Path, default=PROJECT_ROOT / "bench" / "results" / "dashboard-data.json")
    parser.add_argument("--from-data", type=Path, default=None, help="re-plot saved query results")
    args = parser.parse_args(argv)
    if args.from_data is not None:
        data = json.loads(args.from_data.read_text())
    else:
        data = record(args.config.resolve())
        args.data.parent.mkdir(parents=True, exist_ok=True)
        args.data.write_text(json.dumps(data, separators=(",", ":")) + "\n")
        print(f"query results: {args.data} ({data['requests']})")
    plot(data, args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
