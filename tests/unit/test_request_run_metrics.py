"""The router's request-level metrics, recorded by deployments/request_run.RequestRun:
prompt and generation tokens, TTFT, ITL, e2e latency, requests by finished_reason (abort when the
client goes away), failovers. Fakes stand in for the target handle and the router; no Ray starts.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections import Counter
from typing import Any

from ray.exceptions import RayActorError

from app.protocol.generation import GenerateChunk, GenerateRequest
from app.protocol.sampling_params import SamplingParams
from deployments.request_run import RequestRun


class RecordingMetrics:
    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.values: dict[str, list[Any]] = {}

    def __getattr__(self, name: str):
        def record(*args: Any) -> None:
            self.calls[name] += 1
            self.values.setdefault(name, []).append(args[0] if len(args) == 1 else args)
        return record


class FakeStream:
    def __init__(self, chunks: list[GenerateChunk], fail_after: int | None = None) -> None:
        self.chunks, self.fail_after = chunks, fail_after

    def __aiter__(self):
        return self._gen()

    async def _gen(self):
        for i, chunk in enumerate(self.chunks):
            if self.fail_after is not None and i == self.fail_after:
                raise RayActorError()
            await asyncio.sleep(0.001)
            yield chunk

    def cancel(self) -> None:
        pass


class FakeTarget:
    """Each `generate.remote` call takes the next stream from `streams`."""

    def __init__(self, streams: list[FakeStream]) -> None:
        self.streams = list(streams)
        self.requests: list[GenerateRequest] = []

    def options(self, **_: Any) -> "FakeTarget":
        return self

    @property
    def generate(self) -> "FakeTarget":
        return self

    def remote(self, request: GenerateRequest) -> FakeStream:
        self.requests.append(request)
        return self.streams.pop(0)


class FakePolicy:
    def observe_verification(self, *args: Any) -> None:
        pass

    def observe_finished(self, *args: Any) -> None:
        pass


class FakeRouter:
    def __init__(self, target: FakeTarget) -> None:
        self.target, self.metrics, self.policy = target, RecordingMetrics(), FakePolicy()
        self.in_flight, self.failovers, self.active_runs = 0, 0, set()


def _chunk(tokens: list[int], finish: str | None = None) -> GenerateChunk:
    return GenerateChunk(tokens, "x" * len(tokens), finish, replica="r1")


def _run(router: FakeRouter, prompt_len: int = 7, max_tokens: int = 6) -> RequestRun:
    req = GenerateRequest("cmpl-1", list(range(prompt_len)), SamplingParams(max_tokens=max_tokens), 4, 30.0)
    return RequestRun(router, req, decision=None, requested="on", prompt_class="code")


async def _drain(run: RequestRun) -> list[GenerateChunk]:
    return [c async for c in run.chunks()]


def test_finished_request() -> None:
    router = FakeRouter(FakeTarget([FakeStream([_chunk([1, 2, 3]), _chunk([4]), _chunk([5, 6], "length")])]))
    asyncio.run(_drain(_run(router)))
    mx = router.metrics
    assert mx.values["record_prompt_tokens"] == [7]
    assert mx.values["record_generation_tokens"] == [3, 1, 2]
    assert mx.calls["observe_ttft"] == 1
    assert mx.calls["observe_itl"] == 2  # one per token-carrying chunk after the first
    assert mx.calls["observe_e2e"] == 1
    assert mx.values["record_finished"] == ["length"]
    assert mx.calls["record_failover"] == 0
    assert router.in_flight == 0


def test_client_gone_counts_abort() -> None:
    router = FakeRouter(FakeTarget([FakeStream([_chunk([1]), _chunk([2]), _chunk([3], "stop")])]))

    async def first_only() -> None:
        gen = _run(router).chunks()
        await gen.__anext__()
        await gen.aclose()  # what Starlette does when the client disconnects

    asyncio.run(first_only())
    assert router.metrics.values["record_finished"] == ["abort"]
    assert router.metrics.calls["observe_e2e"] == 0


def test_failover_is_counted_and_tokens_once() -> None:
    streams = [FakeStream([_chunk([1, 2]), _chunk([3])], fail_after=1), FakeStream([_chunk([3, 4], "length")])]
    router = FakeRouter(FakeTarget(streams))
    asyncio.run(_drain(_run(router, max_tokens=4)))
    mx = router.metrics
    assert mx.calls["record_failover"] == 1 and router.failovers == 1
    assert mx.values["record_prompt_tokens"] == [7]  # the re-issue's prompt is not counted again
    assert sum(mx.values["record_generation_tokens"]) == 4
    assert mx.values["record_finished"] == ["length"]
    # the re-issue carries the prompt and, apart, what was streamed: the new replica resumes after it
    reissue = router.target.requests[1]
    assert (len(reissue.prompt_ids), reissue.output_ids, reissue.sampling.max_tokens) == (7, (1, 2), 4)


def test_choices_after_the_first_do_not_count_the_prompt_again() -> None:
    """n > 1: usage counts a prompt once; so does specserve_prompt_tokens_total."""
    router = FakeRouter(FakeTarget([FakeStream([_chunk([1], "length")]), FakeStream([_chunk([2], "length")])]))
    req = GenerateRequest("cmpl-abc-1", list(range(7)), SamplingParams(max_tokens=1), 4, 30.0)
    first = RequestRun(router, dataclasses.replace(req, request_id="cmpl-abc-0"), None, "on", "code",
                       shares_request=True, count_prompt=True)
    second = RequestRun(router, req, None, "on", "code", shares_request=True, count_prompt=False)
    asyncio.run(_drain(first))
    asyncio.run(_drain(second))
    assert router.metrics.values["record_prompt_tokens"] == [7]
    assert router.metrics.values["record_finished"] == ["length", "length"]
    assert second.log_extra() == {"completion_id": "cmpl-abc", "choice": 1}
    assert _run(router).log_extra() == {"completion_id": "cmpl-1", "choice": 0}
