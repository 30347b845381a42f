"""One request's life across target replicas: admission, streaming, failover, usage.

A target replica that dies mid-request is replaced transparently: the request is
re-issued to another replica with the prompt plus every token already streamed, and
per-position seeded sampling makes the continuation the one the lost replica would have
produced (identical under greedy decoding).
"""

import asyncio
import contextvars
import dataclasses
import statistics
import logging
import time
import uuid
from typing import Any, AsyncIterator, Protocol

from fastapi.responses import JSONResponse
from ray.exceptions import RayError, TaskCancelledError
from ray.serve import context as serve_context
from ray.serve._private.utils import generate_request_id
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

from app.engine.acceptance import AcceptanceStats
from app.protocol.generation import GenerateChunk, GenerateRequest
from app.protocol.openai_api import SpeculationUsage, Usage, error_body
from app.policy import SpeculationDecision

from ray.serve.handle import DeploymentHandle

from app.policy import SpeculationPolicy
from deployments.metrics_ray import ServeMetrics


class RunHost(Protocol):
    """What a RequestRun uses of the router that owns it (deployments/router.py's Router): the
    target handle, the policy it teaches, the metrics and the counters it keeps up to date."""

    target: DeploymentHandle
    policy: SpeculationPolicy
    metrics: ServeMetrics
    failovers: int
    in_flight: int
    active_runs: set["RequestRun"]

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

    def __init__(self, router: RunHost, request: GenerateRequest, decision: SpeculationDecision,
                 requested: str, prompt_class: str, shares_request: bool = False, count_prompt: bool = True) -> None:
        self.router, self.request, self.decision = router, request, decision
        self.requested, self.prompt_class = requested, prompt_class
        self.shares_request = shares_request  # one of several runs of one HTTP request (n > 1, prompts)
        self.count_prompt = count_prompt  # the prompt's first choice: its tokens count once (n > 1)
        self.failovers = 0
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
        # a re-issued request resumes after what was streamed, with what is left of the deadline
        timeout_s = max(0.05, self.deadline - time.monotonic())
        req = dataclasses.replace(r, request_id=f"{r.request_id}-{uuid.uuid4().hex[:6]}",
                                  output_ids=tuple(self.tokens), timeout_s=timeout_s)
        call = self.router.target.options(stream=True).generate.remote
        self._response = _with_own_serve_id(call, req) if self.shares_request else call(req)
        return self._response.__aiter__()

    def _cancel(self) -> None:
        if self._response is None:
            return
        try:
            self._response.cancel()
        except Exception:  # noqa: BLE001 — cancel() re-raises a failed assignment (e.g. BackPressureError)
            pass

    def release(self) -> None:
        """Undo an admission whose chunks will never be read (another choice of the same request
        was refused, or the client left first): give back the slot and stop the target."""
        self.router.in_flight -= 1
        self.router.active_runs.discard(self)
        self._cancel()

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
            self._log_end()
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
                self.failovers += 1
                self.router.failovers += 1
                self.router.metrics.record_failover()
                log.warning("target replica failed mid-request (%s); re-issuing with %d streamed tokens",
                            type(e).__name__, len(self.tokens), extra=self.log_extra())
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
                if self.count_prompt:
                    metrics.record_prompt_tokens(len(self.request.prompt_ids))
            else:
                metrics.observe_itl(now - self.last_token_at)
            self.last_token_at = now
            metrics.record_generation_tokens(len(chunk.token_ids))
        self.tokens += chunk.token_ids
        self.replica = chunk.replica or self.replica
        for _, drafted, accepted in chunk.parts():
            self.stats.record(drafted, accepted)
            if drafted:
                self.router.policy.observe_verification(self.prompt_class, drafted, accepted)
        if chunk.finish_reason is not None and not self.finished:
            self.finished = True
            metrics.observe_e2e(time.monotonic() - self.started)
            metrics.record_finished(chunk.finish_reason)
        if chunk.finish_reason in ("stop", "length"):
            self.router.policy.observe_finished(self.prompt_class, len(self.tokens), chunk.finish_reason)
            if self.first_token_at is not None and len(self.tokens) > 1:
                self.router.metrics.observe_tpot((time.monotonic() - self.first_token_at) / (len(self.tokens) - 1))

    def log_extra(self) -> dict[str, Any]:
        """Fields of this run's log records: Serve's JSON logs put them beside its request_id."""
        completion_id, choice = self.request.request_id, 0
        if self.shares_request:  # "<completion id>-<choice>"
            completion_id, _, index = completion_id.rpartition("-")
            choice = int(index) if index.isdigit() else 0
        return {"completion_id": completion_id, "choice": choice}

    def _log_end(self) -> None:
        now = time.monotonic()
        outcome = "error" if self.failed else ("finished" if self.finished else "abort")
        log.info("completion %s %s: %d prompt + %d completion tokens in %.3fs (first token %s), %d failovers",
                 self.log_extra()["completion_id"], outcome, len(self.request.prompt_ids), len(self.tokens),
                 now - self.started, "none" if self.first_token_at is None else
                 f"{self.first_token_at - self.started:.3f}s", self.failovers,
                 extra={**self.log_extra(), "outcome": outcome, "completion_tokens": len(self.tokens),
                        "e2e_s": round(now - self.started, 4), "target_replica": self.replica})

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


def provenance(tokenizer, chunk: GenerateChunk) -> dict[str, Any]:
    """The stream's `specserve` extension: per-token origin (the first `accepted` tokens of each
    engine step came from the draft) and the number of tokens of each engine step in the chunk
    (a slow reader's chunk carries several steps)."""
    tokens = [
        {"id": t, "text": tokenizer.decode([t]), "origin": "draft" if drafted else "target"}
        for t, drafted in zip(chunk.token_ids, chunk.origins())
    ]
    return {"tokens": tokens, "steps": [n for n, _, _ in chunk.parts()]}


def _with_own_serve_id(call, *args):
    """`call(*args)` (a handle's .remote) under its own Serve internal request id.

    A handle call inherits the internal request id of the request it is made in, and Serve's
    handle router tracks pending calls by that id: of several concurrent calls from one ingress
    request (one per choice), one is assigned and the others wait forever. In a copy of the
    context, the call gets an id of its own (Serve's _RequestContext is private, frozen: replaced).
    """
    def run():
        ctx = serve_context._get_serve_request_context()
        serve_context._serve_request_context.set(dataclasses.replace(ctx, _internal_request_id=generate_request_id()))
        return call(*args)

    return contextvars.copy_context().run(run)


# ---- one request of several generations (n > 1, a list of prompts): one run per choice ----------
async def admit(runs: list[RequestRun]) -> list[GenerateChunk]:
    """Every run's first chunk, admitted concurrently: all or none. When one is refused (or the
    caller is cancelled), the runs already admitted are released and the first error is raised."""
    if len(runs) == 1:
        return [await runs[0].first()]
    tasks = [asyncio.create_task(run.first()) for run in runs]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        failed = next((t for t in tasks if t.done() and not t.cancelled() and t.exception()), None)
        if failed is None:
            return [t.result() for t in tasks]
        for t in tasks:
            t.cancel()  # a run not yet admitted undoes its own admission (RequestRun.first)
        await asyncio.gather(*tasks, return_exceptions=True)
        raise failed.exception()
    except BaseException:
        for t in tasks:
            t.cancel()
        for run, t in zip(runs, tasks):
            if t.done() and not t.cancelled() and t.exception() is None:
                run.release()
        raise


async def collect(runs: list[RequestRun]) -> list[list[GenerateChunk]]:
    """Every run's chunks (non-streaming), run concurrently; the first error cancels the others."""
    async def one(run: RequestRun) -> list[GenerateChunk]:
        return [c async for c in run.chunks()]

    if len(runs) == 1:
        return [await one(runs[0])]
    tasks = [asyncio.create_task(one(run)) for run in runs]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for t in tasks:
            if t.done() and not t.cancelled() and t.exception() is not None:
                raise t.exception()
        return [t.result() for t in tasks]
    finally:
        for t in tasks:
            t.cancel()  # no-op for finished ones; RequestRun.chunks cleans up a cancelled one


async def merged_chunks(runs: list[RequestRun],
                        firsts: list[GenerateChunk]) -> AsyncIterator[tuple[int, GenerateChunk]]:
    """(run index, chunk) of admitted runs as their chunks arrive (streaming). The first error ends
    it; closing it early (the client left) cancels every run."""
    if len(runs) == 1:
        async for chunk in runs[0].chunks(firsts[0]):
            yield 0, chunk
        return
    queue: asyncio.Queue[tuple[int, GenerateChunk | None, BaseException | None]] = asyncio.Queue()
    started = [False] * len(runs)

    async def pump(i: int) -> None:
        started[i] = True
        try:
            async for chunk in runs[i].chunks(firsts[i]):
                queue.put_nowait((i, chunk, None))
        except Exception as e:  # noqa: BLE001 — handed to the consumer, which raises it
            queue.put_nowait((i, None, e))
        else:
            queue.put_nowait((i, None, None))

    tasks = [asyncio.create_task(pump(i)) for i in range(len(runs))]
    try:
        left = len(runs)
        while left:
            i, chunk, error = await queue.get()
            if error is not None:
                raise error
            if chunk is None:
                left -= 1
            else:
                yield i, chunk
    finally:
        for i, t in enumerate(tasks):
            t.cancel()
            if not started[i]:
                runs[i].release()  # cancelled before it began: its chunks() never ran to clean up


def combined_usage(runs: list[RequestRun], prompt_tokens: int) -> Usage:
    """One request's usage over its runs: prompt tokens once per prompt (`prompt_tokens`), completion
    tokens and speculation counts summed over the choices. Where the runs' decisions differ (a list
    of prompts), mode is "speculative" if any speculated, k the deepest, the reasons joined by ",",
    the expected speedup their mean."""
    if len(runs) == 1:
        return runs[0].usage()
    usages = [run.usage() for run in runs]
    specs = [u.speculation for u in usages if u.speculation is not None]
    stats = AcceptanceStats()
    for run in runs:
        stats.merge(run.stats)
    completion = sum(u.completion_tokens for u in usages)
    spec = SpeculationUsage(
        mode="speculative" if any(s.mode == "speculative" for s in specs) else "plain",
        requested=specs[0].requested, k=max(s.k for s in specs),
        reason=",".join(dict.fromkeys(s.reason for s in specs)), adaptive=any(s.adaptive for s in specs),
        drafted_tokens=stats.num_draft_tokens, accepted_tokens=stats.num_accepted_tokens, num_drafts=stats.num_drafts,
        acceptance_rate=stats.acceptance_rate, mean_acceptance_length=stats.mean_acceptance_length,
        expected_speedup=round(statistics.fmean(s.expected_speedup or 1.0 for s in specs), 3),
        batch_size=max((s.batch_size for s in specs if s.batch_size is not None), default=None),
    )
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion,
                 total_tokens=prompt_tokens + completion, speculation=spec)
