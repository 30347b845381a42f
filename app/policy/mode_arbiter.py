"""Which step mode a batch runs in, chosen by measured goodput: the planner, or a fixed choice.

The step planner (step_plan.py) is a model: it prices a step from measured parts and picks the
plan with the best predicted tokens per second. Its parts can each be right and the sum still be
wrong on a given host, and the error moves with the host's speed. Measured on the 2-core CPU app
over seven full `bench.load` sweeps, the planner alone came within 3 % of the better fixed policy at
every concurrency in two; in the others it under-drafted at 4-8 streams (0.84-0.89 of 'on' on a
slow host), drafted too shallow at 32, or drafted where 'off' won at 2. Tuning the model's margin
and calibrating its step time move the misses around, not away.

The aim is a policy *never worse than the better fixed choice*. That is a bandit over arms, not a
better model: so the engine keeps, per load bucket, the goodput it really measured (output tokens
of the batch / wall seconds of the step, newcomers' prefill excluded) in each of three modes, and
runs the batch's adaptive sequences in the best one (a load bucket is that of the largest batch of
the last `load_window_s`, see below):

- `plan`: the step planner decides (its exploration, hold and depth choice included);
- `on`:   every adaptive sequence drafts at the policy's default k, unless none of them has an
          acceptance that pays at the batch's size (step_mode.py: a batch of prose stays plain);
- `off`:  every adaptive sequence decodes plainly (what forced 'off' does).

Each arm that is not the leader is re-measured by a short probe (at least `probe_min_steps`
measured steps and `probe_min_s` seconds), and probes are budgeted in *time*: after a probe that
took T seconds, the next probe of that mode waits until the leader has run T / share seconds. The
share starts at `base_share` and halves, down to `min_share`, each time the probes find the mode
surely worse (see below); otherwise it goes back to the base. Why time, not steps: a step at 32
streams on the CPU app takes ~0.4 s against ~10 ms at one stream, and a 16-s benchmark cell holds
only ~40 steps there; budgeted in steps (24 every 96), probes took about a third of auto's steps
at 32 streams, as estimated from the replica's step counts, in modes ~30 % worse, and auto lost 7 %
to 'on' there. The first `settle_steps` steps after the mode changes are not measured: they pay the
switch (the draft's catch-up prefill of every token decoded plainly since a sequence last drafted),
which a mode that stays does not pay; their time counts against the probe's budget all the same.

A probe is judged against the leader measured just before and just after it (windows of as many
measured steps and seconds), not against the leader's figure from whenever: one probe's ratio is
its goodput over the mean of those two windows, so a host whose speed drifts (the 2-core CPU
host's moves ~1.7x within one sweep) shifts both sides alike. A mode's evidence is the
time-decayed mean of its probes' ratios with its standard error; one probe spreads ~20 % at one
stream, so the lead moves only when mean - `SWITCH_Z` s.e. > `SWITCH_RATIO`, and a share is cut
only when mean + `FAR_Z` s.e. < `FAR_RATIO`. A mode's first `WARM_PAIRINGS` probes in a bucket come
at `warm_share` and it cannot take the lead before them: at 2 streams 0.25-s windows spread ~30 %,
and single probes at ratios of 1.17 and 1.47 would move the lead (three moves in a level's first
minutes, auto at 0.85 of 'on'), so windows are 1 s (`probe_min_s`) and a lead moves on three
probes, gathered in the bucket's first seconds. The warm-up's cost is its probes, three a mode
whatever their share; the share only spaces them, and the longer it spaces them the longer a wrong
first leader leads (a 4-stream bucket started by the 2-stream bucket's 'off' leader ran 11.8 s of
its 75 there, where 'on' won by 9 %). So the fixed modes warm up at the leader's own time (share
1), and the leader's window after a probe counts towards the next one's wait.

Closed-loop batches of equal requests move in waves (a forced 'off' cell at 32 streams finishes
exactly two waves of 32 requests each): a step's goodput follows its phase in the wave, and a 1-s
window measures a phase, not a mode. A planner probe begins at a fresh wave (its window waits for
the batch to turn over) and the leader's window after it sees the wave's slow end: with 1-s
windows, three pairings at 1.19-1.26 made the planner lead at 32 streams, and auto ran at 0.949 of
forced 'on'. So every window lasts at least `window_lifetimes` mean sequence lifetimes at its load.

The fixed modes are what auto is judged against (the better of forced 'on' and 'off'); the planner
is a model, right or wrong by the host. So a fresh arbiter starts led by a fixed mode
(`first_leader`: plain, which needs no draft), the planner takes the lead from a fixed mode only
when its mean ratio clears `plan_switch_z` standard errors, not `SWITCH_Z`, and it is probed as the
long shot it is: at a new load after the fixed modes, at `plan_warm_share` of the leader's time.
With 1-s pairings spreading 15-30 % and three or four of them in a level, whichever mode leads
keeps the lead when the others are close: started led by the planner, or letting it lead on four
pairings that put it 13 % above 'on', auto ran at 0.90-0.94 of the better fixed policy at the
loads the planner ended up leading.

The leader's figure is its latest window, not each mode's own long-run goodput: a stale figure
from a faster period of the host would win against fresh ones (compared that way, auto ran at
0.93-0.94 of the better fixed policy at 1-4 streams). The figure is dropped when the leader goes
unmeasured `LEADER_STALE_S` (a new benchmark cell, a lull, forced traffic), no probe starts before
the leader is measured afresh, and a mode takes the lead only right after a probe paired it with
the leader. On a change of leader every ratio is re-expressed against the new one.

Steps whose batch is all forced the same way (every sequence 'on' at the default k, or every
sequence 'off') update that mode's displayed goodput only: they are neither a probe nor a window
of the leader, and a probe that has gone `LEADER_STALE_S` without a step (the auto cell ended) is
dropped rather than finished in the next one. Pairing them with the leader's latest window
misleads the arbiter: in the benchmark a forced cell starts right after an auto cell, and its first
seconds would pair with the auto cell's last leader window, across the cell boundary (104 such
pairings made 'off' the leader at 4 streams, where 'on' won by 26 %).

The planner is stateful, the fixed modes are not: what it decides for a sequence depends on that
sequence's history (the draft's catch-up owed for tokens decoded plainly, its own acceptance
record, the plain hold). After an 'on' probe that drafted every sequence owes no catch-up and the
planner drafts as 'on' does; after an 'off' probe each owes a second of tokens and it stays plain as 'off' does.
So a 'plan' window beside a probe measures the probe's mode again (at 8 streams 'on' paired at
1.01 of the planner that way, the leader's windows around the probes ran at 400-510 tok/s against
the planner's 370-420 elsewhere, and the cells gave 'on' 10 % more). A 'plan' step is therefore
measured only when every sequence in its batch has run in 'plan' alone since it joined (a probe of
'plan' waits for the batch to turn over, and so does the planner's window after a probe of
another mode); an 'on' or 'off' step owes its history only the catch-up, paid in the settling steps.
A probe that cannot fill its window within `probe_max_s` (its own steps, or the leader's after
it) is dropped unpaired, and the mode waits its share of that time before the next.

A step is judged under its load, not its own batch size: in a closed loop of two streams 17 % of
the steps run one sequence while the other stream's next request is routed and prefilled, and
keyed by batch size those steps would run in bucket b1's mode, learned at one stream ('off'), where
the 2-stream load drafts ('on' wins by 21 %). The largest batch of the last `load_window_s` (1 s:
tens of steps at low load, a few at 32 streams) names the load.

A pairing is only as good as the assumption that the host ran at one speed across its three windows.
On the 2-core CPU host (a VM) it often does not: the share of CPU the hypervisor steals explains
three quarters of one fixed policy's cell-to-cell spread (r = -0.87, ~1.4 % of goodput per point of
steal; app/host_steal.py). With a steal meter the windows carry the host's steal share, and a
pairing whose probe window's steal differs from the mean of the leader's windows around it by more
than `MAX_STEAL_GAP` is dropped: not evidence, and the mode waits its share before the next probe.

Single-threaded and Ray-free: the engine thread calls `mode` before planning a step and `observe`
after it; time comes from an injected clock (tests drive a fake one).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence

from .mode_arbiter_config import (CONTENDER_Z, DISPLAY_HALF_LIFE_STEPS, EVIDENCE_HALF_LIFE_S, FAR_RATIO, FAR_Z,
                                  LEADER_STALE_S, MAX_STEAL_GAP, PROBE_CV, SWITCH_RATIO, SWITCH_Z, WARM_PAIRINGS,
                                  ModeArbiterConfig)
from .mode_evidence import LoadBucket, MeasuredWindow, ModeProbe, ModeStats
from .step_mode import HISTORY_DEPENDENT, MODES, StepMode, batch_bucket, forced_mode, mode_ks

__all__ = ["HISTORY_DEPENDENT", "MODES", "ModeArbiter", "ModeArbiterConfig", "StepMode", "forced_mode", "mode_ks"]


class ModeArbiter:
    LULL_S = 0.5  # an engine idle this long between two steps was emptied, not turned over

    def __init__(self, config: ModeArbiterConfig | None = None, clock: Callable[[], float] = time.monotonic,
                 steal_meter: Callable[[], tuple[int, int]] | None = None) -> None:
        """`steal_meter`: (stolen, all) host CPU ticks since its previous call, read once per observed
        step (app.host_steal.StealMeter.since_last); None: pairings are not checked for steal."""
        self.config = config or ModeArbiterConfig()
        self._clock = clock
        self._steal_meter = steal_meter
        self._lambda = 0.5 ** (1.0 / DISPLAY_HALF_LIFE_STEPS)
        self._buckets: dict[int, LoadBucket] = {}
        self._last_mode: StepMode | None = None  # the mode of the engine's last step, any bucket
        # the modes each running sequence has stepped in since it joined (the last step's batch)
        self._seq_modes: dict[str, frozenset[StepMode]] = {}
        self._born: dict[str, float] = {}  # clock time each running sequence's first observed step began
        self._last_end: float | None = None  # clock time the last observed step ended
        # recent steps' (clock time, batch size), times increasing and sizes decreasing: a sliding
        # window's maximum is its first unexpired entry
        self._sizes: deque[tuple[float, int]] = deque()
        self._step_load: int | None = None  # the load mode() judged this step under, for its observe()

    def _load(self, batch_size: int, now: float) -> int:
        """The largest batch of the last load_window_s seconds, this one's included."""
        if self.config.load_window_s <= 0:
            return batch_size
        while self._sizes and now - self._sizes[0][0] > self.config.load_window_s:
            self._sizes.popleft()
        return max(batch_size, self._sizes[0][1]) if self._sizes else batch_size

    def _remember(self, batch_size: int, now: float) -> None:
        while self._sizes and self._sizes[-1][1] <= batch_size:
            self._sizes.pop()
        self._sizes.append((now, batch_size))

    def _bucket(self, load: int, now: float) -> LoadBucket:
        key = batch_bucket(load)
        b = self._buckets.get(key)
        if b is None:
            # a new load starts led by the nearest load's leader (first_leader when none): its warm-up
            # then runs mostly in a mode likely right (led by the planner instead, the first two auto
            # cells at 8 streams and at 16 ran at 0.7-0.8 of 'on' until the warm-up moved the lead)
            near = min(self._buckets, key=lambda k: (abs(k.bit_length() - key.bit_length()), k), default=None)
            b = self._buckets[key] = LoadBucket({m: ModeStats(share=self.config.base_share) for m in MODES},
                                             leader=self._buckets[near].leader if near is not None
                                             else self.config.first_leader)
            if near is not None and self.config.inherit_clear_losers:
                self._inherit_clear_losers(self._buckets[near], b, now)
            if b.leader != "plan" and b.stats["plan"].probe_s == 0:
                # the planner is the long shot: its first probe here waits its share of a probe's length
                # (every fixed mode's is due at once). Its probes wait for the batch to turn over: at 16
                # streams on the CPU app the three of its warm-up took 8.8 s of auto's ~72, in a mode at
                # 0.88 of 'on', and over four sweeps the only load it led it led wrongly (32 streams)
                near_s = self._buckets[near].stats["plan"].probe_s if near is not None else 0.0
                b.stats["plan"].probe_s = max(near_s, self.config.probe_min_s)
        if b.probe is not None and now - b.probe.last_t > LEADER_STALE_S:
            b.probe = None  # a lull or forced traffic: its pairing would span it (the leader's window goes
            # stale by itself, see _leader_window)
        return b

    def _far_early(self, s: ModeStats) -> bool:
        """Surely under FAR_RATIO of the leader after warm_loser_pairings: its warm-up ends (it cannot
        take the lead before WARM_PAIRINGS anyway). Why: at 16 streams on the CPU app three warm-up probes
        of 'off' (0.76, 0.75, 0.71 of 'on', each a ~2.5-s window and the switch back) take 7.7 s of auto's
        ~78 and cost it ~3 %; two such pairings already put the mode surely under FAR_RATIO."""
        c = self.config
        return (s.pairings >= c.warm_loser_pairings and s.ratio is not None
                and s.ratio + FAR_Z * s.std_error(PROBE_CV) < FAR_RATIO)

    def _inherit_clear_losers(self, near: LoadBucket, b: LoadBucket, now: float) -> None:
        """A mode the nearest load found surely worse than its leader (b's leader too) by its own pairings
        there is a suspect here, not a verdict: its ratio there counts as one of the warm_loser_pairings,
        so one own pairing that agrees ends its warm-up (_far_early), and one that disagrees leaves it
        warming up (a crossover is still found). A mode that was close there gets the full warm-up here.
        Why one probe, not none: the warm-up's probes are the arbiter's main cost where a level is short
        and steps long (~30 % of auto's time at 32 streams with two or three probes of each mode), but a
        verdict spans a crossover unmeasured. Passed on as a verdict, b2's 'on' at ~0.80 of 'off' put
        b4's first 'on' probe 67 s away, and auto decoded plainly through the whole 4-stream level where
        forced 'on' was ~7 % faster (0.88 of 'on'); a chain of such verdicts lost a sweep four levels.
        One confirming probe costs a level ~0.5-1 % (two cost b16 4.2 s of ~78 at 0.72 of 'on');
        missing a crossover costs the whole gap."""
        for m in MODES:
            if m == b.leader:
                continue
            src = near.stats[m]
            self._decay_evidence(src, now)
            # surely worse as soon as its warm-up there ended early (_far_early): when b8 ends 'off''s
            # warm-up after two pairings at 0.80 and 0.75 of 'on', warming it up again in full costs b16 and
            # b32 4.3 and 4.7 s of ~75 and ~52 in a mode at 0.66-0.72; a suspect costs one probe.
            # Only a load's own pairings pass a loser on: a suspect not yet probed here has one pseudo-
            # pairing, not enough for _far_early, so the next load warms it up in full.
            if not self._far_early(src):
                continue
            dst = b.stats[m]
            dst.seed(src.ratio, now)
            dst.pairings = self.config.warm_loser_pairings - 1  # _far_early needs one own pairing on top
            # The share it reached there, for the probes after the confirming one: with b16 having cut
            # 'off' (0.77 of 'on') to 0.015, a b32 that starts it at 0.03 again spends ~18 % of a 13-s cell
            # on its one probe. No lower than one halving from the base (the confirming probe halves it again), so a
            # load past a crossover still probes the mode within a few of its probe's lengths / base_share.
            dst.share = max(src.share, self.config.base_share / 2)

    def _share(self, m: StepMode, s: ModeStats) -> float:
        """The time share of a mode's probes: high for a fixed mode until it is paired WARM_PAIRINGS times,
        and high again while its mean ratio says it may beat the leader (a contender, raced until the lead
        moves or the mean falls back). Why: at 4 streams on the CPU app 'on' paired at 1.10, 1.02 and 0.93
        of the inherited leader 'off' (the cells gave it ~9 % more), short of the switch; at the base share
        its next probe waited 33 s, and auto ran 41 s of its level in 'off'."""
        c = self.config
        if s.pairings < WARM_PAIRINGS and not self._far_early(s):
            return c.plan_warm_share if m == "plan" else c.warm_share
        if s.ratio is not None and s.ratio > 1.0:
            return c.warm_share
        if m != "plan" and s.ratio is not None \
                and s.ratio + CONTENDER_Z * s.std_error(PROBE_CV) > 1.0:
            # ... and a fixed mode that may still beat it: racing a close mode costs little (its ratio is
            # near 1), leaving it at the base share costs the whole gap when it is the better one. At 4
            # streams 'on' (9 % faster in the forced cells) can pair at 0.99, 0.98 and 0.97 of the inherited
            # 'off' in its warm-up; at the base share it then takes 43 s of auto's ~78 to move the lead.
            # Not the planner (its probes wait for the batch to turn over, ~9 s at 16-32 streams).
            return c.warm_share
        return s.share

    def _window_s(self, b: LoadBucket) -> float:
        """A window's least measured seconds at this load: probe_min_s, or window_lifetimes mean sequence
        lifetimes, whichever is longer (capped at probe_max_s / 2, so a probe can still end)."""
        c = self.config
        lifetimes = c.window_lifetimes * b.lifetime_s if b.lifetime_s is not None else 0.0
        return max(c.probe_min_s, min(lifetimes, c.probe_max_s / 2))

    def _enough(self, w: MeasuredWindow, b: LoadBucket) -> bool:
        return w.steps >= self.config.probe_min_steps and w.seconds >= self._window_s(b)

    def _leader_stale(self, b: LoadBucket, now: float) -> bool:
        """Whether the leader went unmeasured LEADER_STALE_S (its steps so far are then forgotten)."""
        if b.leader_t is None or now - b.leader_t > LEADER_STALE_S:
            b.recent.clear()
            return True
        return False

    def _leader_window(self, b: LoadBucket, now: float) -> MeasuredWindow:
        """The leader's latest measured steps, as few as make a probe's length; none when the leader
        went unmeasured LEADER_STALE_S (the bucket may have run forced traffic meanwhile)."""
        if self._leader_stale(b, now):
            return MeasuredWindow()
        # local sums, the bounds computed once: this walks ~a second of steps (~130 at 2 streams) and
        # ran on every step before the due check moved ahead of it, ~70 us a step, ~1 % of a 7-ms step
        need_s, need_steps = self._window_s(b), self.config.probe_min_steps
        tokens = seconds = 0.0
        steps = stolen = ticks = 0
        for step_tokens, step_s, step_stolen, step_ticks in reversed(b.recent):
            tokens, seconds, steps = tokens + step_tokens, seconds + step_s, steps + 1
            stolen, ticks = stolen + step_stolen, ticks + step_ticks
            if steps >= need_steps and seconds >= need_s:
                break
        return MeasuredWindow(tokens, seconds, steps, stolen, ticks)

    def mode(self, batch_size: int) -> StepMode:
        """The mode this step of a batch of `batch_size` (with adaptive sequences) runs in."""
        now = self._clock()
        self._step_load = self._load(batch_size, now)
        b = self._bucket(self._step_load, now)
        p = b.probe
        if p is not None and p.running:
            # as many *measured* steps and seconds as the leader's windows (settling steps, and 'plan'
            # steps of a batch not yet turned over, come on top); capped, so that a probe still ends
            if not self._enough(p.during, b) and p.phase_s < self.config.probe_max_s:
                return p.mode
            if not self._enough(p.during, b):
                self._drop_probe(b)
                return b.leader
            p.running, p.phase_s = False, 0.0  # now the leader's window after it
        if b.probe is not None and b.probe.phase_s >= self.config.probe_max_s:
            self._drop_probe(b)  # the leader's window after it never filled (the batch did not turn over)
        if b.probe is not None:
            return b.leader
        if self._leader_stale(b, now):  # the leader first: a probe is only worth its pairing
            return b.leader
        others = [m for m in MODES if m != b.leader]
        # never probed: due now (a mode whose probe was dropped waits its share, see _drop_probe)
        unpaired = [m for m in others if b.stats[m].ratio is None and b.stats[m].probe_s == 0]
        due = unpaired or [m for m in others if b.stats[m].due(self._share(m, b.stats[m]))]
        if not due:
            return b.leader
        before = self._leader_window(b, now)  # after the due check: it is the costly part of a step's choice
        if not self._enough(before, b):
            return b.leader
        mode = max(due, key=lambda m: b.stats[m].waited_s * self._share(m, b.stats[m]))  # the longest-waiting first
        b.probe = ModeProbe(mode, before, last_t=now)
        b.stats[mode].probe_s = 0.0
        b.probes += 1
        return mode

    def _drop_probe(self, b: LoadBucket) -> None:
        """A probe that filled no window: unpaired, and its mode waits its share of the time it took."""
        b.stats[b.probe.mode].waited_s = 0.0
        b.probe = None

    def _pure(self, mode: StepMode, seq_ids: Sequence[str] | None) -> bool:
        """Whether this step (already recorded in _seq_modes) measures `mode`: a history-dependent
        mode only on a batch every sequence of which has run in it alone. No ids: taken as pure."""
        if mode not in HISTORY_DEPENDENT or seq_ids is None:
            return True
        return all(self._seq_modes[s] == {mode} for s in seq_ids)

    def _track(self, mode: StepMode, seq_ids: Sequence[str] | None) -> None:
        """The batch's sequences have now stepped in `mode`; those not in it have finished."""
        if seq_ids is not None:
            self._seq_modes = {s: self._seq_modes.get(s, frozenset()) | {mode} for s in seq_ids}

    def _record_lifetimes(self, b: LoadBucket, seq_ids: Sequence[str] | None, seconds: float, now: float) -> None:
        """Sequences of the last step missing from this one have left: their time in the batch (from the
        start of their first observed step to the end of their last) joins this load's mean lifetime."""
        if seq_ids is None:
            return
        ids, start = set(seq_ids), now - max(seconds, 0.0)  # this step began at `start`
        # across a lull the engine emptied (in the benchmark: a cell's streams closed) the departed
        # were mostly cancelled mid-way, not finished: forgotten, not counted
        finished = self._last_end is not None and start - self._last_end <= self.LULL_S
        for s in [s for s in self._born if s not in ids]:
            born = self._born.pop(s)
            if finished:
                life = max(self._last_end - born, 0.0)
                b.lifetime_s = life if b.lifetime_s is None else b.lifetime_s + 0.1 * (life - b.lifetime_s)
        for s in seq_ids:
            self._born.setdefault(s, start)
        self._last_end = now

    def _decay_evidence(self, s: ModeStats, now: float) -> None:
        f = 0.5 ** (max(now - s.evidence_t, 0.0) / EVIDENCE_HALF_LIFE_S)
        s.n, s.r_sum, s.r_sq_sum, s.n_sq, s.evidence_t = s.n * f, s.r_sum * f, s.r_sq_sum * f, s.n_sq * f * f, now

    def _pair(self, b: LoadBucket, mode: StepMode, during: MeasuredWindow, leader_goodput: float, now: float) -> None:
        """Evidence for `mode` against the leader, then its judgement: the mode takes the lead when
        clearly above it; a mode clearly worse is probed half as much, one close or better at the base share."""
        s, c = b.stats[mode], self.config
        if leader_goodput <= 0 or during.seconds <= 0:
            return
        self._decay_evidence(s, now)
        r = during.goodput / leader_goodput
        s.n, s.n_sq, s.r_sum, s.r_sq_sum = s.n + 1.0, s.n_sq + 1.0, s.r_sum + r, s.r_sq_sum + r * r
        s.waited_s, s.pairings = 0.0, s.pairings + 1
        se = s.std_error(PROBE_CV)
        # one probe is noisy (a 0.25-s probe at one stream spread ~20 %): a share is cut, and the lead
        # moves, only on the mean of the probes and its standard error
        s.share = max(s.share / 2, c.min_share) if s.ratio + FAR_Z * se < FAR_RATIO else c.base_share
        z = c.plan_switch_z if mode == "plan" else SWITCH_Z
        if s.pairings >= WARM_PAIRINGS and s.ratio - z * se > SWITCH_RATIO:
            self._switch(b, mode, now)

    def _switch(self, b: LoadBucket, new: StepMode, now: float) -> None:
        """`new` leads: every ratio is re-expressed against it (r_x / r_new), the old leader's is 1 / r_new."""
        old, n = b.stats[b.leader], b.stats[new]
        for s in b.stats.values():
            self._decay_evidence(s, now)
        r, var = n.ratio, n.variance(PROBE_CV)
        for m in MODES:
            if m not in (b.leader, new):
                x = b.stats[m]
                x.r_sum, x.r_sq_sum = x.r_sum / r, x.r_sq_sum / (r * r)
        # the same evidence read the other way round: mean 1/r, spread var/r^4 (to first order)
        old.n, old.n_sq = n.n, n.n_sq
        old.r_sum, old.r_sq_sum = n.n / r, n.n * (1.0 / (r * r) + var / r ** 4)
        old.waited_s, old.share = 0.0, self.config.base_share
        old.pairings = max(old.pairings, n.pairings)  # the same evidence: no warm-up of the old leader
        old.probe_s = max(old.probe_s, self.config.probe_min_s)
        n.n = n.n_sq = n.r_sum = n.r_sq_sum = 0.0
        b.leader, b.probe = new, None
        b.recent.clear()  # the new leader's figure is measured from now on

    def observe(self, batch_size: int, mode: StepMode, tokens: int, seconds: float, *, chosen: bool = True,
                seq_ids: Sequence[str] | None = None) -> None:
        """One finished step in `mode`: the batch's output `tokens` over its wall `seconds`, as
        app/policy/step_wall.py counts them (newcomers' prefill and the turnaround before it included).
        `chosen`: the mode came from `mode()`; False: a batch forced all one way, shown in that mode's
        goodput but never paired.
        `seq_ids`: the batch's sequences, whose history decides whether a 'plan' step is measured
        (None: every step is)."""
        now, c = self._clock(), self.config
        stolen, ticks = self._steal_meter() if self._steal_meter is not None else (0, 0)
        self._track(mode, seq_ids)
        # the bucket mode() chose in (a chosen step), else the load now; then this step joins the window
        load = self._step_load if chosen and self._step_load is not None else self._load(batch_size, now)
        self._step_load = None
        self._remember(batch_size, now)
        b = self._bucket(load, now)
        self._record_lifetimes(b, seq_ids, seconds, now)
        b.steps_by_mode[mode] += 1
        if chosen:
            b.chosen_s[mode] += max(seconds, 0.0)
        s, p = b.stats[mode], b.probe
        in_probe = chosen and p is not None and p.running and mode == p.mode
        if in_probe:
            s.probe_s += max(seconds, 0.0)
        if chosen and p is not None and (in_probe or (not p.running and mode == b.leader)):
            p.phase_s += max(seconds, 0.0)
            p.last_t = now
        if mode != self._last_mode:
            b.settle_left = c.settle_steps
        self._last_mode = mode
        if b.settle_left > 0:
            b.settle_left -= 1
            if chosen and p is not None and not p.running and mode == b.leader and p.mode != mode:
                # the leader's settling after a probe pays the switch back (at 32 streams the draft's
                # catch-up of every token the batch decoded plainly in an 'off' probe): the probe's cost,
                # so the next probe of that mode waits for it too
                b.stats[p.mode].probe_s += max(seconds, 0.0)
            return
        if seconds <= 0 or not self._pure(mode, seq_ids):
            return
        s.steps += 1
        s.tokens, s.seconds = s.tokens * self._lambda + tokens, s.seconds * self._lambda + seconds
        if in_probe:
            p.during.add(tokens, seconds, stolen, ticks)
        elif mode == b.leader and chosen:  # exploiting (forced steps are shown, never windows of a pairing)
            b.recent.append((tokens, seconds, stolen, ticks))
            b.leader_t = now
            for m in MODES:  # the other modes wait longer since their last measurement
                if m != mode:
                    b.stats[m].waited_s += seconds
            if p is not None and not p.running:
                p.after.add(tokens, seconds, stolen, ticks)
                if self._enough(p.after, b):
                    b.probe = None
                    if self._steal_moved(p):
                        b.steal_dropped += 1
                        b.stats[p.mode].waited_s = 0.0  # as a dropped probe: it waits its share
                        return
                    b.pairs.append((p.mode, round(p.during.goodput, 1), round(p.before.goodput, 1),
                                    round(p.after.goodput, 1), p.during.steps))
                    self._pair(b, p.mode, p.during, (p.before.goodput + p.after.goodput) / 2, now)
                    if p.mode != b.leader:
                        # the leader's window after the probe is leader time since it: it counts
                        # towards the next probe's wait (a warm-up at share 1 then alternates probe and
                        # leader windows, and three pairings take ~6 s at one stream, not ~12)
                        b.stats[p.mode].waited_s = p.after.seconds

    def _steal_moved(self, p: ModeProbe) -> bool:
        """Whether the host's steal share during the probe was more than MAX_STEAL_GAP away from the mean of
        the leader's windows around it (False where any of the three has no reading)."""
        during, before, after = p.during.steal, p.before.steal, p.after.steal
        if during is None or before is None or after is None:
            return False
        return abs(during - (before + after) / 2) > MAX_STEAL_GAP

    def snapshot(self) -> dict[str, dict]:
        """Per load bucket (the largest batch of the last load_window_s): the leader, each mode's
        measured goodput (tok/s) and paired ratio to the leader, measured steps and probe shares."""
        return {
            f"b{key}": {
                "leader": b.leader,
                "goodput": {m: round(b.stats[m].goodput, 1) for m in MODES},
                "ratio": {m: 1.0 if m == b.leader else (round(r, 3) if (r := b.stats[m].ratio) is not None else None)
                          for m in MODES},
                "measured_steps": {m: b.stats[m].steps for m in MODES},
                "pairings": {m: b.stats[m].pairings for m in MODES},
                "steps": dict(b.steps_by_mode),
                "probe_share": {m: round(b.stats[m].share, 4) for m in MODES},
                "probes": b.probes,
                "steal_dropped": b.steal_dropped,
                "chosen_s": {m: round(v, 1) for m, v in b.chosen_s.items()},  # wall s of the arbiter's own steps
                "window_s": round(self._window_s(b), 2),  # a window's least measured seconds here
                "last_pairs": [list(p) for p in b.pairs],  # probes: (mode, its goodput, the leader's before, after, steps)
            }
            for key, b in sorted(self._buckets.items())
        }
