"""Ray side of the metrics: `ray.serve.metrics` objects built from `app.metrics` definitions.

Create one `ServeMetrics` per replica, inside the replica (e.g. in the deployment's
`__init__`): Serve then tags every series with `deployment`, `replica` and `application`.
Ray exports them on each node's metrics port with a `ray_` prefix (see app/metrics.py).
"""

from __future__ import annotations

from typing import Sequence

from ray.serve import metrics as serve_metrics

from app import metrics as m


def _make(defn: m.MetricDef) -> serve_metrics.Counter | serve_metrics.Histogram | serve_metrics.Gauge:
    if defn.kind == "counter":
        return serve_metrics.Counter(defn.name, description=defn.description, tag_keys=defn.labels)
    if defn.kind == "histogram":
        return serve_metrics.Histogram(defn.name, description=defn.description,
                                       boundaries=list(defn.buckets), tag_keys=defn.labels)
    return serve_metrics.Gauge(defn.name, description=defn.description, tag_keys=defn.labels)


class ServeMetrics:
    """Implements `app.metrics.MetricsRecorder` over Ray's metrics. Thin by design.

    Ray refuses `Counter.inc(0)`, so zero increments are skipped (the series then appears on
    the first non-zero increment). Inconsistent step counts raise ValueError
    (`app.metrics.check_step`).
    """

    def __init__(self) -> None:
        self._m = {d.name: _make(d) for d in m.ALL_METRICS}

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
