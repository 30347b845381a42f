"""Drive a SpecEngine from a background thread and hand results to asyncio callers.

The model work is synchronous torch code, so it runs on its own thread; request
coroutines (a Serve replica's handlers) submit work and await per-sequence queues.
Submissions and cancellations go to an inbox that the engine thread applies between two
steps, so sequences join and leave exactly at step boundaries and a caller never waits
for a step: the event loop that submits is the one that streams every other request's
tokens, and a step (a draft call and a GPU pass) takes milliseconds. A refused submission
(bad input, a full queue) arrives in its queue as `Rejected`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from app.protocol.sampling_params import SamplingParams
from app.engine.spec_engine import Overloaded, SeqUpdate, SpecEngine

log = logging.getLogger(__name__)

# A stream item costs Python time at every hop it crosses (serialising it, a Ray message, the router's
# chunk, the proxy's write): ~0.1-0.2 ms each. At 32 streams of an 8B model a replica steps ~150 times a
# second, and an item per sequence per step would take more of the replica's and router's CPU than the
# steps leave. So a replica's open streams share a budget of items per second: with s streams open, a
# stream's items come at least s / STREAM_ITEMS_PER_S apart (below ~10 streams that is less than a step:
# an item per step, as before), the steps between merged into one item.
STREAM_ITEMS_PER_S = 2000.0
# a non-streaming request's chunks serve only the router's failover (resume after what arrived): one
# item per this long loses at most that much work to a replica's death
NON_STREAMING_GAP_S = 0.1


def stream_gap_s(open_streams: int, streaming: bool) -> float:
    """The least time between two items of one stream (see STREAM_ITEMS_PER_S)."""
    gap = open_streams / STREAM_ITEMS_PER_S
    return gap if streaming else max(gap, NON_STREAMING_GAP_S)


class Rejected(Exception):
    """The engine refused a submitted sequence: `error` is SpecEngine.add's ValueError (bad input) or
    Overloaded (its queue is full)."""

    def __init__(self, error: ValueError | Overloaded) -> None:
        super().__init__(str(error))
        self.error = error


@dataclass(frozen=True)
class _Add:
    seq_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    k: int
    adaptive: bool
    alpha_prior: float | None
    output_ids: list[int] | None
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


@dataclass(frozen=True)
class _Cancel:
    seq_id: str
    queue: asyncio.Queue | None  # the submission it cancels: a later one under the same id is left alone


@dataclass
class LoopStats:
    steps: int = 0
    last_step_s: float = 0.0
    errors: int = 0


class EngineLoop:
    def __init__(self, engine: SpecEngine, on_step=None, idle_flush_s: float = 0.25) -> None:
        self.engine = engine
        self.idle_flush_s = idle_flush_s  # idle this long before pending draft releases are sent
        self.on_step = on_step  # callback(engine, updates, seconds) on the loop thread, for metrics
        self.lock = threading.Lock()  # held by the engine thread for a step, and for the inbox between steps
        self.wake = threading.Event()
        self._inbox: deque[_Add | _Cancel] = deque()  # appended by callers, emptied by the engine thread
        self.queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self.stats = LoopStats()
        self._stop = False
        self.thread = threading.Thread(target=self._run, name="specserve-engine", daemon=True)
        self.thread.start()

    def submit(self, seq_id: str, prompt_ids: list[int], sampling: SamplingParams, k: int,
               adaptive: bool = False, alpha_prior: float | None = None,
               output_ids: list[int] | None = None) -> asyncio.Queue:
        """Queue a sequence (SpecEngine.add's arguments) for the next step boundary; its updates, or
        `Rejected` when the engine refuses it, arrive in the returned queue. Call from the event loop."""
        queue: asyncio.Queue = asyncio.Queue()
        self._inbox.append(_Add(seq_id, prompt_ids, sampling, k, adaptive, alpha_prior, output_ids,
                                asyncio.get_running_loop(), queue))
        self.wake.set()
        return queue

    def cancel(self, seq_id: str, queue: asyncio.Queue | None = None) -> None:
        """Stop a sequence at the next step boundary and free its caches. With the queue submit() returned,
        only that submission is cancelled (a request re-issued under the same id may already be in)."""
        self._inbox.append(_Cancel(seq_id, queue))
        self.wake.set()

    def _apply_inbox(self) -> None:
        """Between two steps, under the lock: add and cancel sequences in the order they came."""
        while self._inbox:
            item = self._inbox.popleft()
            if isinstance(item, _Cancel):
                entry = self.queues.get(item.seq_id)
                if item.queue is not None and (entry is None or entry[1] is not item.queue):
                    continue  # that submission has ended (or was refused); the id may be another's now
                self.queues.pop(item.seq_id, None)
                try:
                    self.engine.abort(item.seq_id)
                except Exception:  # noqa: BLE001 — the engine thread must outlive one bad cancel
                    log.exception("cancelling sequence %s failed", item.seq_id)
                continue
            try:
                self.engine.add(item.seq_id, item.prompt_ids, item.sampling, item.k, adaptive=item.adaptive,
                                alpha_prior=item.alpha_prior, output_ids=item.output_ids)
            except (ValueError, Overloaded) as e:
                item.loop.call_soon_threadsafe(item.queue.put_nowait, Rejected(e))
            except Exception as e:  # noqa: BLE001 — a fault, not the request's: fail it, keep serving
                log.exception("adding sequence %s failed", item.seq_id)
                item.loop.call_soon_threadsafe(item.queue.put_nowait, e)
            else:
                self.queues[item.seq_id] = (item.loop, item.queue)

    def stop(self) -> None:
        self._stop = True
        self.wake.set()

    def _run(self) -> None:
        while not self._stop:
            if self._inbox:
                with self.lock:
                    self._apply_inbox()
            if not self.engine.has_work():
                # Free the draft's finished sequences only after a quiet spell: the flush is a call to
                # the draft replica on this thread, and a closed-loop client's next request, which
                # usually comes within milliseconds, would wait for it before its prefill
                if not self.wake.wait(timeout=self.idle_flush_s):
                    self._flush_releases()
                    self.wake.wait(timeout=0.5)
                self.wake.clear()
                continue
            t0 = time.perf_counter()
            with self.lock:
                try:
                    updates = self.engine.step()
                except Exception as e:  # noqa: BLE001 — fail the step's sequences, keep serving
                    log.exception("engine step failed")
                    self.stats.errors += 1
                    self._fail_all(e)
                    continue
                targets = [(u, self.queues.get(u.seq_id)) for u in updates]
                for u in updates:
                    if u.finish_reason is not None:
                        self.queues.pop(u.seq_id, None)
            elapsed = time.perf_counter() - t0
            self.stats.steps += 1
            self.stats.last_step_s = elapsed
            for update, target in targets:
                if target is not None:
                    loop, queue = target
                    loop.call_soon_threadsafe(queue.put_nowait, update)
            if self.on_step is not None:
                self.on_step(self.engine, updates, elapsed)

    def _flush_releases(self) -> None:
        """Idle: free finished/cancelled sequences on the draft replica now, not at the next step."""
        try:
            with self.lock:  # against a benchmark's set_draft_ahead (the inbox is this thread's, not held up)
                self.engine.flush_proposer()
        except Exception as e:  # noqa: BLE001 — a draft that is down holds nothing worth freeing
            log.debug("releasing draft caches failed: %s", e)

    def _fail_all(self, error: Exception) -> None:
        for seq_id, (loop, queue) in list(self.queues.items()):
            self.engine.abort(seq_id)
            loop.call_soon_threadsafe(queue.put_nowait, error)
        self.queues.clear()


async def stream_updates(queue: asyncio.Queue, timeout_s: float):
    """Yield SeqUpdates until the sequence finishes; raise TimeoutError past the deadline."""
    deadline = time.monotonic() + timeout_s
    expired = f"request exceeded its {timeout_s:.0f}s deadline"
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(expired)
        # asyncio.timeout, not wait_for: on Python 3.11 wait_for swallows a cancellation that
        # lands in the same loop turn as the item (it returns the item instead), and a
        # cancelled request then keeps generating until max_tokens
        try:
            async with asyncio.timeout(remaining):
                item = await queue.get()
        except TimeoutError:
            raise TimeoutError(expired) from None
        if isinstance(item, Exception):
            raise item
        update: SeqUpdate = item
        yield update
        if update.finish_reason is not None:
            return


async def stream_batches(queue: asyncio.Queue, timeout_s: float, min_gap_s: Callable[[], float] = lambda: 0.0):
    """stream_updates, coalesced: each item is a list of every update waiting at that moment (one
    while the consumer keeps up); the last list ends with the finishing update. Items come at least
    min_gap_s() apart: an update that arrives sooner waits, gathering the steps after it, until the
    gap has passed or the finishing update arrives (the first and the last item never wait)."""
    last_yield = -float("inf")
    async for update in stream_updates(queue, timeout_s):
        batch = [update]
        due = last_yield + min_gap_s()
        while batch[-1].finish_reason is None:
            if queue.empty():
                remaining = due - time.monotonic()
                if remaining <= 0:
                    break
                try:
                    async with asyncio.timeout(remaining):
                        item = await queue.get()
                except TimeoutError:
                    break
            else:
                item = queue.get_nowait()
            if isinstance(item, Exception):
                raise item
            batch.append(item)
        yield batch
        if batch[-1].finish_reason is not None:
            return
        last_yield = time.monotonic()
