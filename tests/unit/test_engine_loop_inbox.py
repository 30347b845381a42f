"""The engine loop's inbox (app/engine/loop.py): submitting or cancelling never waits for a running
step (the caller is the event loop that streams every other request), sequences join and leave in
the order they came at the next step boundary, and a refused one gets `Rejected` in its queue."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from app.engine.loop import EngineLoop, Rejected
from app.engine.spec_engine import Overloaded, SeqUpdate
from app.protocol.sampling_params import SamplingParams


class SlowEngine:
    """Each step emits one token per running sequence and ends only when the test lets it."""

    def __init__(self) -> None:
        self.running: list[str] = []
        self.log: list[str] = []
        self.proposer = None
        self.in_step = threading.Event()
        self.release = threading.Event()

    def add(self, seq_id: str, prompt_ids, sampling, k, adaptive=False, alpha_prior=None, output_ids=None) -> None:
        if not prompt_ids:
            raise ValueError("prompt is empty")
        if seq_id.startswith("full"):
            raise Overloaded("32 requests already waiting")
        self.log.append(f"add {seq_id}")
        self.running.append(seq_id)

    def abort(self, seq_id: str) -> bool:
        self.log.append(f"abort {seq_id}")
        if seq_id in self.running:
            self.running.remove(seq_id)
            return True
        return False

    def has_work(self) -> bool:
        return bool(self.running)

    def step(self) -> list[SeqUpdate]:
        self.in_step.set()
        assert self.release.wait(5)
        self.release.clear()
        self.in_step.clear()
        done, self.running = self.running, []
        return [SeqUpdate(s, [1], "x", "length", 0, 0, 0) for s in done]


def test_submit_and_cancel_do_not_wait_for_a_running_step() -> None:
    async def main() -> None:
        engine = SlowEngine()
        loop = EngineLoop(engine)
        try:
            first = loop.submit("a", [1, 2], SamplingParams(max_tokens=1), 0)
            assert await asyncio.to_thread(engine.in_step.wait, 5)  # the step holds the engine's lock
            t0 = time.monotonic()
            second = loop.submit("b", [3], SamplingParams(max_tokens=1), 0)
            loop.cancel("gone")
            bad = loop.submit("c", [], SamplingParams(max_tokens=1), 0)
            full = loop.submit("full-1", [4], SamplingParams(max_tokens=1), 0)
            assert time.monotonic() - t0 < 0.5 and engine.log == ["add a"]  # nothing applied mid-step
            engine.release.set()
            assert (await asyncio.wait_for(first.get(), 5)).seq_id == "a"
            assert await asyncio.to_thread(engine.in_step.wait, 5)  # the next step runs b
            assert engine.log == ["add a", "add b", "abort gone"]  # the inbox, in order, between steps
            engine.release.set()
            assert (await asyncio.wait_for(second.get(), 5)).seq_id == "b"
            refused = await asyncio.wait_for(bad.get(), 5)
            assert isinstance(refused, Rejected) and isinstance(refused.error, ValueError)
            assert "prompt is empty" in str(refused)
            assert isinstance((await asyncio.wait_for(full.get(), 5)).error, Overloaded)
        finally:
            engine.release.set()
            loop.stop()

    asyncio.run(main())


def test_a_cancel_that_follows_its_submit_before_the_boundary_leaves_nothing_running() -> None:
    async def main() -> None:
        engine = SlowEngine()
        loop = EngineLoop(engine)
        try:
            loop.submit("a", [1], SamplingParams(max_tokens=1), 0)
            assert await asyncio.to_thread(engine.in_step.wait, 5)
            loop.submit("b", [2], SamplingParams(max_tokens=1), 0)
            loop.cancel("b")
            engine.release.set()
            deadline = time.monotonic() + 5
            while engine.log[-1:] != ["abort b"]:
                assert time.monotonic() < deadline, engine.log
                await asyncio.sleep(0.01)
            assert engine.log == ["add a", "add b", "abort b"] and not engine.running
            assert "b" not in loop.queues
        finally:
            engine.release.set()
            loop.stop()

    asyncio.run(main())


@pytest.mark.parametrize("error", [ValueError("bad"), Overloaded("full")])
def test_rejected_keeps_the_engines_error(error: Exception) -> None:
    rejected = Rejected(error)
    assert rejected.error is error and str(rejected) == str(error)


def test_a_late_cancel_leaves_a_newer_submission_under_the_same_id_alone() -> None:
    """A request re-issued under its id can be submitted before the old stream's cancel arrives: the
    cancel names its own submission's queue and does not touch the new one."""
    async def main() -> None:
        engine = SlowEngine()
        loop = EngineLoop(engine)
        try:
            old = loop.submit("a", [1], SamplingParams(max_tokens=1), 0)
            assert await asyncio.to_thread(engine.in_step.wait, 5)
            engine.release.set()
            assert (await asyncio.wait_for(old.get(), 5)).finish_reason == "length"
            assert await asyncio.to_thread(engine.in_step.wait, 0.2) is False  # idle again
            new = loop.submit("a", [2], SamplingParams(max_tokens=1), 0)
            loop.cancel("a", old)  # the old stream's late cleanup
            assert await asyncio.to_thread(engine.in_step.wait, 5)
            engine.release.set()
            assert (await asyncio.wait_for(new.get(), 5)).seq_id == "a"
            assert engine.log == ["add a", "add a"]  # never aborted
            loop.cancel("a", new)  # a cancel of the live submission still works (it has finished: nothing to do)
        finally:
            engine.release.set()
            loop.stop()

    asyncio.run(main())
