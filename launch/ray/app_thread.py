"""`AppThread`: an ASGI app served by uvicorn on its own thread and event loop inside a Ray actor's process (the
routers' actors: launch/ray/actors.py, launch/ray/vllm_actors.py), so the actor's methods stay callable while it
serves."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class AppThread:
    def __init__(self, app: Any, host: str, port: int, startup_timeout_s: float) -> None:
        import uvicorn

        self._server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False))
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._serve, name="ucm-router", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + startup_timeout_s
        while not self._server.started:  # uvicorn offers no event to wait on
            if not self._thread.is_alive():
                raise RuntimeError(f"the router did not start on {host}:{port} (port in use?)")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the router did not start within {startup_timeout_s:.0f}s")
            time.sleep(0.05)
        bound = self._server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://{host}:{bound}"

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self._server.serve())

    def on_loop(self, fn: Callable[[], T], timeout_s: float = 10.0) -> T:
        """Run `fn` on the app's event loop (what the app's state may only be touched from)."""

        async def call() -> T:
            return fn()

        return asyncio.run_coroutine_threadsafe(call(), self.loop).result(timeout_s)

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=15)
