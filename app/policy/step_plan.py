"""Per-step plan for a whole batch: which sequences speculate this step, and how deep.

Why per batch, not per sequence: in one engine step every sequence shares the same target
forward and waits for the same draft call. If even one sequence speculates, the step pays the
draft's k batched steps plus the draft<->target exchange, and every plain sequence in the batch
waits for them too. A per-sequence rule ("speculate if it pays for me") ignores that and lets a
single speculating request slow a batch of plain ones — which is how a per-request policy ends up
below both fixed policies under load. So the engine asks, at every step, for the plan that
maximises the batch's goodput:

    tokens(S, k) = Σ_{s∈S} E(α_s, k_s) + (b − |S|)                       emitted this step
    time(S, k)   = t_target(b · (max_s k_s + 1))                             one target forward, padded
                 + [S ≠ ∅] · (max_s k_s · t_draft(|S|) + t_exchange)        the draft call, if any
                 + t_overhead([S ≠ ∅]) + b · t_chunk        host work: measured apart for plain and drafting steps
                 + Σ_{s∈S} c_s · E(α_s, k_s) / R_s                                catch-ups, amortised
    wall(S, k)   = max(time(S, k), b · t_beside)                             the streaming beside it

(The target pads every row of a pass to its longest input, so a plain row in a drafting step
costs as much target time as a drafting one: measured on the embedded CPU target at batch 32,
31 one-token rows and one 5-token row 99 ms, all 32 rows at 5 tokens 99 ms,
all at 1 token 75 ms. With a ragged pass (`padded=False`) the term is t_target(Σ_{s∈S}(k_s + 1) + (b − |S|)).
t_chunk, t_beside: streaming one sequence's chunk where the router and proxy share the model's
cores. Part of it contends with the engine thread and lengthens the step (t_chunk); the rest runs
in the router and proxy on the core the engine leaves free, and binds only once the batch's chunks
outlast the step (t_beside). Measured on the 2-core CPU app, a plain step takes 0.4, 0.5, 2.3 and
21.7 ms more than its engine parts at 1, 2, 4 and 16 streams: neither all added nor all beside
fits that. c_s: the
draft prefill a sequence needs before it can draft again — its whole context when the draft never
saw it, every token of the plain steps since it last drafted — paid once and then good for its
remaining R_s tokens, so a step is charged the share of it that its E tokens use up) over
S ⊆ adaptive sequences (plus the forced ones, which always speculate at their own k) and a
common depth k (capped per sequence). For a fixed |S| = m, the best S is the m sequences with
the highest α (E grows with α and the cost does not depend on which), so the search is over
(m, k): O(b · max_k) cost-curve lookups. (With catch-ups the best m are not always the m highest
α; ties go to the one with less to catch up, and the rest is left to the next step's plan.)

The chunks' host time is added to the engine time (the forwards, the draft call, the engine's
host time): it is spent outside the engine step (router, proxy), so a step's wall time cannot
measure it.

Exploration lives here too, at step granularity: when no adaptive sequence has drafted for
`every_steps` steps (optionally doubling while explorations keep confirming plain decoding), one
step speculates at a shallow depth so the acceptance estimate stays measured. Its cost is bounded by one speculative step in `every_steps` (and that step still
emits E(α, k) ≥ 1 tokens per sequence), instead of a share of whole requests that keep a batch
paying the draft call for their whole life.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .cost_model import StepCosts, expected_tokens_per_step

# Drafts per sequence in an exploration step: the shallowest depth that measures acceptance past the
# first position, at little more than a plain step's cost when the draft does not pay
EXPLORATION_K = 2


@dataclass(frozen=True)
class StepCandidate:
    """One running sequence as the planner sees it."""

    cap: int  # most drafts it may take this step (request's k, remaining output, context); 0: none
    alpha: float  # per-token acceptance estimate for this sequence
    adaptive: bool  # True: 'auto', the plan picks 0..cap; False: forced on, speculates at cap
    catch_up_s: float = 0.0  # draft prefill (seconds) this sequence needs before it drafts again
    remaining: int = 1  # output tokens it may still produce (the catch-up is amortised over them)
    alpha_upper: float | None = None  # optimistic acceptance: decides whether it drafts (see plan_step_optimistic)

    def catch_up_share(self, tokens: float) -> float:
        """Seconds of catch-up charged to a step that emits `tokens` for this sequence."""
        return self.catch_up_s * min(1.0, tokens / max(self.remaining, 1))


@dataclass(frozen=True)
class StepPlan:
    ks: list[int]  # drafts per candidate, in input order
    goodput: float  # predicted tokens per second of the chosen plan
    plain_goodput: float  # ... with every adaptive sequence decoding plainly
    explored: bool = False
    depth: int = 0  # the deepest k of the plan (0: a plain step)
    step_s: float = 0.0  # the plan's engine step time from the model's parts (no chunk or catch-up time)
    catch_up_s: float = 0.0  # predicted catch-up prefill of the sequences that draft this step, in full


class _StepPrices:
    """The step-time model's lookups for one plan, each cost-curve lookup made once: a search over
    (m, k) asks for the same pass sizes and draft batches many times (at b = 16, ~130 plans)."""

    def __init__(self, costs: StepCosts) -> None:
        self.costs = costs
        self.host = (costs.t_overhead(False), costs.t_overhead(True))  # plain, drafting
        self.exchange = costs.t_exchange
        self._target: dict[int, float] = {}
        self._draft: dict[int, float] = {}

    def time(self, pass_tokens: int, num_spec: int, depth: int) -> float:
        verify = self._target.get(pass_tokens)
        if verify is None:  # one target forward over every token of the pass
            verify = self._target[pass_tokens] = self.costs.t_pass(pass_tokens)
        if num_spec == 0:
            return verify + self.host[0]
        draft = self._draft.get(num_spec)
        if draft is None:
            draft = self._draft[num_spec] = self.costs.t_draft(num_spec)
        # the served engine drafts, exchanges and verifies one after another: every part is paid
        return verify + depth * draft + self.exchange + self.host[1]


def _e_table(alpha: float, cap: int) -> list[float]:
    """E(α, k) for k = 0..cap in one pass (expected_tokens_per_step's sum, cumulated)."""
    a = min(max(alpha, 0.0), 1.0)
    out, total, survive = [1.0], 1.0, 1.0
    for _ in range(cap):
        survive *= a
        total += survive
        out.append(total)
    return out


def plan_step(
    candidates: list[StepCandidate],
    costs: StepCosts,
    *,
    margin: float = 1.0,
    explore_k: int | None = None,
    only_depth: int | None = None,
    padded: bool = True,
    optimistic: bool = False,
    draft_all: bool = False,
) -> StepPlan:
    """The goodput-maximising plan for one step (see the module doc).

    `margin`: the adaptive sequences speculate only when that beats the plain plan by this
    factor (model error absorbs small predicted gains). `explore_k`: if the best plan leaves
    every adaptive sequence plain, speculate them all at this depth anyway (an exploration step).
    `only_depth`: search the adaptive sequences' plans at this common depth only (plain included),
    for the depth report (SpeculationPolicy.depth_report).
    `padded`: the target pads every row of a pass to the longest (model_runner, kv_cache.pack), so a
    pass of depth d costs b·(d + 1) tokens whichever rows draft; False: a ragged pass, Σ (k_s + 1).
    `optimistic`: read each candidate's `alpha_upper` where it has one (plan_step_optimistic).
    `draft_all`: every adaptive sequence drafts; only the common depth is chosen.
    """
    b = len(candidates)
    ks = [0] * b
    alpha = [c.alpha_upper if optimistic and c.alpha_upper is not None else c.alpha for c in candidates]
    forced = [i for i, c in enumerate(candidates) if c.cap > 0 and not c.adaptive]
    adaptive = sorted((i for i, c in enumerate(candidates) if c.cap > 0 and c.adaptive),
                      key=lambda i: (-alpha[i], candidates[i].catch_up_s))
    for i in forced:
        ks[i] = candidates[i].cap
    f_es = [expected_tokens_per_step(alpha[i], ks[i]) for i in forced]
    f_tokens = sum(f_es)
    f_catch = sum(candidates[i].catch_up_share(e) for i, e in zip(forced, f_es))
    f_pass = sum(ks[i] + 1 for i in forced)
    f_depth = max((ks[i] for i in forced), default=0)
    n_rest = b - len(forced)  # plain unless chosen below
    # host time of any step: the engine's own (in prices.time: inside the step's wall time) and the
    # streamed chunks' (the router's and proxy's work, outside it)
    emit, beside = costs.t_emit(b), costs.t_emit_beside(b)
    prices = _StepPrices(costs)
    times: dict[tuple[int, int, int], float] = {}  # the engine time of (pass tokens, drafting, depth)

    def pass_tokens(ragged: int, depth: int) -> int:
        return b * (depth + 1) if padded else ragged

    def goodput(m: int, prefix_e: float, prefix_pass: int, depth: int, catch: float) -> float:
        tokens = f_tokens + prefix_e + (n_rest - m)
        num_spec, d = len(forced) + m, max(f_depth, depth)
        key = (pass_tokens(f_pass + prefix_pass + (n_rest - m), d), num_spec, d)
        t = times.get(key)
        if t is None:  # padded passes repeat: one curve lookup per (tokens, drafting, depth)
            t = times[key] = prices.time(*key)
        t = max(t + emit + f_catch + catch, beside)  # the router's and proxy's share runs beside the step
        return tokens / t if t > 0 else 0.0

    plain = goodput(0, 0.0, 0, 0, 0.0) if b else 0.0
    best, best_m, best_k = (float("-inf"), 0, 0) if draft_all and adaptive else (plain, 0, 0)
    max_cap = max((candidates[i].cap for i in adaptive), default=0)
    tables = {i: _e_table(alpha[i], candidates[i].cap) for i in adaptive}
    for k in range(1, max_cap + 1):
        if only_depth is not None and k != only_depth:
            continue
        e_sum, pass_sum, depth, catch = 0.0, 0, 0, 0.0
        for m, i in enumerate(adaptive, start=1):
            ki = min(k, candidates[i].cap)
            e = tables[i][ki]
            e_sum += e
            catch += candidates[i].catch_up_share(e)
            pass_sum += ki + 1
            depth = max(depth, ki)
            if draft_all and m < len(adaptive):
                continue
            g = goodput(m, e_sum, pass_sum, depth, catch)
            if g > best + 1e-12:
                best, best_m, best_k = g, m, k
    if best_m and best < plain * margin and not draft_all:
        best, best_m, best_k = plain, 0, 0
    explored = False
    if best_m == 0 and explore_k and adaptive:
        best_m, best_k, explored = len(adaptive), explore_k, True
    for i in adaptive[:best_m]:
        ks[i] = min(best_k, candidates[i].cap)
    spec = [i for i in range(b) if ks[i] > 0]
    depth = max((ks[i] for i in spec), default=0)
    step_s = prices.time(pass_tokens(sum(ks[i] for i in spec) + b, depth), len(spec), depth) if b else 0.0
    return StepPlan(ks, best, plain, explored, depth=depth, step_s=step_s,
                    catch_up_s=sum(candidates[i].catch_up_s for i in spec))


def plan_step_optimistic(candidates: list[StepCandidate], costs: StepCosts, **kw) -> StepPlan:
    """`plan_step` where *whether* each adaptive sequence drafts is decided on its optimistic
    acceptance (`alpha_upper`) and *how deep* on its mean (`alpha`).

    Optimism keeps a sequence whose estimate fell after one unlucky step drafting, so its
    estimate can recover (app/engine/acceptance.py token_alpha_upper), but only in a step that drafts on
    the mean as well: a step whose draft call only optimism would start stays plain. Choosing
    the depth on it as well drafts too deep: measured at 1 stream on the CPU app, the planner then
    drafted 6.5 tokens per drafting step at acceptance 0.46 and fell below both fixed policies.
    Keyword arguments go to `plan_step` (not `only_depth`).
    """
    # Optimism buys a measurement cheaply only where the draft call is paid anyway: a sequence
    # joining a drafting batch adds its rows; a step that drafts only on optimism pays the whole
    # call (the draft's steps, the exchange, the padded pass) for it. Measured on the CPU app:
    # with optimism deciding alone, auto drafted in about half the steps at 1 stream and lost 4 %
    # to "off"; without optimism anywhere it drafted shallower at 8-32 streams and lost 3-5 % to
    # "on". So the plan on the mean comes first, and a
    # plain one (or an exploration step) stands: one plan_step where nothing drafts, as at 1 stream.
    on_mean = plan_step(candidates, costs, **kw)
    mean_drafting = {i for i, (c, k) in enumerate(zip(candidates, on_mean.ks)) if k > 0 and c.adaptive}
    if not mean_drafting or on_mean.explored:
        return on_mean
    if len(mean_drafting) == sum(1 for c in candidates if c.adaptive and c.cap > 0):
        return on_mean  # every adaptive sequence drafts already: optimism has no one to add (the usual case under load)
    plan = plan_step(candidates, costs, optimistic=True, **kw)
    drafting = {i for i, (c, k) in enumerate(zip(candidates, plan.ks)) if k > 0 and c.adaptive}
    if drafting <= mean_drafting:
        return on_mean  # optimism adds no one: the mean plan's depth is already best for its set
    # the same sequences draft; their common depth is the one best on the mean acceptance
    chosen = [c if i in drafting or not c.adaptive else replace(c, cap=0) for i, c in enumerate(candidates)]
    best = plan_step(chosen, costs, **{**kw, "margin": 1.0, "explore_k": None}, draft_all=True)
    return replace(best, plain_goodput=on_mean.plain_goodput)


class StepExplorer:
    """Says when the next step should explore: after `interval` steps in which no adaptive
    sequence drafted while some could have. Not thread-safe: one per engine loop.

    The interval starts at `every_steps` and doubles after each exploration, up to
    `max_every_steps`; it falls back to `every_steps` once the planner has drafted on its own in
    `every_steps` steps since the last exploration. Why: at low load an exploration step is dear.
    Its sequence is new to the draft, so the step prefills its whole context on the draft, then
    drafts and crosses the exchange twice. Measured on the CPU app at 1 stream: with one
    exploration per 64 plain steps, about one per 64-token request, auto took 0.94-0.96 of
    'off''s time per request; with no exploration 0.98, with the interval backing off to 512 steps
    0.995. When explorations keep confirming plain decoding, measuring that often buys nothing;
    acceptance decays by tokens observed, not by time, so a sparser measurement is not a staler one.

    The interval is kept per batch size: an exploration that confirmed plain at one stream says
    nothing about four, where the verify pass is shared and drafting may pay (measured on the CPU
    app with one interval for all sizes: a replica that had backed off at 1-2 streams stopped
    drafting at 4 while 'on' beat 'off' by 19 %).

    Why not fall back at the first step the planner drafts on its own: at 1 stream it drafts in
    short bursts (2-5 % of steps on the CPU app), and each burst would bring the interval back to
    `every_steps`, and with it the exploration cost the back-off removes. Drafting
    that lasts as long as one base interval means acceptance is being measured at this load anyway.
    """

    def __init__(self, every_steps: int, max_every_steps: int | None = None, *, k: int = EXPLORATION_K) -> None:
        if every_steps < 1 or k < 1:
            raise ValueError(f"exploration needs every_steps >= 1 and k >= 1, got {every_steps}, {k}")
        if max_every_steps is not None and max_every_steps < every_steps:
            raise ValueError(f"max_every_steps={max_every_steps} < every_steps={every_steps}: the interval only "
                             "grows from every_steps; pass max_every_steps >= every_steps (equal: no back-off)")
        self.every_steps, self.k = every_steps, k
        self.max_every_steps = max_every_steps if max_every_steps is not None else every_steps
        self._intervals: dict[int, int] = {}  # batch size -> its backed-off interval (absent: every_steps)
        self._quiet_steps = 0
        self._self_drafted = 0  # steps the planner drafted on its own since the last exploration (or fall-back)
        self.explorations = 0

    def interval(self, batch_size: int) -> int:
        return self._intervals.get(batch_size, self.every_steps)

    def explore_k(self, batch_size: int) -> int | None:
        return self.k if self._quiet_steps >= self.interval(batch_size) else None

    def record(self, plan: StepPlan, candidates: list[StepCandidate]) -> None:
        """After planning a step: reset when an adaptive sequence drafts, else count it."""
        if not any(c.adaptive and c.cap > 0 for c in candidates):
            return  # nothing could have explored: not a missed measurement
        if any(k > 0 and c.adaptive for k, c in zip(plan.ks, candidates)):
            self._quiet_steps = 0
            if plan.explored:
                self.explorations += 1
                self._self_drafted = 0
                b = len(candidates)
                self._intervals[b] = min(2 * self.interval(b), self.max_every_steps)
            else:  # the planner drafts on its own: once that lasts, explore soon when it stops
                self._self_drafted += 1
                if self._self_drafted >= self.every_steps:
                    self._intervals.clear()
                    self._self_drafted = 0
        else:
            self._quiet_steps += 1

    def record_plain_step(self) -> None:
        """A step left plain without planning (PlainHold): a quiet step like any other."""
        self._quiet_steps += 1


class PlainHold:
    """After a plain plan for a batch, the same batch stays plain for the next `steps` steps
    without planning again.

    Why: in the served app the planner's Python runs on the engine thread beside the replica's
    event loop, and measured at 1 stream on the CPU app a plain step took 4.73 ms per streamed
    chunk with the planner and 3.78 ms with `_plan_k` bypassed ('off': 4.04 and 3.75 ms in the
    same runs), although the planner alone costs ~0.1 ms.
    A plain plan rarely turns into a drafting one from one step to the next (acceptance moves only
    when sequences draft; load only when the batch changes, which ends the hold). Not
    thread-safe: one per engine loop."""

    def __init__(self, steps: int) -> None:
        if steps < 0:
            raise ValueError(f"plain hold steps must be >= 0, got {steps}")
        self.steps = steps
        self._batch: tuple[str, ...] = ()
        self._left = 0

    def holds(self, batch: tuple[str, ...]) -> bool:
        """True if this step of `batch` (its sequence ids, in order) stays plain unplanned."""
        if self._left > 0 and batch == self._batch:
            self._left -= 1
            return True
        return False

    def record(self, batch: tuple[str, ...], plan: StepPlan) -> None:
        """After planning a step: a plain plan (not an exploration) starts a hold."""
        self._batch, self._left = batch, (self.steps if plan.depth == 0 and not any(plan.ks) else 0)
