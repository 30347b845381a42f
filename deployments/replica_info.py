"""What a replica reports about itself for ops and tests: `live_config()` of Router and TargetServer.

It shows which replica answered (its Serve replica id and Ray actor id: a replica replaced by an
update answers with new ones) and the settings in force there: the policy its `reconfigure()`
applied, and the Serve options the replica holds (those Serve sends to a live replica: user_config,
max_ongoing_requests, autoscaling_config, graceful_shutdown_wait_loop_s, ...).
"""

from __future__ import annotations

from typing import Any

import ray
from ray import serve

from app.policy import PolicyConfig

# options of Serve's deployment config that reach the replica actor itself on a lightweight update
_REPLICA_OPTIONS = ("user_config", "max_ongoing_requests", "autoscaling_config", "graceful_shutdown_wait_loop_s",
                    "logging_config")


def live_config(policy: PolicyConfig) -> dict[str, Any]:
    context = serve.get_replica_context()
    deployment_config = getattr(context, "_deployment_config", None)  # Serve keeps it current on reconfigure
    options: dict[str, Any] = {}
    if deployment_config is not None:
        dumped = deployment_config.model_dump(mode="json", include=set(_REPLICA_OPTIONS))
        options = {k: dumped.get(k) for k in _REPLICA_OPTIONS}
    return {"deployment": context.deployment, "replica": context.replica_id.unique_id,
            "actor_id": ray.get_runtime_context().get_actor_id(), "policy": policy.model_dump(mode="json"),
            "serve_options": options}
