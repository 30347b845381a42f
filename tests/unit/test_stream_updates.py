"""stream_updates: the per-request consumer of the engine loop's queue. A cancelled request
must stop consuming even when its cancellation lands in the same event-loop turn as an update
(asyncio.wait_for on Python 3.11 returns the update instead, and the request then keeps
generating to max_tokens on the replica: the leak the cancellation serve test caught)."""

from __future__ import annotations

import asyncio
import time

import pytest

from app.engine.spec_engine import SeqUpdate
from app.engine.loop import stream_updates


def update(token: int, finish: str | None = None) -> SeqUpdate:
    return SeqUpdate(seq_id="s", token_ids=[token], text=str(token), finish_reason=finish)


async def consume(queue: asyncio.Queue, got: list[int], timeout_s: float = 30.0) -> None:
    async for u in stream_updates(queue, timeout_s):
        got.extend(u.token_ids)


def test_cancel_in_the_same_turn_as_an_update_is_not_lost() -> None:
    async def run() -> tuple[bool, list[int]]:
        queue: asyncio.Queue = asyncio.Queue()
        got: list[int] = []
        task = asyncio.create_task(consume(queue, got))
        queue.put_nowait(update(1))
        await asyncio.sleep(0.01)  # the consumer took token 1 and waits for the next
        queue.put_nowait(update(2))  # wakes the waiting get() ...
        task.cancel()  # ... and the client goes away in the same turn
        done, _ = await asyncio.wait([task], timeout=2.0)
        return bool(done) and task.cancelled(), got

    cancelled, got = asyncio.run(run())
    assert cancelled, f"the consumer swallowed its cancellation and kept waiting (got {got})"
    assert got[0] == 1


def test_updates_stream_until_finish() -> None:
    async def run() -> list[int]:
        queue: asyncio.Queue = asyncio.Queue()
        for t, fin in ((1, None), (2, None), (3, "length")):
            queue.put_nowait(update(t, fin))
        queue.put_nowait(update(99))  # never read: the stream ended at the finish
        got: list[int] = []
        await consume(queue, got)
        return got

    assert asyncio.run(run()) == [1, 2, 3]


def test_deadline_raises_timeout_error_with_the_budget() -> None:
    async def run() -> None:
        await consume(asyncio.Queue(), [], timeout_s=0.05)

    with pytest.raises(TimeoutError, match="deadline"):
        asyncio.run(run())


def test_engine_error_is_raised_to_the_consumer() -> None:
    async def run() -> None:
        queue: asyncio.Queue = asyncio.Queue()
        queue.put_nowait(RuntimeError("engine step failed"))
        await consume(queue, [])

    with pytest.raises(RuntimeError, match="engine step failed"):
        asyncio.run(run())


def test_a_slow_reader_gets_every_waiting_step_in_one_batch() -> None:
    from app.engine.loop import stream_batches

    async def run() -> list[list[int]]:
        queue: asyncio.Queue = asyncio.Queue()
        for t in (1, 2, 3):
            queue.put_nowait(update(t))
        batches: list[list[int]] = []
        async for batch in stream_batches(queue, 5.0):
            batches.append([x for u in batch for x in u.token_ids])
            if len(batches) == 1:
                queue.put_nowait(update(4))
                queue.put_nowait(update(5, "length"))
                queue.put_nowait(update(6))  # after the finish: never read
        return batches

    assert asyncio.run(run()) == [[1, 2, 3], [4, 5]]


def test_a_merged_chunk_keeps_each_steps_drafts_and_origins() -> None:
    from app.protocol.generation import GenerateChunk

    one = GenerateChunk([7, 8, 9], "abc", None, drafted=4, accepted=2)
    assert one.parts() == ((3, 4, 2),) and one.origins() == [True, True, False]
    merged = GenerateChunk([7, 8, 9, 10], "abcd", None, drafted=6, accepted=3, steps=((3, 4, 2), (1, 2, 1)))
    assert merged.parts() == ((3, 4, 2), (1, 2, 1))
    assert merged.origins() == [True, True, False, True]


def test_many_streams_space_their_items_and_non_streaming_merges_more() -> None:
    from app.engine.loop import NON_STREAMING_GAP_S, STREAM_ITEMS_PER_S, stream_gap_s

    assert stream_gap_s(1, True) < 0.001  # a lone stream: an item per step
    assert stream_gap_s(64, True) == 2 * stream_gap_s(32, True) == 64 / STREAM_ITEMS_PER_S
    assert stream_gap_s(1, False) == NON_STREAMING_GAP_S
    assert stream_gap_s(10_000, False) == 10_000 / STREAM_ITEMS_PER_S


@pytest.mark.parametrize("gap, expected", [(0.0, [[1], [2], [3, 4]]), (0.3, [[1], [2, 3, 4]])])
def test_an_update_sooner_than_the_gap_waits_for_the_steps_after_it(gap: float, expected: list) -> None:
    from app.engine.loop import stream_batches

    async def run() -> list[list[int]]:
        queue: asyncio.Queue = asyncio.Queue()
        queue.put_nowait(update(1))

        async def later_steps() -> None:
            await asyncio.sleep(0.02)
            queue.put_nowait(update(3))
            queue.put_nowait(update(4, "stop"))

        batches: list[list[int]] = []
        async for batch in stream_batches(queue, 5.0, lambda: gap):
            batches.append([x for u in batch for x in u.token_ids])
            if len(batches) == 1:  # the first update is never held back
                queue.put_nowait(update(2))
                task = asyncio.create_task(later_steps())
        await task
        return batches

    assert asyncio.run(run()) == expected


def test_the_finishing_update_is_not_held_back_by_the_gap() -> None:
    from app.engine.loop import stream_batches

    async def run() -> tuple[list[list[int]], float]:
        queue: asyncio.Queue = asyncio.Queue()
        queue.put_nowait(update(1))
        t0 = 0.0

        async def finish() -> None:
            await asyncio.sleep(0.02)
            queue.put_nowait(update(3, "stop"))

        batches: list[list[int]] = []
        async for batch in stream_batches(queue, 5.0, lambda: 30.0):  # a gap no test would wait out
            batches.append([x for u in batch for x in u.token_ids])
            if len(batches) == 1:
                queue.put_nowait(update(2))
                task = asyncio.create_task(finish())
                t0 = time.monotonic()
        await task
        return batches, time.monotonic() - t0

    batches, waited = asyncio.run(run())
    assert batches == [[1], [2, 3]]
    assert waited < 10.0, "the finishing update waited for the gap"
