"""Serve configs in Serve's own shape: what `serve deploy` does with them, without a cluster.

- configs/*.yaml keep only the model and engine in `args` (Ray hashes args into the application's
  code version) and every deployment's options under `deployments:`. Serve's own override of a
  build from `args` (`override_deployment_info`, what the controller runs) yields the options the
  folded build (`serve_config_args`, what serve.run/tests/benches use) binds.
- Changing num_replicas, autoscaling_config, max_ongoing_requests, graceful_shutdown_timeout_s or
  user_config keeps the code version and needs no replica restart (Serve's DeploymentVersion says
  so); a change under `args` or to ray_actor_options does restart.
- DeploymentOptions (args' `*_deployment`, still accepted) lets every Serve option through to
  `.options()` and refuses typos; graceful_shutdown_timeout_s defaults to a request's deadline.
- user_config: UserConfig merges over args' policy; SpeculationPolicy.reconfigure and
  TargetServer.reconfigure apply it in place, keeping what unchanged parts learned.
- The drain: TargetServer.__del__ refuses new streams and waits for open ones, bounded.
No Ray cluster is started.
"""

from __future__ import annotations

import asyncio
import copy
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from app.config import AppConfig, DeploymentOptions, UserConfig, fold_deployments, serve_config_args
from app.policy import PolicyConfig, SpeculationPolicy
from deployments.builder import SHUTDOWN_MARGIN_S, build_app

ROOT = Path(__file__).resolve().parents[2]
SERVE_CONFIGS = [p for p in sorted((ROOT / "configs").glob("*.yaml"))
                 if "applications" in yaml.safe_load(p.read_text())]
LOCAL = yaml.safe_load((ROOT / "configs" / "local.yaml").read_text())["applications"][0]
ENGINE = LOCAL["args"]["engine"]


# ---- what the Serve controller does with an application config (Ray 2.60's own functions) --------
def _serve_infos(app: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """(code version, deployment name -> DeploymentInfo) as `serve deploy` makes them: build_app(args),
    then the config's `deployments:` applied by Serve's override_deployment_info."""
    from ray.serve._private.application_state import override_deployment_info
    from ray.serve._private.build_app import build_app as serve_build
    from ray.serve._private.config import ReplicaConfig
    from ray.serve._private.deploy_utils import get_app_code_version
    from ray.serve._private.deployment_info import DeploymentInfo
    from ray.serve.schema import ServeApplicationSchema

    schema = ServeApplicationSchema.model_validate(app)
    code = get_app_code_version(schema)
    built = serve_build(build_app(app["args"]), name=app["name"])
    infos = {}
    for d in built.deployments:
        # through the proto bytes, as the controller receives it: a deep copy of live init args would
        # try to connect their DeploymentHandles
        replica = ReplicaConfig.from_proto_bytes(d._replica_config.to_proto_bytes(), d._deployment_config.needs_pickle())
        infos[d.name] = DeploymentInfo(deployment_config=d._deployment_config, replica_config=replica,
                                       start_time_ms=0, deployer_job_id="test", version=code)
    return code, override_deployment_info(infos, schema)


def _version(info):
    from ray.serve._private.version import DeploymentVersion

    r = info.replica_config
    return DeploymentVersion(info.version, info.deployment_config, r.ray_actor_options,
                             placement_group_bundles=r.placement_group_bundles,
                             placement_group_strategy=r.placement_group_strategy,
                             max_replicas_per_node=r.max_replicas_per_node)


def _built(args: dict[str, Any]) -> dict[str, Any]:
    from ray.serve._private.build_app import build_app as serve_build

    return {d.name: d for d in serve_build(build_app(args), name="specserve").deployments}


@pytest.mark.parametrize("path", SERVE_CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_are_in_serve_shape(path: Path) -> None:
    (app,) = yaml.safe_load(path.read_text())["applications"]
    assert set(app["args"]) <= {"model_name", "engine"}, "deployment options and policy belong under deployments:"
    names = {d["name"] for d in app["deployments"]}
    assert names == {"Router", "TargetServer", "DraftServer"}
    config = AppConfig.model_validate(serve_config_args(app))
    for entry in app["deployments"]:
        if "user_config" in entry:  # valid policy knobs, for the deployments that have reconfigure()
            assert entry["name"] in ("Router", "TargetServer")
            UserConfig.model_validate(entry["user_config"]).policy_over(config.policy)
    users = {e["name"]: e.get("user_config") for e in app["deployments"]}
    assert users["Router"] == users["TargetServer"], "router and target read one policy"


@pytest.mark.parametrize("path", SERVE_CONFIGS, ids=lambda p: p.name)
def test_serve_applies_deployments_as_the_folded_build_binds_them(path: Path) -> None:
    (app,) = yaml.safe_load(path.read_text())["applications"]
    _, infos = _serve_infos(app)
    folded = _built(serve_config_args(app))
    limits = AppConfig.model_validate(app["args"]).engine.limits
    for name, info in infos.items():
        cfg, want = info.deployment_config, folded[name]
        assert info.replica_config.ray_actor_options == {
            k: v for k, v in want.ray_actor_options.items() if k in info.replica_config.ray_actor_options}, name
        assert {k: v for k, v in want.ray_actor_options.items() if v} == \
            {k: v for k, v in info.replica_config.ray_actor_options.items() if v}, name
        assert cfg.max_ongoing_requests == want._deployment_config.max_ongoing_requests, name
        assert cfg.autoscaling_config == want._deployment_config.autoscaling_config, name
        if cfg.autoscaling_config is None:  # with one, Serve's num_replicas is None, .options()' 1: unused
            assert cfg.num_replicas == want._deployment_config.num_replicas, name
        assert cfg.user_config == want._deployment_config.user_config, name
        assert cfg.graceful_shutdown_timeout_s == want._deployment_config.graceful_shutdown_timeout_s, name
        if name in ("Router", "TargetServer"):  # a scale-down waits out a request's deadline
            assert cfg.graceful_shutdown_timeout_s >= limits.request_timeout_s + SHUTDOWN_MARGIN_S, name
        if name != "Router":  # the builder's affinity router survives Serve's override
            assert cfg.request_router_config.request_router_class.endswith("AffinityRequestRouter"), name


def _lightweight_changes(app: dict[str, Any]) -> dict[str, Any]:
    """Every pool resized in its own mode (num_replicas, or values inside its autoscaling_config), and
    max_ongoing_requests, graceful shutdown, health checks and the policy knobs changed."""
    new = copy.deepcopy(app)
    for entry in new["deployments"]:
        if entry.get("autoscaling_config"):
            entry["autoscaling_config"] = {**entry["autoscaling_config"], "max_replicas": 5,
                                           "target_ongoing_requests": 7}
        else:
            entry["num_replicas"] = 2
        entry["max_ongoing_requests"] = entry.get("max_ongoing_requests", 64) + 1
    by = {d["name"]: d for d in new["deployments"]}
    by["TargetServer"]["graceful_shutdown_timeout_s"] = 400
    by["TargetServer"]["health_check_period_s"] = 3
    for name in ("Router", "TargetServer"):
        by[name]["user_config"] = {"policy": {"margin": 1.4, "explore_every_steps": 32}}
    return new


@pytest.mark.parametrize("path", SERVE_CONFIGS, ids=lambda p: p.name)
def test_scaling_and_user_config_changes_restart_nothing(path: Path) -> None:
    (app,) = yaml.safe_load(path.read_text())["applications"]
    code, before = _serve_infos(app)
    new_code, after = _serve_infos(_lightweight_changes(app))
    assert new_code == code  # `args` unchanged: Serve keeps the build and applies the options
    for name in before:
        assert not _version(before[name]).requires_actor_restart(_version(after[name])), name
    assert _version(before["TargetServer"]).requires_actor_reconfigure(_version(after["TargetServer"]))
    for name, info in after.items():
        auto = info.deployment_config.autoscaling_config
        assert (auto.max_replicas == 5) if auto is not None else (info.deployment_config.num_replicas == 2), name


def test_switching_a_pool_between_num_replicas_and_autoscaling_is_a_new_code_version() -> None:
    """Ray 2.60 hashes the list of the deployments' autoscaling policies (one entry per deployment
    with an autoscaling_config) into the code version: adding or removing an autoscaling_config block
    replaces every replica, as a change to args does (docs/OPERATING.md says so)."""
    code, _ = _serve_infos(LOCAL)
    auto = copy.deepcopy(LOCAL)
    entry = next(d for d in auto["deployments"] if d["name"] == "Router")
    entry.update(num_replicas="auto", autoscaling_config={"min_replicas": 1, "max_replicas": 2})
    assert _serve_infos(auto)[0] != code


def test_args_and_actor_option_changes_do_restart() -> None:
    code, before = _serve_infos(LOCAL)
    engine_change = copy.deepcopy(LOCAL)
    engine_change["args"]["engine"]["limits"]["max_queue"] = 33
    assert _serve_infos(engine_change)[0] != code  # a new code version: every replica replaced
    cpus = copy.deepcopy(LOCAL)
    next(d for d in cpus["deployments"] if d["name"] == "DraftServer")["ray_actor_options"] = {"num_cpus": 0.25}
    _, after = _serve_infos(cpus)
    assert _version(before["DraftServer"]).requires_actor_restart(_version(after["DraftServer"]))
    assert not _version(before["TargetServer"]).requires_actor_restart(_version(after["TargetServer"]))


# ---- DeploymentOptions: every Serve option through, typos refused -----------------------------------
def test_every_serve_option_passes_through_args() -> None:
    args = {"engine": ENGINE, "target_deployment": {
        "num_replicas": 2, "num_cpus": 0.5, "max_ongoing_requests": 9,
        "graceful_shutdown_timeout_s": 42, "graceful_shutdown_wait_loop_s": 1.5,
        "health_check_period_s": 3, "health_check_timeout_s": 7, "max_replicas_per_node": 1,
        "ray_actor_options": {"accelerator_type": "A100", "memory": 2**30,
                              "runtime_env": {"env_vars": {"SPECSERVE_X": "1"}}},
        "logging_config": {"encoding": "JSON", "log_level": "DEBUG"},
        "user_config": {"policy": {"margin": 1.3}}, "max_surge_percent": 50,
    }}
    d = _built(args)["TargetServer"]
    c = d._deployment_config
    assert (c.graceful_shutdown_timeout_s, c.graceful_shutdown_wait_loop_s) == (42, 1.5)
    assert (c.health_check_period_s, c.health_check_timeout_s) == (3, 7)
    assert c.max_ongoing_requests == 9 and d.num_replicas == 2 and c.max_surge_percent == 50
    assert c.user_config == {"policy": {"margin": 1.3}}
    assert c.logging_config["log_level"] == "DEBUG"
    assert d._replica_config.max_replicas_per_node == 1
    actor = d.ray_actor_options
    assert actor["num_cpus"] == 0.5 and actor["accelerator_type"] == "A100" and actor["memory"] == 2**30
    assert actor["runtime_env"]["env_vars"] == {"SPECSERVE_X": "1"}


@pytest.mark.parametrize("opts,match", [
    ({"gracefull_shutdown_timeout_s": 5}, "Extra inputs are not permitted"),
    ({"ray_actor_options": {"num_cpu": 1}}, "Extra inputs are not permitted"),
    ({"health_check_period_s": 0}, "health_check_period_s"),
    ({"graceful_shutdown_timeout_s": -1}, "graceful_shutdown_timeout_s"),
    ({"num_cpus": 1, "ray_actor_options": {"num_cpus": 2}}, "set twice"),
    ({"rolling_update_percentage": 0.5}, "deployments:"),
    ({"num_replicas": 2, "autoscaling_config": {"max_replicas": 3}}, "not both"),
    ({"user_config": {"policy": {"marginn": 1.2}}}, "marginn"),
    ({"user_config": {"polic": {}}}, "polic"),
])
def test_bad_options_are_refused(opts: dict, match: str) -> None:
    with pytest.raises(ValidationError, match=match):
        DeploymentOptions.model_validate(opts)


def test_graceful_shutdown_defaults_to_a_request_deadline() -> None:
    timeout = ENGINE["limits"]["request_timeout_s"]
    built = _built({"engine": ENGINE})
    assert built["TargetServer"]._deployment_config.graceful_shutdown_timeout_s == timeout + SHUTDOWN_MARGIN_S
    assert built["Router"]._deployment_config.graceful_shutdown_timeout_s == timeout + SHUTDOWN_MARGIN_S
    assert built["DraftServer"]._deployment_config.graceful_shutdown_timeout_s == 20  # Serve's default
    explicit = _built({"engine": ENGINE, "target_deployment": {"graceful_shutdown_timeout_s": 5}})
    assert explicit["TargetServer"]._deployment_config.graceful_shutdown_timeout_s == 5


def test_fold_deployments_replaces_like_serve() -> None:
    args = {"engine": ENGINE, "target_deployment": {"num_cpus": 2, "resources": {"x": 1}, "max_ongoing_requests": 5}}
    out = fold_deployments(args, [{"name": "TargetServer", "ray_actor_options": {"num_cpus": 0.5},
                                   "num_replicas": "auto", "autoscaling_config": {"max_replicas": 3}}])
    assert out["target_deployment"] == {"num_cpus": 0.5, "max_ongoing_requests": 5, "num_replicas": None,
                                        "autoscaling_config": {"max_replicas": 3}}
    assert args["target_deployment"]["num_cpus"] == 2  # not changed in place
    with pytest.raises(ValueError, match="Proxy"):
        fold_deployments(args, [{"name": "Proxy"}])


# ---- user_config and reconfigure -------------------------------------------------------------------
def test_user_config_policy_merges_over_args_policy() -> None:
    base = PolicyConfig.model_validate({"margin": 1.2, "costs": {"chunk_s": 0.001}})
    policy = UserConfig.model_validate({"policy": {"costs": {"chunk_beside_s": 0.002}}}).policy_over(base)
    assert policy.margin == 1.2 and policy.costs.chunk_s == 0.001 and policy.costs.chunk_beside_s == 0.002
    assert UserConfig.model_validate({}).policy_over(base) == base


def test_speculation_policy_reconfigure_keeps_what_unchanged_parts_learned() -> None:
    policy = SpeculationPolicy(PolicyConfig())
    policy.costs.observe_target(1, 0.05)
    policy.acceptance.observe("code", 4, 3)
    costs, acceptance, lengths = policy.costs, policy.acceptance, policy.lengths
    new = PolicyConfig.model_validate({"margin": 1.5, "costs": {"chunk_s": 0.003}})
    assert policy.reconfigure(new) == []
    assert policy.config is new and policy.costs is costs and policy.acceptance is acceptance
    assert policy.costs.t_emit(2) == pytest.approx(0.006)  # read live
    rebuilt = policy.reconfigure(new.model_copy(update={
        "prior_alpha": 0.4, "costs": new.costs.model_copy(update={"target_step_s": 0.01})}))
    assert set(rebuilt) == {"costs", "acceptance"}
    assert policy.costs is not costs and policy.acceptance is not acceptance and policy.lengths is lengths


def _bare_target(request_timeout_s: float = 5.0):
    """A TargetServer without models: the parts reconfigure() and the drain touch."""
    from deployments.target_server import TargetServer

    cls = TargetServer.func_or_class
    server = cls.__new__(cls)
    server.config = AppConfig.model_validate({"engine": {**ENGINE, "limits": {"request_timeout_s": request_timeout_s}}})
    server.replica_id = "r1"
    server.policy = SpeculationPolicy(server.config.policy)
    server._trace = None
    server._build_step_policy(server.policy.config, None)
    server._step_lock = threading.Lock()
    server._step_mode = server._planned = None
    server._breakeven = {}
    server._streams, server._draining = 0, False
    return server


class _FakeLoop:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.queues: dict[str, asyncio.Queue] = {}
        self.stopped = self.cancelled = False

    def submit(self, seq_id, *args, **kwargs) -> asyncio.Queue:
        self.queues[seq_id] = asyncio.Queue()
        return self.queues[seq_id]

    def cancel(self, seq_id, queue=None) -> None:
        self.cancelled = True

    def stop(self) -> None:
        self.stopped = True


def test_target_reconfigure_swaps_only_changed_step_parts() -> None:
    server = _bare_target()
    server.loop = _FakeLoop()
    arbiter, hold = server.arbiter, server.hold
    server._breakeven[4] = (0.0, 0.5)  # the 'on' mode's break-even, priced with the costs in force
    server.reconfigure({"policy": {"margin": 1.4, "explore_every_steps": 16, "explore_max_every_steps": 64}})
    assert server._breakeven == {}
    assert server.policy.config.margin == 1.4
    assert server.explorer.every_steps == 16
    assert server.arbiter is arbiter and server.hold is hold  # their settings did not change
    server.reconfigure({"policy": {"mode_arbiter": {"enabled": False}, "plain_hold_steps": 2}})
    assert server.arbiter is None and server.hold is not hold
    assert server.policy.config.margin == PolicyConfig().margin  # a user_config states the whole overlay
    with pytest.raises(ValidationError):
        server.reconfigure({"policy": {"margin": 0.5}})
    assert server.policy.config.plain_hold_steps == 2  # a refused config changes nothing


def test_drain_refuses_new_streams_and_waits_for_open_ones() -> None:
    from app.engine.spec_engine import SeqUpdate
    from app.protocol.generation import GenerateRequest
    from app.protocol.sampling_params import SamplingParams
    from deployments.target_server import ReplicaDraining

    async def scenario() -> None:
        server = _bare_target()
        server.loop = _FakeLoop()
        request = GenerateRequest("a", [1, 2], SamplingParams(max_tokens=3), 0, timeout_s=5.0)
        chunks: list = []

        async def read() -> None:
            async for chunk in server.generate(request):
                chunks.append(chunk)

        reader = asyncio.create_task(read())
        await asyncio.sleep(0.05)
        queue = server.loop.queues["a"]
        queue.put_nowait(SeqUpdate("a", [5], "x", None))
        await asyncio.sleep(0.05)
        assert server._streams == 1
        drain = asyncio.create_task(server.__del__())
        await asyncio.sleep(0.2)
        assert not drain.done() and not server.loop.stopped  # the open stream holds the replica
        with pytest.raises(ReplicaDraining):  # a late call is refused before any chunk: the router re-issues
            await server.generate(GenerateRequest("b", [1], SamplingParams(max_tokens=2), 0, 5.0)).__anext__()
        queue.put_nowait(SeqUpdate("a", [6, 7], "yz", "length"))
        await asyncio.wait_for(drain, 2)
        await reader
        assert [c.token_ids for c in chunks] == [[5], [6, 7]] and chunks[-1].finish_reason == "length"
        assert server.loop.stopped and server._streams == 0

    asyncio.run(scenario())


def test_drain_is_bounded_by_the_request_timeout() -> None:
    async def scenario() -> float:
        server = _bare_target(request_timeout_s=0.3)
        server.loop = _FakeLoop()
        server._streams = 1  # a stream that never ends
        t0 = time.monotonic()
        await server.__del__()
        assert server.loop.stopped
        return time.monotonic() - t0

    assert 0.25 <= asyncio.run(scenario()) < 1.5


def test_cancelled_stream_frees_its_sequence_at_once() -> None:
    from app.protocol.generation import GenerateRequest
    from app.protocol.sampling_params import SamplingParams

    async def scenario() -> None:
        server = _bare_target()
        server.loop = _FakeLoop()
        stream = server.generate(GenerateRequest("a", [1], SamplingParams(max_tokens=4), 0, 5.0))
        task = asyncio.create_task(stream.__anext__())
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert server.loop.cancelled and server._streams == 0

    asyncio.run(scenario())
