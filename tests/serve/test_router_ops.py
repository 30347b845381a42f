"""The real Router under Serve, wired for operations (issue 51), against a stub target deployment
(no model loads: the router's tokenizer only, so this module is cheap):
- the optional API key: the key reaches the router replica through its environment (here a Ray
  runtime_env; on Kubernetes a Secret), never the config; 401 with OpenAI's error JSON without it,
  through the official openai client too; /health stays open; a key file rotates in place.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from app.api_key import ENV_KEY, ENV_KEY_FILE
from tests.serve.conftest import LOCAL_ARGS

pytestmark = [pytest.mark.serve]
KEY = "sk-specserve-test-0123456789"
APP_NAME = "routerops"


def _stub_target():
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from deployments.request_router import AffinityRequestRouter

    @serve.deployment(ray_actor_options={"num_cpus": 0}, health_check_period_s=60,
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
    env = {ENV_KEY: KEY, ENV_KEY_FILE: str(key_file)}
    router = Router.options(ray_actor_options={"num_cpus": 0, "runtime_env": {"env_vars": env}}).bind(
        LOCAL_ARGS, target)
    serve.run(router, name=APP_NAME, route_prefix="/", blocking=False)
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
