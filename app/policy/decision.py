"""The per-request speculation decision, and how it hands over to the per-step plan.

`SpeculationPolicy.decide` runs on the router for every request; `SpeculationPolicy.plan_step`
runs in the target engine at every step for the whole batch (app/policy/step_plan.py), from the
same cost model with fresher numbers. Both are pure: inputs are snapshots, outputs plain values.

The router's decision is the admission-time judgment (and its reason is what `usage` reports
and the metrics count); `engine_depth` turns it into what the engine may do: a forced 'on'
drafts its k every step, a forced 'off' (or a request that cannot pay: short output, no draft,
stale load) never drafts, and every other 'auto' request is adaptive — the step planner picks
its depth in 0..max_k at each step as acceptance and the batch move.
"""

from __future__ import annotations

import threading
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .cost_model import StepCosts, StepCostsConfig, best_k, best_spec_k, speedup
from .mode_arbiter_config import ModeArbiterConfig
from .step_plan import StepCandidate, StepPlan, plan_step, plan_step_optimistic
from .trackers import AcceptanceTracker, LengthPredictor

Reason = Literal[
    "forced_on",  # request said speculation: "on" or gave num_speculative_tokens
    "forced_off",  # request said speculation: "off" (or num_speculative_tokens 0)
    "low_load_long_output",  # the cost model says speculating pays
    "high_load",  # it would pay at batch 1; the current batch makes verify compute-bound
    "short_output",  # too few expected output tokens to be worth it
    "low_acceptance",  # even at batch 1 the class's acceptance does not pay for the draft
    "prefill_cost",  # would pay per step, but the draft's prompt prefill is not amortised over L
    "no_draft",  # no draft replica answers
    "stale_load",  # load figures too old to trust; plain is the safe side
]

# Off decisions the step planner may still turn on (or explore) as load and acceptance move.
_ADAPTIVE_OFF: frozenset[str] = frozenset({"high_load", "low_acceptance", "prefill_cost"})

# Settings no deployment tunes (constants, not PolicyConfig fields):
# below how many expected output tokens a request never drafts ('short_output'): so short a
# request is not worth the draft's prompt prefill and the router's cost-model search
MIN_OUTPUT_TOKENS = 16
# seconds after which a replica's published load (it publishes every second) is too old to decide
# on: the request goes plain ('stale_load'), the safe side
STALE_AFTER_S = 10.0
# drafted tokens of a prompt class over which its acceptance estimate halves its memory: how fast
# the class's acceptance follows a change in its traffic
ACCEPTANCE_HALF_LIFE_TOKENS = 512.0
# the completion-length predictor (trackers.LengthPredictor): finished requests remembered per
# class, the quantile of them that caps max_tokens, and how many it needs before it caps at all
LENGTH_WINDOW = 256
LENGTH_QUANTILE = 0.9
LENGTH_MIN_SAMPLES = 8


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class LoadSnapshot(_Strict):
    """What the router knows about a target replica (and its draft) when a request arrives.

    The optional step times are recent means the replica measured; `policy.ingest(load)` feeds
    them into the cost model once per (replica, seq) so a snapshot reused for many decisions is
    not counted many times.
    """

    running_sequences: int = Field(0, ge=0)
    queue_length: int = Field(0, ge=0)
    max_num_seqs: int = Field(32, ge=1)
    draft_running_sequences: int = Field(0, ge=0, description="sequences in the draft's batch, all targets")
    draft_available: bool = True
    age_s: float = Field(0.0, ge=0, description="seconds since the replica published it")
    replica: str = ""
    seq: int = Field(0, ge=0, description="publication counter of the replica; 0: unnumbered, ingested every time")
    # Per-kind publication counters: a kind's figures are re-published (same counter) until a newer
    # window measures that kind, so a rare measurement (an exploration step's wide pass) is not lost
    # to whichever caller happened to read that one window. 0: fall back to `seq`.
    decode_seq: int = Field(0, ge=0)
    verify_seq: int = Field(0, ge=0)
    draft_seq: int = Field(0, ge=0)
    exchange_seq: int = Field(0, ge=0)
    decode_step_s: float | None = Field(None, gt=0)
    decode_tokens: int | None = Field(None, ge=1, description="tokens in the pass decode_step_s was measured at")
    verify_step_s: float | None = Field(None, gt=0)
    verify_tokens: int | None = Field(None, ge=1)
    draft_step_s: float | None = Field(None, gt=0)
    draft_batch: int | None = Field(None, ge=1)
    exchange_s: float | None = Field(None, ge=0)

    @property
    def batch_after_admission(self) -> int:
        # A batch never exceeds max_num_seqs: beyond it requests wait in the queue, and the step
        # cost is that of a full batch.
        return min(self.running_sequences + self.queue_length + 1, self.max_num_seqs)


class PolicyRequest(_Strict):
    mode: Literal["auto", "on", "off"] = "auto"
    requested_k: int | None = Field(None, ge=0)
    max_tokens: int = Field(..., ge=1)
    prompt_tokens: int = Field(0, ge=0)
    prompt_class: str = "prose"
    has_stop: bool = Field(True, description="can end before max_tokens (EOS not ignored, or stop strings)")


class SpeculationDecision(_Strict):
    speculate: bool
    k: int = Field(..., ge=0)
    reason: Reason
    expected_speedup: float = Field(1.0, description="of the chosen action over plain decoding")
    alpha: float | None = None
    expected_output_tokens: int | None = None
    batch_size: int | None = None

    @model_validator(mode="after")
    def _consistent(self) -> "SpeculationDecision":
        if self.speculate != (self.k > 0):
            raise ValueError(f"speculate={self.speculate} with k={self.k}")
        return self

    def as_dict(self) -> dict[str, Any]:
        """JSON-able form for `usage.speculation` and logs."""
        return self.model_dump(mode="json", exclude_none=True)


class PolicyConfig(_Strict):
    margin: float = Field(
        1.15, ge=1.0, description="predicted speedup needed to speculate. At 2 streams on CPU, where 'off' beats "
        "'on' by ~5 %, auto drafts 30-56 % of steps at a margin of 1.05 and loses 3-4 % to 'off'; at 1.15 it drafts "
        "1-12 % and matches 'off'")
    explore_every_steps: int = Field(
        64, ge=0, description="engine steps without an adaptive draft before one exploration step; 0: never")
    explore_max_every_steps: int | None = Field(
        512, ge=1,
        description="the exploration interval doubles after each exploration that the planner does not follow by "
                    "drafting on its own, up to this many steps, per batch size, and falls back to "
                    "explore_every_steps once the planner has drafted on its own in explore_every_steps steps "
                    "between explorations (step_plan.StepExplorer); None: no back-off. At 1 stream on "
                    "the CPU app, exploring every 64 steps costs auto 4-6 % against 'off', backing off to 512 under "
                    "1 %")
    plain_hold_steps: int = Field(
        8, ge=0,
        description="after a plain plan, the same batch stays plain this many steps without planning "
                    "(step_plan.PlainHold): in the served CPU app planning every step costs auto ~0.7 ms a plain "
                    "step at 1 stream; 0: plan every step")
    max_k: int = Field(8, ge=1, le=64)
    default_k: int = Field(4, ge=1, description="k for speculation 'on' without num_speculative_tokens")
    prior_alpha: float = Field(0.6, ge=0.0, le=1.0)
    sequence_prior_weight: float = Field(
        24.0, gt=0.0,
        description="pseudo-trials of its prompt class's acceptance that a sequence's own estimate starts from "
                    "(app/engine/acceptance.py token_alpha): how far its own steps move it. Measured on the embedded pair "
                    "(bench/draft_agreement.py): per-prompt acceptance spreads like a Beta prior of 23 (code) to 38 "
                    "(prose) pseudo-trials; lighter, a few lucky steps make sequences look far better than their "
                    "class and the planner drafts on noise")
    acceptance_optimism: float = Field(
        1.0, ge=0.0,
        description="standard deviations added to a sequence's own acceptance estimate when the step planner "
                    "decides whether it joins a drafting step (app/engine/acceptance.py token_alpha_upper; its depth comes "
                    "from the mean): keeps an unlucky start from freezing it plain. A step that drafts only on "
                    "optimism stays plain (step_plan.plan_step_optimistic): measured on the CPU app, optimism "
                    "deciding alone makes auto draft at 1 stream and lose 4 % to 'off', none at all makes it draft "
                    "shallower at 8-32 streams and lose 3-5 % to 'on'")
    costs: StepCostsConfig = Field(default_factory=StepCostsConfig, description="priors and host costs of the cost model")
    mode_arbiter: ModeArbiterConfig = Field(
        default_factory=ModeArbiterConfig,
        description="per batch size, run adaptive sequences in the step mode (planner, all 'on' at default_k unless no "
                    "sequence's acceptance pays, all 'off') whose goodput the engine measured best, re-probing "
                    "the others (app/policy/mode_arbiter.py)")

    @model_validator(mode="after")
    def _exploration_interval(self) -> "PolicyConfig":
        if (self.explore_every_steps and self.explore_max_every_steps is not None
                and self.explore_max_every_steps < self.explore_every_steps):
            raise ValueError(f"explore_max_every_steps={self.explore_max_every_steps} < explore_every_steps="
                             f"{self.explore_every_steps}: the exploration interval only grows; set it >= "
                             "explore_every_steps (equal: no back-off)")
        return self


class SpeculationPolicy:
    """Holds the live statistics and the cost model; decides per request and per step."""

    def __init__(
        self,
        config: PolicyConfig | None = None,
        *,
        costs: StepCosts | None = None,
        acceptance: AcceptanceTracker | None = None,
        lengths: LengthPredictor | None = None,
    ) -> None:
        c = config or PolicyConfig()
        self.config = c
        self.costs = costs or StepCosts(c.costs)
        self.acceptance = acceptance or AcceptanceTracker(
            prior_alpha=c.prior_alpha, half_life_tokens=ACCEPTANCE_HALF_LIFE_TOKENS, max_positions=c.max_k
        )
        self.lengths = lengths or LengthPredictor(
            window=LENGTH_WINDOW, quantile=LENGTH_QUANTILE, min_samples=LENGTH_MIN_SAMPLES
        )
        self._seen: dict[tuple[str, str], int] = {}  # (replica, kind) -> last publication ingested
        self._lock = threading.Lock()

    # fields each learned part is built from: a change rebuilds that part (its measurements start over)
    _ACCEPTANCE_FIELDS = ("prior_alpha", "max_k")
    _LIVE_COST_FIELDS = ("chunk_s", "chunk_beside_s")  # read by StepCosts on every query

    def reconfigure(self, config: PolicyConfig) -> list[str]:
        """Apply a new config in place (a deployment's Serve `user_config`). What is read per decision
        or per step (margin, k limits, optimism, costs.chunk_s, ...) takes the new value at once; a
        learned part whose construction settings changed is rebuilt, and the others keep what they
        have learned. Returns the rebuilt parts' names. Not thread-safe against decide/plan_step: the
        caller serializes it with them."""
        old, c = self.config, config
        rebuilt: list[str] = []

        def changed(fields: tuple[str, ...], a: Any = old, b: Any = c) -> bool:
            return any(getattr(a, f) != getattr(b, f) for f in fields)

        if old.costs != c.costs:
            live_only = all(getattr(old.costs, f) == getattr(c.costs, f)
                            for f in type(c.costs).model_fields if f not in self._LIVE_COST_FIELDS)
            if live_only:
                self.costs.config = c.costs
            else:
                self.costs = StepCosts(c.costs)
                rebuilt.append("costs")
        if changed(self._ACCEPTANCE_FIELDS):
            self.acceptance = AcceptanceTracker(self.acceptance.pair, prior_alpha=c.prior_alpha,
                                                half_life_tokens=ACCEPTANCE_HALF_LIFE_TOKENS, max_positions=c.max_k)
            rebuilt.append("acceptance")
        self.config = c
        return rebuilt

    # -- feeding -------------------------------------------------------------------------------
    def ingest(self, load: LoadSnapshot) -> None:
        """Take a replica's measured step times into the cost model, each kind once per publication."""
        fresh = set()
        with self._lock:
            for kind in ("decode", "verify", "draft", "exchange"):
                seq = getattr(load, f"{kind}_seq") or load.seq
                if seq and self._seen.get((load.replica, kind)) == seq:
                    continue
                self._seen[(load.replica, kind)] = seq
                fresh.add(kind)
        if "decode" in fresh and load.decode_step_s is not None and load.decode_tokens is not None:
            self.costs.observe_target(load.decode_tokens, load.decode_step_s)
        if "verify" in fresh and load.verify_step_s is not None and load.verify_tokens is not None:
            self.costs.observe_target(load.verify_tokens, load.verify_step_s)
        if "draft" in fresh and load.draft_step_s is not None and load.draft_batch is not None:
            self.costs.observe_draft(load.draft_batch, load.draft_step_s)
        if "exchange" in fresh and load.exchange_s is not None:
            self.costs.observe_exchange(load.exchange_s)

    def observe_verification(self, prompt_class: str, num_drafted: int, num_accepted: int,
                             accepted_per_position: list[bool] | None = None) -> None:
        self.acceptance.observe(prompt_class, num_drafted, num_accepted, accepted_per_position)

    def observe_finished(self, prompt_class: str, num_output_tokens: int, finished_by: Literal["stop", "length"]) -> None:
        self.lengths.observe(prompt_class, num_output_tokens, finished_by)

    # -- the decision --------------------------------------------------------------------------
    def decide(self, request: PolicyRequest, load: LoadSnapshot) -> SpeculationDecision:
        c = self.config
        b = load.batch_after_admission
        # Overrides always win, before any statistics are consulted.
        if request.mode == "off" or (request.mode == "auto" and request.requested_k == 0):
            return SpeculationDecision(speculate=False, k=0, reason="forced_off", batch_size=b)
        if request.mode == "on" or request.requested_k is not None:
            # 'on' without a k (or with k=0, which cannot mean "speculate") uses default_k.
            k = min(request.requested_k or c.default_k, c.max_k)
            alpha = self.acceptance.alpha(request.prompt_class)
            s = speedup(alpha, k, b, self.costs, draft_batch=self._draft_batch(load, b))
            return SpeculationDecision(speculate=True, k=k, reason="forced_on", expected_speedup=s, alpha=alpha, batch_size=b)

        if load.age_s > STALE_AFTER_S:
            return SpeculationDecision(speculate=False, k=0, reason="stale_load", batch_size=b)
        if not load.draft_available:
            return SpeculationDecision(speculate=False, k=0, reason="no_draft", batch_size=b)

        # A request that cannot stop early runs to max_tokens; otherwise cap by what this class
        # of request has actually produced lately.
        L = self.lengths.expected_length(request.prompt_class, request.max_tokens) if request.has_stop else request.max_tokens
        alpha = self.acceptance.alpha(request.prompt_class)
        common = dict(alpha=alpha, expected_output_tokens=L, batch_size=b)
        if L < MIN_OUTPUT_TOKENS:
            return SpeculationDecision(speculate=False, k=0, reason="short_output", **common)

        max_k = min(c.max_k, L - 1)  # drafting past the end of the output is pure waste
        pos = self.acceptance.per_position(request.prompt_class, max_k)
        kw = dict(per_position=pos)
        k, s = best_k(alpha, b, self.costs, max_k, margin=c.margin, prompt_tokens=request.prompt_tokens,
                      output_tokens=L, draft_batch=self._draft_batch(load, b), **kw)
        if k > 0:
            return SpeculationDecision(speculate=True, k=k, reason="low_load_long_output", expected_speedup=s, **common)

        # Why not: would it have paid on an empty replica (load), or with the prompt prefill free
        # (length), or not at all (acceptance too low for this draft's cost)?
        _, s_idle = best_spec_k(alpha, 1, self.costs, max_k, prompt_tokens=request.prompt_tokens, output_tokens=L, **kw)
        _, s_free = best_spec_k(alpha, 1, self.costs, max_k, **kw)
        reason: Reason = "high_load" if s_idle > c.margin else ("prefill_cost" if s_free > c.margin else "low_acceptance")
        return SpeculationDecision(speculate=False, k=0, reason=reason, **common)

    def engine_depth(self, decision: SpeculationDecision, max_tokens: int) -> tuple[int, bool]:
        """(most drafts per step, adaptive?) for the engine, from the router's decision."""
        if decision.reason == "forced_on":
            return decision.k, False
        if decision.speculate or decision.reason in _ADAPTIVE_OFF:
            return max(0, min(self.config.max_k, max_tokens - 1)), True
        return 0, False

    def _draft_batch(self, load: LoadSnapshot, b: int) -> int:
        # The draft may serve other targets too: its batch is at least ours, maybe more.
        return max(b, load.draft_running_sequences + 1)

    # -- per step, in the engine ---------------------------------------------------------------
    def plan_step(self, candidates: list[StepCandidate], explore_k: int | None = None) -> StepPlan:
        """The batch's plan for one engine step (app/policy/step_plan.py) on this policy's costs."""
        return plan_step_optimistic(candidates, self.costs, margin=self.config.margin, explore_k=explore_k)

    def depth_report(self, candidates: list[StepCandidate]) -> str:
        """One log line: the batch, its acceptance estimates and the predicted goodput (tokens/s) of
        drafting every adaptive sequence at each common depth, against plain."""
        if not candidates:
            return "(no batch)"
        alphas = sorted(c.alpha for c in candidates)
        parts = [f"b={len(candidates)} alpha min/median/max {alphas[0]:.2f}/{alphas[len(alphas) // 2]:.2f}/{alphas[-1]:.2f}"]
        max_cap = max(c.cap for c in candidates)
        plain = plan_step(candidates, self.costs, margin=1.0, only_depth=0).plain_goodput
        parts.append(f"host ms plain/drafting {1e3 * self.costs.t_overhead(False):.2f}/{1e3 * self.costs.t_overhead(True):.2f}")
        parts.append(f"plain {plain:.0f}")
        for k in range(1, max_cap + 1):
            p = plan_step(candidates, self.costs, margin=1.0, only_depth=k)
            parts.append(f"k{k} {p.goodput:.0f} ({sum(1 for x in p.ks if x)} drafting, {1e3 * p.step_s:.0f} ms)")
        return ", ".join(parts)
