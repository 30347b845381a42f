"""`serve deploy` of a Serve-shaped config updates the running application in place.

configs/local.yaml's application is deployed the way `serve deploy` (and `serve run FILE`) deploy
it: as a declarative config through the Serve controller's apply_config, so Serve builds it from
`args` and applies the `deployments:` list itself. Then, through the same path:

1. Router autoscaling values, TargetServer's max_ongoing_requests and policy knobs in Router's and
   TargetServer's user_config change. Every replica keeps its Ray actor (same actor ids: no
   restart, no model reload), and the live replicas report the new values: Serve's options in the
   replica, the policy their reconfigure() applied.
2. TargetServer's num_replicas goes from 2 to 1 while a long stream runs on each replica: the kept
   replica keeps its actor, and the one Serve stops drains (its stream runs to max_tokens, no
   failover) before it exits.
"""

from __future__ import annotations

import copy
import json
import threading
import time
from typing import Any, Iterator

import httpx
import pytest

from app.config import load_yaml

pytestmark = [pytest.mark.serve, pytest.mark.slow]

APP = "specserve-inplace"
MODEL = "specserve-embedded"
DEADLINE_S = 120
STREAM_TOKENS = 800  # a few seconds on the CPU pair: the drain outlasts the scale-down call


def _app(target_replicas: int, router_auto: dict[str, Any], policy: dict[str, Any],
         target_max_ongoing: int = 64) -> dict[str, Any]:
    """configs/local.yaml's application with this test's pool sizes (small CPU shares: two target
    replicas and the rest fit the 2-CPU session Ray)."""
    app = copy.deepcopy(load_yaml("configs/local.yaml")["applications"][0])
    app["name"] = APP
    by = {d["name"]: d for d in app["deployments"]}
    base_policy = by["Router"]["user_config"]["policy"]
    user_config = {"policy": {**base_policy, **policy}}
    by["Router"].update(num_replicas="auto", autoscaling_config=router_auto, ray_actor_options={"num_cpus": 0.25},
                        user_config=user_config)
    by["TargetServer"].update(num_replicas=target_replicas, ray_actor_options={"num_cpus": 0.5},
                              max_ongoing_requests=target_max_ongoing, user_config=user_config)
    by["DraftServer"].update(num_replicas=1, ray_actor_options={"num_cpus": 0.25})
    return app


ROUTER_AUTO = {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 8, "upscale_delay_s": 60,
               "downscale_delay_s": 600}
FIRST = _app(2, ROUTER_AUTO, {"margin": 1.15})
UPDATED = _app(2, {**ROUTER_AUTO, "max_replicas": 3, "target_ongoing_requests": 9},
               {"margin": 1.4, "explore_every_steps": 16}, target_max_ongoing=32)
SCALED_DOWN = _app(1, {**ROUTER_AUTO, "max_replicas": 3, "target_ongoing_requests": 9},
                   {"margin": 1.4, "explore_every_steps": 16}, target_max_ongoing=32)


def serve_deploy(app: dict[str, Any]) -> None:
    """What `serve deploy` (through the dashboard) and `serve run FILE` do: the controller's apply_config."""
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    _get_global_client().deploy_apps(ServeDeploySchema.model_validate({"applications": [app]}))


def replica_actors() -> dict[str, dict[str, str]]:
    """deployment -> {replica id: Ray actor id} of this app's live replicas (Serve names them)."""
    import ray

    out: dict[str, dict[str, str]] = {}
    for actor in ray.util.list_named_actors(all_namespaces=True):
        name = actor["name"]
        if actor["namespace"] != "serve" or not name.startswith(f"SERVE_REPLICA::{APP}#"):
            continue
        _, deployment, replica = name.removeprefix("SERVE_REPLICA::").split("#")
        try:
            out.setdefault(deployment, {})[replica] = ray.get_actor(name, namespace="serve")._actor_id.hex()
        except ValueError:  # gone between the listing and the lookup
            pass
    return out


def wait_running(base: str, targets: int) -> dict[str, dict[str, str]]:
    from ray import serve

    deadline = time.monotonic() + DEADLINE_S
    while True:
        status = serve.status().applications.get(APP)
        actors = replica_actors()
        if (status is not None and status.status == "RUNNING"
                and all(d.status == "HEALTHY" for d in status.deployments.values())
                and len(actors.get("TargetServer", {})) == targets):
            try:
                if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                    return actors
            except httpx.HTTPError:
                pass
        assert status is None or status.status not in ("DEPLOY_FAILED", "UNHEALTHY"), status
        assert time.monotonic() < deadline, f"{APP} not RUNNING with {targets} targets: {status}, {actors}"
        time.sleep(0.5)


def live_configs(deployment: str, replicas: int) -> dict[str, dict]:
    """replica id -> live_config() of each of `replicas` replicas (handle calls land at random)."""
    from ray import serve

    from deployments.draft_server import ChannelRequest

    handle = serve.get_deployment_handle(deployment, APP)
    seen: dict[str, dict] = {}
    for i in range(40):
        # TargetServer's affinity router sends each client_id to one replica: spread the calls
        call = handle.live_config.remote(ChannelRequest(f"probe-{i}")) if deployment == "TargetServer" \
            else handle.live_config.remote()
        info = call.result(timeout_s=30)
        seen[info["replica"]] = info
        if len(seen) == replicas:
            return seen
    raise AssertionError(f"reached {sorted(seen)} of {replicas} {deployment} replicas")


@pytest.fixture(scope="module")
def base(ray_cluster: int) -> Iterator[str]:
    from ray import serve

    url = f"http://127.0.0.1:{ray_cluster}"
    serve_deploy(FIRST)
    try:
        yield url
    finally:
        serve.delete(APP)


def test_scaling_and_policy_changes_apply_in_place(base: str) -> None:
    t0 = time.monotonic()
    before = wait_running(base, targets=2)
    print(f"deployed in {time.monotonic() - t0:.1f}s")
    assert {d: len(r) for d, r in before.items()} == {"Router": 1, "TargetServer": 2, "DraftServer": 1}
    targets_before = live_configs("TargetServer", 2)
    assert all(info["policy"]["margin"] == 1.15 for info in targets_before.values())

    serve_deploy(UPDATED)
    deadline = time.monotonic() + DEADLINE_S
    while True:  # until every replica has the new options and policy (Serve reconfigures them one by one)
        (router,) = live_configs("Router", 1).values()
        targets = live_configs("TargetServer", 2)
        if all(info["policy"]["margin"] == 1.4 and info["serve_options"]["max_ongoing_requests"] == 32
               for info in targets.values()) and router["policy"]["margin"] == 1.4 \
                and router["serve_options"]["autoscaling_config"]["max_replicas"] == 3:
            break
        assert time.monotonic() < deadline, (router, targets)
        time.sleep(0.5)
    print(f"updated in place in {time.monotonic() - t0:.1f}s")
    after = wait_running(base, targets=2)
    assert after == before  # every replica keeps its actor: no restart, no model reload
    assert router["actor_id"] in before["Router"].values()
    assert router["policy"]["explore_every_steps"] == 16
    assert router["serve_options"]["autoscaling_config"]["target_ongoing_requests"] == 9
    assert {r: i["actor_id"] for r, i in targets.items()} == before["TargetServer"]  # reconfigured in place
    chunk_s = FIRST["deployments"][0]["user_config"]["policy"]["costs"]["chunk_s"]
    for info in targets.values():
        assert info["policy"]["explore_every_steps"] == 16 and info["policy"]["costs"]["chunk_s"] == chunk_s

    r = httpx.post(f"{base}/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": "def f(x):\n", "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text


def _stream(base: str, out: dict[str, Any]) -> None:
    body = {"model": MODEL, "prompt": "class Parser:\n", "max_tokens": STREAM_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    try:
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=DEADLINE_S) as r:
            out["status"] = r.status_code
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    out["error"] = data["error"]
                for choice in data.get("choices", []):
                    out["finish_reason"] = choice.get("finish_reason") or out.get("finish_reason")
                if data.get("usage"):
                    out["completion_tokens"] = data["usage"]["completion_tokens"]
    except Exception as e:  # noqa: BLE001 — reported by the test
        out["exception"] = repr(e)
    out["ended"] = time.monotonic()


def test_scale_down_drains_the_stopped_replica(base: str) -> None:
    from ray import serve

    before = wait_running(base, targets=2)
    router = serve.get_app_handle(APP)
    failovers = router.reliability_state.remote().result(timeout_s=30)["failovers"]
    streams: list[tuple[threading.Thread, dict[str, Any]]] = []
    busy: dict[str, int] = {}
    deadline = time.monotonic() + 20
    while len(busy) < 2:  # a stream on each target replica
        assert time.monotonic() < deadline and len(streams) < 6, f"streams landed on {busy} only"
        out: dict[str, Any] = {}
        thread = threading.Thread(target=_stream, args=(base, out), daemon=True)
        thread.start()
        streams.append((thread, out))
        time.sleep(1.0)
        busy = router.reliability_state.remote().result(timeout_s=30)["by_replica"]

    serve_deploy(SCALED_DOWN)
    started = time.monotonic()
    deadline = started + DEADLINE_S
    while len(replica_actors().get("TargetServer", {})) > 1:  # the stopped replica drains, then exits
        assert time.monotonic() < deadline, "the stopped target replica never exited"
        time.sleep(0.25)
    exited = time.monotonic()
    print(f"the stopped replica exited {exited - started:.1f}s after the scale-down")
    ((kept, kept_actor),) = replica_actors()["TargetServer"].items()
    assert before["TargetServer"][kept] == kept_actor  # the kept replica: same actor, no restart
    (stopped,) = set(before["TargetServer"]) - {kept}
    assert busy.get(stopped), busy  # it had a stream when the scale-down began
    for thread, _ in streams:
        thread.join(timeout=DEADLINE_S)
    for _, out in streams:
        assert out.get("status") == 200 and "error" not in out and "exception" not in out, out
        assert out.get("finish_reason") == "length" and out.get("completion_tokens") == STREAM_TOKENS, out
    print("streams ended " + ", ".join(f"{out['ended'] - started:.1f}s" for _, out in streams)
          + " after the scale-down")
    # every stream was still running when the scale-down began, and none failed over
    assert all(out["ended"] > started for _, out in streams)
    assert min(out["ended"] for _, out in streams) < exited + 1.0  # the stopped replica outlived its stream
    assert router.reliability_state.remote().result(timeout_s=30)["failovers"] == failovers
    wait_running(base, targets=1)
