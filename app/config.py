"""Typed configuration: every knob of specserve, validated by pydantic, loadable from YAML.

`AppConfig` is the one object `deployments.builder.build_app(args)` accepts, so a Serve
config file's `args:` block is exactly an `AppConfig` in YAML. Shipped configs keep only the model
and engine there (Ray hashes `args` into the application's code version: a change to them restarts
every replica); each deployment's Serve options and its `user_config` (`UserConfig`: policy knobs)
sit in the application's `deployments:` list, which Serve applies in place.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from app.policy.decision import PolicyConfig
from app.protocol.sampling_params import SamplingParams  # noqa: F401  (re-exported: modules that import it from here)

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
    """The Serve options of one deployment, passed to `.options()` by the builder.

    The fields below carry specserve's defaults and checks. Every other option of Serve's own
    deployment schema (`ray.serve.schema.DeploymentSchema`: graceful_shutdown_timeout_s,
    health_check_period_s, health_check_timeout_s, graceful_shutdown_wait_loop_s,
    max_replicas_per_node, placement_group_bundles, logging_config, ...) passes through as given,
    validated by Serve's schema; a name Serve does not know is refused like any typo. Shipped
    configs set these in the Serve config's `deployments:` list instead (Serve applies them over
    what the builder bound, and changing them there restarts nothing but what Serve must)."""

    model_config = ConfigDict(extra="allow", frozen=True)

    num_replicas: Annotated[int, Field(ge=1)] | Literal["auto"] | None = 1
    autoscaling_config: dict[str, Any] | None = None
    max_ongoing_requests: int = Field(64, ge=1)
    max_queued_requests: int = Field(-1, ge=-1, description="Serve rejects calls queued beyond this "
                                     "(the router answers 503 + Retry-After); -1 = unbounded")
    num_cpus: float = Field(1.0, ge=0)
    num_gpus: float = Field(0.0, ge=0)
    resources: dict[str, float] | None = Field(
        None, description="Ray custom resources per replica, e.g. {draft_node: 0.01} to pin a pool to nodes")
    ray_actor_options: dict[str, Any] | None = Field(
        None, description="further Ray actor options (accelerator_type, memory, runtime_env, label_selector, ...), "
                          "merged over num_cpus / num_gpus / resources")
    graceful_shutdown_timeout_s: float | None = Field(
        None, ge=0, description="None: Router and TargetServer wait out a request's deadline "
                                "(engine.limits.request_timeout_s + SHUTDOWN_MARGIN_S), DraftServer Serve's default")
    user_config: dict[str, Any] | None = Field(
        None, description="Serve's user_config: {policy: {...}} on Router and TargetServer (UserConfig), applied by "
                          "their reconfigure() without a restart")

    @model_validator(mode="after")
    def _check(self) -> "DeploymentOptions":
        if self.autoscaling_config is not None and self.num_replicas not in (None, 1, "auto"):
            raise ValueError("set either num_replicas or autoscaling_config, not both")
        actor = self.ray_actor_options or {}
        for key in ("num_cpus", "num_gpus", "resources"):
            if key in actor and key in self.model_fields_set:
                raise ValueError(f"{key} is set twice: as an option and in ray_actor_options")
        if self.model_extra or actor:  # Serve's schema (and ray) only where there is something to check
            _check_serve_options(self.model_extra or {}, actor)
        if self.user_config is not None:
            UserConfig.model_validate(self.user_config).policy_over(PolicyConfig())
        return self

    def serve_options(self) -> dict[str, Any]:
        """The options as `Deployment.options()` takes them (num_cpus / num_gpus / resources folded
        into ray_actor_options, num_replicas "auto" with an autoscaling_config); options left unset
        are left to Serve, except graceful_shutdown_timeout_s, which the builder defaults."""
        actor: dict[str, Any] = {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus}
        if self.resources:
            actor["resources"] = dict(self.resources)
        actor.update(self.ray_actor_options or {})
        out: dict[str, Any] = {"max_ongoing_requests": self.max_ongoing_requests,
                               "max_queued_requests": self.max_queued_requests, "ray_actor_options": actor}
        if self.autoscaling_config is not None:
            out["autoscaling_config"] = dict(self.autoscaling_config)
            out["num_replicas"] = "auto"
        else:
            out["num_replicas"] = self.num_replicas
        for key in ("graceful_shutdown_timeout_s", "user_config"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        out.update(self.model_extra or {})
        return out


def serve_option_names() -> tuple[set[str], set[str]]:
    """(options `Deployment.options()` takes, options only a Serve config's `deployments:` list takes),
    both from Serve's own deployment schema."""
    import inspect

    from ray.serve.deployment import Deployment
    from ray.serve.schema import DeploymentSchema

    schema = set(DeploymentSchema.model_fields) - {"name"}
    params = set(inspect.signature(Deployment.options).parameters)
    return schema & params, schema - params


def _check_serve_options(extra: dict[str, Any], actor: dict[str, Any]) -> None:
    """Options beyond DeploymentOptions' fields must be Serve's own, with values Serve accepts."""
    from ray.serve.schema import DeploymentSchema, RayActorOptionsSchema  # ray only where options are checked

    known, config_only = serve_option_names()
    only_there = sorted(set(extra) & config_only)
    if only_there:
        raise ValueError(f"{', '.join(only_there)}: Serve takes it only from a Serve config's `deployments:` list, "
                         "not from code: set it there")
    unknown = sorted(set(extra) - known)
    if unknown:
        raise ValueError(f"{', '.join(unknown)}: Extra inputs are not permitted (not a Serve deployment option; "
                         f"Serve's are: {', '.join(sorted(known | config_only))})")
    unknown = sorted(set(actor) - set(RayActorOptionsSchema.model_fields))
    if unknown:
        raise ValueError(f"ray_actor_options {', '.join(unknown)}: Extra inputs are not permitted (Ray's actor "
                         f"options are: {', '.join(sorted(RayActorOptionsSchema.model_fields))})")
    DeploymentSchema.model_validate({"name": "check", **extra, "ray_actor_options": actor})


def deep_merge(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """`base` with `overrides` merged in, mappings key by key (neither is changed)."""
    out = dict(base)
    for key, value in overrides.items():
        out[key] = deep_merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


class UserConfig(StrictModel):
    """Serve's `user_config` of the Router and TargetServer deployments: what their `reconfigure()`
    applies to the live replica, without a restart or a model reload."""

    policy: dict[str, Any] = Field(
        default_factory=dict, description="PolicyConfig fields, merged over the application args' `policy`")

    def policy_over(self, base: PolicyConfig) -> PolicyConfig:
        """The policy in force: `base` (args' policy) with this user_config's fields over it."""
        return PolicyConfig.model_validate(deep_merge(base.model_dump(), self.policy))


class AppConfig(StrictModel):
    """The whole Serve application: `build_app(args)` validates `args` as this."""

    model_name: str = Field("specserve-embedded", description="name clients pass as `model`")
    engine: EngineConfig
    target_deployment: DeploymentOptions = DeploymentOptions()
    draft_deployment: DeploymentOptions = DeploymentOptions()
    router_deployment: DeploymentOptions = DeploymentOptions(max_ongoing_requests=256)
    policy: PolicyConfig = Field(default_factory=PolicyConfig, description="the speculation policy (app/policy)")


# AppConfig field <-> the Serve deployment it configures (deployments/builder.py binds them)
POOLS = {"router_deployment": "Router", "target_deployment": "TargetServer", "draft_deployment": "DraftServer"}


def fold_deployments(args: dict[str, Any], deployments: list[dict[str, Any]] | None) -> dict[str, Any]:
    """`args` with a Serve config's `deployments:` entries folded in as AppConfig's `*_deployment`
    blocks: what `build_app` alone (serve.run, tests, benches) must be given to build the
    application `serve deploy` of that file runs. An entry's options replace the same options in
    `args`; its `ray_actor_options`, as in Serve, replace the actor options (num_cpus, num_gpus,
    resources, ray_actor_options) as a whole."""
    out = dict(args)
    fields = {name: field for field, name in POOLS.items()}
    for entry in deployments or []:
        entry = dict(entry)
        name = entry.pop("name")
        if name not in fields:
            raise ValueError(f"deployments: no deployment named {name!r} (this application's are {sorted(fields)})")
        opts = dict(out.get(fields[name]) or {})
        if "ray_actor_options" in entry:
            actor = dict(entry.pop("ray_actor_options") or {})
            for key in ("num_cpus", "num_gpus", "resources", "ray_actor_options"):
                opts.pop(key, None)
            opts.update({k: actor.pop(k) for k in ("num_cpus", "num_gpus", "resources") if k in actor})
            if actor:
                opts["ray_actor_options"] = actor
        if entry.get("num_replicas") == "auto" or ("autoscaling_config" in entry and "num_replicas" not in entry):
            entry["num_replicas"] = None if entry.get("autoscaling_config") else "auto"
        opts.update(entry)
        out[fields[name]] = opts
    return out


def serve_config_args(app: dict[str, Any]) -> dict[str, Any]:
    """One application of a Serve config (an `applications:` entry): its args with its
    `deployments:` folded in (fold_deployments)."""
    return fold_deployments(app.get("args") or {}, app.get("deployments"))


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
