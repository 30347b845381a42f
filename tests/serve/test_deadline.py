"""Deadlines: engine.limits.request_timeout_s bounds every request end to end. Past it a
non-streaming request gets a 504 with an OpenAI-style error, a streaming one an error event
then [DONE] (or the 504 itself if no token came in time), and the target frees the sequence."""

from __future__ import annotations

import json
import time
from typing import Iterator

import httpx
import pytest

from tests.serve.conftest import deployed

pytestmark = pytest.mark.serve

TIMEOUT_S = 0.5
OVERRIDES = {
    # n-gram speculation: no draft deployment to start for this module
    "engine": {"speculation": {"proposer": "ngram"}, "limits": {"request_timeout_s": TIMEOUT_S}},
    "target_deployment": {"num_cpus": 0.5},
    "router_deployment": {"num_cpus": 0.25},
}
# The router's own deadline is request_timeout_s + 2 s grace; allow for a loaded machine.
ANSWER_WITHIN_S = 10.0


@pytest.fixture(scope="module")
def app(ray_cluster: int) -> Iterator[str]:
    with deployed(ray_cluster, OVERRIDES) as base:
        yield base


def body(stream: bool) -> dict:
    return {"model": "specserve-embedded", "prompt": "class Parser:\n", "max_tokens": 1500, "temperature": 0,
            "ignore_eos": True, "stream": stream}


def target_cached() -> int:
    from ray import serve

    return serve.get_deployment_handle("TargetServer", "specserve").num_cached_sequences.remote().result(timeout_s=30)


def assert_timeout_error(error: dict) -> None:
    assert error["type"] == "timeout_error" and error["code"] == "request_timeout", error
    assert "deadline" in error["message"]


def wait_freed() -> None:
    deadline = time.monotonic() + 10
    while target_cached():
        assert time.monotonic() < deadline, "the timed-out sequence is still cached on the target"
        time.sleep(0.1)


def test_non_streaming_request_past_deadline_gets_504(app: str) -> None:
    t0 = time.monotonic()
    r = httpx.post(f"{app}/v1/completions", json=body(stream=False), timeout=120, trust_env=False)
    elapsed = time.monotonic() - t0
    assert r.status_code == 504, r.text
    assert_timeout_error(r.json()["error"])
    assert elapsed < ANSWER_WITHIN_S
    wait_freed()


def test_streaming_request_past_deadline_ends_with_error_event(app: str) -> None:
    t0 = time.monotonic()
    with httpx.stream("POST", f"{app}/v1/completions", json=body(stream=True), timeout=120, trust_env=False) as r:
        if r.status_code == 504:  # no token before the deadline (a loaded machine): the JSON error
            assert_timeout_error(json.loads(r.read())["error"])
        else:
            assert r.status_code == 200
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]", events[-3:]
            last = json.loads(events[-2])
            assert_timeout_error(last["error"])
            assert all("error" not in json.loads(e) for e in events[:-2])
    assert time.monotonic() - t0 < ANSWER_WITHIN_S
    wait_freed()


def test_chat_deadline_too(app: str) -> None:
    req = {"model": "specserve-embedded", "messages": [{"role": "user", "content": "write a parser"}],
           "max_tokens": 1500, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{app}/v1/chat/completions", json=req, timeout=120, trust_env=False)
    assert r.status_code == 504, r.text
    assert_timeout_error(r.json()["error"])
