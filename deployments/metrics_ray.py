"""Ray side of the metrics: `ray.serve.metrics` objects built from `app.metrics` definitions.

Create one `ServeMetrics` per replica, inside the replica (e.g. in the deployment's
`__init__`): Serve then tags every series with `deployment`, `replica` and `application`, and
`ServeMetrics(model_name=...)` tags them with `model_name` (vLLM's label; "unknown" when not given).
Ray exports them on each node's metrics port with a `ray_` prefix (see app/metrics.py).
"""

from __future__ import annotations

from typing import Sequence

from ray.serve import metrics as serve_metrics

from app import metrics as m


def _make(defn: m.MetricDef, model_name: str) -> serve_metrics.Counter | serve_metrics.Histogram | serve_metrics.Gauge:
    keys = defn.tag_keys
    if defn.kind == "counter":
        metric = serve_metrics.Counter(defn.name, description=defn.description, tag_keys=keys)
    elif defn.kind == "histogram":
        metric = serve_metrics.Histogram(defn.name, description=defn.description,
                                         boundaries=list(defn.buckets), tag_keys=keys)
    else:
        metric = serve_metrics.Gauge(defn.name, description=defn.description, tag_keys=keys)
    metric.set_default_tags({"model_name": model_name})
    return metric


class ServeMetrics:
    """Implements `app.metrics.MetricsRecorder` over Ray's metrics. Thin by design.

    Ray refuses `Counter.inc(0)`, so zero increments are skipped (the series then appears on
    the first non-zero increment). Inconsistent step counts raise ValueError
    (`app.metrics.check_step`).
    """

    def __init__(self, model_name: str = m.UNKNOWN_MODEL) -> None:
        # any served name (e.g. "meta-llama/Llama-3.1-8B-Instruct"): a label value may hold any text
        self.model_name = model_name or m.UNKNOWN_MODEL
        self._m = {d.name: _make(d, self.model_name) for d in m.ALL_METRICS}

    def _inc(self, defn: m.MetricDef, value: int, tags: dict[str, str] | None = None) -> None:
        if value > 0:
            self._m[defn.name].inc(value, tags=tags)

    def record_step(self, drafted: int, accepted: int, num_drafts: int,
                    accepted_per_pos: Sequence[int] = ()) -> None:
        """One verify step over a batch: totals across its speculating sequences."""
        m.check_step(drafted, accepted, num_drafts, accepted_per_pos)
        self._inc(m.NUM_DRAFTS, num_drafts)
        self._inc(m.NUM_DRAFT_TOKENS, drafted)
        self._inc(m.NUM_ACCEPTED_TOKENS, accepted)
        for pos, n in enumerate(accepted_per_pos):
            self._inc(m.NUM_ACCEPTED_PER_POS, n, {"position": str(pos)})

    def record_decision(self, decision: str, reason: str) -> None:
        tags = {"decision": m.check_label_value(decision, "decision"),
                "reason": m.check_label_value(reason, "reason")}
        self._inc(m.ROUTER_DECISIONS, 1, tags)

    def observe_ttft(self, seconds: float) -> None:
        self._m[m.TTFT.name].observe(seconds)

    def observe_tpot(self, seconds: float) -> None:
        self._m[m.TPOT.name].observe(seconds)

    def observe_step(self, kind: str, seconds: float) -> None:
        self._m[m.STEP_TIME.name].observe(seconds, tags={"kind": m.check_step_kind(kind)})

    def record_step_mode(self, mode: str) -> None:
        self._inc(m.STEP_MODES, 1, {"mode": m.check_step_mode(mode)})

    def set_load(self, running: int, queue: int, kv_tokens: int, kv_seqs: int) -> None:
        self._m[m.RUNNING_SEQUENCES.name].set(running)
        self._m[m.QUEUE_LENGTH.name].set(queue)
        self._m[m.KV_CACHED_TOKENS.name].set(kv_tokens)
        self._m[m.KV_CACHED_SEQUENCES.name].set(kv_seqs)

    # ---- target replica, per request / per step (app.metrics.MetricsRecorder)
    def observe_queue_time(self, seconds: float) -> None:
        """A request's wait on this replica, from its arrival to joining the running batch."""
        self._m[m.QUEUE_TIME.name].observe(seconds)

    def set_kv_usage(self, fraction: float) -> None:
        """Cached tokens / engine.limits.max_cached_tokens, 0..1."""
        self._m[m.KV_USAGE.name].set(m.check_fraction(fraction, "KV usage"))

    def record_draft_misses(self, sequences: int) -> None:
        """Sequences a draft replica answered 'miss' for in one step (rebuilt by prefill)."""
        self._inc(m.DRAFT_MISSES, sequences)

    def record_plain_no_draft_step(self) -> None:
        """One engine step decoded plainly because no draft replica answered."""
        self._inc(m.PLAIN_NO_DRAFT, 1)

    # ---- router, per request
    def record_prompt_tokens(self, tokens: int) -> None:
        self._inc(m.PROMPT_TOKENS, tokens)

    def record_generation_tokens(self, tokens: int) -> None:
        self._inc(m.GENERATION_TOKENS, tokens)

    def observe_e2e(self, seconds: float) -> None:
        self._m[m.E2E_LATENCY.name].observe(seconds)

    def observe_itl(self, seconds: float) -> None:
        self._m[m.ITL.name].observe(seconds)

    def record_finished(self, reason: str) -> None:
        """stop | length | abort (app.metrics.FINISHED_REASONS); any other short identifier the
        engine may add is accepted rather than failing a finished request."""
        self._inc(m.REQUEST_SUCCESS, 1, {"finished_reason": m.check_label_value(reason, "finished_reason")})

    def record_error(self, status: int) -> None:
        self._inc(m.REQUEST_ERRORS, 1, {"status": m.check_status(status)})

    def record_failover(self) -> None:
        self._inc(m.FAILOVERS, 1)
