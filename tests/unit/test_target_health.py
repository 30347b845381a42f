"""app/health.py: the router's verdicts from its target probes."""

from __future__ import annotations

import pytest

from app.health import ProbeSettings, TargetHealth

S = ProbeSettings(probe_period_s=5, probe_timeout_s=5, ready_within_s=15, down_after_s=30)


def test_not_ready_and_not_down_before_any_answer() -> None:
    h = TargetHealth(S)
    assert not h.ready(0.0) and not h.down(0.0)
    h.record_failure(10.0, "no target replica answered within 5s")  # targets still loading
    h.record_failure(1000.0, "still loading")
    assert not h.ready(1000.0)
    assert not h.down(1000.0)  # never answered: the router is not failed (no restart loop at startup)


def test_answered_then_failing() -> None:
    h = TargetHealth(S)
    h.record_answered(100.0)
    assert h.ready(100.0) and h.ready(115.0) and not h.ready(115.1)  # ready_within_s
    h.record_failure(105.0, "RayTaskError: engine loop thread died")
    assert not h.ready(105.0)  # the latest probe failed: 503 at once
    assert not h.down(130.0) and h.down(130.1)  # down_after_s since the last answer
    assert h.describe(131.0) == {"ready": False, "last_result": "RayTaskError: engine loop thread died",
                                 "last_answer_s_ago": 31.0, "failures_in_a_row": 1}
    h.record_answered(140.0)
    assert h.ready(140.0) and not h.down(140.0) and h.failures_in_a_row == 0


def test_busy_counts_as_alive() -> None:
    h = TargetHealth(S)
    h.record_answered(0.0)
    for t in range(5, 200, 5):
        h.record_busy(float(t))
        assert h.ready(float(t)) and not h.down(float(t))
    assert h.last_result == "busy"


def test_settings_from_env() -> None:
    s = ProbeSettings.from_env({"SPECSERVE_TARGET_DOWN_AFTER_S": "4", "SPECSERVE_TARGET_PROBE_PERIOD_S": "0.5"})
    assert (s.down_after_s, s.probe_period_s, s.probe_timeout_s) == (4.0, 0.5, 5.0)
    assert ProbeSettings.from_env({}) == ProbeSettings()
    with pytest.raises(ValueError):
        ProbeSettings.from_env({"SPECSERVE_TARGET_READY_WITHIN_S": "0"})
