"""Every bad input gets OpenAI-style error JSON {"error": {"message", "type", "param", "code"}} with a
4xx — never a 500, never a hang — and the service stays healthy afterwards."""

from __future__ import annotations

import json
from typing import Any, Iterator

import httpx
import pytest

pytestmark = pytest.mark.serve

MODEL = "specserve-embedded"
CONTEXT = 2048  # the embedded target's max_position_embeddings (checked against /v1/models below)
VOCAB = 4096
TIMEOUT = httpx.Timeout(60.0, connect=10.0)  # a hang fails the test instead of blocking it

# Each "x = 1\n" is 4 tokens with the embedded tokenizer (asserted in test_long_prompt_is_long).
LONG_TEXT = "x = 1\n" * 600  # ~2400 tokens > CONTEXT
NEAR_FULL_TEXT = "x = 1\n" * 500  # ~2000 tokens: fits, but not with max_tokens 100

C, CHAT = "/v1/completions", "/v1/chat/completions"
TOK, DETOK = "/tokenize", "/detokenize"
OK_COMPLETION: dict[str, Any] = {"model": MODEL, "prompt": "def f(x):\n", "max_tokens": 4}
OK_CHAT: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def completion(**changes: Any) -> dict[str, Any]:
    body = {**OK_COMPLETION, **changes}
    return {k: v for k, v in body.items() if v is not DROP}


def chat(**changes: Any) -> dict[str, Any]:
    body = {**OK_CHAT, **changes}
    return {k: v for k, v in body.items() if v is not DROP}


DROP = object()

# (id, path, body: bytes sent verbatim or an object sent as JSON, status, param or None to skip, code or None)
CASES: list[tuple[str, str, Any, int, str | None, str | None]] = [
    # malformed bodies
    ("invalid_json", C, b'{"model": "specserve-embedded", "prompt": ', 400, None, None),
    ("empty_body", C, b"", 400, None, None),
    ("not_utf8", C, b'{"model": "\xff\xfe"}', 400, None, None),
    ("json_array", C, b"[1, 2, 3]", 400, None, None),
    ("json_string", C, b'"just a string"', 400, None, None),
    ("json_null", C, b"null", 400, None, None),
    ("chat_invalid_json", CHAT, b"{'single': 'quotes'}", 400, None, None),
    ("chat_json_array", CHAT, b"[]", 400, None, None),
    # missing or wrongly typed fields
    ("missing_model", C, completion(model=DROP), 400, "model", None),
    ("missing_prompt", C, completion(prompt=DROP), 400, "prompt", None),
    ("model_as_number", C, completion(model=7), 400, "model", None),
    ("prompt_as_number", C, completion(prompt=42), 400, "prompt", None),
    ("prompt_as_object", C, completion(prompt={"text": "hi"}), 400, "prompt", None),
    ("prompt_list_mixed", C, completion(prompt=["a", 1]), 400, "prompt", None),
    ("prompt_list_with_empty", C, completion(prompt=["a", ""]), 400, "prompt", None),
    ("prompt_list_of_objects", C, completion(prompt=[{"text": "a"}]), 400, "prompt", None),
    ("temperature_as_string", C, completion(temperature="hot"), 400, "temperature", None),
    ("max_tokens_as_string", C, completion(max_tokens="many"), 400, "max_tokens", None),
    ("max_tokens_fractional", C, completion(max_tokens=1.5), 400, "max_tokens", None),
    ("stream_as_object", C, completion(stream={"on": True}), 400, "stream", None),
    # max_tokens out of range
    ("max_tokens_negative", C, completion(max_tokens=-5), 400, "max_tokens", None),
    ("max_tokens_zero", C, completion(max_tokens=0), 400, "max_tokens", None),
    ("max_tokens_huge", C, completion(max_tokens=10**9), 400, "max_tokens", "context_length_exceeded"),
    ("max_tokens_astronomical", C, completion(max_tokens=10**40), 400, "max_tokens", None),
    ("max_completion_tokens_huge", CHAT, chat(max_completion_tokens=10**6), 400, "max_completion_tokens",
     "context_length_exceeded"),
    ("chat_max_tokens_negative", CHAT, chat(max_tokens=-1), 400, "max_tokens", None),
    # sampling parameters out of range
    ("temperature_negative", C, completion(temperature=-0.1), 400, "temperature", None),
    ("temperature_too_high", C, completion(temperature=2.5), 400, "temperature", None),
    ("temperature_nan", C, b'{"model": "specserve-embedded", "prompt": "a", "temperature": NaN}', 400,
     "temperature", None),
    ("temperature_infinite", C, b'{"model": "specserve-embedded", "prompt": "a", "temperature": Infinity}',
     400, "temperature", None),
    ("top_p_zero", C, completion(top_p=0), 400, "top_p", None),
    ("top_p_above_one", C, completion(top_p=1.5), 400, "top_p", None),
    ("top_p_negative", C, completion(top_p=-0.5), 400, "top_p", None),
    ("chat_temperature_too_high", CHAT, chat(temperature=3), 400, "temperature", None),
    # n, best_of, several prompts (MAX_N = 16 choices per prompt, 32 prompts, 32 generations)
    ("n_zero", C, completion(n=0), 400, "n", None),
    ("n_too_many", C, completion(n=17), 400, "n", None),
    ("chat_n_too_many", CHAT, chat(n=100), 400, "n", None),
    ("best_of_below_n", C, completion(n=3, best_of=2), 400, "best_of", None),
    ("best_of_above_n_streaming", C, completion(best_of=2, stream=True), 400, "best_of", None),
    ("chat_best_of", CHAT, chat(best_of=1), 400, "best_of", None),  # a completions field
    ("too_many_prompts", C, completion(prompt=["a"] * 33), 400, "prompt", None),
    ("too_many_generations", C, completion(prompt=["a", "b", "c"], n=16), 400, "prompt", None),
    ("chat_echo", CHAT, chat(echo=True), 400, "echo", None),  # a completions field
    ("too_many_stops", C, completion(stop=["a", "b", "c", "d", "e"]), 400, "stop", None),
    # empty prompt / messages
    ("empty_prompt", C, completion(prompt=""), 400, "prompt", None),
    ("empty_token_list", C, completion(prompt=[]), 400, "prompt", None),
    ("empty_messages", CHAT, chat(messages=[]), 400, "messages", None),
    ("missing_messages", CHAT, chat(messages=DROP), 400, "messages", None),
    ("messages_as_string", CHAT, chat(messages="hello"), 400, "messages", None),
    # chat message shape
    ("invalid_role", CHAT, chat(messages=[{"role": "wizard", "content": "hi"}]), 400, "messages.0.role", None),
    ("missing_role", CHAT, chat(messages=[{"content": "hi"}]), 400, "messages.0.role", None),
    ("content_as_number", CHAT, chat(messages=[{"role": "user", "content": 5}]), 400, "messages.0.content", None),
    ("missing_content", CHAT, chat(messages=[{"role": "user"}]), 400, "messages.0.content", None),
    ("message_not_object", CHAT, chat(messages=["hi"]), 400, "messages.0", None),
    ("tool_role", CHAT, chat(messages=[{"role": "tool", "content": "1", "tool_call_id": "c"}]), 400,
     "messages.0.role", None),
    ("image_part", CHAT, chat(messages=[{"role": "user", "content": [
        {"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": "http://x/a.png"}}]}]),
     400, "messages.0.content", None),
    ("text_part_without_text", CHAT, chat(messages=[{"role": "user", "content": [{"type": "text"}]}]), 400,
     "messages.0.content", None),
    ("empty_part_list", CHAT, chat(messages=[{"role": "user", "content": []}]), 400, "messages.0.content", None),
    # unknown model
    ("unknown_model", C, completion(model="gpt-4"), 404, "model", "model_not_found"),
    ("chat_unknown_model", CHAT, chat(model="gpt-4"), 404, "model", "model_not_found"),
    ("unknown_model_streaming", C, completion(model="gpt-4", stream=True), 404, "model", "model_not_found"),
    # longer than the context
    ("prompt_longer_than_context", C, completion(prompt=LONG_TEXT), 400, "prompt", "context_length_exceeded"),
    ("token_ids_longer_than_context", C, completion(prompt=[5] * (CONTEXT + 1)), 400, "prompt",
     "context_length_exceeded"),
    ("one_of_prompts_longer_than_context", C, completion(prompt=["def f():\n", LONG_TEXT]), 400, "prompt",
     "context_length_exceeded"),
    ("one_of_prompts_plus_max_tokens_over_context", C, completion(prompt=["a", NEAR_FULL_TEXT], max_tokens=100),
     400, "max_tokens", "context_length_exceeded"),
    ("chat_longer_than_context", CHAT, chat(messages=[{"role": "user", "content": LONG_TEXT}]), 400,
     "messages", "context_length_exceeded"),
    ("prompt_plus_max_tokens_over_context", C, completion(prompt=NEAR_FULL_TEXT, max_tokens=100), 400,
     "max_tokens", "context_length_exceeded"),
    ("long_prompt_streaming", C, completion(prompt=LONG_TEXT, stream=True), 400, "prompt",
     "context_length_exceeded"),
    # token-id prompts outside the vocabulary
    ("token_id_at_vocab_size", C, completion(prompt=[1, 2, VOCAB]), 400, "prompt", None),
    ("token_id_negative", C, completion(prompt=[1, -1]), 400, "prompt", None),
    ("token_id_huge", C, completion(prompt=[10**20]), 400, "prompt", None),
    ("token_id_lists_outside_vocab", C, completion(prompt=[[1, 2], [3, VOCAB]]), 400, "prompt", None),
    # specserve's extension fields
    ("speculation_unknown_value", C, completion(speculation="maybe"), 400, "speculation", None),
    ("speculation_as_bool", C, completion(speculation=True), 400, "speculation", None),
    ("chat_speculation_unknown_value", CHAT, chat(speculation="always"), 400, "speculation", None),
    ("num_speculative_tokens_negative", C, completion(num_speculative_tokens=-1), 400,
     "num_speculative_tokens", None),
    ("num_speculative_tokens_too_many", C, completion(num_speculative_tokens=1000), 400,
     "num_speculative_tokens", None),
    ("num_speculative_tokens_fractional", C, completion(num_speculative_tokens=2.5), 400,
     "num_speculative_tokens", None),
    # fields the server does not implement: refused by name, never silently ignored
    ("unknown_field", C, completion(frobnicate=1), 400, "frobnicate", None),
    ("chat_unknown_field", CHAT, chat(guided_json={"type": "object"}), 400, "guided_json", None),
    ("unknown_message_field", CHAT, chat(messages=[{"role": "user", "content": "hi", "name": "bob"}]), 400,
     "messages.0.name", None),
    ("tools", CHAT, chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}]), 400,
     "tools", None),
    ("tool_choice_required", CHAT, chat(tool_choice="required"), 400, "tool_choice", None),
    ("audio", CHAT, chat(audio={"voice": "alloy", "format": "wav"}), 400, "audio", None),
    ("suffix", C, completion(suffix="\n    return x\n"), 400, "suffix", None),
    # values out of range, and a schema the grammar compiler refuses
    ("logprobs_over_20", C, completion(logprobs=21), 400, "logprobs", None),
    ("chat_top_logprobs_over_20", CHAT, chat(logprobs=True, top_logprobs=21), 400, "top_logprobs", None),
    ("presence_penalty_out_of_range", C, completion(presence_penalty=2.5), 400, "presence_penalty", None),
    ("min_tokens_over_max_tokens", C, completion(min_tokens=9, max_tokens=8), 400, "min_tokens", None),
    ("response_format_unknown_type", CHAT, chat(response_format={"type": "xml"}), 400, "response_format.type",
     None),
    ("response_format_bad_schema", CHAT, chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}}), 400, None, None),
    # /tokenize and /detokenize
    ("tokenize_invalid_json", TOK, b"{", 400, None, None),
    ("tokenize_missing_prompt", TOK, {"model": MODEL}, 400, "prompt", None),
    ("tokenize_prompt_as_number", TOK, {"model": MODEL, "prompt": 5}, 400, "prompt", None),
    ("tokenize_unknown_field", TOK, {"model": MODEL, "prompt": "x", "chat_template": "{{x}}"}, 400,
     "chat_template", None),
    ("tokenize_bad_message", TOK, {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, 400,
     "messages.0.role", None),
    ("tokenize_unknown_model", TOK, {"model": "gpt-4", "prompt": "x"}, 404, "model", "model_not_found"),
    ("detokenize_missing_tokens", DETOK, {"model": MODEL}, 400, "tokens", None),
    ("detokenize_tokens_as_string", DETOK, {"model": MODEL, "tokens": "1 2"}, 400, "tokens", None),
    ("detokenize_outside_vocab", DETOK, {"model": MODEL, "tokens": [1, VOCAB]}, 400, "tokens", None),
    ("detokenize_negative", DETOK, {"model": MODEL, "tokens": [-1]}, 400, "tokens", None),
    ("detokenize_unknown_model", DETOK, {"model": "gpt-4", "tokens": [1]}, 404, "model", "model_not_found"),
]


@pytest.fixture(scope="module")
def client(app_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=app_url, timeout=TIMEOUT) as c:
        yield c


def assert_openai_error(r: httpx.Response, status: int, param: str | None = None, code: str | None = None) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    assert r.headers["content-type"].startswith("application/json"), r.headers["content-type"]
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"], err
    assert isinstance(err["type"], str) and err["type"], err
    assert err["param"] is None or isinstance(err["param"], str), err
    assert err["code"] is None or isinstance(err["code"], str), err
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


@pytest.mark.parametrize(("path", "body", "status", "param", "code"), [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_bad_input_gets_openai_error(client: httpx.Client, path: str, body: Any, status: int,
                                     param: str | None, code: str | None) -> None:
    if isinstance(body, bytes):
        r = client.post(path, content=body, headers={"content-type": "application/json"})
    else:
        r = client.post(path, json=body)
    err = assert_openai_error(r, status, param, code)
    assert err["type"] == "invalid_request_error"


def test_case_ids_are_unique() -> None:
    ids = [c[0] for c in CASES]
    assert len(ids) == len(set(ids))


def test_long_prompt_is_long(client: httpx.Client) -> None:
    """The context cases really are beyond the served context (and NEAR_FULL_TEXT really fits)."""
    from app.config import load_engine_config
    from app.runners.loading import load_tokenizer

    (served,) = client.get("/v1/models").json()["data"]
    assert served["max_model_len"] == CONTEXT
    tok = load_tokenizer(load_engine_config("configs/local.yaml").target)
    assert len(tok) == VOCAB
    assert len(tok(LONG_TEXT, add_special_tokens=False)["input_ids"]) > CONTEXT
    n_near = len(tok(NEAR_FULL_TEXT, add_special_tokens=False)["input_ids"])
    assert n_near < CONTEXT < n_near + 100


def test_boundaries_are_accepted(client: httpx.Client) -> None:
    """The edges of each range are valid: the checks above reject only what is out of range."""
    for body in (completion(temperature=0), completion(temperature=2.0, seed=1), completion(top_p=1.0),
                 completion(top_p=0.01, temperature=1.0, seed=1), completion(num_speculative_tokens=0),
                 completion(prompt=[0, VOCAB - 1]), completion(prompt=NEAR_FULL_TEXT, max_tokens=1),
                 completion(speculation="off"), chat(messages=[{"role": "system", "content": "s"},
                                                               {"role": "user", "content": "u"},
                                                               {"role": "assistant", "content": "a"},
                                                               {"role": "user", "content": "again"}]),
                 completion(n=16, max_tokens=1), completion(prompt=["a"] * 32, max_tokens=1),
                 completion(prompt=[[1, 2]] * 2, n=16, max_tokens=1), completion(n=2, best_of=2, max_tokens=1),
                 chat(n=16, max_tokens=1),
                 chat(messages=[{"role": "developer", "content": [{"type": "text", "text": "d"}]},
                                {"role": "user", "content": [{"type": "text", "text": "u"}]}])):
        path = CHAT if "messages" in body else C
        r = client.post(path, json=body)
        assert r.status_code == 200, (body if len(json.dumps(body)) < 300 else "long body", r.text)


def test_refusal_says_why(client: httpx.Client) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "nonsense"}}}
    err = assert_openai_error(client.post(CHAT, json=chat(response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": schema}})), 400)
    assert err["message"] == 'response_format json_schema cannot be compiled: Unsupported type "nonsense"', err
    err = assert_openai_error(client.post(CHAT, json=chat(tools=[{"type": "function"}])), 400, "tools")
    assert "tool calling is not supported" in err["message"]
    err = assert_openai_error(client.post(C, json=completion(frobnicate=1)), 400, "frobnicate")
    assert "does not implement this field" in err["message"]


def test_nulls_and_defaults_are_accepted(client: httpx.Client) -> None:
    """Clients that send every optional field as null, or at its default, keep working."""
    nulls = {k: None for k in ("max_tokens", "temperature", "top_p", "n", "stream", "stop", "seed", "logprobs",
                               "presence_penalty", "frequency_penalty", "logit_bias", "user", "suffix",
                               "response_format", "stream_options")}
    r = client.post(C, json={**completion(), **nulls})
    assert r.status_code == 200, r.text
    defaults = {"temperature": 0, "logprobs": False, "top_logprobs": 0, "presence_penalty": 0,
                "frequency_penalty": 0, "logit_bias": {}, "response_format": {"type": "text"}, "tools": [],
                "tool_choice": "none", "parallel_tool_calls": True, "modalities": ["text"], "store": False,
                "user": "someone", "tools_unknown_but_null": None}
    r = client.post(CHAT, json=chat(**defaults))
    assert r.status_code == 200, r.text


def test_wrong_method_and_unknown_route_are_4xx_json(client: httpx.Client) -> None:
    for r, status in ((client.get(C), 405), (client.get("/v1/no-such-route"), 404),
                      (client.post("/v1/models", json={}), 405)):
        assert r.status_code == status, (r.status_code, r.text)
        assert r.headers["content-type"].startswith("application/json")
        error = r.json()["error"]  # OpenAI error JSON, not FastAPI's {"detail": ...}
        assert error["type"] == "invalid_request_error" and error["code"] == str(status)
        assert r.request.url.path in error["message"]


def test_still_healthy_after_bad_inputs(client: httpx.Client) -> None:
    assert client.get("/health").status_code == 200
    r = client.post(C, json=completion(temperature=0))
    assert r.status_code == 200 and r.json()["choices"][0]["text"] is not None
