"""The speculation policy: pure (Ray-free) cost model, live trackers and the decision.

The router calls `SpeculationPolicy.decide` per request; the target engine calls
`SpeculationPolicy.plan_step` for its whole batch at every step and feeds `observe_*` back
from what it measures. Above the planner, `ModeArbiter` runs each batch size in whichever mode
(the planner, all 'on' unless no acceptance pays, all 'off') measured the best goodput
there (mode_arbiter.py).
"""

from .cost_model import (
    CostCurve,
    StepCosts,
    StepCostsConfig,
    best_k,
    best_spec_k,
    expected_tokens_per_step,
    speedup,
)
from .decision import (
    LoadSnapshot,
    PolicyConfig,
    PolicyRequest,
    Reason,
    SpeculationDecision,
    SpeculationPolicy,
)
from .mode_arbiter import MODES, ModeArbiter, ModeArbiterConfig, StepMode
from .step_mode import batch_bucket
from .step_plan import PlainHold, StepCandidate, StepExplorer, StepPlan, plan_step, plan_step_optimistic
from .trackers import AcceptanceTracker, LengthPredictor, PromptClass, classify_prompt

__all__ = [
    "AcceptanceTracker",
    "CostCurve",
    "LengthPredictor",
    "LoadSnapshot",
    "MODES",
    "ModeArbiter",
    "ModeArbiterConfig",
    "StepMode",
    "batch_bucket",
    "PolicyConfig",
    "PolicyRequest",
    "PromptClass",
    "Reason",
    "SpeculationDecision",
    "SpeculationPolicy",
    "StepCosts",
    "StepCostsConfig",
    "StepCandidate",
    "StepExplorer",
    "PlainHold",
    "StepPlan",
    "best_k",
    "best_spec_k",
    "classify_prompt",
    "expected_tokens_per_step",
    "plan_step",
    "plan_step_optimistic",
    "speedup",
]
