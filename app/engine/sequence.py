"""The engine's record of one sequence, and what a step reports: per sequence (SeqUpdate) and for the
step as a whole (StepTimes)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Literal

from app.engine.acceptance import AcceptanceStats
from app.engine.detokenizer import StopChecker
from app.engine.draft_ahead import DraftCallTimes
from app.protocol.sampling_params import SamplingParams
from app.spec.grammar import GrammarState
from app.spec.verify import TokenLogprob

FinishReason = Literal["stop", "length", "abort"]


@dataclass
class Sequence:
    seq_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    seed: int
    k: int  # the most drafts per step for this request; 0 = plain decoding
    stop: StopChecker
    prefilled: int = 0  # tokens in the runner's cache before the first token is emitted
    output_ids: list[int] = field(default_factory=list)  # a failed-over sequence starts with what was streamed
    prefill_len: int = 0  # prompt (+ resumed output) tokens to prefill before the first emitted token
    stats: AcceptanceStats = field(default_factory=AcceptanceStats)
    finish_reason: FinishReason | None = None
    step_k: int = 0  # the depth used at the last step (adaptive k may move it)
    adaptive: bool = False  # 'auto': the step planner picks 0..k each step; else k every step
    alpha_prior: float | None = None  # the router's acceptance estimate for its prompt class
    arrival: float = field(default_factory=time.monotonic)
    grammar: GrammarState | None = None  # the response format's matcher, at the end of the output

    @property
    def token_ids(self) -> list[int]:
        """A new list: prompt and output (hot loops use `length` and `last_token`)."""
        return self.prompt_ids + self.output_ids

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def last_token(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    @property
    def remaining(self) -> int:
        return self.sampling.max_tokens - len(self.output_ids)

    @property
    def prefilling(self) -> bool:
        return self.prefilled < self.prefill_len

    def reserved_tokens(self) -> int:
        """KV tokens this sequence may come to hold (admission reserves it all up front)."""
        return len(self.prompt_ids) + self.sampling.max_tokens


@dataclass
class SeqUpdate:
    """What one step produced for one sequence."""

    seq_id: str
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None
    drafted: int = 0
    accepted: int = 0
    k: int = 0
    logprobs: list[TokenLogprob] | None = None  # per token of token_ids, when the request asked


@dataclass
class StepTimes:
    """Wall time of the last step's phases, for the cost model and metrics (seconds)."""

    prefill: float = 0.0  # newcomers' prompt prefill (after the batch's step)
    draft: float = 0.0
    target: float = 0.0  # decode or verify forward
    overhead: float = 0.0  # the batch's step outside both forwards: planning, verifying, emitting
    batch_size: int = 0
    tokens_in_pass: int = 0
    num_speculating: int = 0
    draft_calls: tuple[DraftCallTimes, ...] = ()  # the proposer calls that served this step (`draft` is the wait)
