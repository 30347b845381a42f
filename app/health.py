"""Does a target replica answer? The router's view, from a cheap probe it repeats in the background.

The router (deployments/router.py) calls a target replica's `check_health` through its handle every
`probe_period_s` (the same path requests take: Serve's routing, the replica's event loop, the
target's own check that its engine loop lives) and records the outcome here:
- answered: the replica ran its check and it passed;
- busy: no answer within `probe_timeout_s`, but a target replica published routing stats within
  the last few seconds (Serve's controller polls them past the request queue): it lives, and its
  request slots are all taken by streams. Saturation is not an outage;
- failed: an error (the check raised, the replica died, none is running) or a silent timeout.

Two verdicts:
- `ready` (GET /health, 200/503, what a load balancer or readiness probe reads): the latest probe
  answered (or found the targets busy) within `ready_within_s`;
- `down` (the router's Serve `check_health`; Serve replaces a replica that fails it 3 times in a
  row): no answer for `down_after_s` *after* a target once answered, so routers are not failed
  (and restarted in a loop) while the targets are still loading their models.

Ray-free: the clock is passed in. Defaults may be overridden by the router's environment
(SPECSERVE_TARGET_PROBE_PERIOD_S, SPECSERVE_TARGET_PROBE_TIMEOUT_S, SPECSERVE_TARGET_READY_WITHIN_S,
SPECSERVE_TARGET_DOWN_AFTER_S).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Mapping


@dataclass(frozen=True)
class ProbeSettings:
    probe_period_s: float = 5.0
    probe_timeout_s: float = 5.0
    ready_within_s: float = 15.0  # three probe periods: one lost probe does not flip /health
    down_after_s: float = 30.0

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "ProbeSettings":
        env = os.environ if env is None else env
        values: dict[str, float] = {}
        for name in cls.__dataclass_fields__:
            raw = env.get(f"SPECSERVE_TARGET_{name.upper()}")
            if raw is not None:
                value = float(raw)
                if value <= 0:
                    raise ValueError(f"SPECSERVE_TARGET_{name.upper()} must be > 0, got {raw}")
                values[name] = value
        return cls(**values)


@dataclass
class TargetHealth:
    settings: ProbeSettings = field(default_factory=ProbeSettings)
    last_ok: float | None = None  # clock time of the last probe answered (or busy)
    last_probe: float | None = None
    last_result: str = "no probe yet"  # "answered" | "busy" | the failure
    probes: int = 0
    failures_in_a_row: int = 0

    def record_answered(self, now: float) -> None:
        self._ok(now, "answered")

    def record_busy(self, now: float) -> None:
        self._ok(now, "busy")

    def _ok(self, now: float, result: str) -> None:
        self.last_ok = self.last_probe = now
        self.last_result = result
        self.probes += 1
        self.failures_in_a_row = 0

    def record_failure(self, now: float, reason: str) -> None:
        self.last_probe = now
        self.last_result = reason or "failed"
        self.probes += 1
        self.failures_in_a_row += 1

    def ready(self, now: float) -> bool:
        return (self.last_ok is not None and self.failures_in_a_row == 0
                and now - self.last_ok <= self.settings.ready_within_s)

    def down(self, now: float) -> bool:
        return self.last_ok is not None and now - self.last_ok > self.settings.down_after_s

    def describe(self, now: float) -> dict[str, Any]:
        return {
            "ready": self.ready(now),
            "last_result": self.last_result,
            "last_answer_s_ago": None if self.last_ok is None else round(now - self.last_ok, 3),
            "failures_in_a_row": self.failures_in_a_row,
        }
