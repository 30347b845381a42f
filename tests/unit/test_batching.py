"""Continuous batching: requests of mixed lengths and depths arriving at different steps each
produce exactly what they produce alone (the plain greedy reference, same near-tie rule);
finishing and aborting free every cache; the queue bound is enforced."""

from __future__ import annotations

import pytest

from app.config import EngineLimits
from app.engine.spec_engine import Overloaded, SpecEngine
from app.proposers import DraftModelProposer, NgramProposer
from app.protocol.sampling_params import SamplingParams

# (prompt, max_tokens, k): mixed lengths 8..40 and depths 0 and 2..5
REQUESTS = [
    ("def fibonacci(n):\n    ", 40, 4),
    ("The quick brown fox", 8, 0),
    ("class Stack:\n    def __init__(self):\n", 33, 2),
    ("Return the number of seconds since the epoch, as a", 17, 5),
    ("import os\n\ndef list_python_files(path):\n", 26, 3),
    ("unittest.main()", 40, 5),  # ends on EOS after 16 tokens
]
ARRIVALS = [(0, 1), (3,), (2, 4, 5)]  # added before step 0, after 3 steps, after 2 more


@pytest.mark.parametrize("proposer_kind", ["draft_model", "ngram"])
def test_staggered_mixed_batch_equals_each_alone(
    proposer_kind, target_runner, draft_runner, encode, plain_greedy, check_against_reference, drive
):
    proposer = DraftModelProposer(runner=draft_runner) if proposer_kind == "draft_model" else NgramProposer(1, 4)
    engine = SpecEngine(target_runner, proposer)
    out: dict = {}
    max_batch, mixed_step = 0, False

    def step():
        nonlocal max_batch, mixed_step
        drive.collect(out, engine.step())
        t = engine.last_times
        max_batch = max(max_batch, t.batch_size)
        mixed_step |= 0 < t.num_speculating < t.batch_size

    for wave, pause in zip(ARRIVALS, (3, 2, 0)):
        for i in wave:
            prompt, max_tokens, k = REQUESTS[i]
            engine.add(f"r{i}", encode(prompt), SamplingParams(max_tokens=max_tokens), k=k)
        for _ in range(pause):
            step()
    while engine.has_work():
        step()
    assert max_batch >= 4, "the requests never actually shared a forward"
    assert mixed_step, "no step mixed speculating and plain-decoding sequences"
    for i, (prompt, max_tokens, k) in enumerate(REQUESTS):
        r = out[f"r{i}"]
        check_against_reference(plain_greedy(encode(prompt), max_tokens), r["tokens"], r["finish"], f"r{i} {prompt!r}")
        if k == 0:
            assert r["drafted"] == 0
    assert out["r5"]["finish"] == "stop" and out["r1"]["finish"] == "length"
    assert engine.running == {} and not engine.waiting
    assert engine.cached_tokens() == 0
    assert proposer.num_cached_sequences() == 0


def test_step_planner_moves_depth_per_step_without_changing_tokens(
    target_runner, draft_runner, encode, plain_greedy, check_against_reference, drive
):
    """The engine hands the planner the batch and each sequence's cap (its k, bounded by the
    output left); an adaptive sequence drafts whatever the plan says (0 included), a forced one
    its cap every step, and the tokens stay the plain greedy ones whatever the plan."""
    proposer = DraftModelProposer(runner=draft_runner)
    calls: list[list[tuple[str, int]]] = []

    def planner(batch, caps):
        calls.append([(s.seq_id, c) for s, c in zip(batch, caps)])
        step = len(calls)
        # adaptive: plain on even steps, one draft on every third, the cap otherwise
        return [c if not s.adaptive else (0 if step % 2 == 0 else (1 if step % 3 == 0 else c))
                for s, c in zip(batch, caps)]

    engine = SpecEngine(target_runner, proposer, plan_k=planner)
    reqs = {"auto": ("def fibonacci(n):\n    ", 30, 4, True), "forced": ("class Stack:\n", 20, 3, False),
            "plain": ("The quick brown fox", 12, 0, True)}
    for rid, (prompt, max_tokens, k, adaptive) in reqs.items():
        engine.add(rid, encode(prompt), SamplingParams(max_tokens=max_tokens), k=k, adaptive=adaptive)
    out: dict = {}
    drafted_per_step: list[dict[str, int]] = []
    while engine.has_work():
        updates = engine.step()
        drive.collect(out, updates)
        drafted_per_step.append({u.seq_id: u.drafted for u in updates})
    for rid, (prompt, max_tokens, k, _) in reqs.items():
        r = out[rid]
        check_against_reference(plain_greedy(encode(prompt), max_tokens), r["tokens"], r["finish"], rid)
    # caps: never above k, never past the output left (max_tokens - emitted - 1)
    for call in calls:
        for rid, cap in call:
            assert cap <= reqs[rid][2]
    assert all(cap == 0 for call in calls for rid, cap in call if rid == "plain")
    auto_drafts = [d["auto"] for d in drafted_per_step if "auto" in d]
    assert 0 in auto_drafts[1:] and 1 in auto_drafts and 4 in auto_drafts, auto_drafts
    forced = [d["forced"] for d in drafted_per_step[1:] if "forced" in d]
    assert forced and all(n in (3, 2, 1, 0) for n in forced) and forced.count(3) >= len(forced) - 3
    assert out["plain"]["drafted"] == 0
    assert proposer.num_cached_sequences() == 0


def test_abort_mid_run_frees_caches(target_runner, draft_runner, encode, plain_greedy, check_against_reference, drive):
    proposer = DraftModelProposer(runner=draft_runner)
    engine = SpecEngine(target_runner, proposer, limits=EngineLimits(max_num_seqs=3))
    params = SamplingParams(max_tokens=30)
    for i in (0, 2, 3):
        engine.add(f"r{i}", encode(REQUESTS[i][0]), params, k=4)
    engine.add("queued", encode("x = 1"), params, k=4)
    out: dict = {}
    for _ in range(3):
        drive.collect(out, engine.step())
    assert set(engine.running) == {"r0", "r2", "r3"} and [s.seq_id for s in engine.waiting] == ["queued"]
    assert proposer.num_cached_sequences() == 3
    held = target_runner.length("r2")
    assert held > 0 and engine.cached_tokens() > held

    assert engine.abort("r2")
    assert "r2" not in engine.running and "r2" not in proposer.fed
    assert "r2" not in target_runner and "r2" not in draft_runner
    assert proposer.num_cached_sequences() == 2
    assert engine.abort("queued") and not engine.waiting
    assert not engine.abort("r2") and not engine.abort("never-added")

    rest = drive(engine)
    assert "r2" not in rest and "queued" not in rest
    for sid in ("r0", "r3"):
        tokens = out[sid]["tokens"] + rest[sid]["tokens"]
        check_against_reference(plain_greedy(encode(REQUESTS[int(sid[1])][0]), 30), tokens, rest[sid]["finish"], sid)
    assert engine.running == {} and proposer.num_cached_sequences() == 0
    # an aborted id can be reused
    engine.add("r2", encode(REQUESTS[2][0]), SamplingParams(max_tokens=5), k=2)
    assert drive(engine)["r2"]["finish"] == "length"


def test_overloaded_when_the_queue_is_full(target_runner, encode, drive):
    """max_num_seqs=1, max_queue=1: one running, one waiting, the next is refused."""
    engine = SpecEngine(target_runner, NgramProposer(1, 4), limits=EngineLimits(max_num_seqs=1, max_queue=1))
    params = SamplingParams(max_tokens=4)
    prompt = encode("x = 1")
    engine.add("a", prompt, params)  # takes the free slot at the next step
    engine.add("b", prompt, params)  # waits
    with pytest.raises(Overloaded):
        engine.add("c", prompt, params)
    engine.step()
    assert list(engine.running) == ["a"] and [s.seq_id for s in engine.waiting] == ["b"]
    with pytest.raises(Overloaded):
        engine.add("c", prompt, params)
    out = drive(engine)
    assert out["a"]["finish"] == out["b"]["finish"] == "length"
    engine.add("c", prompt, params)  # room again
    assert drive(engine)["c"]["finish"] == "length"


def test_overloaded_counts_the_kv_budget(target_runner, encode):
    """A slot is free but the KV budget is spent: requests wait, and the queue bound applies."""
    engine = SpecEngine(target_runner, None, limits=EngineLimits(max_num_seqs=8, max_cached_tokens=64, max_queue=1))
    prompt = encode("x = 1")
    params = SamplingParams(max_tokens=64 - len(prompt))
    engine.add("a", prompt, params)
    engine.step()
    engine.add("b", prompt, params)  # a slot is free but a holds the whole KV budget: b waits
    with pytest.raises(Overloaded):
        engine.add("c", prompt, params)
    engine.step()
    assert list(engine.running) == ["a"]


def test_add_validates(target_runner, encode):
    engine = SpecEngine(target_runner, None, limits=EngineLimits(max_cached_tokens=32))
    with pytest.raises(ValueError, match="empty"):
        engine.add("a", [], SamplingParams())
    with pytest.raises(ValueError, match="KV budget"):
        engine.add("a", encode("x"), SamplingParams(max_tokens=40))
    engine.add("a", encode("x"), SamplingParams(max_tokens=8))
    with pytest.raises(ValueError, match="already exists"):
        engine.add("a", encode("y"), SamplingParams(max_tokens=8))
    with pytest.raises(ValueError, match="context"):
        SpecEngine(target_runner, None).add("b", encode("x"), SamplingParams(max_tokens=target_runner.max_context))


def test_sampled_request_is_batch_independent(target_runner, draft_runner, encode, drive):
    """Per-position seeded randomness: a seeded sampled request gives the same tokens alone and
    in a batch with others (different batch composition, different arrival step)."""
    prompt = encode("The history of the module begins")
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=24, seed=21)

    def alone():
        engine = SpecEngine(target_runner, DraftModelProposer(runner=draft_runner))
        engine.add("s", prompt, params, k=3)
        return drive(engine)["s"]["tokens"]

    engine = SpecEngine(target_runner, DraftModelProposer(runner=draft_runner))
    engine.add("x", encode(REQUESTS[0][0]), SamplingParams(max_tokens=30), k=4)
    engine.add("y", encode(REQUESTS[2][0]), SamplingParams(temperature=1.0, seed=1, max_tokens=30), k=2)
    out: dict = {}
    drive.collect(out, engine.step())
    drive.collect(out, engine.step())
    engine.add("s", prompt, params, k=3)
    while engine.has_work():
        drive.collect(out, engine.step())
    assert out["s"]["tokens"] == alone()
