"""Overload: a burst far beyond capacity is answered fast with 429/503 + Retry-After, never hangs,
and the service serves normally afterwards with its caches empty.

Two limits meet the burst: the engine's (max_num_seqs 2 running + max_queue 2 waiting; beyond
that the target answers 429) and Serve's own (the target deployment takes max_ongoing_requests
calls at once and queues max_queued_requests more at the router's handle; beyond that Serve
raises BackPressureError, which the router answers as 503)."""

from __future__ import annotations

import asyncio
import time
from typing import Iterator

import httpx
import pytest

from bench.soak import Result, call
from tests.serve.conftest import deployed

pytestmark = pytest.mark.serve

MAX_NUM_SEQS, MAX_QUEUE = 2, 2
OVERRIDES = {
    "engine": {"limits": {"max_num_seqs": MAX_NUM_SEQS, "max_queue": MAX_QUEUE}},
    "target_deployment": {"num_cpus": 0.5, "max_ongoing_requests": 6, "max_queued_requests": 4},
    "draft_deployment": {"num_cpus": 0.25},
    "router_deployment": {"num_cpus": 0.25},
}
BURST = 40
# Generous bounds for a shared 2-core machine: a rejection must never wait for generation to
# finish (the whole burst's accepted work takes several times this).
REJECT_WITHIN_S = 15.0


@pytest.fixture(scope="module")
def app(ray_cluster: int) -> Iterator[str]:
    with deployed(ray_cluster, OVERRIDES) as base:
        yield base


def body(i: int, max_tokens: int) -> dict:
    return {"model": "specserve-embedded", "prompt": f"def handler_{i}(event):\n", "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": i % 2 == 0, "speculation": ["on", "off", "auto"][i % 3],
            "stream_options": {"include_usage": True}}


async def burst(base: str, n: int, max_tokens: int) -> list[Result]:
    limits = httpx.Limits(max_connections=n + 4)
    async with httpx.AsyncClient(limits=limits, trust_env=False) as client:
        return list(await asyncio.gather(*(call(client, base, body(i, max_tokens), timeout_s=240)
                                           for i in range(n))))


def cached_sequences() -> tuple[int, int]:
    from ray import serve

    target = serve.get_deployment_handle("TargetServer", "specserve").num_cached_sequences.remote()
    draft = serve.get_deployment_handle("DraftServer", "specserve").num_cached_sequences.remote()
    return target.result(timeout_s=30), draft.result(timeout_s=30)


def test_burst_is_rejected_fast_and_service_recovers(app: str) -> None:
    results = asyncio.run(burst(app, BURST, max_tokens=48))
    statuses = sorted(r.status for r in results)
    ok = [r for r in results if r.status == 200]
    rejected = [r for r in results if r.status in (429, 503)]
    assert len(ok) + len(rejected) == BURST, f"unexpected statuses: {statuses} {[r.error for r in results]}"
    # capacity is max_num_seqs + max_queue in the engine plus Serve's small queue that drains
    # into it; most of the burst must be turned away
    assert len(ok) >= MAX_NUM_SEQS and len(rejected) >= BURST // 2, statuses
    for r in ok:
        assert r.ok and r.usage["completion_tokens"] == 48, r.error
    for r in rejected:
        assert r.retry_after is not None and float(r.retry_after) > 0, r
        assert r.latency_s < REJECT_WITHIN_S, f"a {r.status} took {r.latency_s:.1f}s"
        assert "server_overloaded" in r.error, r.error  # OpenAI-style error type, from our router
    slowest_reject = max(r.latency_s for r in rejected)
    fastest_ok = max(r.latency_s for r in ok)
    assert slowest_reject < fastest_ok + REJECT_WITHIN_S

    # healthy afterwards: normal requests are served, one at a time and as a small batch
    assert httpx.get(f"{app}/health", timeout=30).status_code == 200
    again = asyncio.run(burst(app, MAX_NUM_SEQS, max_tokens=16))
    assert all(r.ok for r in again), [(r.status, r.error) for r in again]
    # nothing left behind in the engine or the draft replica
    deadline = time.monotonic() + 30
    while cached_sequences() != (0, 0):
        assert time.monotonic() < deadline, f"caches not freed: {cached_sequences()}"
        time.sleep(0.2)


def test_rejections_carry_openai_error_json(app: str) -> None:
    results = asyncio.run(burst(app, 16, max_tokens=32))
    rejected = [r for r in results if r.status in (429, 503)]
    assert rejected, "16 concurrent requests against 2 slots + 2 waiting + Serve's queue of 4: none rejected"
    for r in rejected:
        # the OpenAI error object (Call keeps the parsed `error` for JSON, the raw body for SSE)
        assert '"error"' in r.error if r.stream else r.error.startswith("{'message'"), r.error
    assert {r.status for r in results} <= {200, 429, 503}
