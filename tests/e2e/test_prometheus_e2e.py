"""End to end: the app in its own Ray, Debian's Prometheus scraping Ray's metrics port on loopback,
the acceptance rate read back through Prometheus' HTTP API with app.metrics' PromQL.

How the rate-based query can be checked *exactly* against the responses' usage: `rate()` over a
window is (last - first sample in the window) times an extrapolation factor that depends only on
the samples' timestamps. The accepted and drafted counters come from the same scrapes, so they
share timestamps and the factor cancels in accepted/drafted, provided both series already exist
(with their warm-up values) when the window opens. So: warm up, let Prometheus see the warm-up
values, mark t0, send the measured traffic, wait until Prometheus has the final values, and
evaluate ACCEPTANCE_RATE_PROMQL (a 1m window) at a time whose window opens 5 ms before the last
scrape before t0 (see the test for why so close). It must equal measured accepted / measured drafted from the responses' `usage.speculation`.
"""

from __future__ import annotations

import json
import math
import threading
import time
import urllib.request
from typing import Any, Callable, Iterator

import httpx
import pytest

from app import metrics as m
from bench.app_process import AppProcess, local_args
from bench.prometheus_process import PrometheusProcess, prometheus_binary

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
if prometheus_binary() is None:
    pytest.skip("prometheus not installed (Debian: apt-get install prometheus)", allow_module_level=True)

SCRAPE_INTERVAL_S = 1.0
WINDOW_S = 60.0  # the constants' [1m]
MEASURE_FOR_S = 25.0
CATCH_UP_S = 60.0
PROMPTS = ("def read_config(path):\n", "import os\nimport sys\n\n\nclass ", "    for i in range(len(items)):\n")
SUMS = {
    "drafted": f"sum({m.NUM_DRAFT_TOKENS.exported})",
    "accepted": f"sum({m.NUM_ACCEPTED_TOKENS.exported})",
    "drafts": f"sum({m.NUM_DRAFTS.exported})",
}


@pytest.fixture(scope="module")
def stack() -> Iterator[tuple[AppProcess, PrometheusProcess]]:
    with AppProcess(local_args()) as app, PrometheusProcess(app.metrics_port, SCRAPE_INTERVAL_S) as prom:
        yield app, prom


def _request(client: httpx.Client, url: str, i: int) -> dict[str, Any]:
    r = client.post(f"{url}/v1/completions", timeout=120, json={
        "model": "specserve-embedded", "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 48,
        "temperature": 0, "ignore_eos": True, "speculation": "on"})
    assert r.status_code == 200, r.text
    return r.json()["usage"]["speculation"]


def _sums(spec: list[dict[str, Any]]) -> dict[str, float]:
    return {"drafted": float(sum(s["drafted_tokens"] for s in spec)),
            "accepted": float(sum(s["accepted_tokens"] for s in spec)),
            "drafts": float(sum(s["num_drafts"] for s in spec))}


def _wait_for(prom: PrometheusProcess, want: dict[str, float], what: str) -> None:
    deadline = time.monotonic() + CATCH_UP_S
    got: dict[str, float | None] = {}
    while time.monotonic() < deadline:
        got = {k: prom.scalar(q) for k, q in SUMS.items()}
        if got == want:
            return
        time.sleep(SCRAPE_INTERVAL_S)
    pytest.fail(f"{what}: Prometheus has {got}, responses say {want} (after {CATCH_UP_S:.0f}s)")


def _traffic(url: str, clients: int, seconds: float) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    errors: list[BaseException] = []
    lock = threading.Lock()
    stop_at = time.monotonic() + seconds

    def run(k: int) -> None:
        with httpx.Client() as client:
            i = k
            while time.monotonic() < stop_at:
                try:
                    spec = _request(client, url, i)
                except BaseException as e:  # noqa: BLE001
                    with lock:
                        errors.append(e)
                    return
                with lock:
                    out.append(spec)
                i += clients

    threads = [threading.Thread(target=run, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=seconds + 150)
    assert not errors, errors
    return out


def _at(prom: PrometheusProcess, when: float) -> Callable[[str], float | None]:
    while time.time() < when + 2 * SCRAPE_INTERVAL_S:
        time.sleep(0.5)
    return lambda expr: prom.scalar(expr, at=when)


def _last_scrape_before(prom: PrometheusProcess, t: float) -> float:
    """Timestamp of the last stored sample of the draft-token counter at or before `t`."""
    series = prom.query(f"{m.NUM_DRAFT_TOKENS.exported}[30s]", at=t)
    stamps = [float(ts) for r in series for ts, _ in r["values"]]
    assert stamps, f"no draft-token samples in the 30 s before t0: {series}"
    return max(stamps)


def test_acceptance_rate_through_prometheus_matches_responses(stack) -> None:
    app, prom = stack
    deadline = time.monotonic() + 60
    while prom.scalar('up{job="ray"}') != 1.0:
        assert time.monotonic() < deadline, f"Prometheus never scraped Ray:\n{prom.log_tail()}"
        time.sleep(SCRAPE_INTERVAL_S)

    # Warm-up: the counter series must exist before the measured window opens.
    with httpx.Client() as client:
        warm = [_request(client, app.url, i) for i in range(2)]
    warm_sums = _sums(warm)
    assert warm_sums["accepted"] > 0, warm  # else the accepted series would not exist yet
    _wait_for(prom, warm_sums, "warm-up")
    time.sleep(3 * SCRAPE_INTERVAL_S)
    t0 = time.time()

    measured = _traffic(app.url, clients=3, seconds=MEASURE_FOR_S)
    assert measured
    meas = _sums(measured)
    final = {k: warm_sums[k] + meas[k] for k in meas}
    _wait_for(prom, final, "after traffic")  # raw counters, read back exactly
    t1 = time.time()

    # Evaluate at a time whose window opens 5 ms before the last scrape before t0 (which holds
    # the warm-up values) and closes after the final values. Opening it right at a scrape matters:
    # rate() caps its extrapolation towards the window start at the time the counter would take
    # to fall to zero (interval * first / increase), which differs between the two counters; an
    # opening 5 ms from the first sample stays under that cap, so the factor cancels.
    opens = _last_scrape_before(prom, t0) - 0.005
    when = opens + WINDOW_S
    if when < t1 + 2 * SCRAPE_INTERVAL_S:  # slow machine: same query, longer window
        when = t1 + 2 * SCRAPE_INTERVAL_S
        window = f"{math.ceil((when - opens) * 1000)}ms"
        rate_q, length_q = m.acceptance_rate_promql(window), m.mean_acceptance_length_promql(window)
    else:
        rate_q, length_q = m.ACCEPTANCE_RATE_PROMQL, m.MEAN_ACCEPTANCE_LENGTH_PROMQL
    q = _at(prom, when)

    expected_rate = meas["accepted"] / meas["drafted"]
    rate = q(rate_q)
    assert rate is not None, rate_q
    assert rate == pytest.approx(expected_rate, rel=1e-6), (rate_q, rate, meas)
    assert 0 < rate <= 1

    expected_length = 1 + meas["accepted"] / meas["drafts"]
    assert q(length_q) == pytest.approx(expected_length, rel=1e-6)

    # The rest of the documented queries answer with sensible values at the same instant.
    per_pos = prom.query(m.per_position_acceptance_promql(window="1m"), at=when)
    by_pos = {int(r["metric"]["position"]): float(r["value"][1]) for r in per_pos}
    assert 0 in by_pos and all(0 <= v <= 1 for v in by_pos.values()), by_pos
    decisions = prom.query(m.ROUTER_DECISIONS_PROMQL, at=when)
    labels = {(r["metric"]["decision"], r["metric"]["reason"]) for r in decisions}
    assert ("speculate", "forced_on") in labels, decisions
    for expr in (m.TTFT_P99_PROMQL, m.TPOT_P99_PROMQL):
        v = prom.scalar(expr, at=when)
        assert v is not None and 0 < v < math.inf, (expr, v)


def test_recording_and_alert_rules_load_and_evaluate(stack) -> None:
    """cluster/prometheus/specserve-rules.yml, loaded through the rendered config, evaluates on the
    app's real series (after the traffic of the test above): every rule healthy, the throughput
    and acceptance recordings present with the served model's label, and no alert firing."""
    app, prom = stack
    with httpx.Client() as client:  # fresh traffic inside the recordings' 5m window
        for i in range(3):
            _request(client, app.url, i)
    with urllib.request.urlopen(f"{prom.url}/api/v1/rules", timeout=20) as r:
        groups = {g["name"]: g for g in json.loads(r.read())["data"]["groups"]}
    assert {"specserve-recording", "specserve-alerts"} <= set(groups)
    for group in groups.values():
        for rule in group["rules"]:
            assert rule["health"] in ("ok", "unknown"), rule  # unknown: not evaluated yet
    deadline = time.monotonic() + 60
    while True:
        tokens = prom.query("specserve:generation_tokens:rate5m")
        acceptance = prom.query("specserve:spec_decode_acceptance_rate:rate5m")
        if (tokens and acceptance) or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    assert tokens and all(float(s["value"][1]) > 0 for s in tokens), tokens
    assert {s["metric"].get("model_name") for s in tokens} == {"specserve-embedded"}
    assert acceptance and all(0 < float(s["value"][1]) <= 1 for s in acceptance), acceptance
    firing = [a for a in prom.query("ALERTS") if a["metric"].get("alertstate") == "firing"]
    assert not firing, firing
