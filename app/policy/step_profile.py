"""Step costs profiled at a replica's start-up, as the cost model's first measurements.

With CUDA graphs per (batch bucket, width), a step's cost on a GPU is stable and can be measured
before any traffic: the target's decode and verify passes at every batch bucket and width, and the
draft's step at every batch bucket and depth (app/runners/profile.py measures them). Without them
the step planner starts from the cost model's prior shape, scaled by the first passes it happens to
see (mostly small batches, plain decoding), and misprices the wide verify passes it has not run yet
(exactly the ones that decide whether drafting pays under load). Fed through StepCosts' own
`observe_*` methods, a profile is the first measurement at each point; the live steps then keep
those points current as they are measured (StepCosts' decaying averages), so a profile never
outweighs what the running engine measures for long.

Pure data and arithmetic: no torch, no Ray.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from app.policy.cost_model import StepCosts


@dataclass(frozen=True)
class PassTime:
    """A target forward over `batch` sequences feeding `width` tokens each (1: decode, k+1: verify),
    its verification's host read included, as the engine times a step's target part."""

    batch: int
    width: int
    seconds: float


@dataclass(frozen=True)
class DraftTime:
    """A draft call for `batch` sequences, `depth` tokens each, none catching up (a drafting step)."""

    batch: int
    depth: int
    seconds: float


@dataclass
class StepProfile:
    target: list[PassTime] = field(default_factory=list)
    draft: list[DraftTime] = field(default_factory=list)
    exchange_s: float | None = None  # one draft call's round trip outside the draft's compute

    def summary(self) -> dict[str, dict[str, float]]:
        """Milliseconds by point, for logs and policy_state."""
        return {"target_ms": {f"{p.batch}x{p.width}": round(p.seconds * 1e3, 3) for p in self.target},
                "draft_step_ms": {f"{d.batch}x{d.depth}": round(d.seconds / d.depth * 1e3, 3) for d in self.draft},
                **({"exchange_ms": {"": round(self.exchange_s * 1e3, 3)}} if self.exchange_s is not None else {})}


def seed_costs(costs: StepCosts, profile: StepProfile, *, repeats: int = 3) -> None:
    """Feed a profile into the cost model as measurements: each target pass at its tokens (batch x
    width, what the engine reports for a step), each draft call as the engine splits a live one into
    per-step time (StepCosts.observe_draft_call), the exchange as measured. `repeats` observations of
    each point weigh it as that many live steps: the live ones take over after a few dozen."""
    from app.proposers.base import FirstPass  # app.proposers imports app.config, which imports app.policy

    for _ in range(max(1, repeats)):
        for p in profile.target:
            costs.observe_target(p.batch * p.width, p.seconds)
        for d in profile.draft:
            costs.observe_draft_call(d.batch, d.depth, d.seconds, FirstPass())
        if profile.exchange_s is not None:
            costs.observe_exchange(profile.exchange_s)
