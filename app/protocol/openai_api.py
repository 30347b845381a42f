"""OpenAI-compatible request/response schemas with specserve's extension fields.

Every field of a request is one of:
  - implemented: typed, range-checked and used (see `_Request` and its two subclasses). At the
    router: `n` (choice i of a seeded request samples with seed + i), `best_of` (the n best of that many), a
    list of prompts (text or token ids; choices prompt-major), `echo`, chat content as text
    parts, the `developer` role (given to the chat template as `system`), `max_completion_tokens`;
  - refused by name: a field the server does not implement set to anything but null or a value
    that asks for nothing (its default) gets a 400 whose `param` names it. Fields this server has
    no plan for (tools, audio, ...) are listed in NOT_SUPPORTED, and any other key (one no OpenAI
    API has, or one of the other endpoint's) is refused as unknown (`extra="forbid"`), nested
    objects (messages, stream_options, response_format) included;
  - accepted without effect on the output: identifiers OpenAI uses only for abuse monitoring,
    caching or its dashboard (`user`, `metadata`, `prompt_cache_key`, `safety_identifier`).
A null is the same as leaving the field out (except for the required `model`, `prompt`,
`messages`), so clients that send nulls or defaults keep working.

Extensions in the request body:
  speculation: "auto" | "on" | "off"   — "auto" lets the router's policy decide
  num_speculative_tokens: int           — depth when speculating (forces "on" under "auto")
  return_provenance: bool               — stream chunks carry per-token origin (playground), and
                                          the stream closes with the usage chunk unless
                                          stream_options.include_usage is false
The response's `usage.speculation` says what was done and why; a stream sends its usage chunk
only when asked (stream_options.include_usage, or return_provenance).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, RootModel, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from app.config import MAX_SPECULATIVE_TOKENS, SamplingParams, SpeculationMode
from app.protocol.sampling_params import StructuredOutput

MAX_STOP_STRINGS = 4
MAX_STOP_LENGTH = 64
MAX_N = 16  # choices per prompt
MAX_PROMPTS = 32  # prompts in one completions request
MAX_CHOICES = 32  # generations in one request (prompts x n): each is a sequence in the engine
# Chat roles the chat template does not know, as the role it is given instead.
TEMPLATE_ROLE = {"developer": "system"}
# The message of a 400 for a key the request model does not declare (pydantic's "extra_forbidden").
UNKNOWN_FIELD = "this server does not implement this field (see /docs for the fields each endpoint takes)"


class _Strict(BaseModel):
    """Unknown keys are refused; a null is the same as leaving an optional field out."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_absent(cls, data: Any) -> Any:
        if isinstance(data, dict):
            fields = cls.model_fields
            return {k: v for k, v in data.items() if v is not None or (k in fields and fields[k].is_required())}
        return data


class JsonSchemaFormat(_Strict):
    name: str = Field(..., min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_iff_json_schema(self) -> "ResponseFormat":
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("`json_schema` is required with type 'json_schema' and allowed with no other type")
        return self

    def structured_output(self) -> StructuredOutput | None:
        """The engine's constraint: None for free text; json_object is any JSON object, and a
        json_schema without `schema` any JSON value (the grammar is compiled on the target)."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return StructuredOutput(type="json_object")
        schema = self.json_schema.schema_ if self.json_schema.schema_ is not None else {}
        return StructuredOutput(type="json_schema", schema_text=json.dumps(schema, sort_keys=True))


class StreamOptions(_Strict):
    include_usage: bool = False  # the stream closes with a usage chunk (see _Request.usage_in_stream)
    include_obfuscation: bool = True  # OpenAI's padding of stream events; nothing to pad here


# Fields of OpenAI's APIs this server does not implement and has no plan for: refused by name
# unless null or one of the values listed (which ask for nothing; compared with their type), with
# the reason given.
NOT_SUPPORTED: dict[str, tuple[tuple[Any, ...], str]] = {
    "tools": (([],), "tool calling is not supported by this server"),
    "tool_choice": (("none", "auto"), "tool calling is not supported by this server"),
    "parallel_tool_calls": ((True, False), "tool calling is not supported by this server"),
    "functions": (([],), "function calling is not supported by this server"),
    "function_call": (("none", "auto"), "function calling is not supported by this server"),
    "audio": ((), "audio output is not supported by this server (text only)"),
    "modalities": ((["text"],), "this server generates text only"),
    "prediction": ((), "predicted outputs are not supported by this server"),
    "reasoning_effort": ((), "the served model is not a reasoning model"),
    "verbosity": (("medium",), "the served model has no verbosity control"),
    "web_search_options": ((), "web search is not supported by this server"),
    "store": ((False,), "this server does not store completions"),
    "service_tier": (("auto", "default"), "this server has one service tier"),
    "suffix": (("",), "suffix (text inserted after the completion) is not supported by this server"),
}


def _asks_for_nothing(value: Any, neutral: tuple[Any, ...]) -> bool:
    return any(type(value) is type(n) and value == n for n in neutral)


def _shown(neutral: tuple[Any, ...], sent: Any) -> str:
    """" or <value>" for each neutral value, the booleans only when a boolean was sent (chat's
    `logprobs: false` is no hint for completions' integer `logprobs`)."""
    def one(v: Any) -> str:
        return json.dumps(v.model_dump(exclude_none=True) if isinstance(v, BaseModel) else v)

    return "".join(f" or {one(n)}" for n in neutral if not isinstance(n, bool) or isinstance(sent, bool))


class _Request(_Strict):
    model: str
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, le=1_000_000)
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, lt=2**63)
    ignore_eos: bool = False
    # accepted without effect on the output (OpenAI uses it for abuse monitoring only)
    user: str | None = Field(None, max_length=512)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0)
    logit_bias: dict[int, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = Field(None, max_length=1024)
    min_tokens: int | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    stop_token_ids: list[int] | None = Field(None, max_length=64)
    response_format: ResponseFormat | None = None
    # specserve's extensions
    speculation: SpeculationMode = "auto"
    num_speculative_tokens: int | None = Field(None, ge=0, le=MAX_SPECULATIVE_TOKENS)
    return_provenance: bool = False

    @field_validator("*")
    @classmethod
    def _refuse_unimplemented(cls, v: Any, info: ValidationInfo) -> Any:
        name = info.field_name
        if name in NOT_SUPPORTED and not _asks_for_nothing(v, NOT_SUPPORTED[name][0]):
            neutral, reason = NOT_SUPPORTED[name]
            raise PydanticCustomError("not_supported", "{reason}; leave it out or send null{neutral}",
                                      {"reason": reason, "neutral": _shown(neutral, v)})
        return v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> list[str]:
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop sequences")
        if any(len(s) > MAX_STOP_LENGTH for s in stops):
            raise ValueError(f"stop sequences are limited to {MAX_STOP_LENGTH} characters")
        return [s for s in stops if s]

    def usage_in_stream(self) -> bool:
        """Whether a stream closes with the usage chunk (our usage.speculation rides in it): when
        stream_options.include_usage is true, as OpenAI's API. specserve's `return_provenance`
        asks for it too (its readers, the playground and bench.load, read both), unless
        include_usage says false."""
        if self.stream_options is not None and "include_usage" in self.stream_options.model_fields_set:
            return self.stream_options.include_usage
        return self.return_provenance

    @property
    def max_tokens_param(self) -> str:
        """The field that set the completion's length (max_completion_tokens wins, as OpenAI's)."""
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def logprob_count(self) -> int | None:
        """Alternatives to report per token (0: the chosen token's logprob only); None: no logprobs.
        Completions ask with `logprobs: n`, chat with `logprobs: true` and `top_logprobs: n`."""
        logprobs = getattr(self, "logprobs", None)
        if isinstance(logprobs, bool):
            return (getattr(self, "top_logprobs", None) or 0) if logprobs else None
        return logprobs

    def sampling(self, default_max_tokens: int, choice: int = 0) -> SamplingParams:
        """The engine's parameters for one choice. With a seed, choice i samples with seed + i: each
        of n choices differs and the request stays reproducible (choice 0 is the request with n=1)."""
        max_tokens = self.max_completion_tokens or self.max_tokens or default_max_tokens
        if (self.min_tokens or 0) > max_tokens:
            raise ValueError(f"min_tokens {self.min_tokens} is more than the {max_tokens} tokens this request may "
                             "generate: lower min_tokens or raise max_tokens")
        return SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            max_tokens=max_tokens,
            stop=tuple(self.stop or ()),
            seed=None if self.seed is None else (self.seed + choice) % 2**63,
            ignore_eos=self.ignore_eos,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            min_tokens=self.min_tokens or 0,
            logprobs=self.logprob_count(),
            min_p=self.min_p or 0.0,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logit_bias=tuple(sorted((int(t), float(b)) for t, b in (self.logit_bias or {}).items())),
            response_format=self.response_format.structured_output() if self.response_format is not None else None,
        )


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        ..., description="text, token ids, or a list of either (several prompts: choices are indexed "
        "prompt-major, prompt i's choice j at i * n + j)")
    echo: bool = Field(False, description="each choice's text starts with its prompt")
    best_of: int | None = Field(None, ge=1, le=MAX_N, description="generate this many per prompt and return the n "
                                "with the highest mean token log-probability (not with stream)")
    logprobs: int | None = Field(None, ge=0, le=20, description="each token's logprob and this many alternatives")
    suffix: str | None = None  # NOT_SUPPORTED unless empty

    @field_validator("prompt")
    @classmethod
    def _prompts_fit(cls, v: Any, info: ValidationInfo) -> Any:
        prompts = _as_prompts(v)
        if not prompts:
            raise ValueError("prompt must not be empty")
        if any(len(p) == 0 for p in prompts):
            raise ValueError("a prompt must not be empty")
        if len(prompts) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts in one request")
        n = info.data.get("n", 1)
        if len(prompts) * n > MAX_CHOICES:
            raise ValueError(f"{len(prompts)} prompts x n={n} is {len(prompts) * n} generations; "
                             f"at most {MAX_CHOICES} in one request")
        return v

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, v: int, info: ValidationInfo) -> int:
        n = info.data.get("n", 1)
        if v < n:
            raise ValueError(f"best_of ({v}) must be at least n ({n})")
        if v > n and info.data.get("stream"):
            raise ValueError(f"best_of ({v}) > n ({n}) cannot stream: the best are known only at the end")
        return v

    def prompts(self) -> list[str | list[int]]:
        """Each prompt: text or token ids."""
        return _as_prompts(self.prompt)


def _as_prompts(prompt: Any) -> list[Any]:
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return [prompt]  # one prompt: text, or token ids
    return list(prompt)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] = Field(..., description="text, or a list of text parts")

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, v: Any) -> Any:
        if isinstance(v, list):
            if not v:
                raise ValueError("content must not be an empty list")
            for i, part in enumerate(v):
                kind = part.get("type") if isinstance(part, dict) else None
                if isinstance(kind, str) and kind != "text":
                    raise PydanticCustomError(
                        "not_supported", "part {i} has type \"{kind}\": this server takes text only "
                        '(content parts of type "text")', {"i": i, "kind": kind})
        return v

    def text(self) -> str:
        """The content as one string: text parts joined by newlines (as vLLM joins them)."""
        return self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content)


def template_messages(messages: list[ChatMessage]) -> list[dict[str, str]]:
    """Messages as the chat template takes them: text content; `developer` given as `system`."""
    return [{"role": TEMPLATE_ROLE.get(m.role, m.role), "content": m.text()} for m in messages]


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(..., min_length=1, max_length=256)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    # NOT_SUPPORTED: refused unless null or a value that asks for nothing
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    web_search_options: Any = None
    store: Any = None
    service_tier: Any = None
    # accepted without effect on the output (OpenAI's dashboard, prompt caching, abuse monitoring)
    metadata: dict[str, str] | None = Field(None, max_length=16)
    prompt_cache_key: str | None = Field(None, max_length=512)
    safety_identifier: str | None = Field(None, max_length=512)


# ---- /tokenize and /detokenize (as vLLM's) --------------------------------------------------------
class TokenizeCompletionRequest(_Strict):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = Field(False, description="false: as /v1/completions tokenizes a prompt")
    return_token_strs: bool = False


class TokenizeChatRequest(_Strict):
    model: str | None = None
    messages: list[ChatMessage] = Field(..., min_length=1, max_length=256)
    add_generation_prompt: bool = Field(True, description="true: as /v1/chat/completions templates")
    add_special_tokens: bool = Field(False, description="false: as /v1/chat/completions tokenizes")
    return_token_strs: bool = False

    def template_messages(self) -> list[dict[str, str]]:
        return template_messages(self.messages)


class TokenizeRequest(RootModel[TokenizeChatRequest | TokenizeCompletionRequest]):
    """/tokenize's body: {"prompt"} or {"messages"} (its OpenAPI schema; parsed as `tokenize_model` picks)."""


def tokenize_model(data: dict[str, Any]) -> type[TokenizeChatRequest] | type[TokenizeCompletionRequest]:
    return TokenizeChatRequest if "messages" in data else TokenizeCompletionRequest


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


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


TokenLogprobs = list[tuple[int, float, list[tuple[int, float]]]]  # per token: (id, logprob, alternatives)


def best_of_order(scores: list[list[float]], n: int) -> list[int]:
    """best_of: the indices of the n generations with the highest mean token log-probability (each
    `scores[i]` holds generation i's token log-probabilities), best first, as OpenAI's."""
    mean = [sum(s) / len(s) if s else float("-inf") for s in scores]
    return sorted(range(len(scores)), key=lambda i: -mean[i])[:n]


def logprobs_block(decode: Callable[[int], str], tokens: TokenLogprobs | None, chat: bool,
                   text_offset: int = 0) -> dict[str, Any] | None:
    """OpenAI's `logprobs` of a choice (or a chunk of it) from per-token (id, logprob, alternatives).
    Completions: parallel lists with text offsets; chat: a `content` list with bytes."""
    if tokens is None:
        return None
    if chat:
        def entry(t: int, lp: float) -> dict[str, Any]:
            s = decode(t)
            return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}
        return {"content": [{**entry(t, lp), "top_logprobs": [entry(a, alp) for a, alp in alts]}
                            for t, lp, alts in tokens]}
    texts = [decode(t) for t, _, _ in tokens]
    offsets, at = [], text_offset
    for s in texts:
        offsets.append(at)
        at += len(s)
    return {"tokens": texts, "token_logprobs": [lp for _, lp, _ in tokens],
            "top_logprobs": [{decode(a): alp for a, alp in alts} for _, _, alts in tokens],
            "text_offset": offsets}


def completion_response(rid: str, model: str, choices: list[tuple[str, str | None]], usage: Usage,
                        logprobs: list[dict[str, Any] | None] | None = None) -> dict[str, Any]:
    """`choices`: (text, finish reason) of each choice, in index order; `logprobs` each one's block."""
    return {
        "id": rid, "object": "text_completion", "created": now(), "model": model,
        "choices": [{"index": i, "text": text, "finish_reason": finish, "logprobs": logprobs[i] if logprobs else None}
                    for i, (text, finish) in enumerate(choices)],
        "usage": usage.model_dump(),
    }


def chat_response(rid: str, model: str, choices: list[tuple[str, str | None]], usage: Usage,
                  logprobs: list[dict[str, Any] | None] | None = None) -> dict[str, Any]:
    """`choices`: (text, finish reason) of each choice, in index order; `logprobs` each one's block."""
    return {
        "id": rid, "object": "chat.completion", "created": now(), "model": model,
        "choices": [{"index": i, "message": {"role": "assistant", "content": text}, "finish_reason": finish,
                     "logprobs": logprobs[i] if logprobs else None}
                    for i, (text, finish) in enumerate(choices)],
        "usage": usage.model_dump(),
    }


def completion_chunk(rid: str, model: str, text: str, finish: str | None,
                     provenance: dict[str, Any] | None = None, index: int = 0,
                     logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    chunk: dict[str, Any] = {
        "id": rid, "object": "text_completion", "created": now(), "model": model,
        "choices": [{"index": index, "text": text, "finish_reason": finish, "logprobs": logprobs}],
    }
    if provenance is not None:
        chunk["specserve"] = provenance  # extension field; OpenAI clients ignore it
    return chunk


def chat_chunk(rid: str, model: str, text: str | None, finish: str | None, first: bool = False,
               provenance: dict[str, Any] | None = None, index: int = 0,
               logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    delta: dict[str, Any] = {}
    if first:
        delta["role"] = "assistant"
    if text:
        delta["content"] = text
    chunk: dict[str, Any] = {
        "id": rid, "object": "chat.completion.chunk", "created": now(), "model": model,
        "choices": [{"index": index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}],
    }
    if provenance is not None:
        chunk["specserve"] = provenance
    return chunk
