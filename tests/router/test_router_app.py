"""The router process alone (no nodes): torch-free, OpenAI-style errors, 503 without decode nodes."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import json, sys, threading, time
    import httpx, uvicorn
    from engine.tokenizer import Tokenizer
    from router.app import create_app
    from engine.model_source import resolve_model_dir
    from launch.ports import free_port
    from router.config import RouterConfig

    port = free_port()
    cfg = RouterConfig(port=port, api_key="k")
    app = create_app(cfg, Tokenizer(resolve_model_dir(cfg.model)))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, loop="asyncio", log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    c = httpx.Client(base_url=f"http://127.0.0.1:{port}", headers={"Authorization": "Bearer k"})
    deadline = time.monotonic() + 120  # a generous bound: only a server that never starts reaches it
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the router did not start"
        time.sleep(0.05)
    good = {"model": "smollm2-135m", "prompt": "hi", "max_tokens": 4}
    out = {
        "health": c.get("/health").status_code,
        "models": c.get("/v1/models").json()["data"][0]["id"],
        "no_key": httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=good).status_code,
        "bad_json": c.post("/v1/completions", content=b"{x").json(),
        "no_nodes": [c.post("/v1/completions", json=good).status_code,
                     c.post("/v1/chat/completions", json={"model": "smollm2-135m",
                            "messages": [{"role": "user", "content": "hi"}]}).status_code],
        "metrics": "ucm_requests_total" in c.get("/metrics").text,
        "reset": [httpx.post(f"http://127.0.0.1:{port}/reset_prefix_cache").status_code,
                  c.post("/reset_prefix_cache").json(), c.post("/reset_prefix_cache?node=p9").status_code],
        "torch": "torch" in sys.modules,
    }
    server.should_exit = True
    thread.join(10)
    print(json.dumps(out))
""")


def test_router_alone_is_torch_free_and_answers_errors() -> None:
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json

    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["torch"] is False, "the router imported torch"
    assert out["health"] == 503 and out["models"] == "smollm2-135m" and out["no_key"] == 401
    assert out["bad_json"]["error"]["type"] == "invalid_request_error"
    assert set(out["bad_json"]["error"]) == {"message", "type", "param", "code"}
    assert out["no_nodes"] == [503, 503]
    assert out["metrics"]
    assert out["reset"] == [401, {"nodes": []}, 404]  # it changes the nodes' state: keyed; no node, none asked
