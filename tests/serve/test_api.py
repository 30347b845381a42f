"""The real application on a local Ray, through HTTP: greedy outputs with speculation on == off ==
the in-process core; streamed chunks concatenate to the non-streamed text; /health, /v1/models."""

from __future__ import annotations

import json
from typing import Any, Iterator

import httpx
import pytest

from app.config import load_engine_config
from app.engine.generate import GenerationResult, build_engine, generate
from app.protocol.sampling_params import SamplingParams

pytestmark = pytest.mark.serve

MODEL = "specserve-embedded"
MAX_TOKENS = 32
TIMEOUT = httpx.Timeout(120.0, connect=10.0)

# Written for these tests, in the style of the stdlib sources the embedded pair was trained on.
PROMPTS = [
    "def read_config(path):\n",
    "import os\n\ndef list_python_files(path):\n",
    "class Stack:\n    def __init__(self):\n",
    "for index, value in enumerate(items):\n",
    "The quick brown fox",
]
USAGE = {"stream_options": {"include_usage": True}}  # a stream closes with the usage chunk only when asked
CHAT = [{"role": "system", "content": "You write Python."},
        {"role": "user", "content": "Write a function that reverses a list."}]


@pytest.fixture(scope="module")
def client(app_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=app_url, timeout=TIMEOUT) as c:
        yield c


@pytest.fixture(scope="module")
def core():
    """The Ray-free core on the same config: target only, plain greedy decoding (k=0)."""
    return build_engine(load_engine_config("configs/local.yaml"), speculate=False)


def core_greedy(engine, prompt: str) -> GenerationResult:
    # Tokenized as the router does: target tokenizer, no special tokens.
    ids = engine.runner.tokenizer(prompt, add_special_tokens=False)["input_ids"]
    return generate(engine, ids, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), k=0)


def complete(client: httpx.Client, prompt: str, **extra: Any) -> dict:
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS,
                                             "temperature": 0, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def sse_events(client: httpx.Client, path: str, body: dict) -> list[str]:
    """Every `data:` payload of a server-sent-event stream, in order (raw strings)."""
    events: list[str] = []
    with client.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read().decode()
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: "):])
            else:
                assert line == "" or line.startswith(":"), f"unexpected SSE line {line!r}"
    return events


def split_stream(events: list[str]) -> tuple[list[dict], dict]:
    """(content chunks, final usage chunk); asserts the stream's framing."""
    assert events and events[-1] == "[DONE]", events[-3:]
    assert events.count("[DONE]") == 1
    payloads = [json.loads(e) for e in events[:-1]]
    assert all("error" not in p for p in payloads), payloads
    *chunks, final = payloads
    assert final["choices"] == [] and final["usage"] is not None, final
    assert all(c.get("usage") is None for c in chunks)
    return chunks, final


def check_speculation_usage(usage: dict, mode: str, requested: str) -> dict:
    spec = usage["speculation"]
    assert {"mode", "k", "drafted_tokens", "accepted_tokens", "acceptance_rate", "reason"} <= set(spec)
    assert spec["mode"] == mode and spec["requested"] == requested, spec
    assert 0 <= spec["accepted_tokens"] <= spec["drafted_tokens"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    # `mode`, `k` and `reason` are the router's decision; an adaptive ('auto') request may then
    # draft at any step the engine's batch plan says so (0..max_k), whatever the decision was.
    assert spec["k"] >= 1 if mode == "speculative" else spec["k"] == 0, spec
    if spec["drafted_tokens"]:
        assert spec["acceptance_rate"] == pytest.approx(spec["accepted_tokens"] / spec["drafted_tokens"], abs=1e-3)
    else:
        assert spec["acceptance_rate"] is None, spec
    if not spec["adaptive"]:
        assert (spec["drafted_tokens"] > 0) == (mode == "speculative"), spec
    else:
        assert requested == "auto", spec
    return spec


# ---- liveness and discovery ---------------------------------------------------------------------
def test_health(client: httpx.Client) -> None:
    r = client.get("/health")
    assert r.status_code == 200
    assert r.json()["status"] == "ok"


def test_models_lists_the_served_model(client: httpx.Client) -> None:
    r = client.get("/v1/models")
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == [MODEL]
    assert body["data"][0]["object"] == "model"


# ---- greedy equivalence -------------------------------------------------------------------------
@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_on_equals_off_equals_core(client: httpx.Client, core, prompt: str) -> None:
    on = complete(client, prompt, speculation="on")
    off = complete(client, prompt, speculation="off")
    ref = core_greedy(core, prompt)

    spec_on = check_speculation_usage(on["usage"], "speculative", "on")
    assert spec_on["reason"] == "forced_on"
    assert check_speculation_usage(off["usage"], "plain", "off")["reason"] == "forced_off"

    assert ref.text, "the core produced nothing: pick another prompt"
    assert off["choices"][0]["text"] == ref.text
    assert on["choices"][0]["text"] == ref.text
    for out in (on, off):
        assert out["usage"]["prompt_tokens"] == ref.prompt_tokens
        assert out["usage"]["completion_tokens"] == len(ref.token_ids)
        assert out["choices"][0]["finish_reason"] == ref.finish_reason


def test_greedy_token_ids_equal_core(client: httpx.Client, core) -> None:
    """Token-level, not only text: the streamed provenance carries every token id."""
    prompt = PROMPTS[0]
    events = sse_events(client, "/v1/completions", {
        "model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
        "speculation": "on", "return_provenance": True})
    chunks, final = split_stream(events)
    tokens = [t for c in chunks for t in c.get("specserve", {}).get("tokens", [])]
    ref = core_greedy(core, prompt)
    assert [t["id"] for t in tokens] == ref.token_ids
    assert {t["origin"] for t in tokens} <= {"draft", "target"}
    assert sum(t["origin"] == "draft" for t in tokens) == final["usage"]["speculation"]["accepted_tokens"]


def test_prompt_as_token_ids_equals_text_prompt(client: httpx.Client, core) -> None:
    prompt = PROMPTS[1]
    ids = core.runner.tokenizer(prompt, add_special_tokens=False)["input_ids"]
    by_ids = complete(client, ids, speculation="on")  # type: ignore[arg-type]
    assert by_ids["choices"][0]["text"] == core_greedy(core, prompt).text


# ---- streaming ----------------------------------------------------------------------------------
@pytest.mark.parametrize("speculation", ["on", "off"])
def test_stream_completion_concatenates(client: httpx.Client, speculation: str) -> None:
    body = {"model": MODEL, "prompt": PROMPTS[2], "max_tokens": MAX_TOKENS, "temperature": 0,
            "speculation": speculation, **USAGE}
    whole = complete(client, PROMPTS[2], speculation=speculation)
    chunks, final = split_stream(sse_events(client, "/v1/completions", body))
    assert all(c["object"] == "text_completion" and c["model"] == MODEL for c in chunks)
    assert len({c["id"] for c in chunks + [final]}) == 1
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert final["usage"]["completion_tokens"] == whole["usage"]["completion_tokens"]
    mode = "speculative" if speculation == "on" else "plain"
    check_speculation_usage(final["usage"], mode, speculation)


@pytest.mark.parametrize("speculation", ["on", "off"])
def test_stream_chat_concatenates(client: httpx.Client, speculation: str) -> None:
    body = {"model": MODEL, "messages": CHAT, "max_tokens": MAX_TOKENS, "temperature": 0,
            "speculation": speculation, **USAGE}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    whole = r.json()
    assert whole["object"] == "chat.completion"
    message = whole["choices"][0]["message"]
    assert message["role"] == "assistant" and message["content"]

    chunks, final = split_stream(sse_events(client, "/v1/chat/completions", body))
    assert all(c["object"] == "chat.completion.chunk" for c in chunks + [final])
    assert chunks[0]["choices"][0]["delta"].get("role") == "assistant"
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == message["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
    mode = "speculative" if speculation == "on" else "plain"
    check_speculation_usage(final["usage"], mode, speculation)
    check_speculation_usage(whole["usage"], mode, speculation)


@pytest.mark.parametrize("speculation", ["on", "off"])
def test_stream_several_choices(client: httpx.Client, speculation: str) -> None:
    """n=2 over two prompts: four choices, prompt-major; each chunk carries one choice; each choice's
    chunks concatenate to its non-streamed text and end with its finish reason; one usage chunk."""
    prompts = [PROMPTS[0], PROMPTS[4]]
    whole = complete(client, prompts, n=2, speculation=speculation)  # type: ignore[arg-type]
    assert [c["index"] for c in whole["choices"]] == [0, 1, 2, 3]
    body = {"model": MODEL, "prompt": prompts, "n": 2, "max_tokens": MAX_TOKENS, "temperature": 0,
            "speculation": speculation, **USAGE}
    chunks, final = split_stream(sse_events(client, "/v1/completions", body))
    assert all(len(c["choices"]) == 1 for c in chunks) and len({c["id"] for c in chunks + [final]}) == 1
    for choice in whole["choices"]:
        own = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == choice["index"]]
        assert "".join(x["text"] for x in own) == choice["text"]
        assert [x["finish_reason"] for x in own] == [None] * (len(own) - 1) + [choice["finish_reason"]]
    alone = complete(client, prompts[0])["choices"][0]["text"]
    assert whole["choices"][0]["text"] == whole["choices"][1]["text"] == alone  # greedy: each choice the same
    assert final["usage"]["completion_tokens"] == whole["usage"]["completion_tokens"]
    mode = "speculative" if speculation == "on" else "plain"
    check_speculation_usage(final["usage"], mode, speculation)
    check_speculation_usage(whole["usage"], mode, speculation)


@pytest.mark.parametrize(("extra", "usage"), [
    ({}, False),
    ({"stream_options": {"include_usage": False}}, False),
    ({"stream_options": {"include_usage": None}}, False),
    ({"stream_options": {"include_usage": True}}, True),
    ({"return_provenance": True}, True),  # specserve's playground and bench.load read both
    ({"return_provenance": True, "stream_options": {"include_usage": False}}, False),
], ids=["default", "false", "null", "true", "provenance", "provenance_but_false"])
def test_usage_chunk_only_when_asked(client: httpx.Client, extra: dict, usage: bool) -> None:
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0, **extra}
    events = sse_events(client, "/v1/completions", body)
    assert events[-1] == "[DONE]"
    payloads = [json.loads(e) for e in events[:-1]]
    with_usage = [p for p in payloads if p.get("usage") is not None]
    if usage:
        assert len(with_usage) == 1 and with_usage[0] is payloads[-1] and payloads[-1]["choices"] == []
        assert payloads[-1]["usage"]["speculation"]["mode"] in ("speculative", "plain")
        assert all("usage" in p and p["usage"] is None for p in payloads[:-1])  # OpenAI's: null on the others
    else:
        assert not with_usage and all(p["choices"] and "usage" not in p for p in payloads)


# ---- /tokenize and /detokenize (as vLLM's) ----------------------------------------------------------
def test_tokenize_gives_the_ids_completions_feed_the_model(client: httpx.Client) -> None:
    prompt = PROMPTS[1]
    r = client.post("/tokenize", json={"model": MODEL, "prompt": prompt})
    assert r.status_code == 200, r.text
    out = r.json()
    assert set(out) == {"count", "max_model_len", "tokens", "token_strs"} and out["token_strs"] is None
    assert out["count"] == len(out["tokens"]) and out["max_model_len"] == client.get("/v1/models").json()[
        "data"][0]["max_model_len"]
    by_text = complete(client, prompt, max_tokens=8)
    by_ids = complete(client, out["tokens"], max_tokens=8)  # type: ignore[arg-type]
    assert by_text["usage"]["prompt_tokens"] == out["count"]
    assert by_ids["choices"][0]["text"] == by_text["choices"][0]["text"]
    back = client.post("/detokenize", json={"model": MODEL, "tokens": out["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": prompt}


def test_tokenize_messages_as_chat_templates_them(client: httpx.Client) -> None:
    r = client.post("/tokenize", json={"model": MODEL, "messages": CHAT, "return_token_strs": True})
    assert r.status_code == 200, r.text
    out = r.json()
    assert len(out["token_strs"]) == out["count"] and all(isinstance(s, str) for s in out["token_strs"])
    chat = client.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "max_tokens": 4,
                                                     "temperature": 0})
    assert chat.json()["usage"]["prompt_tokens"] == out["count"]
    bare = client.post("/tokenize", json={"messages": CHAT, "add_generation_prompt": False}).json()  # model optional
    assert bare["count"] < out["count"] and out["tokens"][:bare["count"]] == bare["tokens"]


def test_auto_is_the_default_and_explains_itself(client: httpx.Client) -> None:
    out = complete(client, PROMPTS[3])
    spec = out["usage"]["speculation"]
    assert spec["requested"] == "auto"
    assert spec["mode"] in ("speculative", "plain") and spec["reason"]
    check_speculation_usage(out["usage"], spec["mode"], "auto")


def test_num_speculative_tokens_sets_k(client: httpx.Client) -> None:
    out = complete(client, PROMPTS[0], num_speculative_tokens=2)
    spec = check_speculation_usage(out["usage"], "speculative", "auto")
    assert spec["k"] == 2 and spec["reason"] == "forced_on"
