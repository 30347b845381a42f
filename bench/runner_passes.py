"""What the served runner and its verification add to a pass, alone on the card.

    python3 -m bench.runner_passes [--shape 8b] [--batches 1,8,32] [--widths 1,2,3,5,9]

The served engine's verify pass (bench/RESULTS.md section 1) costs more over a decode than
bench.gpu's in-process loop measures for the same model. This takes one target replica's runner
(ModelRunner, the served config: CUDA graphs per batch bucket and width, max_context 1024) with an
8B-shaped random-weight model, fills `b` rows with 128-token prompts, and times at every
(batch, width), each point the median of `--repeats` passes:

- `graph`: the captured graph's replay on device tensors, then a synchronisation (the bare pass);
- `step`: ModelRunner.step from host token lists (what the engine calls), then a synchronisation;
- `step+verify`: step, then the served greedy verification of `width - 1` proposals per row
  (app/spec/verify.py), ending in its one host read: what the engine's "target pass" times.

Nothing else runs on the card, so the differences are the runner's and the verification's own.
`--shape tiny --device cpu` is a smoke run (eager passes: the `graph` column is then the eager pass).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from app.config import ModelSpec
from app.protocol.sampling_params import SamplingParams
from app.runners.model_runner import ModelRunner
from app.spec.verify import RowToVerify, verify_batch
from bench.gpu import timed
from bench.serve_gpu import VOCAB, write_checkpoint

PROMPT = 128


def _median_ms(fn: Callable[[], object], repeats: int) -> float:
    timed(fn)  # warm-up (a first replay, a first compiled shape)
    return 1e3 * statistics.median(timed(fn) for _ in range(repeats))


def measure(runner: ModelRunner, batches: list[int], widths: list[int], repeats: int) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    sampling = SamplingParams(max_tokens=1, temperature=0)
    out = []
    ids: list[str] = []
    for b in batches:
        while len(ids) < b:  # rows filled once, oldest first: the batch bucket follows len(ids)
            ids.append(f"s{len(ids)}")
            runner.add(ids[-1])
            runner.prefill(ids[-1], torch.randint(1, VOCAB - 1, (PROMPT,), generator=gen).tolist())
        for w in widths:
            inputs = [torch.randint(1, VOCAB - 1, (w,), generator=gen).tolist() for _ in ids]

            def step() -> tuple[torch.Tensor, list[int]]:
                logits, rows = runner.step(ids, inputs)
                for s in ids:  # back to the prompt: every repeat runs at the same positions
                    runner.truncate(s, PROMPT)
                return logits, rows

            def step_and_verify() -> None:
                logits, rows = step()
                verify_batch(logits, [RowToVerify(row, x[1:], None, sampling, 0, PROMPT + 1)
                                      for row, x in zip(rows, inputs)])

            bucket = next(x for x in runner.buckets if x >= len(ids))
            graph = runner.model.graphs.get((bucket, w))
            if graph is not None:
                replay = graph[0].replay
            else:  # no graph (CPU, or graphs off): the eager pass from device tensors
                tok = torch.tensor([x for x in inputs], device=runner.device)
                pos = (torch.arange(w, device=runner.device) + PROMPT).view(1, -1).expand(len(ids), -1)

                def replay() -> None:
                    runner.model.forward(tok, pos)
            # step first: it leaves this prompt's positions in the graph's input buffers (captured at
            # the cache's last positions, a replay before it would attend over the whole cache)
            step_ms = _median_ms(step, repeats)
            point = {"batch": b, "width": w, "graph_ms": _median_ms(replay, repeats),
                     "step_ms": step_ms, "step_verify_ms": _median_ms(step_and_verify, repeats)}
            out.append(point)
            print(f"{b:>5} {w:>5} {point['graph_ms']:>9.3f} {point['step_ms']:>9.3f} {point['step_verify_ms']:>12.3f}",
                  flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=("8b", "tiny"), default="8b")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--widths", default="1,2,3,5,9")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", type=Path, default=Path("bench/out/runner_passes.json"))
    args = ap.parse_args()
    batches = sorted({int(x) for x in args.batches.split(",")})
    widths = sorted({int(x) for x in args.widths.split(",")})
    gpu = args.device.startswith("cuda")
    with tempfile.TemporaryDirectory() as tmp:
        path = write_checkpoint(Path(tmp) / "target", args.shape, VOCAB)
        spec = ModelSpec(path=str(path), dtype="bfloat16" if gpu else "float32", device=args.device,
                         max_context=1024, random_weights=True)
        t0 = time.perf_counter()
        runner = ModelRunner(spec, max_seqs=max(batches), widths=range(1, max(widths) + 1))
        print(f"runner ready in {time.perf_counter() - t0:.1f}s; batch width graph_ms step_ms step+verify_ms")
        points = measure(runner, batches, widths, args.repeats)
    card = torch.cuda.get_device_name() if gpu else "cpu"
    report = {"bench": "runner_passes", "card": card, "shape": args.shape,
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "repeats": args.repeats, "points": points}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
