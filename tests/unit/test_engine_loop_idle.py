"""The engine loop's idle path (app/engine/loop.py): pending draft releases are sent only after a
quiet spell, so a request that arrives right after the engine went idle is not held behind the
call to the draft replica."""

from __future__ import annotations

import threading
import time

from app.engine.loop import EngineLoop


class FakeProposer:
    def __init__(self, log: list[str]) -> None:
        self.log = log

    def flush(self) -> None:
        self.log.append("flush")


class FakeEngine:
    """One step per queued unit of work; the loop only needs has_work, step and the proposer."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.proposer = FakeProposer(self.log)
        self.work = 0
        self.lock = threading.Lock()

    def has_work(self) -> bool:
        with self.lock:
            return self.work > 0

    def step(self) -> list:
        with self.lock:
            self.work -= 1
        self.log.append("step")
        return []

    def flush_proposer(self) -> None:
        self.proposer.flush()

    def add_work(self, loop: EngineLoop) -> None:
        with self.lock:
            self.work += 1
        loop.wake.set()


def wait_until(cond, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_work_arriving_within_the_quiet_spell_runs_before_any_flush() -> None:
    engine = FakeEngine()
    loop = EngineLoop(engine, idle_flush_s=2.0)
    try:
        for _ in range(3):  # a closed loop: the next request comes soon after the last finished
            engine.add_work(loop)
            wait_until(lambda: not engine.has_work())
            time.sleep(0.02)
        wait_until(lambda: engine.log.count("step") == 3)
        assert "flush" not in engine.log, engine.log
    finally:
        loop.stop()


def test_a_quiet_spell_flushes_the_pending_releases() -> None:
    engine = FakeEngine()
    loop = EngineLoop(engine, idle_flush_s=0.05)
    try:
        engine.add_work(loop)
        wait_until(lambda: "flush" in engine.log)
        assert engine.log.index("step") < engine.log.index("flush")
    finally:
        loop.stop()
