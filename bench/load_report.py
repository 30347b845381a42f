"""bench.load's report: the cells a sweep measured, their summary per (level, policy), the verdict
against the target (auto >= 0.97x the better fixed policy at every level, read on medians, round by
round and paired; above both fixed policies at some levels), the plot, and pooling of several
sweeps' reports."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

POLICIES = ("on", "off", "auto")
TARGET_RATIO = 0.97  # the target: auto within 3 % of the better fixed policy at every level

@dataclass
class Cell:
    policy: str
    concurrency: int
    seconds: float
    tokens: int
    goodput_tok_s: float
    completed: int
    failed: int
    latency_p50_s: float | None
    latency_p99_s: float | None
    acceptance_rate: float | None
    speculated: int = 0  # requests whose decision was to speculate
    reasons: dict[str, int] = field(default_factory=dict)
    drafted_requests: int = 0  # requests that drafted at least one token (auto: the engine's plan)
    round: int = 0
    drafted: int = 0  # draft tokens verified, over the requests inside the window
    drafts: int = 0  # sequence-steps that drafted (vLLM's num_drafts): drafted / drafts = mean depth
    steps: int = 0  # sequence-steps (one streamed event each): drafts / steps = share of steps that drafted
    host_steal: float | None = None  # share of the machine's CPU time stolen by the hypervisor in the window
    attempt: int = 0  # with --max-steal: earlier runs of this cell discarded for steal
    # per prompt class (mixed traffic): requests, drafted_requests, drafted and accepted tokens
    by_class: dict[str, dict[str, int]] = field(default_factory=dict)


def percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 3)



def median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def _median_or_none(xs: list[float | None]) -> float | None:
    known = [x for x in xs if x is not None]
    return median(known) if known else None


def summarize(cells: list[Cell], levels: list[int]) -> dict[tuple[int, str], dict[str, Any]]:
    """Per (level, policy): median goodput over rounds, its range, and the auto cells' modes."""
    out: dict[tuple[int, str], dict[str, Any]] = {}
    for c in levels:
        for p in POLICIES:
            xs = [x for x in cells if x.concurrency == c and x.policy == p]
            if not xs:
                continue
            g = [x.goodput_tok_s for x in xs]
            total = sum(sum(x.reasons.values()) for x in xs)
            out[(c, p)] = {
                "goodput_median": round(median(g), 2), "goodput_min": min(g), "goodput_max": max(g),
                "rounds": len(xs), "requests": total, "speculated": sum(x.speculated for x in xs),
                "drafted_requests": sum(x.drafted_requests for x in xs),
                # how the engine drafted: mean depth of the sequence-steps that drafted, and their share
                "mean_depth": _r(sum(x.drafted for x in xs) / d) if (d := sum(x.drafts for x in xs)) else None,
                "drafting_share": _r(d / st) if (st := sum(x.steps for x in xs)) else None,
                # None where no cell saw a request both start and end in its window (32 streams 'off' on a
                # slow host: a request outlasts the 10-s window), not a latency of 0
                "latency_p50_s": _r(_median_or_none([x.latency_p50_s for x in xs])),
                "latency_p99_s": _r(_median_or_none([x.latency_p99_s for x in xs])),
                **({"by_class": _by_class(xs)} if any(x.by_class for x in xs) else {}),
            }
    return out


def _by_class(cells: list[Cell]) -> dict[str, dict[str, Any]]:
    """Per prompt class over the cells: requests, the share that drafted, accepted / drafted tokens."""
    out: dict[str, dict[str, Any]] = {}
    for cls in sorted({k for x in cells for k in x.by_class}):
        tot = {key: sum(x.by_class.get(cls, {}).get(key, 0) for x in cells)
               for key in ("requests", "drafted_requests", "drafted", "accepted")}
        out[cls] = {"requests": tot["requests"],
                    "drafted_share": _r(tot["drafted_requests"] / tot["requests"]) if tot["requests"] else None,
                    "acceptance_rate": _r(tot["accepted"] / tot["drafted"]) if tot["drafted"] else None}
    return out


def paired_ratio(cells: list[Cell], c: int, fixed: str) -> dict[str, float | None]:
    """Auto over the level's better fixed policy `fixed` within each round (the three cells of a round
    ran back to back, so they share the host's state), then the mean over rounds and its standard
    error. A second reading of the medians' verdict: on a noisy host the two disagree by up to 0.08.
    The same fixed policy in every round, as the target says ("the better fixed policy"): the better of
    the two *per round* is an oracle no fixed choice is, and where the two are close it is the larger of
    two noisy cells (on one CPU sweep at 1 stream, paired 1.037 that way against 1.060 this way)."""
    by_round: dict[int, dict[str, float]] = {}
    for x in cells:
        if x.concurrency == c:
            by_round.setdefault(x.round, {})[x.policy] = x.goodput_tok_s
    ratios = [r["auto"] / r[fixed] for _, r in sorted(by_round.items()) if len(r) == len(POLICIES) and r[fixed] > 0]
    if not ratios:
        return {"paired_mean": None, "paired_se": None, "round_ratios": []}
    mean = sum(ratios) / len(ratios)
    se = (sum((x - mean) ** 2 for x in ratios) / (len(ratios) - 1) / len(ratios)) ** 0.5 if len(ratios) > 1 else None
    return {"paired_mean": round(mean, 3), "paired_se": _r(se), "round_ratios": [round(x, 3) for x in ratios]}


def verdict(cells: list[Cell], levels: list[int]) -> dict[str, Any]:
    summary = summarize(cells, levels)
    rows = []
    for c in levels:
        by = {p: summary[(c, p)] for p in POLICIES if (c, p) in summary}
        if len(by) < len(POLICIES):
            continue
        on, off, auto = (by[p]["goodput_median"] for p in POLICIES)
        best_fixed = max(on, off)
        a = by["auto"]
        # what auto controls is the mode: did most of its sequence-steps draft, as the better policy's do?
        # (by steps, not requests: at low load nearly every auto request drafts a few exploring steps, so a
        # request count called auto "on" at a 1-4 % drafting share; cells without step counts use requests)
        share = a["drafting_share"]
        auto_mode = "on" if (share > 0.5 if share is not None else a["drafted_requests"] * 2 > a["requests"]) else "off"
        better = "on" if on > off else "off"
        rows.append({"concurrency": c, "on": on, "off": off, "auto": auto, "rounds": a["rounds"],
                     "auto_over_best_fixed": round(auto / best_fixed, 3) if best_fixed else None,
                     **paired_ratio(cells, c, better),
                     "auto_above_both": auto > best_fixed, "auto_mostly": auto_mode, "better_fixed": better,
                     "auto_mode_matches_better_fixed": auto_mode == better})
    within = all(r["auto_over_best_fixed"] is not None and r["auto_over_best_fixed"] >= TARGET_RATIO for r in rows)
    # the same target on the paired reading (round by round): where the host's speed moves between sweeps
    # or rounds, the medians of a pool compare cells of different speeds; both are reported, neither hidden
    paired = [r["paired_mean"] for r in rows]
    # the GPU target read strictly: every round's auto / better fixed at every level, and auto above both
    # fixed policies (medians) at two levels or more
    every_round = bool(rows) and all(r["round_ratios"] and min(r["round_ratios"]) >= TARGET_RATIO for r in rows)
    above = [r["concurrency"] for r in rows if r["auto_above_both"]]
    return {"levels": rows, "auto_within_3pct_everywhere": within,
            "auto_within_3pct_every_round": every_round,
            "levels_auto_above_both": above, "auto_above_both_at_2_levels": len(above) >= 2,
            "target_met": within and every_round and len(above) >= 2,
            "auto_above_both_somewhere": any(r["auto_above_both"] for r in rows),
            "auto_within_3pct_everywhere_paired": bool(rows) and all(x is not None and x >= TARGET_RATIO
                                                                     for x in paired),
            "auto_above_both_somewhere_paired": any(x is not None and x > 1.0 for x in paired),
            "auto_mode_matches_better_fixed_everywhere": all(r["auto_mode_matches_better_fixed"] for r in rows)}


def plot(cells: list[Cell], levels: list[int], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"on": "tab:orange", "off": "tab:blue", "auto": "tab:green"}
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(15, 4.2))
    summary = summarize(cells, levels)
    rows = [r for r in verdict(cells, levels)["levels"] if r["paired_mean"] is not None]
    ax3.errorbar([r["concurrency"] for r in rows], [r["paired_mean"] for r in rows],
                 yerr=[r["paired_se"] or 0.0 for r in rows], fmt="o-", color=colors["auto"], capsize=3,
                 label="auto / better fixed, paired (± s.e.)")
    ax3.plot([r["concurrency"] for r in rows], [r["auto_over_best_fixed"] for r in rows], "x", color="black",
             label="auto / better fixed, medians")
    ax3.axhline(1.0, color="gray", lw=0.8)
    ax3.axhline(TARGET_RATIO, color="tab:red", lw=0.8, ls="--", label=f"target: {TARGET_RATIO}")
    ax3.set_ylabel("ratio")
    ax3.set_title("auto against the better fixed policy")
    for p in POLICIES:
        rows = [(c, summary[(c, p)]) for c in levels if (c, p) in summary]
        xs = [c for c, _ in rows]
        med = [r["goodput_median"] for _, r in rows]
        err = [[m - r["goodput_min"] for m, (_, r) in zip(med, rows)], [r["goodput_max"] - m for m, (_, r) in zip(med, rows)]]
        ax1.errorbar(xs, med, yerr=err, fmt="o-", color=colors[p], capsize=3, label=f"speculation {p}")
        for q, style, alpha in (("p50", "o-", 1.0), ("p99", "s--", 0.5)):  # a level without a latency: a gap
            lat = [r[f"latency_{q}_s"] if r[f"latency_{q}_s"] is not None else float("nan") for _, r in rows]
            ax2.plot(xs, lat, style, color=colors[p], alpha=alpha, label=f"{p} {q}")
    for ax in (ax1, ax2, ax3):
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(x) for x in levels])
        ax.set_xlabel("concurrent streams")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    ax1.set_ylabel("goodput (output tokens/s)")
    ax1.set_title("goodput (median over rounds; bars: min-max)")
    ax2.set_ylabel("request latency (s)")
    ax2.set_title("end-to-end latency")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def rescore(path: str) -> None:
    """Recompute the verdict of a written report from its cells (no new measurement)."""
    report = json.loads(Path(path).read_text())
    cells = [Cell(**c) for c in report["cells"]]
    report["verdict"] = verdict(cells, report["config"]["levels"])
    Path(path).write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report["verdict"], indent=1))


def pooled_cells(paths: list[str]) -> tuple[list[Cell], list[int]]:
    """The cells of several reports as one run: each report's rounds stay their own (renumbered), so
    the paired reading pairs cells of one round only. Reports must share levels, max_tokens, cell
    times and policy overrides; pooling is for sweeps of the same code (the caller names them)."""
    cells: list[Cell] = []
    first: dict | None = None
    for path in paths:
        report = json.loads(Path(path).read_text())
        cfg = report["config"]
        key = {k: cfg.get(k) for k in ("levels", "max_tokens", "policy_overrides", "duration_s", "warmup_s",
                                       "max_steal")}
        if first is None:
            first = key
        elif key != first:
            raise SystemExit(f"{path}: config {key} differs from {paths[0]}'s {first}: pool only sweeps of one setup")
        base = max((c.round for c in cells), default=-1) + 1
        cells += [Cell(**{**c, "round": base + c.get("round", 0)}) for c in report["cells"]]
        print(f"{path}: commit {report.get('commit', '?')}, {report.get('date', '?')}, {cfg.get('rounds')} rounds",
              flush=True)
    if first is None:
        raise SystemExit("--pool: name at least one report")
    return cells, list(first["levels"])


def print_verdict(cells: list[Cell], levels: list[int]) -> dict[str, Any]:
    """The verdict as a table, one row per level."""
    v = verdict(cells, levels)
    print(f"{'conc':>5}{'on':>9}{'off':>9}{'auto':>9}{'auto/best':>10}{'paired':>15}  auto mostly / better fixed; "
          "auto's depth, share")
    summary = summarize(cells, levels)
    for r in v["levels"]:
        a_sum = summary[(r["concurrency"], "auto")]
        paired = f"{r['paired_mean']} ± {r['paired_se']}" if r["paired_mean"] is not None else "-"
        print(f"{r['concurrency']:>5}{r['on']:>9.1f}{r['off']:>9.1f}{r['auto']:>9.1f}{r['auto_over_best_fixed']:>10.3f}"
              f"{paired:>15}  {r['auto_mostly']} / {r['better_fixed']}; {a_sum['mean_depth']}, {a_sum['drafting_share']}")
    if any("by_class" in row for row in summary.values()):  # mixed traffic: which classes auto drafted
        print("auto's requests that drafted, by class (acceptance):", " ".join(
            f"c={c}:" + ",".join(f"{k}={b['drafted_share']}({b['acceptance_rate']})"
                                 for k, b in summary[(c, "auto")].get("by_class", {}).items())
            for c in levels if (c, "auto") in summary))
    print("auto / best fixed policy:", " ".join(f"c={r['concurrency']}:{r['auto_over_best_fixed']}" for r in v["levels"]))
    print("auto mostly / better fixed:", " ".join(f"c={r['concurrency']}:{r['auto_mostly']}/{r['better_fixed']}"
                                                   for r in v["levels"]))
    print(f"auto within 3% of the better fixed policy everywhere: {v['auto_within_3pct_everywhere']}; "
          f"above both somewhere: {v['auto_above_both_somewhere']}; "
          f"auto took the better fixed policy's mode everywhere: {v['auto_mode_matches_better_fixed_everywhere']}")
    print(f"paired (auto / better fixed round by round): within 3% everywhere: "
          f"{v['auto_within_3pct_everywhere_paired']}; above both somewhere: {v['auto_above_both_somewhere_paired']}")
    print("auto / better fixed per round:", " ".join(f"c={r['concurrency']}:{','.join(map(str, r['round_ratios']))}"
                                                      for r in v["levels"]))
    print(f"TARGET auto >= {TARGET_RATIO}x the better fixed policy at every load: on medians "
          f"{v['auto_within_3pct_everywhere']}, in every round {v['auto_within_3pct_every_round']}")
    print(f"TARGET auto above both fixed policies at >= 2 loads: {v['auto_above_both_at_2_levels']} "
          f"(at {v['levels_auto_above_both'] or 'none'})")
    print(f"TARGET met: {v['target_met']}")
    return v
