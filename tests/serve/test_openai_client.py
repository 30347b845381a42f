"""The official `openai` Python client against the real application: completions, chat, streaming
(both), specserve's extension fields through `extra_body`, and errors mapped to its exceptions."""

from __future__ import annotations

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
                                                 stream=True, extra_body=SPEC_K3))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant"
    assert "".join(d.content or "" for d in deltas) == whole.choices[0].message.content
    usage = [c.usage for c in chunks if c.usage is not None]
    assert len(usage) == 1
    spec = speculation(usage[0])
    assert spec["mode"] == "speculative" and spec["k"] == 3


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
    """Issue 48: never a 200 that ignores what was asked; the error's `param` names the field."""
    refused = [
        (client.chat.completions.create, {"messages": MESSAGES, "tools": [
            {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}, "tools"),
        (client.chat.completions.create, {"messages": MESSAGES, "logprobs": True, "top_logprobs": 2}, "logprobs"),
        (client.chat.completions.create, {"messages": MESSAGES, "response_format": {"type": "json_object"}},
         "response_format"),
        (client.completions.create, {"prompt": PROMPT, "presence_penalty": 0.5}, "presence_penalty"),
        (client.completions.create, {"prompt": PROMPT, "logprobs": 2}, "logprobs"),
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
