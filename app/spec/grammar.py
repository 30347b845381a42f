"""Structured output (`response_format`): a grammar's token masks on the target's verification.

xgrammar (the library vLLM and SGLang use) compiles a JSON schema, or "any JSON object", into a
grammar over the tokenizer's vocabulary; a matcher per sequence follows the emitted tokens and
gives, at each position, the bitmask of tokens the grammar allows there (EOS once the value is
complete).

Under speculation a step verifies k proposals at once, so the target needs a mask for each of
the k + 1 positions: the matcher walks the proposals (position j's mask is the state after the
first j of them), then rolls back. A proposal the grammar forbids ends the draft there: it could
never be accepted, and the positions after it have no grammar state to mask with. The target's
logits are masked before greedy or sampled verification, so the output is what plain decoding
with the same grammar gives, and a proposal is judged against the constrained distribution.

The draft follows the same grammar (app/proposers/draft_model.py keeps a matcher per sequence
and masks each of its k passes), so its proposals are ones the target may accept: an
unconstrained draft, which knows nothing of the schema, proposes mostly forbidden tokens.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from functools import lru_cache
from typing import Any

import torch

from app.protocol.sampling_params import StructuredOutput
from app.runners.transfer import to_device

_BITS = 32  # xgrammar's bitmask: int32 words, bit i of word w is token 32 w + i
MAX_FORMATS = 64  # compiled response formats a model keeps (least recently used ones go)


class GrammarState:
    """One sequence's grammar matcher: masks for a step's positions, advanced by emitted tokens."""

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        import xgrammar

        self._xgr = xgrammar
        self.matcher = matcher
        self.vocab_size = vocab_size

    @property
    def done(self) -> bool:
        """The value is complete and its stop token emitted: nothing more is constrained."""
        return self.matcher.is_terminated()

    def masks(self, proposals: list[int]) -> tuple[torch.Tensor | None, int]:
        """Bitmasks `[n + 1, words]` int32 (CPU) of the positions after 0..n proposals, and n: how
        many leading proposals the grammar allows. None when the grammar is done."""
        if self.done:
            return None, len(proposals)
        bitmask = self._xgr.allocate_token_bitmask(len(proposals) + 1, self.vocab_size)  # [k+1, words]
        n = 0
        while True:
            self.matcher.fill_next_token_bitmask(bitmask, n)
            if n == len(proposals) or not self.matcher.accept_token(proposals[n]):
                break
            n += 1
            if self.done:  # the proposal was the stop token: nothing may follow it
                break
        self.rollback(n)
        return bitmask[:n + 1], n

    def next_mask(self) -> torch.Tensor | None:
        """The bitmask `[1, words]` of the next position; None when the grammar is done."""
        return self.masks([])[0]

    def try_accept(self, token: int) -> bool:
        """Follow a proposal (undo with rollback); False, and no move, where the grammar forbids it."""
        return not self.done and self.matcher.accept_token(token)

    def rollback(self, n: int) -> None:
        if n:
            self.matcher.rollback(n)

    def advance(self, tokens: list[int]) -> None:
        """Follow emitted tokens (each allowed by the mask it was drawn under)."""
        for token in tokens:
            if self.done:
                return
            if not self.matcher.accept_token(token):
                raise RuntimeError(f"token {token} was emitted where the response format forbids it")


class Grammars:
    """The compiler for one tokenizer; compiled grammars are cached by response format."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: frozenset[int], max_rollback: int) -> None:
        try:
            import xgrammar
        except ImportError as e:  # a dependency of the package; only a hand-made environment lacks it
            raise ValueError("response_format needs the xgrammar package on the target replica: "
                             "pip install xgrammar") from e
        self._xgr = xgrammar
        self.vocab_size = vocab_size
        self.max_rollback = max_rollback
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=sorted(stop_ids) or None)
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1)
        self._compile = lru_cache(maxsize=MAX_FORMATS)(self._compile_uncached)

    def _compile_uncached(self, fmt: StructuredOutput) -> Any:
        # any_whitespace=False: JSON with single separators. A model free to add whitespace can
        # pad a value with newlines until max_tokens, which a grammar cannot tell from progress.
        schema = fmt.schema_text if fmt.type == "json_schema" else json.dumps({"type": "object"})
        try:
            return self.compiler.compile_json_schema(schema, any_whitespace=False)
        except Exception as e:  # noqa: BLE001 — xgrammar raises RuntimeError/ValueError by kind of flaw
            # its messages start with "[time] source.cc:line: ", which tells the user nothing
            reason = re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", str(e)).strip()
            raise ValueError(f"response_format json_schema cannot be compiled: {reason}") from None

    def compile(self, fmt: StructuredOutput) -> None:
        """Compile (and cache) a format ahead of state(): a large schema takes a while, which a
        caller can spend outside the engine's lock. ValueError for a schema the compiler refuses."""
        self._compile(fmt)

    def state(self, fmt: StructuredOutput) -> GrammarState:
        """A matcher at the start of the output; ValueError for a schema the compiler refuses."""
        matcher = self._xgr.GrammarMatcher(self._compile(fmt), max_rollback_tokens=self.max_rollback)
        return GrammarState(matcher, self.vocab_size)


class LazyGrammars:
    """A model's Grammars, built on first use, and compiled formats: now (prepare, on the caller's
    thread) or in the background (ready), so a model step never waits for a compilation."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: frozenset[int], max_rollback: int) -> None:
        self._args = (tokenizer, vocab_size, stop_ids, max_rollback)
        self._grammars: Grammars | None = None
        self._lock = threading.Lock()  # guards _grammars and _pending
        self._pending: OrderedDict[StructuredOutput, Future] = OrderedDict()
        self._pool: ThreadPoolExecutor | None = None

    def _get(self) -> Grammars:
        if self._grammars is None:  # built outside the lock (seconds for a large vocabulary): ready() never waits
            built = Grammars(*self._args)
            with self._lock:
                if self._grammars is None:
                    self._grammars = built
        return self._grammars

    def prepare(self, fmt: StructuredOutput) -> None:
        """Compile now; ValueError for a schema the compiler refuses."""
        self._get().compile(fmt)
        with self._lock:
            if fmt not in self._pending:  # ready() from now on
                done: Future = Future()
                done.set_result(None)
                self._remember(fmt, done)

    def _remember(self, fmt: StructuredOutput, future: Future) -> None:
        self._pending[fmt] = future
        while len(self._pending) > MAX_FORMATS:
            self._pending.popitem(last=False)

    def ready(self, fmt: StructuredOutput) -> bool:
        """Whether `fmt` is compiled; if not, its compilation starts in the background."""
        with self._lock:
            future = self._pending.get(fmt)
            if future is None:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile")
                # building the Grammars (reading the vocabulary) happens on the pool's thread too
                future = self._pool.submit(lambda: self._get().compile(fmt))
                self._remember(fmt, future)
            self._pending.move_to_end(fmt)
        return future.done() and future.exception() is None

    def state(self, fmt: StructuredOutput) -> GrammarState:
        return self._get().state(fmt)


def apply_mask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits `[n, vocab]`, bitmask `[n, words]` (CPU int32) -> logits with forbidden tokens at -inf.

    A row the mask would leave with no token at all (the grammar allows only EOS while min_tokens
    bans it) keeps what the grammar allows: the grammar wins over min_tokens."""
    n, vocab = logits.shape
    bits = torch.arange(_BITS, dtype=torch.int32, device=logits.device)
    words = to_device(bitmask[:n], logits.device)  # [n, words]
    allowed = ((words.unsqueeze(-1) >> bits) & 1).bool().reshape(n, -1)[:, :vocab]  # [n, vocab]
    masked = logits.float().masked_fill(~allowed, float("-inf"))
    empty = torch.isneginf(masked).all(dim=-1, keepdim=True)  # [n, 1]
    return torch.where(empty & allowed, torch.zeros_like(masked), masked)
