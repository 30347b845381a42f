"""Request routing for specserve's deployments (a custom Serve RequestRouter).

- Calls that carry an affinity key (a DraftStepRequest's `client_id`, the calling target
  replica) go to the replica that rendezvous hashing picks for that key, so a target
  replica keeps talking to the draft replica that holds its sequences' caches; when that
  replica is gone the next in hash order takes over (and rebuilds from cache misses).
- Other calls (the router's generate calls to target replicas) go to the least loaded
  replica by the routing stats each replica publishes (running + waiting sequences).

Routing stats seen here are also kept in LOAD_REGISTRY so the ingress's policy can read
live load without another round trip.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

# deployment name -> replica id -> (routing stats, monotonic time seen)
LOAD_REGISTRY: dict[str, dict[str, tuple[dict[str, Any], float]]] = {}


def load_registry() -> dict[str, dict[str, tuple[dict[str, Any], float]]]:
    """The process's LOAD_REGISTRY. Use this, never the `LOAD_REGISTRY` name, from code Serve
    may ship by value.

    Serve ships a custom request router class to the handle's process cloudpickled *by value*
    (RequestRouterConfig registers this module with `register_pickle_by_value`), so the class's
    methods see a private copy of this module's globals; an ingress class is shipped by value too
    (its referenced globals copied). Both writing and reading the bare name would each touch a
    private dict. Looking the module up by name at call time finds the one real registry.
    """
    import importlib

    return importlib.import_module("deployments.request_router").LOAD_REGISTRY


def _affinity_key(request: PendingRequest | None) -> str | None:
    if request is None:
        return None
    for arg in list(request.args) + list(request.kwargs.values()):
        key = getattr(arg, "client_id", None)
        if isinstance(key, str):
            return key
    return None


def _score(key: str, replica_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{key}|{replica_id}".encode(), digest_size=8).digest(), "big")


def _load(replica: RunningReplica) -> float:
    stats = replica.routing_stats or {}
    return float(stats.get("running", 0)) + float(stats.get("waiting", 0))


class AffinityRequestRouter(RequestRouter):
    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        now = time.monotonic()
        registry = load_registry().setdefault(self._deployment_id.name, {})
        for r in candidate_replicas:
            registry[r.replica_id.unique_id] = (dict(r.routing_stats or {}), now)
        live = {r.replica_id.unique_id for r in candidate_replicas}
        for gone in set(registry) - live:
            del registry[gone]
        key = _affinity_key(pending_request)
        if key is not None:
            ordered = sorted(candidate_replicas, key=lambda r: _score(key, r.replica_id.unique_id), reverse=True)
        else:
            ordered = sorted(candidate_replicas, key=_load)
        return [[r] for r in ordered]
