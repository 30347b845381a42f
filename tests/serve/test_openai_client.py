"""The official `openai` Python client against the real application: completions, chat, streaming
(both), specserve's extension fields through `extra_body`, and errors mapped to its exceptions."""

from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.serve

MODEL = "specserve-embedded"
PROMPT = "def read_config(path):\n"
MESSAGES = [{"role": "user", "content": "Write a function that reverses a list."}]
SPEC_K3 = {"speculation": "on", "num_speculative_tokens": 3}


@pytest.fixture(scope="module")
def client(app_url: str):
    return openai.OpenAI(base_url=f"{app_url}/v1", api_key="x", max_retries=0, timeout=120)


def speculation(usage) -> dict:
    """openai's CompletionUsage keeps unknown fields: usage.speculation lives in model_extra."""
    assert usage is not None
    spec = usage.model_dump()["speculation"]
    assert {"mode", "k", "drafted_tokens", "accepted_tokens", "acceptance_rate", "reason"} <= set(spec)
    return spec


def test_models_list(client) -> None:
    assert [m.id for m in client.models.list()] == [MODEL]


def test_completion(client) -> None:
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0)
    assert out.object == "text_completion" and out.model == MODEL
    (choice,) = out.choices
    assert choice.text and choice.finish_reason in ("stop", "length")
    assert out.usage.completion_tokens >= 1
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    assert speculation(out.usage)["requested"] == "auto"


def test_completion_extra_body_is_honoured(client) -> None:
    on = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, extra_body=SPEC_K3)
    spec = speculation(on.usage)
    assert spec["mode"] == "speculative" and spec["k"] == 3 and spec["reason"] == "forced_on"
    assert spec["drafted_tokens"] > 0
    off = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0,
                                    extra_body={"speculation": "off"})
    spec_off = speculation(off.usage)
    assert spec_off["mode"] == "plain" and spec_off["k"] == 0 and spec_off["drafted_tokens"] == 0
    assert on.choices[0].text == off.choices[0].text  # greedy: speculation is lossless


def test_chat(client) -> None:
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=24, temperature=0,
                                         extra_body=SPEC_K3)
    assert out.object == "chat.completion"
    (choice,) = out.choices
    assert choice.message.role == "assistant" and choice.message.content
    spec = speculation(out.usage)
    assert spec["mode"] == "speculative" and spec["k"] == 3


def test_completion_stream(client) -> None:
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, extra_body=SPEC_K3)
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stream=True,
                                       stream_options={"include_usage": True}, extra_body=SPEC_K3)
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    usage = [c.usage for c in chunks if c.usage is not None]
    assert len(usage) == 1 and chunks[-1].usage is not None
    spec = speculation(usage[0])
    assert spec["mode"] == "speculative" and spec["k"] == 3
    assert usage[0].completion_tokens == whole.usage.completion_tokens


def test_chat_stream(client) -> None:
    whole = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=24, temperature=0,
                                           extra_body=SPEC_K3)
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=24, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body=SPEC_K3))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant"
    assert "".join(d.content or "" for d in deltas) == whole.choices[0].message.content
    usage = [c.usage for c in chunks if c.usage is not None]
    assert len(usage) == 1
    spec = speculation(usage[0])
    assert spec["mode"] == "speculative" and spec["k"] == 3


def test_no_usage_chunk_unless_asked(client) -> None:
    for create, kw in ((client.completions.create, {"prompt": PROMPT}),
                       (client.chat.completions.create, {"messages": MESSAGES})):
        chunks = list(create(model=MODEL, max_tokens=8, temperature=0, stream=True, **kw))
        assert chunks and all(c.usage is None and c.choices for c in chunks)
        chunks = list(create(model=MODEL, max_tokens=8, temperature=0, stream=True,
                             stream_options={"include_usage": False}, **kw))
        assert all(c.usage is None for c in chunks)


def test_errors_map_to_client_exceptions(client) -> None:
    with pytest.raises(openai.NotFoundError) as nf:
        client.completions.create(model="gpt-4", prompt=PROMPT, max_tokens=4)
    assert nf.value.status_code == 404 and nf.value.code == "model_not_found" and nf.value.param == "model"
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=5)
    assert bad.value.param == "temperature" and bad.value.type == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as spec:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4,
                                       extra_body={"num_speculative_tokens": -1})
    assert spec.value.param == "num_speculative_tokens"
    with pytest.raises(openai.BadRequestError):  # raised before any byte of the stream
        client.chat.completions.create(model=MODEL, messages=[], max_tokens=4, stream=True)


def test_unimplemented_fields_are_refused_by_name(client) -> None:
    """Never a 200 that ignores what was asked; the error's `param` names the field."""
    refused = [
        (client.chat.completions.create, {"messages": MESSAGES, "tools": [
            {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}, "tools"),
        (client.completions.create, {"prompt": PROMPT, "suffix": "\n    return x\n"}, "suffix"),
        (client.completions.create, {"prompt": PROMPT, "extra_body": {"guided_json": {"type": "object"}}},
         "guided_json"),
    ]
    for create, kwargs, param in refused:
        with pytest.raises(openai.BadRequestError) as bad:
            create(model=MODEL, max_tokens=4, **kwargs)
        assert bad.value.param == param and bad.value.type == "invalid_request_error", (param, bad.value.body)


def test_defaults_of_unimplemented_fields_keep_working(client) -> None:
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0,
                                         logprobs=False, presence_penalty=0, frequency_penalty=0, logit_bias={},
                                         response_format={"type": "text"}, tool_choice="none", user="user-1",
                                         store=False, extra_body={"tools": None})
    plain = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0)
    assert out.choices[0].message.content == plain.choices[0].message.content


# ---- n, best_of, several prompts, echo, text parts, developer role --------------------
def _by_index(chunks, chat: bool = False) -> dict[int, str]:
    """Each choice's streamed text, by choice index."""
    texts: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            piece = (choice.delta.content or "") if chat else choice.text
            texts[choice.index] = texts.get(choice.index, "") + piece
    return texts


def _finishes(chunks) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            if choice.finish_reason is not None:
                out.setdefault(choice.index, []).append(choice.finish_reason)
    return out


def test_n_choices_are_seeded_per_choice(client) -> None:
    """n=3 with a seed: choice i is the n=1 request with seed + i (reproducible, and not 3 copies)."""
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=1.0, seed=11)
    out = client.completions.create(n=3, **kw)
    assert [c.index for c in out.choices] == [0, 1, 2]
    texts = [c.text for c in out.choices]
    for i, text in enumerate(texts):
        assert text == client.completions.create(**{**kw, "seed": 11 + i}).choices[0].text
    assert len(set(texts)) > 1, texts
    assert out.usage.completion_tokens == sum(
        client.completions.create(**{**kw, "seed": 11 + i}).usage.completion_tokens for i in range(3))
    assert out.usage.prompt_tokens == client.completions.create(**kw).usage.prompt_tokens  # counted once
    chunks = list(client.completions.create(n=3, stream=True, **kw))
    assert _by_index(chunks) == dict(enumerate(texts))
    assert all(len(f) == 1 for f in _finishes(chunks).values()) and set(_finishes(chunks)) == {0, 1, 2}


def test_chat_n_choices_stream(client) -> None:
    kw = dict(model=MODEL, messages=MESSAGES, max_tokens=10, temperature=0.9, seed=3, n=2)
    whole = client.chat.completions.create(**kw)
    assert [c.index for c in whole.choices] == [0, 1]
    chunks = list(client.chat.completions.create(stream=True, **kw))
    assert _by_index(chunks, chat=True) == {c.index: c.message.content for c in whole.choices}
    roles = [(ch.index, ch.delta.role) for c in chunks for ch in c.choices if ch.delta.role]
    assert sorted(roles) == [(0, "assistant"), (1, "assistant")]  # each choice's first delta


def test_list_of_prompts_is_prompt_major(client) -> None:
    prompts = [PROMPT, "class Stack:\n    def __init__(self):\n"]
    single = [client.completions.create(model=MODEL, prompt=p, max_tokens=10, temperature=0).choices[0].text
              for p in prompts]
    out = client.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=10, temperature=0)
    assert [c.text for c in out.choices] == [single[0], single[0], single[1], single[1]]
    chunks = list(client.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=10, temperature=0,
                                            stream=True, extra_body={"speculation": "on"}))
    assert _by_index(chunks) == {0: single[0], 1: single[0], 2: single[1], 3: single[1]}
    assert all(len(f) == 1 for f in _finishes(chunks).values())


def test_prompts_as_token_id_lists(client) -> None:
    from transformers import AutoTokenizer

    texts = [PROMPT, "import os\n"]
    by_text = client.completions.create(model=MODEL, prompt=texts, max_tokens=8, temperature=0)
    tok = AutoTokenizer.from_pretrained("models/target")  # the served target's tokenizer
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    assert [c.text for c in by_ids.choices] == [c.text for c in by_text.choices]
    assert by_ids.usage.prompt_tokens == by_text.usage.prompt_tokens == sum(map(len, ids))


def test_echo(client) -> None:
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    echoed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, echo=True)
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text
    assert echoed.usage.completion_tokens == plain.usage.completion_tokens
    chunks = [c for c in client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0,
                                                    echo=True, stream=True) if c.choices]
    assert chunks[0].choices[0].text.startswith(PROMPT)  # the prompt rides in the first chunk
    assert "".join(c.choices[0].text for c in chunks) == echoed.choices[0].text


def test_best_of_returns_the_n_most_likely_of_best_of(client) -> None:
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=1.0, seed=11)
    assert len(client.completions.create(n=2, best_of=2, **kw).choices) == 2
    all4 = client.completions.create(n=4, logprobs=0, **kw)  # seeds 11..14: the same four generations
    best = client.completions.create(n=2, best_of=4, logprobs=0, **kw)
    mean = lambda c: sum(c.logprobs.token_logprobs) / len(c.logprobs.token_logprobs)  # noqa: E731
    ranked = sorted(all4.choices, key=mean, reverse=True)[:2]
    assert [c.text for c in best.choices] == [c.text for c in ranked]
    assert best.usage.completion_tokens == all4.usage.completion_tokens  # every candidate is generated
    plain = client.completions.create(n=1, best_of=3, **kw)
    assert len(plain.choices) == 1 and plain.choices[0].logprobs is None  # ranked, but not asked for
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(best_of=3, stream=True, **kw)
    assert bad.value.param == "best_of" and "cannot stream" in bad.value.message


def test_chat_text_parts_and_developer_role(client) -> None:
    kw = dict(model=MODEL, max_tokens=12, temperature=0)
    system = [{"role": "system", "content": "You write Python.\nBe brief."}, MESSAGES[0]]
    parts = [{"role": "developer", "content": [{"type": "text", "text": "You write Python."},
                                               {"type": "text", "text": "Be brief."}]},
             {"role": "user", "content": [{"type": "text", "text": MESSAGES[0]["content"]}]}]
    want = client.chat.completions.create(messages=system, **kw)
    got = client.chat.completions.create(messages=parts, **kw)
    assert got.choices[0].message.content == want.choices[0].message.content
    assert got.usage.prompt_tokens == want.usage.prompt_tokens


def test_max_completion_tokens_and_stop(client) -> None:
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=5, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 5 and out.choices[0].finish_reason == "length"
    free = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0).choices[0].text
    cut = "\n" if "\n" in free.strip() else free.strip()[len(free.strip()) // 2]  # met inside the continuation
    for stop in (cut, [cut, "\x00never"]):
        out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=stop)
        assert out.choices[0].text == free[:free.index(cut)] and out.choices[0].finish_reason == "stop", stop


def test_logprobs_through_the_client_with_speculation_on_and_off(client) -> None:
    """logprobs from the target's distribution, the same whether the tokens were drafted or not."""
    runs = {}
    for spec in ({"speculation": "off"}, SPEC_K3):
        out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, logprobs=2,
                                        extra_body=spec)
        lp = out.choices[0].logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 12
        assert "".join(lp.tokens) == out.choices[0].text and lp.text_offset[0] == 0
        assert all(len(top) <= 2 and max(top.values()) >= tl - 1e-6 for top, tl in zip(lp.top_logprobs, lp.token_logprobs))
        runs[spec.get("speculation", "on")] = lp.token_logprobs
    assert runs["off"] == pytest.approx(runs["on"], abs=1e-3)
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0,
                                          logprobs=True, top_logprobs=1, stream=True)
    content = [c for chunk in chat for ch in chunk.choices if ch.logprobs for c in ch.logprobs.content]
    assert len(content) == 6 and all(len(c.top_logprobs) == 1 and c.logprob <= 0 for c in content)


TOOL_CALL_SCHEMA = {
    "type": "object",
    "properties": {"function": {"type": "string", "enum": ["open", "read", "close"]},
                   "path": {"type": "string", "maxLength": 24},
                   "retries": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["function", "path", "retries"], "additionalProperties": False,
}


def _structured_text(client, response_format: dict, speculation: str, stream: bool, temperature: float = 0.0) -> str:
    kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=96, temperature=temperature, seed=3,
                  response_format=response_format, extra_body={"speculation": speculation})
    if not stream:
        out = client.chat.completions.create(**kwargs)
        assert out.choices[0].finish_reason == "stop", out  # the grammar ends the output with EOS
        return out.choices[0].message.content
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    assert chunks[-1].choices[0].finish_reason == "stop"
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_response_format_json_schema_and_object(client) -> None:
    """The output parses and follows the schema; greedy output is the same with speculation on,
    off and auto, streamed or not."""
    jsonschema = pytest.importorskip("jsonschema")
    schema_format = {"type": "json_schema", "json_schema": {"name": "call", "schema": TOOL_CALL_SCHEMA}}
    texts = {(spec, stream): _structured_text(client, schema_format, spec, stream)
             for spec in ("on", "off", "auto") for stream in (False, True)}
    assert len(set(texts.values())) == 1, texts
    jsonschema.validate(json.loads(texts["on", False]), TOOL_CALL_SCHEMA)
    free = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=24, temperature=0)
    with pytest.raises(ValueError):  # the embedded pair writes Python, not JSON, unless constrained
        json.loads(free.choices[0].message.content)
    for spec in ("on", "off"):  # sampled: a JSON object either way (lossless in distribution only)
        obj = json.loads(_structured_text(client, {"type": "json_object"}, spec, False, temperature=0.8))
        assert isinstance(obj, dict)
