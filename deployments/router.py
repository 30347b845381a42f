"""Router: the HTTP ingress. Validates, tokenizes, asks the policy, streams from a target replica.

OpenAI-compatible: /v1/completions, /v1/chat/completions (stream or not), /v1/models,
/health; /tokenize and /detokenize as vLLM's. Bad input gets OpenAI error JSON with a 4xx. A
request for several choices (n > 1, a list of prompts) runs one generation per choice on the
targets, concurrently. A target replica that dies mid-request is replaced transparently: the
request is re-issued to another replica, which resumes after every token already streamed, so the
stream continues where it stopped.
"""

import asyncio
import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, StreamingResponse
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException

from app.api_key import ApiKeys, is_open_path
from app.config import AppConfig, UserConfig
from app.health import ProbeSettings, TargetHealth
from app.protocol.generation import GenerateChunk, GenerateRequest
from app.runners.loading import load_tokenizer
from app.protocol.openai_api import (
    ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeChatRequest,
    TokenizeRequest, best_of_order, chat_chunk, chat_response, completion_chunk, completion_response, error_body,
    logprobs_block, new_id,
    template_messages, tokenize_model,
)
from app.policy import LoadSnapshot, PolicyRequest, SpeculationDecision, SpeculationPolicy, classify_prompt
from deployments.metrics_ray import ServeMetrics
from deployments.replica_info import live_config
from deployments.request_body import json_body, parse_body
from deployments.request_router import load_registry
from deployments.request_run import (
    RequestError, RequestRun, admit, collect, combined_usage, merged_chunks, provenance,
)

log = logging.getLogger("ray.serve")
fastapi_app = FastAPI(title="specserve", description="speculative decoding on Ray Serve")
PLAYGROUND = Path(__file__).resolve().parent.parent / "app" / "static" / "playground.html"
DEFAULT_MAX_TOKENS = 256
STATS_FRESH_S = 3.0  # published running/waiting older than this are not trusted (stats period: 1 s)


@fastapi_app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """Unknown routes and wrong methods answer OpenAI error JSON too, not FastAPI's {"detail"}."""
    if exc.status_code == 404:
        message = f"no such route: {request.method} {request.url.path} (see /docs for the API)"
    elif exc.status_code == 405:
        message = f"method {request.method} is not allowed on {request.url.path}"
    else:
        message = str(exc.detail)
    return JSONResponse(error_body(message, "invalid_request_error", code=str(exc.status_code)),
                        status_code=exc.status_code, headers=getattr(exc, "headers", None))


# This replica's Router state the ASGI middleware needs (API keys, metrics). Serve ships the
# ingress class and a frozen copy of `fastapi_app` to the replica by value, so neither a global
# nor `fastapi_app.state` is shared between them: both sides look the one real module up by name.
_REPLICA_STATE: dict[str, Any] = {}


def replica_state() -> dict[str, Any]:
    import importlib

    return importlib.import_module("deployments.router")._REPLICA_STATE


class ApiKeyMiddleware:
    """Optional API key (app/api_key.py): without a valid `Authorization: Bearer` key a request is
    answered 401 with OpenAI's error JSON. Open paths (/health, ...) pass, and so does everything
    when the router's environment sets no key. Pure ASGI (no BaseHTTPMiddleware), so streaming and
    client-disconnect handling are untouched; the keys are the replica's (Router.__init__)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        state = replica_state()
        keys: ApiKeys | None = state.get("api_keys")
        if scope["type"] != "http" or keys is None or not keys.enabled:
            return await self.app(scope, receive, send)
        path, root = scope["path"], scope.get("root_path", "")
        if root and path.startswith(root):  # a route_prefix other than "/"
            path = path[len(root):] or "/"
        header = next((v for k, v in scope["headers"] if k == b"authorization"), None)
        failure = None if is_open_path(path) else keys.check(header.decode("latin-1") if header else None)
        if failure is None:
            return await self.app(scope, receive, send)
        metrics = state.get("metrics")
        if metrics is not None:
            metrics.record_error(401)
        response = JSONResponse(error_body(failure.message, "invalid_request_error", None, failure.code),
                                status_code=401, headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)


fastapi_app.add_middleware(ApiKeyMiddleware)


@serve.deployment
@serve.ingress(fastapi_app)
class Router:
    def __init__(self, config: dict, target: DeploymentHandle) -> None:
        self.config = AppConfig.model_validate(config)
        self.target = target
        self.tokenizer = load_tokenizer(self.config.engine.target)
        cfg = self.config.engine.target
        self.max_context = cfg.max_context or int(getattr(self.tokenizer, "model_max_length", 2048))
        self.has_draft = self.config.engine.draft is not None or self.config.engine.speculation.proposer == "ngram"
        self.policy = SpeculationPolicy(self.config.policy)
        self.metrics = ServeMetrics(model_name=self.config.model_name)
        # Optional API key from the replica's environment, never the config (app/api_key.py).
        api_keys = ApiKeys.from_env()
        replica_state().update(api_keys=api_keys, metrics=self.metrics)
        log.info("API key %s", "required (Authorization: Bearer)" if api_keys.enabled else "off")
        self.in_flight = 0
        self.failovers = 0  # target replica failures survived by re-issuing (RequestRun)
        self.active_runs: set[RequestRun] = set()
        # Does a target replica answer? A background probe (app/health.py), started on the event
        # loop by the first /health or Serve health check.
        self.target_health = TargetHealth(ProbeSettings.from_env())
        self._probe_loop_task: asyncio.Task | None = None
        self._probe_task: asyncio.Task | None = None

    # ---- health ------------------------------------------------------------------------
    def _ensure_probing(self) -> None:
        if self._probe_loop_task is None or self._probe_loop_task.done():
            self._probe_loop_task = asyncio.get_running_loop().create_task(self._probe_loop())

    async def _probe_loop(self) -> None:
        while True:
            await self._probe()
            await asyncio.sleep(self.target_health.settings.probe_period_s)

    async def _probe(self) -> None:
        """One probe at a time, shared by whoever asks (the loop, a /health before any answer)."""
        if self._probe_task is None or self._probe_task.done():
            self._probe_task = asyncio.get_running_loop().create_task(self._probe_once())
        await asyncio.shield(self._probe_task)

    async def _probe_once(self) -> None:
        health = self.target_health
        response = self.target.check_health.remote()
        try:
            async with asyncio.timeout(health.settings.probe_timeout_s):
                await response
            health.record_answered(time.monotonic())
        except TimeoutError:
            response.cancel()
            if self._targets_publishing():
                health.record_busy(time.monotonic())  # every request slot taken by streams: alive
            else:
                health.record_failure(time.monotonic(), f"no target replica answered within "
                                                        f"{health.settings.probe_timeout_s:g}s")
        except Exception as e:  # noqa: BLE001 — any failure to reach a healthy target is the answer
            cause = getattr(e, "cause", None) or e  # a RayTaskError carries the target's own exception
            health.record_failure(time.monotonic(), f"{type(e).__name__}: {type(cause).__name__}: "
                                                    f"{str(cause).splitlines()[0][:300] if str(cause) else ''}")

    def _targets_publishing(self) -> bool:
        """A target replica published routing stats lately (Serve's controller polls them past the
        request queue; the probe's routing attempt refreshed this router's copy)."""
        now = time.time()
        replicas = load_registry().get(self.target.deployment_id.name, {})
        return any(now - float(stats.get("time", 0.0)) <= STATS_FRESH_S for stats, _seen in replicas.values() if stats)

    async def check_health(self) -> None:
        """Serve's periodic health check of this router: failed once no target replica has
        answered for down_after_s (after one did), so the Router deployment shows the outage."""
        self._ensure_probing()
        now = time.monotonic()
        if self.target_health.down(now):
            raise RuntimeError(f"no target replica answered for {now - self.target_health.last_ok:.0f}s "
                               f"(last probe: {self.target_health.last_result})")

    # ---- routes ----------------------------------------------------------------------
    @fastapi_app.get("/health")
    async def health(self) -> JSONResponse:
        """200 while a target replica answers the router's probe, 503 otherwise (app/health.py)."""
        self._ensure_probing()
        if self.target_health.probes == 0:
            await self._probe()  # the first caller waits for the first answer rather than a guess
        now = time.monotonic()
        ready = self.target_health.ready(now)
        return JSONResponse({"status": "ok" if ready else "unhealthy", "model": self.config.model_name,
                             "target": self.target_health.describe(now)}, status_code=200 if ready else 503)

    @fastapi_app.get("/v1/models")
    async def models(self) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [
            {"id": self.config.model_name, "object": "model", "created": 0, "owned_by": "specserve",
             "max_model_len": self.max_context}
        ]})

    @fastapi_app.get("/")
    async def playground(self):
        if PLAYGROUND.exists():
            return FileResponse(PLAYGROUND, media_type="text/html")
        return JSONResponse({"message": "specserve: POST /v1/completions"})

    @fastapi_app.post("/v1/completions", openapi_extra=json_body(CompletionRequest))
    async def completions(self, request: Request):
        return self._count_error(await self._handle(request, chat=False))

    @fastapi_app.post("/v1/chat/completions", openapi_extra=json_body(ChatCompletionRequest))
    async def chat_completions(self, request: Request):
        return self._count_error(await self._handle(request, chat=True))

    @fastapi_app.post("/tokenize", openapi_extra=json_body(TokenizeRequest))
    async def tokenize(self, request: Request) -> JSONResponse:
        """As vLLM's: {"prompt"} or {"messages"} -> {"count", "max_model_len", "tokens", "token_strs"}.
        By default the ids /v1/completions and /v1/chat/completions would feed the model."""
        try:
            body = await self._parse(request, tokenize_model)
            self._check_model(body.model)
            if isinstance(body, TokenizeChatRequest):
                text = self.tokenizer.apply_chat_template(body.template_messages(), tokenize=False,
                                                          add_generation_prompt=body.add_generation_prompt)
            else:
                text = body.prompt
            ids = self.tokenizer(text, add_special_tokens=body.add_special_tokens)["input_ids"]
        except RequestError as e:
            return e.response()
        strs = self.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return JSONResponse({"count": len(ids), "max_model_len": self.max_context, "tokens": ids, "token_strs": strs})

    @fastapi_app.post("/detokenize", openapi_extra=json_body(DetokenizeRequest))
    async def detokenize(self, request: Request) -> JSONResponse:
        """As vLLM's: {"tokens"} -> {"prompt"}."""
        try:
            body = await self._parse(request, DetokenizeRequest)
            self._check_model(body.model)
            vocab = len(self.tokenizer)
            if any(t < 0 or t >= vocab for t in body.tokens):
                raise RequestError(400, f"token ids must lie in [0, {vocab})", "tokens")
        except RequestError as e:
            return e.response()
        return JSONResponse({"prompt": self.tokenizer.decode(body.tokens)})

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.config.model_name:
            raise RequestError(404, f"model {model!r} does not exist; this server serves "
                                    f"{self.config.model_name!r} (see GET /v1/models)", "model", "model_not_found")

    def _count_error(self, response):
        """specserve_request_errors_total{status} for a request answered with a 4xx/5xx."""
        if getattr(response, "status_code", 200) >= 400:
            self.metrics.record_error(response.status_code)
        return response

    async def reliability_state(self) -> dict[str, Any]:
        """For tests and bench/soak.py (via a handle): in-flight requests per target replica.
        Async: it runs on the event loop that mutates active_runs, never beside it."""
        by_replica: dict[str, int] = {}
        for run in self.active_runs:
            if run.replica:
                by_replica[run.replica] = by_replica.get(run.replica, 0) + 1
        return {"in_flight": self.in_flight, "failovers": self.failovers, "by_replica": by_replica}

    async def reconfigure(self, user_config: dict[str, Any] | None) -> None:
        """Serve's user_config (UserConfig), at start and on every `serve deploy` that changes it: the
        policy in force becomes args' `policy` with user_config's `policy` over it, applied to the live
        policy (SpeculationPolicy.reconfigure) without a restart. Async: on the event loop that decides."""
        policy = UserConfig.model_validate(user_config or {}).policy_over(self.config.policy)
        rebuilt = self.policy.reconfigure(policy)
        log.info("policy reconfigured from user_config%s", f" (rebuilt: {', '.join(rebuilt)})" if rebuilt else "")

    async def live_config(self) -> dict[str, Any]:
        """For ops and tests (via a handle): this replica's identity and the settings in force."""
        return live_config(self.policy.config)

    async def policy_state(self) -> dict[str, Any]:
        """For tests and benches (via a handle): what the policy has learned, and the load it sees.
        Async: it runs on the event loop that decides (and ingests), never beside it.

        `ingested` maps "replica/kind" -> last publication counter taken into the cost model;
        `target_curve` / `draft_curve` are (tokens or batch, seconds, measured?) per grid point."""
        costs = self.policy.costs
        return {
            "load": self._load().model_dump(mode="json"),
            "ingested": {f"{replica}/{kind}": seq for (replica, kind), seq in dict(self.policy._seen).items()},
            "target_curve": [p for p in costs.target_points() if p[2]],
            "draft_curve": [p for p in costs.draft_points() if p[2]],
            "exchange_s": costs.t_exchange,
            "alpha": {c: self.policy.acceptance.alpha(c) for c in ("code", "prose", "chat")},
            "registry": {name: {r: {"stats": s, "seen_s_ago": time.monotonic() - t} for r, (s, t) in dict(reps).items()}
                         for name, reps in dict(load_registry()).items()},
        }

    # ---- request handling --------------------------------------------------------------
    async def _handle(self, request: Request, chat: bool):
        try:
            body = await self._parse(request, ChatCompletionRequest if chat else CompletionRequest)
            self._check_model(body.model)
            prompts = self._tokenize(body, chat)
            rooms = [self._room(body, ids, chat, i if len(prompts) > 1 else None) for i, (ids, _) in enumerate(prompts)]
            for room in rooms:
                body.sampling(default_max_tokens=min(DEFAULT_MAX_TOKENS, room))
        except ValueError as e:  # the sampling settings contradict each other (min_tokens > max_tokens)
            return RequestError(400, str(e), "min_tokens").response()
        except RequestError as e:
            return e.response()
        rid = new_id("chatcmpl" if chat else "cmpl")
        # n generations per prompt, prompt-major (choice index = prompt index * n + j), as OpenAI's;
        # with best_of > n, best_of per prompt of which the n best are returned
        per_prompt = max(body.n, getattr(body, "best_of", None) or 0)
        ranked = per_prompt > body.n
        runs: list[RequestRun] = []
        for (prompt_ids, text), room in zip(prompts, rooms):
            default_max = min(DEFAULT_MAX_TOKENS, room)
            sampling = body.sampling(default_max_tokens=default_max)
            decision = self._decide(body, sampling, len(prompt_ids), text, chat)
            max_k, adaptive = self.policy.engine_depth(decision, sampling.max_tokens)
            for j in range(per_prompt):
                choice_sampling = body.sampling(default_max_tokens=default_max, choice=j)
                if ranked and choice_sampling.logprobs is None:  # best_of ranks by the tokens' logprobs
                    choice_sampling = choice_sampling.model_copy(update={"logprobs": 0})
                gen = GenerateRequest(rid if len(prompts) * per_prompt == 1 else f"{rid}-{len(runs)}", prompt_ids,
                                      choice_sampling, max_k,
                                      self.config.engine.limits.request_timeout_s, adaptive=adaptive,
                                      alpha_prior=decision.alpha, streaming=bool(body.stream))
                runs.append(RequestRun(self, gen, decision, body.speculation, classify_prompt(text, chat=chat),
                                       shares_request=len(prompts) * per_prompt > 1, count_prompt=j == 0))
        echoes = [text for _, text in prompts for _ in range(body.n)] if not chat and body.echo else None
        prompt_tokens = sum(len(ids) for ids, _ in prompts)
        # one line per request: Serve's JSON log record carries its request_id beside completion_id
        log.info("completion %s: %d prompt tokens, %d choice(s), speculation %s, stream=%s", rid, prompt_tokens,
                 len(runs), ",".join(sorted({r.decision.reason for r in runs})), bool(body.stream),
                 extra={"completion_id": rid, "prompt_tokens": prompt_tokens, "choices": len(runs)})
        if body.stream:
            try:
                firsts = await admit(runs)
            except RequestError as e:
                return e.response()
            return StreamingResponse(self._sse(runs, firsts, rid, chat, body.return_provenance, echoes, prompt_tokens,
                                               body.usage_in_stream()), media_type="text/event-stream")
        try:
            outputs = await collect(runs)
        except RequestError as e:
            return e.response()
        if ranked:  # keep each prompt's n best generations, best first
            keep = []
            for p in range(len(prompts)):
                group = outputs[p * per_prompt:(p + 1) * per_prompt]
                scores = [[lp for c in chunks for lp, _ in (c.logprobs or [])] for chunks in group]
                keep += [p * per_prompt + i for i in best_of_order(scores, body.n)]
            outputs = [outputs[i] for i in keep]
            if body.logprob_count() is None:  # asked for by the ranking only
                outputs = [[dataclasses.replace(c, logprobs=None) for c in chunks] for chunks in outputs]
        choices, blocks = [], []
        for i, chunks in enumerate(outputs):
            text_out = (echoes[i] if echoes else "") + "".join(c.text for c in chunks)
            choices.append((text_out, chunks[-1].finish_reason if chunks else None))
            asked = any(c.logprobs is not None for c in chunks)
            blocks.append(logprobs_block(self._decode_one, [e for c in chunks for e in self._token_logprobs(c)], chat,
                                         len(echoes[i]) if echoes else 0) if asked else None)
        make = chat_response if chat else completion_response
        return JSONResponse(make(rid, self.config.model_name, choices, combined_usage(runs, prompt_tokens), blocks))

    def _decode_one(self, token: int) -> str:
        return self.tokenizer.decode([token])

    @staticmethod
    def _token_logprobs(chunk: GenerateChunk) -> list[tuple[int, float, list[tuple[int, float]]]]:
        """A chunk's per-token (id, logprob, alternatives), for logprobs_block. (A method, not a module
        function: Serve ships this class by value, and a comprehension's globals do not travel.)"""
        return [(t, lp, alts) for t, (lp, alts) in zip(chunk.token_ids, chunk.logprobs or [])]

    def _room(self, body, prompt_ids: list[int], chat: bool, index: int | None) -> int:
        """Tokens left for the completion after this prompt; a 400 when none, or fewer than asked."""
        what = "prompt" if index is None else f"prompt {index}"
        room = self.max_context - len(prompt_ids)
        if room < 1:
            raise RequestError(400, f"{what} is {len(prompt_ids)} tokens; this model's maximum context "
                                    f"length is {self.max_context} tokens", "messages" if chat else "prompt",
                               "context_length_exceeded")
        requested = body.max_completion_tokens or body.max_tokens
        if requested is not None and requested > room:
            param = body.max_tokens_param
            raise RequestError(400, f"{what} ({len(prompt_ids)} tokens) + {param} ({requested}) exceeds "
                                    f"this model's maximum context length of {self.max_context} tokens; "
                                    f"lower {param} to at most {room}", param, "context_length_exceeded")
        return room

    async def _parse(self, request: Request, model):
        """The body as `model` (or as the model `model(data)` picks), or a 400 naming the field."""
        return parse_body(await request.body(), model)

    def _tokenize(self, body, chat: bool) -> list[tuple[list[int], str]]:
        """(token ids, text) of each prompt: a chat's one templated prompt, or each completion prompt."""
        if chat:
            text = self.tokenizer.apply_chat_template(template_messages(body.messages), tokenize=False,
                                                      add_generation_prompt=True)
            return [(self.tokenizer(text, add_special_tokens=False)["input_ids"], text)]
        out = []
        vocab = len(self.tokenizer)
        for prompt in body.prompts():
            if isinstance(prompt, str):
                out.append((self.tokenizer(prompt, add_special_tokens=False)["input_ids"], prompt))
            elif any(t < 0 or t >= vocab for t in prompt):
                raise RequestError(400, f"prompt token ids must lie in [0, {vocab})", "prompt")
            else:
                out.append((list(prompt), self.tokenizer.decode(prompt)))
        return out

    def _load(self) -> LoadSnapshot:
        replicas = load_registry().get("TargetServer", {})
        now = time.monotonic()
        fresh = [(r, (s, now - t)) for r, (s, t) in replicas.items() if s]
        if not fresh:
            return LoadSnapshot(running_sequences=max(0, self.in_flight), draft_available=self.has_draft)
        replica, (stats, _age) = min(fresh, key=lambda rx: rx[1][0].get("running", 0) + rx[1][0].get("waiting", 0))
        # The router's own in-flight count per replica is fresher than published stats.
        mine = self.in_flight // max(1, len(fresh))
        # The registry holds what the replica published as of this router's last routing: after an
        # idle spell it still describes the last burst. Past a few publication periods, trust only
        # the in-flight count (else the first request after load falls is decided at the old peak).
        published_age = time.time() - float(stats.get("time", 0.0))
        counts = stats if published_age <= STATS_FRESH_S else {}
        return LoadSnapshot(
            running_sequences=max(int(counts.get("running", 0)), mine),
            queue_length=int(counts.get("waiting", 0)),
            max_num_seqs=int(stats.get("max_num_seqs", 32)),
            draft_available=bool(stats.get("draft_available", True)) and self.has_draft,
            age_s=0.0,  # the in-flight count keeps it current even when stats lag
            # measured step times (TargetServer.StepWindow); `seq` makes the policy ingest each
            # publication once, not once per request decided while it is the latest
            replica=replica, seq=int(stats.get("seq", 0)),
            **{f"{k}_seq": int(stats.get(f"{k}_seq", 0)) for k in ("decode", "verify", "draft", "exchange")},
            **{k: stats[k] for k in ("decode_step_s", "decode_tokens", "verify_step_s", "verify_tokens",
                                     "draft_step_s", "draft_batch", "exchange_s") if stats.get(k)},
        )

    def _decide(self, body, sampling, prompt_tokens: int, text: str, chat: bool) -> SpeculationDecision:
        load = self._load()
        self.policy.ingest(load)
        decision = self.policy.decide(PolicyRequest(
            mode=body.speculation, requested_k=body.num_speculative_tokens, max_tokens=sampling.max_tokens,
            prompt_tokens=prompt_tokens, prompt_class=classify_prompt(text, chat=chat),
            has_stop=bool(sampling.stop) or not sampling.ignore_eos,
        ), load)
        self.metrics.record_decision("speculate" if decision.speculate else "plain", decision.reason)
        return decision

    async def _sse(self, runs: list[RequestRun], firsts: list[GenerateChunk], rid: str, chat: bool,
                   with_provenance: bool, echoes: list[str] | None, prompt_tokens: int, include_usage: bool):
        """Server-sent events: each choice's chunks as its run yields them (several choices
        interleave, each chunk naming its choice's index), then the usage chunk when asked (as
        OpenAI's, the other chunks then carry "usage": null)."""
        model = self.config.model_name
        started = [False] * len(runs)
        offsets = [0] * len(runs)  # each choice's text so far: completions' logprobs carry text offsets
        try:
            async for i, chunk in merged_chunks(runs, firsts):
                prov = provenance(self.tokenizer, chunk) if with_provenance else None
                text = chunk.text if started[i] or not echoes else echoes[i] + chunk.text
                lp = None
                if chunk.logprobs is not None:
                    lp = logprobs_block(self._decode_one, self._token_logprobs(chunk), chat,
                                        offsets[i] + len(text) - len(chunk.text))
                offsets[i] += len(text)
                if chat:
                    data = chat_chunk(rid, model, text, chunk.finish_reason, first=not started[i], provenance=prov,
                                      index=i, logprobs=lp)
                else:
                    data = completion_chunk(rid, model, text, chunk.finish_reason, provenance=prov, index=i, logprobs=lp)
                if include_usage:
                    data["usage"] = None
                started[i] = True
                yield f"data: {json.dumps(data)}\n\n"
            if include_usage:
                final: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                                         "created": int(time.time()), "model": model, "choices": [],
                                         "usage": combined_usage(runs, prompt_tokens).model_dump()}
                yield f"data: {json.dumps(final)}\n\n"
        except RequestError as e:
            self.metrics.record_error(e.status)
            yield f"data: {json.dumps(error_body(e.message, e.type_, e.param, e.code))}\n\n"
        except Exception as e:  # noqa: BLE001 — headers are sent: end the stream with an error event
            self.metrics.record_error(500)
            log.exception("stream failed")
            yield f"data: {json.dumps(error_body(f'internal error: {type(e).__name__}', 'server_error'))}\n\n"
        yield "data: [DONE]\n\n"

