"""Stop strings, EOS and max_tokens, on the real tokenizer: StopChecker alone and the engine.

Invariants: the emitted text never contains a stop string; no token after the one that
completed a stop (or after EOS) is emitted, even when a verify step accepted several; text
held back because it could still become a stop string (or an unfinished UTF-8 sequence) is
released when generation ends without that stop; EOS -> finish "stop" (EOS not emitted),
max_tokens -> finish "length".
"""

from __future__ import annotations

import copy

import pytest

from app.engine.detokenizer import StopChecker
from app.engine.spec_engine import SpecEngine
from app.proposers import DraftModelProposer
from app.proposers.oracle import OracleProposer
from app.protocol.sampling_params import SamplingParams

FOX = "The quick brown fox"  # greedy: ' jumps over the original Python module.\n\nThe "as" is a ...'


def feed_one_by_one(checker: StopChecker, ids: list[int]):
    released, kept = "", 0
    for t in ids:
        update = checker.add([t])
        released += update.delta
        kept += update.num_tokens
        if update.stopped:
            return released, kept, True
    return released, kept, False


def first_prefix_containing(tokenizer, ids: list[int], stop: str) -> int:
    """Tokens a correct stop check keeps: the shortest prefix whose text contains the stop."""
    for n in range(1, len(ids) + 1):
        if stop in tokenizer.decode(ids[:n]):
            return n
    raise AssertionError(f"{stop!r} not in the text")


# ---- StopChecker on its own ---------------------------------------------------------------
@pytest.mark.parametrize(
    "stop",
    ["return", "(a, b)", "\n    ", "rn x", "etur", "x\n"],  # whole tokens, spanning tokens, inside one token
)
def test_stop_checker_cuts_before_the_stop(tokenizer, encode, stop):
    text = "def add(a, b):\n    x = a + b\n    return x\n"
    ids = encode(text)
    want_tokens = first_prefix_containing(tokenizer, ids, stop)
    want_text = text[: text.index(stop)]
    # token by token
    released, kept, stopped = feed_one_by_one(StopChecker(tokenizer, (stop,)), ids)
    assert stopped and released == want_text and kept == want_tokens
    assert stop not in released
    # all tokens offered at once (a verify step that accepted many): the tail is dropped
    update = StopChecker(tokenizer, (stop,)).add(ids)
    assert update.stopped and update.delta == want_text and update.num_tokens == want_tokens


def test_earliest_of_several_stops_wins(tokenizer, encode):
    text = "alpha beta gamma delta"
    update = StopChecker(tokenizer, ("delta", "beta", "gamma")).add(encode(text))
    assert update.stopped and update.delta == "alpha "


def test_partial_stop_is_held_back_then_released_by_flush(tokenizer, encode):
    text = "result = compute(value)\nprint(result)"
    ids = encode(text)
    checker = StopChecker(tokenizer, ("print(result)!",))
    released, kept, stopped = feed_one_by_one(checker, ids)
    assert not stopped and kept == len(ids)
    assert released == "result = compute(value)\n"  # "print(result)" could still become the stop
    assert checker.flush() == "print(result)"
    assert checker.released == text


def test_partial_stop_released_once_it_cannot_match(tokenizer, encode):
    checker = StopChecker(tokenizer, ("ab!",))
    out = checker.add(encode("x = ab")).delta
    assert not out.endswith("ab")
    out += checker.add(encode(" + 1")).delta  # "ab" followed by " " can no longer become "ab!"
    assert out == "x = ab + 1" and checker.flush() == ""


def test_unfinished_utf8_is_held_back(tokenizer, encode):
    ids = encode("héllo")
    assert tokenizer.decode(ids[:2]).endswith("\ufffd")  # 'é' is split across byte tokens
    checker = StopChecker(tokenizer)
    assert checker.add(ids[:2]).delta == "h"
    assert checker.add(ids[2:]).delta == "éllo"
    assert "\ufffd" not in checker.released


def test_empty_stop_strings_are_ignored(tokenizer, encode):
    update = StopChecker(tokenizer, ("",)).add(encode("abc"))
    assert not update.stopped and update.delta == "abc"


# ---- the engine ---------------------------------------------------------------------------
def _engine(target_runner, draft_runner, speculate: bool):
    return SpecEngine(target_runner, DraftModelProposer(runner=draft_runner) if speculate else None)


@pytest.mark.parametrize("speculate", [True, False], ids=["spec-k6", "plain"])
@pytest.mark.parametrize("stop", ["module.", " Pyth", "\n\nThe"])
def test_engine_stops_on_stop_string(stop, speculate, target_runner, draft_runner, tokenizer, encode, plain_greedy, drive):
    prompt = encode(FOX)
    ref = plain_greedy(prompt, 40)
    full = tokenizer.decode(ref.tokens)
    assert stop in full
    engine = _engine(target_runner, draft_runner, speculate)
    engine.add("s", prompt, SamplingParams(max_tokens=40, stop=(stop,)), k=6)
    out = drive(engine)["s"]
    n = first_prefix_containing(tokenizer, ref.tokens, stop)
    assert out["finish"] == "stop"
    assert out["tokens"] == ref.tokens[:n], "tokens past the stop were emitted (or some were lost)"
    assert out["text"] == full[: full.index(stop)]
    assert stop not in out["text"]
    if speculate:
        assert out["drafted"] > 0
    assert engine.running == {} and (engine.proposer is None or engine.proposer.num_cached_sequences() == 0)


@pytest.mark.parametrize("speculate", [True, False], ids=["spec-k4", "plain"])
def test_engine_releases_held_back_text_at_the_end(speculate, target_runner, draft_runner, tokenizer, encode, plain_greedy, drive):
    prompt = encode(FOX)
    ref = plain_greedy(prompt, 9)
    full = tokenizer.decode(ref.tokens)
    assert full.endswith("module.")
    engine = _engine(target_runner, draft_runner, speculate)
    engine.add("s", prompt, SamplingParams(max_tokens=9, stop=("module.!",)), k=4)
    out: dict = {}
    while engine.has_work():
        updates = engine.step()
        drive.collect(out, updates)
        if engine.has_work():  # before the end "module." (a prefix of the stop) is held back
            assert not out["s"]["text"].endswith("module"), out["s"]["text"]
    assert out["s"]["finish"] == "length"
    assert out["s"]["tokens"] == ref.tokens
    assert out["s"]["text"] == full


@pytest.mark.parametrize("k", [0, 2, 8])
@pytest.mark.parametrize(
    "prompt,n_before_eos",
    [("unittest.main()", 16), ('if __name__ == "__main__":\n    unittest.', 3), ('if __name__ == "__main__":\n    main()\n', 0)],
)
def test_engine_eos_finishes_with_stop(prompt, n_before_eos, k, target_runner, draft_runner, tokenizer, encode, plain_greedy, drive):
    ids = encode(prompt)
    ref = plain_greedy(ids, 40)
    assert ref.finish_reason == "stop" and len(ref.tokens) == n_before_eos
    engine = _engine(target_runner, draft_runner, k > 0)
    engine.add("s", ids, SamplingParams(max_tokens=40), k=k)
    out = drive(engine)["s"]
    assert out["finish"] == "stop"
    assert out["tokens"] == ref.tokens  # EOS itself is not emitted, nothing after it either
    assert out["text"] == tokenizer.decode(ref.tokens)
    assert engine.running == {}


def test_engine_drops_accepted_proposals_after_eos(target_runner, tokenizer, encode, plain_greedy, drive):
    """An always-right oracle proposes past the (pretend) EOS in one verify step; all of it is dropped.

    The runner is shallow-copied with a different EOS id: the real model, a controlled EOS.
    """
    prompt = encode(FOX)
    ref = plain_greedy(prompt, 24)
    eos_at = 6
    runner = copy.copy(target_runner)
    runner.eos_ids = frozenset({ref.tokens[eos_at]})
    assert ref.tokens[eos_at] not in ref.tokens[:eos_at]
    oracle = OracleProposer({"s": prompt + ref.tokens, "t": prompt + ref.tokens}, alpha=1.0, vocab_size=runner.vocab_size)
    engine = SpecEngine(runner, oracle)
    engine.add("s", prompt, SamplingParams(max_tokens=24), k=8)
    out = drive(engine)["s"]
    assert out["finish"] == "stop" and out["tokens"] == ref.tokens[:eos_at]
    assert out["accepted"] > eos_at - 1  # the EOS and what followed were accepted, then dropped
    # ignore_eos decodes on to max_tokens
    engine.add("t", prompt, SamplingParams(max_tokens=24, ignore_eos=True), k=8)
    out = drive(engine)["t"]
    assert out["finish"] == "length" and out["tokens"] == ref.tokens


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 7])
@pytest.mark.parametrize("k", [0, 8])
def test_engine_max_tokens_gives_length(max_tokens, k, target_runner, draft_runner, tokenizer, encode, plain_greedy, drive):
    prompt = encode("class Stack:\n    def __init__(self):\n")
    engine = _engine(target_runner, draft_runner, k > 0)
    engine.add("s", prompt, SamplingParams(max_tokens=max_tokens), k=k)
    out = drive(engine)["s"]
    assert out["finish"] == "length"
    assert out["tokens"] == plain_greedy(prompt, 40).tokens[:max_tokens]
    assert out["text"] == tokenizer.decode(out["tokens"])
