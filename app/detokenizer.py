"""Incremental detokenization with stop strings checked on text, not tokens.

Text is released only when it can no longer change: a trailing replacement character
(an unfinished UTF-8 sequence split across byte-level BPE tokens) and any suffix that
could still grow into a stop string are held back. When a stop string appears, the text
ends just before it and no later token is emitted.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase


@dataclass
class TextUpdate:
    delta: str  # newly released text
    num_tokens: int  # how many of the offered tokens were kept (tokens past a stop are dropped)
    stopped: bool  # a stop string was found


class StopChecker:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.token_ids: list[int] = []
        self.released = ""  # text already handed out

    def _decode(self, ids: list[int]) -> str:
        # Re-decoding the whole output is O(n) per step; fine at the lengths served here and
        # always right for byte-level BPE, where a token's text depends on its neighbours.
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, new_ids: list[int]) -> TextUpdate:
        """Offer new tokens; returns the text that may be released and where a stop cut in."""
        for used in range(1, len(new_ids) + 1):
            text = self._decode(self.token_ids + new_ids[:used])
            cut = self._find_stop(text)
            if cut is not None:
                self.token_ids.extend(new_ids[:used])
                delta = text[len(self.released) : cut] if cut > len(self.released) else ""
                self.released += delta
                return TextUpdate(delta=delta, num_tokens=used, stopped=True)
        self.token_ids.extend(new_ids)
        text = self._decode(self.token_ids)
        stable = len(text) - self._holdback(text)
        delta = text[len(self.released) : stable] if stable > len(self.released) else ""
        self.released += delta
        return TextUpdate(delta=delta, num_tokens=len(new_ids), stopped=False)

    def flush(self) -> str:
        """At the end of generation, release whatever was held back (no stop can complete now)."""
        text = self._decode(self.token_ids)
        delta = text[len(self.released) :] if text.startswith(self.released) else ""
        self.released += delta
        return delta

    def _find_stop(self, text: str) -> int | None:
        # only search where a stop string could newly appear (overlapping released text)
        start = max(0, len(self.released) - max((len(s) for s in self.stop), default=0))
        hits = [i for s in self.stop if (i := text.find(s, start)) >= 0]
        return min(hits) if hits else None

    def _holdback(self, text: str) -> int:
        hold = 0
        if text.endswith("\ufffd"):
            hold = len(text) - len(text.rstrip("\ufffd"))
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:n]):
                    hold = max(hold, n)
                    break
        return hold
