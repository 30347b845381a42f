"""response_format on the engine (app/spec/grammar.py): the output follows the grammar, a draft
proposal the grammar forbids ends that draft, and greedy output with a response format,
penalties or logit_bias is the same with speculation on and off (a property test)."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from app.engine.spec_engine import SpecEngine
from app.proposers import DraftModelProposer
from app.proposers.base import Proposal, ProposalRequest, Proposer
from app.protocol.sampling_params import SamplingParams, StructuredOutput
from app.spec.grammar import Grammars, apply_mask

jsonschema = pytest.importorskip("jsonschema")

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12},
                   "args": {"type": "array", "items": {"type": "integer"}, "maxItems": 3},
                   "ok": {"type": "boolean"}},
    "required": ["name", "args", "ok"], "additionalProperties": False,
}
FORMATS = [None, StructuredOutput(type="json_object"),
           StructuredOutput(type="json_schema", schema_text=json.dumps(SCHEMA))]
PROMPT = 'def parse(args):\n    """Return the parsed arguments as JSON: '


def generate(target_runner, proposer: Proposer | None, encode, drive, params: SamplingParams, k: int,
             prompt: str = PROMPT, output_ids: list[int] | None = None) -> dict:
    engine = SpecEngine(target_runner, proposer)
    engine.add("s", encode(prompt), params, k=k, output_ids=output_ids)
    return drive(engine)["s"]


@pytest.fixture(scope="module")
def grammars(target_runner) -> Grammars:
    return Grammars(target_runner.tokenizer, target_runner.vocab_size, target_runner.eos_ids, max_rollback=9)


def test_output_follows_the_schema_and_ends_with_eos(target_runner, draft_runner, encode, drive) -> None:
    for k in (0, 4):
        out = generate(target_runner, DraftModelProposer(runner=draft_runner) if k else None, encode, drive,
                       SamplingParams(max_tokens=96, response_format=FORMATS[2]), k)
        assert out["finish"] == "stop"
        jsonschema.validate(json.loads(out["text"]), SCHEMA)
    free = generate(target_runner, None, encode, drive, SamplingParams(max_tokens=32), 0)
    with pytest.raises(ValueError):  # not JSON unless constrained: the constraint is what made it so
        json.loads(free["text"])


class _Scripted(Proposer):
    """Proposes fixed tokens whatever the context: most of them break the JSON grammar."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens

    def propose(self, requests: list[ProposalRequest]) -> list[Proposal]:
        return [Proposal(self.tokens[:r.k]) for r in requests]


def test_a_forbidden_proposal_ends_the_draft(target_runner, encode, drive, grammars) -> None:
    state = grammars.state(FORMATS[1])
    brace, quote = encode("{")[0], encode('"')[0]
    masks, allowed = state.masks([brace, brace, quote])
    assert allowed == 1 and masks.shape[0] == 2  # "{" then a second "{" (a key must be a string)
    masks_again, _ = state.masks([brace])
    assert torch.equal(masks_again[0], masks[0])  # the matcher was rolled back
    bad = encode("\n")[0]  # a raw newline: JSON (compact, no raw control characters in strings) never has one
    assert encode("\n") == [bad]
    params = SamplingParams(max_tokens=40, response_format=FORMATS[1])
    out = generate(target_runner, _Scripted([bad] * 4), encode, drive, params, 4)
    assert out["drafted"] == 0 and out["accepted"] == 0  # every draft ended at its first token
    assert out["tokens"] == generate(target_runner, None, encode, drive, params, 0)["tokens"]


def test_apply_mask_keeps_what_the_grammar_allows_over_a_ban(target_runner, grammars) -> None:
    state = grammars.state(FORMATS[1])
    masks, _ = state.masks([])
    logits = torch.randn(1, target_runner.vocab_size)
    masked = apply_mask(logits, masks)
    allowed = torch.isfinite(masked[0])
    assert 0 < int(allowed.sum()) < 64 and torch.equal(masked[0][allowed], logits[0][allowed])
    banned = logits.clone()
    banned[0, allowed] = float("-inf")  # min_tokens banning the only tokens the grammar allows
    assert torch.isfinite(apply_mask(banned, masks)[0]).sum() == allowed.sum()


def test_a_resumed_sequence_replays_its_output_through_the_grammar(target_runner, encode, drive) -> None:
    params = SamplingParams(max_tokens=96, response_format=FORMATS[2])
    whole = generate(target_runner, None, encode, drive, params, 0)
    rest = generate(target_runner, None, encode, drive, params, 0, output_ids=whole["tokens"][:5])
    assert rest["tokens"] == whole["tokens"][5:]
    with pytest.raises(ValueError, match="does not follow the response format"):
        generate(target_runner, None, encode, drive, params, 0, output_ids=encode("def f"))


def test_a_schema_the_compiler_refuses_is_a_value_error(target_runner, encode) -> None:
    engine = SpecEngine(target_runner, None)
    bad = StructuredOutput(type="json_schema", schema_text=json.dumps({"type": "object", "properties": {
        "a": {"type": "nonsense"}}}))
    with pytest.raises(ValueError, match='cannot be compiled: Unsupported type "nonsense"'):
        engine.add("s", encode(PROMPT), SamplingParams(response_format=bad))


@settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(fmt=st.sampled_from(FORMATS), k=st.integers(1, 6),
       presence=st.sampled_from([0.0, 0.8]), frequency=st.sampled_from([0.0, 0.5]),
       repetition=st.sampled_from([1.0, 1.3]),
       bias=st.lists(st.tuples(st.integers(0, 4095), st.sampled_from([-100.0, -2.0, 3.0])), max_size=3),
       prompt=st.sampled_from([PROMPT, "class Config:\n", "The quick brown fox"]))
def test_greedy_output_is_the_same_with_speculation_on_and_off(target_runner, draft_runner, encode, drive,
                                                                fmt, k, presence, frequency, repetition, bias,
                                                                prompt) -> None:
    params = SamplingParams(max_tokens=32, response_format=fmt, presence_penalty=presence,
                            frequency_penalty=frequency, repetition_penalty=repetition,
                            logit_bias=tuple(sorted(dict(bias).items())))
    off = generate(target_runner, None, encode, drive, params, 0, prompt)
    on = generate(target_runner, DraftModelProposer(runner=draft_runner), encode, drive, params, k, prompt)
    assert (on["tokens"], on["finish"]) == (off["tokens"], off["finish"])


def test_the_draft_follows_the_grammar(target_runner, draft_runner, encode, drive) -> None:
    """The draft masks its passes with the same grammar, so the target cuts none of its proposals
    (the embedded draft, left free, proposes Python where JSON must come)."""
    engine = SpecEngine(target_runner, DraftModelProposer(runner=draft_runner))
    engine.add("s", encode(PROMPT), SamplingParams(max_tokens=96, response_format=FORMATS[2]), k=4)
    out = drive(engine)["s"]
    assert out["finish"] == "stop" and out["drafted"] > 20
    assert engine.grammar_cut_tokens == 0
    assert out["accepted"] / out["drafted"] > 0.4


def test_the_draft_channel_carries_the_response_format() -> None:
    from app.protocol.draft_channel import decode_request, encode_request
    from app.protocol.draft import DraftSeqDelta, DraftStepRequest

    seqs = [DraftSeqDelta("a", 0, 0, [1, 2, 3], 4, SamplingParams(response_format=FORMATS[2]), 7, 2),
            DraftSeqDelta("b", 0, 0, [4], 2, SamplingParams(temperature=0.5, top_k=3, response_format=FORMATS[1]), 8, 1),
            DraftSeqDelta("c", 0, 0, [5], 3, SamplingParams(), 9, 1)]
    back = decode_request(encode_request(DraftStepRequest("client", seqs)))
    assert back.seqs == seqs


def test_prepare_compiles_ahead_so_add_finds_the_grammar(target_runner, encode) -> None:
    engine = SpecEngine(target_runner, None)
    params = SamplingParams(response_format=StructuredOutput(type="json_schema", schema_text=json.dumps(
        {"type": "object", "properties": {"prepared": {"type": "boolean"}}})))
    engine.prepare(params)
    compiled = engine._grammars._get()._compile.cache_info()
    engine.add("s", encode(PROMPT), params)
    after = engine._grammars._get()._compile.cache_info()
    assert after.misses == compiled.misses and after.hits > compiled.hits  # nothing compiled again
    with pytest.raises(ValueError, match="cannot be compiled"):
        engine.prepare(SamplingParams(response_format=StructuredOutput(type="json_schema", schema_text='{"type": 5}')))
    engine.prepare(SamplingParams())  # free text: nothing to compile


def test_a_draft_replica_compiles_in_the_background_and_drafts_freely_meanwhile(draft_runner, encode) -> None:
    """A draft replica sees a format first inside a step: it must not stall the step compiling it."""
    proposer = DraftModelProposer(runner=draft_runner)
    fmt = StructuredOutput(type="json_schema", schema_text=json.dumps({"type": "array", "items": {"type": "integer"}}))
    request = ProposalRequest("bg", encode(PROMPT), 4, SamplingParams(response_format=fmt), 0, len(encode(PROMPT)))
    assert proposer._grammar(request) is None  # compiling: this step drafts freely
    proposer._grammars._pending[fmt].result(timeout=60)
    assert proposer._grammar(request) is not None
    proposer.release("bg")
