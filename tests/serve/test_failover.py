"""Failover: `ray.kill` a draft replica, then a target replica, while greedy requests (streaming and
not, speculation on) are in flight. Every request completes with exactly the tokens of an
undisturbed run: a lost draft means plain decoding (or a cache-miss resend to the next draft
replica); a lost target means the router re-issues prompt + streamed tokens to the other one."""

from __future__ import annotations

import asyncio
import time
from typing import Iterator

import httpx
import pytest

from bench.soak import Result, call, kill_replica, replica_actor_names
from deployments.request_router import _score
from tests.serve.conftest import deployed

pytestmark = pytest.mark.serve

OVERRIDES = {
    "target_deployment": {"num_replicas": 2, "num_cpus": 0.5},
    "draft_deployment": {"num_replicas": 2, "num_cpus": 0.25},
    "router_deployment": {"num_cpus": 0.25},
}
PROMPTS = ["def read_config(path):\n", "class Stack:\n", "import os\nimport sys\n", "for i in range(",
           "# Parse the arguments\n", "def main():\n"]
MAX_TOKENS = 96


@pytest.fixture(scope="module")
def app(ray_cluster: int) -> Iterator[str]:
    with deployed(ray_cluster, OVERRIDES) as base:
        yield base


def body(i: int) -> dict:
    # ignore_eos: every request runs MAX_TOKENS tokens, long enough to be killed mid-stream
    return {"model": "specserve-embedded", "prompt": PROMPTS[i], "max_tokens": MAX_TOKENS, "temperature": 0,
            "speculation": "on", "num_speculative_tokens": 4, "ignore_eos": True, "stream": i % 2 == 1,
            "stream_options": {"include_usage": True}}


def router_state() -> dict:
    from ray import serve

    return serve.get_deployment_handle("Router", "specserve").reliability_state.remote().result(timeout_s=30)


async def run_batch(base: str, kill=None) -> tuple[list[Result], dict]:
    """Six concurrent requests; `kill(state)` runs once every request has streamed a token."""
    from ray import serve

    router = serve.get_deployment_handle("Router", "specserve")
    info: dict = {}
    async with httpx.AsyncClient(trust_env=False) as client:
        tasks = [asyncio.create_task(call(client, base, body(i), timeout_s=180)) for i in range(len(PROMPTS))]
        if kill is not None:
            deadline = time.monotonic() + 120
            while True:
                state = await router.reliability_state.remote()
                if sum(state["by_replica"].values()) == len(PROMPTS):
                    break  # all admitted and producing tokens
                assert not any(t.done() for t in tasks), "a request finished before the kill: raise MAX_TOKENS"
                assert time.monotonic() < deadline, f"requests never all started: {state}"
                await asyncio.sleep(0.02)
            info["state"] = state
            info["killed"] = kill(state)
            info["in_flight_at_kill"] = sum(not t.done() for t in tasks)
        results = await asyncio.gather(*tasks)
    return list(results), info


def wait_replicas(deployment: str, n: int, exclude: str, timeout_s: float = 180) -> None:
    """Serve replaced the killed replica: n live replica actors again, none of them `exclude`."""
    from ray import serve

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        names = replica_actor_names(deployment)
        status = serve.status().applications["specserve"].deployments[deployment]
        if len(names) == n and exclude not in names and status.replica_states.get("RUNNING") == n:
            return
        time.sleep(0.5)
    raise AssertionError(f"{deployment} did not come back to {n} replicas: {replica_actor_names(deployment)}")


@pytest.fixture(scope="module")
def baseline(app: str) -> list[Result]:
    results, _ = asyncio.run(run_batch(app))
    assert all(r.ok for r in results), [r.error for r in results]
    assert all(r.finish_reason == "length" for r in results)
    return results


def assert_identical(results: list[Result], baseline: list[Result]) -> None:
    for i, (got, want) in enumerate(zip(results, baseline)):
        assert got.ok, f"request {i} (stream={got.stream}) failed: status {got.status}: {got.error}"
        assert got.usage["completion_tokens"] == want.usage["completion_tokens"] == MAX_TOKENS, i
        assert got.text == want.text, f"request {i} (stream={got.stream}) diverged after the kill"


def test_draft_replica_killed_mid_request(app: str, baseline: list[Result]) -> None:
    def kill(state: dict) -> str:
        # The draft replica that a busy target replica talks to (the affinity router's pick).
        drafts = replica_actor_names("DraftServer")
        target_id = max(state["by_replica"], key=state["by_replica"].get)
        victim = max(drafts, key=lambda name: _score(target_id, name.rsplit("#", 1)[1]))
        return kill_replica("DraftServer", name=victim)

    results, info = asyncio.run(run_batch(app, kill))
    assert info["in_flight_at_kill"] == len(PROMPTS)
    assert_identical(results, baseline)
    # speculation really ran in this batch (before the kill, or after via the other replica)
    assert sum(r.usage["speculation"]["drafted_tokens"] for r in results) > 0
    wait_replicas("DraftServer", 2, info["killed"])


def test_target_replica_killed_mid_request(app: str, baseline: list[Result]) -> None:
    before = router_state()["failovers"]

    def kill(state: dict) -> tuple[str, int]:
        busiest = max(state["by_replica"], key=state["by_replica"].get)
        victim = next(n for n in replica_actor_names("TargetServer") if n.endswith(f"#{busiest}"))
        return kill_replica("TargetServer", name=victim), state["by_replica"][busiest]

    results, info = asyncio.run(run_batch(app, kill))
    victim, on_victim = info["killed"]
    assert info["in_flight_at_kill"] == len(PROMPTS)
    assert_identical(results, baseline)
    # each request that was on the killed replica was re-issued (at least once) to the survivor
    assert router_state()["failovers"] - before >= on_victim >= 1
    wait_replicas("TargetServer", 2, victim)
    # and the app serves normally on the replaced replica set
    after, _ = asyncio.run(run_batch(app))
    assert_identical(after, baseline)
    assert router_state()["in_flight"] == 0
