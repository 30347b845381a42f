"""One request's life across target replicas: admission, streaming, failover, usage.

A target replica that dies mid-request is replaced transparently: the request is
re-issued to another replica with the prompt plus every token already streamed, and
per-position seeded sampling makes the continuation the one the lost replica would have
produced (identical under greedy decoding).
"""

import asyncio
import dataclasses
import logging
import time
import uuid
from typing import TYPE_CHECKING, Any, AsyncIterator

from fastapi.responses import JSONResponse
from ray.exceptions import RayError, TaskCancelledError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

from app.acceptance import AcceptanceStats
from app.generation_protocol import GenerateChunk, GenerateRequest
from app.openai_protocol import SpeculationUsage, Usage, error_body
from app.policy import SpeculationDecision

if TYPE_CHECKING:
    from deployments.router import Router

log = logging.getLogger("ray.serve")
MAX_FAILOVERS = 3
# The router's own deadline runs this much past the target's (request_timeout_s), so a
# target that is alive answers its own TimeoutError first; a hung one is cut off here.
DEADLINE_GRACE_S = 2.0


def timeout_error(timeout_s: float) -> "RequestError":
    return RequestError(504, f"request exceeded its {timeout_s:g}s deadline (engine.limits.request_timeout_s)",
                        type_="timeout_error", code="request_timeout")


class RequestError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str = "invalid_request_error", headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type_ = status, message, param, code, type_
        self.headers = headers or {}

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.message, self.type_, self.param, self.code), self.status, self.headers)



class RequestRun:
    """One request's life across target replicas: streams chunks, fails over, accounts usage."""

    def __init__(self, router: "Router", request: GenerateRequest, decision: SpeculationDecision,
                 requested: str, prompt_class: str) -> None:
        self.router, self.request, self.decision = router, request, decision
        self.requested, self.prompt_class = requested, prompt_class
        self.tokens: list[int] = []
        self.stats = AcceptanceStats()
        self.started = time.monotonic()
        self.deadline = self.started + request.timeout_s
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.finished = False  # a chunk with a finish reason arrived
        self.failed = False  # ended by a RequestError (the router counts it as an error)
        self.replica = ""  # the target replica that streamed the last chunk
        self._stream: AsyncIterator[GenerateChunk] | None = None
        self._response = None

    def _open(self) -> AsyncIterator[GenerateChunk]:
        r = self.request
        sampling = r.sampling.model_copy(update={"max_tokens": r.sampling.max_tokens - len(self.tokens)})
        # a re-issued request gets what is left of the deadline, not a fresh one
        timeout_s = max(0.05, self.deadline - time.monotonic())
        req = dataclasses.replace(r, request_id=f"{r.request_id}-{uuid.uuid4().hex[:6]}",
                                  prompt_ids=r.prompt_ids + self.tokens, sampling=sampling, timeout_s=timeout_s)
        self._response = self.router.target.options(stream=True).generate.remote(req)
        return self._response.__aiter__()

    def _cancel(self) -> None:
        if self._response is None:
            return
        try:
            self._response.cancel()
        except Exception:  # noqa: BLE001 — cancel() re-raises a failed assignment (e.g. BackPressureError)
            pass

    async def first(self) -> GenerateChunk:
        """Admission: the first chunk (or a 4xx/429 before any byte of the response is sent)."""
        self.router.in_flight += 1
        self.router.active_runs.add(self)
        try:
            async for chunk in self._attempts():
                return chunk
        except BaseException:
            self.router.in_flight -= 1
            self.router.active_runs.discard(self)
            self._cancel()
            raise
        raise RequestError(500, "target produced no output", type_="server_error")

    async def chunks(self, first: GenerateChunk | None = None) -> AsyncIterator[GenerateChunk]:
        if first is None:
            first = await self.first()
        try:
            yield first
            if first.finish_reason is None:
                async for chunk in self._attempts(resume=True):
                    yield chunk
                    if chunk.finish_reason is not None:
                        break
        except RequestError:
            self.failed = True
            raise
        finally:
            if not self.finished and not self.failed:
                self.router.metrics.record_finished("abort")  # the client went away / cancelled
            self.router.in_flight -= 1
            self.router.active_runs.discard(self)
            self._cancel()  # client gone or done: the target frees the sequence

    async def _attempts(self, resume: bool = False) -> AsyncIterator[GenerateChunk]:
        failures = 0
        stream = self._stream if resume and self._stream is not None else None
        while True:
            if stream is None:
                stream = self._stream = self._open()
            try:
                while True:
                    remaining = self.deadline + DEADLINE_GRACE_S - time.monotonic()
                    try:
                        # asyncio.timeout, not wait_for (which on 3.11 can swallow a client's cancel)
                        async with asyncio.timeout(max(remaining, 0.01)):
                            chunk = await stream.__anext__()
                    except StopAsyncIteration:
                        return
                    if chunk.error:
                        headers = {"Retry-After": "1"} if chunk.status == 429 else None
                        raise RequestError(chunk.status, chunk.error, type_="server_overloaded"
                                           if chunk.status == 429 else "invalid_request_error", headers=headers)
                    self._account(chunk)
                    yield chunk
                    if chunk.finish_reason is not None:
                        return
            except TimeoutError as e:
                # the target's own deadline (a RayTaskError that is also a TimeoutError), or ours
                # when a hung target neither answered nor timed out itself: not a replica
                # failure, so no re-issue
                raise timeout_error(self.request.timeout_s) from e
            except TaskCancelledError:
                raise  # we (or Serve, for a gone client) cancelled it: nothing to re-issue
            except (BackPressureError, DeploymentUnavailableError) as e:
                raise RequestError(503, f"no target replica can take this request now ({type(e).__name__}); "
                                        "retry later", type_="server_overloaded", code="service_unavailable",
                                   headers={"Retry-After": "1"}) from None
            except (RayError, ConnectionError) as e:
                # ActorDiedError / ActorUnavailableError (both RayActorError) when a replica dies
                # mid-stream; RayTaskError when its engine failed the step
                failures += 1
                self.router.failovers += 1
                self.router.metrics.record_failover()
                log.warning("target replica failed mid-request (%s); re-issuing with %d streamed tokens",
                            type(e).__name__, len(self.tokens))
                if failures > MAX_FAILOVERS:
                    raise RequestError(503, "target replicas keep failing; retry later", type_="server_error",
                                       headers={"Retry-After": "5"}) from e
                self._cancel()
                await asyncio.sleep(0.2 * failures)
                stream = None

    def _account(self, chunk: GenerateChunk) -> None:
        metrics = self.router.metrics
        if chunk.token_ids:
            now = time.monotonic()
            if self.first_token_at is None:
                self.first_token_at = now
                metrics.observe_ttft(now - self.started)
                metrics.record_prompt_tokens(len(self.request.prompt_ids))
            else:
                metrics.observe_itl(now - self.last_token_at)
            self.last_token_at = now
            metrics.record_generation_tokens(len(chunk.token_ids))
        self.tokens += chunk.token_ids
        self.replica = chunk.replica or self.replica
        self.stats.record(chunk.drafted, chunk.accepted)
        if chunk.drafted:
            self.router.policy.observe_verification(self.prompt_class, chunk.drafted, chunk.accepted)
        if chunk.finish_reason is not None and not self.finished:
            self.finished = True
            metrics.observe_e2e(time.monotonic() - self.started)
            metrics.record_finished(chunk.finish_reason)
        if chunk.finish_reason in ("stop", "length"):
            self.router.policy.observe_finished(self.prompt_class, len(self.tokens), chunk.finish_reason)
            if self.first_token_at is not None and len(self.tokens) > 1:
                self.router.metrics.observe_tpot((time.monotonic() - self.first_token_at) / (len(self.tokens) - 1))

    def usage(self) -> Usage:
        s, d = self.stats, self.decision
        spec = SpeculationUsage(
            mode="speculative" if d.speculate else "plain", requested=self.requested, k=d.k, reason=d.reason,
            adaptive=self.request.adaptive,
            drafted_tokens=s.num_draft_tokens, accepted_tokens=s.num_accepted_tokens, num_drafts=s.num_drafts,
            acceptance_rate=s.acceptance_rate, mean_acceptance_length=s.mean_acceptance_length,
            expected_speedup=round(d.expected_speedup, 3), batch_size=d.batch_size,
        )
        n_prompt = len(self.request.prompt_ids)
        return Usage(prompt_tokens=n_prompt, completion_tokens=len(self.tokens),
                     total_tokens=n_prompt + len(self.tokens), speculation=spec)


def provenance(tokenizer, chunk: GenerateChunk) -> list[dict[str, Any]]:
    """Per-token origin for the playground: the first `accepted` tokens came from the draft."""
    return [
        {"id": t, "text": tokenizer.decode([t]), "origin": "draft" if i < chunk.accepted else "target"}
        for i, t in enumerate(chunk.token_ids)
    ]
