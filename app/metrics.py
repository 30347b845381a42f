"""Metric definitions as plain data, plus a small Ray-free recording interface.

`app/` stays Ray-free: this module only *describes* the metrics (name, kind, label names, help
text, histogram buckets) and the PromQL that reads them. `deployments/metrics_ray.ServeMetrics`
turns the definitions into `ray.serve.metrics` objects; code in `app/` talks to a
`MetricsRecorder` (a Protocol both `ServeMetrics` and the in-process recorders here satisfy).

Names follow vLLM's (`vllm:spec_decode_num_drafts_total` ...) with a `specserve_` prefix, so
vLLM's queries carry over with a rename.

What Ray 2.60 actually exposes (verified by scraping `ray.init(_metrics_export_port=...)` with a
Serve replica recording `ray.serve.metrics` objects; OpenTelemetry recorder, Ray's default):
- every user metric gets a `ray_` prefix: `specserve_x_total` -> `ray_specserve_x_total`;
- counters are exported with exactly one `_total` suffix (OTel adds it when missing, and does not
  double it), so counters are *defined* with `_total` and the exported name is predictable;
- histograms export `<name>_bucket{le=...}` (incl. `le="+Inf"`), `<name>_sum`, `<name>_count`;
  `_sum` is *approximate*: Ray adds each observation's bucket midpoint (2x the last bound for
  +Inf), not the value, so means from `_sum/_count` are only as fine as the buckets;
- Serve adds `deployment`, `replica` and `application` labels by itself (they are reserved: a
  metric declaring them raises), and Ray adds `Component`, `NodeAddress`, `SessionName`,
  `Version`, `WorkerId`, `otel_scope_*` labels;
- a counter with no increment yet is not exported at all (and Ray refuses `inc(0)`), hence the
  `or vector(0)` on numerators below.
(`RAY_enable_open_telemetry=0`, the legacy OpenCensus path, answered HTTP 500 on /metrics in
Ray 2.60 here; only the default path is supported.)
"""

from __future__ import annotations

import re
from collections import Counter as _Tally
from dataclasses import dataclass, field
from typing import Literal, Protocol, Sequence

MetricKind = Literal["counter", "histogram", "gauge"]

RAY_EXPORT_PREFIX = "ray_"
# Labels every specserve metric carries besides its own (vLLM labels its series with model_name):
# `deployments.metrics_ray.ServeMetrics(model_name=...)` sets them as default tags.
COMMON_LABELS: tuple[str, ...] = ("model_name",)
UNKNOWN_MODEL = "unknown"  # model_name of a ServeMetrics created without one
# Labels Ray Serve adds to every metric recorded inside a replica; user metrics may not declare them.
SERVE_AUTO_LABELS: tuple[str, ...] = ("deployment", "replica", "application")

STEP_KINDS: tuple[str, ...] = ("decode", "verify", "draft", "exchange", "prefill")
# `mode` label values of STEP_MODES (app.policy.mode_arbiter.MODES; tested equal)
STEP_MODE_NAMES: tuple[str, ...] = ("plan", "on", "off")
# Bound on the `position` label's cardinality (>= app.config.MAX_SPECULATIVE_TOKENS, tested).
MAX_POSITIONS = 16
MAX_LABEL_VALUE_LEN = 64
# `decision` label values; use decision_label(speculate) so the router and dashboards agree.
DECISIONS: tuple[str, ...] = ("speculate", "plain")
# Reasons app.policy emits today (its `Reason` literal); any short identifier is accepted.
# `finished_reason` of REQUEST_SUCCESS: the engine's (stop, length) and abort (client gone), as vLLM.
FINISHED_REASONS: tuple[str, ...] = ("stop", "length", "abort")
KNOWN_REASONS: tuple[str, ...] = (
    "low_load_long_output", "high_load", "short_output", "low_acceptance", "prefill_cost",
    "stale_load", "no_draft", "forced_on", "forced_off",
)

_NAME_RE = re.compile(r"^[a-z][a-z0-9_]*$")
_LABEL_VALUE_RE = re.compile(r"^[A-Za-z0-9_.:-]+$")


@dataclass(frozen=True)
class MetricDef:
    """One metric as declared to Ray (`name`) and as Prometheus sees it (`exported`)."""

    name: str
    kind: MetricKind
    description: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = field(default=())

    @property
    def exported(self) -> str:
        """Name of the series on Ray's /metrics (histograms: the base of _bucket/_sum/_count)."""
        return RAY_EXPORT_PREFIX + self.name

    @property
    def tag_keys(self) -> tuple[str, ...]:
        """Every label the metric is declared with: COMMON_LABELS, then its own."""
        return COMMON_LABELS + self.labels

    def series(self, suffix: Literal["bucket", "sum", "count"]) -> str:
        if self.kind != "histogram":
            raise ValueError(f"{self.name} is a {self.kind}, it has no _{suffix} series")
        return f"{self.exported}_{suffix}"

    @property
    def exported_series(self) -> tuple[str, ...]:
        if self.kind == "histogram":
            return (self.series("bucket"), self.series("sum"), self.series("count"))
        return (self.exported,)


# Latency buckets (seconds). vLLM's, extended below 10 ms: CPU toy pairs step in ~1 ms, an 8B
# target on an H200 in ~4-20 ms, and an exchange over a compiled graph in ~0.1 ms.
TTFT_BUCKETS: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)
TPOT_BUCKETS: tuple[float, ...] = (
    0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.05, 0.075,
    0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
)
# End to end and queue time (seconds): vLLM's range (to 7680 s) cut at the longest request timeout
# a config here allows (300 s), extended below 0.3 s for the CPU pair's short requests.
E2E_BUCKETS: tuple[float, ...] = (
    0.01, 0.025, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
    40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
)
QUEUE_BUCKETS: tuple[float, ...] = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
    60.0, 120.0, 300.0,
)
STEP_BUCKETS: tuple[float, ...] = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03,
    0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
)

NUM_DRAFTS = MetricDef(
    "specserve_spec_decode_num_drafts_total", "counter",
    "Number of spec decoding drafts (one per speculating sequence per verify step).")
NUM_DRAFT_TOKENS = MetricDef(
    "specserve_spec_decode_num_draft_tokens_total", "counter",
    "Number of draft tokens proposed and verified.")
NUM_ACCEPTED_TOKENS = MetricDef(
    "specserve_spec_decode_num_accepted_tokens_total", "counter",
    "Number of draft tokens accepted by the target (bonus/correction token excluded).")
NUM_ACCEPTED_PER_POS = MetricDef(
    "specserve_spec_decode_num_accepted_tokens_per_pos_total", "counter",
    "Accepted draft tokens by position in the draft (0-based).", ("position",))
ROUTER_DECISIONS = MetricDef(
    "specserve_router_decisions_total", "counter",
    "Router speculation decisions by decision and reason.", ("decision", "reason"))
TTFT = MetricDef(
    "specserve_time_to_first_token_seconds", "histogram",
    "Time from request arrival to the first streamed token.", (), TTFT_BUCKETS)
TPOT = MetricDef(
    "specserve_time_per_output_token_seconds", "histogram",
    "Time per output token after the first.", (), TPOT_BUCKETS)
STEP_TIME = MetricDef(
    "specserve_step_time_seconds", "histogram",
    "Engine step time by kind (decode|verify|draft|exchange|prefill).", ("kind",), STEP_BUCKETS)
STEP_MODES = MetricDef(
    "specserve_engine_step_modes_total", "counter",
    "Engine steps with adaptive ('auto') sequences by the mode they ran in (plan|on|off), as the "
    "measured-goodput arbiter chose it (app/policy/mode_arbiter.py).", ("mode",))
RUNNING_SEQUENCES = MetricDef(
    "specserve_running_sequences", "gauge", "Sequences in the replica's running batch.")
QUEUE_LENGTH = MetricDef(
    "specserve_queue_length", "gauge", "Sequences waiting to join the replica's batch.")
KV_CACHED_TOKENS = MetricDef(
    "specserve_kv_cached_tokens", "gauge", "Tokens held in the replica's KV caches.")
KV_CACHED_SEQUENCES = MetricDef(
    "specserve_kv_cached_sequences", "gauge", "Sequences with a KV cache on the replica.")

# ---- request-level metrics (vLLM's meaning, `specserve_` prefix). Router side:
PROMPT_TOKENS = MetricDef(
    "specserve_prompt_tokens_total", "counter",
    "Prompt tokens of requests that started generating (counted once per request when its first "
    "token arrives; a failover's re-prefill of prompt + streamed tokens is not counted again).")
GENERATION_TOKENS = MetricDef(
    "specserve_generation_tokens_total", "counter", "Generated tokens streamed to clients.")
E2E_LATENCY = MetricDef(
    "specserve_e2e_request_latency_seconds", "histogram",
    "Time from a request's arrival at the router to its last token (finished requests: stop or length).",
    (), E2E_BUCKETS)
ITL = MetricDef(
    "specserve_inter_token_latency_seconds", "histogram",
    "Time between consecutive token-carrying chunks of one request (a chunk carries every token one "
    "engine step produced for it: several when drafts are accepted).", (), TPOT_BUCKETS)
REQUEST_SUCCESS = MetricDef(
    "specserve_request_success_total", "counter",
    "Requests that ended, by finished_reason: stop, length (the engine finished them) or abort "
    "(the client went away or cancelled).", ("finished_reason",))
REQUEST_ERRORS = MetricDef(
    "specserve_request_errors_total", "counter",
    "Requests answered with an error, by HTTP status (a stream's error event counts with the status "
    "its error carries).", ("status",))
FAILOVERS = MetricDef(
    "specserve_router_failovers_total", "counter",
    "Target replica failures survived by re-issuing the request to another target replica.")
# Target replica side (recorded by TargetServer):
QUEUE_TIME = MetricDef(
    "specserve_request_queue_time_seconds", "histogram",
    "Time a request waited on a target replica before joining its running batch.", (), QUEUE_BUCKETS)
KV_USAGE = MetricDef(
    "specserve_kv_cache_usage_perc", "gauge",
    "KV-cache usage of the replica: cached tokens / engine.limits.max_cached_tokens (1 means 100 percent).")
DRAFT_MISSES = MetricDef(
    "specserve_draft_cache_misses_total", "counter",
    "Sequences a draft replica answered 'miss' for (it did not hold their draft cache) and rebuilt by prefill.")
PLAIN_NO_DRAFT = MetricDef(
    "specserve_plain_steps_no_draft_total", "counter",
    "Engine steps decoded plainly because no draft replica answered (draft down: 'decoding plainly').")

ROUTER_REQUEST_METRICS: tuple[MetricDef, ...] = (
    PROMPT_TOKENS, GENERATION_TOKENS, E2E_LATENCY, ITL, REQUEST_SUCCESS, REQUEST_ERRORS, FAILOVERS)
TARGET_REQUEST_METRICS: tuple[MetricDef, ...] = (QUEUE_TIME, KV_USAGE, DRAFT_MISSES, PLAIN_NO_DRAFT)

ALL_METRICS: tuple[MetricDef, ...] = (
    NUM_DRAFTS, NUM_DRAFT_TOKENS, NUM_ACCEPTED_TOKENS, NUM_ACCEPTED_PER_POS, ROUTER_DECISIONS,
    STEP_MODES, TTFT, TPOT, STEP_TIME, RUNNING_SEQUENCES, QUEUE_LENGTH, KV_CACHED_TOKENS, KV_CACHED_SEQUENCES,
    *ROUTER_REQUEST_METRICS, *TARGET_REQUEST_METRICS,
)

# Ray Serve's own series (verified present on Ray 2.60's /metrics), used by the dashboard.
SERVE_REPLICA_HEALTHY = "ray_serve_deployment_replica_healthy"  # 1 per healthy replica
SERVE_TARGET_REPLICAS = "ray_serve_autoscaling_target_replicas"  # autoscaler's target
SERVE_ONGOING_REQUESTS = "ray_serve_replica_processing_queries"
# Ray's per-node series (the dashboard agent's reporter, every node; Ray 2.60 source:
# dashboard/modules/reporter/reporter_agent.py). Labels ip, RayNodeType, IsHeadNode, SessionName,
# and for GPUs GpuIndex, GpuDeviceName, GpuUuid; no Serve application label. GPU series exist on
# nodes with NVIDIA (pynvml) or AMD GPUs only.
RAY_NODE_GPU_UTILIZATION = "ray_node_gpus_utilization"  # percent 0-100, per GPU
RAY_NODE_GPU_MEMORY_USED = "ray_node_gram_used"  # MiB (Ray's help text says bytes; it is MB), per GPU
RAY_NODE_GPU_MEMORY_AVAILABLE = "ray_node_gram_available"  # MiB, per GPU
RAY_NODE_CPU_UTILIZATION = "ray_node_cpu_utilization"  # percent 0-100, per node
RAY_NODE_SERIES: tuple[str, ...] = (
    RAY_NODE_GPU_UTILIZATION, RAY_NODE_GPU_MEMORY_USED, RAY_NODE_GPU_MEMORY_AVAILABLE, RAY_NODE_CPU_UTILIZATION)


# ---------------------------------------------------------------------------------------- PromQL
def _sel(selector: str) -> str:
    return "{" + selector + "}" if selector else ""


def _rate(metric: str, window: str, selector: str) -> str:
    return f"sum(rate({metric}{_sel(selector)}[{window}]))"


def acceptance_rate_promql(window: str = "1m", selector: str = "") -> str:
    """rate(accepted) / rate(draft tokens). Numerator defaults to 0 until a token is accepted."""
    return (f"({_rate(NUM_ACCEPTED_TOKENS.exported, window, selector)} or vector(0))"
            f" / {_rate(NUM_DRAFT_TOKENS.exported, window, selector)}")


def mean_acceptance_length_promql(window: str = "1m", selector: str = "") -> str:
    """1 + rate(accepted) / rate(drafts): tokens emitted per target verify pass (incl. bonus)."""
    return (f"1 + ({_rate(NUM_ACCEPTED_TOKENS.exported, window, selector)} or vector(0))"
            f" / {_rate(NUM_DRAFTS.exported, window, selector)}")


def per_position_acceptance_promql(window: str = "1m", selector: str = "") -> str:
    """Per position i: share of drafts whose token i was accepted (vLLM's per-position rate)."""
    return (f"sum by (position) (rate({NUM_ACCEPTED_PER_POS.exported}{_sel(selector)}[{window}]))"
            f" / scalar({_rate(NUM_DRAFTS.exported, window, selector)})")


def histogram_quantile_promql(metric: MetricDef, q: float, window: str = "1m",
                              selector: str = "", by: Sequence[str] = ()) -> str:
    keys = ", ".join(("le", *by))
    return (f"histogram_quantile({q}, sum by ({keys}) "
            f"(rate({metric.series('bucket')}{_sel(selector)}[{window}])))")


def error_ratio_promql(window: str = "5m", selector: str = "") -> str:
    """Share of requests answered with a 5xx (of those that ended: finished or failed)."""
    sel = f"{selector}, " if selector else ""
    errors = f"(sum(rate({REQUEST_ERRORS.exported}{{{sel}status=~\"5..\"}}[{window}])) or vector(0))"
    ended = (f"(sum(rate({REQUEST_SUCCESS.exported}{_sel(selector)}[{window}])) or vector(0))"
             f" + (sum(rate({REQUEST_ERRORS.exported}{_sel(selector)}[{window}])) or vector(0))")
    return f"{errors} / ({ended})"


ACCEPTANCE_RATE_PROMQL = acceptance_rate_promql()
MEAN_ACCEPTANCE_LENGTH_PROMQL = mean_acceptance_length_promql()
PER_POSITION_ACCEPTANCE_PROMQL = per_position_acceptance_promql()
ROUTER_DECISIONS_PROMQL = (
    f"sum by (decision, reason) (rate({ROUTER_DECISIONS.exported}[1m]))")
TTFT_P99_PROMQL = histogram_quantile_promql(TTFT, 0.99)
TPOT_P99_PROMQL = histogram_quantile_promql(TPOT, 0.99)


# ----------------------------------------------------------------------- Ray-free recording API
def check_label_value(value: str, what: str) -> str:
    """Label values must be short identifiers: keeps cardinality bounded and output parseable."""
    if not value or len(value) > MAX_LABEL_VALUE_LEN or not _LABEL_VALUE_RE.match(value):
        raise ValueError(f"bad {what} label value {value!r}")
    return value


def check_step(drafted: int, accepted: int, num_drafts: int,
               accepted_per_pos: Sequence[int]) -> None:
    """Validate one verify step's spec-decode counts (raises ValueError on inconsistency)."""
    if min(drafted, accepted, num_drafts) < 0 or any(n < 0 for n in accepted_per_pos):
        raise ValueError("spec-decode counts must be >= 0")
    if accepted > drafted:
        raise ValueError(f"accepted ({accepted}) > drafted ({drafted})")
    if num_drafts > drafted:
        raise ValueError(f"num_drafts ({num_drafts}) > drafted ({drafted}): a draft has >= 1 token")
    if len(accepted_per_pos) > MAX_POSITIONS:
        raise ValueError(f"{len(accepted_per_pos)} positions > MAX_POSITIONS={MAX_POSITIONS}")
    if accepted_per_pos and sum(accepted_per_pos) != accepted:
        raise ValueError(f"sum(accepted_per_pos)={sum(accepted_per_pos)} != accepted={accepted}")
    if any(n > num_drafts for n in accepted_per_pos):
        raise ValueError("a position cannot be accepted more often than there are drafts")


def decision_label(speculate: bool) -> str:
    return DECISIONS[0] if speculate else DECISIONS[1]


def check_step_kind(kind: str) -> str:
    if kind not in STEP_KINDS:
        raise ValueError(f"unknown step kind {kind!r}; expected one of {STEP_KINDS}")
    return kind


def check_step_mode(mode: str) -> str:
    if mode not in STEP_MODE_NAMES:
        raise ValueError(f"unknown step mode {mode!r}; expected one of {STEP_MODE_NAMES}")
    return mode


def check_finished_reason(reason: str) -> str:
    if reason not in FINISHED_REASONS:
        raise ValueError(f"unknown finished_reason {reason!r}; expected one of {FINISHED_REASONS}")
    return reason


def check_status(status: int) -> str:
    if not 400 <= status <= 599:
        raise ValueError(f"error status must be 4xx or 5xx, got {status}")
    return str(status)


def check_fraction(value: float, what: str) -> float:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{what} must lie in [0, 1], got {value}")
    return value


class MetricsRecorder(Protocol):
    """What app/ code calls; `deployments.metrics_ray.ServeMetrics` implements it over Ray."""

    def record_step(self, drafted: int, accepted: int, num_drafts: int,
                    accepted_per_pos: Sequence[int] = ()) -> None: ...

    def record_decision(self, decision: str, reason: str) -> None: ...

    def observe_ttft(self, seconds: float) -> None: ...

    def observe_tpot(self, seconds: float) -> None: ...

    def observe_step(self, kind: str, seconds: float) -> None: ...

    def record_step_mode(self, mode: str) -> None: ...

    def set_load(self, running: int, queue: int, kv_tokens: int, kv_seqs: int) -> None: ...

    # target replica, per request / per step
    def observe_queue_time(self, seconds: float) -> None: ...

    def set_kv_usage(self, fraction: float) -> None: ...

    def record_draft_misses(self, sequences: int) -> None: ...

    def record_plain_no_draft_step(self) -> None: ...


class NullMetrics:
    """Records nothing (validates nothing either): for engines run outside Serve."""

    def record_step(self, drafted: int, accepted: int, num_drafts: int,
                    accepted_per_pos: Sequence[int] = ()) -> None:
        return None

    def record_decision(self, decision: str, reason: str) -> None:
        return None

    def observe_ttft(self, seconds: float) -> None:
        return None

    def observe_tpot(self, seconds: float) -> None:
        return None

    def observe_step(self, kind: str, seconds: float) -> None:
        return None

    def record_step_mode(self, mode: str) -> None:
        return None

    def set_load(self, running: int, queue: int, kv_tokens: int, kv_seqs: int) -> None:
        return None

    def observe_queue_time(self, seconds: float) -> None:
        return None

    def set_kv_usage(self, fraction: float) -> None:
        return None

    def record_draft_misses(self, sequences: int) -> None:
        return None

    def record_plain_no_draft_step(self) -> None:
        return None


class InMemoryMetrics:
    """Same validation as ServeMetrics, kept in plain Python: for unit tests and benchmarks."""

    def __init__(self) -> None:
        self.drafted = 0
        self.accepted = 0
        self.num_drafts = 0
        self.accepted_per_pos: list[int] = [0] * MAX_POSITIONS
        self.decisions: _Tally[tuple[str, str]] = _Tally()
        self.ttft: list[float] = []
        self.tpot: list[float] = []
        self.steps: dict[str, list[float]] = {k: [] for k in STEP_KINDS}
        self.step_modes: _Tally[str] = _Tally()
        self.load: tuple[int, int, int, int] = (0, 0, 0, 0)
        self.queue_times: list[float] = []
        self.kv_usage = 0.0
        self.draft_misses = 0
        self.plain_no_draft_steps = 0

    def record_step(self, drafted: int, accepted: int, num_drafts: int,
                    accepted_per_pos: Sequence[int] = ()) -> None:
        check_step(drafted, accepted, num_drafts, accepted_per_pos)
        self.drafted += drafted
        self.accepted += accepted
        self.num_drafts += num_drafts
        for pos, n in enumerate(accepted_per_pos):
            self.accepted_per_pos[pos] += n

    def record_decision(self, decision: str, reason: str) -> None:
        key = (check_label_value(decision, "decision"), check_label_value(reason, "reason"))
        self.decisions[key] += 1

    def observe_ttft(self, seconds: float) -> None:
        self.ttft.append(seconds)

    def observe_tpot(self, seconds: float) -> None:
        self.tpot.append(seconds)

    def observe_step(self, kind: str, seconds: float) -> None:
        self.steps[check_step_kind(kind)].append(seconds)

    def record_step_mode(self, mode: str) -> None:
        self.step_modes[check_step_mode(mode)] += 1

    def set_load(self, running: int, queue: int, kv_tokens: int, kv_seqs: int) -> None:
        self.load = (running, queue, kv_tokens, kv_seqs)

    def observe_queue_time(self, seconds: float) -> None:
        self.queue_times.append(seconds)

    def set_kv_usage(self, fraction: float) -> None:
        self.kv_usage = check_fraction(fraction, "KV usage")

    def record_draft_misses(self, sequences: int) -> None:
        if sequences < 0:
            raise ValueError("draft misses must be >= 0")
        self.draft_misses += sequences

    def record_plain_no_draft_step(self) -> None:
        self.plain_no_draft_steps += 1

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    @property
    def mean_acceptance_length(self) -> float | None:
        return 1 + self.accepted / self.num_drafts if self.num_drafts else None


def is_valid_metric_name(name: str) -> bool:
    return bool(_NAME_RE.match(name))
