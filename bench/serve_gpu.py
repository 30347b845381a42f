"""One end-to-end figure through HTTP with the Serve application on a GPU host.

    source .gpu-carry/unpack-ray && python3 -m bench.serve_gpu

Deploys the embedded pair with draft and target replicas on GPU actors (fractions of one
GPU), sends sequential greedy completions with speculation off and on through the HTTP
proxy on 127.0.0.1, and reports output tokens/s for each and the speculation usage.
"""

from __future__ import annotations

import json
import time
import urllib.request

import ray
from ray import serve

from bench.app_process import GPU_OVERRIDES, local_args
from deployments.builder import build_app

PROMPTS = ["import os\nimport sys\n\n\ndef main(argv):\n", "class Config(object):\n    def __init__(self, path):\n",
           "def read_lines(path):\n    \"\"\"Return the lines of a file.\"\"\"\n"]


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def main() -> None:
    args = local_args(GPU_OVERRIDES)
    ray.init(include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": 8000})
    serve.run(build_app(args), name="specserve", route_prefix="/")
    url = "http://127.0.0.1:8000/v1/completions"
    results = {}
    for mode in ("off", "on", "off", "on"):
        tokens, t0, usage = 0, time.perf_counter(), None
        for p in PROMPTS:
            r = post(url, {"model": "specserve-embedded", "prompt": p, "max_tokens": 128, "temperature": 0,
                           "ignore_eos": True, "speculation": mode, "num_speculative_tokens": 4 if mode == "on" else None})
            tokens += r["usage"]["completion_tokens"]
            usage = r["usage"]["speculation"]
        results[mode] = {"tok_s": tokens / (time.perf_counter() - t0), "last_usage": usage}
    import torch
    results["card"] = torch.cuda.get_device_name()
    results["on_over_off"] = results["on"]["tok_s"] / results["off"]["tok_s"]
    print(json.dumps(results, indent=1))
    serve.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main()
