"""Start the real application on a local Ray (CPU) for HTTP tests.

`deployed(port, overrides)` deploys configs/local.yaml's AppConfig with deep-merged overrides on
a free loopback port and yields its base URL; the app is deleted when the block ends, so modules
can deploy different shapes. Ray is started once per test session.

`app_url` is the unchanged configs/local.yaml application. Its modules only read from it, so one
deployment serves all of them: they run first (`pytest_collection_modifyitems`), and the shared
app is deleted before any other shape is deployed under the same name and route.
"""

from __future__ import annotations

import time
from contextlib import ExitStack, contextmanager
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
    _shared.close()
    serve.shutdown()
    ray.shutdown()


class _SharedApp:
    """The default application, deployed once and kept until another shape needs its route."""

    def __init__(self) -> None:
        self._stack = ExitStack()  # holds the open deployed() block
        self.base: str | None = None

    def url(self, port: int) -> str:
        if self.base is None:
            self.base = self._stack.enter_context(deployed(port))
        return self.base

    def close(self) -> None:
        self.base = None
        self._stack.close()


_shared = _SharedApp()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Within tests/serve, the tests on the shared default app run first (a stable sort in the serve
    tests' own slots: everything else keeps its place and order)."""
    slots = [i for i, item in enumerate(items) if item.nodeid.startswith("tests/serve/")]
    serve_items = sorted((items[i] for i in slots), key=lambda item: "app_url" not in item.fixturenames)
    for i, item in zip(slots, serve_items):
        items[i] = item


@contextmanager
def deployed(port: int, overrides: dict | None = None, name: str = "specserve") -> Iterator[str]:
    from ray import serve

    if _shared.base is not None:
        _shared.close()  # one route, one app: the shared default gives way

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
def app_url(ray_cluster: int) -> str:
    """The default local application (configs/local.yaml), shared by the modules that use it."""
    return _shared.url(ray_cluster)
