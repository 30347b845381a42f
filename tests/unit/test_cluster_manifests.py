"""The files ops deploy from: every Serve config in configs/ and embedded in cluster/ is one that
`deployments.builder:build_app` accepts, and the cluster manifests provide what it asks for.

- configs/*.yaml: Serve configs validate as AppConfig via `parse_args`, build with `build_app`
  into Serve deployments (Ray's own validation of options and autoscaling_config), and carry
  `DeploymentOptions.resources` through to the replicas' ray_actor_options.
- cluster/kuberay-rayservice.yaml: a ray.io/v1 RayService whose serveConfigV2 is
  configs/gpu-llama.yaml; its GPU worker groups advertise the custom resources the draft and
  target pools ask for, one group per pool, and every replica fits its group's pods.
- cluster/ray-cluster-launcher.yaml: passes Ray's own launcher schema (prepare_config +
  validate_config); the same resource checks for its node types, for both GPU configs.
- cluster/prometheus/prometheus.yml: `promtool check config` (and its loopback rendering), rules
  included (tests/unit/test_prometheus_rules.py tests the rules themselves).
No Ray cluster is started: building an Application does not need one.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from app.config import AppConfig, DeploymentOptions, load_engine_config, serve_config_args
from deployments.builder import build_app, parse_args

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
SERVE_CONFIGS = [p for p in CONFIGS if "applications" in yaml.safe_load(p.read_text())]
KUBERAY = ROOT / "cluster" / "kuberay-rayservice.yaml"
LAUNCHER = ROOT / "cluster" / "ray-cluster-launcher.yaml"
IMPORT_PATH = "deployments.builder:build_app"
POOLS = {"target_deployment": "TargetServer", "draft_deployment": "DraftServer", "router_deployment": "Router"}
GPU_PAIRS = {
    "gpu-llama.yaml": ("meta-llama/Llama-3.1-8B-Instruct", "meta-llama/Llama-3.2-1B-Instruct"),
    "gpu-qwen.yaml": ("Qwen/Qwen2.5-7B-Instruct", "Qwen/Qwen2.5-0.5B-Instruct"),
}


def _built_deployments(args: dict[str, Any]) -> dict[str, Any]:
    """name -> ray.serve Deployment, as `serve run`/`serve deploy` would build them."""
    from ray.serve._private.build_app import build_app as serve_build

    built = serve_build(build_app(args), name="specserve")
    return {d.name: d for d in built.deployments}


def check_serve_config(data: dict[str, Any]) -> list[AppConfig]:
    """Validate a Serve config's applications like `serve deploy` would; returns their AppConfigs."""
    from ray.serve.schema import ServeDeploySchema

    ServeDeploySchema.model_validate(data) if hasattr(ServeDeploySchema, "model_validate") \
        else ServeDeploySchema.parse_obj(data)
    out = []
    for app in data["applications"]:
        assert app["import_path"] == IMPORT_PATH
        args = serve_config_args(app)  # args with the app's `deployments:` folded in, as Serve applies them
        config = parse_args(args)
        deployments = _built_deployments(args)
        assert set(deployments) == ({"TargetServer", "DraftServer", "Router"} if config.engine.draft
                                    else {"TargetServer", "Router"})
        for field, name in POOLS.items():
            if name not in deployments:
                continue
            opts: DeploymentOptions = getattr(config, field)
            d = deployments[name]
            actor = d.ray_actor_options
            assert actor["num_cpus"] == opts.num_cpus and actor["num_gpus"] == opts.num_gpus
            assert actor.get("resources", {}) == (opts.resources or {})
            auto = d._deployment_config.autoscaling_config
            if opts.autoscaling_config is None:
                assert auto is None and d.num_replicas == opts.num_replicas
            else:
                for key, value in opts.autoscaling_config.items():
                    assert getattr(auto, key) == value, (name, key)
                assert auto.min_replicas <= auto.max_replicas
        out.append(config)
    return out


# ------------------------------------------------------------------------------------ configs/
def test_configs_dir_has_the_documented_files() -> None:
    names = {p.name for p in CONFIGS}
    assert {"local.yaml", "engine.yaml", "autoscale-local.yaml", "gpu-llama.yaml", "gpu-qwen.yaml"} <= names


@pytest.mark.parametrize("path", SERVE_CONFIGS, ids=lambda p: p.name)
def test_serve_configs_build(path: Path) -> None:
    data = yaml.safe_load(path.read_text())
    (config,) = check_serve_config(data)
    # `serve run deployments.builder:build_app config=FILE` reads the same file.
    assert parse_args({"config": str(path)}) == config
    assert load_engine_config(path) == config.engine


@pytest.mark.parametrize("path", [*SERVE_CONFIGS, KUBERAY], ids=lambda p: p.name)
def test_serve_configs_log_json(path: Path) -> None:
    """Issue 51: Serve's logging_config, JSON-encoded, for every deployment of the application
    (`serve deploy` applies it; `make run` passes it to serve.run)."""
    from ray.serve.schema import LoggingConfig

    from deployments.run_local import serve_config_logging

    data = yaml.safe_load(path.read_text())
    if path == KUBERAY:
        data = yaml.safe_load(data["spec"]["serveConfigV2"])
    for app in data["applications"]:
        config = LoggingConfig.model_validate(app["logging_config"])
        assert config.encoding == "JSON" and config.log_level == "INFO" and config.enable_access_log
    if path != KUBERAY:
        assert serve_config_logging(str(path)) == data["applications"][0]["logging_config"]


def test_engine_only_config_loads() -> None:
    assert load_engine_config(ROOT / "configs" / "engine.yaml").draft is not None


def test_autoscale_local_scales_every_pool_on_its_own_signal() -> None:
    config = parse_args({"config": str(ROOT / "configs" / "autoscale-local.yaml")})
    targets = {}
    for field in POOLS:
        auto = getattr(config, field).autoscaling_config
        assert auto is not None, field
        assert auto["min_replicas"] >= 1 and auto["max_replicas"] > auto["min_replicas"], field
        assert auto["upscale_delay_s"] <= 5 and auto["downscale_delay_s"] <= 30, field  # a demo
        targets[field] = auto["target_ongoing_requests"]
    # target: sequences per replica, within the engine's batch; draft: step calls in flight (< 1).
    assert 1 <= targets["target_deployment"] <= config.engine.limits.max_num_seqs
    assert 0 < targets["draft_deployment"] < 1
    assert len(set(targets.values())) == 3
    # every pool can reach max_replicas on a 2-CPU local Ray
    need = sum(getattr(config, f).num_cpus * getattr(config, f).autoscaling_config["max_replicas"] for f in POOLS)
    assert need <= 2


@pytest.mark.parametrize("name", sorted(GPU_PAIRS))
def test_gpu_configs(name: str) -> None:
    config = parse_args({"config": str(ROOT / "configs" / name)})
    target, draft = GPU_PAIRS[name]
    assert config.engine.target.path == target and config.engine.draft is not None
    assert config.engine.draft.path == draft
    for spec in (config.engine.target, config.engine.draft):
        assert spec.device == "cuda" and spec.dtype == "bfloat16"
        # hub ids (no such local directory): resolved_path leaves them alone
        assert spec.resolved_path() == spec.path
    assert config.engine.speculation.proposer == "draft_model"
    assert config.target_deployment.num_gpus == 1 and config.draft_deployment.num_gpus == 1
    assert config.router_deployment.num_gpus == 0
    assert config.target_deployment.resources == {"target_node": 1}
    assert config.draft_deployment.resources == {"draft_node": 1}
    for field in POOLS:
        assert getattr(config, field).autoscaling_config is not None, field
    assert config.target_deployment.autoscaling_config["target_ongoing_requests"] <= \
        config.engine.limits.max_num_seqs


# ------------------------------------------------------------------------------------ cluster/
def _ray_start_resources(params: dict[str, str]) -> dict[str, float]:
    """rayStartParams -> the resources that node advertises (KubeRay's string forms)."""
    out: dict[str, float] = {"CPU": float(params.get("num-cpus", "nan")), "GPU": float(params.get("num-gpus", 0))}
    if "resources" in params:
        raw = params["resources"]
        assert raw.startswith('"{') and raw.endswith('}"'), f"KubeRay wants '\"{{...}}\"', got {raw!r}"
        out.update(json.loads(json.loads(raw)))
    return out


def _check_pools_fit(config: AppConfig, nodes: dict[str, tuple[dict[str, float], int]]) -> None:
    """nodes: group/type name -> (advertised resources, max nodes). Each pool has exactly one group
    with its custom resource, a replica fits a node, max_replicas fit the group, and a router does
    not fit beside a GPU replica (routers stay on CPU nodes)."""
    for field in ("target_deployment", "draft_deployment"):
        opts: DeploymentOptions = getattr(config, field)
        assert opts.resources, f"{field} is not pinned to a node group"
        (custom,) = opts.resources
        groups = [g for g, (res, _) in nodes.items() if res.get(custom, 0) > 0]
        assert len(groups) == 1, (field, custom, groups)
        res, max_nodes = nodes[groups[0]]
        per_node = min(res.get("CPU", 0) // opts.num_cpus if opts.num_cpus else 1e9,
                       res.get("GPU", 0) // opts.num_gpus if opts.num_gpus else 1e9,
                       res[custom] // opts.resources[custom])
        assert per_node >= 1, (field, res)
        assert opts.autoscaling_config is not None
        assert opts.autoscaling_config["max_replicas"] <= per_node * max_nodes, (field, per_node, max_nodes)
        left_cpu = res.get("CPU", 0) - per_node * opts.num_cpus
        assert left_cpu < config.router_deployment.num_cpus, f"routers would fit on {groups[0]}"
    router = config.router_deployment
    assert any(res.get("CPU", 0) >= router.num_cpus and not res.get("GPU") for res, _ in nodes.values())
    assert not router.resources and router.num_gpus == 0


def test_kuberay_rayservice() -> None:
    doc = yaml.safe_load(KUBERAY.read_text())
    assert doc["apiVersion"] == "ray.io/v1" and doc["kind"] == "RayService"
    serve_config = yaml.safe_load(doc["spec"]["serveConfigV2"])
    (config,) = check_serve_config(serve_config)
    # The embedded application is configs/gpu-llama.yaml's, verbatim.
    assert serve_config == yaml.safe_load((ROOT / "configs" / "gpu-llama.yaml").read_text())

    cluster = doc["spec"]["rayClusterConfig"]
    assert cluster["rayVersion"] == __import__("ray").__version__
    assert cluster["enableInTreeAutoscaling"] is True
    head = cluster["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0"
    nodes: dict[str, tuple[dict[str, float], int]] = {}
    for group in cluster["workerGroupSpecs"]:
        params = group["rayStartParams"]
        res = _ray_start_resources(params)
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
        (container,) = group["template"]["spec"]["containers"]
        limits = container["resources"]["limits"]
        assert int(limits.get("nvidia.com/gpu", 0)) == res["GPU"], group["groupName"]  # Ray GPUs = pod GPUs
        assert float(limits["cpu"]) >= res["CPU"]
        assert params.get("metrics-export-port") == "8080"
        nodes[group["groupName"]] = (res, group["maxReplicas"])
    _check_pools_fit(config, nodes)
    # separate GPU worker groups for draft and target
    gpu_groups = [g for g, (res, _) in nodes.items() if res["GPU"] > 0]
    assert len(gpu_groups) == 2


def test_ray_cluster_launcher() -> None:
    from ray.autoscaler._private.util import prepare_config, validate_config

    raw = yaml.safe_load(LAUNCHER.read_text())
    config = prepare_config(raw)
    validate_config(config)  # Ray's own cluster-launcher JSON schema
    types = config["available_node_types"]
    head = types[config["head_node_type"]]
    assert head["resources"].get("CPU") == 0
    nodes = {name: ({k: float(v) for k, v in t["resources"].items()}, t.get("max_workers", 0))
             for name, t in types.items() if name != config["head_node_type"]}
    for name in GPU_PAIRS:
        _check_pools_fit(parse_args({"config": str(ROOT / "configs" / name)}), nodes)
    assert config["file_mounts"]["~/specserve"] == "."
    assert any("--metrics-export-port=8080" in c for c in config["head_start_ray_commands"])
    assert any("--metrics-export-port=8080" in c for c in config["worker_start_ray_commands"])


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Debian prometheus) missing")
def test_prometheus_configs_pass_promtool(tmp_path: Path) -> None:
    from cluster.prometheus_test_config import render_prometheus_config

    rendered = tmp_path / "prometheus.yml"
    rendered.write_text(render_prometheus_config(8080, 1.0))
    for path in (ROOT / "cluster" / "prometheus" / "prometheus.yml", rendered):
        proc = subprocess.run(["promtool", "check", "config", str(path)], capture_output=True, text=True,
                              cwd=tmp_path)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "specserve-rules.yml" in proc.stdout and "SUCCESS: 0 rules found" not in proc.stdout
