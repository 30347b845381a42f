"""TargetServer: the target model and its continuous-batching engine loop, one per replica.

Speculating sequences get proposals through one batched call per step to a DraftServer
replica (a DraftClient over the draft channel, a socket to the draft replica that the affinity
request router picks for this target replica); an n-gram proposer runs in-process instead.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from contextlib import aclosing
from typing import AsyncIterator

from ray import serve
from ray.serve.handle import DeploymentHandle

from app.config import AppConfig, PolicyConfig, UserConfig
from app.protocol.draft_channel import DraftChannelClient
from app.protocol.draft import DraftClient, DraftStepRequest, DraftStepResponse, DraftUnavailable
from app.engine.spec_engine import Overloaded, SpecEngine
from app.engine.loop import EngineLoop, Rejected, stream_batches, stream_gap_s
from app.protocol.generation import GenerateChunk, GenerateRequest
from app.host_steal import StealMeter
from app.runners.model_runner import ModelRunner
from app.runners.profile import profile_target
from app.policy import (AcceptanceTracker, ModeArbiter, PlainHold, SpeculationPolicy, StepCandidate, StepExplorer,
                        StepMode, StepPlan)
from app.policy.cost_model import breakeven_alpha
from app.policy.step_mode import forced_mode, mode_ks
from app.policy.step_profile import StepProfile, seed_costs
from app.policy.step_wall import StepWall
from app.proposers import NgramProposer, Proposer
from deployments.draft_server import ChannelRequest
from deployments.metrics_ray import ServeMetrics
from deployments.step_window import StepWindow
from deployments.replica_info import live_config

log = logging.getLogger("ray.serve")

# A draft step takes milliseconds; the engine step (every sequence of the replica) waits on
# this call, so a draft that is gone must cost little: no answer within this time means plain
# decoding (and finding a draft replica through Serve, which queues the call while none is
# up, is cut off at the same time).
DRAFT_CALL_TIMEOUT_S = 3.0
DRAFT_RETRY_AFTER_S = 2.0  # after a failed draft call, decode plainly this long before trying again
DRAFT_RETRY_AFTER_MAX_S = 30.0  # ... doubling while calls keep failing
DRAIN_POLL_S = 0.05  # how often a shutting-down replica checks whether its streams have ended
GAUGE_PERIOD_S = 0.25  # the load gauges' writes, at most this often while the engine has work
# how often the step mode 'on' recomputes its break-even acceptance: the cost model moves over seconds
BREAKEVEN_PERIOD_S = 0.25


class ReplicaDraining(RuntimeError):
    """A generate call reached a replica that is shutting down. Raised before any chunk: the router
    takes it as a replica failure and re-issues the request to another replica."""


class RemoteDraftTransport:
    """Carries DraftStepRequests to a draft replica over the draft channel (app/protocol/draft_channel.py), the
    replica found through a Serve handle; a dead draft makes the engine go plain for a while."""

    def __init__(self, handle: DeploymentHandle, client_id: str) -> None:
        self.handle = handle
        self.client_id = client_id
        self.channel = DraftChannelClient(self._resolve, timeout_s=DRAFT_CALL_TIMEOUT_S)
        self.down_until = 0.0
        self.failures = 0  # consecutive failed calls
        self._lease = None  # the open DraftServer.lease call (deployments/draft_server.py): the pool's load
        self._lease_checked = 0.0
        self.step_profile: StepProfile | None = None  # the draft replica's, from its channel() answer


    def _resolve(self) -> tuple[str, int, str]:
        response = self.handle.channel.remote(ChannelRequest(self.client_id))
        try:
            info = response.result(timeout_s=DRAFT_CALL_TIMEOUT_S)
        except Exception:
            try:
                response.cancel()  # don't leave a queued call to run on a replacement later
            except Exception:  # noqa: BLE001 — cancel() re-raises a failed assignment
                pass
            raise
        if info.step_profile:  # the draft replica measured its steps at start-up (deployments/draft_server.py)
            self.step_profile = StepProfile(draft=list(info.step_profile))
        return info.host, info.port, info.token

    def __call__(self, request: DraftStepRequest) -> DraftStepResponse:
        if time.monotonic() < self.down_until:
            raise DraftUnavailable("draft replica recently failed; decoding plainly")
        try:
            result = self.channel(request)
        except DraftUnavailable as e:
            self.failures += 1
            wait = min(DRAFT_RETRY_AFTER_MAX_S, DRAFT_RETRY_AFTER_S * 2 ** (self.failures - 1))
            self.down_until = time.monotonic() + wait
            log.warning("draft call failed (%s); decoding plainly for %.1fs", e, wait)
            raise
        self.failures = 0
        self._keep_lease()
        return result

    def _keep_lease(self) -> None:
        """While this replica drafts, keep one lease call open on its draft replica (checked twice a
        second: a finished call is renewed)."""
        now = time.monotonic()
        if self._lease is not None and now - self._lease_checked < 0.5:
            return
        self._lease_checked = now
        if self._lease is not None:
            try:
                self._lease.result(timeout_s=0)
            except TimeoutError:
                return  # still open
            except Exception:  # noqa: BLE001 — the replica went away: open one on whichever answers now
                pass
        self._lease = self.handle.lease.remote(ChannelRequest(self.client_id))


@serve.deployment
class TargetServer:
    def __init__(self, config: dict, draft: DeploymentHandle | None = None) -> None:
        self.config = AppConfig.model_validate(config)
        engine_cfg = self.config.engine
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        runner = ModelRunner(engine_cfg.target, engine_cfg.limits.max_num_seqs,
                             widths=range(1, engine_cfg.speculation.max_speculative_tokens + 2))
        proposer: Proposer | None = None
        self._transport: RemoteDraftTransport | None = None
        if engine_cfg.speculation.proposer == "ngram":
            proposer = NgramProposer(engine_cfg.speculation.ngram_min, engine_cfg.speculation.ngram_max)
        elif draft is not None:
            self._transport = RemoteDraftTransport(draft, self.replica_id)
            proposer = DraftClient(self.replica_id, self._transport)
        self.policy = SpeculationPolicy(self.config.policy, acceptance=AcceptanceTracker(pair=self.config.model_name))
        # On CUDA (graphs per batch bucket and width: stable step costs) the target's passes are measured
        # before traffic and fed to the step planner's cost model as its first measurements; the draft's
        # steps arrive from the draft replica with its channel (app/policy/step_profile.py)
        self.profile = StepProfile()
        self._draft_profile_seeded: StepProfile | None = None
        if runner.device.type == "cuda":
            t0 = time.perf_counter()
            try:
                self.profile.target = profile_target(runner, range(1, engine_cfg.speculation.max_speculative_tokens + 2))
            except Exception:  # noqa: BLE001 — a profile only seeds the cost model: serve without one
                log.exception("profiling the target's passes failed; the cost model starts from its prior")
            seed_costs(self.policy.costs, self.profile)
            log.info("profiled %d target passes in %.1fs: %s", len(self.profile.target), time.perf_counter() - t0,
                     self.profile.summary()["target_ms"])
        self.engine = SpecEngine(
            runner, proposer, engine_cfg.limits, max_k=engine_cfg.speculation.max_speculative_tokens,
            plan_k=self._plan_k,
        )
        c = self.policy.config
        self._build_step_policy(c, None)
        # this step's (mode, chosen by the arbiter, the batch's sequence ids), set in _plan_k
        self._step_mode: tuple[StepMode, bool, tuple[str, ...]] | None = None
        self._breakeven: dict[int, tuple[float, float]] = {}  # batch size -> (when, acceptance), _on_mode_drafts
        self.step_wall = StepWall()
        self._mode_steps = 0
        # speculative passes as this replica measures them: the whole pass (draft call + verify),
        # the draft's own compute, and the exchange (the call's time outside the draft's compute)
        self.pass_parts = {"passes": 0, "pass_s": 0.0, "draft_s": 0.0, "exchange_s": 0.0}
        # every step: the engine's time by phase and the loop's time between steps (streaming, metrics)
        self.step_parts = {"steps": 0, "step_s": 0.0, "target_s": 0.0, "draft_s": 0.0, "prefill_s": 0.0,
                           "overhead_s": 0.0, "between_s": 0.0, "batch": 0}
        self._last_step_end: float | None = None
        self._gauges_at = -GAUGE_PERIOD_S  # when the load gauges were last written (perf_counter)
        self.metrics = ServeMetrics(model_name=self.config.model_name)
        self._seen_errors = self._seen_resends = 0  # the engine's counters already exported
        self.window = StepWindow()  # measured step times, published in record_routing_stats
        self._planned: tuple[StepPlan, list[StepCandidate]] | None = None  # this step's plan and batch, set in _plan_k
        self._plans_seen, self._depths = 0, {}  # for a periodic log line of the plans' depths
        # reconfigure() swaps policy parts between steps: it holds the loop's lock (no _plan_k) and this one (no _on_step)
        self._step_lock = threading.Lock()
        self._streams = 0  # generate calls open on this replica (the drain in __del__ waits for them)
        self._draining = False
        self.loop = EngineLoop(self.engine, on_step=self._on_step)

    def _build_step_policy(self, c: PolicyConfig, old: PolicyConfig | None) -> None:
        """The engine-side policy parts, from `c`; with `old`, only those whose settings changed
        (the others keep their measurements)."""
        def changed(*fields: str) -> bool:
            return old is None or any(getattr(old, f) != getattr(c, f) for f in fields)

        if changed("explore_every_steps", "explore_max_every_steps"):
            self.explorer = (StepExplorer(c.explore_every_steps, c.explore_max_every_steps)
                             if c.explore_every_steps else None)
        if changed("plain_hold_steps"):
            self.hold = PlainHold(c.plain_hold_steps)
        if changed("mode_arbiter"):
            # the host's steal read per step: a probe across which the hypervisor's share moved is no evidence
            self.arbiter = (ModeArbiter(c.mode_arbiter, steal_meter=StealMeter().since_last)
                            if c.mode_arbiter.enabled else None)

    def reconfigure(self, user_config: dict | None) -> None:
        """Serve's user_config (UserConfig), at start and on every `serve deploy` that changes it: the
        policy in force becomes args' `policy` with user_config's `policy` over it. Applied between two
        engine steps to the live policy and step planner, without a restart or a model reload; parts
        whose settings did not change keep what they measured."""
        policy = UserConfig.model_validate(user_config or {}).policy_over(self.config.policy)
        with self.loop.lock, self._step_lock:
            old = self.policy.config
            rebuilt = self.policy.reconfigure(policy)
            if "costs" in rebuilt:  # a new cost model starts from the start-up profiles again
                seed_costs(self.policy.costs, self.profile)
                self._draft_profile_seeded = None
            self._build_step_policy(policy, old)
            self._step_mode, self._planned = None, None  # planned under the old parts
            self._breakeven.clear()  # priced with the old costs and default k
        log.info("policy reconfigured from user_config%s", f" (rebuilt: {', '.join(rebuilt)})" if rebuilt else "")

    def live_config(self, route: ChannelRequest | None = None) -> dict:
        """For ops and tests (via a handle): this replica's identity and the settings in force. `route`
        only steers the call: the affinity router sends each client_id to one replica, different ids
        spread over the replicas (a call without one goes to the least loaded)."""
        return {**live_config(self.policy.config), "streams": self._streams, "draining": self._draining}

    # ---- adaptive k: the whole batch's plan, re-decided every step from live acceptance and cost ----
    def _plan_k(self, batch, caps: list[int]) -> list[int]:
        ids = tuple(seq.seq_id for seq in batch)  # the arbiter's step history and the plain hold key on them
        if self.arbiter is not None:  # the step's mode by measured goodput (app/policy/mode_arbiter.py)
            adaptive = [seq.adaptive and cap > 0 for seq, cap in zip(batch, caps)]
            default_k = self.policy.config.default_k
            if not any(adaptive):
                requested = [seq.k for seq in batch]
                on_drafts = all(k == default_k for k in requested) and self._on_mode_drafts(batch, len(batch))
                mode = forced_mode(requested, [seq.adaptive for seq in batch], default_k, on_drafts)
                self._step_mode = (mode, False, ids) if mode is not None else None
                return caps
            mode = self.arbiter.mode(len(batch))
            self._step_mode = (mode, True, ids)
            on_drafts = mode == "on" and self._on_mode_drafts([s for s, a in zip(batch, adaptive) if a], len(batch))
            ks = mode_ks(mode, caps, adaptive, default_k, on_drafts)
            if ks is not None:
                return ks
        if not any(caps):
            return caps
        if (self.explorer is None or self.explorer.explore_k(len(ids)) is None) and self.hold.holds(ids):
            if self.explorer is not None:
                self.explorer.record_plain_step()
            return [0] * len(caps)
        replica_alpha = self.policy.acceptance.alpha("default")
        proposer, costs = self.engine.proposer, self.policy.costs
        candidates = []
        for seq, cap in zip(batch, caps):
            alpha, alpha_upper = self._acceptance(seq, replica_alpha)
            candidates.append(StepCandidate(
                cap, alpha, seq.adaptive,
                catch_up_s=costs.t_draft_prefill(proposer.catch_up_tokens(seq.seq_id, seq.token_ids))
                if proposer is not None and cap else 0.0,
                remaining=seq.remaining, alpha_upper=alpha_upper))
        explore_k = self.explorer.explore_k(len(candidates)) if self.explorer is not None else None
        plan = self.policy.plan_step(candidates, explore_k=explore_k)
        if self.explorer is not None:
            self.explorer.record(plan, candidates)
        self.hold.record(ids, plan)
        self._planned = (plan, candidates)  # its realized time is fed back in _on_step
        return plan.ks

    def _acceptance(self, seq, replica_alpha: float) -> tuple[float, float]:
        """The sequence's own acceptance, shrunk towards its prompt class's (router) or the replica's,
        and the same made optimistic by acceptance_optimism standard deviations (token_alpha_upper):
        the latter decides whether it drafts."""
        c = self.policy.config
        prior = seq.alpha_prior if seq.alpha_prior is not None else replica_alpha
        return (seq.stats.token_alpha(prior, c.sequence_prior_weight),
                seq.stats.token_alpha_upper(prior, c.acceptance_optimism, c.sequence_prior_weight))

    def _on_mode_drafts(self, seqs, batch_size: int) -> bool:
        """Does the step mode 'on' draft for this batch of `batch_size`: is some sequence's optimistic
        acceptance at or above the break-even of the default k in a batch of this size drafting alike
        (app/policy/step_mode.py says why)? The break-even is a dozen cost-model queries: recomputed
        per batch size every BREAKEVEN_PERIOD_S."""
        now = time.perf_counter()
        when, threshold = self._breakeven.get(batch_size, (-math.inf, math.inf))
        if now - when > BREAKEVEN_PERIOD_S:
            threshold = breakeven_alpha(self.policy.costs, self.policy.config.default_k, b=batch_size)
            self._breakeven[batch_size] = (now, threshold)
        replica_alpha = self.policy.acceptance.alpha("default")
        return any(self._acceptance(seq, replica_alpha)[1] >= threshold for seq in seqs)

    def _on_step(self, engine: SpecEngine, updates, seconds: float) -> None:
        with self._step_lock:
            self._observe_step(engine, updates, seconds)

    def _observe_step(self, engine: SpecEngine, updates, seconds: float) -> None:
        times = engine.last_times
        now = time.perf_counter()
        sp = self.step_parts
        sp["steps"] += 1
        sp["step_s"] += seconds
        sp["target_s"] += times.target
        sp["draft_s"] += times.draft
        sp["prefill_s"] += times.prefill
        sp["overhead_s"] += times.overhead
        sp["batch"] += times.batch_size
        if self._last_step_end is not None:
            sp["between_s"] += max(0.0, now - seconds - self._last_step_end)
        observed = self._step_mode is not None and times.batch_size > 0 and self.arbiter is not None
        # what the step stands for in the arbiter's goodput: its time and tokens with its newcomers',
        # the loop's short gap before it, and any prefill-only step before it (app/policy/step_wall.py)
        measured = self.step_wall.step(now, seconds, sum(len(u.token_ids) for u in updates),
                                       batch_size=times.batch_size, observed=observed)
        if observed and measured is not None:
            tokens, wall = measured
            mode, chosen, seq_ids = self._step_mode
            self.arbiter.observe(times.batch_size, mode, tokens, wall, chosen=chosen, seq_ids=seq_ids)
            if chosen:
                self.metrics.record_step_mode(mode)
            self._mode_steps += 1
            if self._mode_steps % 2000 == 0:
                log.info("step modes by load bucket %s", self.arbiter.snapshot())
        self._step_mode = None
        if self._planned is not None:
            plan, candidates = self._planned
            self._planned = None
            self._plans_seen += 1
            self._depths[plan.depth] = self._depths.get(plan.depth, 0) + 1
            if self._plans_seen % 500 == 0:
                # what the planner saw at this step: its predicted goodput at each common depth
                log.info("step plans by depth %s; last plan %s", dict(sorted(self._depths.items())),
                         self.policy.depth_report(candidates))
                self._depths.clear()
        drafted = sum(u.drafted for u in updates)
        accepted = sum(u.accepted for u in updates)
        num_drafts = sum(1 for u in updates if u.drafted)
        if drafted:
            per_pos = [0] * max(u.drafted for u in updates)
            for u in updates:
                for i in range(u.accepted):
                    per_pos[i] += 1
            self.metrics.record_step(drafted, accepted, num_drafts, per_pos)
            for u in updates:
                if u.drafted:
                    self.policy.acceptance.observe("default", u.drafted, u.accepted)
        if times.batch_size:
            # a step whose draft call failed decoded plainly: its host time is a plain step's
            self.policy.costs.observe_overhead(times.overhead, speculative=drafted > 0)
            kind = "verify" if times.num_speculating else "decode"
            self.metrics.observe_step(kind, times.target)
            self.policy.costs.observe_target(times.tokens_in_pass, times.target)
            self.window.add(kind, times.target, times.tokens_in_pass)
        if times.draft:
            self.metrics.observe_step("draft", times.draft)
            self._observe_draft(engine, times.draft)
        # gauges: a Ray metric call is ~30 us of Python on this thread, five a step were ~5 % of an 8B
        # step; Prometheus scrapes every few seconds, so they are written a few times a second (and
        # always when the engine empties, so an idle replica never shows a stale load)
        if now - self._gauges_at >= GAUGE_PERIOD_S or not (engine.running or engine.waiting):
            self._gauges_at = now
            self.metrics.set_load(len(engine.running), len(engine.waiting), engine.cached_tokens(), len(engine.running))
            self.metrics.set_kv_usage(min(1.0, engine.reserved_tokens() / engine.limits.max_cached_tokens))
        while engine.queue_times:
            self.metrics.observe_queue_time(engine.queue_times.pop())
        if engine.proposer_errors != self._seen_errors:
            self._seen_errors = engine.proposer_errors
            self.metrics.record_plain_no_draft_step()
        resends = getattr(engine.proposer, "resends", 0)
        if resends != self._seen_resends:
            self.metrics.record_draft_misses(resends - self._seen_resends)
            self._seen_resends = resends
        self._last_step_end = time.perf_counter()

    def _observe_draft(self, engine: SpecEngine, total_s: float) -> None:
        """Split a step's draft calls into per-draft-step compute, catch-up prefill and the hop, each
        call at its own batch and depth (a call sent a step ahead was made for the batch of then)."""
        calls = engine.last_times.draft_calls
        if not calls:
            return  # no draft call answered: the step decoded plainly
        parts = self.pass_parts
        parts["passes"] += 1
        parts["pass_s"] += total_s + engine.last_times.target
        draft_profile = self._transport.step_profile if self._transport is not None else None
        if draft_profile is not None and draft_profile is not self._draft_profile_seeded:
            seed_costs(self.policy.costs, draft_profile)  # before this step's own measurement, which then weighs in
            self._draft_profile_seeded = draft_profile
            log.info("draft replica's step profile: %s", draft_profile.summary()["draft_step_ms"])
        for call in calls:
            parts["draft_s"] += call.compute_s
            parts["exchange_s"] += call.hop_s
            if call.batch <= 0 or call.depth <= 0:
                continue
            # the draft runs `depth` batched steps (the deepest sequence's k), the first one maybe a catch-up
            per_step = self.policy.costs.observe_draft_call(call.batch, call.depth, call.compute_s, call.first_pass)
            self.policy.costs.observe_exchange(call.hop_s)
            if per_step is not None:
                self.window.add("draft", per_step, call.batch)
            self.window.add("exchange", max(call.hop_s, 1e-9))

    # ---- the request path ----
    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        if self._draining:
            raise ReplicaDraining(f"target replica {self.replica_id} is shutting down")
        self._streams += 1
        try:
            async with aclosing(self._generate(request)) as chunks:  # closed at once when the caller cancels
                async for chunk in chunks:
                    yield chunk
        finally:
            self._streams -= 1

    async def _generate(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        if request.sampling.response_format is not None:  # compiled off the event loop and the engine's lock
            try:
                await asyncio.to_thread(self.engine.prepare, request.sampling)
            except ValueError as e:
                yield GenerateChunk([], "", None, error=str(e), status=400, replica=self.replica_id)
                return
        queue = self.loop.submit(request.request_id, request.prompt_ids, request.sampling, request.k,
                                 adaptive=request.adaptive, alpha_prior=request.alpha_prior,
                                 output_ids=list(request.output_ids))
        finished = False
        try:
            gap = lambda: stream_gap_s(self._streams, request.streaming)  # noqa: E731 — open streams change
            async for batch in stream_batches(queue, request.timeout_s, gap):
                last = batch[-1]
                finished = last.finish_reason is not None
                if len(batch) == 1:
                    yield GenerateChunk(last.token_ids, last.text, last.finish_reason, last.drafted, last.accepted,
                                        last.k, self.replica_id, logprobs=last.logprobs)
                else:  # the reader fell behind: one chunk for every step that waited
                    yield GenerateChunk([t for u in batch for t in u.token_ids], "".join(u.text for u in batch),
                                        last.finish_reason, sum(u.drafted for u in batch),
                                        sum(u.accepted for u in batch), last.k, self.replica_id,
                                        steps=tuple((len(u.token_ids), u.drafted, u.accepted) for u in batch),
                                        logprobs=None if last.logprobs is None else
                                        [lp for u in batch for lp in (u.logprobs or [])])
        except Rejected as rejected:  # the engine refused it at the step boundary: nothing to cancel
            finished = True
            overloaded = isinstance(rejected.error, Overloaded)
            yield GenerateChunk([], "", None, error=f"server overloaded: {rejected}" if overloaded else str(rejected),
                                status=429 if overloaded else 400, replica=self.replica_id)
        finally:
            if not finished:  # client gone, deadline passed, or the router cancelled us
                self.loop.cancel(request.request_id, queue)

    def set_draft_ahead(self, enabled: bool) -> None:
        """Benchmarks: send the draft calls one step ahead (the default) or only when a step needs them
        (app/engine/draft_ahead.py), to measure both in one run."""
        with self.loop.lock:
            self.engine.set_draft_ahead(enabled)

    def pass_report(self, reset: bool = True) -> dict:
        """Speculative passes since the last reset: count, and seconds of the passes, of the draft's
        compute and of the exchange (what bench.serve_gpu reports as the exchange's share)."""
        report = {**self.pass_parts, "steps": dict(self.step_parts)}
        if reset:
            self.pass_parts.update(passes=0, pass_s=0.0, draft_s=0.0, exchange_s=0.0)
            self.step_parts.update({k: 0 for k in self.step_parts})
            self._last_step_end = None
        return report

    def policy_state(self) -> dict:
        """The mode arbiter's measured goodput per batch bucket, and the step costs profiled at start-up (ms per
        target pass '{batch}x{width}' and per draft step '{batch}x{depth}'; empty on the CPU)."""
        return {"start_profile": {**self.profile.summary(),
                                  **(self._draft_profile_seeded.summary() if self._draft_profile_seeded else {})},
                "step_modes": self.arbiter.snapshot() if self.arbiter is not None else {}}

    def load(self) -> dict:
        """The load figures with the last published measurements (does not close the window)."""
        return {**self._load_figures(), **self.window.last}

    def record_routing_stats(self) -> dict:
        """Published to handles every request_routing_stats_period_s (fresher than Serve's metrics):
        load, plus the mean step times measured since the last publication (StepWindow), which
        the router's policy learns its cost curves from."""
        return {**self._load_figures(), **self.window.publish()}

    def _load_figures(self) -> dict:
        e = self.engine
        return {
            "running": len(e.running),
            "waiting": len(e.waiting),
            "max_num_seqs": e.limits.max_num_seqs,
            "kv_tokens": e.cached_tokens(),
            "last_step_s": self.loop.stats.last_step_s,
            "draft_available": not isinstance(e.proposer, DraftClient)
            or time.monotonic() >= e.proposer.transport.down_until,
            "time": time.time(),
        }

    def num_cached_sequences(self) -> int:
        return len(self.engine.running)

    def check_health(self) -> None:
        if not self.loop.thread.is_alive():
            raise RuntimeError("engine loop thread died")

    async def __del__(self) -> None:
        """Serve's graceful shutdown (scale-down, an update that replaces replicas, `serve shutdown`).
        Serve first waits, up to graceful_shutdown_timeout_s (the builder's default: a request's
        deadline + a margin), until the replica has no ongoing request (routers stop sending new ones
        once the controller marks it stopping), then rejects late handle calls so their routers retry
        elsewhere, then calls this. Here: refuse new sequences (ReplicaDraining: the router re-issues),
        wait for any stream still open to end (each ends by its deadline, so within
        request_timeout_s), then stop the engine loop."""
        self._draining = True
        config = getattr(self, "config", None)
        deadline = time.monotonic() + (config.engine.limits.request_timeout_s if config is not None else 0.0)
        while getattr(self, "_streams", 0) and time.monotonic() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        loop = getattr(self, "loop", None)
        if loop is not None:
            loop.stop()
