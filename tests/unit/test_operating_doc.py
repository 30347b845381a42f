"""docs/OPERATING.md stays true to the tree: the files, tests and environment variables it
names exist, its metric table lists every exported specserve series, its alert table every alert."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from app import metrics as m

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "OPERATING.md").read_text()
PATH_RE = re.compile(r"`((?:app|deployments|cluster|configs|tests|bench|docs)/[A-Za-z0-9_./-]+|Dockerfile|Makefile)`")


def test_named_paths_exist() -> None:
    paths = set(PATH_RE.findall(DOC))
    assert len(paths) > 20
    missing = sorted(p for p in paths if not (ROOT / p.split("::")[0].rstrip(".")).exists())
    assert not missing, missing


def test_environment_variables_exist_in_the_code() -> None:
    code = "\n".join(p.read_text() for top in ("app", "deployments") for p in (ROOT / top).rglob("*.py"))
    names = set(re.findall(r"\bSPECSERVE_[A-Z_]+[A-Z]\b", DOC)) - {"SPECSERVE_TARGET_"}
    assert {"SPECSERVE_API_KEY", "SPECSERVE_API_KEY_FILE"} <= names
    for name in names:
        if name.startswith("SPECSERVE_TARGET_"):  # built from ProbeSettings' field names
            field = name.removeprefix("SPECSERVE_TARGET_").lower()
            from app.health import ProbeSettings

            assert field in ProbeSettings.__dataclass_fields__, name
        else:
            assert name in code, name


def test_metric_table_lists_every_series() -> None:
    table = "\n".join(line for line in DOC.splitlines() if line.startswith("| `ray_specserve_"))
    listed = set(re.findall(r"^\| `(ray_specserve_\w+)`", table, re.M))
    assert listed == {d.exported for d in m.ALL_METRICS}


def test_alert_table_lists_every_alert() -> None:
    rules = yaml.safe_load((ROOT / "cluster" / "prometheus" / "specserve-rules.yml").read_text())
    alerts = {r["alert"]: r["labels"]["severity"] for g in rules["groups"] for r in g["rules"] if "alert" in r}
    rows = {m_.group(1): m_.group(2) for m_ in re.finditer(r"^\| `(Specserve\w+)` \|[^|]*\| (\w+) \|", DOC, re.M)}
    assert rows == alerts
