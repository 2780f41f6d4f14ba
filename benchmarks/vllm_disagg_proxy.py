"""vLLM's own prefill/decode proxy, as a baseline for benchmarks/vllm_pd.py: our equivalent of the toy proxy vLLM
tests its NixlConnector with (vllm-project/vllm, tests/v1/kv_connector/nixl_integration/toy_proxy_server.py; it is
not installed with vLLM, so this is written after reading it, not copied). What it does, and nothing more:

1. the client's request to the next prefill instance (round robin) with `kv_transfer_params` asking for a remote
   decode (`do_remote_decode: true`, the remote fields null), `stream: false`, `max_tokens: 1` (and
   `max_completion_tokens: 1` when set), without `stream_options`, `min_tokens` or `min_completion_tokens`;
2. the `kv_transfer_params` of that response (with NixlConnector: the producer's engine id, host, side-channel port
   and block ids) put into the client's request, which goes unchanged otherwise to the next decode instance (round
   robin); the decode instance pulls the blocks from the producer and its body or stream is relayed byte for byte.

No admission, no retries, no health checks (the toy proxy has none either); an error status from either instance is
relayed as is.

    python -m benchmarks.vllm_disagg_proxy --port 8000 --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200
"""

from __future__ import annotations

import argparse
import itertools
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from router.vllm_proxy import PREFILL_TRANSFER_PARAMS

REPO = Path(__file__).resolve().parents[1]
# What the toy proxy sends a prefill instance ("decode elsewhere", no remote side known yet): what our router sends.
PREFILL_KV_PARAMS = PREFILL_TRANSFER_PARAMS
_PREFILL_DROPS = ("stream_options", "min_tokens", "min_completion_tokens")  # not for a one-token prefill


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill instance's request: one token, not streamed, asking for a remote decode."""
    out = {k: v for k, v in body.items() if k not in _PREFILL_DROPS}
    out.update(kv_transfer_params=dict(PREFILL_KV_PARAMS), stream=False, max_tokens=1)
    if "max_completion_tokens" in body:
        out["max_completion_tokens"] = 1
    return out


def decode_body(body: dict[str, Any], prefill_reply: dict[str, Any]) -> dict[str, Any]:
    """The client's request with the prefill reply's `kv_transfer_params` (where the decode instance finds the KV)."""
    params = prefill_reply.get("kv_transfer_params")
    return {**body, "kv_transfer_params": params} if params else dict(body)


def build_app(prefill_urls: list[str], decode_urls: list[str]) -> FastAPI:
    if not prefill_urls or not decode_urls:
        raise ValueError("at least one prefill and one decode URL")
    clients: dict[str, httpx.AsyncClient] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        for url in {*prefill_urls, *decode_urls}:
            clients[url] = httpx.AsyncClient(base_url=url, timeout=None, limits=limits)
        yield
        for client in clients.values():
            await client.aclose()

    app = FastAPI(lifespan=lifespan)
    next_prefill: Iterator[str] = itertools.cycle(prefill_urls)
    next_decode: Iterator[str] = itertools.cycle(decode_urls)

    async def trip(path: str, request: Request) -> Response:
        body = await request.json()
        headers = {"X-Request-Id": str(uuid.uuid4())}
        prefill = await clients[next(next_prefill)].post(path, json=prefill_body(body), headers=headers)
        if prefill.status_code != 200:
            return Response(prefill.content, prefill.status_code, media_type="application/json")
        decode = clients[next(next_decode)]
        reply = await decode.send(
            decode.build_request("POST", path, json=decode_body(body, prefill.json()), headers=headers), stream=True
        )

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in reply.aiter_raw():
                    yield chunk
            finally:
                await reply.aclose()

        media = reply.headers.get("content-type", "application/json")
        return StreamingResponse(relay(), status_code=reply.status_code, media_type=media)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await trip("/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await trip("/v1/chat/completions", request)

    @app.get("/healthcheck")
    async def healthcheck() -> dict[str, int]:
        return {"prefill_instances": len(prefill_urls), "decode_instances": len(decode_urls)}

    return app


@dataclass
class ExampleProxy:
    """This proxy in its own process (as `ucm-serve router` runs in its own), until /healthcheck answers."""

    port: int
    prefill_urls: list[str]
    decode_urls: list[str]
    log_path: Path
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> ExampleProxy:
        argv = [sys.executable, "-m", "benchmarks.vllm_disagg_proxy", "--port", str(self.port)]
        argv += ["--prefill", *self.prefill_urls, "--decode", *self.decode_urls]
        self.proc = subprocess.Popen(argv, cwd=REPO, stdout=self.log_path.open("w"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the proxy exited ({self.proc.returncode}): {self.log_path.read_text()[-2000:]}")
            try:
                if httpx.get(self.url + "/healthcheck", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.__exit__()
        raise RuntimeError(f"the proxy did not answer within 60 s: {self.log_path.read_text()[-2000:]}")

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(30)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--prefill", nargs="+", required=True, help="prefill instances' base URLs")
    ap.add_argument("--decode", nargs="+", required=True, help="decode instances' base URLs")
    args = ap.parse_args(argv)
    import uvicorn

    uvicorn.run(build_app(args.prefill, args.decode), host=args.host, port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main())
