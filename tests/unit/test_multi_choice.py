"""A request of several generations (n > 1, a list of prompts) runs one RequestRun per choice
(deployments/request_run.py): admitted all or none, collected or streamed concurrently, every run
released or cleaned up however the request ends, one usage over all of them."""

from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator

import pytest

from app.engine.acceptance import AcceptanceStats
from app.protocol.generation import GenerateChunk
from app.protocol.openai_api import SpeculationUsage, Usage
from deployments.request_run import RequestError, admit, collect, combined_usage, merged_chunks


class FakeRun:
    """What the helpers use of a RequestRun: first(), chunks(first), release(), usage(), stats.
    `admitted` counts like the router's in_flight (first() +1; chunks()' end or release() -1)."""

    admitted = 0

    def __init__(self, tokens: list[int], delay: float = 0.0, refuse: int | None = None, fail_at: int | None = None,
                 reason: str = "forced_on", k: int = 3) -> None:
        self.tokens, self.delay, self.refuse, self.fail_at = tokens, delay, refuse, fail_at
        self.reason, self.k = reason, k
        self.released = self.cleaned = False
        self.yielded = 0
        self.stats = AcceptanceStats()

    def _chunk(self, i: int) -> GenerateChunk:
        last = i == len(self.tokens) - 1
        return GenerateChunk([self.tokens[i]], f"t{self.tokens[i]} ", "length" if last else None, drafted=2, accepted=1)

    async def first(self) -> GenerateChunk:
        FakeRun.admitted += 1
        try:
            await asyncio.sleep(self.delay)
            if self.refuse is not None:
                raise RequestError(self.refuse, "queue full")
        except BaseException:
            FakeRun.admitted -= 1
            raise
        self.stats.record(2, 1)
        return self._chunk(0)

    async def chunks(self, first: GenerateChunk | None = None) -> AsyncIterator[GenerateChunk]:
        if first is None:
            first = await self.first()
        try:
            yield first
            for i in range(1, len(self.tokens)):
                await asyncio.sleep(self.delay)
                if self.fail_at == i:
                    raise RequestError(504, "deadline")
                self.stats.record(2, 1)
                self.yielded = i
                yield self._chunk(i)
        finally:
            self.cleaned = True
            FakeRun.admitted -= 1

    def release(self) -> None:
        self.released = True
        FakeRun.admitted -= 1

    def usage(self) -> Usage:
        spec = SpeculationUsage(mode="speculative" if self.k else "plain", requested="auto", k=self.k,
                                reason=self.reason, drafted_tokens=self.stats.num_draft_tokens,
                                accepted_tokens=self.stats.num_accepted_tokens, num_drafts=self.stats.num_drafts,
                                expected_speedup=1.5 if self.k else 1.0, batch_size=2)
        return Usage(prompt_tokens=7, completion_tokens=len(self.tokens), total_tokens=7 + len(self.tokens),
                     speculation=spec)


@pytest.fixture(autouse=True)
def _count() -> Any:
    FakeRun.admitted = 0
    yield
    assert FakeRun.admitted == 0, "a run was neither finished, cleaned up nor released"


def test_collect_runs_concurrently_and_keeps_order() -> None:
    runs = [FakeRun([1, 2, 3], delay=0.05), FakeRun([4, 5], delay=0.05), FakeRun([6], delay=0.05)]
    start = time.perf_counter()
    out = asyncio.run(collect(runs))
    elapsed = time.perf_counter() - start
    assert [[t for c in chunks for t in c.token_ids] for chunks in out] == [[1, 2, 3], [4, 5], [6]]
    assert elapsed < 0.25  # concurrent: ~3 x 0.05 s, not the 6 x 0.05 s of one run after another


def test_collect_first_error_cancels_the_others() -> None:
    async def go() -> FakeRun:
        runs = [FakeRun(list(range(50)), delay=0.01), FakeRun([1, 2, 3], delay=0.01, fail_at=2)]
        with pytest.raises(RequestError) as e:
            await collect(runs)
        assert e.value.status == 504
        await asyncio.sleep(0.02)  # the cancelled run's cleanup runs at its next step
        return runs[0]

    other = asyncio.run(go())
    assert other.cleaned and other.yielded < 10  # cancelled mid-stream, not run to its end


def test_admit_is_all_or_none() -> None:
    async def go() -> list[FakeRun]:
        runs = [FakeRun([1, 2]), FakeRun([3, 4], delay=0.05, refuse=429), FakeRun([5, 6], delay=0.01)]
        with pytest.raises(RequestError) as e:
            await admit(runs)
        assert e.value.status == 429
        return runs

    runs = asyncio.run(go())
    assert runs[0].released and runs[2].released and not runs[1].released  # the refused one undid its own


def test_admit_then_merged_stream_interleaves_and_ends_with_every_choice() -> None:
    async def go() -> list[tuple[int, GenerateChunk]]:
        runs = [FakeRun([1, 2, 3], delay=0.01), FakeRun([4, 5, 6], delay=0.01)]
        firsts = await admit(runs)
        return [x async for x in merged_chunks(runs, firsts)]

    out = asyncio.run(go())
    assert [c.token_ids[0] for i, c in out if i == 0] == [1, 2, 3]
    assert [c.token_ids[0] for i, c in out if i == 1] == [4, 5, 6]
    assert {i for i, _ in out[:2]} == {0, 1}  # both first chunks before any second one
    assert [i for i, c in out if c.finish_reason] == [0, 1] or [i for i, c in out if c.finish_reason] == [1, 0]


def test_merged_stream_closed_early_cleans_up_every_run() -> None:
    """The client leaves after the first event: every run ends (started ones through chunks()'
    cleanup, ones whose pump never ran through release())."""
    async def go() -> list[FakeRun]:
        runs = [FakeRun(list(range(20)), delay=0.01) for _ in range(3)]
        firsts = await admit(runs)
        stream = merged_chunks(runs, firsts)
        await stream.__anext__()
        await stream.aclose()
        await asyncio.sleep(0.05)
        return runs

    runs = asyncio.run(go())
    assert all(r.cleaned or r.released for r in runs)


def test_merged_stream_raises_a_runs_error() -> None:
    async def go() -> None:
        runs = [FakeRun(list(range(20)), delay=0.01), FakeRun([1, 2, 3], delay=0.01, fail_at=1)]
        firsts = await admit(runs)
        async for _ in merged_chunks(runs, firsts):
            pass

    with pytest.raises(RequestError):
        asyncio.run(go())


def test_single_run_paths_are_the_plain_ones() -> None:
    async def go() -> tuple[list[list[GenerateChunk]], list[tuple[int, GenerateChunk]]]:
        collected = await collect([FakeRun([1, 2])])
        run = FakeRun([3, 4])
        return collected, [x async for x in merged_chunks([run], await admit([run]))]

    collected, streamed = asyncio.run(go())
    assert [c.token_ids for c in collected[0]] == [[1], [2]]
    assert [(i, c.token_ids) for i, c in streamed] == [(0, [3]), (0, [4])]


def test_combined_usage_sums_choices_and_counts_each_prompt_once() -> None:
    async def go() -> list[FakeRun]:
        runs = [FakeRun([1, 2, 3], reason="forced_on"), FakeRun([4, 5], reason="forced_on"),
                FakeRun([6], reason="short_output", k=0)]
        await collect(runs)
        return runs

    runs = asyncio.run(go())
    usage = combined_usage(runs, prompt_tokens=12)
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (12, 6, 18)
    spec = usage.speculation
    assert spec.mode == "speculative" and spec.k == 3 and spec.reason == "forced_on,short_output"
    assert (spec.drafted_tokens, spec.accepted_tokens, spec.num_drafts) == (12, 6, 6)
    assert spec.acceptance_rate == pytest.approx(0.5)
    assert spec.expected_speedup == pytest.approx((1.5 + 1.5 + 1.0) / 3, abs=1e-3)
    assert combined_usage(runs[:1], prompt_tokens=99) == runs[0].usage()  # one run: its own usage
