"""Metric definitions follow Prometheus/vLLM conventions; the PromQL reads the exported names."""

from __future__ import annotations

import inspect
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from app import metrics as m
from app.config import MAX_SPECULATIVE_TOKENS

LABEL_RE = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
RAY_NAME_RE = re.compile(r"\bray_[a-z0-9_]+")
ALL_EXPORTED = {s for d in m.ALL_METRICS for s in d.exported_series}
PROMQL_CONSTANTS = {
    name: value for name, value in vars(m).items() if name.endswith("_PROMQL") and isinstance(value, str)
}


def test_names_are_unique_prefixed_and_valid() -> None:
    names = [d.name for d in m.ALL_METRICS]
    assert len(set(names)) == len(names)
    for d in m.ALL_METRICS:
        assert d.name.startswith("specserve_"), d.name
        assert m.is_valid_metric_name(d.name), d.name
        assert d.description.strip(), d.name
        assert d.exported == "ray_" + d.name


def test_vllm_style_names_are_defined() -> None:
    names = {d.name for d in m.ALL_METRICS}
    assert {
        "specserve_spec_decode_num_drafts_total",
        "specserve_spec_decode_num_draft_tokens_total",
        "specserve_spec_decode_num_accepted_tokens_total",
        "specserve_spec_decode_num_accepted_tokens_per_pos_total",
        "specserve_router_decisions_total",
        "specserve_time_to_first_token_seconds",
        "specserve_time_per_output_token_seconds",
        "specserve_step_time_seconds",
        "specserve_running_sequences",
        "specserve_queue_length",
        "specserve_kv_cached_tokens",
        "specserve_kv_cached_sequences",
    } <= names


@pytest.mark.parametrize("d", m.ALL_METRICS, ids=lambda d: d.name)
def test_kind_conventions(d: m.MetricDef) -> None:
    if d.kind == "counter":
        # Exactly one _total: Ray exports a counter named x_total as ray_x_total.
        assert d.name.endswith("_total") and not d.name.endswith("_total_total")
        assert d.exported_series == (d.exported,)
        assert not d.buckets
    elif d.kind == "histogram":
        assert d.name.endswith("_seconds")
        assert list(d.buckets) == sorted(set(d.buckets)) and d.buckets[0] > 0
        assert d.exported_series == tuple(f"{d.exported}_{s}" for s in ("bucket", "sum", "count"))
    else:
        assert d.kind == "gauge"
        assert not d.name.endswith(("_total", "_seconds", "_bucket", "_count", "_sum"))
        assert not d.buckets
        with pytest.raises(ValueError):
            d.series("bucket")


@pytest.mark.parametrize("d", m.ALL_METRICS, ids=lambda d: d.name)
def test_labels_are_valid_and_not_reserved(d: m.MetricDef) -> None:
    for label in d.labels:
        assert LABEL_RE.match(label) and not label.startswith("__"), label
        assert label not in m.SERVE_AUTO_LABELS  # ray.serve.metrics raises on these
        assert label not in ("le", "quantile", "job", "instance")


def test_expected_labels() -> None:
    assert m.NUM_ACCEPTED_PER_POS.labels == ("position",)
    assert m.ROUTER_DECISIONS.labels == ("decision", "reason")
    assert m.STEP_TIME.labels == ("kind",)
    assert set(m.STEP_KINDS) == {"decode", "verify", "draft", "exchange", "prefill"}
    assert m.MAX_POSITIONS >= MAX_SPECULATIVE_TOKENS


def test_promql_references_exported_names_only() -> None:
    assert {"ACCEPTANCE_RATE_PROMQL", "MEAN_ACCEPTANCE_LENGTH_PROMQL"} <= set(PROMQL_CONSTANTS)
    for name, expr in PROMQL_CONSTANTS.items():
        referenced = set(RAY_NAME_RE.findall(expr))
        assert referenced, name
        assert referenced <= ALL_EXPORTED, (name, referenced - ALL_EXPORTED)
        assert "specserve_" not in RAY_NAME_RE.sub("", expr), f"{name} uses an unexported name"


def test_acceptance_queries_are_the_documented_ratios() -> None:
    acc, drafted, drafts = (m.NUM_ACCEPTED_TOKENS.exported, m.NUM_DRAFT_TOKENS.exported,
                            m.NUM_DRAFTS.exported)
    assert m.ACCEPTANCE_RATE_PROMQL == (
        f"(sum(rate({acc}[1m])) or vector(0)) / sum(rate({drafted}[1m]))")
    assert m.MEAN_ACCEPTANCE_LENGTH_PROMQL == (
        f"1 + (sum(rate({acc}[1m])) or vector(0)) / sum(rate({drafts}[1m]))")
    assert m.acceptance_rate_promql("5m", 'application="a"') == (
        f'(sum(rate({acc}{{application="a"}}[5m])) or vector(0))'
        f' / sum(rate({drafted}{{application="a"}}[5m]))')


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Debian prometheus) missing")
def test_promql_parses_with_promtool(tmp_path: Path) -> None:
    rules = ["groups:", "  - name: specserve", "    rules:"]
    for i, expr in enumerate(PROMQL_CONSTANTS.values()):
        rules += [f"      - record: specserve:check_{i}", f"        expr: '{expr}'"]
    path = tmp_path / "rules.yml"
    path.write_text("\n".join(rules) + "\n")
    proc = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_check_step() -> None:
    m.check_step(drafted=8, accepted=5, num_drafts=2, accepted_per_pos=[2, 2, 1])
    m.check_step(drafted=8, accepted=5, num_drafts=2, accepted_per_pos=[])
    m.check_step(drafted=0, accepted=0, num_drafts=0, accepted_per_pos=[])
    bad = [
        dict(drafted=4, accepted=5, num_drafts=1, accepted_per_pos=[]),
        dict(drafted=4, accepted=-1, num_drafts=1, accepted_per_pos=[]),
        dict(drafted=4, accepted=2, num_drafts=5, accepted_per_pos=[]),
        dict(drafted=8, accepted=3, num_drafts=2, accepted_per_pos=[2, 2]),
        dict(drafted=8, accepted=3, num_drafts=2, accepted_per_pos=[3]),
        dict(drafted=99, accepted=17, num_drafts=1, accepted_per_pos=[1] * (m.MAX_POSITIONS + 1)),
    ]
    for case in bad:
        with pytest.raises(ValueError):
            m.check_step(**case)


def test_label_value_and_kind_checks() -> None:
    assert m.check_label_value("low_load_long_output", "reason") == "low_load_long_output"
    for value in ("", "has space", "x" * (m.MAX_LABEL_VALUE_LEN + 1), 'q"uote'):
        with pytest.raises(ValueError):
            m.check_label_value(value, "reason")
    with pytest.raises(ValueError):
        m.check_step_kind("bogus")


def test_policy_reasons_are_valid_label_values() -> None:
    import typing

    from app.policy.decision import Reason

    for reason in typing.get_args(Reason):
        assert m.check_label_value(reason, "reason") == reason
    assert set(typing.get_args(Reason)) <= set(m.KNOWN_REASONS)
    assert (m.decision_label(True), m.decision_label(False)) == ("speculate", "plain")


def test_in_memory_recorder() -> None:
    rec = m.InMemoryMetrics()
    assert rec.acceptance_rate is None and rec.mean_acceptance_length is None
    rec.record_step(12, 7, 3, [3, 2, 1, 1])
    rec.record_step(8, 4, 3, [2, 1, 1])
    rec.record_decision("speculate", "low_load_long_output")
    rec.observe_step("verify", 0.01)
    rec.set_load(1, 2, 3, 4)
    assert rec.acceptance_rate == pytest.approx(11 / 20)
    assert rec.mean_acceptance_length == pytest.approx(1 + 11 / 6)
    assert rec.accepted_per_pos[:4] == [5, 3, 2, 1]
    assert rec.decisions[("speculate", "low_load_long_output")] == 1
    assert rec.load == (1, 2, 3, 4)


def test_recorders_share_the_protocol_signatures() -> None:
    from deployments.metrics_ray import ServeMetrics

    methods = [n for n in vars(m.MetricsRecorder) if not n.startswith("_")]
    assert set(methods) == {"record_step", "record_decision", "observe_ttft", "observe_tpot",
                            "observe_step", "record_step_mode", "set_load", "observe_queue_time",
                            "set_kv_usage", "record_draft_misses", "record_plain_no_draft_step"}
    for cls in (ServeMetrics, m.NullMetrics, m.InMemoryMetrics):
        for name in methods:
            want = inspect.signature(getattr(m.MetricsRecorder, name))
            assert inspect.signature(getattr(cls, name)) == want, (cls.__name__, name)


def test_request_level_metrics_follow_vllm() -> None:
    """Issue 51: vLLM's request metrics with our prefix, every specserve series labelled model_name."""
    vllm = {  # vLLM name (without `vllm:`) -> ours
        "prompt_tokens_total": m.PROMPT_TOKENS, "generation_tokens_total": m.GENERATION_TOKENS,
        "e2e_request_latency_seconds": m.E2E_LATENCY, "time_to_first_token_seconds": m.TTFT,
        "inter_token_latency_seconds": m.ITL, "request_queue_time_seconds": m.QUEUE_TIME,
        "request_success_total": m.REQUEST_SUCCESS, "kv_cache_usage_perc": m.KV_USAGE,
    }
    for name, d in vllm.items():
        assert d.name == "specserve_" + name and d in m.ALL_METRICS
    assert m.REQUEST_SUCCESS.labels == ("finished_reason",)
    assert m.FINISHED_REASONS == ("stop", "length", "abort")
    assert m.REQUEST_ERRORS.labels == ("status",)
    for d in (m.FAILOVERS, m.DRAFT_MISSES, m.PLAIN_NO_DRAFT):
        assert d.kind == "counter" and d in m.ALL_METRICS
    for d in m.ALL_METRICS:
        assert d.tag_keys == ("model_name", *d.labels)
        assert "model_name" not in d.labels
    # buckets reach past the longest request timeout a config allows (300 s)
    assert m.E2E_BUCKETS[-1] > 300 and m.QUEUE_BUCKETS[-1] >= 300


def test_error_ratio_promql() -> None:
    expr = m.error_ratio_promql("5m", 'application="a"')
    assert expr.startswith(f'(sum(rate({m.REQUEST_ERRORS.exported}{{application="a", status=~"5.."}}[5m]))')
    assert f'{m.REQUEST_SUCCESS.exported}{{application="a"}}[5m]' in expr


def test_in_memory_target_side_recorder() -> None:
    rec = m.InMemoryMetrics()
    rec.observe_queue_time(0.25)
    rec.set_kv_usage(0.5)
    rec.record_draft_misses(3)
    rec.record_plain_no_draft_step()
    assert (rec.queue_times, rec.kv_usage, rec.draft_misses, rec.plain_no_draft_steps) == ([0.25], 0.5, 3, 1)
    with pytest.raises(ValueError):
        rec.set_kv_usage(1.5)
    with pytest.raises(ValueError):
        rec.record_draft_misses(-1)
    assert m.check_status(503) == "503"
    for bad in (200, 99, 600):
        with pytest.raises(ValueError):
            m.check_status(bad)


def test_app_metrics_is_ray_free() -> None:
    source = Path(m.__file__).read_text()
    assert not re.search(r"^\s*(import|from)\s+ray\b", source, re.M)
