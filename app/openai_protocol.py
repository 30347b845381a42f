"""OpenAI-compatible request/response schemas with specserve's extension fields.

Extensions in the request body (ignored by nothing: unknown fields are refused):
  speculation: "auto" | "on" | "off"   — "auto" lets the router's policy decide
  num_speculative_tokens: int           — depth when speculating (forces "on" under "auto")
  return_provenance: bool               — stream chunks carry per-token origin (playground)
The response's `usage.speculation` says what was done and why.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from app.config import MAX_SPECULATIVE_TOKENS, SamplingParams, SpeculationMode

MAX_STOP_STRINGS = 4
MAX_STOP_LENGTH = 64


class _Request(BaseModel):
    # Unknown fields are ignored like OpenAI does (clients send e.g. `user`, `logprobs: null`),
    # but every field we read is typed and range-checked.
    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, le=1_000_000)
    n: int = Field(1, ge=1, le=1)
    stream: bool = False
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, lt=2**63)
    ignore_eos: bool = False
    speculation: SpeculationMode = "auto"
    num_speculative_tokens: int | None = Field(None, ge=0, le=MAX_SPECULATIVE_TOKENS)
    return_provenance: bool = False

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> list[str]:
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop sequences")
        if any(len(s) > MAX_STOP_LENGTH for s in stops):
            raise ValueError(f"stop sequences are limited to {MAX_STOP_LENGTH} characters")
        return [s for s in stops if s]

    def sampling(self, default_max_tokens: int) -> SamplingParams:
        max_tokens = self.max_completion_tokens or self.max_tokens or default_max_tokens
        return SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            max_tokens=max_tokens,
            stop=tuple(self.stop or ()),
            seed=self.seed,
            ignore_eos=self.ignore_eos,
        )


class CompletionRequest(_Request):
    prompt: str | list[int] = Field(..., description="text, or token ids")

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, v: str | list[int]) -> str | list[int]:
        if len(v) == 0:
            raise ValueError("prompt must not be empty")
        return v


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant"]
    content: str


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(..., min_length=1, max_length=256)


class SpeculationUsage(BaseModel):
    mode: Literal["speculative", "plain"]
    requested: SpeculationMode
    k: int
    reason: str
    adaptive: bool = False  # the engine picked the depth per step (0 included): drafted_tokens tell
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    num_drafts: int = 0
    acceptance_rate: float | None = None
    mean_acceptance_length: float | None = None
    expected_speedup: float | None = None
    batch_size: int | None = None  # the target batch the router's decision assumed


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    speculation: SpeculationUsage | None = None


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def completion_response(rid: str, model: str, text: str, finish: str | None, usage: Usage) -> dict[str, Any]:
    return {
        "id": rid, "object": "text_completion", "created": now(), "model": model,
        "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}],
        "usage": usage.model_dump(),
    }


def chat_response(rid: str, model: str, text: str, finish: str | None, usage: Usage) -> dict[str, Any]:
    return {
        "id": rid, "object": "chat.completion", "created": now(), "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}],
        "usage": usage.model_dump(),
    }


def completion_chunk(rid: str, model: str, text: str, finish: str | None,
                     provenance: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    chunk: dict[str, Any] = {
        "id": rid, "object": "text_completion", "created": now(), "model": model,
        "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}],
    }
    if provenance is not None:
        chunk["specserve"] = {"tokens": provenance}  # extension field; OpenAI clients ignore it
    return chunk


def chat_chunk(rid: str, model: str, text: str | None, finish: str | None, first: bool = False,
               provenance: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    delta: dict[str, Any] = {}
    if first:
        delta["role"] = "assistant"
    if text:
        delta["content"] = text
    chunk: dict[str, Any] = {
        "id": rid, "object": "chat.completion.chunk", "created": now(), "model": model,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }
    if provenance is not None:
        chunk["specserve"] = {"tokens": provenance}
    return chunk
