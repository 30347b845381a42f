"""Build an engine from a config and run single generations in-process (no Ray)."""

from __future__ import annotations

import time
import uuid
from dataclasses import asdict, dataclass

from app.engine.acceptance import AcceptanceStats
from app.config import EngineConfig
from app.engine.spec_engine import FinishReason, SpecEngine, StepPlanner
from app.runners.model_runner import ModelRunner
from app.proposers import DraftModelProposer, Proposer, make_proposer
from app.protocol.sampling_params import SamplingParams
from app.tokenizer_compat import check_compatible


def build_engine(config: EngineConfig, speculate: bool = True, plan_k: StepPlanner | None = None) -> SpecEngine:
    """Load the target (and the draft, checked for tokenizer compatibility) into an engine."""
    runner = ModelRunner(config.target, config.limits.max_num_seqs,
                         widths=range(1, config.speculation.max_speculative_tokens + 2))
    proposer: Proposer | None = make_proposer(config) if speculate else None
    if isinstance(proposer, DraftModelProposer):
        check_compatible(runner.tokenizer, proposer.runner.tokenizer)
    return SpecEngine(
        runner, proposer, config.limits, max_k=config.speculation.max_speculative_tokens, plan_k=plan_k
    )


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None
    num_speculative_tokens: int
    drafted_tokens: int
    accepted_tokens: int
    num_drafts: int
    acceptance_rate: float | None
    mean_acceptance_length: float | None
    prompt_tokens: int
    elapsed_s: float

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def generate(engine: SpecEngine, prompt_ids: list[int], sampling: SamplingParams, k: int) -> GenerationResult:
    """Run one sequence to completion; k = 0 decodes plainly."""
    seq_id = uuid.uuid4().hex
    t0 = time.perf_counter()
    engine.add(seq_id, prompt_ids, sampling, k=k)
    stats = AcceptanceStats()
    tokens: list[int] = []
    text = ""
    finish: FinishReason | None = None
    while finish is None:
        for update in engine.step():
            if update.seq_id != seq_id:
                continue
            tokens += update.token_ids
            text += update.text
            stats.record(update.drafted, update.accepted)
            finish = update.finish_reason
    return GenerationResult(
        text=text,
        token_ids=tokens,
        finish_reason=finish,
        num_speculative_tokens=k,
        drafted_tokens=stats.num_draft_tokens,
        accepted_tokens=stats.num_accepted_tokens,
        num_drafts=stats.num_drafts,
        acceptance_rate=stats.acceptance_rate,
        mean_acceptance_length=stats.mean_acceptance_length,
        prompt_tokens=len(prompt_ids),
        elapsed_s=round(time.perf_counter() - t0, 4),
    )
