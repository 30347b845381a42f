"""Start the real application on a local Ray (CPU) for HTTP tests.

`serve_app(overrides)` deploys configs/local.yaml's AppConfig with deep-merged overrides on
a free loopback port and yields its base URL. Ray is started once per test session;
each app is deleted at the end of its fixture so modules can deploy different shapes.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Any, Iterator

import httpx
import pytest

from app.config import load_yaml, serve_config_args
from bench.app_process import free_port, merged  # one copy of each, shared with the benches

# the application configs/local.yaml deploys: its args with its Serve-shaped `deployments:` folded in
LOCAL_ARGS: dict[str, Any] = serve_config_args(load_yaml("configs/local.yaml")["applications"][0])


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[int]:
    """A local Ray with Serve's HTTP proxy on a free loopback port; yields the port."""
    import ray
    from ray import serve

    port = free_port()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield port
    serve.shutdown()
    ray.shutdown()


@contextmanager
def deployed(port: int, overrides: dict | None = None, name: str = "specserve") -> Iterator[str]:
    from ray import serve

    from deployments.builder import build_app

    args = merged(LOCAL_ARGS, overrides or {})
    serve.run(build_app(args), name=name, route_prefix="/", blocking=False)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while True:
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError("application did not become healthy in 180 s")
        time.sleep(0.5)
    try:
        yield base
    finally:
        serve.delete(name)


@pytest.fixture(scope="module")
def app_url(ray_cluster: int) -> Iterator[str]:
    """The default local application (configs/local.yaml) for a test module."""
    with deployed(ray_cluster) as base:
        yield base
