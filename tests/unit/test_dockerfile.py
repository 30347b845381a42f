"""The Dockerfile builds the image cluster/kuberay-rayservice.yaml names: parsed, not built
(no Docker daemon here). Base image = Ray's GPU image at the pinned Ray version; CUDA torch from
PyTorch's CUDA index before the package; the package with its runtime dependencies only; the tag
`make image` builds is the one every pod of the RayService runs; HF_HOME lies on the model cache
volume the manifest mounts, a PersistentVolumeClaim that cluster/model-cache-pvc.yaml defines.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
KUBERAY = ROOT / "cluster" / "kuberay-rayservice.yaml"
PVC = ROOT / "cluster" / "model-cache-pvc.yaml"
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
IMAGE = f"specserve:{PROJECT['version']}"


def parse_dockerfile(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order; continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        op, _, args = line.partition(" ")
        out.append((op.upper(), " ".join(args.split())))
    assert not pending, "dangling line continuation"
    return out


INSTRUCTIONS = parse_dockerfile(DOCKERFILE.read_text())


def _args() -> dict[str, str]:
    return dict(a.split("=", 1) for op, a in INSTRUCTIONS if op == "ARG" and "=" in a)


def _expand(value: str) -> str:
    return re.sub(r"\$\{(\w+)\}", lambda mt: _args()[mt.group(1)], value)


def test_base_image_is_rays_gpu_image_at_the_pinned_version() -> None:
    ray_pin = next(r for r in PROJECT["dependencies"] if r.startswith("ray["))
    version = ray_pin.split("==")[1]
    assert version == __import__("ray").__version__
    froms = [a for op, a in INSTRUCTIONS if op == "FROM"]
    assert len(froms) == 1
    base = _expand(froms[0])
    match = re.fullmatch(r"rayproject/ray:(\d+\.\d+\.\d+)-py3(\d+)-(gpu|cu\d+)", base)
    assert match, base
    assert match.group(1) == version
    minimum = int(re.search(r">=3\.(\d+)", PROJECT["requires-python"]).group(1))
    assert int(match.group(2)) >= minimum
    # the RayService's rayVersion is the same Ray
    assert yaml.safe_load(KUBERAY.read_text())["spec"]["rayClusterConfig"]["rayVersion"] == version


def test_cuda_torch_then_the_package_runtime_deps_only() -> None:
    runs = [a for op, a in INSTRUCTIONS if op == "RUN"]
    torch_i = next(i for i, r in enumerate(runs) if "TORCH_SPEC" in r)
    assert "--index-url" in runs[torch_i] and re.search(r"/whl/cu\d+$", _args()["TORCH_INDEX"])
    # the same torch the Makefile installs by default, in its CUDA build
    make_default = re.search(r"^TORCH_SPEC \?= (\S+)", (ROOT / "Makefile").read_text(), re.M).group(1)
    assert _args()["TORCH_SPEC"] == make_default
    installs = [i for i, r in enumerate(runs) if re.search(r"pip install .*-e \.(\s|$)", r)]
    assert installs and min(installs) > torch_i, runs
    assert "--no-deps" in runs[max(installs)]  # the second install, after the source is in
    text = " ".join(runs)
    assert "[test]" not in text and "[bench]" not in text and "requirements" not in text


def test_copies_what_the_package_and_configs_need() -> None:
    copies = [a for op, a in INSTRUCTIONS if op == "COPY"]
    sources = {s for c in copies for s in c.split()[:-1] if not s.startswith("--")}
    packages = {p.split("*")[0] for p in
                tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]}
    assert packages | {"pyproject.toml", "configs", "models"} <= sources
    for src in sources:
        assert (ROOT / src).exists(), src
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    assert not ignored & sources, ignored & sources
    assert {".venv", ".git"} <= ignored
    workdir = [a for op, a in INSTRUCTIONS if op == "WORKDIR"]
    assert workdir == ["/home/ray/specserve"]


def test_image_name_matches_the_manifest_and_make_image() -> None:
    doc = yaml.safe_load(KUBERAY.read_text())
    cluster = doc["spec"]["rayClusterConfig"]
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    images = {c["image"] for g in groups for c in g["template"]["spec"]["containers"]}
    assert images == {IMAGE}
    label = next(a for op, a in INSTRUCTIONS if op == "LABEL")
    assert f'org.opencontainers.image.version="{PROJECT["version"]}"' in label
    assert f"docker build -t {IMAGE} ." in DOCKERFILE.read_text()  # the header's instructions


@pytest.mark.skipif(shutil.which("make") is None, reason="make missing")
def test_make_image_builds_that_tag() -> None:
    # --no-print-directory: under `make test` (a parent make) make would also print the directory it enters
    out = subprocess.run(["make", "-n", "--no-print-directory", "image"], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == f"docker build -t {IMAGE} ."


def test_model_cache_volume() -> None:
    env = dict(kv.split("=", 1) for op, args in INSTRUCTIONS if op == "ENV" for kv in args.split())
    hf_home = env["HF_HOME"]
    pvc = yaml.safe_load(PVC.read_text())
    assert pvc["kind"] == "PersistentVolumeClaim" and pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    cluster = yaml.safe_load(KUBERAY.read_text())["spec"]["rayClusterConfig"]
    for group in cluster["workerGroupSpecs"]:  # routers (tokenizer) and both GPU pools (weights)
        spec = group["template"]["spec"]
        volumes = {v["name"]: v for v in spec["volumes"]}
        (container,) = spec["containers"]
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        assert set(mounts) <= set(volumes), group["groupName"]
        cache = [name for name, path in mounts.items() if hf_home.startswith(path.rstrip("/") + "/")]
        assert cache, (group["groupName"], mounts, hf_home)
        claim = volumes[cache[0]]["persistentVolumeClaim"]["claimName"]
        assert claim == pvc["metadata"]["name"]
        assert spec["securityContext"]["fsGroup"] == 100  # Ray's image: user ray, group users (100)
        envs = {e["name"] for e in container.get("env", [])}
        assert "HF_TOKEN" in envs, group["groupName"]  # the Llama repos are gated
