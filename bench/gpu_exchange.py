"""What does moving a batch of proposals between draft and target cost, by each channel? (GPU host)

    source .gpu-carry/unpack-ray && python3 -m bench.gpu_exchange [--calls 500] [--out F]

The payload is what one speculative step exchanges for a full batch: proposals `[32, 8]` int64
going to the target, accepted counts `[32]` coming back. Measured round trips (p50 / p99 ms):
  - raw Ray actor call, one hop (driver -> draft actor -> driver) and two hops (draft -> target);
  - Ray compiled graph (`experimental_compile`), one hop and two hops, same payload;
  - in one process (the fast path's choice when both models are driven by one host loop):
    the ids copied device -> pinned host (awaited on an event) -> the other device.
Actors are placed on GPUs as the Serve replicas would be (one GPU each when there are two).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

import ray
from bench.inproc.fast_decode import read_back, to_device
from ray.dag import InputNode

BATCH, K = 32, 8


def percentiles(samples: list[float]) -> dict[str, float]:
    s = sorted(samples)
    return {"p50_ms": s[len(s) // 2] * 1e3, "p99_ms": s[int(len(s) * 0.99)] * 1e3}


def timed_calls(call, calls: int, warmup: int = 50) -> dict[str, float]:
    for _ in range(warmup):
        call()
    samples = []
    for _ in range(calls):
        t0 = time.perf_counter()
        call()
        samples.append(time.perf_counter() - t0)
    return percentiles(samples)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=500)
    ap.add_argument("--out", type=Path, default=Path("bench/out/gpu-exchange.json"))
    args = ap.parse_args()
    gpus = torch.cuda.device_count()
    per_actor = 1.0 if gpus >= 2 else 0.5
    ray.init(num_gpus=gpus, include_dashboard=False, log_to_driver=False)

    @ray.remote(num_gpus=per_actor, num_cpus=0)
    class Draft:
        def propose(self, step: torch.Tensor) -> torch.Tensor:
            return torch.full((BATCH, K), int(step), dtype=torch.long)  # [batch, k] proposals

        def propose_np(self, step: int) -> np.ndarray:
            return np.full((BATCH, K), step, dtype=np.int64)  # [batch, k] proposals

    @ray.remote(num_gpus=per_actor, num_cpus=0)
    class Target:
        def verify(self, proposals: torch.Tensor) -> torch.Tensor:
            return (proposals[:, 0] % (K + 1)).clone()  # [batch] accepted counts

        def verify_np(self, proposals: np.ndarray) -> np.ndarray:
            return proposals[:, 0] % (K + 1)  # [batch] accepted counts

    draft, target = Draft.remote(), Target.remote()
    step = torch.tensor(3)
    res: dict[str, object] = {"card": torch.cuda.get_device_name(), "gpus": gpus, "ray": ray.__version__,
                              "payload": f"[{BATCH}, {K}] int64 proposals, [{BATCH}] int64 back", "calls": args.calls}
    res["raw_actor_one_hop"] = timed_calls(lambda: ray.get(draft.propose.remote(step)), args.calls)
    res["raw_actor_two_hops"] = timed_calls(lambda: ray.get(target.verify.remote(draft.propose.remote(step))), args.calls)
    with InputNode() as inp:
        one = draft.propose.bind(inp)
    cg_one = one.experimental_compile()
    res["compiled_graph_one_hop"] = timed_calls(lambda: ray.get(cg_one.execute(step)), args.calls)
    cg_one.teardown()
    with InputNode() as inp:
        two = target.verify.bind(draft.propose.bind(inp))
    cg_two = two.experimental_compile()
    res["compiled_graph_two_hops"] = timed_calls(lambda: ray.get(cg_two.execute(step)), args.calls)
    cg_two.teardown()
    # the same through numpy arrays (Ray serialises torch tensors through its torch path)
    with InputNode() as inp:
        one_np = draft.propose_np.bind(inp)
    cg = one_np.experimental_compile()
    res["compiled_graph_one_hop_numpy"] = timed_calls(lambda: ray.get(cg.execute(3)), args.calls)
    cg.teardown()
    with InputNode() as inp:
        two_np = target.verify_np.bind(draft.propose_np.bind(inp))
    cg = two_np.experimental_compile()
    res["compiled_graph_two_hops_numpy"] = timed_calls(lambda: ray.get(cg.execute(3)), args.calls)
    cg.teardown()
    src, dst = torch.device("cuda:0"), torch.device(f"cuda:{min(1, gpus - 1)}")
    ids = torch.zeros((BATCH, K), dtype=torch.long, device=src)

    def in_process() -> None:
        values = read_back(ids.view(-1)).tolist()
        to_device(values, dst)
        torch.cuda.synchronize(dst)

    res["in_process_device_host_device"] = timed_calls(in_process, args.calls)
    ray.shutdown()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))
    print(f"\n{'channel':36} {'p50 ms':>8} {'p99 ms':>8}")
    for key, value in res.items():
        if isinstance(value, dict):
            print(f"{key:36} {value['p50_ms']:8.3f} {value['p99_ms']:8.3f}")


if __name__ == "__main__":
    main()
