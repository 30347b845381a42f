"""Per-token provenance on the stream (`return_provenance: true`), the playground's data source.

The extension field `specserve` on each chunk must not disturb the official `openai` client
(it parses completions and chat streams as usual and keeps the field as an extra), must
account for exactly the tokens that `usage.completion_tokens` counts, and must be absent
unless asked for, so plain OpenAI clients see standard chunks.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from app.config import AppConfig, load_yaml
from app.runners.loading import load_tokenizer

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.serve

MODEL = "specserve-embedded"
PROMPT = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'
MESSAGES = [{"role": "user", "content": "Write a function that adds two numbers."}]


@pytest.fixture(scope="module")
def client(app_url: str):
    return openai.OpenAI(base_url=f"{app_url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tokenizer():
    config = AppConfig.model_validate(load_yaml("configs/local.yaml")["applications"][0]["args"])
    return load_tokenizer(config.engine.target)


def _extra(obj: Any, name: str) -> Any:
    return (obj.model_extra or {}).get(name)


def _collect(stream, chat: bool) -> dict[str, Any]:
    """Drain an openai stream: text, provenance tokens per chunk, finish reason, usage."""
    out: dict[str, Any] = {"text": "", "steps": [], "finish": None, "usage": None, "roles": []}
    for chunk in stream:
        if chunk.usage is not None:
            out["usage"] = chunk.usage
        for choice in chunk.choices:
            if chat:
                out["text"] += choice.delta.content or ""
                if choice.delta.role:
                    out["roles"].append(choice.delta.role)
            else:
                out["text"] += choice.text or ""
            out["finish"] = choice.finish_reason or out["finish"]
        ext = _extra(chunk, "specserve")
        if chunk.choices:
            assert ext is not None and isinstance(ext.get("tokens"), list), chunk
            # a chunk may carry several engine steps (coalesced for a slow reader): split by them
            assert sum(ext["steps"]) == len(ext["tokens"]), ext
            start = 0
            for n in ext["steps"]:
                out["steps"].append(ext["tokens"][start:start + n])
                start += n
        else:
            assert ext is None  # the closing usage chunk carries no tokens
    return out


def _check_provenance(result: dict[str, Any], tokenizer) -> dict[str, Any]:
    usage = result["usage"]
    assert usage is not None, "the stream must close with a usage chunk"
    tokens = [t for step in result["steps"] for t in step]
    assert len(tokens) == usage.completion_tokens > 0
    for t in tokens:
        assert set(t) == {"id", "text", "origin"}
        assert t["origin"] in ("draft", "target")
        assert t["text"] == tokenizer.decode([t["id"]])
    # Per engine step: accepted draft proposals first, then at most one token of the target's.
    for step in result["steps"]:
        origins = [t["origin"] for t in step]
        n_draft = origins.count("draft")
        assert origins == ["draft"] * n_draft + ["target"] * (len(origins) - n_draft), origins
        assert len(origins) - n_draft <= 1, origins
    # The concatenated token texts re-decode to exactly the streamed text (no stop strings here).
    assert tokenizer.decode([t["id"] for t in tokens], skip_special_tokens=True) == result["text"]
    spec = _extra(usage, "speculation")
    assert spec is not None
    n_draft = sum(t["origin"] == "draft" for t in tokens)
    # Draft tokens dropped by an EOS inside an accepted run still count as accepted on the server.
    assert n_draft <= spec["accepted_tokens"]
    if result["finish"] == "length":
        assert n_draft == spec["accepted_tokens"]
    return {"tokens": tokens, "speculation": spec, "n_draft": n_draft}


@pytest.mark.parametrize("speculation", ["on", "off"])
def test_openai_client_parses_completion_stream_with_provenance(client, tokenizer, speculation: str) -> None:
    stream = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=48, temperature=0, stream=True,
        extra_body={"return_provenance": True, "speculation": speculation, "num_speculative_tokens": 4},
    )
    result = _collect(stream, chat=False)
    checked = _check_provenance(result, tokenizer)
    spec = checked["speculation"]
    if speculation == "off":
        assert spec["mode"] == "plain" and spec["drafted_tokens"] == 0
        assert checked["n_draft"] == 0
    else:
        assert spec["mode"] == "speculative" and spec["drafted_tokens"] > 0
        assert checked["n_draft"] > 0, "a trained draft at temperature 0 gets some tokens accepted"


def test_openai_client_parses_chat_stream_with_provenance(client, tokenizer) -> None:
    stream = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=32, temperature=0, stream=True,
        extra_body={"return_provenance": True, "speculation": "on"},
    )
    result = _collect(stream, chat=True)
    assert result["roles"] == ["assistant"]
    checked = _check_provenance(result, tokenizer)
    assert checked["speculation"]["mode"] == "speculative"


def _raw_chunks(app_url: str, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    chunks = []
    with httpx.stream("POST", f"{app_url}{path}", json=body, timeout=120) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: "):]))
    return chunks


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": PROMPT}),
    ("/v1/chat/completions", {"messages": MESSAGES}),
])
def test_no_provenance_unless_asked(app_url: str, client, path: str, body: dict[str, Any]) -> None:
    base = {"model": MODEL, "max_tokens": 16, "temperature": 0, "stream": True, "speculation": "on",
            "stream_options": {"include_usage": True}, **body}
    for flag in (None, False):
        request = dict(base) if flag is None else {**base, "return_provenance": flag}
        chunks = _raw_chunks(app_url, path, request)
        assert len(chunks) >= 2 and chunks[-1]["choices"] == [] and "usage" in chunks[-1]
        assert all("specserve" not in c for c in chunks), chunks[0]
    # and through the official client: nothing extra on the chunks
    create = client.chat.completions.create if "chat" in path else client.completions.create
    for chunk in create(model=MODEL, max_tokens=8, temperature=0, stream=True, **body):
        assert _extra(chunk, "specserve") is None


def test_provenance_ignored_without_stream(client) -> None:
    response = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0,
                                         extra_body={"return_provenance": True})
    assert response.choices[0].text
    assert response.usage.completion_tokens == 8
