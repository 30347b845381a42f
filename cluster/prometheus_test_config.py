"""Render a loopback-only Prometheus config from cluster/prometheus/prometheus.yml, for tests.

`cluster/prometheus/prometheus.yml` discovers Ray nodes through Ray's file_sd JSON, whose targets
are node IPs. Tests here may only talk to 127.0.0.1, so the same config is rendered with the
file_sd block replaced by one static target, 127.0.0.1:<metrics_export_port>, and a short interval.
Its rule files are made absolute, so the rendered file may be written anywhere.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

TEMPLATE_PATH = Path(__file__).resolve().parent / "prometheus" / "prometheus.yml"


def _duration(seconds: float) -> str:
    """Prometheus duration string; milliseconds keep sub-second intervals exact."""
    ms = int(round(seconds * 1000))
    if ms <= 0:
        raise ValueError(f"interval must be > 0, got {seconds}")
    return f"{ms // 1000}s" if ms % 1000 == 0 else f"{ms}ms"


def render_prometheus_config(metrics_port: int, scrape_interval_s: float) -> str:
    """YAML for Prometheus scraping Ray's metrics at 127.0.0.1:`metrics_port` only."""
    if not 0 < metrics_port < 65536:
        raise ValueError(f"bad port {metrics_port}")
    template: dict[str, Any] = yaml.safe_load(TEMPLATE_PATH.read_text())
    config = copy.deepcopy(template)
    interval = _duration(scrape_interval_s)
    config["global"]["scrape_interval"] = interval
    config["global"]["evaluation_interval"] = interval
    # Prometheus rejects scrape_timeout > scrape_interval; its default is 10s.
    config["global"]["scrape_timeout"] = interval
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "ray"]
    job.pop("file_sd_configs")
    config["rule_files"] = [str(TEMPLATE_PATH.parent / f) for f in config.get("rule_files", [])]
    job["static_configs"] = [{"targets": [f"127.0.0.1:{metrics_port}"]}]
    return yaml.safe_dump(config, sort_keys=False)
