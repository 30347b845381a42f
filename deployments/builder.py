"""`build_app(args)`: one AppConfig in, the bound Serve application out.

    serve run deployments.builder:build_app config=configs/local.yaml      # or a Serve config file:
    serve run configs/local.yaml        # applications[0].import_path = deployments.builder:build_app
"""

from __future__ import annotations

from typing import Any

from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from app.config import AppConfig, DeploymentOptions, load_yaml
from deployments.draft_server import DraftServer
from deployments.request_router import AffinityRequestRouter
from deployments.router import Router
from deployments.target_server import TargetServer

ROUTING_STATS_PERIOD_S = 1.0  # fresher than Serve's 10 s default: the policy reads these


def _options(opts: DeploymentOptions, custom_router: bool) -> dict[str, Any]:
    out: dict[str, Any] = {
        "max_ongoing_requests": opts.max_ongoing_requests,
        "max_queued_requests": opts.max_queued_requests,
        "ray_actor_options": {"num_cpus": opts.num_cpus, "num_gpus": opts.num_gpus},
    }
    if opts.resources:
        out["ray_actor_options"]["resources"] = dict(opts.resources)
    if opts.autoscaling_config is not None:
        out["autoscaling_config"] = dict(opts.autoscaling_config)
        out["num_replicas"] = "auto"
    else:
        out["num_replicas"] = opts.num_replicas
    if custom_router:
        out["request_router_config"] = RequestRouterConfig(
            request_router_class=AffinityRequestRouter,
            request_routing_stats_period_s=ROUTING_STATS_PERIOD_S,
            request_routing_stats_timeout_s=ROUTING_STATS_PERIOD_S * 3,
        )
    return out


def parse_args(args: dict[str, Any]) -> AppConfig:
    """Accept an AppConfig mapping, or {"config": path-to-yaml} for `serve run ... config=FILE`."""
    if set(args) == {"config"}:
        data = load_yaml(args["config"])
        if "applications" in data:
            data = data["applications"][0]["args"]
        return AppConfig.model_validate(data)
    return AppConfig.model_validate(args)


def build_app(args: dict[str, Any]) -> Application:
    config = parse_args(args)
    raw = config.model_dump(mode="json")
    draft = None
    if config.engine.speculation.proposer == "draft_model" and config.engine.draft is not None:
        draft = DraftServer.options(**_options(config.draft_deployment, custom_router=True)).bind(raw)
    target = TargetServer.options(**_options(config.target_deployment, custom_router=True)).bind(raw, draft)
    return Router.options(**_options(config.router_deployment, custom_router=False)).bind(raw, target)
