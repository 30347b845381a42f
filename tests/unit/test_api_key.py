"""The optional API key: app/api_key.py's check, and the router's ASGI middleware on a
small Starlette app (401 with OpenAI's error JSON, /health open, streams untouched). The real
router under Serve: tests/serve/test_router_ops.py."""

from __future__ import annotations

import asyncio
import os

import httpx
import pytest
from starlette.applications import Starlette
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from app.api_key import ENV_KEY, ENV_KEY_FILE, INVALID, MISSING, ApiKeys


def test_off_without_configuration() -> None:
    keys = ApiKeys.from_env({})
    assert not keys.enabled
    assert keys.check(None) is None and keys.check("Bearer anything") is None


def test_env_key() -> None:
    keys = ApiKeys.from_env({ENV_KEY: "sk-test-1"})
    assert keys.enabled
    assert keys.check("Bearer sk-test-1") is None
    assert keys.check("bearer   sk-test-1 ") is None  # scheme case-insensitive, spaces tolerated
    assert keys.check(None) is MISSING and keys.check("") is MISSING
    assert keys.check("Basic c2stdGVzdC0x") is MISSING and keys.check("Bearer") is MISSING
    assert keys.check("Bearer sk-test-2") is INVALID
    assert keys.check("Bearer sk-test-1x") is INVALID
    with pytest.raises(ValueError):
        ApiKeys.from_env({ENV_KEY: "  "})


def test_key_file_several_keys_and_rotation(tmp_path) -> None:
    path = tmp_path / "keys"
    path.write_text("# rotated 2026-12-01\nsk-old\n\nsk-new\n")
    keys = ApiKeys.from_env({ENV_KEY_FILE: str(path)})
    assert keys.check("Bearer sk-old") is None and keys.check("Bearer sk-new") is None
    assert keys.check("Bearer # rotated 2026-12-01") is INVALID
    path.write_text("sk-newer\n")
    os.utime(path, (1, 1))  # a changed mtime, whatever the clock's resolution
    assert keys.check("Bearer sk-old") is INVALID and keys.check("Bearer sk-newer") is None
    path.unlink()  # a Secret mid-update: keep the keys last read
    assert keys.check("Bearer sk-newer") is None
    with pytest.raises(OSError):  # a key file that is not there fails the replica at startup
        ApiKeys.from_env({ENV_KEY_FILE: str(tmp_path / "missing")})
    (tmp_path / "empty").write_text("# nothing\n")
    with pytest.raises(ValueError):
        ApiKeys.from_env({ENV_KEY_FILE: str(tmp_path / "empty")})


def test_env_and_file_together(tmp_path) -> None:
    (tmp_path / "k").write_text("sk-file\n")
    keys = ApiKeys.from_env({ENV_KEY: "sk-env", ENV_KEY_FILE: str(tmp_path / "k")})
    assert keys.check("Bearer sk-env") is None and keys.check("Bearer sk-file") is None


# ---- the router's middleware ------------------------------------------------------------------
@pytest.fixture()
def client(monkeypatch):
    from deployments import router

    async def ok(request):
        return JSONResponse({"ok": True})

    async def stream(request):
        async def chunks():
            for i in range(3):
                yield f"data: {i}\n\n"
        return StreamingResponse(chunks(), media_type="text/event-stream")

    app = Starlette(routes=[Route("/health", ok), Route("/v1/models", ok), Route("/v1/completions", stream,
                                                                              methods=["POST"])])
    app.add_middleware(router.ApiKeyMiddleware)
    monkeypatch.setitem(router.replica_state(), "api_keys", ApiKeys(["sk-test"]))
    monkeypatch.setitem(router.replica_state(), "metrics", None)
    transport = httpx.ASGITransport(app=app)
    return httpx.AsyncClient(transport=transport, base_url="http://test")


async def _get(client, path, key=None, method="GET"):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with client:
        return await client.request(method, path, headers=headers)


@pytest.mark.parametrize("path", ["/v1/models", "/v1/completions", "/v1/no-such-route"])
def test_middleware_refuses_without_a_key(client, path) -> None:
    r = asyncio.run(_get(client, path, method="POST" if "completions" in path else "GET"))
    assert r.status_code == 401
    assert r.headers["www-authenticate"] == "Bearer"
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["param"] is None and err["code"] is None


def test_middleware_wrong_key(client) -> None:
    r = asyncio.run(_get(client, "/v1/models", key="sk-wrong"))
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_middleware_health_open_and_key_passes(client) -> None:
    async def run():
        async with client:
            health = await client.get("/health")
            models = await client.get("/v1/models", headers={"Authorization": "Bearer sk-test"})
            streamed = await client.post("/v1/completions", headers={"Authorization": "Bearer sk-test"})
        return health, models, streamed

    health, models, streamed = asyncio.run(run())
    assert health.status_code == 200 and models.status_code == 200
    assert streamed.status_code == 200 and streamed.text == "data: 0\n\ndata: 1\n\ndata: 2\n\n"


def test_router_app_carries_the_middleware() -> None:
    from deployments import router

    assert any(m.cls is router.ApiKeyMiddleware for m in router.fastapi_app.user_middleware)
