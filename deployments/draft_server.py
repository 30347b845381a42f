"""DraftServer: the draft model and its KV cache, one per replica.

Serve is its control plane: target replicas find it through a handle (`channel()`, routed by
the affinity request router so a target keeps to the replica that holds its sequences) and
Serve checks its health. The per-step data goes over the draft channel (app/protocol/draft_channel.py),
one socket round trip per target step for the whole batch. Its state is only a cache: a replica
that lost a sequence answers *miss* and is sent the full token ids (app/protocol/draft.py).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass

import ray
from ray import serve

from app.config import AppConfig
from app.protocol.sampling_params import SamplingParams
from app.protocol.draft_channel import DraftChannelServer
from app.protocol.draft import DraftSeqDelta, DraftStepRequest, DraftStepResponse, DraftWorker
from app.proposers import DraftModelProposer
from app.policy.step_profile import DraftTime
from app.proposers.oracle import ReferenceProposer
from app.runners.profile import profile_draft
from deployments.metrics_ray import ServeMetrics

log = logging.getLogger("ray.serve")

# rows of the draft's cache per target sequence slot: one draft replica serves several target replicas,
# and a sequence it no longer has room for is evicted and rebuilt on its next miss
DRAFT_ROWS_PER_TARGET_SEQ = 2


# A target replica stepping against a draft replica holds one `lease` call open there, so Serve's
# autoscaler, which counts ongoing requests, sees the draft pool's load although the steps travel
# over the draft channel: the lease ends once the target has sent no step for LEASE_IDLE_S, or
# after LEASE_MAX_S (then the target opens another: a draining replica is never held long).
LEASE_IDLE_S = 1.0
LEASE_MAX_S = 10.0


@dataclass(frozen=True)
class ChannelRequest:
    client_id: str  # the calling target replica: the affinity key


@dataclass(frozen=True)
class ChannelInfo:
    host: str
    port: int
    token: str
    # the draft's step measured at start-up per (batch, depth) (on CUDA; empty on the CPU): the calling
    # target replica feeds it to its step planner's cost model (app/policy/step_profile.py)
    step_profile: tuple[DraftTime, ...] = ()


@serve.deployment
class DraftServer:
    def __init__(self, config: dict) -> None:
        app_config = AppConfig.model_validate(config)
        if app_config.engine.draft is None:
            raise ValueError("DraftServer needs engine.draft in the config")
        rows = app_config.engine.limits.max_num_seqs * DRAFT_ROWS_PER_TARGET_SEQ
        self.proposer = DraftModelProposer(app_config.engine.draft, max_seqs=rows)
        # proposes what the draft model does until a benchmark loads references (set_references)
        self.reference = ReferenceProposer(self.proposer, self.proposer.runner.vocab_size)
        self.worker = DraftWorker(self.reference)
        self.step_profile: tuple[DraftTime, ...] = ()
        if self.proposer.runner.device.type == "cuda":  # graphs per (batch bucket, depth): stable, measurable
            t0 = time.perf_counter()
            limits, spec = app_config.engine.limits, app_config.engine.speculation
            try:  # it also captures the step's graph at every (batch bucket, depth) before traffic
                self.step_profile = tuple(profile_draft(
                    self.proposer, self.proposer.runner.vocab_size,
                    [b for b in self.proposer.runner.buckets if b <= limits.max_num_seqs],
                    range(1, spec.max_speculative_tokens + 1)))
            except Exception:  # noqa: BLE001 — a profile only seeds the targets' cost models: serve without one
                log.exception("profiling the draft's steps failed; targets measure them live")
            log.info("profiled %d draft steps in %.1fs", len(self.step_profile), time.perf_counter() - t0)
        # torch work is synchronous: serialise steps from several target replicas
        self.lock = threading.Lock()
        self.metrics = ServeMetrics(model_name=app_config.model_name)
        self.last_step: dict[str, float] = {}  # target replica -> when its last step arrived (leases)
        self.server = DraftChannelServer(self._step, advertise_host=ray.util.get_node_ip_address())

    def _step(self, request: DraftStepRequest) -> DraftStepResponse:
        if request.seqs:
            self.last_step[request.client_id] = time.monotonic()
        with self.lock:
            response = self.worker.step(request)
        if request.seqs:
            self.metrics.observe_step("draft", response.draft_time_s)
        return response

    async def lease(self, request: ChannelRequest) -> None:
        """Held open by a target replica while it drafts here (see LEASE_IDLE_S): one ongoing request
        per busy target replica is the load Serve's autoscaler scales the draft pool on."""
        start = time.monotonic()
        while (time.monotonic() - self.last_step.get(request.client_id, 0.0) < LEASE_IDLE_S
               and time.monotonic() - start < LEASE_MAX_S):
            await asyncio.sleep(LEASE_IDLE_S / 4)

    def channel(self, request: ChannelRequest) -> ChannelInfo:
        """Where a target replica sends its steps (the data plane), and the token it must present."""
        host, port = self.server.address
        return ChannelInfo(host, port, self.server.token, self.step_profile)

    def set_references(self, references: list[list[int]], alpha: float | dict[str, float] | None,
                       classes: list[str] | None = None) -> None:
        """Benchmarks only (random-weight models agree on nothing): propose the target's own greedy
        continuation of these sequences with probability alpha per token, while the draft model still
        runs every step (app/proposers/oracle.py ReferenceProposer). alpha may be one per prompt class,
        with `classes` naming each reference's class. alpha None turns it off."""
        with self.lock:
            self.reference.set_references(references, alpha, classes)

    def num_cached_sequences(self) -> int:
        return self.proposer.num_cached_sequences()

    def record_routing_stats(self) -> dict:
        return {
            "sequences": self.worker.num_sequences(),
            "kv_tokens": self.proposer.cached_tokens(),
            "misses": self.worker.misses,
        }

    def check_health(self) -> None:
        """The model can run a step: a two-token sequence drafts one token, then is freed."""
        probe = DraftSeqDelta("__health__", 0, 0, [1, 2], 1, SamplingParams(), 0)
        response = self._step(DraftStepRequest("__health__", [probe], release=[]))
        with self.lock:
            self.worker.step(DraftStepRequest("__health__", [], release=["__health__"]))
        if len(response.proposals.get("__health__", _EMPTY).tokens) != 1:
            raise RuntimeError("the draft model did not propose a token for a health probe")

    def __del__(self) -> None:
        server = getattr(self, "server", None)
        if server is not None:
            server.close()


class _Empty:
    tokens: list[int] = []


_EMPTY = _Empty()
