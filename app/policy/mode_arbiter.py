"""Which step mode a batch runs in, chosen by measured goodput: the planner, or a fixed choice.

The step planner (step_plan.py) is a model: it prices a step from measured parts and picks the
plan with the best predicted tokens per second. Its parts can each be right and the sum still be
wrong on a given host, and the error moves with the host's speed. Measured on the 2-core CPU app
(bench/RESULTS.md section 7, runs AE-AL): in seven full sweeps the planner came within 3 % of the
better fixed policy at every concurrency in two; in the others it under-drafted at 4-8 streams
(0.84-0.89 of 'on' on a slow host), drafted too shallow at 32, or drafted where 'off' won at 2.
Tuning the model's margin and calibrating its step time moved the misses around, not away.

The issue asks for a router that is *never worse than the best fixed choice*. That is a bandit
over arms, not a better model: so the engine keeps, per batch-size bucket, the goodput it really
measured (output tokens of the batch / wall seconds of the step, newcomers' prefill excluded) in
each of three modes, and runs the batch's adaptive sequences in the best one:

- `plan`: the step planner decides (its exploration, hold and depth choice included);
- `on`:   every adaptive sequence drafts at the policy's default k (what forced 'on' does);
- `off`:  every adaptive sequence decodes plainly (what forced 'off' does).

Each arm that is not the leader is re-measured by a short probe (at least `probe_min_steps`
steps and `probe_min_s` seconds), and probes are budgeted in *time*: after a probe that took T
seconds, the next probe of that mode waits until the leader has run T / share seconds. The share
starts at `base_share` and halves, down to `min_share`, each time a probe finds the mode clearly
worse (under `far_ratio` of the leader); a probe that finds it close or better puts it back at the
base. Why time, not steps: a step at 32 streams on the CPU app takes ~0.4 s against ~10 ms at one
stream, and a 16-s benchmark cell holds only ~40 steps there; probes of 24 steps every 96 (the
first form of this module, run AM in bench/RESULTS.md section 7) spent, as estimated from the
replica's step counts, about a third of auto's steps at 32 streams in modes ~30 % worse, and auto
lost 7 % to 'on' there. The first `settle_steps` steps
after the mode changes are not measured: they pay the switch (the draft's catch-up prefill of
every token decoded plainly since a sequence last drafted), which a mode that stays does not pay;
their time counts against the probe's budget all the same.

Steps whose batch is all forced the same way (every sequence 'on' at the default k, or every
sequence 'off') are measurements of that arm too, and count as its probe: a live service learns
from the fixed policies' own traffic.

Pure and single-threaded: the engine thread calls `mode` before planning a step and `observe`
after it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .calibration import batch_bucket  # the same buckets as the planner's step-time calibration

StepMode = Literal["plan", "on", "off"]
MODES: tuple[StepMode, ...] = ("plan", "on", "off")


class ModeArbiterConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(True, description="choose the step mode by measured goodput; False: the planner always")
    probe_min_steps: int = Field(4, ge=1, description="a probe of a non-leading mode runs at least this many steps")
    probe_min_s: float = Field(0.25, ge=0.0, description="... and at least this many seconds")
    settle_steps: int = Field(2, ge=0, description="steps after a mode change that are not measured (the switch's cost)")
    base_share: float = Field(0.05, gt=0.0, lt=1.0, description="time share of probes of a mode close to the leader")
    min_share: float = Field(0.005, gt=0.0, lt=1.0, description="the share's floor after repeated clear losses")
    far_ratio: float = Field(0.95, gt=0.0, lt=1.0, description="a probe under this share of the leader halves its share")
    switch_ratio: float = Field(1.01, ge=1.0, description="a mode takes the lead only above this share of the leader")
    half_life_steps: float = Field(256.0, gt=0.0, description="measured steps over which a mode's goodput is averaged")

    @model_validator(mode="after")
    def _share_shrinks(self) -> "ModeArbiterConfig":
        if self.min_share > self.base_share:
            raise ValueError(f"mode_arbiter.min_share={self.min_share} > base_share={self.base_share}: the probe "
                             "share only shrinks from the base; set min_share <= base_share")
        return self


@dataclass
class _ModeStats:
    share: float  # time share its probes may take of the leader's time
    tokens: float = 0.0  # decayed sum of output tokens over measured steps
    seconds: float = 0.0  # decayed sum of their wall seconds
    steps: int = 0  # measured steps, undecayed
    waited_s: float = 0.0  # leader seconds since it was last measured
    probe_s: float = 0.0  # wall seconds its last probe took (settling included)
    pending: bool = False  # measured since the last judgement (see ModeArbiter._judge)

    @property
    def goodput(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def due(self) -> bool:
        return self.waited_s * self.share >= self.probe_s


@dataclass
class _Bucket:
    stats: dict[str, _ModeStats]
    leader: StepMode = "plan"
    current: StepMode = "plan"  # the mode of the running spell
    probing: bool = False  # the spell is a probe of `current`
    probe_steps: int = 0  # steps the probe has run
    settle_left: int = 0
    probes: int = 0
    steps_by_mode: dict[str, int] = field(default_factory=lambda: {m: 0 for m in MODES})


class ModeArbiter:
    def __init__(self, config: ModeArbiterConfig | None = None) -> None:
        self.config = config or ModeArbiterConfig()
        self._lambda = 0.5 ** (1.0 / self.config.half_life_steps)
        self._buckets: dict[int, _Bucket] = {}
        self._last_mode: StepMode | None = None  # the mode of the engine's last step, any bucket

    def _bucket(self, batch_size: int) -> _Bucket:
        key = batch_bucket(batch_size)
        b = self._buckets.get(key)
        if b is None:
            b = self._buckets[key] = _Bucket({m: _ModeStats(share=self.config.base_share) for m in MODES})
        return b

    def mode(self, batch_size: int) -> StepMode:
        """The mode this step of a batch of `batch_size` (with adaptive sequences) runs in."""
        b = self._bucket(batch_size)
        if b.probing:
            s = b.stats[b.current]
            if b.probe_steps < self.config.probe_min_steps or s.probe_s < self.config.probe_min_s:
                return b.current
            b.probing = False
        self._judge(b)
        unmeasured = [m for m in MODES if b.stats[m].steps == 0]
        if unmeasured:  # every mode is measured once before any is trusted, the planner first
            return self._start(b, unmeasured[0])
        due = [m for m in MODES if m != b.leader and b.stats[m].due()]
        if due:  # the longest-waiting first
            return self._start(b, max(due, key=lambda m: b.stats[m].waited_s * b.stats[m].share))
        b.current = b.leader
        return b.leader

    def _start(self, b: _Bucket, mode: StepMode) -> StepMode:
        b.current, b.probing, b.probe_steps = mode, True, 0
        b.stats[mode].probe_s = 0.0
        b.probes += 1
        return mode

    def _judge(self, b: _Bucket) -> None:
        """After a probe (or forced steps) measured a non-leading mode: when it was clearly worse
        than the leader, probe it half as much; when close or better, at the base share."""
        lead = b.stats[b.leader]
        for m in MODES:
            s = b.stats[m]
            if not s.pending or m == b.leader:
                s.pending = False
                continue
            s.pending = False
            if lead.steps and s.goodput < self.config.far_ratio * lead.goodput:
                s.share = max(s.share / 2, self.config.min_share)
            else:
                s.share = self.config.base_share

    def observe(self, batch_size: int, mode: StepMode, tokens: int, seconds: float, *, chosen: bool = True) -> None:
        """One finished step in `mode`: the batch's output `tokens` over its wall `seconds`
        (prefill of sequences that joined excluded). `chosen`: the mode came from `mode()`;
        False: a batch forced all one way, a free measurement of that mode."""
        b = self._bucket(batch_size)
        b.steps_by_mode[mode] += 1
        s = b.stats[mode]
        if chosen and b.probing and mode == b.current:
            b.probe_steps += 1
            s.probe_s += max(seconds, 0.0)
        if mode != self._last_mode:
            b.settle_left = self.config.settle_steps
        self._last_mode = mode
        if b.settle_left > 0:
            b.settle_left -= 1
            return
        if seconds <= 0:
            return
        s.tokens = s.tokens * self._lambda + tokens
        s.seconds = s.seconds * self._lambda + seconds
        s.steps += 1
        if mode == b.leader:
            if chosen:  # exploiting: the other modes wait longer since their last measurement
                for m in MODES:
                    if m != mode:
                        b.stats[m].waited_s += seconds
        else:
            s.waited_s, s.pending = 0.0, True
            if not chosen:  # forced traffic measured it: that is its probe, as long as it lasts
                s.probe_s = max(s.probe_s, self.config.probe_min_s)
        self._elect(b)

    def _elect(self, b: _Bucket) -> None:
        lead = b.stats[b.leader]
        best = max((m for m in MODES if b.stats[m].steps), key=lambda m: b.stats[m].goodput, default=b.leader)
        if best != b.leader and (lead.steps == 0 or b.stats[best].goodput > self.config.switch_ratio * lead.goodput):
            old = b.stats[b.leader]
            old.waited_s, old.share, old.pending = 0.0, self.config.base_share, False
            old.probe_s = max(old.probe_s, self.config.probe_min_s)
            b.stats[best].pending = False
            b.leader = best

    def snapshot(self) -> dict[str, dict]:
        """Per batch bucket: the leader, each mode's measured goodput (tok/s) and steps, probe shares."""
        return {
            f"b{key}": {
                "leader": b.leader,
                "goodput": {m: round(b.stats[m].goodput, 1) for m in MODES},
                "measured_steps": {m: b.stats[m].steps for m in MODES},
                "steps": dict(b.steps_by_mode),
                "probe_share": {m: round(b.stats[m].share, 4) for m in MODES},
                "probes": b.probes,
            }
            for key, b in sorted(self._buckets.items())
        }


def forced_mode(requested_ks: list[int], adaptive: list[bool], default_k: int) -> StepMode | None:
    """The mode a batch with no adaptive sequence measures: 'off' when every sequence asked for
    no drafts, 'on' when every one asked for `default_k` (forced 'on'), else None (a mix)."""
    if any(adaptive) or not requested_ks:
        return None
    if all(k == 0 for k in requested_ks):
        return "off"
    if all(k == default_k for k in requested_ks):
        return "on"
    return None


def mode_ks(mode: StepMode, caps: list[int], adaptive: list[bool], default_k: int) -> list[int] | None:
    """Drafts per sequence for a fixed mode: adaptive sequences at `default_k` ('on') or 0 ('off'),
    forced ones at their cap as always; None for 'plan' (the planner decides)."""
    if mode == "plan":
        return None
    return [(min(cap, default_k) if mode == "on" else 0) if a else cap for cap, a in zip(caps, adaptive)]
