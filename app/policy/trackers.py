"""Live statistics the policy learns from: acceptance per prompt class, completion lengths, and a
cheap prompt classifier. Pure Python, thread-safe (the engine may feed them from its loop thread
while the router reads them)."""

from __future__ import annotations

import re
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Literal

PromptClass = Literal["code", "prose", "chat"]
FinishReason = Literal["stop", "length"]

_POOLED = "*"  # statistics over all classes: the prior for a class not seen yet


@dataclass
class _AcceptState:
    # Decayed counts. A "trial" is a drafted token the target actually judged: every accepted one
    # plus the first rejected one; tokens after the first rejection are never judged.
    successes: float = 0.0
    trials: float = 0.0
    pos_successes: list[float] = field(default_factory=list)
    pos_trials: list[float] = field(default_factory=list)
    steps: int = 0  # verification steps observed, undecayed


class AcceptanceTracker:
    """Per-token acceptance α of one draft/target pair, per prompt class, as a decaying average.

    α is estimated as successes / trials with trials = accepted + (1 if a rejection happened):
    the maximum-likelihood α of the geometric acceptance model that E(k) assumes. The naive
    accepted/drafted (vLLM's "acceptance rate" metric) is (E(k)-1)/k instead, which depends on k
    and would make the cost model undervalue deep speculation.
    Counts decay by `half_life_tokens` judged tokens, so α follows the traffic mix. Unseen classes
    start from the pooled α (or `prior_alpha`), weighted as `prior_weight` pseudo-trials.
    """

    def __init__(
        self,
        pair: str = "default",
        *,
        prior_alpha: float = 0.6,
        prior_weight: float = 8.0,
        half_life_tokens: float = 512.0,
        max_positions: int = 16,
    ) -> None:
        self.pair = pair
        self.prior_alpha = prior_alpha
        self.prior_weight = prior_weight
        self._lambda = 0.5 ** (1.0 / half_life_tokens)
        self.max_positions = max_positions
        self._states: dict[str, _AcceptState] = {}
        self._lock = threading.Lock()

    def observe(
        self,
        prompt_class: str,
        num_drafted: int,
        num_accepted: int,
        accepted_per_position: list[bool] | None = None,
    ) -> None:
        """One verification step of one sequence."""
        if num_drafted <= 0:
            return
        if accepted_per_position is not None:
            if len(accepted_per_position) != num_drafted:
                raise ValueError(f"accepted_per_position has {len(accepted_per_position)} entries for {num_drafted} drafts")
            # Only the accepted prefix and the first rejection were judged conditionally on all
            # earlier positions being accepted; later matches say nothing about P(accept | prefix).
            prefix = next((i for i, ok in enumerate(accepted_per_position) if not ok), num_drafted)
        else:
            prefix = min(max(num_accepted, 0), num_drafted)
        rejected = 1 if prefix < num_drafted else 0
        with self._lock:
            for key in (prompt_class, _POOLED):
                st = self._states.setdefault(key, _AcceptState())
                self._add(st, prefix, rejected)

    def _add(self, st: _AcceptState, prefix: int, rejected: int) -> None:
        n = prefix + rejected
        decay = self._lambda**n
        st.successes = st.successes * decay + prefix
        st.trials = st.trials * decay + n
        st.steps += 1
        for i in range(min(n, self.max_positions)):
            while len(st.pos_trials) <= i:
                st.pos_trials.append(0.0)
                st.pos_successes.append(0.0)
            # Each position decays per judgement at that position: later positions are judged
            # less often, and decaying them per token would leave them with almost no memory.
            st.pos_trials[i] = st.pos_trials[i] * self._lambda + 1.0
            st.pos_successes[i] = st.pos_successes[i] * self._lambda + (1.0 if i < prefix else 0.0)

    def _prior(self, prompt_class: str) -> float:
        pooled = self._states.get(_POOLED)
        if prompt_class != _POOLED and pooled is not None and pooled.trials > 0:
            return (pooled.successes + self.prior_alpha * self.prior_weight) / (pooled.trials + self.prior_weight)
        return self.prior_alpha

    def alpha(self, prompt_class: str) -> float:
        with self._lock:
            prior = self._prior(prompt_class)
            st = self._states.get(prompt_class)
            if st is None:
                return prior
            return (st.successes + prior * self.prior_weight) / (st.trials + self.prior_weight)

    def per_position(self, prompt_class: str, k: int) -> list[float]:
        """P(accept at position i | all before accepted) for i < k; shrunk toward α where thin."""
        a = self.alpha(prompt_class)
        with self._lock:
            st = self._states.get(prompt_class)
            out = []
            for i in range(k):
                if st is None or i >= len(st.pos_trials):
                    out.append(a)
                else:
                    out.append((st.pos_successes[i] + a * self.prior_weight) / (st.pos_trials[i] + self.prior_weight))
            return out

    def samples(self, prompt_class: str) -> float:
        """Effective (decayed) number of judged draft tokens behind α."""
        with self._lock:
            st = self._states.get(prompt_class)
            return st.trials if st else 0.0

    def observations(self, prompt_class: str) -> int:
        """Verification steps ever observed for the class."""
        with self._lock:
            st = self._states.get(prompt_class)
            return st.steps if st else 0

    def confidence(self, prompt_class: str) -> float:
        """0 with only the prior, → 1 as measurements outweigh it."""
        n = self.samples(prompt_class)
        return n / (n + self.prior_weight)


class LengthPredictor:
    """Completion lengths per prompt class, from finished requests, over a bounded window.

    Requests cut by max_tokens (`finished_by='length'`) are right-censored: their natural length
    is at least what was produced. Counting them as that length would bias the quantile low; the
    quantile is therefore a Kaplan–Meier estimate, and None when censoring hides it (the caller
    then falls back to max_tokens, which is the conservative direction for speculation).
    """

    def __init__(self, *, window: int = 256, quantile: float = 0.9, min_samples: int = 8) -> None:
        if not 0 < quantile < 1:
            raise ValueError("quantile must be in (0, 1)")
        self.window, self.quantile, self.min_samples = window, quantile, min_samples
        self._samples: dict[str, deque[tuple[int, bool]]] = {}
        self._lock = threading.Lock()

    def observe(self, prompt_class: str, num_output_tokens: int, finished_by: FinishReason) -> None:
        if num_output_tokens < 0:
            return
        item = (num_output_tokens, finished_by == "length")
        with self._lock:
            for key in (prompt_class, _POOLED):
                self._samples.setdefault(key, deque(maxlen=self.window)).append(item)

    def count(self, prompt_class: str) -> int:
        with self._lock:
            return len(self._samples.get(prompt_class, ()))

    def predict(self, prompt_class: str, quantile: float | None = None) -> int | None:
        """The q-quantile of completion length, from the class or else all classes; None if unknown."""
        q = self.quantile if quantile is None else quantile
        with self._lock:
            for key in (prompt_class, _POOLED):
                data = self._samples.get(key)
                if data is not None and len(data) >= self.min_samples:
                    return _km_quantile(list(data), q)
        return None

    def expected_length(self, prompt_class: str, max_tokens: int) -> int:
        """L = min(max_tokens, predicted high quantile)."""
        p = self.predict(prompt_class)
        return max_tokens if p is None else max(1, min(max_tokens, p))


def _km_quantile(samples: list[tuple[int, bool]], q: float) -> int | None:
    """Smallest t with Kaplan–Meier CDF(t) >= q; samples are (length, censored)."""
    samples.sort(key=lambda s: (s[0], s[1]))  # at ties, events before censorings (KM convention)
    at_risk, survival, i = len(samples), 1.0, 0
    while i < len(samples):
        t = samples[i][0]
        events = censored = 0
        while i < len(samples) and samples[i][0] == t:
            censored += samples[i][1]
            events += not samples[i][1]
            i += 1
        if events:
            survival *= 1.0 - events / at_risk
            if 1.0 - survival >= q - 1e-12:
                return t
        at_risk -= events + censored
    return None


_CODE_LINE = re.compile(
    r"^\s*(def |class |import |from \S+ import|return\b|if .*:\s*$|for .*:\s*$|while .*:\s*$|elif |else:|try:|except|with .*:\s*$|@\w|#|\w+\s*=[^=]|\w+\(.*\)\s*$|[\]\)\}]\s*$)"
)
_SYMBOLS = frozenset("()[]{}=:_.,'\"#<>+-*/%")


def classify_prompt(text: str, *, chat: bool = False) -> PromptClass:
    """'chat' if it came through the chat endpoint, 'code' if python-ish, else 'prose'.

    Cheap on purpose (runs per request on the router): only the tail is read, since the text
    nearest the continuation predicts it best, and two signals decide: the share of lines that
    look like statements, or a high density of code punctuation relative to letters.
    """
    if chat:
        return "chat"
    tail = text[-2000:]
    lines = [ln for ln in tail.splitlines() if ln.strip()]
    if not lines:
        return "prose"
    code_lines = sum(1 for ln in lines if _CODE_LINE.match(ln))
    symbols = sum(1 for ch in tail if ch in _SYMBOLS)
    letters = sum(1 for ch in tail if ch.isalpha())
    indented = sum(1 for ln in lines if ln.startswith(("    ", "\t")))
    if code_lines / len(lines) >= 0.4 or (indented / len(lines) >= 0.3 and code_lines):
        return "code"
    if letters and symbols / letters >= 0.25:
        return "code"
    return "prose"
