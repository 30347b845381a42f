"""Where each Serve process's threads spend their wall time, from `bench.serve_gpu --spy DIR`.

    .venv/bin/python -m bench.spy_report DIR [--top 15] [--match spec0.7-1]

`--spy` records every replica and the HTTP proxy with py-spy (raw collapsed stacks, idle samples
included, so a thread's samples add up to its wall time). Per file (one process at one level) and per
thread that ran project code this prints:
- the tree of project functions (app/, deployments/, bench/) with the share of the thread's samples
  each holds (inclusive: the function or anything it called), so the engine step's phases and the
  draft's step read as a tree;
- the lines where its samples end (exclusive): a leaf in a `.tolist()` or `synchronize()` is the
  host waiting for the GPU, a leaf in a socket or queue wait is waiting for work, and a leaf
  anywhere else is Python running, or waiting for the GIL while another thread holds it.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

LINE = re.compile(r"^thread \((?P<tid>\w+)\): (?P<stack>.*) (?P<count>\d+)$")
PROJECT = ("app/", "deployments/", "bench/")


@dataclass
class ThreadSamples:
    name: str
    total: int = 0
    paths: Counter = field(default_factory=Counter)  # (project functions, outermost first) -> samples
    leaves: Counter = field(default_factory=Counter)  # innermost frame -> samples


def _is_project(frame: str) -> bool:
    return any(f"/{p}" in frame for p in PROJECT)


def read(path: Path) -> dict[str, ThreadSamples]:
    """Thread id -> its samples, from one py-spy raw file (recorded with --full-filenames)."""
    threads: dict[str, ThreadSamples] = {}
    for line in path.read_text().splitlines():
        m = LINE.match(line.strip())
        if m is None:
            continue
        name, *frames = m["stack"].split(";")
        count = int(m["count"])
        t = threads.setdefault(m["tid"], ThreadSamples(name))
        t.total += count
        t.leaves[frames[-1] if frames else "(no Python frame)"] += count
        # the project's functions on the stack, one entry per function (not per line), outermost first
        chain: list[str] = []
        for frame in frames:
            if _is_project(frame):
                function = re.sub(r" \(/.*/((?:app|deployments|bench)/[^:]*):\d+\)$", r" (\1)", frame)
                if not chain or chain[-1] != function:
                    chain.append(function)
        for i in range(1, len(chain) + 1):  # inclusive: every prefix of the chain holds the sample
            t.paths[tuple(chain[:i])] += count
    return threads


def _tree(t: ThreadSamples, min_share: float) -> list[str]:
    lines: list[str] = []

    def walk(prefix: tuple[str, ...]) -> None:
        children = [(p, n) for p, n in t.paths.items() if len(p) == len(prefix) + 1 and p[:len(prefix)] == prefix]
        for p, n in sorted(children, key=lambda pn: -pn[1]):
            if n >= min_share * t.total:
                lines.append(f"   {100 * n / t.total:5.1f} %  {'  ' * len(prefix)}{p[-1]}")
                walk(p)

    walk(())
    return lines


def report(path: Path, top: int, min_share: float) -> str:
    threads = read(path)
    total = sum(t.total for t in threads.values()) or 1
    out = [f"== {path.name}: {total} samples"]
    for tid, t in sorted(threads.items(), key=lambda kv: -kv[1].total):
        if not t.paths:
            continue  # no project code on this thread (Ray's, the event loop's idle waits)
        out.append(f"-- thread {t.name} ({tid}): {t.total} samples")
        out += _tree(t, min_share)
        out.append("   leaves:")
        for frame, n in t.leaves.most_common(top):
            out.append(f"   {100 * n / t.total:5.1f} %  {frame}")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--match", default="", help="only files whose name contains this")
    parser.add_argument("--min-share", type=float, default=0.01, help="hide functions under this share of a thread")
    args = parser.parse_args()
    files = sorted(p for p in args.folder.glob("*.txt") if args.match in p.name)
    if not files:
        raise SystemExit(f"no py-spy files matching {args.match!r} in {args.folder}")
    print("\n\n".join(report(p, args.top, args.min_share) for p in files))


if __name__ == "__main__":
    main()
