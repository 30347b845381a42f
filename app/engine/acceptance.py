"""Acceptance accounting with vLLM's definitions.

acceptance rate          = accepted tokens / drafted tokens
mean acceptance length   = 1 + accepted tokens / drafts   (tokens emitted per verify step)
per-position acceptance  = accepted at position i / drafts that reached position i
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


def expected_tokens_per_step(alpha: float, k: int, per_position: Sequence[float] | None = None) -> float:
    """Tokens the target emits per verify pass: E(k) = (1 - α^(k+1)) / (1 - α).

    With `per_position` (P(accept at position i | all before accepted), i = 0..), E = 1 +
    Σ_i Π_{j<=i} a_j; positions beyond the list fall back to `alpha`. The sum form is used for
    both because it is exact at α → 1 (E = k + 1) where the closed form divides 0 by 0.
    """
    if k <= 0:
        return 1.0
    a = min(max(alpha, 0.0), 1.0)
    total, survive = 1.0, 1.0  # the +1 is the target's own bonus/correction token
    for i in range(k):
        p = per_position[i] if per_position is not None and i < len(per_position) else a
        survive *= min(max(p, 0.0), 1.0)
        total += survive
    return total


@dataclass
class AcceptanceStats:
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_rejections: int = 0  # drafts that ended in a rejection (accepted < drafted)
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)

    def record(self, drafted: int, accepted: int) -> None:
        """One verification: `drafted` proposals, the first `accepted` of them accepted."""
        if not 0 <= accepted <= drafted:
            raise ValueError(f"accepted {accepted} must lie in [0, drafted={drafted}]")
        if drafted == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        self.num_rejections += accepted < drafted
        for counts, upto in ((self.drafted_per_position, drafted), (self.accepted_per_position, accepted)):
            if len(counts) < drafted:
                counts.extend([0] * (drafted - len(counts)))
            for pos in range(upto):
                counts[pos] += 1

    def merge(self, other: "AcceptanceStats") -> None:
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        self.num_rejections += other.num_rejections
        for mine, theirs in (
            (self.drafted_per_position, other.drafted_per_position),
            (self.accepted_per_position, other.accepted_per_position),
        ):
            if len(mine) < len(theirs):
                mine.extend([0] * (len(theirs) - len(mine)))
            for i, n in enumerate(theirs):
                mine[i] += n

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_acceptance_length(self) -> float | None:
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None

    def token_alpha(self, prior: float, prior_weight: float = 8.0) -> float:
        """Per-token acceptance probability: accepted / (accepted + rejections), shrunk to a prior.

        Unlike accepted/drafted this does not depend on k (a step stops at its first rejection).
        """
        return (self.num_accepted_tokens + prior * prior_weight) / (
            self.num_accepted_tokens + self.num_rejections + prior_weight
        )

    def token_alpha_upper(self, prior: float, z: float, prior_weight: float = 8.0) -> float:
        """`token_alpha` plus z standard deviations of its Beta posterior, capped at 1: an
        optimistic estimate for deciding whether the sequence drafts at all.

        Why: a sequence's estimate moves only when it drafts. Planned on the mean, one unlucky
        first step (0 of 4 accepted: (0 + 8·0.8) / (1 + 8) = 0.71) can drop it below break-even,
        after which it never drafts again and stays plain for its whole output, whatever its real
        acceptance. The spread shrinks as the sequence's own judged tokens accumulate, so the
        estimate converges to the mean for sequences that keep drafting.
        """
        n = self.num_accepted_tokens + self.num_rejections + prior_weight
        mean = self.token_alpha(prior, prior_weight)
        return min(1.0, mean + z * (mean * (1.0 - mean) / (n + 1.0)) ** 0.5)

    def per_position_rate(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position)]
