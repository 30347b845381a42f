"""Typed configuration: every knob of specserve, validated by pydantic, loadable from YAML.

`AppConfig` is the one object `deployments.builder.build_app(args)` accepts, so a Serve
config file's `args:` block is exactly an `AppConfig` in YAML.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from app.policy.decision import PolicyConfig
from app.sampling_params import SamplingParams  # noqa: F401  (re-exported: modules that import it from here)

Dtype = Literal["float32", "float16", "bfloat16"]
ProposerKind = Literal["draft_model", "ngram"]
SpeculationMode = Literal["auto", "on", "off"]

PROJECT_ROOT = Path(__file__).resolve().parent.parent
MAX_SPECULATIVE_TOKENS = 16


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSpec(StrictModel):
    """Where a model comes from and how it is placed."""

    path: str = Field(description="local directory (relative paths are resolved against the project root) or hub id")
    dtype: Dtype = "float32"
    device: str = Field("cpu", description="'cpu', 'cuda' or 'cuda:N'")
    max_context: int | None = Field(None, ge=16, description="defaults to the model's max_position_embeddings")
    num_threads: int | None = Field(None, ge=1, description="torch CPU threads for this process")
    quantization: Literal["none", "int8"] = Field(
        "none", description="int8: weight-only int8 GEMMs (per-row scales), for a draft: it halves the bytes a "
        "step reads, and the target's verification keeps the output exact")
    cuda_graphs: bool = Field(True, description="on CUDA, replay captured graphs per (batch bucket, width)")
    random_weights: bool = Field(
        False, description="benchmarks only: build the architecture in `path`/config.json with random weights "
        "instead of loading them (8B-shaped models on a host without a model hub)")

    def resolved_path(self) -> str:
        """Local directories relative to the project root; anything else is a hub id."""
        local = Path(self.path)
        if not local.is_absolute():
            local = PROJECT_ROOT / local
        return str(local) if local.exists() else self.path


class SpeculationConfig(StrictModel):
    proposer: ProposerKind = "draft_model"
    num_speculative_tokens: int = Field(4, ge=1, le=MAX_SPECULATIVE_TOKENS)
    max_speculative_tokens: int = Field(8, ge=1, le=MAX_SPECULATIVE_TOKENS)
    ngram_min: int = Field(1, ge=1)
    ngram_max: int = Field(4, ge=1)

    @model_validator(mode="after")
    def _check(self) -> "SpeculationConfig":
        if self.ngram_min > self.ngram_max:
            raise ValueError(f"ngram_min {self.ngram_min} > ngram_max {self.ngram_max}")
        if self.num_speculative_tokens > self.max_speculative_tokens:
            raise ValueError(
                f"num_speculative_tokens {self.num_speculative_tokens} > max_speculative_tokens "
                f"{self.max_speculative_tokens}"
            )
        return self


class EngineLimits(StrictModel):
    """Memory bounds of one target (or draft) replica."""

    max_num_seqs: int = Field(32, ge=1, description="sequences decoding at once")
    max_cached_tokens: int = Field(65536, ge=16, description="KV tokens held across all sequences")
    max_queue: int = Field(64, ge=0, description="requests waiting for a slot; beyond it: 429")
    request_timeout_s: float = Field(120.0, gt=0, description="deadline of one request end to end")


class EngineConfig(StrictModel):
    """What one in-process engine needs: a target, optionally a draft, and speculation settings."""

    target: ModelSpec
    draft: ModelSpec | None = None
    speculation: SpeculationConfig = SpeculationConfig()
    limits: EngineLimits = EngineLimits()

    @model_validator(mode="after")
    def _check(self) -> "EngineConfig":
        if self.speculation.proposer == "draft_model" and self.draft is None:
            raise ValueError("speculation.proposer is 'draft_model' but no draft model is configured: add `draft:` or use proposer: ngram")
        return self


class DeploymentOptions(StrictModel):
    """The Serve knobs of one deployment; passed to `.options()` by the builder."""

    num_replicas: int | None = Field(1, ge=1)
    autoscaling_config: dict[str, float | int | str] | None = None
    max_ongoing_requests: int = Field(64, ge=1)
    max_queued_requests: int = Field(-1, ge=-1, description="Serve rejects calls queued beyond this "
                                     "(the router answers 503 + Retry-After); -1 = unbounded")
    num_cpus: float = Field(1.0, ge=0)
    num_gpus: float = Field(0.0, ge=0)
    resources: dict[str, float] | None = Field(
        None, description="Ray custom resources per replica, e.g. {draft_node: 0.01} to pin a pool to nodes")

    @model_validator(mode="after")
    def _check(self) -> "DeploymentOptions":
        if self.autoscaling_config is not None and self.num_replicas not in (None, 1):
            raise ValueError("set either num_replicas or autoscaling_config, not both")
        return self


class AppConfig(StrictModel):
    """The whole Serve application: `build_app(args)` validates `args` as this."""

    model_name: str = Field("specserve-embedded", description="name clients pass as `model`")
    engine: EngineConfig
    target_deployment: DeploymentOptions = DeploymentOptions()
    draft_deployment: DeploymentOptions = DeploymentOptions()
    router_deployment: DeploymentOptions = DeploymentOptions(max_ongoing_requests=256)
    policy: PolicyConfig = Field(default_factory=PolicyConfig, description="the speculation policy (app/policy)")


def load_yaml(path: str | Path) -> dict:
    with open(path) as f:
        data = yaml.safe_load(f)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping at the top level")
    return data


def load_engine_config(path: str | Path) -> EngineConfig:
    """An EngineConfig from YAML: either the engine mapping itself, an AppConfig, or a Serve config."""
    data = load_yaml(path)
    if "applications" in data:  # a Serve config: take the first application's args
        data = data["applications"][0]["args"]
    if "engine" in data:
        return AppConfig.model_validate(data).engine
    return EngineConfig.model_validate(data)
