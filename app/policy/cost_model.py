"""Cost model of speculative decoding: expected tokens per step, step times, speedup, best k.

Everything here is pure arithmetic on numbers the engine measures; no Ray, no torch.

Step times are kept as piecewise-linear curves over *tokens in the forward pass*, because that
is what the GPU (or CPU) actually pays for: a plain decode step at batch b processes b tokens, a
verify step at batch b with k drafts each processes b·(k+1). Putting both on one curve lets
measurements of either inform the other, and makes the load effect fall out naturally: at small
token counts a pass is bound by reading the weights (flat), past a knee it is compute-bound
(linear), and that is exactly where speculation stops paying.

The *defaults* model such a memory-bound regime, t(n) = t0 · max(1, n / n_knee), with the draft's
step ~0.25 of the target's. They are only a prior: the live engine overwrites them through the
`observe_*` methods with its own measurements (first measurement at a point replaces the prior,
later ones are exponentially decaying averages).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field

from app.engine.acceptance import expected_tokens_per_step  # noqa: F401  (re-exported by app.policy)

if TYPE_CHECKING:  # app.proposers imports app.config, which imports this package
    from app.proposers.base import FirstPass

# Token counts where CostCurve.points() reports the curve between measurements (logs, the router's
# policy_state): powers of two plus midpoints.
DEFAULT_GRID: tuple[int, ...] = tuple(
    sorted({1, 2, 3} | {2**e for e in range(2, 15)} | {3 * 2**e for e in range(1, 14)})
)


class _Ema:
    """A decaying average whose first observation replaces the prior.

    The step is max(decay, 1/(n+1)): a running mean for the first few samples (so one noisy
    sample is not weighted like a hundred), then an exponential average that follows drift.

    Once warmed up, one observation counts at most OUTLIER times the mean (a winsorised average).
    Why: on a shared host a step the OS held up for tens of milliseconds is not what a step of that
    shape costs. Measured on the 2-core CPU app at 1 stream without it, the planner's plain step
    swung between 6.1 and 8.5 ms across its depth reports, and the planner drafted in bursts exactly
    while the plain step looked dear. A real rise is still followed: at
    up to (OUTLIER - 1) * decay per observation, a doubling within ~7 observations at decay 0.1.
    """

    __slots__ = ("value", "count", "decay")
    OUTLIER = 2.0
    WARM = 3  # observations before the clip applies

    def __init__(self, value: float, decay: float) -> None:
        self.value, self.count, self.decay = value, 0, decay

    def observe(self, x: float) -> None:
        self.count += 1
        if self.count > self.WARM and self.value > 0:
            x = min(x, self.OUTLIER * self.value)
        self.value += max(self.decay, 1.0 / self.count) * (x - self.value)


class CostCurve:
    """Seconds of one forward pass as a function of tokens in the pass.

    Each measurement is kept where it was taken: one decaying average per token count (exact up
    to EXACT_TOKENS, then one per ~3% bucket). A query reads a weighted isotonic fit of those
    averages — a pass over more tokens never takes less time; noisy measurements that say
    otherwise would make verify look cheaper than decode and bias the policy toward speculating —
    and interpolates linearly between measured counts.
    Outside the measured range the default shape is scaled by the measured/default ratio of the
    nearest measurement: one measurement at batch 1 that is 3x the prior rescales the whole curve.
    Past the widest measured pass, where the measurements may already climb faster than the
    prior's shape (on a CPU the time grows from the first token; the prior is flat up to its
    knee), the measured slope is continued when that is higher, so a wider pass never looks as
    cheap as the widest one measured.

    Why not values on a fixed grid updated by interpolation weights (normalised LMS, this class
    before 2026-11-27): an observation between two grid points moves both, and with observations
    crowded near one end the far end absorbs errors it was never measured at. Fed step times all
    at or above an emulated accelerator's curve, one in ten simulated runs ended with a grid point
    15-60% below every measurement near it (32 tokens at 0.15 s, where every pass took >= 0.29 s),
    and the router then saw speculating at the full batch as free (tests/serve/test_policy_flip.py
    failed in CI that way; tests/unit/test_policy_cost_model.py replays such runs).
    """

    EXACT_TOKENS = 128  # token counts kept exactly up to here; wider passes share ~3% buckets
    BUCKETS_PER_OCTAVE = 24

    def __init__(self, base_s: float, knee_tokens: float, decay: float = 0.1, grid: Sequence[int] = DEFAULT_GRID) -> None:
        self._base, self._knee, self._decay = base_s, knee_tokens, decay
        self._grid = tuple(grid)  # where points() reports the curve between measurements
        self._measured: dict[int, _Ema] = {}  # token count (bucket) -> its decaying mean seconds
        self._fit: tuple[list[float], list[float]] | None = None  # (tokens, monotone seconds), ascending

    def _default(self, tokens: float) -> float:
        return self._base * max(1.0, tokens / self._knee)

    @classmethod
    def _bucket(cls, tokens: float) -> int:
        n = max(1, round(tokens))
        if n <= cls.EXACT_TOKENS:
            return n
        step = round(math.log2(n) * cls.BUCKETS_PER_OCTAVE)
        return round(2 ** (step / cls.BUCKETS_PER_OCTAVE))

    def _fitted(self) -> tuple[list[float], list[float]]:
        """Weighted pool-adjacent-violators over the measured means, ascending in tokens. A bucket
        weighs as many samples as its average holds (at most 1/decay, the EMA's memory)."""
        if self._fit is None:
            blocks: list[list[float]] = []  # [mean seconds, weight, points pooled]
            keys = sorted(self._measured)
            for key in keys:
                ema = self._measured[key]
                blocks.append([ema.value, float(min(ema.count, 1.0 / self._decay)), 1])
                while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
                    (v1, w1, n1), (v2, w2, n2) = blocks.pop(-2), blocks.pop()
                    blocks.append([(v1 * w1 + v2 * w2) / (w1 + w2), w1 + w2, n1 + n2])
            values = [v for v, _, n in blocks for _ in range(int(n))]
            self._fit = ([float(k) for k in keys], values)
        return self._fit

    def __call__(self, tokens: float) -> float:
        n = max(float(tokens), 1.0)
        ts, vs = self._fitted()
        if not ts:
            return self._default(n)
        if n <= ts[0]:
            return min(vs[0], self._default(n) * vs[0] / self._default(ts[0]))
        if n >= ts[-1]:
            scaled = self._default(n) * vs[-1] / self._default(ts[-1])
            if len(ts) < 2:
                return scaled
            # continue the measured slope, from the widest point back to one with at most half its
            # tokens: a baseline wide enough not to amplify noise
            j = next((i for i in range(len(ts) - 2, -1, -1) if ts[i] <= ts[-1] / 2), 0)
            slope = (vs[-1] - vs[j]) / (ts[-1] - ts[j])  # >= 0: the fit is monotone
            return max(scaled, vs[-1] + slope * (n - ts[-1]))
        i = bisect.bisect_right(ts, n)  # ts[i-1] <= n < ts[i]
        w = (n - ts[i - 1]) / (ts[i] - ts[i - 1])
        return vs[i - 1] + w * (vs[i] - vs[i - 1])

    def observe(self, tokens: float, seconds: float) -> None:
        if tokens <= 0 or not math.isfinite(seconds) or seconds <= 0:
            return
        key = self._bucket(tokens)
        ema = self._measured.get(key)
        if ema is None:
            ema = self._measured[key] = _Ema(seconds, self._decay)
        ema.observe(seconds)  # the first observation replaces the prior (step 1/1)
        self._fit = None

    def points(self) -> list[tuple[int, float, bool]]:
        """(tokens, seconds, measured?): every measured count plus the grid between, for logs."""
        ts, vs = self._fitted()
        measured = {int(t): v for t, v in zip(ts, vs)}
        out = [(t, v, True) for t, v in measured.items()]
        out += [(g, self(g), False) for g in self._grid if g not in measured]
        return sorted(out)


class StepCostsConfig(BaseModel):
    """Priors of the step-time model (seconds). Only the shape matters once measurements arrive."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    target_step_s: float = Field(0.020, gt=0, description="target forward at 1 token (weight-read bound)")
    knee_tokens: float = Field(64.0, gt=0, description="tokens per pass where the target turns compute-bound")
    draft_ratio: float = Field(0.25, gt=0, description="draft step time / target step time")
    exchange_s: float = Field(0.001, ge=0, description="one batched draft<->target exchange per step")
    overhead_s: float = Field(
        0.0, ge=0,
        description="per engine step outside the forwards (host work), paid by every step; the prior of both the plain "
                    "and the speculative step's measured overhead")
    chunk_s: float = Field(
        0.0, ge=0,
        description="wall time each streamed chunk (one per sequence per step) adds to the engine step: the part "
                    "of streaming it that contends with the engine thread (the replica's own streaming) when "
                    "they share the model's CPU cores (configs/local.yaml); 0 where they run elsewhere (GPU hosts)")
    chunk_beside_s: float = Field(
        0.0, ge=0,
        description="seconds each streamed chunk keeps the processes beside the engine busy (router, proxy) on the "
                    "core the engine leaves free: a step lasts at least batch * chunk_beside_s, so this binds only "
                    "where the batch's chunks outlast the step (step_plan.py); 0 where they run elsewhere")


# Weight of a new step-time measurement once a point has warmed up (every curve, the exchange, the
# host time, the draft's prefill rate): ~10 steps of memory follow a change in load within a
# fraction of a second, while one noisy step moves a price by a tenth of its error.
MEASUREMENT_DECAY = 0.1


class StepCosts:
    """Measured step times: t_decode(b), t_verify(b, k), t_draft(b), t_exchange, t_draft_prefill(P).

    Each price is what its own kind of pass last measured; the kinds are measured at different
    moments (at 1 stream on the CPU app the plain step ~140 times a second, the drafting parts only
    when it drafts), so a slowdown seen by one kind reaches the other only when it is measured.
    """

    def __init__(self, config: StepCostsConfig | None = None) -> None:
        c = config or StepCostsConfig()
        self.config = c
        decay = MEASUREMENT_DECAY
        # the draft's prior has the target's shape (same knee), scaled by draft_ratio
        self.target = CostCurve(c.target_step_s, c.knee_tokens, decay)
        self.draft = CostCurve(c.target_step_s * c.draft_ratio, c.knee_tokens, decay)
        self._exchange = _Ema(c.exchange_s, decay)
        # host time outside the forwards, measured apart for plain and speculative steps: a drafting
        # step verifies, rolls back and books more tokens, and one average of both, fed mostly by
        # whichever kind the traffic ran lately, prices the other kind wrong
        self._overhead = {False: _Ema(c.overhead_s, decay), True: _Ema(c.overhead_s, decay)}
        # the draft's prefill rate before it is measured: its prior curve's slope past the knee
        self._prefill_per_token = _Ema(c.target_step_s * c.draft_ratio / c.knee_tokens, decay)

    # -- queries ---------------------------------------------------------------------------------
    def t_pass(self, tokens: int) -> float:
        """One target forward over `tokens` tokens (a mixed batch of decodes and verifies)."""
        return self.target(max(tokens, 1))

    def t_decode(self, b: int) -> float:
        return self.t_pass(max(b, 1))

    def t_verify(self, b: int, k: int) -> float:
        return self.t_pass(max(b, 1) * (max(k, 0) + 1))

    def t_draft(self, b: int) -> float:
        return self.draft(max(b, 1))

    @property
    def t_exchange(self) -> float:
        return self._exchange.value

    def target_points(self) -> list[tuple[int, float, bool]]:
        """The target curve, for logs and policy_state."""
        return self.target.points()

    def draft_points(self) -> list[tuple[int, float, bool]]:
        return self.draft.points()

    def t_emit(self, b: int) -> float:
        """Host time that streaming one chunk per sequence of a b-sequence step adds to it (configured)."""
        return max(b, 0) * self.config.chunk_s

    def t_emit_beside(self, b: int) -> float:
        """The shortest a b-sequence step can be while the router and proxy forward its chunks beside
        it (configured): a step takes max(its own time, this)."""
        return max(b, 0) * self.config.chunk_beside_s

    def t_overhead(self, speculative: bool) -> float:
        """Host time of an engine step outside the forwards, for a plain step or one where some
        sequence drafts: a fixed cost per step, so it favours steps that emit more tokens. Until
        one kind has been measured it is priced as the other (a measurement beats the prior)."""
        own, other = self._overhead[speculative], self._overhead[not speculative]
        return own.value if own.count or not other.count else other.value

    def t_draft_prefill(self, prompt_tokens: int) -> float:
        return max(prompt_tokens, 0) * self._prefill_per_token.value

    # -- live measurements -----------------------------------------------------------------------
    def _observe_pass(self, curve: CostCurve, tokens: float, seconds: float) -> None:
        """A forward pass (CostCurve.observe ignores empty and non-finite ones)."""
        curve.observe(tokens, seconds)

    def observe_target(self, tokens: int, seconds: float) -> None:
        """Any target forward (a mixed batch of decodes and verifies counts its total tokens)."""
        self._observe_pass(self.target, tokens, seconds)

    def observe_decode(self, b: int, seconds: float) -> None:
        self._observe_pass(self.target, b, seconds)

    def observe_verify(self, b: int, k: int, seconds: float) -> None:
        self._observe_pass(self.target, b * (k + 1), seconds)

    def observe_draft(self, b: int, seconds: float) -> None:
        self._observe_pass(self.draft, b, seconds)

    def observe_exchange(self, seconds: float) -> None:
        if seconds >= 0 and math.isfinite(seconds):
            self._exchange.observe(seconds)

    def observe_overhead(self, seconds: float, speculative: bool) -> None:
        """One engine step's host time outside the forwards; `speculative`: some sequence drafted."""
        if seconds >= 0 and math.isfinite(seconds):
            self._overhead[speculative].observe(seconds)

    def observe_draft_call(self, batch: int, depth: int, compute_s: float, first: FirstPass) -> float | None:
        """One draft call: `depth` batched steps for `batch` sequences in `compute_s`. When its
        first pass caught sequences up (fed them the tokens of steps they did not draft, e.g. on
        the first drafting step after plain ones), that pass was a prefill: it feeds the prefill
        rate, and the per-step cost comes from the remaining steps only (none when depth is 1).
        Counting it as drafting made the first drafting steps after a plain stretch look ~10x
        dearer than they are, which kept a fresh replica from drafting. Returns the per-step time
        observed, or None."""
        if batch <= 0 or depth <= 0:
            return None
        if first.caught_up:
            self.observe_draft_prefill(first.tokens, first.seconds)
            if depth == 1:
                return None
            per_step = max(compute_s - first.seconds, 0.0) / (depth - 1)
        else:
            per_step = compute_s / depth
        self.observe_draft(batch, per_step)
        return per_step

    def observe_draft_prefill(self, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds >= 0 and math.isfinite(seconds):
            self._prefill_per_token.observe(seconds / tokens)


def speedup(
    alpha: float,
    k: int,
    b: int,
    costs: StepCosts,
    *,
    per_position: Sequence[float] | None = None,
    prompt_tokens: int = 0,
    output_tokens: int | None = None,
    draft_batch: int | None = None,
) -> float:
    """Goodput of speculating with depth k over plain decoding, for one sequence in a batch of b.

    plain: max(t_decode(b) + t_overhead(plain) + t_emit(b), t_emit_beside(b)) per token. speculative:
    max(k·t_draft + t_verify(b, k) + t_exchange + t_overhead(spec) + t_emit(b), t_emit_beside(b)) / E(k) per token, plus the draft's prefill t_p(P) amortised over the L output tokens. The
    served engine drafts, exchanges and verifies one after another, so every part is paid.
    `draft_batch`: sequences in the draft's batch when it serves several targets (default b).
    """
    if k <= 0:
        return 1.0
    beside = costs.t_emit_beside(b)  # the router's and proxy's share runs beside the step
    plain = max(costs.t_decode(b) + costs.t_overhead(False) + costs.t_emit(b), beside)
    verify = costs.t_verify(b, k)
    side = k * costs.t_draft(draft_batch if draft_batch is not None else b) + costs.t_exchange
    step = max(verify + side + costs.t_overhead(True) + costs.t_emit(b), beside)
    per_token = step / expected_tokens_per_step(alpha, k, per_position)
    if prompt_tokens > 0 and output_tokens:
        per_token += costs.t_draft_prefill(prompt_tokens) / output_tokens
    return plain / per_token if per_token > 0 else 1.0


def breakeven_alpha(costs: StepCosts, k: int, *, b: int = 1, margin: float = 1.0) -> float:
    """The lowest per-token acceptance at which drafting k tokens beats plain decoding by `margin` for
    a sequence in a batch of b (math.inf: not even at acceptance 1). Bisection: speedup grows with
    acceptance (more tokens per step at the same cost)."""
    if k <= 0 or speedup(1.0, k, b, costs) < margin:
        return math.inf
    lo, hi = 0.0, 1.0
    for _ in range(12):  # to 1/4096: far finer than any acceptance estimate
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if speedup(mid, k, b, costs) >= margin else (mid, hi)
    return hi


def best_spec_k(alpha: float, b: int, costs: StepCosts, max_k: int, **kw: object) -> tuple[int, float]:
    """The k in 1..max_k with the highest speedup, whatever it is (ties go to the smaller k)."""
    best, best_s = 1, -math.inf
    for k in range(1, max(max_k, 1) + 1):
        s = speedup(alpha, k, b, costs, **kw)  # type: ignore[arg-type]
        if s > best_s + 1e-12:
            best, best_s = k, s
    return best, best_s


def best_k(
    alpha: float,
    b: int,
    costs: StepCosts,
    max_k: int,
    *,
    margin: float = 1.0,
    per_position: Sequence[float] | None = None,
    prompt_tokens: int = 0,
    output_tokens: int | None = None,
    draft_batch: int | None = None,
) -> tuple[int, float]:
    """(k, speedup) maximising the ratio; (0, 1.0) when no k beats plain by more than `margin`.

    The margin absorbs model error: a predicted 2% gain is within the noise of the step-time
    estimates, and a wrong 'on' at high load costs far more than a missed 2%.
    """
    if max_k <= 0:
        return 0, 1.0
    k, s = best_spec_k(
        alpha, b, costs, max_k, per_position=per_position,
        prompt_tokens=prompt_tokens, output_tokens=output_tokens, draft_batch=draft_batch,
    )
    return (k, s) if s > margin else (0, 1.0)
