"""What the mode arbiter remembers per load bucket: each mode's paired evidence against the leader,
the measured windows a pairing compares, the probe in flight. Plain records; the rules that read and
write them are mode_arbiter.py's."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .step_mode import MODES, StepMode


@dataclass
class ModeStats:
    share: float  # time share its probes may take of the leader's time
    tokens: float = 0.0  # decayed sum of output tokens over its measured steps (display)
    seconds: float = 0.0  # ... and of their wall seconds
    # paired evidence: time-decayed sums over its probes of weight d, d^2, d * ratio, d * ratio^2, where
    # ratio = the probe's goodput / the leader's around it
    n: float = 0.0
    n_sq: float = 0.0
    r_sum: float = 0.0
    r_sq_sum: float = 0.0
    evidence_t: float = 0.0  # clock time the sums were last decayed to
    steps: int = 0  # measured steps, undecayed
    pairings: int = 0  # probes paired with the leader, undecayed
    waited_s: float = 0.0  # leader seconds since it was last measured
    probe_s: float = 0.0  # wall seconds its last probe took (settling included)

    @property
    def goodput(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def ratio(self) -> float | None:
        """Its goodput over the leader's, measured side by side in time (mean over probes); None before any pair."""
        return self.r_sum / self.n if self.n > 0 else None

    def variance(self, prior_cv: float) -> float:
        """One probe's ratio variance: the probes' own, shrunk towards the prior by one pseudo-probe."""
        mean = self.r_sum / self.n
        sample = max(self.r_sq_sum / self.n - mean * mean, 0.0)
        return (sample * self.n + (prior_cv * mean) ** 2) / (self.n + 1.0)

    def std_error(self, prior_cv: float) -> float:
        """Of the mean ratio, with the effective number of probes (n^2 / n_sq) of the decayed weights."""
        return (self.variance(prior_cv) * self.n_sq) ** 0.5 / self.n

    def seed(self, ratio: float, now: float) -> None:
        """Evidence of one pseudo-pairing at `ratio`: what a new load carries over from the nearest one."""
        self.n, self.n_sq, self.r_sum, self.r_sq_sum, self.evidence_t = 1.0, 1.0, ratio, ratio * ratio, now

    def due(self, share: float) -> bool:
        return self.waited_s > 0 and self.waited_s * share >= self.probe_s


@dataclass
class MeasuredWindow:
    """Measured steps of one mode in a row: output tokens, wall seconds, steps."""
    tokens: float = 0.0
    seconds: float = 0.0
    steps: int = 0
    stolen: int = 0  # host CPU ticks stolen by the hypervisor over its steps (with a steal meter)
    ticks: int = 0  # ... of all host CPU ticks over them

    def add(self, tokens: float, seconds: float, stolen: int = 0, ticks: int = 0) -> None:
        self.tokens, self.seconds, self.steps = self.tokens + tokens, self.seconds + seconds, self.steps + 1
        self.stolen, self.ticks = self.stolen + stolen, self.ticks + ticks

    @property
    def steal(self) -> float | None:
        return self.stolen / self.ticks if self.ticks > 0 else None

    @property
    def goodput(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class ModeProbe:
    """A probe of `mode` paired with the leader's windows just before and just after it: with the
    host's speed drifting linearly, their mean is the leader's goodput during the probe."""
    mode: StepMode
    before: MeasuredWindow  # the leader's last measured steps when the probe began
    during: MeasuredWindow = field(default_factory=MeasuredWindow)  # the probed mode's measured steps
    after: MeasuredWindow = field(default_factory=MeasuredWindow)  # the leader's first measured steps after it
    running: bool = True  # the probe's own steps are still running (else: measuring `after`)
    last_t: float = 0.0  # clock time of its last step (its own or the leader's after it)
    phase_s: float = 0.0  # wall seconds of the current phase's steps (running, then after), measured or not


@dataclass
class LoadBucket:
    stats: dict[str, ModeStats]
    leader: StepMode  # first_leader, or the nearest load's leader when the bucket was made
    recent: deque = field(default_factory=lambda: deque(maxlen=256))  # the leader's measured steps: (tokens, s,
    # stolen ticks, ticks)
    leader_t: float | None = None  # clock time of the leader's last measured step
    probe: ModeProbe | None = None
    settle_left: int = 0
    probes: int = 0
    steps_by_mode: dict[str, int] = field(default_factory=lambda: {m: 0 for m in MODES})
    pairs: deque = field(default_factory=lambda: deque(maxlen=8))  # the last pairings, for the snapshot
    steal_dropped: int = 0  # pairings dropped because the host's steal moved across them
    chosen_s: dict[str, float] = field(default_factory=lambda: {m: 0.0 for m in MODES})  # wall s of chosen steps
    lifetime_s: float | None = None  # decaying mean of the wall seconds a sequence spent in the batch at this load
