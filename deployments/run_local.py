"""`make run`: start a local Ray, deploy a Serve config, wait until healthy, print how to call it."""

from __future__ import annotations

import argparse
import signal
import sys
import time
import urllib.request

import ray
from ray import serve

from deployments.builder import build_app, parse_args

CURL = """curl -s http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
  -d '{"model": "%s", "prompt": "def read_config(path):\\n", "max_tokens": 48, "temperature": 0}'"""


def wait_healthy(url: str, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} not healthy after {timeout_s:.0f}s")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="configs/local.yaml")
    parser.add_argument("--detach", action="store_true", help="return once healthy, leave it running")
    args = parser.parse_args()
    config = parse_args({"config": args.config})
    ray.init(include_dashboard=False, num_cpus=2, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": 8000})
    serve.run(build_app(config.model_dump(mode="json")), name="specserve", route_prefix="/", blocking=False)
    wait_healthy("http://127.0.0.1:8000/health")
    print("\nspecserve is up: http://127.0.0.1:8000  (playground: http://127.0.0.1:8000/)")
    print("try:\n" + CURL % config.model_name + "\n")
    if args.detach:
        return
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()
