"""bench.runner_passes on the CPU (tiny pair, eager): every point is measured, and verification is
timed on top of the step it follows."""

from __future__ import annotations

import json
import sys

from bench import runner_passes


def test_every_batch_and_width_is_measured(tmp_path, monkeypatch) -> None:
    out = tmp_path / "passes.json"
    monkeypatch.setattr(sys, "argv", ["runner_passes", "--shape", "tiny", "--device", "cpu", "--batches", "1,2",
                                      "--widths", "1,3", "--repeats", "2", "--out", str(out)])
    runner_passes.main()
    report = json.loads(out.read_text())
    assert [(p["batch"], p["width"]) for p in report["points"]] == [(1, 1), (1, 3), (2, 1), (2, 3)]
    for p in report["points"]:
        assert p["graph_ms"] > 0 and p["step_ms"] > 0 and p["step_verify_ms"] > 0
