"""The served engine through HTTP: the whole Serve application on one GPU, against the in-process fast path.

    source .gpu-carry/unpack-ray && python3 -m bench.serve_gpu [--out DIR]
    python3 -m bench.serve_gpu --shape tiny --device cpu        # a smoke run of the same code on a CPU

Llama-3.1-8B / Llama-3.2-1B shaped checkpoints with the real Llama-3 vocabulary (128,256) are
written as directories (config and a word-level tokenizer whose tokens are "t<id>"; weights are
random, built on the GPU at load: `random_weights`), and the Serve application (router, target and
draft replicas sharing the card) is deployed on 127.0.0.1. Clients send 128-token prompts for
128-token greedy completions through HTTP:

- plain decoding at 1, 8 and 32 concurrent streams, streaming and non-streaming: output tok/s,
  time to first token, inter-token latency (streaming) or end-to-end latency (non-streaming);
- speculative decoding at controlled acceptance alpha 0.7 and 0.9, 1 and 8 streams: random weights
  agree on nothing, so the draft replica runs the real draft model every step (its cost is real)
  and then proposes the target's greedy continuation (recorded from the plain run) with
  probability alpha per token (app/proposers/oracle.py ReferenceProposer); at 1 stream also with
  the draft called only when a step needs proposals, for the ratio of calls sent one step ahead
  (app/engine/draft_ahead.py);
- the exchange's share of a speculative pass, as the target replica measures it;
- the in-process fast path's plain figure (bench.gpu's loop: one graph replay per token) in the
  same run, for the ratio.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import random
import shutil
import signal
import statistics
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

VOCAB = 128256
EOS = 128001
SHAPES = {
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, tie_word_embeddings=False),
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, tie_word_embeddings=True),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, tie_word_embeddings=True),
}


def write_checkpoint(path: Path, shape: str, vocab: int) -> Path:
    """A checkpoint directory without weights: config.json, generation_config.json and a tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import GenerationConfig, LlamaConfig, PreTrainedTokenizerFast

    path.mkdir(parents=True, exist_ok=True)
    # a special token matches inside words too: "t1" as EOS would split "t1004" in two, so a smaller
    # vocabulary takes its last id, which no prompt uses and no other word starts with
    eos = EOS if EOS < vocab else vocab - 1
    LlamaConfig(vocab_size=vocab, max_position_embeddings=131072, rope_theta=500000.0, bos_token_id=None,
                eos_token_id=eos, pad_token_id=0,
                rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 8192},
                **SHAPES[shape]).save_pretrained(path)
    GenerationConfig(eos_token_id=eos, pad_token_id=0).save_pretrained(path)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=f"t{eos}", pad_token="t0",
                            unk_token="t0").save_pretrained(path)
    return path


def app_args(target: Path, draft: Path, device: str, max_k: int, draft_quantization: str) -> dict:
    gpu = device == "cuda"
    dtype = "bfloat16" if gpu else "float32"
    return {
        "model_name": "bench",
        "engine": {
            "target": {"path": str(target), "dtype": dtype, "device": device, "max_context": 1024, "random_weights": True},
            "draft": {"path": str(draft), "dtype": dtype, "device": device, "max_context": 1024, "random_weights": True,
                      "quantization": draft_quantization},
            "speculation": {"proposer": "draft_model", "num_speculative_tokens": min(4, max_k), "max_speculative_tokens": max_k},
            "limits": {"max_num_seqs": 32, "max_cached_tokens": 32 * 1024, "max_queue": 64, "request_timeout_s": 300},
        },
        "target_deployment": {"num_replicas": 1, "num_cpus": 1 if gpu else 0.5, "num_gpus": 0.5 if gpu else 0},
        "draft_deployment": {"num_replicas": 1, "num_cpus": 1 if gpu else 0.5, "num_gpus": 0.4 if gpu else 0},
        "router_deployment": {"num_replicas": 1, "num_cpus": 1 if gpu else 0.5, "max_ongoing_requests": 512},
        "policy": {"mode_arbiter": {"enabled": False}},
    }


# ---- the clients --------------------------------------------------------------------------
@dataclass
class Result:
    tokens: list[int]
    start: float
    first: float | None  # first content chunk (streaming)
    end: float
    gaps: list[float] = field(default_factory=list)  # streaming: seconds per token between chunks
    drafted: int = 0  # non-streaming: usage.speculation
    accepted: int = 0


def complete(port: int, prompt: str, max_tokens: int, stream: bool, mode: str, k: int | None) -> Result:
    body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": stream, "speculation": mode}
    if k:
        body["num_speculative_tokens"] = k
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    start = time.perf_counter()
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:300]!r}")
    tokens: list[int] = []
    first, gaps, last = None, [], start
    drafted = accepted = 0
    if not stream:
        answer = json.loads(resp.read())
        tokens = [int(t[1:]) for t in answer["choices"][0]["text"].split()]
        spec = (answer.get("usage") or {}).get("speculation") or {}
        drafted, accepted = spec.get("drafted_tokens") or 0, spec.get("accepted_tokens") or 0
    else:
        while True:
            line = resp.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            choices = chunk.get("choices") or []
            text = choices[0].get("text", "") if choices else ""
            new = [int(t[1:]) for t in text.split()]
            if not new:
                continue
            now = time.perf_counter()
            if first is None:
                first = now
            else:
                gaps.extend([(now - last) / len(new)] * len(new))
            last = now
            tokens += new
    conn.close()
    return Result(tokens, start, first, time.perf_counter(), gaps, drafted, accepted)


def run_level(port: int, prompts: list[str], streams: int, per_stream: int, stream: bool, mode: str,
              k: int | None, max_tokens: int) -> tuple[dict, list[Result]]:
    results: list[Result] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def client(i: int) -> None:
        try:
            for j in range(per_stream):
                r = complete(port, prompts[(i * per_stream + j) % len(prompts)], max_tokens, stream, mode, k)
                with lock:
                    results.append(r)
        except BaseException as e:  # noqa: BLE001 — reported below
            errors.append(e)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(streams)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise errors[0]
    tokens = sum(len(r.tokens) for r in results)
    pct = lambda xs, q: statistics.quantiles(xs, n=100)[q - 1] * 1e3 if len(xs) > 1 else (xs[0] * 1e3 if xs else None)  # noqa: E731
    ttft = [r.first - r.start for r in results if r.first is not None]
    gaps = [g for r in results for g in r.gaps]
    e2e = [r.end - r.start for r in results]
    row = {"streams": streams, "stream": stream, "mode": mode, "k": k, "requests": len(results),
           "tok_s": tokens / wall, "e2e_p50_ms": pct(e2e, 50), "e2e_p99_ms": pct(e2e, 99),
           "ttft_p50_ms": pct(ttft, 50), "ttft_p99_ms": pct(ttft, 99),
           "itl_p50_ms": pct(gaps, 50), "itl_p99_ms": pct(gaps, 99)}
    return row, results


@contextlib.contextmanager
def spying(folder: Path | None, tag: str) -> Iterator[None]:
    """With a folder: py-spy samples every Serve process (replicas and the HTTP proxy) while the block
    runs, one collapsed-stack file per process (`<tag>-<process>.txt`, py-spy's raw format: where a
    replica's threads spend their time at that level; `python -m bench.spy_report DIR` reads them).
    Needs the py-spy binary on PATH."""
    if folder is None:
        yield
        return
    spy = shutil.which("py-spy")
    if spy is None:
        raise SystemExit("--spy needs py-spy on PATH (pip install py-spy)")
    folder.mkdir(parents=True, exist_ok=True)
    ps = subprocess.run(["ps", "-eo", "pid=,args="], capture_output=True, text=True, check=True).stdout
    procs = []
    for line in ps.splitlines():
        pid, _, cmd = line.strip().partition(" ")
        if "ServeReplica:" in cmd or "ProxyActor" in cmd:
            name = cmd.split()[0].split(":")[-1].replace("ray::", "")
            out = folder / f"{tag}-{name}-{pid}.txt"
            # idle samples too: a thread's samples are its wall time, waits on the GPU or a socket included
            procs.append(subprocess.Popen([spy, "record", "--pid", pid, "--format", "raw", "--rate", "200",
                                           "--threads", "--idle", "--full-filenames", "--nonblocking",
                                           "--output", str(out)],
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    time.sleep(0.5)  # attached before the level starts
    try:
        yield
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
        for proc in procs:
            proc.wait(timeout=30)


def pass_share(parts: dict, key: str) -> float:
    """A part's share of the speculative passes in a TargetServer.pass_report (`draft_s`, `exchange_s`)."""
    return parts[key] / max(parts["pass_s"], 1e-9)


def step_breakdown(steps: dict) -> dict:
    """The target replica's engine steps of a level: mean batch and milliseconds per step by phase."""
    n = max(steps["steps"], 1)
    return {"steps": steps["steps"], "mean_batch": steps["batch"] / n,
            **{k.replace("_s", "_ms"): v / n * 1e3 for k, v in steps.items() if k.endswith("_s")}}


# ---- the in-process fast path -------------------------------------------------------------
def in_process_plain(prompt_tokens: int, new_tokens: int) -> dict:
    """bench.gpu's plain figure: an 8B FastLlama greedy loop, one graph replay per token, prefill included."""
    import torch

    from bench.inproc.fast_decode import GreedyLoop, plain_generate
    from app.runners.lean_llama import FastLlama
    from bench.gpu import copy_bandwidth, random_llama, timed, weight_bytes

    bw = copy_bandwidth()
    hf = random_llama("8b")
    roofline = bw / weight_bytes(hf)
    fast = FastLlama(hf, max_len=prompt_tokens + new_tokens + 64, compile_elementwise=True)
    fast.capture(1)
    loop = GreedyLoop(fast)
    prompt = torch.randint(0, VOCAB, (1, prompt_tokens), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    plain_generate(loop, prompt, 16)
    tok_s = new_tokens / timed(lambda: plain_generate(loop, prompt, new_tokens))
    del loop, fast, hf
    torch.cuda.empty_cache()
    return {"in_process_plain_tok_s": tok_s, "roofline_tok_s": roofline, "card": torch.cuda.get_device_name()}


def markdown(res: dict) -> str:
    """The run as the tables of bench/RESULTS.md."""
    f = lambda v, d=1: "-" if v is None else f"{v:.{d}f}"  # noqa: E731
    lines = ["| streams | mode | tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms | e2e p50 / p99 ms | engine step ms |",
             "|---:|---|---:|---:|---:|---:|---:|"]
    for r in res["plain"]:
        lines.append(f"| {r['streams']} | plain, {'streaming' if r['stream'] else 'non-streaming'} | {f(r['tok_s'])} | "
                     f"{f(r['ttft_p50_ms'])} / {f(r['ttft_p99_ms'])} | {f(r['itl_p50_ms'])} / {f(r['itl_p99_ms'])} | "
                     f"{f(r['e2e_p50_ms'], 0)} / {f(r['e2e_p99_ms'], 0)} | {f(r['engine_steps']['step_ms'], 2)} |")
    lines += ["", "| α | k | streams | tok/s | × plain | acceptance | tokens / step | step ms | draft share | exchange share "
              "| × calls on demand (their exchange share) |",
              "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in res["speculative"]:
        on_demand = r.get("on_demand_exchange_share")
        on_demand_text = "" if on_demand is None else f" ({on_demand * 100:.2f} %)"
        lines.append(f"| {r['alpha']} | {r['k']} | {r['streams']} | {f(r['tok_s'])} | {f(r['over_plain'], 2)} | "
                     f"{f(r['acceptance'], 2)} | {f(r['tokens_per_pass'], 2)} | {f(r['pass_ms'], 2)} | "
                     f"{f(r['draft_share'] * 100)} % | {f(r['exchange_share'] * 100, 2)} % | "
                     f"{f(r.get('ahead_over_on_demand'), 2)}{on_demand_text} |")
    return "\n".join(lines)


# ---- the run ------------------------------------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=["8b", "tiny"], default="8b", help="tiny: a smoke run on the CPU")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--draft-quantization", choices=["none", "int8"], default="int8")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--streams", default="1,8,32", help="plain levels")
    parser.add_argument("--spec-streams", default="1,8")
    parser.add_argument("--alphas", default="0.7,0.9")
    parser.add_argument("--k", default="0.7:4,0.9:8", help="draft length per alpha")
    parser.add_argument("--out", type=Path, default=Path("bench/out/serve_gpu.json"))
    parser.add_argument("--skip-in-process", action="store_true",
                        help="served figures only (no ratio to the in-process fast path; ~50 s less)")
    parser.add_argument("--spy", type=Path, default=None,
                        help="a folder: py-spy samples the Serve processes during the --spy-levels' runs")
    parser.add_argument("--spy-levels", default="1,32", help="stream counts to sample with --spy")
    parser.add_argument("--logs", type=Path, default=None, help="a folder: copy Ray's Serve logs there at the end")
    parser.add_argument("--port", type=int, default=8000, help="the HTTP proxy's port on 127.0.0.1")
    args = parser.parse_args()
    spy_levels = {int(s) for s in args.spy_levels.split(",") if s}
    t_start = time.perf_counter()
    res: dict = {"command": "python3 -m bench.serve_gpu", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    if args.device == "cuda" and not args.skip_in_process:
        res.update(in_process_plain(args.prompt_tokens, args.max_tokens))
        print(f"[{time.perf_counter() - t_start:.0f}s] in-process plain {res['in_process_plain_tok_s']:.1f} tok/s "
              f"(roofline {res['roofline_tok_s']:.1f})", flush=True)

    import ray
    from ray import serve

    from deployments.builder import build_app

    root = Path(tempfile.mkdtemp(prefix="serve-gpu-"))
    vocab = VOCAB if args.shape == "8b" else 1024
    target = write_checkpoint(root / "target", "8b" if args.shape == "8b" else "tiny", vocab)
    draft = write_checkpoint(root / "draft", "1b" if args.shape == "8b" else "tiny", vocab)
    ks = {float(a): int(k) for a, k in (x.split(":") for x in args.k.split(","))}
    config = app_args(target, draft, args.device, max(ks.values()), args.draft_quantization)
    # a Ray of its own ("local"), never one already running on the host
    ray.init(address="local", include_dashboard=False, log_to_driver=False, num_gpus=1 if args.device == "cuda" else 0)
    port = args.port
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(config), name="specserve", route_prefix="/")
    print(f"[{time.perf_counter() - t_start:.0f}s] deployed", flush=True)
    draft_handle = serve.get_deployment_handle("DraftServer", app_name="specserve")
    target_handle = serve.get_deployment_handle("TargetServer", app_name="specserve")

    rng = random.Random(0)
    prompts_ids = [[rng.randrange(vocab // 64, vocab - vocab // 64) for _ in range(args.prompt_tokens)] for _ in range(64)]
    prompts = [" ".join(f"t{i}" for i in p) for p in prompts_ids]
    # warm-up: every path once, and the draft's chain graphs (captured on first use per batch bucket and k)
    run_level(port, prompts, 2, 1, True, "off", None, 16)
    spec_levels = sorted({int(x) for x in args.spec_streams.split(",")})
    for streams in spec_levels:
        for k in sorted(set(ks.values())):
            run_level(port, prompts, streams, 1, False, "on", k, 3 * k)
    rows: list[dict] = []
    outputs: dict[str, list[int]] = {}
    levels = [int(s) for s in args.streams.split(",")]
    for streams in levels:
        for stream in (False, True):
            per_stream = max(2, 8 // streams) if streams < 32 else 2
            target_handle.pass_report.remote().result()
            with spying(args.spy if streams in spy_levels else None, f"plain{streams}{'-stream' if stream else ''}"):
                row, results = run_level(port, prompts, streams, per_stream, stream, "off", None, args.max_tokens)
            row["engine_steps"] = step_breakdown(target_handle.pass_report.remote().result()["steps"])
            rows.append(row)
            print(json.dumps(row), flush=True)
    # the references: every prompt's greedy continuation (plain, non-streaming). The first eight one at
    # a time (the identity check below compares one-stream runs: a batch's numerics may break a near-tie
    # differently), the rest eight at a time
    for p in prompts[:8]:
        outputs[p] = complete(port, p, args.max_tokens, False, "off", None).tokens
    with ThreadPoolExecutor(8) as pool:
        rest = prompts[8:]
        for p, result in zip(rest, pool.map(lambda q: complete(port, q, args.max_tokens, False, "off", None), rest)):
            outputs[p] = result.tokens
    references = [ids + outputs[p] for p, ids in zip(prompts, prompts_ids)]
    plain = {(r["streams"], r["stream"]): r["tok_s"] for r in rows}
    spec_rows = []
    for alpha in (float(a) for a in args.alphas.split(",")):
        draft_handle.set_references.remote(references, alpha).result()
        for streams in spec_levels:
            target_handle.pass_report.remote().result()
            per_stream = max(2, 8 // streams)
            with spying(args.spy if streams in spy_levels else None, f"spec{alpha}-{streams}"):
                row, results = run_level(port, prompts, streams, per_stream, False, "on", ks[alpha], args.max_tokens)
            parts = target_handle.pass_report.remote().result()
            row["engine_steps"] = step_breakdown(parts["steps"])
            row.update(alpha=alpha, exchange_share=pass_share(parts, "exchange_s"),
                       draft_share=pass_share(parts, "draft_s"),
                       pass_ms=parts["pass_s"] / max(parts["passes"], 1) * 1e3, passes=parts["passes"],
                       tokens_per_pass=sum(len(r.tokens) for r in results) / max(parts["passes"], 1),
                       acceptance=sum(r.accepted for r in results) / max(1, sum(r.drafted for r in results)),
                       over_plain=row["tok_s"] / plain.get((streams, False), float("nan")))
            spec_rows.append(row)
            print(json.dumps(row), flush=True)
        # the same level with each step calling the draft only when it needs proposals (no call ahead)
        first = spec_levels[0]
        target_handle.set_draft_ahead.remote(False).result()
        target_handle.pass_report.remote().result()
        row, _ = run_level(port, prompts, first, max(2, 8 // first), False, "on", ks[alpha], args.max_tokens)
        parts = target_handle.pass_report.remote().result()
        target_handle.set_draft_ahead.remote(True).result()
        ahead = next(r for r in spec_rows if r["alpha"] == alpha and r["streams"] == first)
        ahead["on_demand_tok_s"] = row["tok_s"]
        ahead["ahead_over_on_demand"] = ahead["tok_s"] / row["tok_s"]
        # a call made on the engine's thread: its hop has no wait for the GIL behind the engine's host
        # work, which a call sent ahead (on its helper thread) counts in its exchange
        ahead["on_demand_exchange_share"] = pass_share(parts, "exchange_s")
        print(json.dumps({"alpha": alpha, "streams": first, "on_demand_tok_s": row["tok_s"],
                          "ahead_over_on_demand": ahead["ahead_over_on_demand"]}), flush=True)
    # outputs under speculation equal plain greedy's (same prompt, same tokens)
    draft_handle.set_references.remote(references, 0.7).result()
    mismatched = [p for p in prompts[:8] if complete(port, p, args.max_tokens, False, "on", 4).tokens != outputs[p]]
    # the step costs the replicas measured at start-up (ms per target pass and per draft step)
    start_profile = target_handle.policy_state.remote().result()["start_profile"]
    print("start-up profile:", json.dumps(start_profile), flush=True)
    res.update(plain=rows, speculative=spec_rows, spec_outputs_identical=not mismatched,
               start_profile=start_profile, wall_s=time.perf_counter() - t_start)
    if "in_process_plain_tok_s" in res:
        base = res["in_process_plain_tok_s"]
        res["served_plain_1_over_in_process"] = plain[(1, False)] / base
        res["served_plain_1_fraction_of_roofline"] = plain[(1, False)] / res["roofline_tok_s"]
    if (32, False) in plain:
        res["plain_32_over_1"] = plain[(32, False)] / plain[(1, False)]
        res["plain_32_streaming_over_non"] = plain[(32, True)] / plain[(32, False)]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1))
    print(json.dumps({k: v for k, v in res.items() if k not in ("plain", "speculative")}, indent=1))
    print(markdown(res))
    if args.logs is not None:
        shutil.copytree("/tmp/ray/session_latest/logs/serve", args.logs, dirs_exist_ok=True)
    serve.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main()
