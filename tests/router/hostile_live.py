"""The live router of the hostile-input tests: the real app over real HTTP in front of a real node runtime whose
engine is a fake (tests/node_helpers.py). Used by test_router_hostile.py and test_router_hostile_node.py;
`live_router` (the app served on its own thread) by test_kv_index.py too."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from benchmarks.prom_text import metric as prom_metric
from tests.cluster_helpers import wait_until as cluster_wait_until
from tests.node_helpers import FakeNode

MODEL = "smollm2-135m"
C = "/v1/completions"
CHAT = "/v1/chat/completions"
NODE = "fake-0"


@dataclass
class Live:
    url: str
    app: Any
    loop: asyncio.AbstractEventLoop
    node: FakeNode

    def run(self, coro: Any, timeout: float = 30.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)


def wait_until(what: str, condition: Callable[[], bool], timeout: float = 30.0) -> None:
    cluster_wait_until(what, condition, timeout, poll_s=0.02)  # in-process: poll fast


@contextmanager
def live_router(config: Any) -> Iterator[tuple[Any, asyncio.AbstractEventLoop]]:
    """The router app for `config` (a RouterConfig) served by uvicorn on a thread, started: (app, its event loop)."""
    import uvicorn

    from engine.model_source import resolve_model_dir
    from engine.tokenizer import Tokenizer
    from router.app import create_app

    app = create_app(config, Tokenizer(resolve_model_dir(config.model)))
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=config.port, loop="asyncio", log_level="warning")
    )
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_until_complete, args=(server.serve(),), daemon=True)
    thread.start()
    try:
        wait_until("the router to start", lambda: server.started)
        yield app, loop
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.fixture(scope="module")
def live() -> Iterator[Live]:
    from launch.ports import free_port
    from router.config import RouterConfig

    config = RouterConfig(port=free_port(), node_timeout_s=5.0)
    with live_router(config) as (app, loop):
        url = f"http://127.0.0.1:{config.port}"
        node = FakeNode(app.state.nodes_address, NODE).start()
        try:
            wait_until("the node to register", lambda: httpx.get(url + "/health").status_code == 200)
            yield Live(url, app, loop, node)
        finally:
            node.stop()


def complete(live: Live, **body: Any) -> httpx.Response:
    return httpx.post(live.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", **body}, timeout=60)


def metric(live: Live, metric_name: str, **labels: str) -> float:
    return prom_metric(live.url, metric_name, **labels)


def assert_served(live: Live) -> None:
    r = complete(live, max_tokens=3)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3
