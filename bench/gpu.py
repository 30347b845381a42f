"""GPU speed at batch 1: HF eager, HF assisted, ours plain, ours speculative sequential and overlapped.

    python3 -m bench.gpu [--new-tokens 256] [--prompt-tokens 128] [--out bench/out/gpu.json]

Llama-3.1-8B / Llama-3.2-1B *shaped* models with random bf16 weights are built on the GPU.
Random weights agree on nothing, so speculative speed is measured at controlled acceptance
(`bench.inproc.fast_decode.ControlledAcceptance`): the draft model really runs every step (its cost is
real) but proposes the target's own greedy token with probability alpha, a wrong one otherwise;
verification is real. Sequential mode runs the draft on the target's GPU; overlapped mode (when
the host has a second GPU) runs it on cuda:1 while the target verifies on cuda:0. k (and the
overlap depth) are chosen per alpha from the step costs measured in this run, by the same rules
the loop follows (`predicted_tokens_per_second`); "achieved / predicted" compares the measured
speed with that model. The embedded trained pair runs at its natural acceptance.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from bench.inproc.fast_decode import (ControlledAcceptance, GreedyLoop, plain_generate, predicted_tokens_per_second,
                             read_back, speculative_generate, to_device)
from app.runners.lean_llama import FastLlama
from bench.inproc.fast_spec_graph import SpeculativePassGraph

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def sync() -> None:
    for i in range(torch.cuda.device_count()):
        torch.cuda.synchronize(i)


SHAPES = {
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, tie_word_embeddings=False),
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, tie_word_embeddings=True),
}


def random_llama(shape: str, device: str = "cuda"):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192},
        **SHAPES[shape],
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    # Random weights make a chaotic function: a one-token pass and a (k+1)-token pass pick
    # different argmaxes after tiny rounding differences, and the greedy "reference"
    # continuation diverges for good after the first flip (measured: acceptance ~0.03 at a
    # nominal 0.9). Zeroing what each layer writes back into the residual stream makes the
    # argmax a stable function of the current token. Every weight is still read by the same
    # dense GEMMs, so the step's cost (what is measured here) does not change.
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    return model


def weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def copy_bandwidth() -> float:
    x = torch.empty(2 * 1024**3 // 2, dtype=torch.bfloat16, device=DEV)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    torch.cuda.synchronize()
    return 2 * x.numel() * 2 * 10 / (time.perf_counter() - t0)  # read + write bytes / s


def timed(fn) -> float:
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def hf_generate(model, prompt: torch.Tensor, n: int, assistant=None) -> float:
    kwargs = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    if assistant is not None:
        kwargs["assistant_model"] = assistant
    model.generate(prompt, **{**kwargs, "max_new_tokens": 8, "min_new_tokens": 8})  # warm-up
    return n / timed(lambda: model.generate(prompt, **kwargs))


def step_time(fast: FastLlama, width: int, reps: int = 50) -> float:
    """One graph replay over `[1, width]` (captured beforehand), in seconds."""
    tok = torch.zeros((1, width), dtype=torch.long, device=fast.device)
    pos = torch.arange(300, 300 + width, device=fast.device).view(1, -1)
    fast.run(tok, pos)
    return timed(lambda: [fast.run(tok, pos) for _ in range(reps)]) / reps


def loop_step_time(loop: GreedyLoop, reps: int = 50) -> float:
    """One step of the on-device greedy loop (forward + argmax + proposer + feed back)."""
    loop.reset([1], 200)
    loop.advance(5)
    loop.reset([1], 200)
    return timed(lambda: loop.advance(reps)) / reps


def pair_step_extra(loop: GreedyLoop, reps: int = 50) -> float:
    """What a 2-token draft step (feeding [x_{n-1}, x_n], as after a fully accepted pass) costs
    over a 1-token one: reset + one step of each width, timed alike, differenced (seconds)."""
    def one(width: int) -> float:
        def go() -> None:
            for _ in range(reps):
                loop.reset([1] * width, 200)
                loop.advance(1)
        go()
        return timed(go) / reps
    return one(2) - one(1)


def decode_only(loop: GreedyLoop, prompt: torch.Tensor, n: int) -> float:
    """Plain decoding's rate with the prompt's prefill left out (tok/s over n-1 decode steps)."""
    loop.reset([int(loop.prefill(prompt)[0].argmax())], prompt.shape[1])
    return (n - 1) / timed(lambda: loop.advance(n - 1))


def exchange_time(src: torch.device, dst: torch.device, width: int, reps: int = 200) -> float:
    """What the host loop pays per pass to move `width` token ids: an async device->pinned copy
    waited on by event, then a pinned->device copy (median seconds)."""
    ids = torch.arange(width, device=src)
    times = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        values = read_back(ids).tolist()
        to_device(values, dst)
        torch.cuda.synchronize(dst)
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def best_k(alpha: float, overlap: bool, t_draft: float, t_verify: dict[int, float], max_k: int) -> tuple[int, int, float]:
    """(k, overlap steps, predicted tok/s) maximising the loop's cost model."""
    depths = range(1, 9) if overlap else (0,)
    return max(((k, L, predicted_tokens_per_second(alpha, k, L, t_draft, t_verify))
                for k in range(1, max_k + 1) for L in depths), key=lambda c: c[2])


class BusyTimer:
    """CUDA events around every target pass and every batch of draft steps: how long each GPU
    was busy, so wall time minus busy time shows what the host loop and the exchange cost."""

    def __init__(self, target: FastLlama, draft: GreedyLoop) -> None:
        self.spans: dict[str, list[tuple[torch.cuda.Event, torch.cuda.Event]]] = {"target": [], "draft": []}
        self._wrap(target, "run", "target")
        self._wrap(target, "run_from_host", "target")  # verify_host_ids' way in
        self._wrap(draft, "advance", "draft")
        self._wrapped = ((target, "run"), (target, "run_from_host"), (draft, "advance"))

    def _wrap(self, obj, method: str, name: str) -> None:
        inner = getattr(obj, method)

        def timed_call(*args, **kwargs):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.device(obj.device):
                start.record()
                out = inner(*args, **kwargs)
                end.record()
            self.spans[name].append((start, end))
            return out

        setattr(obj, method, timed_call)

    def finish(self) -> dict[str, float]:
        sync()
        for obj, method in self._wrapped:
            delattr(obj, method)  # the class's method again
        return {f"{name}_busy_s": sum(s.elapsed_time(e) for s, e in spans) / 1e3 for name, spans in self.spans.items()}


def run_spec(target: FastLlama, draft: GreedyLoop, prompt: torch.Tensor, n: int, k: int, L: int) -> dict[str, object]:
    speculative_generate(target, draft, prompt, 32, k, overlap_steps=L)  # warm-up
    result: dict[str, object] = {}

    def go() -> None:
        result["tokens"], result["stats"] = speculative_generate(target, draft, prompt, n, k, overlap_steps=L)

    seconds = timed(go)
    st = result["stats"]
    # the same run again with events around each GPU's work: where the wall time went
    timer = BusyTimer(target, draft)
    seconds_timed = timed(go)
    busy = timer.finish()
    return {"tokens": result["tokens"], "tok_s": n / seconds, "k": k, "overlap_steps": L,
            "acceptance_rate": st.acceptance_rate, "per_token_acceptance": st.per_token_acceptance,
            "tokens_per_pass": n / st.passes, "passes": st.passes, "restarts": st.restarts,
            "draft_steps": st.draft_steps, "proposals_per_pass": dict(sorted(st.widths.items())),
            "ms_per_pass": seconds / st.passes * 1e3,
            "instrumented": {"wall_s": seconds_timed, **busy,
                             "target_idle_ms_per_pass": (seconds_timed - busy["target_busy_s"]) / st.passes * 1e3}}


def run_pass_graph(target: FastLlama, draft: GreedyLoop, prompt: torch.Tensor, n: int, k: int, L: int) -> dict[str, object]:
    """Sequential speculation with each pass one CUDA graph (bench/inproc/fast_spec_graph.py); L must be 0."""
    assert L == 0, "the one-graph pass is the sequential mode"
    loop = SpeculativePassGraph(target, draft, k)
    loop.generate(prompt, 32)  # warm-up
    result: dict[str, object] = {}

    def go() -> None:
        result["tokens"], result["stats"] = loop.generate(prompt, n)

    seconds = timed(go)
    st = result["stats"]
    return {"tokens": result["tokens"], "tok_s": n / seconds, "k": k, "overlap_steps": 0,
            "acceptance_rate": st.acceptance_rate, "per_token_acceptance": st.per_token_acceptance,
            "tokens_per_pass": n / st.passes, "passes": st.passes, "restarts": st.restarts,
            "draft_steps": st.draft_steps, "proposals_per_pass": dict(sorted(st.widths.items())),
            "ms_per_pass": seconds / st.passes * 1e3}


EMBEDDED_PROMPT = "import os\nimport sys\n\n\ndef read_config(path):\n    \"\"\"Read a configuration file.\"\"\"\n"


def embedded_pair(n: int) -> dict[str, object]:
    """The trained pair at its natural acceptance (greedy, a held-out-style code prompt)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    load = lambda p: AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).to(DEV).eval()  # noqa: E731
    tok = AutoTokenizer.from_pretrained("models/target")
    prompt = torch.tensor([tok(EMBEDDED_PROMPT, add_special_tokens=False)["input_ids"]], device=DEV)
    max_len = prompt.shape[1] + n + 32
    ft, fd = FastLlama(load("models/target"), max_len=max_len), FastLlama(load("models/draft"), max_len=max_len)
    for w in range(1, 8):
        ft.capture(w)
    plain_loop, draft = GreedyLoop(ft), GreedyLoop(fd)
    plain_generate(plain_loop, prompt, n)
    ref: list[int] = []
    plain = n / timed(lambda: ref.extend(plain_generate(plain_loop, prompt, n)))
    out: dict[str, object] = {"plain_tok_s": plain}
    for k in (2, 4, 6):
        r = run_spec(ft, draft, prompt, n, k, 0)
        out[f"k{k}"] = {"tok_s": r["tok_s"], "speedup": r["tok_s"] / plain, "acceptance_rate": r["acceptance_rate"],
                        "tokens_per_pass": r["tokens_per_pass"], "identical_to_plain": r["tokens"] == ref}
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--alphas", default="0.5,0.7,0.9")
    parser.add_argument("--max-k", type=int, default=8)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--hf-new-tokens", type=int, default=64, help="HF rows decode fewer tokens (they are slow)")
    parser.add_argument("--attention", default="grouped", choices=["grouped", "sdpa"])
    parser.add_argument("--draft-compile", default=None, metavar="MODE",
                        help="compile the draft's whole forward with this torch.compile mode "
                             "(max-autotune-no-cudagraphs makes the 1B step ~11%% faster on an H200)")
    parser.add_argument("--draft-weights", default="bf16,int8",
                        help="draft weight formats to measure, comma-separated (FastLlama weights=: bf16, int8, "
                             "int8_layers); a quantized draft changes acceptance, never the output")
    parser.add_argument("--int8-one-row", default="triton", choices=["inductor", "triton"],
                        help="the int8 draft's one-row GEMV kernel (FastLlama int8_one_row)")
    parser.add_argument("--int8-pins", default="", metavar="JSON",
                        help="Triton int8 GEMV block configs per shape (bench.gpu_draft_step --cold-table); "
                             "default: app/runners/kernels/int8_gemv.py's H200 table")
    parser.add_argument("--skip-embedded", action="store_true")
    parser.add_argument("--out", type=Path, default=Path("bench/out/gpu.json"))
    args = parser.parse_args()
    n, P, max_k = args.new_tokens, args.prompt_tokens, args.max_k
    t0 = time.perf_counter()
    two_gpus = torch.cuda.device_count() > 1
    res: dict[str, object] = {"card": torch.cuda.get_device_name(), "gpus": torch.cuda.device_count(),
                              "torch": torch.__version__, "new_tokens": n, "prompt_tokens": P,
                              "attention": args.attention, "draft_compile": args.draft_compile,
                              "draft_weights": args.draft_weights, "int8_one_row": args.int8_one_row,
                              "int8_pins": args.int8_pins}
    if args.int8_pins:
        from bench.int8_pins import load_pins
        load_pins(args.int8_pins)
    bw = copy_bandwidth()
    target_hf, draft_hf = random_llama("8b"), random_llama("1b")
    wt, wd = weight_bytes(target_hf), weight_bytes(draft_hf)
    res.update(bandwidth_TBs=bw / 1e12, roofline_8b_tok_s=bw / wt, roofline_1b_tok_s=bw / wd)
    prompt = torch.randint(0, 128256, (1, P), device=DEV, generator=torch.Generator("cuda").manual_seed(1))
    if not args.skip_hf:
        res["hf_eager_8b_tok_s"] = hf_generate(target_hf, prompt, args.hf_new_tokens)
        res["hf_assisted_8b_1b_tok_s"] = hf_generate(target_hf, prompt, args.hf_new_tokens, assistant=draft_hf)
    max_len = P + n + 2 * max_k + 24
    draft_kw = (dict(compile_forward=args.draft_compile) if args.draft_compile
                else dict(compile_elementwise=True, int8_one_row=args.int8_one_row))
    ft = FastLlama(target_hf, max_len=max_len, compile_elementwise=True, attention=args.attention)
    for w in range(1, max_k + 2):
        ft.capture(w)
    t_ver = {w: step_time(ft, w) for w in range(1, max_k + 2)}
    plain_loop = GreedyLoop(ft)
    reference: list[int] = []
    plain_generate(plain_loop, prompt, 32)
    plain_tok_s = (n + 2 * max_k + 16) / timed(lambda: reference.extend(plain_generate(plain_loop, prompt, n + 2 * max_k + 16)))
    ref = torch.zeros(max_len, dtype=torch.long)
    ref[P: P + len(reference)] = torch.tensor(reference)
    decode_tok_s = decode_only(plain_loop, prompt, n)
    res.update(t_decode_8b_ms=t_ver[1] * 1e3, t_verify_8b_ms={w: t * 1e3 for w, t in t_ver.items()},
               ours_plain_8b_tok_s=plain_tok_s, ours_plain_fraction_of_roofline=plain_tok_s / (bw / wt),
               ours_plain_decode_only_tok_s=decode_tok_s, ours_plain_decode_only_fraction_of_roofline=decode_tok_s / (bw / wt),
               plain_over_hf_eager=plain_tok_s / res.get("hf_eager_8b_tok_s", float("nan")))
    print(f"[{time.perf_counter() - t0:.0f}s] plain 8B {plain_tok_s:.1f} tok/s with the prefill "
          f"({plain_tok_s / (bw / wt):.1%} of roofline), decode alone {decode_tok_s:.1f} tok/s "
          f"({decode_tok_s / (bw / wt):.1%}), graph step {t_ver[1] * 1e3:.3f} ms", flush=True)

    draft_hf_1 = random_llama("1b", "cuda:1") if two_gpus else None

    def draft_loop(device: str, weights: str) -> GreedyLoop:
        """The draft's loop on `device`, proposing at alpha 1 until reseeded for each alpha."""
        fd = FastLlama(draft_hf if device == "cuda:0" else draft_hf_1, max_len=max_len, attention=args.attention,
                       weights=weights, **draft_kw)
        return GreedyLoop(fd, ControlledAcceptance(ref.to(device), 1.0, vocab=128256, seed=7))
    alphas = [float(a) for a in args.alphas.split(",")]
    modes = [("sequential", "cuda:0", False)] + ([("overlapped", "cuda:1", True)] if two_gpus else [])
    rows = []
    for (mode, device, overlap), weights in [(m, w) for w in args.draft_weights.split(",") for m in modes]:
        probe = draft_loop(device, weights)
        t_draft = loop_step_time(probe)
        res[f"t_draft_1b_ms_{mode}_{weights}"] = t_draft * 1e3
        res[f"draft_over_target_{mode}_{weights}"] = t_draft / t_ver[1]
        res[f"t_draft_pair_extra_ms_{mode}_{weights}"] = pair_step_extra(probe) * 1e3
        print(f"[{time.perf_counter() - t0:.0f}s] {mode}, {weights} draft: loop step {t_draft * 1e3:.3f} ms "
              f"({t_draft / t_ver[1]:.3f} of a target step; a 2-token step costs "
              f"{res[f't_draft_pair_extra_ms_{mode}_{weights}']:.3f} ms more); target pass ms by width "
              f"{ {w: round(t * 1e3, 3) for w, t in t_ver.items()} }", flush=True)
        for alpha in alphas:
            k, L, pred = best_k(alpha, overlap, t_draft, t_ver, max_k)
            # sequential: the host-verdict loop, then the same passes as one graph each
            runs = [(mode, run_spec)] + ([] if overlap else [("sequential-graph", run_pass_graph)])
            for name, run in runs:
                probe.propose.reseed(alpha, seed=7)
                r = run(ft, probe, prompt, n, k, L)
                identical = r.pop("tokens") == reference[:n]
                pred_at_measured = predicted_tokens_per_second(r["per_token_acceptance"], k, L, t_draft, t_ver)
                rows.append({"mode": name, "draft_weights": weights, "alpha": alpha, **r, "identical_to_plain": identical,
                             "speedup_vs_plain": r["tok_s"] / plain_tok_s, "predicted_speedup": pred * t_ver[1],
                             "predicted_speedup_at_measured_alpha": pred_at_measured * t_ver[1],
                             "achieved_over_predicted": r["tok_s"] / plain_tok_s / (pred_at_measured * t_ver[1])})
                print(f"[{time.perf_counter() - t0:.0f}s] {json.dumps(rows[-1])}", flush=True)
        del probe
        torch.cuda.empty_cache()
    res["speculative"] = rows
    if two_gpus:
        for seq_mode in ("sequential", "sequential-graph"):
            seq = {(r["draft_weights"], r["alpha"]): r["tok_s"] for r in rows if r["mode"] == seq_mode}
            res[f"overlapped_over_{seq_mode}"] = {f"{r['draft_weights']} {r['alpha']}": r["tok_s"] / seq[r["draft_weights"], r["alpha"]]
                                                 for r in rows if r["mode"] == "overlapped"}
        res["exchange_ms_cuda1_to_cuda0"] = exchange_time(torch.device("cuda:1"), torch.device("cuda:0"), max_k) * 1e3
    res["exchange_ms_same_gpu"] = exchange_time(torch.device("cuda:0"), torch.device("cuda:0"), max_k) * 1e3
    if not args.skip_embedded:
        res["embedded_pair"] = embedded_pair(n)
    res["wall_s"] = time.perf_counter() - t0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))
    print(f"\n{res['card']} x{res['gpus']}, {n} new tokens after a {P}-token prompt, batch 1, greedy")
    print(f"{'config':80} {'tok/s':>8} {'vs ours plain':>13}")
    line = lambda name, v: print(f"{name:80} {v:8.1f} {v / plain_tok_s:13.2f}")  # noqa: E731
    line("roofline 8B (weights / copy bandwidth)", bw / wt)
    if "hf_eager_8b_tok_s" in res:
        line("HF transformers eager, 8B", res["hf_eager_8b_tok_s"])
        line("HF assisted generation 8B+1B (natural α≈0)", res["hf_assisted_8b_1b_tok_s"])
    line("ours plain 8B (static cache + CUDA graph; incl. prefill)", plain_tok_s)
    line("ours plain 8B, decode steps alone", decode_tok_s)
    for r in rows:
        line(f"ours {r['mode']} {r['draft_weights']} draft α={r['alpha']} k={r['k']} L={r['overlap_steps']} (α̂={r['per_token_acceptance']:.2f}, "
             f"{r['achieved_over_predicted']:.2f} of pred.)", r["tok_s"])


if __name__ == "__main__":
    main()
