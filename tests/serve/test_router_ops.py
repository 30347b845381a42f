"""The real Router under Serve, wired for operations, against a stub target deployment
(no model loads: the router's tokenizer only, so this module is cheap):
- the optional API key: the key reaches the router replica through its environment (here a Ray
  runtime_env; on Kubernetes a Secret), never the config; 401 with OpenAI's error JSON without it,
  through the official openai client too; /health stays open; a key file rotates in place;
- real health: GET /health answers 503 while no target replica answers the router's probe and
  200 again once one does; a target whose request slots are all taken is busy, not down; the
  router's Serve check_health fails once targets stay silent (probe timings shortened through
  the router's environment, app/health.py);
- JSON logs: deployed with configs/local.yaml's `logging_config` (encoding JSON), the router's
  log lines for a completion carry its completion id beside Serve's request_id, the same
  request_id as Serve's access log line for that HTTP request.
"""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from app.api_key import ENV_KEY, ENV_KEY_FILE
from app.config import load_yaml
from tests.serve.conftest import LOCAL_ARGS

LOGGING_CONFIG = load_yaml("configs/local.yaml")["applications"][0]["logging_config"]

pytestmark = [pytest.mark.serve]
KEY = "sk-specserve-test-0123456789"
APP_NAME = "routerops"


def _stub_target():
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from deployments.request_router import AffinityRequestRouter

    @serve.deployment(ray_actor_options={"num_cpus": 0}, health_check_period_s=60, max_ongoing_requests=1,
                      request_router_config=RequestRouterConfig(request_router_class=AffinityRequestRouter,
                                                                request_routing_stats_period_s=1.0,
                                                                request_routing_stats_timeout_s=3.0))
    class StubTarget:
        """Answers the router's probe (check_health) unless the flag file exists."""

        def __init__(self, down_flag: str) -> None:
            self.down_flag = down_flag

        def check_health(self) -> None:
            if os.path.exists(self.down_flag):
                raise RuntimeError("stub target is down")

        def record_routing_stats(self) -> dict[str, Any]:
            return {"running": 0, "waiting": 0, "max_num_seqs": 16, "time": time.time()}

        async def generate(self, request):
            """Three tokens in two chunks, like an engine's steps."""
            from app.protocol.generation import GenerateChunk

            yield GenerateChunk([11, 12], "ab", None, replica="stub")
            yield GenerateChunk([13], "c", "length", replica="stub")

        async def hold(self, seconds: float) -> None:
            """Takes the replica's only request slot (max_ongoing_requests=1), like a long stream."""
            await asyncio.sleep(seconds)

    return StubTarget


@pytest.fixture(scope="module")
def ops_app(ray_cluster: int) -> Iterator[dict[str, Any]]:
    from ray import serve

    from deployments.router import Router

    tmp = Path(tempfile.mkdtemp(prefix="ops"))
    key_file = tmp / "keys"
    key_file.write_text("sk-from-file-1\n")
    down_flag = tmp / "target-down"
    target = _stub_target().bind(str(down_flag))
    env = {ENV_KEY: KEY, ENV_KEY_FILE: str(key_file), "SPECSERVE_TARGET_PROBE_PERIOD_S": "0.5",
           "SPECSERVE_TARGET_PROBE_TIMEOUT_S": "2", "SPECSERVE_TARGET_READY_WITHIN_S": "3",
           "SPECSERVE_TARGET_DOWN_AFTER_S": "4"}
    router = Router.options(ray_actor_options={"num_cpus": 0, "runtime_env": {"env_vars": env}}).bind(
        LOCAL_ARGS, target)
    serve.run(router, name=APP_NAME, route_prefix="/", blocking=False, logging_config=LOGGING_CONFIG)
    base = f"http://127.0.0.1:{ray_cluster}"
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "router did not become healthy in 120 s"
        time.sleep(0.5)
    try:
        yield {"url": base, "key_file": key_file, "down_flag": down_flag}
    finally:
        serve.delete(APP_NAME)


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_api_key_required_health_open(ops_app: dict[str, Any]) -> None:
    url = ops_app["url"]
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200  # no key needed
    r = httpx.get(f"{url}/v1/models", timeout=10)
    assert r.status_code == 401
    assert r.json() == {"error": {
        "message": r.json()["error"]["message"], "type": "invalid_request_error", "param": None, "code": None}}
    assert "API key" in r.json()["error"]["message"]
    assert r.headers["www-authenticate"] == "Bearer"
    r = httpx.get(f"{url}/v1/models", headers=_auth("sk-wrong"), timeout=10)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    # refused before the body is read: a completion without a key is 401, not 400 or 404
    r = httpx.post(f"{url}/v1/completions", json={"model": "x"}, timeout=10)
    assert r.status_code == 401
    r = httpx.get(f"{url}/v1/models", headers=_auth(KEY), timeout=10)
    assert r.status_code == 200 and r.json()["data"][0]["id"] == LOCAL_ARGS["model_name"]


def test_api_key_with_the_openai_client(ops_app: dict[str, Any]) -> None:
    import openai

    good = openai.OpenAI(base_url=f"{ops_app['url']}/v1", api_key=KEY, max_retries=0)
    assert [m.id for m in good.models.list()] == [LOCAL_ARGS["model_name"]]
    bad = openai.OpenAI(base_url=f"{ops_app['url']}/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        bad.models.list()
    assert info.value.status_code == 401 and info.value.code == "invalid_api_key"


def test_api_key_file_rotates_in_place(ops_app: dict[str, Any]) -> None:
    url, key_file = ops_app["url"], ops_app["key_file"]
    assert httpx.get(f"{url}/v1/models", headers=_auth("sk-from-file-1"), timeout=10).status_code == 200
    key_file.write_text("sk-from-file-2\n")
    os.utime(key_file, (time.time() + 5, time.time() + 5))  # a new mtime whatever the clock's resolution
    assert httpx.get(f"{url}/v1/models", headers=_auth("sk-from-file-1"), timeout=10).status_code == 401
    assert httpx.get(f"{url}/v1/models", headers=_auth("sk-from-file-2"), timeout=10).status_code == 200
    assert httpx.get(f"{url}/v1/models", headers=_auth(KEY), timeout=10).status_code == 200  # the env key


def _health(url: str) -> httpx.Response:
    return httpx.get(f"{url}/health", timeout=10)


def _wait_health(url: str, status: int, within_s: float = 20.0) -> httpx.Response:
    deadline = time.monotonic() + within_s
    while True:
        r = _health(url)
        if r.status_code == status or time.monotonic() > deadline:
            return r
        time.sleep(0.25)


def _router_check(handle) -> Exception | None:
    try:
        handle.check_health.remote().result(timeout_s=30)
    except Exception as e:  # noqa: BLE001 — the router's RuntimeError, wrapped by Ray
        return e
    return None


def test_health_follows_the_target(ops_app: dict[str, Any]) -> None:
    from ray import serve

    url, flag = ops_app["url"], ops_app["down_flag"]
    router = serve.get_deployment_handle("Router", APP_NAME)
    r = _health(url)
    assert r.status_code == 200, r.text
    assert r.json()["status"] == "ok" and r.json()["target"]["last_result"] == "answered"
    assert _router_check(router) is None

    flag.touch()  # the target's check now raises: no target replica answers healthy
    try:
        r = _wait_health(url, 503)
        assert r.status_code == 503, r.text
        body = r.json()
        assert body["status"] == "unhealthy" and "stub target is down" in body["target"]["last_result"]
        time.sleep(4.5)  # SPECSERVE_TARGET_DOWN_AFTER_S: the router itself now fails its check
        err = _router_check(router)
        assert err is not None and "no target replica answered" in str(err), err
    finally:
        flag.unlink()
    r = _wait_health(url, 200)
    assert r.status_code == 200 and r.json()["target"]["last_result"] == "answered", r.text
    assert _router_check(router) is None


def test_health_busy_target_is_not_down(ops_app: dict[str, Any]) -> None:
    from ray import serve

    url = ops_app["url"]
    target = serve.get_deployment_handle("StubTarget", APP_NAME)
    held = target.hold.remote(8.0)  # the only slot is taken: the probe queues and times out
    try:
        deadline = time.monotonic() + 7
        seen = set()
        while time.monotonic() < deadline:
            r = _health(url)
            assert r.status_code == 200, r.text  # never 503 while the target is merely busy
            seen.add(r.json()["target"]["last_result"])
            time.sleep(0.25)
        assert "busy" in seen, seen
    finally:
        held.result(timeout_s=30)
    deadline = time.monotonic() + 10  # the slot is free again: the next probe is answered
    while (last := _health(url).json()["target"]["last_result"]) != "answered" and time.monotonic() < deadline:
        time.sleep(0.25)
    assert last == "answered"


def _serve_log_lines(prefix: str) -> list[dict[str, Any]]:
    """JSON records of this session's Serve log files named <prefix>*."""
    import ray

    logs = Path(ray._private.worker._global_node.get_session_dir_path()) / "logs" / "serve"
    records = []
    for path in logs.glob(f"{prefix}*.log"):
        for line in path.read_text(errors="replace").splitlines():
            if line.startswith("{"):
                try:
                    records.append(json.loads(line))
                except ValueError:
                    pass
    return records


def _access_lines(records: list[dict[str, Any]], request_ids: set[Any]) -> list[dict[str, Any]]:
    """Serve's access log lines for a successful POST /v1/completions with one of these request ids."""
    return [rec for rec in records if rec.get("request_id") in request_ids
            and rec.get("message", "").startswith("POST /v1/completions 200")]


def test_json_logs_carry_completion_and_request_ids(ops_app: dict[str, Any]) -> None:
    assert LOGGING_CONFIG["encoding"] == "JSON"
    r = httpx.post(f"{ops_app['url']}/v1/completions", headers=_auth(KEY), timeout=30,
                   json={"model": LOCAL_ARGS["model_name"], "prompt": "def f(x):", "max_tokens": 3})
    assert r.status_code == 200, r.text
    completion_id = r.json()["id"]
    deadline = time.monotonic() + 15
    while True:  # Serve flushes its log files asynchronously, the access line after the router's own
        records = _serve_log_lines(f"replica_{APP_NAME}_Router_")
        mine = [rec for rec in records if rec.get("completion_id") == completion_id]
        ids = {rec.get("request_id") for rec in mine}
        if (len(mine) >= 2 and _access_lines(records, ids)) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert len(mine) >= 2, [rec.get("message") for rec in records[-10:]]  # admitted + ended
    request_ids = {rec.get("request_id") for rec in mine}
    assert len(request_ids) == 1 and None not in request_ids and "" not in request_ids, mine
    end = next(rec for rec in mine if rec.get("outcome"))
    assert end["outcome"] == "finished" and end["completion_tokens"] == 3
    assert end["levelname"] == "INFO" and end["deployment"].endswith("Router")
    # Serve's access log line for the same HTTP request has the same request_id
    access = _access_lines(records, request_ids)
    assert access and access[0]["route"] == "/v1/completions", [rec for rec in records if rec.get("request_id") in request_ids]
