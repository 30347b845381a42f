"""A short soak (bench/soak.py, ~20 s): mixed traffic with a draft replica killed half way.
Nothing fails, and the report carries latency percentiles and Ray workers' memory."""

from __future__ import annotations

import asyncio
import time
from typing import Iterator

import pytest

from bench.soak import replica_actor_names, soak
from tests.serve.conftest import deployed

pytestmark = pytest.mark.serve

OVERRIDES = {
    "target_deployment": {"num_cpus": 0.5},
    "draft_deployment": {"num_cpus": 0.25},
    "router_deployment": {"num_cpus": 0.25},
}


@pytest.fixture(scope="module")
def app(ray_cluster: int) -> Iterator[str]:
    with deployed(ray_cluster, OVERRIDES) as base:
        yield base


def test_short_soak_with_a_draft_replica_killed(app: str) -> None:
    before = replica_actor_names("DraftServer")
    report = asyncio.run(soak(app, duration_s=20, max_requests=400, concurrency=3, kill="draft",
                              min_tokens=4, max_tokens=48, seed=1))
    print(report)
    assert report.killed and report.killed[0] in before
    assert report.failed == 0, report.failures
    assert report.completed >= 5 and report.completed + report.rejected == report.requests
    assert report.latency_p50_s is not None and report.latency_p50_s <= report.latency_p99_s <= report.latency_max_s
    assert report.worker_rss_end_mb and report.worker_rss_end_mb > 0
    assert any("TargetServer" in k for k in report.worker_rss_end_by_process_mb), report.worker_rss_end_by_process_mb
    # the killed draft replica is replaced
    deadline = time.monotonic() + 120
    while report.killed[0] in replica_actor_names("DraftServer") or not replica_actor_names("DraftServer"):
        assert time.monotonic() < deadline, "draft replica not replaced"
        time.sleep(0.5)
