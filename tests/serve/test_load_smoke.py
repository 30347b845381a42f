"""`bench.load --shape tiny --device cpu`: the GPU benchmark's code end to end on the CPU, through its
command line. A tiny random-weight pair with the real code path: the app in its own Ray, prompts
tokenized by the router, references from a plain run loaded into the draft replica with an alpha
per prompt class, the warm-up, on / off / auto cells, the report and the plot. The acceptance the
clients read per class follows the classes' alphas (code 0.8 against prose 0.35)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from app.config import PROJECT_ROOT


def test_the_mixed_load_sweep_runs_end_to_end_on_the_cpu(tmp_path: Path) -> None:
    report, png = tmp_path / "load.json", tmp_path / "load.png"
    cmd = [sys.executable, "-m", "bench.load", "--shape", "tiny", "--device", "cpu", "--levels", "2", "--rounds", "1",
           "--warmup", "0.3", "--duration", "1", "--lengths", "8,24", "--prompts-per-class", "2",
           "--json", str(report), "--png", str(png)]
    run = subprocess.run(cmd, cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "plan: tiny pair on cpu" in run.stdout and "TARGET met:" in run.stdout
    r = json.loads(report.read_text())
    assert not r["partial"] and png.stat().st_size > 0
    assert r["config"]["alphas"] == {"code": 0.8, "prose": 0.35} and r["config"]["references"]["count"] == 4
    assert {c["policy"] for c in r["cells"]} == {"on", "off", "auto"}
    assert all(c["failed"] == 0 and c["tokens"] > 0 for c in r["cells"])
    assert set(r["verdict"]) >= {"auto_within_3pct_everywhere", "auto_within_3pct_every_round",
                                 "auto_above_both_at_2_levels", "target_met"}
    # 'on' drafts every request; what it drafted per class was accepted at about the class's alpha
    # (accepted / drafted at k 4: 0.59 for alpha 0.8, 0.13 for 0.35)
    on = next(c for c in r["cells"] if c["policy"] == "on")["by_class"]
    rate = {k: v["accepted"] / v["drafted"] for k, v in on.items() if v.get("drafted")}
    assert set(rate) == {"code", "prose"} and rate["code"] > rate["prose"] + 0.2, on
    off = next(c for c in r["cells"] if c["policy"] == "off")["by_class"]
    assert all(v.get("drafted", 0) == 0 for v in off.values())
