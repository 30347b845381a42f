"""The draft <-> target step protocol (app/protocol/draft.py) without a model: after a sequence's
first step only the tokens it gained travel, the draft rebuilds each truth exactly from base and
delta, and a draft that holds another history, or none, answers a miss and gets the truth in full."""

from __future__ import annotations

import random

from app.proposers.base import Proposal, ProposalRequest, Proposer
from app.protocol.draft import (DraftClient, DraftStepRequest, DraftStepResponse, DraftWorker, extend_hash,
                                tokens_hash)
from app.protocol.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=64)


class Recorder(Proposer):
    """Proposes k copies of 1 and remembers the truth it was given per sequence."""

    def __init__(self) -> None:
        self.seen: dict[str, list[int]] = {}

    def propose(self, requests: list[ProposalRequest]) -> list[Proposal]:
        for r in requests:
            self.seen[r.seq_id] = list(r.token_ids)
        return [Proposal([1] * r.k) for r in requests]


class Wire:
    """The transport: records each request, hands it to whichever worker is current."""

    def __init__(self, worker: DraftWorker) -> None:
        self.worker = worker
        self.requests: list[DraftStepRequest] = []

    def __call__(self, request: DraftStepRequest) -> DraftStepResponse:
        self.requests.append(request)
        return self.worker.step(request)


def _request(seq_id: str, tokens: list[int]) -> ProposalRequest:
    return ProposalRequest(seq_id, list(tokens), 3, GREEDY, 0)


def test_the_hash_extends_by_appended_tokens():
    rng = random.Random(0)
    a, b = [rng.randrange(128256) for _ in range(50)], [rng.randrange(128256) for _ in range(7)]
    assert extend_hash(tokens_hash(a), b) == tokens_hash(a + b)
    assert tokens_hash([]) == 0 and tokens_hash(a) != tokens_hash(a[:-1] + [a[-1] + 1])
    assert tokens_hash([0]) != tokens_hash([0, 0])  # a zero token still changes the hash


def test_steps_send_only_new_tokens_and_the_draft_rebuilds_each_truth():
    rng = random.Random(1)
    recorder = Recorder()
    wire = Wire(DraftWorker(recorder))
    client = DraftClient("t0", wire)
    truths = {f"s{i}": [rng.randrange(1000) for _ in range(20 + i)] for i in range(3)}
    for step in range(6):
        client.propose([_request(s, t) for s, t in truths.items()])
        assert recorder.seen == truths
        if step:  # a sequence's later steps carry only what it gained since
            assert [len(d.append) for d in wire.requests[-1].seqs] == [(step - 1) % 3 + 1] * 3
        for t in truths.values():
            t.extend(rng.randrange(1000) for _ in range(step % 3 + 1))
    assert client.resends == 0 and wire.worker.misses == 0


def test_a_draft_holding_another_history_or_none_answers_a_miss_and_gets_the_truth_in_full():
    recorder = Recorder()
    wire = Wire(DraftWorker(recorder))
    client = DraftClient("t0", wire)
    truth = list(range(100, 130))
    client.propose([_request("s", truth)])
    # the draft's copy differs at one token but has the same length: the base hash tells it apart
    held, _ = wire.worker.truth["s"]
    wrong = held[:5] + [held[5] + 1] + held[6:]
    wire.worker.truth["s"] = (wrong, tokens_hash(wrong))
    truth += [7, 8]
    client.propose([_request("s", truth)])
    assert (wire.worker.misses, client.resends) == (1, 1) and recorder.seen["s"] == truth
    assert wire.requests[-1].seqs[0].base_len == 0  # the resend carries the whole truth
    # a new draft replica (it restarted, or another answers) holds nothing: a miss, then the truth
    wire.worker = DraftWorker(recorder)
    truth += [9]
    client.propose([_request("s", truth)])
    assert client.resends == 2 and recorder.seen["s"] == truth


def test_a_truth_that_is_no_longer_an_extension_resumes_from_the_common_prefix():
    recorder = Recorder()
    wire = Wire(DraftWorker(recorder))
    client = DraftClient("t0", wire)
    first = list(range(40))
    client.propose([_request("s", first)])
    changed = first[:25] + [900, 901]
    client.propose([_request("s", changed)])
    delta = wire.requests[-1].seqs[0]
    assert (delta.base_len, delta.append) == (25, [900, 901]) and delta.base_hash == tokens_hash(first[:25])
    assert recorder.seen["s"] == changed and client.resends == 0
    client.propose([_request("s", changed + [5])])  # and the next step extends the new truth
    assert wire.requests[-1].seqs[0].append == [5] and recorder.seen["s"] == changed + [5]


def test_common_prefix_is_the_shared_leading_run():
    from app.proposers.base import common_prefix

    rng = random.Random(2)
    for _ in range(3000):
        a = [rng.randrange(3) for _ in range(rng.randrange(200))]
        b = a[:rng.randrange(len(a) + 1)] + [rng.randrange(3) for _ in range(rng.randrange(50))]
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        assert common_prefix(a, b) == common_prefix(b, a) == n
