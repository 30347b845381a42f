"""The mode arbiter's settings (mode_arbiter.py says why each rule exists). The figures quoted are
measurements of the Serve app on the 2-core CPU host (`bench.load`)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .step_mode import StepMode

# Settings no deployment tunes (constants, not ModeArbiterConfig fields):
# standard errors by which a mode's mean ratio (+ FAR_Z s.e.) must be under FAR_RATIO to count as a
# clear loser whose probe share halves: one s.e., so a mode is not starved on one bad probe
FAR_Z = 1.0
# a fixed mode whose mean ratio + CONTENDER_Z standard errors is above the leader's is a contender,
# raced at warm_share (ModeArbiter._share)
CONTENDER_Z = 0.5
# prior spread of one probe's ratio (its coefficient of variation), one pseudo-probe that the
# probes' own spread is shrunk towards (ModeStats.variance): ~0.2 for 0.25-s probes at one stream
# on the CPU app
PROBE_CV = 0.2
# wall seconds over which a mode's paired ratio to the leader is averaged: how fast evidence from
# an older host state (speed, traffic) fades
EVIDENCE_HALF_LIFE_S = 120.0
# measured steps over which a mode's goodput is averaged for display (ModeArbiter.snapshot); the
# decisions use paired ratios, never this
DISPLAY_HALF_LIFE_STEPS = 64.0
# a mode's first this many pairings in a load bucket are probed at warm_share, and it takes the
# lead only after them: single probes spread ~30 % at 2 streams on the CPU app, so one lucky probe
# must not move the lead
WARM_PAIRINGS = 3
# a mode surely under this share of the leader (mean ratio + FAR_Z standard errors) is a clear
# loser: its probe share halves
FAR_RATIO = 0.95
# a mode takes the lead only when surely above this share of the leader (mean ratio - SWITCH_Z
# standard errors): a lead does not move on a tie
SWITCH_RATIO = 1.01
# standard errors of the mean ratio a new fixed-mode leader must clear (the planner clears
# plan_switch_z)
SWITCH_Z = 0.5
# a leader unmeasured this long (a lull, forced traffic) has no current figure: it is measured
# afresh before any probe, and a probe this long without a step ends
LEADER_STALE_S = 5.0
# a pairing whose probe ran at a host CPU steal share this far from the mean of the leader's
# windows around it is dropped (with a steal meter; the hypervisor's share on the 2-core CPU VM
# explained most of one fixed policy's cell-to-cell spread)
MAX_STEAL_GAP = 0.03


class ModeArbiterConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(True, description="choose the step mode by measured goodput; False: the planner always")
    probe_min_steps: int = Field(8, ge=1, description="a probe of a non-leading mode runs at least this many steps "
                                                      "(4-step windows at 32 streams differ up to 2x)")
    probe_min_s: float = Field(1.0, ge=0.0, description="... and at least this many seconds; the leader is measured "
                                                        "as long before and after it, to pair with (0.25 s windows "
                                                        "spread ~30 % at 2 streams)")
    probe_max_s: float = Field(10.0, gt=0.0, description="a probe's own steps, and the leader's after it, that "
                                                         "have not filled a window in this many seconds end it "
                                                         "unpaired (a 'plan' window waits for the batch to turn "
                                                         "over)")
    settle_steps: int = Field(2, ge=0, description="steps after a mode change that are not measured (the switch's cost)")
    warm_loser_pairings: int = Field(2, ge=1, description="... but a mode surely under FAR_RATIO after this many "
                                                          "ends its warm-up (probed at its share from then on)")
    plan_warm_share: float = Field(0.02, gt=0.0, le=1.0, description="... and of the planner's, which also waits "
                                                                    "its last probe's length (probe_min_s, or the "
                                                                    "nearest load's) / this share before its first "
                                                                    "probe at a load: a model, the long shot (0.05: "
                                                                    "3.5-7.5 % of auto's time per level, no "
                                                                    "bucket led, b32's 4.5 s probe never paired)")
    warm_share: float = Field(1.0, gt=0.0, le=1.0, description="time share of probes of a fixed mode not yet paired "
                                                               "WARM_PAIRINGS times")
    base_share: float = Field(0.03, gt=0.0, lt=1.0, description="time share of probes of a mode close to the leader "
                                                                "(0.05: probes take ~13 % of auto's time at 2 streams "
                                                                "in modes 6-13 % worse)")
    min_share: float = Field(0.005, gt=0.0, lt=1.0, description="the share's floor after repeated clear losses")
    plan_switch_z: float = Field(1.5, ge=0.0, description="... and the planner, taking the lead from a fixed mode "
                                                          "(the fixed modes are the choices auto is judged against)")
    first_leader: StepMode = Field("off", description="the leader of the first load bucket, before any "
                                                      "measurement (later buckets start with the nearest one's)")
    inherit_clear_losers: bool = Field(True, description="a mode the nearest load found surely under FAR_RATIO of "
                                                         "their common leader is a suspect at a new load: one own "
                                                         "probe that agrees ends its warm-up (False: full warm-up)")
    window_lifetimes: float = Field(1.0, ge=0.0, description="every window (the leader's before and after a probe, "
                                                              "the probe's) lasts at least this many mean sequence "
                                                              "lifetimes at its load, up to probe_max_s / 2 (closed-"
                                                              "loop batches move in waves)")
    load_window_s: float = Field(1.0, ge=0.0, description="a step is judged in the bucket of its load: the largest "
                                                          "batch of the last this many seconds, its own included "
                                                          "(0: the step's own batch size)")

    @model_validator(mode="after")
    def _share_shrinks(self) -> "ModeArbiterConfig":
        if self.min_share > self.base_share:
            raise ValueError(f"mode_arbiter.min_share={self.min_share} > base_share={self.base_share}: the probe "
                             "share only shrinks from the base; set min_share <= base_share")
        return self
