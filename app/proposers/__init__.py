"""Proposers behind one interface and one factory."""

from __future__ import annotations

from app.config import EngineConfig
from app.proposers.base import Proposal, ProposalRequest, Proposer
from app.proposers.draft_model import DraftModelProposer
from app.proposers.ngram import NgramProposer

__all__ = ["Proposal", "ProposalRequest", "Proposer", "DraftModelProposer", "NgramProposer", "make_proposer"]


def make_proposer(config: EngineConfig) -> Proposer:
    """The proposer a config asks for (the only place that knows the kinds)."""
    spec = config.speculation
    if spec.proposer == "ngram":
        return NgramProposer(spec.ngram_min, spec.ngram_max)
    assert config.draft is not None  # EngineConfig validation guarantees it
    return DraftModelProposer(config.draft, max_seqs=config.limits.max_num_seqs)
