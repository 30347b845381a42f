"""bench.spy_report reads py-spy's raw stacks (as bench.serve_gpu --spy records them) into per-thread
trees of project functions with inclusive shares, and lists where the samples end."""

from __future__ import annotations

from pathlib import Path

from bench.spy_report import read, report

RAW = """\
thread (11): engine;run (/x/deployments/target_server.py:10);step (/x/app/engine/spec_engine.py:279);\
_propose (/x/app/engine/spec_engine.py:420);wait (/usr/lib/python3.12/threading.py:331) 6
thread (11): engine;run (/x/deployments/target_server.py:10);step (/x/app/engine/spec_engine.py:280);\
_emit (/x/app/engine/spec_engine.py:440) 3
thread (11): engine;run (/x/deployments/target_server.py:12) 1
thread (12): loop;select (/usr/lib/python3.12/selectors.py:468) 10
"""


def test_threads_read_as_trees_of_project_functions(tmp_path: Path) -> None:
    path = tmp_path / "spec0.7-1-TargetServer-1.txt"
    path.write_text(RAW)
    threads = read(path)
    engine = threads["11"]
    assert (engine.name, engine.total) == ("engine", 10)
    run = ("run (deployments/target_server.py)",)
    step = run + ("step (app/engine/spec_engine.py)",)
    # two lines of step() are one function; the shares are inclusive
    assert engine.paths[run] == 10 and engine.paths[step] == 9
    assert engine.paths[step + ("_propose (app/engine/spec_engine.py)",)] == 6
    assert engine.leaves["wait (/usr/lib/python3.12/threading.py:331)"] == 6
    assert not threads["12"].paths  # no project code: left out of the report
    text = report(path, top=5, min_share=0.01)
    assert "thread loop" not in text
    lines = text.splitlines()
    i = next(i for i, line in enumerate(lines) if "step (app/engine" in line)
    assert "90.0 %" in lines[i] and "60.0 %" in lines[i + 1] and "_propose" in lines[i + 1]
