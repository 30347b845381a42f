"""pyproject's requires-python states what is tested: the served code needs Python 3.11
(asyncio.timeout in deployments/request_run.py and app/engine/loop.py), and CI runs 3.11."""

from __future__ import annotations

import asyncio
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _minimum() -> tuple[int, int]:
    spec = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    m = re.fullmatch(r">=\s*(\d+)\.(\d+)", spec.strip())
    assert m, f"requires-python should be a plain lower bound, got {spec!r}"
    return int(m.group(1)), int(m.group(2))


def test_requires_python_is_311() -> None:
    assert _minimum() == (3, 11)
    assert hasattr(asyncio, "timeout")  # the 3.11 API the router and engine loop use


def test_running_interpreter_satisfies_it() -> None:
    assert sys.version_info[:2] >= _minimum()


def test_readme_names_the_same_minimum() -> None:
    major, minor = _minimum()
    readme = (ROOT / "README.md").read_text()
    assert f"Python {major}.{minor}+" in readme
    assert "Python 3.10+" not in readme
