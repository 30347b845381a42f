"""Hostile input: property-based fuzzing of the HTTP API. No input gets a 5xx, none hangs.

- schemathesis from the app's OpenAPI schema (the completion routes declare their request bodies
  from app/protocol/openai_api.py's models; see deployments/request_body.py `json_body`), valid and
  invalid bodies alike;
- hypothesis with raw bodies: arbitrary bytes, arbitrary JSON, near-valid requests with fields
  swapped for wrong-typed / absurd values, plus hand-picked nasties (huge, deeply nested, lone
  surrogates, NaN/Infinity literals, 400-digit numbers, non-UTF-8).

Bounded for CI: a small max_context keeps every accepted generation short, and each property
runs a fixed number of examples with a per-request timeout (a hang fails the test).
"""

from __future__ import annotations

import copy
import json
from typing import Any, Iterator

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from deployments.router import fastapi_app
from tests.serve.conftest import LOCAL_ARGS, deployed

pytestmark = pytest.mark.serve

MODEL = LOCAL_ARGS["model_name"]
MAX_CONTEXT = 64  # every accepted request generates at most this many tokens
OVERRIDES = {
    "engine": {"target": {"max_context": MAX_CONTEXT}, "draft": {"max_context": MAX_CONTEXT}},
    "target_deployment": {"num_cpus": 0.5},
    "draft_deployment": {"num_cpus": 0.25},
    "router_deployment": {"num_cpus": 0.25},
}
REQUEST_TIMEOUT_S = 60.0  # far above any legitimate answer here: reaching it is a hang
FUZZ = settings(max_examples=60, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def app(ray_cluster: int) -> Iterator[str]:
    with deployed(ray_cluster, OVERRIDES) as base:
        yield base


@pytest.fixture(scope="module")
def client(app: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=app, timeout=REQUEST_TIMEOUT_S, trust_env=False) as c:
        yield c


def _schema_dict() -> dict[str, Any]:
    """The app's OpenAPI schema with `model` pinned to the served name (else nearly every
    valid body stops at the 404 for an unknown model; negative cases still vary it)."""
    raw = copy.deepcopy(fastapi_app.openapi())
    for path in ("/v1/completions", "/v1/chat/completions"):
        body = raw["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        body["properties"]["model"] = {"const": MODEL}
    return raw


# Cases come from schemathesis; they are sent with httpx rather than `case.call()`, whose
# requests transport breaks when urllib3-future shadows urllib3 (as it does in this venv).
OPERATIONS = {op.label: op for op in (r.ok() for r in schemathesis.openapi.from_dict(_schema_dict())
                                      .get_all_operations())}
SCHEMA_EXAMPLES = {"POST": 40, "GET": 5}


def test_openapi_declares_request_bodies(client: httpx.Client) -> None:
    served = client.get("/openapi.json").json()
    for path, name in (("/v1/completions", "prompt"), ("/v1/chat/completions", "messages")):
        body = served["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert name in body["properties"] and name in body["required"]
    assert {"POST /v1/completions", "POST /v1/chat/completions"} <= set(OPERATIONS)


# GET routes take no input: only POSTs have invalid (negative) cases to generate
@pytest.mark.parametrize(("label", "mode"), [(label, mode) for label in sorted(OPERATIONS)
                                             for mode in GenerationMode
                                             if mode is GenerationMode.POSITIVE or label.startswith("POST")],
                         ids=lambda x: getattr(x, "value", x))
def test_schemathesis_no_server_errors(client: httpx.Client, label: str, mode: GenerationMode) -> None:
    op = OPERATIONS[label]

    @settings(FUZZ, max_examples=SCHEMA_EXAMPLES[op.method.upper()])
    @given(case=op.as_strategy(generation_mode=mode))
    def check(case) -> None:
        kw = case.as_transport_kwargs(base_url=str(client.base_url))
        r = client.request(kw["method"], kw["url"], params=kw.get("params") or None, headers=kw.get("headers"),
                           json=kw.get("json"), content=kw.get("data"))
        assert r.status_code < 500, f"{r.status_code} for {case.as_curl_command()}: {r.text[:300]}"
        if r.status_code >= 400 and case.method.upper() == "POST":
            assert "error" in r.json(), r.text

    check()


# ---- hypothesis: raw bodies -------------------------------------------------------------
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=50),
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=10), children, max_size=5),
    max_leaves=30,
)
absurd = st.one_of(
    st.none(), st.booleans(), st.text(max_size=20), st.just(""), st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, -1, 2**31, 2**63, 2**64, 10**30, 1e308, -1e308, 1e-320]),
    st.floats(allow_nan=False), st.lists(st.integers(), max_size=5), st.dictionaries(st.text(max_size=5), st.integers(),
                                                                                     max_size=3),
)
FIELDS = ["model", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "n", "stream",
          "stop", "seed", "ignore_eos", "speculation", "num_speculative_tokens", "return_provenance", "messages"]


@st.composite
def near_valid(draw) -> tuple[str, bytes]:
    chat = draw(st.booleans())
    body: dict[str, Any] = {"model": MODEL, "max_tokens": draw(st.integers(1, 8)), "temperature": 0}
    if chat:
        body["messages"] = [{"role": "user", "content": draw(st.text(max_size=40))}]
    else:
        body["prompt"] = draw(st.text(min_size=1, max_size=40) | st.lists(st.integers(0, 300), min_size=1, max_size=8))
    for name in draw(st.lists(st.sampled_from(FIELDS), min_size=1, max_size=3, unique=True)):
        body[name] = draw(absurd)
    return ("/v1/chat/completions" if chat else "/v1/completions"), json.dumps(body).encode()


raw_bodies = st.one_of(
    st.binary(max_size=512),
    json_values.map(lambda v: json.dumps(v).encode()),
    st.text(max_size=200).map(lambda t: t.encode("utf-8", "surrogatepass")),
)
paths = st.sampled_from(["/v1/completions", "/v1/chat/completions"])


def post(client: httpx.Client, path: str, content: bytes, content_type: str = "application/json") -> httpx.Response:
    r = client.post(path, content=content, headers={"content-type": content_type})
    assert r.status_code < 500, f"{r.status_code} for {content[:200]!r}: {r.text[:300]}"
    return r


@FUZZ
@given(path=paths, content=raw_bodies)
def test_raw_bodies_never_5xx(client: httpx.Client, path: str, content: bytes) -> None:
    r = post(client, path, content)
    if r.status_code >= 400:
        assert "error" in r.json(), r.text  # OpenAI-style error object


@FUZZ
@given(req=near_valid())
def test_near_valid_bodies_never_5xx(client: httpx.Client, req: tuple[str, bytes]) -> None:
    path, content = req
    r = post(client, path, content)
    if r.status_code == 200 and b'"stream": true' not in content:
        assert r.json()["usage"]["completion_tokens"] <= MAX_CONTEXT


NASTIES: dict[str, tuple[str, bytes]] = {
    "empty": ("/v1/completions", b""),
    "whitespace": ("/v1/completions", b" \n\t "),
    "not utf-8": ("/v1/completions", b'{"model": "\xff\xfe", "prompt": "\xc3\x28"}'),
    "utf-16": ("/v1/completions", json.dumps({"model": MODEL, "prompt": "x"}).encode("utf-16")),
    "deeply nested array": ("/v1/completions", b"[" * 100_000 + b"]" * 100_000),
    "deeply nested prompt": ("/v1/completions",
                             b'{"model": "%s", "prompt": ' % MODEL.encode() + b"[" * 50_000 + b"]" * 50_000 + b"}"),
    "deeply nested message": ("/v1/chat/completions",
                              b'{"model": "%s", "messages": [{"role": "user", "content": ' % MODEL.encode()
                              + b'{"a":' * 20_000 + b"1" + b"}" * 20_000 + b"}]}"),
    "lone surrogate prompt": ("/v1/completions", b'{"model": "%s", "prompt": "ab\\ud800cd"}' % MODEL.encode()),
    "lone surrogate chat": ("/v1/chat/completions",
                            b'{"model": "%s", "messages": [{"role": "user", "content": "\\udfff"}]}' % MODEL.encode()),
    "NaN temperature": ("/v1/completions", b'{"model": "%s", "prompt": "x", "temperature": NaN}' % MODEL.encode()),
    "Infinity top_p": ("/v1/completions", b'{"model": "%s", "prompt": "x", "top_p": Infinity}' % MODEL.encode()),
    "-Infinity max_tokens": ("/v1/completions",
                             b'{"model": "%s", "prompt": "x", "max_tokens": -Infinity}' % MODEL.encode()),
    "400-digit max_tokens": ("/v1/completions",
                             b'{"model": "%s", "prompt": "x", "max_tokens": %s}' % (MODEL.encode(), b"9" * 400)),
    "400-digit seed": ("/v1/completions", b'{"model": "%s", "prompt": "x", "seed": %s}' % (MODEL.encode(), b"9" * 400)),
    "1e999 temperature": ("/v1/completions", b'{"model": "%s", "prompt": "x", "temperature": 1e999}' % MODEL.encode()),
    "huge token id": ("/v1/completions", b'{"model": "%s", "prompt": [%s]}' % (MODEL.encode(), b"9" * 100)),
    "negative token id": ("/v1/completions", b'{"model": "%s", "prompt": [-1]}' % MODEL.encode()),
    "bool token ids": ("/v1/completions", b'{"model": "%s", "prompt": [true, false]}' % MODEL.encode()),
    "many token ids": ("/v1/completions",
                       json.dumps({"model": MODEL, "prompt": [5] * 200_000, "max_tokens": 1}).encode()),
    "huge prompt": ("/v1/completions", json.dumps({"model": MODEL, "prompt": "def f():\n" * 100_000}).encode()),
    "huge model name": ("/v1/completions", json.dumps({"model": "m" * 1_000_000, "prompt": "x"}).encode()),
    "many messages": ("/v1/chat/completions", json.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}] * 10_000}).encode()),
    "huge stop list": ("/v1/completions", json.dumps({"model": MODEL, "prompt": "x", "stop": ["a"] * 100_000}).encode()),
    "empty stop strings": ("/v1/completions",
                           json.dumps({"model": MODEL, "prompt": "x", "stop": ["", ""], "max_tokens": 4}).encode()),
    "prompt null": ("/v1/completions", json.dumps({"model": MODEL, "prompt": None}).encode()),
    "messages empty": ("/v1/chat/completions", json.dumps({"model": MODEL, "messages": []}).encode()),
    "duplicate keys": ("/v1/completions", b'{"model": "%s", "prompt": "x", "prompt": 5}' % MODEL.encode()),
    "top-level string": ("/v1/completions", b'"just a string"'),
    "top-level number": ("/v1/chat/completions", b"1e999"),
    "stream with absurd max_tokens": ("/v1/completions", json.dumps(
        {"model": MODEL, "prompt": "x", "stream": True, "max_tokens": 10**12}).encode()),
    "all extremes accepted": ("/v1/completions", json.dumps(
        {"model": MODEL, "prompt": "x", "max_tokens": MAX_CONTEXT - 10, "temperature": 2.0, "top_p": 1e-9,
         "top_k": 1_000_000, "seed": 2**63 - 1, "num_speculative_tokens": 16, "speculation": "on",
         "stop": ["\u0000", "\U0001F600" * 16], "ignore_eos": True, "return_provenance": True}).encode()),
}


@pytest.mark.parametrize("name", list(NASTIES))
def test_nasty_bodies(client: httpx.Client, name: str) -> None:
    path, content = NASTIES[name]
    r = post(client, path, content)
    if r.status_code != 200:
        assert 400 <= r.status_code < 500 and "error" in r.json(), r.text


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data",
                                          "application/json; charset=latin-1"])
def test_odd_content_types(client: httpx.Client, content_type: str) -> None:
    post(client, "/v1/completions", json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 2}).encode(),
         content_type)
    post(client, "/v1/completions", b"model=x&prompt=y", content_type)


def test_still_healthy_after_fuzzing(client: httpx.Client) -> None:
    assert client.get("/health").status_code == 200
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "def f():\n", "max_tokens": 4})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 4
