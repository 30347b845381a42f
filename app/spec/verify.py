"""Verification of every sequence of a step on the device, with one host read.

Greedy rows: accept the longest prefix of the proposals equal to the target's argmax, then
emit the target's own token there (the correction, or the bonus when all k are accepted):
the output is the target's greedy output token for token. Plain rows are k = 0.

Sampled rows (Leviathan et al. / Chen et al.): accept proposal x_i when u_i q_i(x_i) < p_i(x_i)
(probability min(1, p/q)); at the first rejection emit a draw from the normalised residual
(p_i - q_i)+, and when all k are accepted a bonus draw from p_k. The emitted tokens are
distributed exactly as the target's own sampling. A deterministic proposer (n-gram, greedy
draft) has q = one-hot: acceptance is p_i(x_i) and the residual is p_i without x_i. The
uniforms come from (seed, position) (app/spec/sampling.py), so a failover redraws the same.

Everything stays on the device until the step's results `[n, T+1]` (tokens, then the accepted
count) are read back at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from app.protocol.sampling_params import SamplingParams
from app.runners.transfer import take_rows, to_device
from app.spec.grammar import apply_mask
from app.spec.sampling import adjust_logits, inverse_cdf, processed_probs, uniforms


@dataclass(frozen=True)
class RowToVerify:
    row: int  # the sequence's row in the pass's logits
    proposals: list[int]  # k >= 0 draft tokens fed after the last token
    draft_probs: torch.Tensor | None  # [k, vocab] the distributions the proposals were drawn from; None: deterministic
    sampling: SamplingParams
    seed: int
    position: int  # absolute position of the first token this row emits
    first_output: int = 0  # the index in the output of the first token this row emits
    banned: tuple[int, ...] = ()  # tokens masked before min_tokens (EOS, stop_token_ids)
    prompt: list[int] | None = None  # the sequence so far, for penalties (None: the request has none)
    output: list[int] | None = None
    mask: torch.Tensor | None = None  # [k+1, words] int32: the response format's allowed tokens per position


# per emitted token: (its log-probability, [(alternative, log-probability)] most likely first)
TokenLogprob = tuple[float, list[tuple[int, float]]]


@dataclass(frozen=True)
class Verified:
    tokens: list[int]  # the accepted proposals and one target token: 1..k+1 tokens
    num_accepted: int
    logprobs: list[TokenLogprob] | None = None  # per token, when the request asked for them


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, top: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits `[T, vocab]` (the target's raw distribution), tokens `[T]` -> each token's log-probability
    `[T]` and the `top` most likely `[T, top]` (log-probabilities, ids), on the device."""
    lp = torch.log_softmax(logits.float(), dim=-1)  # [T, vocab]
    values, ids = lp.topk(top, dim=-1) if top else (lp[:, :0], lp[:, :0].long())
    return lp.gather(1, tokens.view(-1, 1)).squeeze(1), values, ids


def verify_batch(logits: torch.Tensor, rows: list[RowToVerify]) -> list[Verified]:
    """logits `[B, W, vocab]` from one pass (row r fed its last token and proposals left-aligned)."""
    if not rows:
        return []
    device = logits.device
    T = max(len(r.proposals) for r in rows) + 1  # the widest row's outputs
    # rows whose logits the request adjusts (logit_bias, min_tokens, penalties, a response format)
    # take the one-row path
    greedy = [i for i, r in enumerate(rows) if r.sampling.greedy and not _adjusted(r)]
    out: torch.Tensor | None = None  # [n, T tokens + accepted]
    if greedy:
        choice = take_rows(logits, [rows[i].row for i in greedy])[:, :T].argmax(dim=-1)  # [g, T]
        if T > 1:  # -1 pads the shorter rows' proposals: it matches nothing
            padded = [rows[i].proposals + [-1] * (T - 1 - len(rows[i].proposals)) for i in greedy]
            match = choice[:, :T - 1] == to_device(padded, device)  # [g, T-1]
            result = torch.cat([choice, match.long().cumprod(dim=1).sum(dim=1, keepdim=True)], dim=1)  # [g, T+1]
        else:  # a plain step: one token each, nothing accepted
            result = torch.cat([choice, torch.zeros_like(choice)], dim=1)  # [g, 2]
        if len(greedy) == len(rows):
            out = result
    if out is None:
        out = torch.zeros((len(rows), T + 1), dtype=torch.long, device=device)
        if greedy:
            out[to_device(greedy, device)] = result
    for i, r in enumerate(rows):
        if not r.sampling.greedy or _adjusted(r):
            history = (r.prompt or [], r.output or [], r.proposals) if r.sampling.penalised else None
            row = adjust_logits(logits[r.row, :len(r.proposals) + 1], r.sampling, r.first_output, r.banned, history)
            if r.mask is not None:
                row = apply_mask(row, r.mask)
            out[i] = _verify_greedy_row(row, r, T) if r.sampling.greedy else _verify_sampled(row, r, T)
    wanted = [i for i, r in enumerate(rows) if r.sampling.logprobs is not None]
    parts = []
    for i in wanted:  # computed before the host read: queued behind the verification, read after it
        top = rows[i].sampling.logprobs
        width = len(rows[i].proposals) + 1
        parts.append(token_logprobs(logits[rows[i].row, :width], out[i, :width], top))
    host = out.tolist()  # the step's host read: every later read finds its data ready
    results = [Verified(h[:h[T] + 1], h[T]) for h in host]
    for i, (chosen, values, ids) in zip(wanted, parts):
        n = len(results[i].tokens)
        top = list(zip(ids[:n].tolist(), values[:n].tolist()))
        results[i] = Verified(results[i].tokens, results[i].num_accepted,
                              [(c, list(zip(a, b))) for c, (a, b) in zip(chosen[:n].tolist(), top)])
    return results


def _adjusted(r: RowToVerify) -> bool:
    return r.sampling.adjusts_logits or r.mask is not None


def _verify_greedy_row(logits: torch.Tensor, r: RowToVerify, T: int) -> torch.Tensor:
    """logits `[k+1, vocab]` of one greedy row -> `[T + 1]` as _verify_sampled returns it."""
    k = len(r.proposals)
    choice = logits.argmax(dim=-1)  # [k+1]
    out = torch.zeros(T + 1, dtype=torch.long, device=logits.device)
    out[:k + 1] = choice
    if k:
        match = choice[:k] == to_device(r.proposals, logits.device)
        out[T] = match.long().cumprod(dim=0).sum()
    return out


def _verify_sampled(logits: torch.Tensor, r: RowToVerify, T: int) -> torch.Tensor:
    """logits `[k+1, vocab]` of one sampled row -> `[T + 1]`: tokens (valid up to the accepted
    count + 1), then the accepted count."""
    device, k = logits.device, len(r.proposals)
    p = processed_probs(logits, r.sampling)  # [k+1, vocab]
    out = torch.zeros(T + 1, dtype=torch.long, device=device)
    if k == 0:
        out[0] = inverse_cdf(p, uniforms(r.seed, r.position, 1, "sample", device))[0]
        return out
    props = to_device(r.proposals, device)  # [k]
    at = torch.arange(k, device=device)
    p_x = p[at, props]  # [k]
    if r.draft_probs is not None:
        q = r.draft_probs.to(device=device, dtype=torch.float32)  # [k, vocab]
        q_x = q[at, props]
        accept = (q_x > 0) & (uniforms(r.seed, r.position, k, "accept", device) * q_x < p_x)
        residual = (p[:k] - q).clamp_min(0.0)
    else:  # q one-hot on the proposal
        accept = uniforms(r.seed, r.position, k, "accept", device) < p_x
        residual = p[:k].clone()
        residual[at, props] = 0.0
    # no residual mass only where p == q exactly, where rejection has probability 0: draw from p then
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p[:k])
    candidates = inverse_cdf(torch.cat([residual, p[k:]]), uniforms(r.seed, r.position, k + 1, "sample", device))  # [k+1]
    accepted = accept.long().cumprod(dim=0).sum()  # []
    idx = torch.arange(k + 1, device=device)
    out[:k + 1] = torch.where(idx < accepted, torch.cat([props, props[:1]]), candidates[accepted])
    out[T] = accepted
    return out
