"""Per-request sampling settings, the request type every layer shares.

The router builds it from an OpenAI request; the engine, the proposers, sampling and verification
and the draft server read it. It lives apart from app/config.py, which imports the policy's
settings (app/policy), so that the modules below the policy can import it without a circle: it
depends on pydantic alone.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class StructuredOutput(BaseModel):
    """A constraint on the output's form (OpenAI's response_format, free text excluded)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["json_object", "json_schema"]
    schema_text: str | None = Field(None, description="json_schema: the JSON schema, serialised")

    @model_validator(mode="after")
    def _check(self) -> "StructuredOutput":
        if (self.type == "json_schema") != (self.schema_text is not None):
            raise ValueError("a json_schema response format needs its schema; json_object has none")
        return self


class SamplingParams(BaseModel):
    """Per-request sampling. temperature 0 means greedy."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    temperature: float = Field(0.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, description="0 disables top-k")
    min_p: float = Field(0.0, ge=0.0, le=1.0, description="drop tokens less likely than min_p x the most likely one")
    max_tokens: int = Field(64, ge=1, le=1_000_000)
    stop: tuple[str, ...] = ()
    seed: int | None = Field(None, ge=0, lt=2**63)
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = Field((), description="generation stops after any of these tokens (kept in "
                                            "the output unless it is a special token), as vLLM's")
    min_tokens: int = Field(0, ge=0, description="EOS and stop_token_ids cannot be generated before this many tokens")
    logit_bias: tuple[tuple[int, float], ...] = Field((), description="(token id, bias added to its logit) pairs, "
                                                      "applied to the target's distribution before sampling")

    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, description="subtracted from the logit of every token "
                                    "the output already holds (OpenAI's)")
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, description="subtracted once per occurrence in the output")
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0, description="divides a positive logit (multiplies a "
                                      "negative one) of every token in the prompt or the output (vLLM's, from CTRL)")

    response_format: StructuredOutput | None = Field(None, description="the output follows this grammar "
                                                   "(app/spec/grammar.py); None: free text")

    logprobs: int | None = Field(None, ge=0, le=20, description="report each output token's log-probability under "
                                 "the target's raw distribution and this many most likely alternatives; None: none")

    @model_validator(mode="after")
    def _check(self) -> "SamplingParams":
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens {self.min_tokens} > max_tokens {self.max_tokens}")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def adjusts_logits(self) -> bool:
        """Whether the target's logits are changed before sampling (logit_bias, min_tokens, penalties)."""
        return (bool(self.logit_bias) or self.min_tokens > 0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0)

    @property
    def penalised(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
