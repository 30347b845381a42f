"""Plain steps launched one step ahead (app/engine/ahead.py): sequences joining, finishing, stopping
on text and being aborted while a pass is in flight each produce what they produce alone, sampled
sequences draw what they draw when every step waits for the one before, a speculating newcomer
turns the overlap off until the batch is plain again, and every cache is freed at the end."""

from __future__ import annotations

from app.engine.spec_engine import SpecEngine
from app.proposers import DraftModelProposer
from app.protocol.sampling_params import SamplingParams

PLAIN = [  # (prompt, max_tokens): staggered lengths, so sequences leave while others continue
    ("def fibonacci(n):\n    ", 30),
    ("The quick brown fox", 9),
    ("class Stack:\n    def __init__(self):\n", 21),
    ("import os\n\ndef list_python_files(path):\n", 14),
]


def _ahead_steps(engine: SpecEngine, out: dict, drive, steps: int | None = None) -> int:
    """Step (all the way, or `steps` times), counting the steps served by a pass launched ahead."""
    n = 0
    while engine.has_work() and (steps is None or steps > 0):
        launched = engine._ahead is not None
        drive.collect(out, engine.step())
        n += launched
        steps = None if steps is None else steps - 1
    return n


def test_staggered_plain_batch_launched_ahead_equals_each_alone(
    target_runner, encode, plain_greedy, check_against_reference, drive
):
    engine = SpecEngine(target_runner, None)
    out: dict = {}
    engine.add("p0", encode(PLAIN[0][0]), SamplingParams(max_tokens=PLAIN[0][1]), k=0)
    engine.add("p1", encode(PLAIN[1][0]), SamplingParams(max_tokens=PLAIN[1][1]), k=0)
    ahead = _ahead_steps(engine, out, drive, 4)
    # newcomers join while a pass is in flight; one is aborted with a pass launched for it
    engine.add("p2", encode(PLAIN[2][0]), SamplingParams(max_tokens=PLAIN[2][1]), k=0)
    engine.add("gone", encode("x = 1"), SamplingParams(max_tokens=40), k=0)
    ahead += _ahead_steps(engine, out, drive, 3)
    engine.add("p3", encode(PLAIN[3][0]), SamplingParams(max_tokens=PLAIN[3][1]), k=0)
    ahead += _ahead_steps(engine, out, drive, 2)
    assert engine._ahead is not None and "gone" in engine._ahead.seq_ids, "no pass in flight for the aborted one"
    assert engine.abort("gone")
    ahead += _ahead_steps(engine, out, drive)
    assert ahead >= 20, f"only {ahead} steps ran on a pass launched ahead"
    for i, (prompt, max_tokens) in enumerate(PLAIN):
        r = out[f"p{i}"]
        check_against_reference(plain_greedy(encode(prompt), max_tokens), r["tokens"], r["finish"], f"p{i}")
        assert r["finish"] == "length" and len(r["tokens"]) == max_tokens
    assert engine.running == {} and engine.cached_tokens() == 0


def test_a_stop_string_ends_a_sequence_whose_next_pass_is_in_flight(target_runner, encode, plain_greedy, drive):
    tokenizer = target_runner.tokenizer
    prompt = PLAIN[0][0]
    reference = tokenizer.decode(plain_greedy(encode(prompt), 30).tokens, skip_special_tokens=True)
    stop = reference[len(reference) // 2: len(reference) // 2 + 3]
    assert stop.strip(), f"pick a stop string with text in it, got {stop!r}"
    engine = SpecEngine(target_runner, None)
    engine.add("s", encode(prompt), SamplingParams(max_tokens=30, stop=[stop]), k=0)
    engine.add("long", encode(PLAIN[2][0]), SamplingParams(max_tokens=30), k=0)
    out: dict = {}
    assert _ahead_steps(engine, out, drive) > 10
    assert out["s"]["finish"] == "stop" and out["s"]["text"] == reference[:reference.index(stop)]
    assert out["long"]["tokens"] == plain_greedy(encode(PLAIN[2][0]), 30).tokens
    assert engine.cached_tokens() == 0


def test_a_speculating_newcomer_runs_the_batch_as_usual_until_it_leaves(
    target_runner, draft_runner, encode, plain_greedy, check_against_reference, drive
):
    proposer = DraftModelProposer(runner=draft_runner)
    engine = SpecEngine(target_runner, proposer)
    out: dict = {}
    engine.add("plain", encode(PLAIN[0][0]), SamplingParams(max_tokens=30), k=0)
    assert _ahead_steps(engine, out, drive, 4) >= 2
    engine.add("spec", encode(PLAIN[2][0]), SamplingParams(max_tokens=8), k=3)
    drafted_steps = launched_while_drafting = 0
    while engine.has_work():
        launched = engine._ahead is not None
        updates = engine.step()
        drive.collect(out, updates)
        drafted = any(u.drafted for u in updates)
        drafted_steps += drafted
        launched_while_drafting += launched and drafted
    assert drafted_steps >= 2 and launched_while_drafting == 0
    for sid, prompt, n in (("plain", PLAIN[0][0], 30), ("spec", PLAIN[2][0], 8)):
        check_against_reference(plain_greedy(encode(prompt), n), out[sid]["tokens"], out[sid]["finish"], sid)
    assert engine.cached_tokens() == 0 and proposer.num_cached_sequences() == 0


def test_sampled_and_greedy_sequences_draw_the_same_with_and_without_launching_ahead(target_runner, encode, drive):
    requests = [  # (prompt, sampling): seeded draws at several settings beside greedy ones, staggered
        (PLAIN[0][0], SamplingParams(max_tokens=24, temperature=0.8, seed=7)),
        (PLAIN[1][0], SamplingParams(max_tokens=12)),
        (PLAIN[2][0], SamplingParams(max_tokens=18, temperature=1.0, top_p=0.9, seed=11)),
        (PLAIN[3][0], SamplingParams(max_tokens=20, temperature=0.7, top_k=20, seed=3)),
    ]

    def run(launch_ahead: bool) -> tuple[dict, int]:
        engine = SpecEngine(target_runner, None, launch_ahead=launch_ahead)
        out: dict = {}
        ahead = 0
        for i, (prompt, sampling) in enumerate(requests):
            engine.add(f"r{i}", encode(prompt), sampling, k=0)
            ahead += _ahead_steps(engine, out, drive, 3)
        ahead += _ahead_steps(engine, out, drive)
        assert engine.cached_tokens() == 0
        return {sid: r["tokens"] for sid, r in out.items()}, ahead

    overlapped, ahead = run(True)
    waited, none = run(False)
    assert ahead >= 15 and none == 0
    assert overlapped == waited
    assert all(len(overlapped[f"r{i}"]) == s.max_tokens for i, (_, s) in enumerate(requests))
