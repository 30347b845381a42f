"""`make run`: start a local Ray, deploy a Serve config, wait until healthy, print how to call it.

Ray starts the way a cluster's head node does for Prometheus: with its dashboard, whose
process rewrites `<session_dir>/prom_metrics_service_discovery.json` (symlinked from
`/tmp/ray/prom_metrics_service_discovery.json`) every few seconds with the node's metrics
endpoint, so a Prometheus using cluster/prometheus/prometheus.yml finds this host's metrics, and with a
fixed metrics export port (`--metrics-export-port`, 8080 by default as on the cluster manifests).

A Serve config is deployed the way `serve deploy` (and `serve run FILE`) deploy it: through Serve's
controller as a declarative config, so Serve applies its `deployments:` options and a later
`serve deploy` of an edited file onto this Ray updates the application in place.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
import urllib.request

import ray
from ray import serve

from app.config import load_yaml
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


def start_ray(metrics_export_port: int, dashboard_port: int = 8265, num_cpus: int = 2) -> None:
    """The local Ray `make run` serves on: dashboard on (loopback), metrics on a known port."""
    ray.init(include_dashboard=True, dashboard_host="127.0.0.1", dashboard_port=dashboard_port,
             _metrics_export_port=metrics_export_port, num_cpus=num_cpus, log_to_driver=False)


def serve_config_logging(path: str) -> dict | None:
    """The application's `logging_config` in a Serve config file (None for a plain AppConfig file):
    `serve deploy`, and `make run` through deploy_serve_config, apply it with the rest of the file."""
    data = load_yaml(path)
    return data["applications"][0].get("logging_config") if "applications" in data else None


def deploy_serve_config(path: str) -> None:
    """Deploy a Serve config file's applications as `serve deploy` does (the controller's apply_config,
    which `serve run FILE` calls too): `deployments:` applied by Serve, updatable in place."""
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    _get_global_client().deploy_apps(ServeDeploySchema.model_validate(load_yaml(path)))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="configs/local.yaml")
    parser.add_argument("--detach", action="store_true", help="return once healthy, leave it running")
    parser.add_argument("--metrics-export-port", type=int, default=8080,
                        help="Ray's Prometheus endpoint: http://127.0.0.1:PORT/metrics")
    args = parser.parse_args()
    config = parse_args({"config": args.config})
    start_ray(args.metrics_export_port)
    serve.start(http_options={"host": "127.0.0.1", "port": 8000})
    if "applications" in load_yaml(args.config):
        deploy_serve_config(args.config)
    else:  # a bare AppConfig file
        serve.run(build_app(config.model_dump(mode="json")), name="specserve", route_prefix="/", blocking=False)
    wait_healthy("http://127.0.0.1:8000/health")
    print("\nspecserve is up: http://127.0.0.1:8000  (playground: http://127.0.0.1:8000/)")
    print(f"metrics: http://127.0.0.1:{args.metrics_export_port}/metrics  (Prometheus service discovery: "
          "/tmp/ray/prom_metrics_service_discovery.json)")
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
