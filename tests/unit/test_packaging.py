"""What `make run` and `make test` install: serving gets the runtime dependencies only,
testing the extras; every third-party module the served code imports is a declared runtime
dependency, and nothing only benches or tests use is one.
"""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
# Import name -> distribution name, where they differ.
DIST_OF = {"yaml": "pyyaml", "grafana_client": "grafana-client", "prometheus_client": "prometheus-client"}
# Imported inside try/except ImportError: optional accelerators that come with a CUDA torch.
OPTIONAL = {"triton"}
TEST_ONLY = {"pytest", "pytest-timeout", "selenium", "schemathesis", "hypothesis", "matplotlib", "scipy",
             "openai", "httpx", "grafana-client", "prometheus-client"}


def _dist(requirement: str) -> str:
    """'ray[serve]==2.60.0' -> 'ray'; names normalized the PEP 503 way."""
    name = re.match(r"^[A-Za-z0-9._-]+", requirement.strip()).group(0)
    return re.sub(r"[-_.]+", "-", name).lower()


def _third_party_imports(paths: list[Path]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            for name in names:
                top = name.split(".")[0]
                if top in sys.stdlib_module_names or top in ("app", "deployments", "cluster", "bench", "tests"):
                    continue
                out.setdefault(_dist(DIST_OF.get(top, top)), set()).add(str(path.relative_to(ROOT)))
    return out


RUNTIME = {_dist(r) for r in PYPROJECT["dependencies"]}
EXTRAS = {k: {_dist(r) for r in v} for k, v in PYPROJECT["optional-dependencies"].items()}
PROVISION = ROOT / "cluster" / "grafana" / "provision.py"
SERVED = [p for top in ("app", "deployments", "cluster") for p in (ROOT / top).rglob("*.py") if p != PROVISION]


def _installed_closure(requirements: list[str]) -> set[str]:
    """Distributions the requirements pull in (as installed here), extras and markers honoured."""
    from packaging.requirements import Requirement

    seen: set[str] = set()
    todo = [(Requirement(r), "") for r in requirements]
    while todo:
        req, extra = todo.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": extra}):
            continue
        name = _dist(req.name)
        key = name + "[" + ",".join(sorted(req.extras)) + "]"
        if key in seen:
            continue
        seen.add(key)
        try:
            requires = metadata.requires(req.name) or []
        except metadata.PackageNotFoundError:
            continue
        for extra_name in ("", *req.extras):
            todo += [(Requirement(r), extra_name) for r in requires]
    return {k.split("[")[0] for k in seen}


def test_served_code_imports_only_runtime_dependencies() -> None:
    imports = _third_party_imports(SERVED)
    # a module of a package a declared dependency brings (pydantic_core with pydantic) is fine
    pulled = _installed_closure(PYPROJECT["dependencies"])
    missing = {d: sorted(files) for d, files in imports.items() if d not in RUNTIME | OPTIONAL | pulled}
    assert not missing, f"imported by served code but not in [project.dependencies]: {missing}"


def test_runtime_dependencies_carry_no_test_or_bench_only_packages() -> None:
    assert not RUNTIME & TEST_ONLY, RUNTIME & TEST_ONLY
    # prometheus-client: no served code uses it (Ray exports the metrics); only bench/ parses them
    assert "prometheus-client" not in _third_party_imports(SERVED)
    assert "prometheus-client" in EXTRAS["bench"]


def test_grafana_client_is_the_provisioners_extra() -> None:
    assert set(_third_party_imports([PROVISION])) - RUNTIME == {"grafana-client"}
    assert EXTRAS["grafana"] == {"grafana-client"}


def test_test_extra_pulls_bench_and_grafana() -> None:
    (self_ref,) = [r for r in PYPROJECT["optional-dependencies"]["test"] if _dist(r) == "specserve"]
    assert set(re.search(r"\[(.*)\]", self_ref).group(1).split(",")) == {"bench", "grafana"}
    bench_imports = _third_party_imports(list((ROOT / "bench").rglob("*.py")))
    for dist in ("matplotlib", "prometheus-client", "httpx"):
        assert dist in bench_imports and dist in EXTRAS["bench"], dist


def _make_dry_run(target: str, *extra: str) -> str:
    proc = subprocess.run(["make", "-n", "-B", target, "VENV=/nonexistent-venv", *extra], cwd=ROOT,
                          capture_output=True, text=True, check=True)
    return proc.stdout


@pytest.mark.skipif(shutil.which("make") is None, reason="make missing")
def test_make_run_installs_runtime_only_and_make_test_the_test_extra() -> None:
    run = _make_dry_run("run")
    assert "pip install -q -e .\n" in run
    assert "[test]" not in run and "[bench]" not in run
    assert 'pip install -q "torch==2.13.0"' in run  # the CPU wheel on this machine's disk
    assert "-m deployments.run_local --config configs/local.yaml --metrics-export-port 8080" in run
    test = _make_dry_run("test")
    assert 'pip install -q -e ".[test]"' in test and "-m pytest" in test
    gpu = _make_dry_run("setup", "TORCH_SPEC=torch --index-url https://download.pytorch.org/whl/cu128")
    assert 'pip install -q "torch --index-url https://download.pytorch.org/whl/cu128"' in gpu


def test_ci_runs_make_test() -> None:
    assert (ROOT / ".ci" / "run").read_text().rstrip().endswith("make test")
