"""The OpenAI request models (app/protocol/openai_api.py): every field is implemented, or refused by
name when set to anything but null or a value that asks for nothing — never silently ignored."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError

from app.protocol.openai_api import (
    NOT_SUPPORTED, ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
    TokenizeChatRequest, TokenizeCompletionRequest, template_messages, tokenize_model,
)
from app.protocol.sampling_params import StructuredOutput

COMPLETION: dict[str, Any] = {"model": "m", "prompt": "def f():\n"}
CHAT: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def completion(**fields: Any) -> CompletionRequest:
    return CompletionRequest.model_validate({**COMPLETION, **fields})


def chat(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({**CHAT, **fields})


def refusal(make, **fields: Any) -> dict[str, Any]:
    """The first validation error of a refused request (the router answers with it)."""
    with pytest.raises(ValidationError) as e:
        make(**fields)
    return e.value.errors()[0]


# ---- refused by name ------------------------------------------------------------------------------
def test_stop_token_ids_min_tokens_and_logit_bias_reach_the_engine() -> None:
    body = completion(stop_token_ids=[7, 9], min_tokens=3, logit_bias={"42": -100, "5": 2.5}, max_tokens=8)
    params = body.sampling(default_max_tokens=16)
    assert params.stop_token_ids == (7, 9) and params.min_tokens == 3
    assert params.logit_bias == ((5, 2.5), (42, -100.0))
    pen = completion(presence_penalty=0.5, frequency_penalty=-1.0, repetition_penalty=1.2).sampling(16)
    assert (pen.presence_penalty, pen.frequency_penalty, pen.repetition_penalty) == (0.5, -1.0, 1.2)
    assert completion(min_p=0.1).sampling(16).min_p == 0.1
    assert completion(logprobs=0).sampling(16).logprobs == 0 and completion().sampling(16).logprobs is None
    assert chat(logprobs=True, top_logprobs=3).sampling(16).logprobs == 3
    assert chat(logprobs=False, top_logprobs=3).sampling(16).logprobs is None


def test_logprobs_blocks_have_openais_shapes() -> None:
    from app.protocol.openai_api import logprobs_block

    decode = {5: "ab", 6: "c", 7: "é"}.__getitem__
    tokens = [(5, -0.1, [(5, -0.1), (6, -2.5)]), (7, -0.7, [(7, -0.7), (5, -1.0)])]
    block = logprobs_block(decode, tokens, chat=False, text_offset=3)
    assert block == {"tokens": ["ab", "é"], "token_logprobs": [-0.1, -0.7],
                     "top_logprobs": [{"ab": -0.1, "c": -2.5}, {"é": -0.7, "ab": -1.0}], "text_offset": [3, 5]}
    content = logprobs_block(decode, tokens, chat=True)["content"]
    assert content[1] == {"token": "é", "logprob": -0.7, "bytes": [195, 169],
                          "top_logprobs": [{"token": "é", "logprob": -0.7, "bytes": [195, 169]},
                                           {"token": "ab", "logprob": -1.0, "bytes": [97, 98]}]}
    assert logprobs_block(decode, None, chat=True) is None
    with pytest.raises(ValueError, match="min_tokens 9 is more than the 8 tokens"):
        completion(min_tokens=9, max_tokens=8).sampling(default_max_tokens=16)



def test_response_format_becomes_the_engines_structured_output() -> None:
    assert chat(response_format={"type": "text"}).sampling(16).response_format is None
    assert chat(response_format={"type": "json_object"}).sampling(16).response_format == \
        StructuredOutput(type="json_object")
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    fmt = chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}).sampling(16)
    assert fmt.response_format.type == "json_schema" and json.loads(fmt.response_format.schema_text) == schema
    # without a schema: any JSON value
    bare = chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}}).sampling(16)
    assert json.loads(bare.response_format.schema_text) == {}


NOT_SUPPORTED_CASES: list[tuple[Any, str, Any]] = [
    (chat, "tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]),
    (chat, "tool_choice", "required"),
    (chat, "tool_choice", {"type": "function", "function": {"name": "f"}}),
    (chat, "functions", [{"name": "f"}]),
    (chat, "function_call", {"name": "f"}),
    (chat, "audio", {"voice": "alloy", "format": "wav"}),
    (chat, "modalities", ["text", "audio"]),
    (chat, "prediction", {"type": "content", "content": "x"}),
    (chat, "reasoning_effort", "low"),
    (chat, "web_search_options", {}),
    (chat, "store", True),
    (chat, "service_tier", "flex"),
    (completion, "suffix", "\n    return x\n"),
]


@pytest.mark.parametrize(("make", "name", "value"), NOT_SUPPORTED_CASES,
                         ids=[f"{m.__name__}-{n}-{i}" for i, (m, n, _v) in enumerate(NOT_SUPPORTED_CASES)])
def test_unimplemented_openai_fields_are_refused_by_name(make, name: str, value: Any) -> None:
    err = refusal(make, **{name: value})
    assert err["loc"] == (name,) and err["type"] == "not_supported", err
    assert NOT_SUPPORTED[name][1] in err["msg"]


@pytest.mark.parametrize(("make", "name"), [
    (completion, "guided_json"), (completion, "best_of_n"), (chat, "echo"), (chat, "suffix"),
    (completion, "tools"), (completion, "top_logprobs"), (chat, "prompt"),
])
def test_unknown_keys_are_refused_by_name(make, name: str) -> None:
    err = refusal(make, **{name: 1})
    assert err["loc"] == (name,) and err["type"] == "extra_forbidden", err


def test_nested_unknown_keys_are_refused_with_their_path() -> None:
    err = refusal(chat, messages=[{"role": "user", "content": "hi", "name": "bob"}])
    assert err["loc"] == ("messages", 0, "name") and err["type"] == "extra_forbidden"
    err = refusal(chat, messages=[{"role": "assistant", "content": "", "tool_calls": [{"id": "1"}]}])
    assert err["loc"] == ("messages", 0, "tool_calls")
    err = refusal(completion, stream=True, stream_options={"continuous_usage_stats": True})
    assert err["loc"] == ("stream_options", "continuous_usage_stats")


def test_refusal_message_names_what_is_accepted() -> None:
    assert refusal(chat, tool_choice="required")["msg"].endswith('send null or "none" or "auto"')


def test_values_are_type_checked_before_the_refusal() -> None:
    """Out-of-range or ill-typed values get the usual error, so turning a field on later keeps them."""
    assert refusal(completion, presence_penalty=3.0)["type"] == "less_than_equal"
    assert refusal(completion, logit_bias={"x": 1})["loc"][0] == "logit_bias"
    assert refusal(completion, logit_bias={"3": 101})["type"] == "less_than_equal"
    assert refusal(chat, response_format={"type": "xml"})["loc"][:2] == ("response_format", "type")
    assert refusal(chat, response_format={"type": "json_schema"})["loc"] == ("response_format",)
    assert refusal(chat, top_logprobs=21)["type"] == "less_than_equal"


# ---- nulls and defaults keep working ------------------------------------------------------------
def test_nulls_are_accepted_everywhere_but_required_fields() -> None:
    optional_c = [n for n, f in CompletionRequest.model_fields.items() if not f.is_required()]
    optional_ch = [n for n, f in ChatCompletionRequest.model_fields.items() if not f.is_required()]
    assert completion(**dict.fromkeys(optional_c)) == completion()
    assert chat(**dict.fromkeys(optional_ch)) == chat()
    assert chat(messages=[{"role": "user", "content": "hi", "name": None, "tool_calls": None}]) == chat()
    assert completion(whatever_unknown=None) == completion()  # null asks for nothing, known or not
    for make, required in ((completion, "prompt"), (completion, "model"), (chat, "messages")):
        assert refusal(make, **{required: None})["loc"][0] == required


def test_defaults_sent_explicitly_are_accepted() -> None:
    defaults = dict(logprobs=False, top_logprobs=0, presence_penalty=0, frequency_penalty=0.0,
                    repetition_penalty=1.0, logit_bias={}, min_tokens=0, min_p=0.0, stop_token_ids=[],
                    response_format={"type": "text"}, tools=[], tool_choice="none", parallel_tool_calls=True,
                    functions=[], function_call="auto", modalities=["text"], store=False, service_tier="auto",
                    verbosity="medium", user="user-1", metadata={"k": "v"}, prompt_cache_key="k",
                    safety_identifier="s", stream_options={"include_usage": False})
    out = chat(**defaults)
    assert out.sampling(16) == chat().sampling(16)
    assert completion(suffix="", presence_penalty=0.0, user="u").sampling(16) == completion().sampling(16)


def test_tables_name_declared_fields() -> None:
    """Every field in the refusal tables is declared (typed) by a request model."""
    declared = set(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields)
    assert set(NOT_SUPPORTED) <= declared


# ---- n, best_of, several prompts, echo, text parts, developer role --------------------------------
def test_choice_seeds_are_seed_plus_index() -> None:
    req = completion(n=3, seed=41, temperature=0.7)
    assert [req.sampling(16, choice=i).seed for i in range(3)] == [41, 42, 43]
    assert req.sampling(16) == completion(seed=41, temperature=0.7).sampling(16)  # choice 0 = the n=1 request
    assert completion(n=2).sampling(16, choice=1).seed is None  # unseeded: each choice draws its own
    assert completion(n=2, seed=2**63 - 1).sampling(16, choice=1).seed == 0  # wraps inside the range


def test_prompts_text_ids_and_lists() -> None:
    assert completion(prompt="a").prompts() == ["a"]
    assert completion(prompt=[5, 6]).prompts() == [[5, 6]]
    assert completion(prompt=["a", "b"]).prompts() == ["a", "b"]
    assert completion(prompt=[[1], [2, 3]]).prompts() == [[1], [2, 3]]
    for bad in ([], [""], ["a", ""], [[]], ["a", 1], [{"text": "a"}]):
        assert refusal(completion, prompt=bad)["loc"][0] == "prompt", bad
    assert "at most 32 prompts" in refusal(completion, prompt=["a"] * 33)["msg"]
    assert "generations" in refusal(completion, prompt=["a", "b", "c"], n=11)["msg"]
    completion(prompt=["a"] * 2, n=16)  # 32 generations: the limit


def test_n_and_best_of() -> None:
    assert refusal(completion, n=0)["loc"] == ("n",)
    assert refusal(chat, n=17)["loc"] == ("n",)
    assert completion(n=3, best_of=3).best_of == 3
    assert refusal(completion, n=3, best_of=2)["loc"] == ("best_of",)
    assert completion(best_of=2).best_of == 2
    assert "cannot stream" in refusal(completion, best_of=2, stream=True)["msg"]


def test_best_of_keeps_the_highest_mean_logprob() -> None:
    from app.protocol.openai_api import best_of_order

    scores = [[-1.0, -1.0], [-0.1], [-3.0, -0.1, -0.2], []]  # means -1, -0.1, -1.1, none
    assert best_of_order(scores, 2) == [1, 0]
    assert best_of_order(scores, 4) == [1, 0, 2, 3]


def test_echo_is_a_completions_field() -> None:
    assert completion(echo=True).echo and not completion().echo
    assert refusal(chat, echo=True)["type"] == "extra_forbidden"


def test_chat_text_parts_and_developer_role() -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    req = chat(messages=[{"role": "developer", "content": parts}, {"role": "user", "content": "q"}])
    assert template_messages(req.messages) == [{"role": "system", "content": "a\nb"}, {"role": "user", "content": "q"}]
    err = refusal(chat, messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
    assert err["loc"] == ("messages", 0, "content") and err["type"] == "not_supported" and "image_url" in err["msg"]
    assert refusal(chat, messages=[{"role": "user", "content": []}])["loc"] == ("messages", 0, "content")
    assert refusal(chat, messages=[{"role": "tool", "content": "1"}])["loc"] == ("messages", 0, "role")


def test_max_tokens_param_names_the_field_that_set_it() -> None:
    assert chat(max_completion_tokens=5, max_tokens=9).sampling(16).max_tokens == 5
    assert chat(max_completion_tokens=5).max_tokens_param == "max_completion_tokens"
    assert chat(max_tokens=5).max_tokens_param == "max_tokens"


def test_stop_as_string_or_list() -> None:
    assert completion(stop="\n").sampling(16).stop == ("\n",)
    assert completion(stop=["a", "", "b"]).sampling(16).stop == ("a", "b")
    assert refusal(completion, stop=["a"] * 5)["loc"] == ("stop",)


def test_usage_chunk_only_when_asked() -> None:
    assert not completion(stream=True).usage_in_stream()
    assert completion(stream=True, stream_options={"include_usage": True}).usage_in_stream()
    assert not chat(stream=True, stream_options={"include_usage": False}).usage_in_stream()
    assert not chat(stream=True, stream_options={"include_usage": None}).usage_in_stream()  # null = not given
    # specserve's return_provenance asks for it too (the playground and bench.load read both) ...
    assert completion(stream=True, return_provenance=True).usage_in_stream()
    # ... unless include_usage says otherwise
    assert not completion(stream=True, return_provenance=True,
                          stream_options={"include_usage": False}).usage_in_stream()


# ---- /tokenize and /detokenize ---------------------------------------------------------------------
def test_tokenize_requests() -> None:
    assert tokenize_model({"prompt": "x"}) is TokenizeCompletionRequest
    assert tokenize_model({"messages": []}) is TokenizeChatRequest
    req = TokenizeCompletionRequest.model_validate({"prompt": "x", "model": None})
    assert req.model is None and not req.add_special_tokens and not req.return_token_strs  # as completions
    msgs = [{"role": "developer", "content": [{"type": "text", "text": "d"}]}, {"role": "user", "content": "u"}]
    chat_req = TokenizeChatRequest.model_validate({"model": "m", "messages": msgs})
    assert chat_req.add_generation_prompt and not chat_req.add_special_tokens
    assert chat_req.template_messages()[0] == {"role": "system", "content": "d"}
    for model, data, loc in ((TokenizeCompletionRequest, {"prompt": "x", "tools": []}, ("tools",)),
                             (TokenizeCompletionRequest, {}, ("prompt",)),
                             (TokenizeChatRequest, {"messages": []}, ("messages",)),
                             (DetokenizeRequest, {"tokens": ["a"]}, ("tokens", 0))):
        with pytest.raises(ValidationError) as e:
            model.model_validate(data)
        assert e.value.errors()[0]["loc"] == loc
    assert DetokenizeRequest.model_validate({"tokens": [1, 2]}).tokens == [1, 2]
