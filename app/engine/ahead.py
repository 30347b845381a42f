"""Plain steps launched one step ahead: the GPU runs step N+1 while the host emits step N.

A served step ends with a host read (the tokens must be streamed and checked for stops), so without
this the GPU idles for the host's whole share of every step: emitting, detokenizing, stop checks,
the replica's metrics and handing tokens to the streams (~0.5 ms at one sequence, several ms at
32). When every sequence of the batch decodes plainly (greedy or sampled, without logit
adjustments), the next step's inputs are known as soon as this step's tokens are read, before any
of that host work: the engine launches the next pass right then and does the host work while it
runs (vLLM's and SGLang's "overlap scheduling", for plain decoding). A sampled token is drawn on the
device from its (seed, position) uniform, as verification draws it, so the output does not depend on
whether a step ran ahead.

The pass is launched for the sequences that can continue by what is cheap to check (not EOS, not a
stop token, room under max_tokens and the context); one that a stop string ends while the pass runs
only wastes its row. Sequences that joined meanwhile (their prompt prefilled) wait for the launch
after. Each sequence's cache then holds its whole output, the token of the launched pass included,
as the step protocol expects after that pass (all but the last token).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from app.protocol.sampling_params import SamplingParams
from app.runners.model_runner import ModelRunner
from app.runners.transfer import take_rows
from app.spec.sampling import sample_token


@dataclass(frozen=True)
class Feed:
    """One sequence of a pass launched ahead: the token it is fed, and how its next token is chosen."""

    seq_id: str
    token: int
    sampling: SamplingParams
    seed: int
    position: int  # the absolute position of the token this pass chooses (its (seed, position) draw)


@dataclass
class AheadPass:
    """A launched plain pass: each sequence's next token, on its way to the host."""

    seq_ids: list[str]
    host: torch.Tensor  # [n] long: the token chosen per sequence (pinned on CUDA, filled when `done` fires)
    done: torch.cuda.Event | None  # None on the CPU, where the pass ran synchronously

    def tokens(self) -> dict[str, int]:
        """Wait for the pass (only it: later work on the stream is not waited for) -> token per sequence."""
        if self.done is not None:
            self.done.synchronize()
        return dict(zip(self.seq_ids, self.host.tolist()))


def launch(runner: ModelRunner, feeds: list[Feed]) -> AheadPass:
    """Feed each sequence its token in one pass, choose each next token on the device (the argmax, or
    the (seed, position) draw of a sampled sequence, as verification chooses a plain row's token), and
    queue the choices' copy to the host."""
    seq_ids = [f.seq_id for f in feeds]
    logits, rows = runner.step(seq_ids, [[f.token] for f in feeds])  # [B, 1, vocab]
    step_logits = take_rows(logits, rows)[:, 0]  # [n, vocab]
    choice = step_logits.argmax(-1)  # [n]
    for i, f in enumerate(feeds):
        if not f.sampling.greedy:  # a few kernels per sampled row, still no host read
            choice[i] = sample_token(step_logits[i], f.sampling, f.seed, f.position)
    if logits.device.type != "cuda":
        return AheadPass(seq_ids, choice, None)
    host = torch.empty(len(seq_ids), dtype=torch.long, pin_memory=True)
    host.copy_(choice, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    return AheadPass(seq_ids, host, done)
