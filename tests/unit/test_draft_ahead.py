"""Draft calls sent one step ahead (app/engine/draft_ahead.py): with a remote-style draft (a DraftClient
over a DraftWorker), the engine sends the next step's call as a speculative step ends and takes its
answer at the next step. The output is what calling on demand gives, greedy and seeded sampled, with
sequences joining and leaving, a planner that moves each step's depth, a draft that stops answering,
and sequences cancelled while a call is out; every cache is freed at the end."""

from __future__ import annotations

from app.engine.spec_engine import SpecEngine
from app.proposers import DraftModelProposer
from app.protocol.draft import DraftClient, DraftStepRequest, DraftStepResponse, DraftUnavailable, DraftWorker
from app.protocol.sampling_params import SamplingParams

PROMPTS = ["def fibonacci(n):\n    ", "The quick brown fox", "class Stack:\n    def __init__(self):\n",
           "import os\n\ndef list_python_files(path):\n"]


class Wire:
    """A transport to an in-process draft worker that can be made to stop answering."""

    def __init__(self, worker: DraftWorker) -> None:
        self.worker = worker
        self.calls = 0
        self.down_calls: set[int] = set()  # these calls (1-based) raise DraftUnavailable

    def __call__(self, request: DraftStepRequest) -> DraftStepResponse:
        self.calls += 1
        if self.calls in self.down_calls:
            raise DraftUnavailable("draft replica gone")
        return self.worker.step(request)


def _run(target_runner, draft_runner, encode, requests, *, ahead: bool, plan_k=None, down_calls=(),
         cancel_at: dict[int, str] | None = None) -> tuple[dict, SpecEngine, Wire]:
    wire = Wire(DraftWorker(DraftModelProposer(runner=draft_runner)))
    wire.down_calls = set(down_calls)
    engine = SpecEngine(target_runner, DraftClient("t0", wire), plan_k=plan_k, draft_ahead=ahead)
    out: dict[str, list[int]] = {}
    step = 0
    for i, (prompt, sampling, k) in enumerate(requests):
        engine.add(f"r{i}", encode(prompt), sampling, k=k, adaptive=plan_k is not None)
        for _ in range(2):  # staggered: each joins a batch already speculating
            for u in engine.step():
                out.setdefault(u.seq_id, []).extend(u.token_ids)
            step += 1
    while engine.has_work():
        if cancel_at and step in cancel_at:
            engine.abort(cancel_at[step])
        for u in engine.step():
            out.setdefault(u.seq_id, []).extend(u.token_ids)
        step += 1
    engine.flush_proposer()
    return out, engine, wire


def _requests(sampled: bool) -> list:
    out = []
    for i, prompt in enumerate(PROMPTS):
        if sampled and i % 2 == 0:
            sampling = SamplingParams(max_tokens=20 + 6 * i, temperature=0.8, top_p=0.95, seed=5 + i, ignore_eos=True)
        else:
            sampling = SamplingParams(max_tokens=14 + 5 * i, ignore_eos=True)
        out.append((prompt, sampling, 4))
    return out


def test_calls_sent_ahead_give_what_calls_on_demand_give(target_runner, draft_runner, encode):
    for sampled in (False, True):
        requests = _requests(sampled)
        ahead, engine, wire = _run(target_runner, draft_runner, encode, requests, ahead=True)
        waited, plain_engine, _ = _run(target_runner, draft_runner, encode, requests, ahead=False)
        assert ahead == waited
        # the same proposals, not just the same output (which any proposals would give): every draft
        # verified, position by position, as the on-demand run's
        assert engine.stats == plain_engine.stats
        assert [len(ahead[f"r{i}"]) for i in range(4)] == [s.max_tokens for _, s, _ in requests]
        assert engine.drafting.served > 20 and plain_engine.drafting is None
        assert engine.stats.num_draft_tokens > 0 and engine.cached_tokens() == 0
        assert wire.worker.num_sequences() == 0  # every release reached the draft


def test_a_planner_moving_depths_and_a_draft_that_stops_answering(target_runner, draft_runner, encode, plain_greedy,
                                                                  check_against_reference):
    """Depths change every step (deeper, shallower, none: the call sent ahead serves what it can, a call
    of its own the rest), and two calls fail (that step decodes plainly): greedy output is still the
    target's own."""
    turn = {"n": 0}

    def plan_k(batch, caps):
        turn["n"] += 1
        pattern = (4, 2, 0, 3, 4, 1)
        return [min(cap, pattern[(turn["n"] + j) % len(pattern)]) for j, cap in enumerate(caps)]

    requests = [(p, SamplingParams(max_tokens=16 + 4 * i, ignore_eos=True), 4) for i, p in enumerate(PROMPTS)]
    out, engine, wire = _run(target_runner, draft_runner, encode, requests, ahead=True, plan_k=plan_k,
                             down_calls={7, 12})
    for i, (prompt, sampling, _) in enumerate(requests):
        ref = plain_greedy(encode(prompt), sampling.max_tokens)
        check_against_reference(ref, out[f"r{i}"], "length", f"r{i}")
    assert engine.proposer_errors >= 1 and engine.drafting.served > 0
    assert engine.cached_tokens() == 0 and wire.worker.num_sequences() == 0


def test_a_sequence_cancelled_while_a_call_is_out_is_freed_after_it(target_runner, draft_runner, encode):
    requests = _requests(sampled=False)
    out, engine, wire = _run(target_runner, draft_runner, encode, requests, ahead=True, cancel_at={9: "r3", 11: "r0"})
    assert len(out["r1"]) == requests[1][1].max_tokens
    assert len(out.get("r3", [])) < requests[3][1].max_tokens
    assert engine.cached_tokens() == 0 and wire.worker.num_sequences() == 0
    assert not engine.drafting.in_flight
    assert not engine.proposer.sent and not engine.proposer.proposed  # nothing kept for a freed sequence


def test_turning_calls_ahead_off_between_steps_settles_the_one_in_flight(target_runner, draft_runner, encode):
    """A benchmark measures both ways in one run: turned off with a call out, the engine waits for
    it, sends the releases it held back and calls on demand from then on."""
    wire = Wire(DraftWorker(DraftModelProposer(runner=draft_runner)))
    engine = SpecEngine(target_runner, DraftClient("t0", wire))
    for i, prompt in enumerate(PROMPTS[:2]):
        engine.add(f"r{i}", encode(prompt), SamplingParams(max_tokens=24, ignore_eos=True), k=4)
    while not engine.drafting.in_flight:
        engine.step()
    engine.abort("r1")  # its release waits for the call in flight
    engine.set_draft_ahead(False)
    assert engine.drafting is None and engine.proposer.pending_release == ["r1"]  # sent with the next call
    while engine.has_work():
        engine.step()
    engine.flush_proposer()
    assert wire.worker.num_sequences() == 0 and engine.cached_tokens() == 0
    engine.set_draft_ahead(True)
    assert engine.drafting is not None and not engine.drafting.in_flight


def test_plain_steps_drop_an_answered_call_so_releases_do_not_wait(target_runner, draft_runner, encode):
    """A call sent ahead of a step that turns out plain is dropped once it has answered, and the
    releases it held back go out: they do not wait for the next drafting step, which may never come."""
    plain = {"on": True}

    def plan_k(batch, caps):
        return list(caps) if plain["on"] else [0] * len(caps)

    wire = Wire(DraftWorker(DraftModelProposer(runner=draft_runner)))
    engine = SpecEngine(target_runner, DraftClient("t0", wire), plan_k=plan_k)
    for i, prompt in enumerate(PROMPTS[:2]):
        engine.add(f"r{i}", encode(prompt), SamplingParams(max_tokens=40, ignore_eos=True), k=4, adaptive=True)
    while not engine.drafting.in_flight:
        engine.step()
    plain["on"] = False
    engine.drafting._call.future.result()  # the draft has answered
    engine.step()  # a plain step drops the answer
    assert not engine.drafting.in_flight
    engine.abort("r1")  # released at once
    assert "r1" in engine.proposer.pending_release
    while engine.has_work():
        engine.step()
    engine.flush_proposer()
    assert wire.worker.num_sequences() == 0 and not engine.proposer.sent
