"""The served benchmark's controlled-acceptance proposer (app/proposers/oracle.py ReferenceProposer)
with an acceptance per prompt class: the acceptance the policy's own estimator measures for each
class matches that class's alpha, both against a simulated greedy verifier (many trials, tight
bounds) and through the engine with the embedded pair (the draft model runs, the target verifies)."""

from __future__ import annotations

import random

import pytest

from app.engine.spec_engine import SpecEngine
from app.policy import classify_prompt
from app.policy.trackers import AcceptanceTracker
from app.proposers import DraftModelProposer
from app.proposers.base import Proposal, ProposalRequest, Proposer
from app.proposers.oracle import ReferenceProposer
from app.protocol.sampling_params import SamplingParams

from .conftest import CODE_PROMPTS, PROSE_PROMPTS

ALPHAS = {"code": 0.8, "prose": 0.35}
GREEDY = SamplingParams(max_tokens=32)


class FixedDraft(Proposer):
    """A draft whose proposals are always token 7: what the reference overrides."""

    def __init__(self) -> None:
        self.calls = 0

    def propose(self, requests: list[ProposalRequest]) -> list[Proposal]:
        self.calls += 1
        return [Proposal([7] * r.k) for r in requests]


def _tracker() -> AcceptanceTracker:
    # no prior weight to speak of and no decay: the plain maximum-likelihood alpha of every observation
    return AcceptanceTracker(prior_weight=1e-6, half_life_tokens=1e12)


def test_per_class_alpha_is_the_acceptance_a_greedy_verifier_measures():
    rng = random.Random(3)
    vocab = 5000
    refs, classes = [], []
    for i in range(40):
        refs.append([rng.randrange(vocab) for _ in range(40 + 400)])
        classes.append("code" if i % 2 == 0 else "prose")
    draft = FixedDraft()
    proposer = ReferenceProposer(draft, vocab)
    proposer.set_references(refs, ALPHAS, classes)
    tracker = _tracker()
    for i, (ref, cls) in enumerate(zip(refs, classes)):
        pos, k = 40, 4
        while pos + k + 1 < len(ref):
            tokens = proposer.propose([ProposalRequest(f"seq-{i}", ref[:pos], k, GREEDY, 0)])[0].tokens
            accepted = next((j for j, t in enumerate(tokens) if t != ref[pos + j]), len(tokens))
            tracker.observe(cls, len(tokens), accepted)
            pos += accepted + 1  # the accepted prefix and the target's own token
    assert draft.calls > 0  # the draft ran every step: its cost is real
    for cls, alpha in ALPHAS.items():
        assert tracker.samples(cls) > 1500
        assert abs(tracker.alpha(cls) - alpha) < 0.04, (cls, tracker.alpha(cls))


def test_coins_are_fixed_by_sequence_and_position_and_unknown_prompts_keep_the_drafts_tokens():
    vocab = 100
    ref = list(range(50, 90)) + [1, 2, 3, 4, 5, 6, 7, 8]
    proposer = ReferenceProposer(FixedDraft(), vocab)
    proposer.set_references([ref], {"code": 0.5}, ["code"])
    request = ProposalRequest("s", ref[:40], 8, GREEDY, 0)
    first = proposer.propose([request])[0].tokens
    assert first == proposer.propose([request])[0].tokens  # same sequence, same positions: same coins
    assert all(t in (right, (right + 1) % vocab) for t, right in zip(first, ref[40:]))
    other = ProposalRequest("s", [9] * 40, 3, GREEDY, 0)  # no reference for this prompt
    assert proposer.propose([other])[0].tokens == [7, 7, 7]
    # a class without an alpha keeps the draft's proposals too
    proposer.set_references([ref], {"prose": 0.5}, ["code"])
    assert proposer.propose([request])[0].tokens == [7] * 8
    # one alpha for every reference, as bench.serve_gpu loads them
    proposer.set_references([ref], 1.0)
    assert proposer.propose([request])[0].tokens == ref[40:48]
    with pytest.raises(ValueError):
        proposer.set_references([ref], {"code": 0.5})  # a per-class alpha needs the classes


def _long_prompt(parts: list[str], encode, min_tokens: int) -> str:
    """Prompts of at least `min_tokens` tokens (the references are keyed by the first 32)."""
    text = ""
    i = 0
    while len(encode(text)) < min_tokens:
        text += parts[i % len(parts)] + ("\n" if not parts[i % len(parts)].endswith("\n") else "")
        i += 1
    return text


def test_engine_measures_each_class_at_its_alpha(target_runner, draft_runner, encode):
    """Through the engine: the embedded draft runs every step, the target verifies greedily, and the
    acceptance per class (the router's estimator over each step's drafted / accepted) is its alpha."""
    code = [_long_prompt(CODE_PROMPTS[i:] + CODE_PROMPTS[:i], encode, 36) for i in range(4)]
    prose = [_long_prompt(PROSE_PROMPTS[i:] + PROSE_PROMPTS[:i], encode, 36) for i in range(4)]
    texts = code + prose
    classes = [classify_prompt(t) for t in texts]
    assert classes == ["code"] * 4 + ["prose"] * 4  # the classes the router would give these prompts
    ids = [encode(t) for t in texts]
    new_tokens = 96
    # the references: the target's own greedy continuation, from a plain run of the same engine
    plain = SpecEngine(target_runner, None)
    for i, p in enumerate(ids):
        plain.add(f"ref-{i}", p, SamplingParams(max_tokens=new_tokens + 8, ignore_eos=True))
    outputs: dict[str, list[int]] = {}
    while plain.has_work():
        for u in plain.step():
            outputs.setdefault(u.seq_id, []).extend(u.token_ids)
    references = [p + outputs[f"ref-{i}"] for i, p in enumerate(ids)]

    proposer = ReferenceProposer(DraftModelProposer(runner=draft_runner), draft_runner.vocab_size)
    proposer.set_references(references, ALPHAS, classes)
    engine = SpecEngine(target_runner, proposer)
    for i, p in enumerate(ids):
        engine.add(f"spec-{i}", p, SamplingParams(max_tokens=new_tokens, ignore_eos=True), k=4)
    tracker = _tracker()
    catch_ups = 0
    while engine.has_work():
        for u in engine.step():
            if u.drafted:
                tracker.observe(classes[int(u.seq_id.split("-")[1])], u.drafted, u.accepted)
        catch_ups += proposer.last_first_pass.caught_up
    # the draft held what it proposed: only its first step (each sequence's whole prompt) caught up,
    # as for a real draft whose proposals were accepted at these rates
    assert catch_ups == 1
    for cls, alpha in ALPHAS.items():
        assert tracker.samples(cls) > 150
        assert abs(tracker.alpha(cls) - alpha) < 0.1, (cls, tracker.alpha(cls), tracker.samples(cls))


@pytest.mark.parametrize("vocab", [1024, 128256])
def test_bench_checkpoints_tokenize_prompts_to_their_ids(tmp_path, vocab: int) -> None:
    """References are keyed by the prompt's ids: the router's tokenization of a bench prompt must give
    back exactly the ids it was written from (a special token such as EOS matches inside words)."""
    from transformers import AutoTokenizer

    from bench.serve_gpu import write_checkpoint

    path = write_checkpoint(tmp_path / "ckpt", "tiny", vocab)
    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = list(range(vocab // 64, vocab - vocab // 64, max(1, vocab // 1000)))
    assert tokenizer(" ".join(f"t{i}" for i in ids))["input_ids"] == ids
