"""What overlapped drafting can gain over sequential speculation, computed exactly from measured step costs.

`bench.inproc.fast_decode.speculative_generate`'s overlapped loop is a Markov chain over one number: how
many drafted tokens are ready when a target pass starts. This module solves that chain exactly
(its stationary distribution) instead of sampling it as `predicted_tokens_per_second` does, and
asks what-if questions of the same chain that the implemented loop does not do:

- `draft_free`: the draft's steps cost nothing (the scheme's ceiling; host time is never counted);
- `restart_wait=m`: after a restart the target waits m draft steps and verifies them
  (PEARL's "pre-verify") instead of running a zero-proposal pass;
- `branch_hit=b`: after a rejection or a wrong bonus guess, with probability b the draft had
  already drafted a branch from the right correction (its runner-up token), deep enough, each
  draft step costing `branch_step_extra` ms more for the extra rows (0: branches free, tree
  drafting's upper bound).

Usage: `python -m bench.overlap_bound [gpu-json]` with a `bench.gpu` result file (default:
bench/results/gpu-h200x2-int8.json, a two-H200 int8 run); prints, per alpha, the best sequential
one-graph pass, the implemented overlapped loop, its ceiling, the what-ifs, and the branch hit rate 1.3x over sequential needs
(with the draft at its measured cost and the branch rows priced per draft step).
Pure Python; no GPU.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, replace
from pathlib import Path

from app.engine.acceptance import expected_tokens_per_step

DEFAULT_RUN = Path(__file__).parent / "results" / "gpu-h200x2-int8.json"


@dataclass(frozen=True)
class PassCosts:
    """Measured costs in ms: target pass by input width (1 = plain decode), one draft step, and
    what a 2-token first draft step costs over a 1-token one (the one-graph sequential pass has it)."""
    t_verify: dict[int, float]
    t_draft: float
    t_pair_extra: float = 0.0

    @classmethod
    def from_gpu_json(cls, path: Path, weights: str = "int8") -> PassCosts:
        run = json.loads(path.read_text())
        return cls(t_verify={int(w): t for w, t in run["t_verify_8b_ms"].items()},
                   t_draft=run[f"t_draft_1b_ms_sequential_{weights}"],
                   t_pair_extra=run[f"t_draft_pair_extra_ms_sequential_{weights}"])


def accepted_distribution(alpha: float, p: int) -> list[float]:
    """P(a accepted of p proposals), a = 0..p: each accepted with alpha until the first miss."""
    return [alpha ** a * (1 - alpha) for a in range(p)] + [alpha ** p]


def sequential_ms_per_token(alpha: float, k: int, costs: PassCosts) -> float:
    """The one-graph sequential pass: a 2-token first draft step, k-1 single steps, verify k+1."""
    return (k * costs.t_draft + costs.t_pair_extra + costs.t_verify[k + 1]) / expected_tokens_per_step(alpha, k)


def overlapped_ms_per_token(alpha: float, k: int, overlap_steps: int, costs: PassCosts, *, draft_free: bool = False,
                            restart_wait: int = 0, branch_hit: float = 0.0, branch_step_extra: float = 0.0,
                            branch_rows: int | None = None, tolerance: float = 1e-12) -> float:
    """Expected ms per output token of the overlapped loop's rules (`speculative_generate`,
    `predicted_tokens_per_second`), solved as a Markov chain over the ready count.

    `branch_rows=None`: the what-if, a branch from the right correction is there with
    probability `branch_hit` after any rejection and is as deep as the chain would have been.
    `branch_rows=B`: the loop as built (bench/inproc/fast_branches.branching_generate): at most B branches a
    pass, one per judged index i < min(p + 1, ready) from the pass's start, plus the bonus index p
    after the first step when the chain held only p; an adopted branch holds the steps it drafted
    (one fewer for the late bonus branch), not the chain's depth."""
    # drafting branches beside the chain makes every draft step a wider batch: branch_step_extra ms more
    t_draft = 0.0 if draft_free else costs.t_draft + (branch_step_extra if branch_hit > 0 else 0.0)
    cap = k + 2 + overlap_steps + restart_wait + 1  # no reachable state holds more ready tokens
    dist = [0.0] * (cap + 1)
    dist[0] = 1.0
    ms = tokens = 0.0
    for _ in range(10_000):  # power iteration; the chain mixes within a few dozen passes
        nxt = [0.0] * (cap + 1)
        ms = tokens = 0.0
        for ready, w in enumerate(dist):
            if w == 0.0:
                continue
            wait = 0.0
            if ready == 0 and restart_wait:
                # the target idles while the draft drafts m: not hidden, so charged even when the draft is free
                wait, ready = restart_wait * costs.t_draft, restart_wait
            p = min(k, ready)
            steps = min(overlap_steps, max(1, k + 2 - (ready - p)))
            after = ready + steps
            ms += w * (wait + max(costs.t_verify[p + 1], steps * t_draft))
            early = min(p + 1, ready, branch_rows if branch_rows is not None else p + 1)  # branched from the start
            late = branch_rows is not None and ready == p and early < branch_rows  # the bonus, after one step
            for a, q in enumerate(accepted_distribution(alpha, p)):
                tokens += w * q * (a + 1)
                chain = alpha if a == p else 0.0  # all accepted and the bonus guessed
                if branch_rows is None:  # a branch as deep as the chain
                    chain += (1 - chain) * branch_hit
                    nxt[0] += w * q * (1 - chain)
                else:
                    covered = a < early or (a == p and late)
                    hit = (1 - chain) * branch_hit if covered else 0.0
                    nxt[steps if a < early else steps - 1] += w * q * hit
                    nxt[0] += w * q * (1 - chain - hit)
                nxt[min(cap, max(0, after - (a + 1)))] += w * q * chain
        converged = sum(abs(x - y) for x, y in zip(dist, nxt)) < tolerance
        dist = nxt
        if converged:
            break
    return ms / tokens


def best_overlapped(alpha: float, costs: PassCosts, max_k: int = 8, **what_if) -> tuple[float, int, int]:
    """(ms per token, k, overlap steps) minimising the chain's cost over the loop's choices."""
    # L beyond k + 2 changes nothing: the loop never runs more than k + 2 steps in one pass
    return min((overlapped_ms_per_token(alpha, k, L, costs, **what_if), k, L)
               for k in range(1, max_k + 1) for L in range(1, k + 3))


def branch_hit_needed(alpha: float, costs: PassCosts, ratio: float, seq_ms: float,
                      branch_step_extra: float = 0.0) -> float | None:
    """Smallest branch hit rate at which the overlapped loop (its draft at its measured cost, each
    draft step `branch_step_extra` ms dearer) reaches `ratio` x the best sequential pass; None if none does."""
    lo, hi = 0.0, 1.0
    extra = {"branch_step_extra": branch_step_extra}
    if seq_ms / best_overlapped(alpha, costs, branch_hit=hi, **extra)[0] < ratio:
        return None
    for _ in range(20):
        mid = (lo + hi) / 2
        if seq_ms / best_overlapped(alpha, costs, branch_hit=mid, **extra)[0] >= ratio:
            hi = mid
        else:
            lo = mid
    return hi


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", nargs="?", type=Path, default=DEFAULT_RUN, help="a bench.gpu result JSON")
    parser.add_argument("--weights", default="int8", choices=["int8", "bf16"], help="which draft's step costs")
    parser.add_argument("--alphas", type=float, nargs="+", default=[0.5, 0.7, 0.9])
    parser.add_argument("--branch-hit", type=float, default=0.52,
                        help="runner-up hit rate for the branch what-if (default: the embedded pair on code, "
                             "bench.draft_agreement)")
    parser.add_argument("--draft-ms", type=float, help="override the draft step's cost (ms)")
    parser.add_argument("--pair-extra-ms", type=float, help="override what a 2-token draft step costs over 1 (ms)")
    parser.add_argument("--branch-extra-ms", type=float,
                        help="what the branch rows add to a draft step (ms; default: the 2-token step's extra)")
    args = parser.parse_args()
    costs = PassCosts.from_gpu_json(args.run, args.weights)
    if args.draft_ms is not None:
        costs = replace(costs, t_draft=args.draft_ms)
    if args.pair_extra_ms is not None:
        costs = replace(costs, t_pair_extra=args.pair_extra_ms)
    branch_extra = costs.t_pair_extra if args.branch_extra_ms is None else args.branch_extra_ms
    plain = costs.t_verify[1]
    print(f"{args.run.name}: decode {plain:.3f} ms, draft step {costs.t_draft:.3f} ms "
          f"(2-token step +{costs.t_pair_extra:.3f}), verify of 4 tokens {costs.t_verify[4]:.3f} ms")
    print("speedup over plain decoding [over the best sequential pass] (k, overlap steps); every what-if but "
          "'draft free' keeps the draft at its measured cost; the last prices the branch rows per draft step")
    columns = {"overlapped, as built": {}, "draft free": {"draft_free": True}, "pre-verify 1": {"restart_wait": 1},
               f"free branches, hit {args.branch_hit:.2f}": {"branch_hit": args.branch_hit},
               f"branches at +{branch_extra:.2f} ms a step": {"branch_hit": args.branch_hit,
                                                              "branch_step_extra": branch_extra}}
    print(" alpha | sequential (k) | " + " | ".join(columns) + " | branch hit for 1.3x (rows priced)")
    for alpha in args.alphas:
        seq_ms, seq_k = min((sequential_ms_per_token(alpha, k, costs), k) for k in range(1, 9))
        cells = []
        for what_if in columns.values():
            ms, k, steps = best_overlapped(alpha, costs, **what_if)
            cells.append(f"{plain / ms:.2f} [{seq_ms / ms:.2f}] ({k},{steps})")
        need = branch_hit_needed(alpha, costs, 1.3, seq_ms, branch_extra)
        print(f"  {alpha:.2f} | {plain / seq_ms:.2f} ({seq_k}) | " + " | ".join(cells)
              + f" | {'unreachable' if need is None else f'{need:.2f}'}")


if __name__ == "__main__":
    main()
