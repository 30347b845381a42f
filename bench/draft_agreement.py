"""Where the embedded draft agrees with its target, prompt by prompt (CPU).

    .venv/bin/python -m bench.draft_agreement [--prompts 24] [--new-tokens 64]

The target decodes greedily from held-out prompts, the draft reads the same text in one forward,
and at every position the draft's top-1, top-2 and top-3 are compared with the target's token.
It reports two things the design leans on:

- the runner-up rate: when the target rejects the draft's token, how often the target's own token
  is the draft's second choice. Tree or branch drafting pays only if that is high enough;
  `bench.overlap_bound` turns it into what overlapped drafting could gain;
- how much prompts of one class differ in acceptance: the spread of per-prompt top-1 rates beyond
  what binomial noise explains. That sets how much a sequence's own steps should move its
  acceptance estimate away from its class's (the tracker's prior weight, in pseudo-trials:
  n0 = mean·(1 − mean) / variance_between − 1, the Beta prior with that spread).
"""

from __future__ import annotations

import argparse

import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

from bench.acceptance import heldout_prompts


def rank_hits(draft_logits: torch.Tensor, target_tokens: torch.Tensor, top: int = 3) -> torch.Tensor:
    """[n, top] booleans: column r is True where the target's token is the draft's (r+1)-th choice.

    draft_logits: [n, vocab], the draft's prediction for each of the n positions; target_tokens: [n].
    """
    ranked = draft_logits.topk(top, dim=-1).indices  # [n, top]
    return ranked == target_tokens[:, None]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=24, help="held-out prompts per kind (code, prose)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(2)
    tokenizer = AutoTokenizer.from_pretrained("models/target")
    target = AutoModelForCausalLM.from_pretrained("models/target").eval()
    draft = AutoModelForCausalLM.from_pretrained("models/draft").eval()
    prompts = heldout_prompts(tokenizer, args.prompts, args.seed)
    print(f"{'kind':6} {'positions':>9} {'top-1 (alpha)':>13} {'top-2 | top-1 wrong (beta)':>26} "
          f"{'top-3 | top-1,2 wrong':>21} {'per-prompt sd':>13} {'of it noise':>11} {'prior weight':>12}")
    for kind, batch in prompts.items():
        hits: list[torch.Tensor] = []
        for ids in tqdm(batch, desc=kind, leave=False):
            prompt = torch.tensor([ids])
            with torch.no_grad():
                full = target.generate(prompt, max_new_tokens=args.new_tokens, do_sample=False,
                                       pad_token_id=tokenizer.eos_token_id)  # [1, P + new]
                logits = draft(full).logits[0]  # [P + new, vocab]
            P = prompt.shape[1]
            # the draft's guess for position i comes from logits at i - 1
            hits.append(rank_hits(logits[P - 1: full.shape[1] - 1], full[0, P:]))
        h = torch.cat(hits)  # [positions, 3]
        top1 = h[:, 0].float().mean().item()
        missed = ~h[:, 0]
        beta = h[missed, 1].float().mean().item() if missed.any() else float("nan")
        missed2 = missed & ~h[:, 1]
        third = h[missed2, 2].float().mean().item() if missed2.any() else float("nan")
        rates = torch.tensor([x[:, 0].float().mean().item() for x in hits])  # [prompts]
        observed_var = rates.var().item()
        noise_var = top1 * (1 - top1) / args.new_tokens  # binomial spread of a rate over new_tokens positions
        between = observed_var - noise_var
        weight = f"{top1 * (1 - top1) / between - 1:.1f}" if between > 0 else "inf"
        print(f"{kind:6} {len(h):>9} {top1:>13.3f} {beta:>26.3f} {third:>21.3f} {observed_var ** 0.5:>13.3f} "
              f"{noise_var ** 0.5:>11.3f} {weight:>12}")


if __name__ == "__main__":
    main()
