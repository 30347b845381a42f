"""cluster/prometheus/specserve-rules.yml: valid (`promtool check rules`), unit-tested
(`promtool test rules` on specserve-rules.test.yml), and written over series that exist.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from app import metrics as m

DIR = Path(__file__).resolve().parents[2] / "cluster" / "prometheus"
RULES = DIR / "specserve-rules.yml"
RULE_TESTS = DIR / "specserve-rules.test.yml"
RAY_NAME_RE = re.compile(r"\bray_[a-z0-9_]+")
RECORD_NAME_RE = re.compile(r"^specserve:[a-z0-9_]+:[a-z0-9_]+$")  # level:metric:operations
KNOWN_SERIES = {s for d in m.ALL_METRICS for s in d.exported_series} | {
    m.SERVE_REPLICA_HEALTHY, m.SERVE_TARGET_REPLICAS, m.SERVE_ONGOING_REQUESTS}
needs_promtool = pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Debian prometheus) missing")


def _rules() -> list[dict]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def _promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["promtool", *args], capture_output=True, text=True, cwd=DIR)


@needs_promtool
def test_promtool_check_rules() -> None:
    proc = _promtool("check", "rules", RULES.name)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(_rules())} rules found" in proc.stdout


@needs_promtool
def test_promtool_test_rules() -> None:
    proc = _promtool("test", "rules", RULE_TESTS.name)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout


def test_rules_read_defined_series_only() -> None:
    records = {r["record"] for r in _rules() if "record" in r}
    for rule in _rules():
        referenced = set(RAY_NAME_RE.findall(rule["expr"]))
        assert referenced <= KNOWN_SERIES, (rule.get("record") or rule.get("alert"), referenced - KNOWN_SERIES)
        used_records = set(re.findall(r"\bspecserve:[a-z0-9_]+:[a-z0-9_]+", rule["expr"]))
        assert used_records <= records, used_records - records
        assert referenced or used_records, rule


def test_recording_rules_cover_the_issue_metrics() -> None:
    records = [r["record"] for r in _rules() if "record" in r]
    assert len(set(records)) == len(records)
    for name in records:
        assert RECORD_NAME_RE.match(name), name
    text = RULES.read_text()
    for d in (m.REQUEST_SUCCESS, m.REQUEST_ERRORS, m.GENERATION_TOKENS, m.PROMPT_TOKENS, m.E2E_LATENCY, m.TTFT,
              m.ITL, m.QUEUE_TIME, m.KV_USAGE, m.FAILOVERS, m.PLAIN_NO_DRAFT, m.DRAFT_MISSES,
              m.NUM_ACCEPTED_TOKENS, m.NUM_DRAFT_TOKENS, m.NUM_DRAFTS):
        assert d.exported in text, d.name


def test_every_alert_is_labelled_annotated_and_unit_tested() -> None:
    alerts = [r for r in _rules() if "alert" in r]
    assert {a["alert"] for a in alerts} >= {
        "SpecserveTargetReplicasDown", "SpecserveRouterReplicasDown", "SpecserveHighErrorRate",
        "SpecserveKVCacheNearlyFull", "SpecserveDraftUnavailable", "SpecserveHighTimeToFirstToken"}
    fired = {t["alertname"] for case in yaml.safe_load(RULE_TESTS.read_text())["tests"]
             for t in case.get("alert_rule_test", []) if t.get("exp_alerts")}
    for alert in alerts:
        name = alert["alert"]
        assert alert["labels"]["severity"] in ("critical", "warning", "info"), name
        assert alert["annotations"]["summary"] and alert["annotations"]["description"], name
        assert name in fired, f"{name}: no promtool test expects it to fire"


def test_prometheus_config_loads_the_rules() -> None:
    config = yaml.safe_load((DIR / "prometheus.yml").read_text())
    assert config["rule_files"] == [RULES.name]
    assert yaml.safe_load(RULE_TESTS.read_text())["rule_files"] == [RULES.name]


def test_rendered_test_config_points_at_the_rules() -> None:
    from cluster.prometheus_test_config import render_prometheus_config

    rendered = yaml.safe_load(render_prometheus_config(9999, 1.0))
    assert rendered["rule_files"] == [str(RULES)]
    assert rendered["scrape_configs"][0]["static_configs"] == [{"targets": ["127.0.0.1:9999"]}]
