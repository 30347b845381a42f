"""What the separate-actor design costs per step: one draft<->target Serve hop vs one model step.

    .venv/bin/python -m bench.exchange [--calls 300]

Deploys the DraftServer alone on a local Ray and calls its batched `step()` through a Serve
handle from a helper replica (as the TargetServer does), with an empty step (pure hop) and
with a real 4-token proposal for one sequence; then times, in-process, one target decode
step and one verify step of the embedded pair. Prints p50/p99 and the hop as a fraction of
a speculative step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import ray
import torch
from ray import serve

from app.config import AppConfig, ModelSpec, load_yaml
from app.draft_protocol import DraftSeqDelta, DraftStepRequest
from app.kv_cache import SequenceKV
from app.model_runner import ModelRunner
from app.sampling_params import SamplingParams
from deployments.draft_server import DraftServer


@serve.deployment
class HopProbe:
    """Calls the draft from inside a replica, as the target server does."""

    def __init__(self, draft) -> None:
        self.draft = draft

    async def measure(self, calls: int, with_proposal: bool) -> list[float]:
        sampling = SamplingParams(max_tokens=64)
        prompt = list(range(10, 74))
        out = []
        for i in range(calls):
            seqs = [DraftSeqDelta("probe", 0, 0, prompt + [i % 50], 4, sampling, 0)] if with_proposal else []
            t0 = time.perf_counter()
            await self.draft.step.remote(DraftStepRequest("probe-client", seqs))
            out.append(time.perf_counter() - t0)
        return out


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] * 1e3


def model_steps(reps: int) -> dict[str, float]:
    torch.set_num_threads(1)  # what a replica gets in configs/local.yaml
    target = ModelRunner(ModelSpec(path="models/target", num_threads=1))
    draft = ModelRunner(ModelSpec(path="models/draft", num_threads=1))
    out = {}
    for name, runner, width in (("target_decode", target, 1), ("target_verify_k4", target, 5), ("draft_decode", draft, 1)):
        times = []
        for _ in range(reps):
            kv = SequenceKV()
            runner.forward([kv], [list(range(10, 138))])
            t0 = time.perf_counter()
            runner.forward([kv], [list(range(200, 200 + width))])
            times.append(time.perf_counter() - t0)
        out[name] = statistics.median(times) * 1e3
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--out", type=Path, default=Path("bench/results/exchange-cpu.json"))
    args = parser.parse_args()
    steps = model_steps(30)
    config = load_yaml("configs/local.yaml")["applications"][0]["args"]
    AppConfig.model_validate(config)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    draft = DraftServer.options(ray_actor_options={"num_cpus": 0.5}).bind(config)
    probe = serve.run(HopProbe.options(ray_actor_options={"num_cpus": 0.5}).bind(draft), name="exchange", route_prefix=None)
    empty = probe.measure.remote(args.calls, False).result()
    full = probe.measure.remote(args.calls // 3, True).result()
    serve.shutdown()
    ray.shutdown()
    spec_step = 4 * steps["draft_decode"] + steps["target_verify_k4"]
    res = {
        "model_step_ms_p50": steps,
        "serve_hop_empty_ms": {"p50": pct(empty, 0.5), "p99": pct(empty, 0.99)},
        "serve_hop_with_4_token_proposal_ms": {"p50": pct(full, 0.5), "p99": pct(full, 0.99)},
        "hop_over_speculative_step": pct(empty, 0.5) / (spec_step + pct(empty, 0.5)),
        "hop_over_target_decode": pct(empty, 0.5) / steps["target_decode"],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
