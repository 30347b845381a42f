"""Incremental detokenization with stop strings checked on text, not tokens.

Text is released only when it can no longer change: a trailing replacement character
(an unfinished UTF-8 sequence split across byte-level BPE tokens) and any suffix that
could still grow into a stop string are held back. When a stop string appears, the text
ends just before it and no later token is emitted.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

DECODE_CONTEXT = 4  # tokens decoded before the settled point, so spaces and bytes join as in a whole decode


@dataclass
class TextUpdate:
    delta: str  # newly released text
    num_tokens: int  # how many of the offered tokens were kept (tokens past a stop are dropped)
    stopped: bool  # a stop string was found


class StopChecker:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        # decode() converts its argument element by element (to_py_obj) before calling _decode: ids here
        # are lists of ints already, and at tens of sequences a step that conversion was the largest
        # part of a step's host time. The output is decode()'s: it is the same call past the conversion.
        self._decode_ids: Callable[..., str] = getattr(tokenizer, "_decode", tokenizer.decode)
        self.stop = tuple(s for s in stop if s)
        self.token_ids: list[int] = []
        self.released = ""  # text already handed out
        self._settled_tokens = 0  # decode(token_ids[:_settled_tokens]) == _settled_text
        self._settled_text = ""

    def _decode(self, new_ids: list[int]) -> str:
        """decode(token_ids + new_ids) in time independent of the output's length: the settled text
        plus what decoding from a few tokens before the settled point adds (vLLM's incremental
        detokenization: the context lets the tokenizer place spaces and join bytes as in a whole
        decode). Falls back to a whole decode where the two could disagree."""
        n0 = self._settled_tokens
        if n0:
            c = max(0, n0 - DECODE_CONTEXT)
            head = self._decode_ids(self.token_ids[c:n0], skip_special_tokens=True)
            tail = self._decode_ids(self.token_ids[c:] + new_ids, skip_special_tokens=True)
            if tail.startswith(head) and not head.endswith("\ufffd"):
                return self._settled_text + tail[len(head):]
        return self._decode_ids(self.token_ids + new_ids, skip_special_tokens=True)

    def _settle(self, text: str) -> None:
        """Remember the text of every token so far (the next decodes start near its end), unless it
        ends inside a character (a byte-level token that a later one completes)."""
        if not text.endswith("\ufffd"):
            self._settled_tokens, self._settled_text = len(self.token_ids), text

    def add(self, new_ids: list[int]) -> TextUpdate:
        """Offer new tokens; returns the text that may be released and where a stop cut in."""
        # with stop strings, each token's text is checked in turn (no token past a stop is kept)
        for used in range(1, len(new_ids) + 1 if self.stop else 0):
            text = self._decode(new_ids[:used])
            cut = self._find_stop(text)
            if cut is not None:
                self.token_ids.extend(new_ids[:used])
                delta = text[len(self.released) : cut] if cut > len(self.released) else ""
                self.released += delta
                return TextUpdate(delta=delta, num_tokens=used, stopped=True)
        text = self._decode(new_ids)
        self.token_ids.extend(new_ids)
        self._settle(text)
        stable = len(text) - self._holdback(text)
        delta = text[len(self.released) : stable] if stable > len(self.released) else ""
        self.released += delta
        return TextUpdate(delta=delta, num_tokens=len(new_ids), stopped=False)

    def flush(self) -> str:
        """At the end of generation, release whatever was held back (no stop can complete now)."""
        text = self._decode([])
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
