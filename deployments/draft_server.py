"""DraftServer: the draft model and its per-sequence KV caches, one per replica.

Serves one batched `step()` per target step for every target replica pinned to it.
Its state is only a cache: a replica that lost a sequence answers *miss* and is sent
the full token ids (app/draft_protocol.py).
"""

from __future__ import annotations

import threading

from ray import serve

from app.config import AppConfig
from app.draft_protocol import DraftStepRequest, DraftStepResponse, DraftWorker
from app.proposers import DraftModelProposer
from deployments.metrics_ray import ServeMetrics


@serve.deployment
class DraftServer:
    def __init__(self, config: dict) -> None:
        app_config = AppConfig.model_validate(config)
        if app_config.engine.draft is None:
            raise ValueError("DraftServer needs engine.draft in the config")
        self.proposer = DraftModelProposer(app_config.engine.draft)
        self.worker = DraftWorker(self.proposer)
        # torch work is synchronous: serialise calls from several target replicas
        self.lock = threading.Lock()
        self.metrics = ServeMetrics()

    def step(self, request: DraftStepRequest) -> DraftStepResponse:
        with self.lock:
            response = self.worker.step(request)
            self.metrics.observe_step("draft", response.draft_time_s)
            return response

    def num_cached_sequences(self) -> int:
        return self.proposer.num_cached_sequences()

    def record_routing_stats(self) -> dict:
        return {
            "sequences": self.worker.num_sequences(),
            "kv_tokens": self.proposer.cached_tokens(),
            "misses": self.worker.misses,
        }

    def check_health(self) -> None:
        return None
