"""Turning logits into the distribution a request samples from, and seeded per-position randomness.

Randomness is drawn per (request seed, position, stream), never from a shared generator:
a sequence rebuilt on another replica after a failure, or verified in a different batch,
draws the same numbers at the same position, so sampled output stays reproducible and
exact in distribution across failover.
"""

from __future__ import annotations

import hashlib

import torch

from app.config import SamplingParams


_MIN_TEMPERATURE = 1e-30


def processed_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities after temperature, top-k and top-p. `logits`: `[n, vocab]` -> `[n, vocab]`.

    The same function is applied to draft and target logits: rejection sampling is lossless
    with respect to the *processed* target distribution only if the draft's is processed alike.
    """
    if params.greedy:
        raise ValueError("processed_probs is for temperature > 0; greedy uses argmax")
    # shifted by the row max first (softmax does not change) and divided by at least 1e-30: a tiny
    # temperature such as 5e-324 (a valid float the API accepts) would turn logits / T into inf and
    # 0 / 0 into NaN, and multinomial fails on it; at T -> 0 the row becomes one-hot on its argmax
    logits = logits.float()
    logits = (logits - logits.max(dim=-1, keepdim=True).values) / max(params.temperature, _MIN_TEMPERATURE)
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]  # [n, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the token crossing it included)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        drop = before >= params.top_p
        drop[..., 0] = False  # the most likely token always stays: top_p 5e-324 (valid input, 0 in float32) kept none
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def position_generator(seed: int, position: int, stream: str) -> torch.Generator:
    """A generator seeded from (request seed, absolute token position, stream name)."""
    digest = hashlib.blake2b(f"{seed}:{position}:{stream}".encode(), digest_size=8).digest()
    gen = torch.Generator()
    gen.manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))
    return gen


def sample(probs: torch.Tensor, gen: torch.Generator) -> int:
    """One token from `probs` `[vocab]` (on any device; drawn on the CPU for determinism)."""
    return int(torch.multinomial(probs.cpu(), 1, generator=gen).item())


def next_token(logits: torch.Tensor, params: SamplingParams, seed: int, position: int) -> int:
    """The target's own token at `position` from `logits` `[vocab]` (plain decoding, bonus tokens)."""
    if params.greedy:
        return int(torch.argmax(logits).item())
    probs = processed_probs(logits.unsqueeze(0), params)[0]
    return sample(probs, position_generator(seed, position, "target"))
