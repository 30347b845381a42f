"""The runner owns the KV cache: rolling a sequence back by length (ModelRunner.truncate) leaves
exactly what a fresh prefill of the same tokens would hold, for single and batched passes, when
rows move (a freed row is filled by the last one), in the engine's target rows mid-run and in the
draft proposer's rows."""

from __future__ import annotations

import itertools

import pytest
import torch

from app.protocol.sampling_params import SamplingParams
from app.engine.spec_engine import SpecEngine
from app.proposers import DraftModelProposer
from app.proposers.base import ProposalRequest
from app.runners.model_runner import ModelRunner

ATOL = 1e-5
_ids = itertools.count()


def held(runner: ModelRunner, seq_id: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values a sequence's row holds: `[layers, length, kv_heads, head_dim]` each."""
    row, n = runner.row(seq_id), runner.length(seq_id)
    return runner.model.k_cache[:, row, :n], runner.model.v_cache[:, row, :n]


def fresh(runner: ModelRunner, tokens: list[int]) -> str:
    seq_id = f"fresh-{next(_ids)}"
    runner.add(seq_id)
    runner.prefill(seq_id, tokens)
    return seq_id


def assert_same_cache(runner: ModelRunner, got: str, want: str, label: str = "") -> None:
    (gk, gv), (wk, wv) = held(runner, got), held(runner, want)
    assert gk.shape == wk.shape, f"{label}: {gk.shape} vs {wk.shape}"
    torch.testing.assert_close(gk, wk, atol=ATOL, rtol=0, msg=f"{label}: keys differ")
    torch.testing.assert_close(gv, wv, atol=ATOL, rtol=0, msg=f"{label}: values differ")


def test_truncate_after_verify_equals_fresh_prefill(target_runner, encode, plain_greedy):
    r = target_runner
    prompt = encode("def merge(left, right):\n    result = []\n")
    cont = plain_greedy(prompt, 12).tokens
    for accepted in (0, 2, 5):
        s = fresh(r, prompt)
        # a verify pass of 1 + 6 tokens, only `accepted` proposals of which survive; the proposals
        # after the accepted ones are wrong, so stale entries would differ
        proposals = cont[1: 1 + accepted] + [7, 8, 9, 10, 11, 12][: 6 - accepted]
        r.step([s], [[cont[0]] + proposals])
        assert r.length(s) == len(prompt) + 7
        r.truncate(s, len(prompt) + 1 + accepted)
        want = fresh(r, prompt + cont[: 1 + accepted])
        assert_same_cache(r, s, want, f"accepted={accepted}")
        # decoding on from the rolled-back row gives the fresh row's logits
        nxt = cont[1 + accepted]
        logits, rows = r.step([s, want], [[nxt], [nxt]])
        torch.testing.assert_close(logits[rows[0], 0], logits[rows[1], 0], atol=1e-4, rtol=0)
        r.remove(s)
        r.remove(want)


def test_truncate_after_a_batched_pass_of_mixed_widths(target_runner, encode):
    """Rows of different lengths and widths share one pass; each rolls back alone."""
    r = target_runner
    prompts = [encode(p) for p in ("import sys\n", "The number of items in the list is", "x = 1\ny = 2\nz =")]
    seqs = [fresh(r, p) for p in prompts]
    inputs = [[11, 12, 13, 14, 15], [21], [31, 32, 33]]
    r.step(seqs, inputs)
    truth = []
    for s, p, inp, keep in zip(seqs, prompts, inputs, (2, 1, 0)):
        assert r.length(s) == len(p) + len(inp)
        r.truncate(s, len(p) + keep)
        truth.append(p + inp[:keep])
        want = fresh(r, truth[-1])
        assert_same_cache(r, s, want, f"prompt {p}")
        r.remove(want)
    # a second batched pass on the rolled-back rows still matches fresh prefills
    more = [[40, 41], [42, 43, 44], [45]]
    r.step(seqs, more)
    for s, t, m in zip(seqs, truth, more):
        want = fresh(r, t + m)
        assert_same_cache(r, s, want, "after second pass")
        r.remove(want)
    for s in seqs:
        r.remove(s)


def test_a_freed_row_is_filled_by_the_last_and_nothing_else_moves(target_runner, encode):
    r = target_runner
    base = r.num_sequences
    a, b, c = (fresh(r, encode(t)) for t in ("alpha = 1\n", "def beta():\n    pass\n", "gamma"))
    before_c = [t.clone() for t in held(r, c)]
    before_a = [t.clone() for t in held(r, a)]
    row_b = r.row(b)
    r.remove(b)
    assert r.num_sequences == base + 2 and r.row(c) == row_b and b not in r
    for got, want in zip(held(r, c), before_c):
        torch.testing.assert_close(got, want, atol=0, rtol=0)
    for got, want in zip(held(r, a), before_a):
        torch.testing.assert_close(got, want, atol=0, rtol=0)
    with pytest.raises(ValueError):
        r.truncate(a, r.length(a) + 1)
    r.remove(a)
    r.remove(c)
    assert r.num_sequences == base


def test_engine_rows_match_fresh_prefill_mid_run(target_runner, draft_runner, encode, drive):
    """After each step the target row holds every token but the last, exactly as a fresh prefill
    would; each draft row holds what a fresh draft prefill of the tokens it fed would."""
    proposer = DraftModelProposer(runner=draft_runner)
    engine = SpecEngine(target_runner, proposer)
    params = SamplingParams(max_tokens=30)
    engine.add("a", encode("class Counter:\n    def __init__(self):\n"), params, k=5)
    engine.add("b", encode("The default value of the argument is"), params, k=3)
    engine.add("c", encode("for line in open(path):\n"), SamplingParams(temperature=0.8, seed=3, max_tokens=30), k=4)
    checked = 0
    for _ in range(6):
        engine.step()
        for seq in list(engine.running.values()):
            assert target_runner.length(seq.seq_id) == len(seq.token_ids) - 1
            want = fresh(target_runner, seq.token_ids[:-1])
            assert_same_cache(target_runner, seq.seq_id, want, f"target {seq.seq_id}")
            target_runner.remove(want)
            fed = proposer.fed.get(seq.seq_id)
            if fed and seq.seq_id in draft_runner:
                # it may still hold this step's proposals but the last: they are rolled back lazily at
                # the next propose(); whatever it holds must be what a prefill of it would hold
                n = draft_runner.length(seq.seq_id)
                want = fresh(draft_runner, fed[:n])
                assert_same_cache(draft_runner, seq.seq_id, want, f"draft {seq.seq_id}")
                draft_runner.remove(want)
                checked += 1
    assert checked >= 6
    drive(engine)
    assert proposer.num_cached_sequences() == 0


def test_draft_proposer_rolls_back_on_divergence(draft_runner, encode):
    proposer = DraftModelProposer(runner=draft_runner)
    truth = encode("def area(radius):\n    return")
    greedy = SamplingParams(max_tokens=16)
    first = proposer.propose([ProposalRequest("s", truth, 4, greedy, 0)])[0].tokens
    assert len(first) == 4
    # the target rejected everything after the first proposal and corrected to another token
    correction = (first[1] + 1) % draft_runner.vocab_size
    truth2 = truth + [first[0], correction]
    second = proposer.propose([ProposalRequest("s", truth2, 3, greedy, 0)])[0].tokens
    assert proposer.fed["s"][: len(truth2)] == truth2  # the rejected proposals are gone
    want = fresh(draft_runner, proposer.fed["s"])
    assert_same_cache(draft_runner, "s", want, "draft after rollback")
    draft_runner.remove(want)
    assert proposer.cache_misses == 1
    proposer.release("s")
    # and the proposals equal what a fresh proposer says for the same truth
    again = DraftModelProposer(runner=draft_runner)
    assert again.propose([ProposalRequest("s", truth2, 3, greedy, 0)])[0].tokens == second
    again.release("s")
    assert again.num_cached_sequences() == draft_runner.num_sequences == 0


def test_engine_rebuilds_a_cache_that_lost_the_truth(target_runner, draft_runner, encode, plain_greedy,
                                                     check_against_reference, drive):
    """A row that no longer holds the truth (rolled back too far, replica moved) is rebuilt by prefill."""
    prompt = encode("import os\n\ndef list_python_files(path):\n")
    engine = SpecEngine(target_runner, DraftModelProposer(runner=draft_runner))
    engine.add("s", prompt, SamplingParams(max_tokens=30), k=3)
    out: dict = {}
    for _ in range(3):
        drive.collect(out, engine.step())
    target_runner.truncate("s", 0)  # lost
    drive.collect(out, engine.step())
    target_runner.truncate("s", 2)  # stale
    out2 = drive(engine)
    tokens = out["s"]["tokens"] + out2["s"]["tokens"]
    check_against_reference(plain_greedy(prompt, 30), tokens, out2["s"]["finish"], "rebuilt cache")
