"""Rolling a per-sequence KV cache back (SequenceKV.crop) leaves exactly what a fresh prefill
of the same tokens would hold, for single and batched (left-padded, packed) forwards, in the
engine's target caches mid-run and in the draft proposer's caches."""

from __future__ import annotations

import pytest
import torch

from app.config import SamplingParams
from app.engine import SpecEngine
from app.kv_cache import SequenceKV
from app.proposers import DraftModelProposer
from app.proposers.base import ProposalRequest

ATOL = 1e-5


def fresh(runner, tokens: list[int]) -> tuple[SequenceKV, torch.Tensor]:
    kv = SequenceKV()
    logits = runner.forward([kv], [list(tokens)])[0]
    return kv, logits


def assert_same_cache(got: SequenceKV, want: SequenceKV, label: str = "") -> None:
    assert got.token_ids == want.token_ids, label
    assert len(got.keys) == len(want.keys) > 0, label
    for layer, (gk, wk, gv, wv) in enumerate(zip(got.keys, want.keys, got.values, want.values)):
        assert gk.shape == wk.shape and gv.shape == wv.shape, f"{label} layer {layer}: {gk.shape} vs {wk.shape}"
        torch.testing.assert_close(gk, wk, atol=ATOL, rtol=0, msg=f"{label}: keys of layer {layer} differ")
        torch.testing.assert_close(gv, wv, atol=ATOL, rtol=0, msg=f"{label}: values of layer {layer} differ")


def test_crop_after_verify_equals_fresh_prefill(target_runner, encode, plain_greedy):
    prompt = encode("def merge(left, right):\n    result = []\n")
    cont = plain_greedy(prompt, 12).tokens
    for accepted in (0, 2, 5):
        kv, _ = fresh(target_runner, prompt)
        # a verify pass of 1 + 6 tokens, only `accepted` proposals of which survive;
        # make the proposals after the accepted ones wrong so stale entries would differ
        proposals = cont[1 : 1 + accepted] + [7, 8, 9, 10, 11, 12][: 6 - accepted]
        target_runner.forward([kv], [[cont[0]] + proposals])
        assert kv.length == len(prompt) + 7
        kv.crop(len(prompt) + 1 + accepted)
        want, want_logits = fresh(target_runner, prompt + cont[: 1 + accepted])
        assert_same_cache(kv, want, f"accepted={accepted}")
        # and decoding on from the rolled-back cache gives the fresh cache's logits
        nxt = cont[1 + accepted]
        got_row = target_runner.forward([kv], [[nxt]])[0][-1]
        want_row = target_runner.forward([want], [[nxt]])[0][-1]
        torch.testing.assert_close(got_row, want_row, atol=1e-4, rtol=0)


def test_crop_after_batched_packed_forward(target_runner, encode):
    """Rows of different cache and input lengths share one left-padded pass; each rolls back alone."""
    prompts = [encode(p) for p in ("import sys\n", "The number of items in the list is", "x = 1\ny = 2\nz =")]
    caches = [fresh(target_runner, p)[0] for p in prompts]
    inputs = [[11, 12, 13, 14, 15], [21], [31, 32, 33]]
    target_runner.forward(caches, inputs)
    for kv, p, inp, keep in zip(caches, prompts, inputs, (2, 1, 0)):
        assert kv.length == len(p) + len(inp)
        kv.crop(len(p) + keep)
        assert_same_cache(kv, fresh(target_runner, p + inp[:keep])[0], f"prompt {p}")
    # a second batched pass on the cropped caches still matches fresh prefills
    target_runner.forward(caches, [[40, 41], [42, 43, 44], [45]])
    for kv in caches:
        assert_same_cache(kv, fresh(target_runner, kv.token_ids)[0], "after second pass")


def test_crop_bookkeeping():
    kv = SequenceKV()
    kv.append([torch.zeros(2, 3, 4)], [torch.ones(2, 3, 4)], [5, 6, 7])
    assert kv.common_prefix([5, 6, 9, 9]) == 2 and kv.common_prefix([1]) == 0
    with pytest.raises(ValueError):
        kv.crop(4)
    kv.crop(1)
    assert kv.length == 1 and kv.token_ids == [5] and kv.keys[0].shape == (2, 1, 4)
    kv.crop(0)
    assert kv.length == 0 and kv.keys[0].shape == (2, 0, 4)


def test_engine_caches_match_fresh_prefill_mid_run(target_runner, draft_runner, encode, drive):
    """After each step the target KV holds every token but the last, exactly as a fresh prefill
    of them would; each draft cache holds what a fresh draft prefill of its tokens would."""
    proposer = DraftModelProposer(runner=draft_runner)
    engine = SpecEngine(target_runner, proposer)
    params = SamplingParams(max_tokens=30)
    engine.add("a", encode("class Counter:\n    def __init__(self):\n"), params, k=5)
    engine.add("b", encode("The default value of the argument is"), params, k=3)
    engine.add("c", encode("for line in open(path):\n"), SamplingParams(temperature=0.8, seed=3, max_tokens=30), k=4)
    checked = 0
    for _ in range(6):
        engine.step()
        for seq in engine.running.values():
            assert seq.kv.length == len(seq.token_ids) - 1
            assert_same_cache(seq.kv, fresh(target_runner, seq.token_ids[:-1])[0], f"target {seq.seq_id}")
            draft_kv = proposer.caches.get(seq.seq_id)
            if draft_kv is not None and draft_kv.length:
                # it may still hold this step's rejected proposals: they are cropped lazily at
                # the next propose(); whatever it holds must be what a prefill of it would hold
                assert draft_kv.common_prefix(seq.token_ids) >= len(seq.prompt_ids)
                assert_same_cache(draft_kv, fresh(draft_runner, draft_kv.token_ids)[0], f"draft {seq.seq_id}")
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
    kv = proposer.caches["s"]
    assert kv.token_ids[: len(truth2)] == truth2  # the rejected proposals are gone
    assert_same_cache(kv, fresh(draft_runner, kv.token_ids)[0], "draft after rollback")
    # and the proposals equal what a fresh proposer says for the same truth
    again = DraftModelProposer(runner=draft_runner).propose([ProposalRequest("s", truth2, 3, greedy, 0)])[0].tokens
    assert second == again
    assert proposer.cache_misses == 1
    proposer.release("s")
    assert proposer.num_cached_sequences() == 0


def test_engine_rebuilds_a_cache_that_lost_the_truth(target_runner, draft_runner, encode, plain_greedy, check_against_reference, drive):
    """A cache that no longer matches the tokens (evicted, replica moved) is rebuilt by prefill."""
    prompt = encode("import os\n\ndef list_python_files(path):\n")
    engine = SpecEngine(target_runner, DraftModelProposer(runner=draft_runner))
    engine.add("s", prompt, SamplingParams(max_tokens=30), k=3)
    out: dict = {}
    for _ in range(3):
        drive.collect(out, engine.step())
    engine.running["s"].kv = SequenceKV()  # evicted
    drive.collect(out, engine.step())
    engine.running["s"].kv.crop(2)  # stale
    out2 = drive(engine)
    tokens = out["s"]["tokens"] + out2["s"]["tokens"]
    check_against_reference(plain_greedy(prompt, 30), tokens, out2["s"]["finish"], "rebuilt cache")
