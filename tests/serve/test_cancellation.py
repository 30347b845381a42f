"""Cancellation: a client that goes away mid-request stops its generation (Serve cancels the
router's request, the router cancels the target call, the engine aborts the sequence at the next
step boundary) and frees its caches on both replicas: the target's KV at once, the draft
replica's when the idle target flushes its pending releases."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Iterator

import httpx
import pytest

from tests.serve.conftest import deployed

pytestmark = pytest.mark.serve

OVERRIDES = {
    "target_deployment": {"num_cpus": 0.5},
    "draft_deployment": {"num_cpus": 0.25},
    "router_deployment": {"num_cpus": 0.25},
}
# Far more tokens than the test waits for: a full run takes tens of seconds even on a quiet
# machine, so caches emptying within FREED_WITHIN_S means the generation was stopped.
LONG = 1500
FREED_WITHIN_S = 10.0


@pytest.fixture(scope="module")
def app(ray_cluster: int) -> Iterator[str]:
    with deployed(ray_cluster, OVERRIDES) as base:
        yield base


def body(stream: bool, max_tokens: int = LONG) -> dict:
    return {"model": "specserve-embedded", "prompt": "def parse(lines):\n", "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "speculation": "on", "num_speculative_tokens": 4,
            "stream": stream}


def state() -> dict:
    from ray import serve

    target = serve.get_deployment_handle("TargetServer", "specserve").num_cached_sequences.remote()
    draft = serve.get_deployment_handle("DraftServer", "specserve").num_cached_sequences.remote()
    router = serve.get_deployment_handle("Router", "specserve").reliability_state.remote()
    return {"target": target.result(timeout_s=30), "draft": draft.result(timeout_s=30),
            "router_in_flight": router.result(timeout_s=30)["in_flight"]}


def wait_until(pred, timeout_s: float, what: str) -> tuple[float, dict]:
    t0 = time.monotonic()
    while True:
        s = state()
        if pred(s):
            return time.monotonic() - t0, s
        assert time.monotonic() - t0 < timeout_s, f"{what} not within {timeout_s}s: {s}"
        time.sleep(0.05)


def test_stream_disconnect_stops_generation_and_frees_both_caches(app: str) -> None:
    with httpx.Client(trust_env=False, timeout=120) as client:
        with client.stream("POST", f"{app}/v1/completions", json=body(stream=True)) as r:
            assert r.status_code == 200
            chunks = 0
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    assert "error" not in json.loads(line[6:])
                    chunks += 1
                    if chunks == 5:
                        # mid-stream: the sequence is alive on the target and (speculating) on the draft
                        _, during = wait_until(lambda s: s["target"] == 1 and s["draft"] == 1, 30,
                                               "sequence cached on both")
                        break  # closing the iterator closes the connection: the client is gone
    t_target, _ = wait_until(lambda s: s["target"] == 0 and s["router_in_flight"] == 0, FREED_WITHIN_S,
                             "generation stopped on the target")
    t_draft, _ = wait_until(lambda s: s["draft"] == 0, FREED_WITHIN_S, "draft cache released")
    print(f"target freed {t_target:.2f}s, draft freed {t_draft:.2f}s after disconnect (during: {during})")


def test_non_streaming_client_timeout_frees_caches(app: str) -> None:
    with httpx.Client(trust_env=False) as client:
        with pytest.raises(httpx.ReadTimeout):
            client.post(f"{app}/v1/completions", json=body(stream=False), timeout=httpx.Timeout(30, read=1.5))
    wait_until(lambda s: s["target"] == 0 and s["draft"] == 0 and s["router_in_flight"] == 0, FREED_WITHIN_S,
               "caches freed after the client gave up")


@pytest.mark.parametrize("stream", [True, False])
def test_several_choices_all_stop_when_the_client_leaves(app: str, stream: bool) -> None:
    """n=3 (three sequences for one request): a hang-up stops and frees every one of them."""
    request = {**body(stream=stream), "n": 3, "temperature": 0.8, "seed": 1}
    with httpx.Client(trust_env=False, timeout=120) as client:
        if stream:
            with client.stream("POST", f"{app}/v1/completions", json=request) as r:
                assert r.status_code == 200
                for n, _line in enumerate(line for line in r.iter_lines() if line.startswith("data: ")):
                    if n == 6:
                        wait_until(lambda s: s["target"] == 3 and s["router_in_flight"] == 3, 30, "3 sequences")
                        break
        else:
            with pytest.raises(httpx.ReadTimeout):
                client.post(f"{app}/v1/completions", json=request, timeout=httpx.Timeout(30, read=1.5))
    wait_until(lambda s: s == {"target": 0, "draft": 0, "router_in_flight": 0}, 2 * FREED_WITHIN_S,
               "every choice's sequence freed")


def test_many_disconnects_leave_nothing_behind(app: str) -> None:
    async def hang_up(i: int) -> None:
        async with httpx.AsyncClient(trust_env=False, timeout=120) as client:
            async with client.stream("POST", f"{app}/v1/completions", json=body(stream=True)) as r:
                assert r.status_code == 200
                n = 0
                async for line in r.aiter_lines():
                    n += line.startswith("data: ")
                    if n >= 1 + i % 3:  # hang up after 1..3 events
                        return

    async def run() -> None:
        await asyncio.gather(*(hang_up(i) for i in range(6)))

    asyncio.run(run())
    wait_until(lambda s: s == {"target": 0, "draft": 0, "router_in_flight": 0}, 2 * FREED_WITHIN_S,
               "all cancelled sequences freed")
    # and the service still answers
    r = httpx.post(f"{app}/v1/completions", json=body(stream=False, max_tokens=8), timeout=120, trust_env=False)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
