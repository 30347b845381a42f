"""`specserve generate`: one generation in-process, no Ray."""

from __future__ import annotations

import argparse
import json
import sys

from pydantic import ValidationError

from app.config import load_engine_config
from app.engine.generate import build_engine, generate
from app.protocol.sampling_params import SamplingParams


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specserve")
    sub = parser.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="run one generation in-process")
    g.add_argument("--config", required=True, help="engine, app or Serve config YAML")
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--speculation", choices=["on", "off"], default="on")
    g.add_argument("--num-speculative-tokens", type=int, default=None)
    g.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    try:
        config = load_engine_config(args.config)
        sampling = SamplingParams(
            temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
            max_tokens=args.max_tokens, seed=args.seed, stop=tuple(args.stop),
        )
    except (ValidationError, ValueError, OSError) as e:
        print(f"specserve: {e}", file=sys.stderr)
        return 2
    k = args.num_speculative_tokens
    max_k = config.speculation.max_speculative_tokens
    if k is not None and not 0 <= k <= max_k:
        print(f"specserve: --num-speculative-tokens {k} is outside 0..{max_k} "
              f"(speculation.max_speculative_tokens in {args.config})", file=sys.stderr)
        return 2
    if k is None:
        k = config.speculation.num_speculative_tokens
    speculate = args.speculation == "on" and k > 0  # an explicit 0 means plain decoding
    k = k if speculate else 0
    engine = build_engine(config, speculate=speculate)
    prompt_ids = engine.runner.tokenizer(args.prompt, add_special_tokens=False)["input_ids"]
    result = generate(engine, prompt_ids, sampling, k)
    if args.json:
        print(json.dumps(result.as_dict()))
    else:
        print(args.prompt + result.text)
        rate = f"{result.acceptance_rate:.2f}" if result.acceptance_rate is not None else "n/a"
        print(
            f"\n[{len(result.token_ids)} tokens in {result.elapsed_s:.2f}s; drafted {result.drafted_tokens}, "
            f"accepted {result.accepted_tokens} (rate {rate}); finish: {result.finish_reason}]",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
