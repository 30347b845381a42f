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

if TYPE_CHECKING:  # app.proposers imports app.config, which imports this package
    from app.proposers.base import FirstPass

# Token counts where the curves keep a point: powers of two plus midpoints, so the knee region is
# resolved to within ~1.5x in tokens while the table stays ~30 entries.
DEFAULT_GRID: tuple[int, ...] = tuple(
    sorted({1, 2, 3} | {2**e for e in range(2, 15)} | {3 * 2**e for e in range(1, 14)})
)


def expected_tokens_per_step(alpha: float, k: int, per_position: Sequence[float] | None = None) -> float:
    """Tokens the target emits per verify pass: E(k) = (1 - α^(k+1)) / (1 - α).

    With `per_position` (P(accept at position i | all before accepted), i = 0..), E = 1 +
    Σ_i Π_{j<=i} a_j; positions beyond the list fall back to `alpha`. The sum form is used for
    both because it is exact at α → 1 (E = k + 1) where the closed form divides 0 by 0.
    """
    if k <= 0:
        return 1.0
    a = min(max(alpha, 0.0), 1.0)
    total, survive = 1.0, 1.0  # the +1 is the target's own bonus/correction token
    for i in range(k):
        p = per_position[i] if per_position is not None and i < len(per_position) else a
        survive *= min(max(p, 0.0), 1.0)
        total += survive
    return total


class _Ema:
    """A decaying average whose first observation replaces the prior.

    The step is max(decay, 1/(n+1)): a running mean for the first few samples (so one noisy
    sample is not weighted like a hundred), then an exponential average that follows drift.
    """

    __slots__ = ("value", "count", "decay")

    def __init__(self, value: float, decay: float) -> None:
        self.value, self.count, self.decay = value, 0, decay

    def observe(self, x: float) -> None:
        self.count += 1
        self.value += max(self.decay, 1.0 / self.count) * (x - self.value)


class CostCurve:
    """Seconds of one forward pass as a function of tokens in the pass.

    A fixed grid of token counts holds values; queries interpolate linearly between grid points
    and extrapolate linearly past the last one. An observation between two grid points updates
    both in proportion to their interpolation weights (normalised LMS), so the curve reproduces
    the measurement at that token count without snapping it to a grid point.
    Grid points never measured follow the default shape scaled by the measured/default ratio of
    their measured neighbours: one measurement at batch 1 that is 3x the prior rescales the whole
    curve instead of leaving a cliff between measured and unmeasured points. Past the widest
    measured point, where the measurements already climb faster than the prior's shape (on a CPU
    the time grows from the first token; the prior is flat up to its knee), the measured slope is
    continued instead, so a wider pass never looks as cheap as the widest one measured.
    """

    def __init__(self, base_s: float, knee_tokens: float, decay: float = 0.1, grid: Sequence[int] = DEFAULT_GRID) -> None:
        self._grid = tuple(grid)
        self._log_grid = [math.log(g) for g in self._grid]
        self._default = [base_s * max(1.0, g / knee_tokens) for g in self._grid]
        self._value = list(self._default)
        self._weight = [0.0] * len(self._grid)  # how much measurement each point has absorbed
        self._decay = decay
        self._filled: list[float] | None = None
        self._monotone: list[float] | None = None

    def _fill(self) -> list[float]:
        """Measured points as they are, unmeasured ones from the shape and their neighbours' ratio."""
        if self._filled is not None:
            return self._filled
        seen = [i for i, w in enumerate(self._weight) if w > 0]
        out = []
        for i, d in enumerate(self._default):
            if self._weight[i] > 0:
                out.append(self._value[i])
                continue
            j = bisect.bisect_left(seen, i)
            left, right = (seen[j - 1] if j > 0 else None), (seen[j] if j < len(seen) else None)
            ratio = 1.0
            if left is not None and right is not None:
                r_l, r_r = self._value[left] / self._default[left], self._value[right] / self._default[right]
                f = (self._log_grid[i] - self._log_grid[left]) / (self._log_grid[right] - self._log_grid[left])
                ratio = r_l + f * (r_r - r_l)
            elif left is not None or right is not None:
                n = left if left is not None else right
                ratio = self._value[n] / self._default[n]
            out.append(d * ratio)
        if len(seen) >= 2:
            # Past the widest measured pass the prior's shape alone would keep a flat stretch (below
            # its knee) even where the measurements already climb, so wider passes (verify at high
            # load) would look as cheap as the widest one measured. Continue the measured slope
            # instead — from the widest point back to one with at most half its tokens, a baseline
            # wide enough not to amplify noise — whenever that is the higher estimate.
            last = seen[-1]
            base = next((j for j in reversed(seen[:-1]) if self._grid[j] <= self._grid[last] / 2), seen[0])
            slope = max(0.0, (self._value[last] - self._value[base]) / (self._grid[last] - self._grid[base]))
            for i in range(last + 1, len(out)):
                out[i] = max(out[i], self._value[last] + slope * (self._grid[i] - self._grid[last]))
        self._filled = out
        return out

    def _bracket(self, tokens: float) -> tuple[int, int, float]:
        """Indices (i0, i1) around `tokens` and the weight of i1; clamps below the first point."""
        n = max(float(tokens), float(self._grid[0]))
        i1 = bisect.bisect_left(self._grid, n)
        if i1 == 0:
            return 0, 0, 0.0
        if i1 >= len(self._grid):  # past the table: extrapolate along the last segment
            i1 = len(self._grid) - 1
        i0 = i1 - 1
        return i0, i1, (n - self._grid[i0]) / (self._grid[i1] - self._grid[i0])

    def __call__(self, tokens: float) -> float:
        if self._monotone is None:
            # A pass over more tokens never takes less time; noisy measurements that say otherwise
            # would make verify look cheaper than decode and bias the policy toward speculating.
            self._monotone, top = [], 0.0
            for v in self._fill():
                top = max(top, v)
                self._monotone.append(top)
        i0, i1, w = self._bracket(tokens)
        v = self._monotone
        return max(v[i0] + w * (v[i1] - v[i0]), 0.0)

    def observe(self, tokens: float, seconds: float) -> None:
        if tokens <= 0 or not math.isfinite(seconds) or seconds <= 0:
            return
        i0, i1, w = self._bracket(tokens)
        filled = self._fill()
        phi = {i0: 1.0 - w, i1: w} if i0 != i1 else {i0: 1.0}
        phi = {i: p for i, p in phi.items() if p > 0}
        pred = sum(p * filled[i] for i, p in phi.items())
        norm = sum(p * p for p in phi.values())
        seen = sum(p * self._weight[i] for i, p in phi.items())
        step = max(self._decay, 1.0 / (1.0 + seen))  # first measurement here replaces the prior
        err = seconds - pred
        for i, p in phi.items():
            self._value[i] = max(filled[i] + step * p * err / norm, 1e-9)
            self._weight[i] += p
        self._filled = self._monotone = None

    def points(self) -> list[tuple[int, float, bool]]:
        """(tokens, seconds, measured?) per grid point, for logs and metrics."""
        return [(g, v, w > 0) for g, v, w in zip(self._grid, self._fill(), self._weight)]


class StepCostsConfig(BaseModel):
    """Priors of the step-time model (seconds). Only the shape matters once measurements arrive."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    target_step_s: float = Field(0.020, gt=0, description="target forward at 1 token (weight-read bound)")
    knee_tokens: float = Field(64.0, gt=0, description="tokens per pass where the target turns compute-bound")
    draft_ratio: float = Field(0.25, gt=0, description="draft step time / target step time")
    draft_knee_tokens: float | None = Field(None, gt=0, description="defaults to knee_tokens")
    exchange_s: float = Field(0.001, ge=0, description="one batched draft<->target exchange per step")
    overhead_s: float = Field(0.0, ge=0, description="per engine step outside the forwards (host work), paid by every step")
    chunk_s: float = Field(
        0.0, ge=0,
        description="wall time each streamed chunk (one per sequence per step) costs the model's cores: the router "
                    "and proxy forwarding it when they share the model's CPU cores (configs/local.yaml); 0 where "
                    "they run elsewhere (GPU hosts)")
    draft_prefill_per_token_s: float | None = Field(None, ge=0, description="defaults to the draft curve's slope past its knee")
    decay: float = Field(0.1, gt=0, le=1, description="weight of a new measurement once warmed up")


class StepCosts:
    """Measured step times: t_decode(b), t_verify(b, k), t_draft(b), t_exchange, t_draft_prefill(P)."""

    def __init__(self, config: StepCostsConfig | None = None) -> None:
        c = config or StepCostsConfig()
        self.config = c
        draft_knee = c.draft_knee_tokens or c.knee_tokens
        self.target = CostCurve(c.target_step_s, c.knee_tokens, c.decay)
        self.draft = CostCurve(c.target_step_s * c.draft_ratio, draft_knee, c.decay)
        self._exchange = _Ema(c.exchange_s, c.decay)
        self._overhead = _Ema(c.overhead_s, c.decay)
        per_token = c.draft_prefill_per_token_s
        if per_token is None:
            per_token = c.target_step_s * c.draft_ratio / draft_knee
        self._prefill_per_token = _Ema(per_token, c.decay)

    # -- queries ---------------------------------------------------------------------------------
    def t_decode(self, b: int) -> float:
        return self.target(max(b, 1))

    def t_verify(self, b: int, k: int) -> float:
        return self.target(max(b, 1) * (max(k, 0) + 1))

    def t_draft(self, b: int) -> float:
        return self.draft(max(b, 1))

    @property
    def t_exchange(self) -> float:
        return self._exchange.value

    def t_emit(self, b: int) -> float:
        """Host time of streaming one chunk per sequence of a b-sequence step (configured)."""
        return max(b, 0) * self.config.chunk_s

    @property
    def t_overhead(self) -> float:
        """Host time of an engine step outside the forwards: the same for a plain and a
        speculative step, so it favours steps that emit more tokens."""
        return self._overhead.value

    def t_draft_prefill(self, prompt_tokens: int) -> float:
        return max(prompt_tokens, 0) * self._prefill_per_token.value

    # -- live measurements -----------------------------------------------------------------------
    def observe_target(self, tokens: int, seconds: float) -> None:
        """Any target forward (a mixed batch of decodes and verifies counts its total tokens)."""
        self.target.observe(tokens, seconds)

    def observe_decode(self, b: int, seconds: float) -> None:
        self.target.observe(b, seconds)

    def observe_verify(self, b: int, k: int, seconds: float) -> None:
        self.target.observe(b * (k + 1), seconds)

    def observe_draft(self, b: int, seconds: float) -> None:
        self.draft.observe(b, seconds)

    def observe_exchange(self, seconds: float) -> None:
        if seconds >= 0 and math.isfinite(seconds):
            self._exchange.observe(seconds)

    def observe_overhead(self, seconds: float) -> None:
        if seconds >= 0 and math.isfinite(seconds):
            self._overhead.observe(seconds)

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
    overlap: bool = False,
    *,
    per_position: Sequence[float] | None = None,
    prompt_tokens: int = 0,
    output_tokens: int | None = None,
    draft_batch: int | None = None,
) -> float:
    """Goodput of speculating with depth k over plain decoding, for one sequence in a batch of b.

    plain: t_decode(b) + t_overhead + t_emit(b) per token. speculative: (k·t_draft + t_verify(b, k) +
    t_exchange + t_overhead + t_emit(b)) / E(k) per token, plus the draft's prefill t_p(P) amortised over the L output tokens. With overlap the
    draft drafts block t+1 while the target verifies block t, so only the part of draft+exchange
    that outlasts the verify is paid. (That is optimistic when acceptance is low, since a rejected
    block's pre-drafted successor is thrown away; the live step times correct for it.)
    `draft_batch`: sequences in the draft's batch when it serves several targets (default b).
    """
    if k <= 0:
        return 1.0
    plain = costs.t_decode(b) + costs.t_overhead + costs.t_emit(b)
    verify = costs.t_verify(b, k)
    side = k * costs.t_draft(draft_batch if draft_batch is not None else b) + costs.t_exchange
    step = verify + (max(0.0, side - verify) if overlap else side) + costs.t_overhead + costs.t_emit(b)
    per_token = step / expected_tokens_per_step(alpha, k, per_position)
    if prompt_tokens > 0 and output_tokens:
        per_token += costs.t_draft_prefill(prompt_tokens) / output_tokens
    return plain / per_token if per_token > 0 else 1.0


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
    overlap: bool = False,
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
        alpha, b, costs, max_k, overlap=overlap, per_position=per_position,
        prompt_tokens=prompt_tokens, output_tokens=output_tokens, draft_batch=draft_batch,
    )
    return (k, s) if s > margin else (0, 1.0)
