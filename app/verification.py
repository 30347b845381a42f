"""Verification of k proposed tokens against the target's k+1 distributions.

Greedy: accept the longest prefix equal to the target's argmax, then emit the target's
own token (correction, or bonus when all k are accepted): the output is the target's
greedy output token for token.

Sampling (Leviathan et al. / Chen et al.): accept proposal x_i with probability
min(1, p_i(x_i) / q_i(x_i)); at the first rejection emit a sample from the normalised
residual (p_i - q_i)+; when all are accepted emit a bonus sample from p_k. The emitted
tokens are distributed exactly as the target's own sampling. A deterministic proposer
(n-gram, greedy draft) has q = one-hot, so acceptance is p_i(x_i) and the residual is p_i
with x_i removed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from app.config import SamplingParams
from app.sampling import position_generator, processed_probs, sample


@dataclass(frozen=True)
class VerifyResult:
    tokens: list[int]  # accepted proposals followed by one target token: 1..k+1 tokens
    num_accepted: int


def verify_greedy(proposals: list[int], target_logits: torch.Tensor) -> VerifyResult:
    """`target_logits`: `[k+1, vocab]`, row i predicts the token after proposal i-1."""
    choices = torch.argmax(target_logits, dim=-1).tolist()  # [k+1]
    accepted = 0
    while accepted < len(proposals) and proposals[accepted] == choices[accepted]:
        accepted += 1
    return VerifyResult(tokens=proposals[:accepted] + [choices[accepted]], num_accepted=accepted)


def verify_sampled(
    proposals: list[int],
    draft_probs: torch.Tensor | None,
    target_logits: torch.Tensor,
    params: SamplingParams,
    seed: int,
    first_position: int,
) -> VerifyResult:
    """Lossless rejection sampling.

    draft_probs: `[k, vocab]` processed draft distributions the proposals were drawn from,
    or None for a deterministic proposer. target_logits: `[k+1, vocab]`. first_position is
    the absolute position of proposals[0] in the sequence.
    """
    p = processed_probs(target_logits, params).cpu()  # [k+1, vocab]
    q = draft_probs.float().cpu() if draft_probs is not None else None  # [k, vocab]
    for i, token in enumerate(proposals):
        gen = position_generator(seed, first_position + i, "target")
        q_x = float(q[i, token]) if q is not None else 1.0
        p_x = float(p[i, token])
        u = float(torch.rand((), generator=gen))
        if q_x > 0 and u < min(1.0, p_x / q_x):
            continue
        residual = p[i] - (q[i] if q is not None else _one_hot(token, p.shape[-1]))
        residual = residual.clamp_min(0.0)
        mass = residual.sum()
        # mass == 0 only when p == q exactly, where rejection has probability 0; guard anyway
        corrected = sample(residual / mass if mass > 0 else p[i], gen)
        return VerifyResult(tokens=proposals[:i] + [corrected], num_accepted=i)
    k = len(proposals)
    bonus = sample(p[k], position_generator(seed, first_position + k, "target"))
    return VerifyResult(tokens=list(proposals) + [bonus], num_accepted=k)


def _one_hot(token: int, vocab: int) -> torch.Tensor:
    out = torch.zeros(vocab)
    out[token] = 1.0
    return out
