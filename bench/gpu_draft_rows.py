"""Where an R-row draft step's time goes (app/fast_branches.py): the 1B-shaped draft's forward over
R batch rows alone, then with its argmax, a top-2, and the whole branching step (top-2, the
controlled proposer, the row writes). R = 1 also times the one-chain loop's step (GreedyLoop).

    python3 -m bench.gpu_draft_rows        # one GPU, ~1 min; ms per step by R

Each variant but the loops' is captured as one CUDA graph and replayed 200 times.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from app.fast_branches import BranchingDraft, ControlledBranches
from app.fast_decode import ControlledAcceptance, GreedyLoop
from app.fast_llama import FastLlama, capture_graph
from bench.gpu import loop_step_time, random_llama, timed
from bench.gpu_branches import VOCAB, branch_step_time

MAX_LEN = 434  # bench.gpu_branches' cache for a 128-token prompt and 256 new tokens


def graph_ms(fn: Callable[[], torch.Tensor], reps: int = 200) -> float:
    graph, _ = capture_graph(torch.device("cuda"), fn)
    graph.replay()
    torch.cuda.synchronize()
    return timed(lambda: [graph.replay() for _ in range(reps)]) / reps * 1e3


def main() -> None:
    torch._dynamo.config.recompile_limit = 64  # one fused-op variant per row count
    hf = random_llama("1b")
    model = FastLlama(hf, max_batch=8, max_len=MAX_LEN, attention="grouped", compile_elementwise=True)
    ref = torch.zeros(MAX_LEN, dtype=torch.long, device="cuda")
    print(f"{torch.cuda.get_device_name()}: 1B-shaped bf16 draft, ms per step")
    for rows in (1, 2, 4, 6):
        tok = torch.zeros((rows, 1), dtype=torch.long, device="cuda")
        pos = torch.full((rows, 1), 300, dtype=torch.long, device="cuda")
        logits = lambda: model.forward(tok, pos, last_only=True)[:, -1]  # noqa: E731  [R, vocab]
        res = {"forward": graph_ms(logits),
               "+ argmax": graph_ms(lambda: logits().argmax(-1)),
               "+ top-2": graph_ms(lambda: logits().topk(2, dim=-1).indices)}
        if rows >= 2:
            draft = BranchingDraft(model, rows, ControlledBranches(ref, 0.7, 0.5, vocab=VOCAB))
            res["branching step"] = branch_step_time(draft) * 1e3
        else:
            one = FastLlama(hf, max_len=MAX_LEN, attention="grouped", compile_elementwise=True)
            res["one-chain loop step"] = loop_step_time(GreedyLoop(one, ControlledAcceptance(ref, 0.7, vocab=VOCAB))) * 1e3
        print(f"R={rows}: " + ", ".join(f"{k} {v:.3f}" for k, v in res.items()), flush=True)


if __name__ == "__main__":
    main()
