"""stop_token_ids, min_tokens and logit_bias on the engine: each changes the output as it says,
and greedy speculation gives exactly what plain decoding gives with the same settings, because
the adjusted distribution is what the draft's proposals are verified against (sampled decoding
goes through the same adjusted distribution: tests/unit/test_sampling_lossless.py covers its
exactness in distribution)."""

from __future__ import annotations

import pytest

from app.engine.spec_engine import SpecEngine
from app.proposers import DraftModelProposer
from app.protocol.sampling_params import SamplingParams

PROMPT = "def read_config(path):\n"


def run(target_runner, draft_runner, encode, drive, params: SamplingParams, k: int) -> dict:
    engine = SpecEngine(target_runner, DraftModelProposer(runner=draft_runner) if k else None)
    engine.add("s", encode(PROMPT), params, k=k)
    return drive(engine)["s"]


def test_each_control_is_the_same_with_and_without_speculation(target_runner, draft_runner, encode, drive):
    temperature = 0.0
    plain = run(target_runner, draft_runner, encode, drive,
                SamplingParams(temperature=temperature, seed=5, max_tokens=24, ignore_eos=True), 0)
    stop_at = plain["tokens"][6]
    favourite = plain["tokens"][0]
    for params in (
        SamplingParams(temperature=temperature, seed=5, max_tokens=24, ignore_eos=True, stop_token_ids=(stop_at,)),
        SamplingParams(temperature=temperature, seed=5, max_tokens=24, ignore_eos=True,
                       logit_bias=((favourite, -100.0), (plain["tokens"][1], 3.0))),
        SamplingParams(temperature=temperature, seed=5, max_tokens=24, min_tokens=20,
                       stop_token_ids=(plain["tokens"][2],)),
    ):
        off = run(target_runner, draft_runner, encode, drive, params, 0)
        on = run(target_runner, draft_runner, encode, drive, params, 4)
        assert on["drafted"] > 0
        assert (on["tokens"], on["finish"]) == (off["tokens"], off["finish"]), params


def test_stop_token_ids_end_the_output_at_the_token(target_runner, draft_runner, encode, drive):
    plain = run(target_runner, draft_runner, encode, drive, SamplingParams(max_tokens=24, ignore_eos=True), 0)
    stop_at = plain["tokens"][6]
    first = plain["tokens"].index(stop_at)
    out = run(target_runner, draft_runner, encode, drive,
              SamplingParams(max_tokens=24, ignore_eos=True, stop_token_ids=(stop_at,)), 4)
    assert out["tokens"] == plain["tokens"][:first + 1] and out["finish"] == "stop"  # kept, as vLLM


def test_min_tokens_holds_back_the_stop_tokens(target_runner, draft_runner, encode, drive):
    plain = run(target_runner, draft_runner, encode, drive, SamplingParams(max_tokens=24, ignore_eos=True), 0)
    stopper = plain["tokens"][2]
    early = run(target_runner, draft_runner, encode, drive,
                SamplingParams(max_tokens=24, ignore_eos=True, stop_token_ids=(stopper,)), 4)
    held = run(target_runner, draft_runner, encode, drive,
               SamplingParams(max_tokens=24, ignore_eos=True, stop_token_ids=(stopper,), min_tokens=12), 4)
    assert len(early["tokens"]) <= 3
    assert len(held["tokens"]) >= 12 and stopper not in held["tokens"][:12]


def test_logit_bias_moves_the_greedy_choice(target_runner, draft_runner, encode, drive):
    plain = run(target_runner, draft_runner, encode, drive, SamplingParams(max_tokens=8, ignore_eos=True), 0)
    forced = 7
    out = run(target_runner, draft_runner, encode, drive,
              SamplingParams(max_tokens=8, ignore_eos=True, logit_bias=((forced, 100.0),)), 4)
    assert out["tokens"] == [forced] * 8 != plain["tokens"]


def test_token_ids_outside_the_vocabulary_are_refused(target_runner):
    engine = SpecEngine(target_runner, None)
    with pytest.raises(ValueError, match="outside this model's vocabulary"):
        engine.add("s", [1, 2, 3], SamplingParams(stop_token_ids=(10**7,)))
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)


def test_a_sampled_request_samples_from_the_biased_distribution(target_runner, draft_runner, encode, drive):
    out = run(target_runner, draft_runner, encode, drive,
              SamplingParams(temperature=0.8, seed=3, max_tokens=8, ignore_eos=True, logit_bias=((7, 100.0),)), 4)
    assert out["tokens"] == [7] * 8 and out["drafted"] > 0


def test_penalties_against_a_hand_computation() -> None:
    import torch

    from app.spec.sampling import adjust_logits

    logits = torch.tensor([[0.5, -1.0, 2.0, 3.0], [0.5, -1.0, 2.0, 3.0]])
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0)
    # row 0 follows output [2, 2] (prompt [1]); row 1 also the proposal 3
    got = adjust_logits(logits, params, 2, (), ([1], [2, 2], [3]))
    want = torch.tensor([[0.5, -2.0, 2.0 / 2 - 0.5 - 0.5, 3.0],
                         [0.5, -2.0, 2.0 / 2 - 0.5 - 0.5, 3.0 / 2 - 0.25 - 0.5]])
    torch.testing.assert_close(got, want)


def test_penalties_are_the_same_with_and_without_speculation(target_runner, draft_runner, encode, drive):
    base = dict(max_tokens=32, ignore_eos=True)
    plain = run(target_runner, draft_runner, encode, drive, SamplingParams(**base), 0)
    for pen in (dict(frequency_penalty=1.5), dict(presence_penalty=1.0, repetition_penalty=1.3)):
        params = SamplingParams(**base, **pen)
        off = run(target_runner, draft_runner, encode, drive, params, 0)
        on = run(target_runner, draft_runner, encode, drive, params, 4)
        assert on["drafted"] > 0 and on["tokens"] == off["tokens"], pen
        assert off["tokens"] != plain["tokens"], pen  # the penalty changed the output
        assert len(set(off["tokens"])) >= len(set(plain["tokens"])), pen  # and repeats no more


def test_logprobs_are_the_targets_with_and_without_speculation(target_runner, draft_runner, encode, drive,
                                                               plain_greedy):
    import torch

    ref = plain_greedy(encode(PROMPT), 16)

    def logprobs(k: int) -> list:
        engine = SpecEngine(target_runner, DraftModelProposer(runner=draft_runner) if k else None)
        engine.add("s", encode(PROMPT), SamplingParams(max_tokens=16, logprobs=3), k=k)
        got: list = []
        while engine.has_work():
            for u in engine.step():
                assert u.logprobs is not None and len(u.logprobs) == len(u.token_ids)
                got += list(zip(u.token_ids, u.logprobs))
        return got

    for k in (0, 4):
        got = logprobs(k)
        assert [t for t, _ in got] == ref.tokens[:len(got)]
        for i, (token, (lp, alts)) in enumerate(got):
            want = torch.log_softmax(ref.logits[i], dim=-1)
            assert abs(lp - float(want[token])) < 1e-3, (k, i)
            assert [a for a, _ in alts] == want.topk(3).indices.tolist() and alts[0][0] == token


# sampled plain decoding draws per position; sampled speculation is exact in distribution only
# (where a step ends decides which draws are used), so its resumed tokens are checked greedy
@pytest.mark.parametrize("temperature,k", [(0.8, 0), (0.0, 4)])
def test_a_resumed_sequence_continues_as_if_uninterrupted(target_runner, draft_runner, encode, drive,
                                                          temperature, k):
    """A failover re-issues the request with the output already streamed: the new replica's tokens
    are the rest of what one uninterrupted run gives, also where the output so far matters
    (penalties count it, min_tokens and max_tokens include it, randomness is per position)."""
    params = SamplingParams(temperature=temperature, seed=11, max_tokens=24, min_tokens=16, frequency_penalty=0.7,
                            repetition_penalty=1.3, stop_token_ids=(encode("\n")[0],))
    whole = run(target_runner, draft_runner, encode, drive, params, k)
    assert len(whole["tokens"]) >= 16
    engine = SpecEngine(target_runner, DraftModelProposer(runner=draft_runner) if k else None)
    engine.add("s", encode(PROMPT), params, k=k, output_ids=whole["tokens"][:9])
    rest = drive(engine)["s"]
    assert (rest["tokens"], rest["finish"]) == (whole["tokens"][9:], whole["finish"])
