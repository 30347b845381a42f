"""Turning logits into the distribution a request samples from, and per-position randomness.

Every random number is a function of (request seed, absolute position, purpose), never of a
shared generator: a sequence rebuilt on another replica after a failure, or verified in a
different batch, draws the same numbers at the same position, so sampled output stays
reproducible and exact in distribution across failover. A token is drawn by inverting the
distribution's cumulative sum at one such uniform number, on the device, with no host sync.
"""

from __future__ import annotations

import hashlib

import torch

from app.protocol.sampling_params import SamplingParams
from app.runners.transfer import to_device
from app.spec.grammar import apply_mask

_MIN_TEMPERATURE = 1e-30


def processed_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities after temperature, top-k, min-p and top-p. `logits`: `[n, vocab]` -> `[n, vocab]` float32.

    The same function is applied to draft and target logits: rejection sampling is lossless
    with respect to the *processed* target distribution only if the draft's is processed alike.
    """
    if params.greedy:
        raise ValueError("processed_probs is for temperature > 0; greedy uses argmax")
    # shifted by the row max first and divided by at least 1e-30: a tiny temperature such as 5e-324
    # (a valid float the API accepts) would turn logits / T into inf and 0 / 0 into NaN
    logits = logits.float()
    logits = (logits - logits.max(dim=-1, keepdim=True).values) / max(params.temperature, _MIN_TEMPERATURE)
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]  # [n, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.min_p > 0.0:  # relative to each row's most likely token, which always stays
        probs = probs.masked_fill(probs < params.min_p * probs.max(dim=-1, keepdim=True).values, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the token crossing it included)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        drop = before >= params.top_p
        drop[..., 0] = False  # the most likely token always stays (top_p 5e-324 is 0 in float32)
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def adjust_logits(logits: torch.Tensor, params: SamplingParams, first_output: int,
                  banned: tuple[int, ...], history: tuple[list[int], list[int], list[int]] | None = None) -> torch.Tensor:
    """The target's logits `[n, vocab]` for outputs first_output.. as the request asks: penalties
    for what came before each row, logit_bias added, and the `banned` tokens (EOS and
    stop_token_ids) masked while the output is shorter than min_tokens. history: (prompt ids,
    output ids, proposals): row j comes after the output and the first j proposals. Applied before
    greedy or sampled verification, so a draft proposal is judged against the adjusted
    distribution and speculation changes nothing."""
    if not params.adjusts_logits:
        return logits
    out = logits.float().clone()
    if params.penalised and history is not None:
        out = _penalise(out, params, *history)
    if params.logit_bias:
        ids = to_device([t for t, _ in params.logit_bias], out.device)
        out[:, ids] += to_device([b for _, b in params.logit_bias], out.device, torch.float32)
    masked = min(out.shape[0], max(0, params.min_tokens - first_output))  # rows before min_tokens
    if masked and banned:
        out[:masked, to_device(list(banned), out.device)] = float("-inf")
    return out


def _penalise(logits: torch.Tensor, params: SamplingParams, prompt: list[int], output: list[int],
              proposals: list[int]) -> torch.Tensor:
    """Presence, frequency and repetition penalties of rows `[n, vocab]`, row j after `output` and
    proposals[:j] (what precedes that position if the proposals before it are accepted)."""
    n, vocab = logits.shape
    device = logits.device
    counts = torch.zeros(vocab, device=device)
    if output:
        counts += torch.bincount(to_device(output, device), minlength=vocab).float()
    counts = counts.expand(n, vocab).clone()  # [n, vocab]
    extra = proposals[:n - 1]
    if extra:  # row j also counts proposals[:j]
        onehot = torch.nn.functional.one_hot(to_device(extra, device), vocab).float()  # [len, vocab]
        counts[1:len(extra) + 1] += onehot.cumsum(dim=0)
    if params.repetition_penalty != 1.0:
        seen = counts > 0
        if prompt:
            seen[:, to_device(prompt, device)] = True
        penalised = torch.where(logits > 0, logits / params.repetition_penalty, logits * params.repetition_penalty)
        logits = torch.where(seen, penalised, logits)
    return logits - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).float()


def uniform(seed: int, position: int, purpose: str) -> float:
    """A number in [0, 1) fixed by (request seed, absolute token position, purpose)."""
    digest = hashlib.blake2b(f"{seed}:{position}:{purpose}".encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "little") >> 11) / float(1 << 53)


def uniforms(seed: int, first_position: int, n: int, purpose: str, device: torch.device) -> torch.Tensor:
    """`[n]` float64 uniforms for positions first_position.. on `device`."""
    return to_device([uniform(seed, first_position + i, purpose) for i in range(n)], device, torch.float64)


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row: probs `[n, vocab]` (need not sum to 1), u `[n]` in [0, 1) -> `[n]` long.
    The token whose cumulative mass first passes u x total: distributed as probs, and a token of
    zero mass is never drawn."""
    # float64: a float32 u just under 1 rounds to 1, past the last token of non-zero mass
    cdf = torch.cumsum(probs.double(), dim=-1)  # [n, vocab]
    target = (u.to(cdf.dtype) * cdf[:, -1]).unsqueeze(-1)  # [n, 1]
    return torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp_max(probs.shape[-1] - 1)


def sample_token(logits: torch.Tensor, params: SamplingParams, seed: int, position: int,
                 first_output: int = 0, banned: tuple[int, ...] = (),
                 history: tuple[list[int], list[int], list[int]] | None = None,
                 mask: torch.Tensor | None = None) -> torch.Tensor:
    """The target's own token at `position` from `logits` `[vocab]`, on the device (`[]` long);
    first_output, banned and history as adjust_logits takes them; mask `[1, words]`: the tokens a
    response format allows (app/spec/grammar.py)."""
    logits = adjust_logits(logits.unsqueeze(0), params, first_output, banned, history)
    if mask is not None:
        logits = apply_mask(logits, mask)
    logits = logits[0]
    if params.greedy:
        return torch.argmax(logits)
    probs = processed_probs(logits.unsqueeze(0), params)  # [1, vocab]
    return inverse_cdf(probs, uniforms(seed, position, 1, "sample", logits.device))[0]
