"""The measured step times a target replica publishes in its routing stats, for the router's cost model."""

from __future__ import annotations

import threading
from typing import Any


class StepWindow:
    """Measured step times for the router's cost model, published per kind.

    The engine loop thread adds every step; `publish()` (Serve's record_routing_stats, ~1/s)
    closes the window, and every kind measured in it gets its mean seconds and mean tokens under a
    new per-kind counter (`<kind>_seq`). A kind not measured in a window keeps its last figures
    and counter: the router's policy ingests each (replica, kind, counter) once
    (SpeculationPolicy.ingest), and a rare measurement — the wide pass of an exploration step —
    reaches it even when another caller read the window it was measured in.
    Kinds: decode (no sequence speculated: tokens = batch), verify (some did: tokens = every
    token of the pass), draft (seconds per draft step at the draft batch = speculating
    sequences), exchange (the draft call's hop, outside the draft's own compute).
    `seq` counts publications that measured anything.
    """

    KINDS = ("decode", "verify", "draft", "exchange")
    _KEYS = {"decode": ("decode_step_s", "decode_tokens"), "verify": ("verify_step_s", "verify_tokens"),
             "draft": ("draft_step_s", "draft_batch"), "exchange": ("exchange_s", None)}

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sums = self._empty()
        self.seq = 0
        self._kind_seq = {kind: 0 for kind in self.KINDS}
        self.last: dict[str, Any] = {}

    @staticmethod
    def _empty() -> dict[str, list[float]]:
        return {kind: [0.0, 0.0, 0] for kind in StepWindow.KINDS}  # seconds, tokens, count

    def add(self, kind: str, seconds: float, tokens: float = 0.0) -> None:
        if seconds <= 0:
            return
        with self._lock:
            acc = self._sums[kind]
            acc[0] += seconds
            acc[1] += tokens
            acc[2] += 1

    def publish(self) -> dict[str, Any]:
        with self._lock:
            sums, self._sums = self._sums, self._empty()
            measured = False
            for kind, (key_s, key_n) in self._KEYS.items():
                seconds, tokens, n = sums[kind]
                if not n:
                    continue
                measured = True
                self._kind_seq[kind] += 1
                self.last[key_s] = seconds / n
                if key_n is not None:
                    self.last[key_n] = max(1, round(tokens / n))
                self.last[f"{kind}_seq"] = self._kind_seq[kind]
            if measured:
                self.seq += 1
            self.last["seq"] = self.seq
            return dict(self.last)
