"""`build_app(args)`: one AppConfig in, the bound Serve application out.

    serve deploy configs/local.yaml     # applications[0].import_path = deployments.builder:build_app
    serve run deployments.builder:build_app config=configs/local.yaml

A Serve config keeps the model and engine in the application's `args` and each deployment's Serve
options (num_replicas, autoscaling_config, ray_actor_options, graceful_shutdown_timeout_s,
user_config, ...) under `deployments:`; `serve deploy` builds the application from `args` and Serve
applies the `deployments:` entries over what this builder bound. Ray hashes `args` (not
`deployments:`) into the application's code version, so a change under `deployments:` is applied
to the running replicas: scaling options and `user_config` without a restart (ray_actor_options and
placement options, which Ray cannot change on a live actor, by replacing the replicas).

`args` may still carry `router_deployment` / `target_deployment` / `draft_deployment` and `policy`
(older configs, tests, benches): the builder applies them as before, and `deployments:` entries win.
"""

from __future__ import annotations

from typing import Any

from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from app.config import AppConfig, DeploymentOptions, load_yaml, serve_config_args
from deployments.draft_server import DraftServer
from deployments.request_router import AffinityRequestRouter
from deployments.router import Router
from deployments.target_server import TargetServer

ROUTING_STATS_PERIOD_S = 1.0  # fresher than Serve's 10 s default: the policy reads these
# A replica that Serve stops (scale-down, update, shutdown) drains: Serve waits for its ongoing
# requests up to graceful_shutdown_timeout_s, then kills it. Router and TargetServer default to a
# request's deadline plus this margin (the router's own deadline grace, Serve's wait loop, __del__).
SHUTDOWN_MARGIN_S = 10.0


def _options(opts: DeploymentOptions, custom_router: bool, shutdown_s: float | None = None) -> dict[str, Any]:
    out = opts.serve_options()
    if shutdown_s is not None:
        out.setdefault("graceful_shutdown_timeout_s", shutdown_s)
    if custom_router and "request_router_config" not in out:
        out["request_router_config"] = RequestRouterConfig(
            request_router_class=AffinityRequestRouter,
            request_routing_stats_period_s=ROUTING_STATS_PERIOD_S,
            request_routing_stats_timeout_s=ROUTING_STATS_PERIOD_S * 3,
        )
    return out


def parse_args(args: dict[str, Any]) -> AppConfig:
    """Accept an AppConfig mapping, or {"config": path-to-yaml} for `serve run ... config=FILE`
    (a Serve config: its first application, `deployments:` included)."""
    if set(args) == {"config"}:
        data = load_yaml(args["config"])
        if "applications" in data:
            data = serve_config_args(data["applications"][0])
        return AppConfig.model_validate(data)
    return AppConfig.model_validate(args)


def build_app(args: dict[str, Any]) -> Application:
    config = parse_args(args)
    raw = config.model_dump(mode="json")
    drain_s = config.engine.limits.request_timeout_s + SHUTDOWN_MARGIN_S
    draft = None
    if config.engine.speculation.proposer == "draft_model" and config.engine.draft is not None:
        draft = DraftServer.options(**_options(config.draft_deployment, custom_router=True)).bind(raw)
    target = TargetServer.options(**_options(config.target_deployment, custom_router=True, shutdown_s=drain_s)
                                  ).bind(raw, draft)
    return Router.options(**_options(config.router_deployment, custom_router=False, shutdown_s=drain_s)
                          ).bind(raw, target)
