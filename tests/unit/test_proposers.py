"""The proposers on their own: n-gram lookup, the draft model (batched, greedy and sampled,
its cache), the oracle, the factory, and the engine's fallback when a proposer is gone."""

from __future__ import annotations

import copy

import pytest
import torch

from app.config import EngineConfig, ModelSpec, SpeculationConfig
from app.engine.spec_engine import ProposerUnavailable, SpecEngine
from app.proposers import DraftModelProposer, NgramProposer, make_proposer
from app.proposers.base import Proposal, ProposalRequest, Proposer
from app.proposers.ngram import ngram_lookup
from app.proposers.oracle import OracleProposer
from app.protocol.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=32)


# ---- n-gram -------------------------------------------------------------------------------
def test_ngram_lookup_follows_the_most_recent_longest_match():
    #         0  1  2  3  4  5  6  7  8  9
    tokens = [1, 2, 3, 9, 1, 2, 4, 5, 1, 2]
    # suffix [1, 2]: most recent earlier occurrence at 4 -> followed by 4, 5, 1
    assert ngram_lookup(tokens, 3, 1, 4) == [4, 5, 1]
    assert ngram_lookup(tokens, 1, 1, 4) == [4]
    # a longer suffix beats a more recent shorter one: [3, 1, 2] ... [7, 3, 1, 2]
    tokens = [7, 3, 1, 2, 8, 8, 1, 2, 6, 6, 3, 1, 2]
    assert ngram_lookup(tokens, 2, 1, 3) == [8, 8]
    assert ngram_lookup(tokens, 2, 1, 2) == [6, 6]  # only [1, 2]: the most recent wins
    # nothing to continue from
    assert ngram_lookup([1, 2, 3, 4], 3, 1, 4) == []
    assert ngram_lookup([5], 3, 1, 4) == []
    # n_min excludes short matches
    assert ngram_lookup([1, 2, 3, 2], 2, 1, 4) == [3, 2]
    assert ngram_lookup([1, 2, 3, 2], 2, 2, 4) == []
    # a match near the end proposes fewer than k
    assert ngram_lookup([4, 5, 4], 5, 1, 1) == [5, 4]


def test_ngram_proposer_batches_in_order():
    p = NgramProposer(1, 3)
    reqs = [ProposalRequest("a", [1, 2, 1], 2, GREEDY, 0), ProposalRequest("b", [3, 4], 2, GREEDY, 0),
            ProposalRequest("c", [5, 6, 7, 5, 6], 1, GREEDY, 0)]
    out = p.propose(reqs)
    assert [x.tokens for x in out] == [[2, 1], [], [7]]
    assert all(x.probs is None for x in out)
    assert p.num_cached_sequences() == 0


# ---- draft model --------------------------------------------------------------------------
PROMPTS = ["def fibonacci(n):\n    ", "The quick brown fox", "import os\n\ndef walk(top):\n", "x = [i * i for i in"]


def test_draft_greedy_proposals_are_the_drafts_greedy_continuation(draft_runner, encode, draft_plain_greedy):
    proposer = DraftModelProposer(runner=draft_runner)
    ids = [encode(p) for p in PROMPTS]
    ks = [1, 3, 5, 8]
    batched = proposer.propose([ProposalRequest(f"s{i}", t, k, GREEDY, 0) for i, (t, k) in enumerate(zip(ids, ks))])
    for t, k, prop in zip(ids, ks, batched):
        want = draft_plain_greedy(t, 8).decisions()[:k]
        assert prop.tokens == want and prop.probs is None
    assert proposer.num_cached_sequences() == 4
    # the next step: two proposals of s3 accepted plus a target correction -> caught up, rolled back
    truth = ids[3] + batched[3].tokens[:2] + [42]
    again = proposer.propose([ProposalRequest("s3", truth, 4, GREEDY, 0)])[0]
    assert again.tokens == draft_plain_greedy(truth, 4).decisions()
    for i in range(4):
        proposer.release(f"s{i}")
    proposer.release("never-seen")
    assert proposer.num_cached_sequences() == 0


def test_draft_reports_its_first_pass_so_catch_ups_are_told_from_draft_steps(draft_runner, encode):
    from app.protocol.draft import DraftClient, DraftWorker

    proposer = DraftModelProposer(runner=draft_runner)
    ids = [encode(p) for p in PROMPTS[:2]]
    first = proposer.propose([ProposalRequest(f"s{i}", t, 3, GREEDY, 0) for i, t in enumerate(ids)])
    fp = proposer.last_first_pass
    assert (fp.tokens, fp.sequences) == (sum(map(len, ids)), 2) and fp.caught_up and fp.seconds > 0
    # all three accepted + the bonus: each sequence feeds its unfed third proposal and the bonus
    truth = [t + p.tokens + [7] for t, p in zip(ids, first)]
    second = proposer.propose([ProposalRequest(f"s{i}", t, 3, GREEDY, 0) for i, t in enumerate(truth)])
    assert (proposer.last_first_pass.tokens, proposer.last_first_pass.sequences) == (4, 2)
    assert not proposer.last_first_pass.caught_up
    # one proposal accepted, then sixteen plain steps: a catch-up again
    behind = [t + p.tokens[:1] + [5] * 16 for t, p in zip(truth, second)]
    proposer.propose([ProposalRequest(f"s{i}", t, 2, GREEDY, 0) for i, t in enumerate(behind)])
    assert proposer.last_first_pass.caught_up and proposer.last_first_pass.tokens == 2 * 16  # p1 was held
    # the worker and the client carry it across the hop
    client = DraftClient("t0", DraftWorker(DraftModelProposer(runner=draft_runner)).step)
    assert client.catch_up_tokens("a", ids[0]) == len(ids[0]) - 2  # never seen: its whole context
    got = client.propose([ProposalRequest("a", ids[0], 2, GREEDY, 0)])[0].tokens
    assert client.last_first_pass.tokens == len(ids[0]) and client.last_first_pass.caught_up
    # the client predicts what the draft's next first pass feeds beyond an ordinary step's 1-2 tokens
    after = ids[0] + got + [9]  # both accepted + the bonus: the draft feeds got[-1] and the bonus
    assert client.catch_up_tokens("a", after) == 0
    plain = after + [4] * 10  # then ten plain steps
    assert client.catch_up_tokens("a", plain) == 10
    client.propose([ProposalRequest("a", plain, 2, GREEDY, 0)])
    assert client.last_first_pass.tokens == 10 + 2  # ...and it did: the catch-up plus an ordinary feed
    client.release("a")
    assert client.catch_up_tokens("a", plain) == len(plain) - 2


@pytest.mark.parametrize("sampling", [GREEDY, SamplingParams(temperature=0.8, max_tokens=32)],
                         ids=["greedy-chain", "sampled-passes"])
def test_forced_proposals_are_fed_back_as_the_drafts_own(draft_runner, encode, draft_plain_greedy, sampling):
    """A controlled-acceptance benchmark forces the draft's proposals: the draft still runs and its
    cache holds the forced tokens, so the next step after accepting them all feeds only the last
    proposal and the target's token, as after a real draft's accepted proposals."""
    proposer = DraftModelProposer(runner=draft_runner)
    prompt = encode(PROMPTS[2])
    forced = (11, 12, 13, 14)
    got = proposer.propose([ProposalRequest("f", prompt, 4, sampling, 0, forced=forced)])[0]
    assert got.tokens == list(forced)
    truth = prompt + list(forced) + [42]  # all accepted + the target's own token
    again = proposer.propose([ProposalRequest("f", truth, 3, GREEDY, 0)])[0]
    assert (proposer.last_first_pass.tokens, proposer.last_first_pass.sequences) == (2, 1)
    # what it proposes then is the draft's greedy continuation of the whole truth: the cache held it
    assert again.tokens == draft_plain_greedy(truth, 3).decisions()
    proposer.release("f")


def test_draft_sampled_proposals_carry_processed_probs(draft_runner, encode):
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=40, max_tokens=16)
    prompt = encode(PROMPTS[1])

    def propose(seed):
        return DraftModelProposer(runner=draft_runner).propose([ProposalRequest("s", prompt, 5, params, seed)])[0]

    a = propose(3)
    assert len(a.tokens) == 5 and a.probs.shape == (5, draft_runner.vocab_size)
    torch.testing.assert_close(a.probs.sum(-1), torch.ones(5))
    assert all((row > 0).sum() <= 40 for row in a.probs)  # top-k applied to the draft as well
    assert all(row[tok] > 0 for row, tok in zip(a.probs, a.tokens))
    b = propose(3)
    assert a.tokens == b.tokens and torch.equal(a.probs, b.probs)
    assert any(propose(s).tokens != a.tokens for s in range(4, 10))


def test_draft_proposals_stop_at_the_context_limit(draft_runner, encode):
    runner = copy.copy(draft_runner)
    prompt = encode(PROMPTS[0])
    runner.max_context = len(prompt) + 2
    out = DraftModelProposer(runner=runner).propose([ProposalRequest("s", prompt, 6, GREEDY, 0)])[0]
    assert len(out.tokens) == 2


def test_draft_needs_a_spec_or_runner():
    with pytest.raises(ValueError):
        DraftModelProposer()


# ---- oracle -------------------------------------------------------------------------------
@pytest.mark.parametrize("alpha,lo,hi", [(1.0, 1.0, 1.0), (0.0, 0.0, 0.0), (0.5, 0.4, 0.6)])
def test_oracle_proposes_right_with_probability_alpha(alpha, lo, hi):
    ref = list(range(100, 400))
    oracle = OracleProposer({"s": ref}, alpha=alpha, vocab_size=4096, seed=1)
    right = total = 0
    for pos in range(10, 250, 8):
        tokens = oracle.propose([ProposalRequest("s", ref[:pos], 8, GREEDY, 0)])[0].tokens
        assert len(tokens) == 8 and all(0 <= t < 4096 for t in tokens)
        right += sum(t == ref[pos + j] for j, t in enumerate(tokens))
        total += 8
    assert lo <= right / total <= hi


# ---- factory and the engine's fallback ----------------------------------------------------
def test_make_proposer_builds_the_configured_kind(draft_runner):
    ngram = make_proposer(EngineConfig(
        target=ModelSpec(path="models/target"),
        speculation=SpeculationConfig(proposer="ngram", ngram_min=2, ngram_max=3),
    ))
    assert isinstance(ngram, NgramProposer) and (ngram.n_min, ngram.n_max) == (2, 3)
    draft = make_proposer(EngineConfig(target=ModelSpec(path="models/target"), draft=ModelSpec(path="models/draft")))
    assert isinstance(draft, DraftModelProposer) and draft.runner.vocab_size == draft_runner.vocab_size


class FlakyProposer(Proposer):
    """Raises ProposerUnavailable on some steps (a lost remote draft replica)."""

    def __init__(self, inner: Proposer) -> None:
        self.inner, self.calls = inner, 0

    def propose(self, requests):
        self.calls += 1
        if self.calls % 2 == 0:
            raise ProposerUnavailable("draft replica gone")
        return self.inner.propose(requests)

    def release(self, seq_id):
        self.inner.release(seq_id)

    def num_cached_sequences(self):
        return self.inner.num_cached_sequences()


def test_engine_decodes_plainly_when_the_proposer_is_unavailable(target_runner, draft_runner, encode, plain_greedy, check_against_reference, drive):
    proposer = FlakyProposer(DraftModelProposer(runner=draft_runner))
    engine = SpecEngine(target_runner, proposer)
    prompt = encode(PROMPTS[2])
    engine.add("s", prompt, SamplingParams(max_tokens=30), k=4)
    out = drive(engine)["s"]
    assert engine.proposer_errors >= 2 and out["drafted"] > 0
    check_against_reference(plain_greedy(prompt, 30), out["tokens"], out["finish"], "flaky proposer")
    assert proposer.num_cached_sequences() == 0


def test_short_proposals_are_fine(target_runner, encode, plain_greedy, check_against_reference, drive):
    """A proposer may return fewer than k tokens (or none): the engine verifies what it got."""

    class Short(Proposer):
        def __init__(self):
            self.n = 0

        def propose(self, requests):
            self.n += 1
            return [Proposal([]) if self.n % 3 == 0 else Proposal([7] * (self.n % 3)) for _ in requests]

    engine = SpecEngine(target_runner, Short())
    prompt = encode(PROMPTS[1])
    engine.add("s", prompt, SamplingParams(max_tokens=24), k=5)
    out = drive(engine)["s"]
    check_against_reference(plain_greedy(prompt, 24), out["tokens"], out["finish"], "short proposals")
