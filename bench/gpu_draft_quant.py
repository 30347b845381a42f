"""How much cheaper is the draft's step with int8 weights? (GPU, one card, batch 1)

    python3 -m bench.gpu_draft_quant [--reps 100] [--agree-steps 256] [--out bench/out/gpu_draft_quant.json]

The 1B-shaped random-weight draft of bench/gpu.py, its greedy loop (forward + argmax +
ControlledAcceptance proposer + feed back, one CUDA graph replay a step) timed as bench/gpu.py
times it, for FastLlama(weights=...):
  - "bf16": the current draft (elementwise ops fused by Inductor, cuBLAS GEMMs, grouped attention);
  - "int8_layers": weight-only int8 for the 4 GEMMs of every layer (Inductor-compiled int8 GEMVs);
  - "int8": those and the lm_head (525 MB of the 1B's 2.47 GB in bf16).
Each row: ms per step (median of 5 runs of --reps steps), the weight bytes one step actually reads (int8 + scales where quantised,
the embedding's one row and the KV cache left out), the fraction of that step's own weight-read
roofline (bytes / copy bandwidth), and the ratio to the 8B target's decode graph step (bf16, as in
bench/gpu.py): what a draft step costs in target steps.

Acceptance. A quantised draft changes only acceptance (the target verifies every proposal), so:
  - 1B, random weights: the draft's argmax per position, teacher-forced along the bf16 draft's own
    greedy continuation, compared with the bf16 draft's. A poor proxy: random_llama zeroes every
    layer's o_proj/down_proj (see bench/gpu.py), so the argmax depends on the current token and the
    lm_head alone -- "int8_layers" agrees trivially, "int8" measures only the lm_head's rounding.
  - the embedded trained pair (models/, real weights, tiny): the acceptance rate of real
    speculative decoding (k=4, greedy) with the draft in bf16 vs int8, the target in fp32; the
    output must stay identical to plain decoding either way.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from app.fast_decode import ControlledAcceptance, GreedyLoop, plain_generate, speculative_generate
from app.fast_llama import FastLlama
from bench.gpu import EMBEDDED_PROMPT, copy_bandwidth, loop_step_time, random_llama, step_time

VARIANTS = ("bf16", "int8_layers", "int8")
VOCAB = 128256


class RecordingAcceptance(ControlledAcceptance):
    """ControlledAcceptance that also keeps what the draft itself picked at each position
    (capture-safe). At alpha 1 it feeds `reference` back: the loop is teacher-forced along it."""

    def __init__(self, reference: torch.Tensor, vocab: int) -> None:
        super().__init__(reference, 1.0, vocab)
        self.drafted = torch.full_like(reference, -1)  # [max_len]: the draft's argmax per position

    def __call__(self, drafted: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        self.drafted.index_copy_(0, position, drafted)
        return super().__call__(drafted, position)


def median_of(measure: Callable[..., float], *args: object, times: int = 5, **kwargs: object) -> float:
    """Median of `times` calls of measure(*args, **kwargs): single runs of ~0.1 s moved by tens of
    microseconds a step."""
    return statistics.median(measure(*args, **kwargs) for _ in range(times))


def log(t0: float, msg: str) -> None:
    print(f"[{time.perf_counter() - t0:5.0f}s] {msg}", flush=True)


def greedy_chain(fd: FastLlama, prompt: torch.Tensor, steps: int) -> list[int]:
    """The draft's own greedy continuation: tokens for positions P .. P+steps."""
    loop = GreedyLoop(fd)
    P = prompt.shape[1]
    first = int(loop.prefill(prompt)[0].argmax())
    loop.reset([first], P)
    loop.advance(steps)
    return [first] + loop.read(P + 1, P + 1 + steps).tolist()


def agreement(fd: FastLlama, prompt: torch.Tensor, chain: list[int]) -> dict[str, float]:
    """Teacher-forced along `chain` (positions P..): how often fd's argmax equals chain's token,
    and how many leading positions agree (where fd's own free-running chain would first differ)."""
    P, steps = prompt.shape[1], len(chain) - 1
    forced = torch.zeros(fd.max_len, dtype=torch.long, device=fd.device)  # [max_len]
    forced[P: P + len(chain)] = torch.tensor(chain, device=fd.device)
    rec = RecordingAcceptance(forced, VOCAB)
    loop = GreedyLoop(fd, rec)
    first = int(loop.prefill(prompt)[0].argmax())  # the prefill path (dequantise + cuBLAS)
    loop.reset([chain[0]], P)
    loop.advance(steps)
    mine = [first] + rec.drafted[P + 1: P + 1 + steps].tolist()
    same = [a == b for a, b in zip(mine, chain)]
    prefix = same.index(False) if False in same else len(same)
    return {"argmax_agreement": sum(same) / len(same), "agreeing_prefix": prefix, "positions": len(same)}


def embedded_acceptance(n: int, k: int, t0: float) -> dict[str, object]:
    """Real speculative decoding with the trained pair: target fp32, draft bf16 / int8."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained("models/target")
    prompt = torch.tensor([tok(EMBEDDED_PROMPT, add_special_tokens=False)["input_ids"]], device="cuda")
    max_len = prompt.shape[1] + n + 2 * k + 32
    target_hf = AutoModelForCausalLM.from_pretrained("models/target", dtype=torch.float32).to("cuda").eval()
    draft_hf = AutoModelForCausalLM.from_pretrained("models/draft", dtype=torch.bfloat16).to("cuda").eval()
    ft = FastLlama(target_hf, max_len=max_len)
    for w in range(1, k + 2):
        ft.capture(w)
    plain = plain_generate(GreedyLoop(ft), prompt, n)
    out: dict[str, object] = {"k": k, "new_tokens": n, "target": "fp32", "draft": "bf16 weights as below"}
    for weights in VARIANTS:
        fd = FastLlama(draft_hf, max_len=max_len, compile_elementwise=True, attention="grouped", weights=weights)
        tokens, st = speculative_generate(ft, GreedyLoop(fd), prompt, n, k)
        out[weights] = {"acceptance_rate": st.acceptance_rate, "per_token_acceptance": st.per_token_acceptance,
                        "mean_acceptance_length": st.mean_acceptance_length, "identical_to_plain": tokens == plain}
        log(t0, f"embedded pair, draft {weights}: {json.dumps(out[weights])}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--agree-steps", type=int, default=256, help="greedy steps compared for argmax agreement")
    ap.add_argument("--reps", type=int, default=100, help="timed steps per measurement (median of 5)")
    ap.add_argument("--embedded-tokens", type=int, default=256)
    ap.add_argument("--skip-embedded", action="store_true")
    ap.add_argument("--out", type=Path, default=Path("bench/out/gpu_draft_quant.json"))
    args = ap.parse_args()
    t0 = time.perf_counter()
    P, S = args.prompt_tokens, args.agree_steps
    max_len = max(P + S + 32, 200 + args.reps + 16)  # loop_step_time runs its steps from position 200
    res: dict[str, object] = {"card": torch.cuda.get_device_name(), "torch": torch.__version__,
                              "prompt_tokens": P, "agree_steps": S, "reps": args.reps}
    bw = copy_bandwidth()
    res["bandwidth_TBs"] = bw / 1e12
    prompt = torch.randint(0, VOCAB, (1, P), device="cuda", generator=torch.Generator("cuda").manual_seed(1))

    # the 8B target: its decode graph step (what a draft step is compared with) and its greedy tokens
    # (the reference the ControlledAcceptance proposer feeds back, as in bench/gpu.py)
    target_hf = random_llama("8b")
    ft = FastLlama(target_hf, max_len=max_len, compile_elementwise=True, attention="grouped")
    ft.capture(1)
    t_target = median_of(step_time, ft, 1, reps=args.reps)
    target_bytes = ft.weight_bytes_per_step()
    ref = torch.zeros(max_len, dtype=torch.long, device="cuda")  # [max_len]
    reference = plain_generate(GreedyLoop(ft), prompt, max_len - P - 8)
    ref[P: P + len(reference)] = torch.tensor(reference, device="cuda")
    res["target_8b"] = {"step_ms": t_target * 1e3, "weight_MB": target_bytes / 1e6,
                        "fraction_of_roofline": target_bytes / bw / t_target}
    log(t0, f"8B target graph step {t_target * 1e3:.3f} ms ({target_bytes / bw / t_target:.1%} of its roofline)")
    del ft, target_hf
    torch.cuda.empty_cache()

    draft_hf = random_llama("1b")
    rows: dict[str, dict[str, object]] = {}
    chain: list[int] = []
    for weights in VARIANTS:
        t1 = time.perf_counter()
        fd = FastLlama(draft_hf, max_len=max_len, compile_elementwise=True, attention="grouped", weights=weights)
        loop = GreedyLoop(fd, ControlledAcceptance(ref, 1.0, vocab=VOCAB, seed=7))  # compiles and captures
        setup_s = time.perf_counter() - t1
        t_step = median_of(loop_step_time, loop, reps=args.reps)
        nbytes = fd.weight_bytes_per_step()
        if weights == "bf16":
            chain = greedy_chain(fd, prompt, S)
        agree = agreement(fd, prompt, chain)
        rows[weights] = {"step_ms": t_step * 1e3, "weight_MB": nbytes / 1e6, "fraction_of_roofline": nbytes / bw / t_step,
                         "over_target_step": t_step / t_target, "setup_s": setup_s, **agree}
        log(t0, f"1B draft {weights}: {json.dumps(rows[weights])}")
        del loop, fd
        torch.cuda.empty_cache()
    res["draft_1b"] = rows
    for weights in VARIANTS[1:]:
        res[f"speedup_{weights}_over_bf16"] = rows["bf16"]["step_ms"] / rows[weights]["step_ms"]
    del draft_hf
    torch.cuda.empty_cache()
    if not args.skip_embedded:
        res["embedded_pair"] = embedded_acceptance(args.embedded_tokens, 4, t0)
    res["wall_s"] = time.perf_counter() - t0
    res["note"] = ("argmax agreement on the random 1B is a poor proxy for acceptance: its o_proj/down_proj are "
                   "zeroed, so only the lm_head's quantisation can change an argmax; see embedded_pair for "
                   "acceptance measured with trained weights")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1))

    print(f"\n{res['card']}, torch {res['torch']}, copy bandwidth {bw / 1e12:.2f} TB/s, batch 1; "
          f"draft = 1B greedy loop step (one graph replay), target = 8B decode graph step")
    print(f"{'variant':16} {'ms/step':>8} {'weights MB':>10} {'% roofline':>10} {'/ target':>8} "
          f"{'argmax agree':>12} {'prefix':>6}")
    print(f"{'8B target bf16':16} {t_target * 1e3:8.3f} {target_bytes / 1e6:10.0f} "
          f"{res['target_8b']['fraction_of_roofline']:10.1%} {1:8.3f}")
    for weights, r in rows.items():
        print(f"{'1B ' + weights:16} {r['step_ms']:8.3f} {r['weight_MB']:10.0f} {r['fraction_of_roofline']:10.1%} "
              f"{r['over_target_step']:8.3f} {r['argmax_agreement']:12.1%} {r['agreeing_prefix']:6d}")
    print(f"argmax agreement: teacher-forced along the bf16 draft's greedy continuation, {S + 1} positions. "
          f"{res['note']}.")
    if "embedded_pair" in res:
        emb = res["embedded_pair"]
        print("embedded trained pair, k=4, greedy: acceptance rate "
              + ", ".join(f"draft {w} {emb[w]['acceptance_rate']:.3f} (identical output: {emb[w]['identical_to_plain']})"
                          for w in VARIANTS))
    print(f"wall {res['wall_s']:.0f} s; JSON in {args.out}", flush=True)


if __name__ == "__main__":
    main()
