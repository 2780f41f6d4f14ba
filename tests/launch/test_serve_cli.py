"""`ucm-serve serve MODEL` (vLLM's one-line form, with vLLM's serving flags), `--version`, and a bad `--model` as
one line with exit 2.

One cluster start (`serve` with vLLM's flags), answered through the official `openai` client."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest

from benchmarks.prom_text import node_stats
from launch.child import Child
from launch.ports import free_port
from tests.cluster_helpers import wait_until

openai = pytest.importorskip("openai")
STEP_TOKENS = 32  # `serve --max-num-batched-tokens`


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "launch.cli", *args], capture_output=True, text=True, timeout=120, check=False
    )


def test_version() -> None:
    out = _cli("--version")
    assert out.returncode == 0 and out.stdout.startswith("ucm-serve "), out
    assert out.stdout.split()[1][0].isdigit(), out.stdout


@pytest.mark.parametrize(
    "args",
    [
        ("serve", "smollm2-135n"),  # a typo of the alias
        ("up", "--model", "/no/such/model.gguf"),
        ("serve", "README.md"),  # a file, not a model
        ("router", "--model", "smolm2", "--insecure"),
    ],
    ids=["serve-typo", "up-missing-path", "serve-not-a-model", "router-typo"],
)
def test_bad_model_is_one_line_and_exit_2(args: tuple[str, ...]) -> None:
    out = _cli(*args)
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 2, out
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    assert lines[0].startswith(f"ucm-serve {args[0]}: error: model"), lines[0]


def test_the_router_takes_a_model_folder_only() -> None:
    from router.cli import main

    assert main(["--model", "smollm2-135m", "--insecure", "--port", str(free_port())]) == 2


@pytest.mark.slow
def test_serve_model_answers_under_its_served_name_within_max_model_len() -> None:
    port = free_port()
    serve = Child(
        "serve",
        [
            sys.executable,
            "-m",
            "launch.cli",
            "serve",
            "smollm2-135m",
            "--port",
            str(port),
            "--served-model-name",
            "tiny-chat",
            "--max-model-len",
            "256",
            "--kv-cache-memory",
            "64MiB",
            "--no-enable-prefix-caching",
            "--max-num-seqs",
            "3",
            "--max-num-batched-tokens",
            str(STEP_TOKENS),
        ],
        sink=open(os.devnull, "w"),
    )
    try:
        url = serve.wait_for(r"ucm-serve is up: (http://\S+)", 300).group(1)
        assert url == f"http://127.0.0.1:{port}"
        models = httpx.get(url + "/v1/models").json()["data"]
        assert [(m["id"], m["max_model_len"]) for m in models] == [("tiny-chat", 256)]
        nodes = httpx.get(url + "/health").json()["nodes"]
        assert nodes and {n["capacity"] for n in nodes.values()} == {3}, nodes  # --max-num-seqs reached the nodes
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
        # --max-num-batched-tokens reached the engine: a prompt of P tokens takes ceil(P / STEP_TOKENS) steps
        # before its one token (at the default budget, 1024, it would take one). A node reports its step count
        # in its heartbeats, so wait for the count to show; a budget that did not arrive never gets there.
        (node,) = nodes
        before = node_stats(url, "steps").get(node, 0.0)
        r1 = client.completions.create(model="tiny-chat", prompt="one two three four " * 30, max_tokens=1)
        steps = -(-r1.usage.prompt_tokens // STEP_TOKENS)
        assert steps >= 4, r1.usage
        wait_until(f"{steps} steps on {node}", lambda: node_stats(url, "steps").get(node, 0.0) >= before + steps)
        hi = [{"role": "user", "content": "Hi!"}]
        r = client.chat.completions.create(model="tiny-chat", messages=hi, max_tokens=4, temperature=0)
        assert r.model == "tiny-chat" and r.choices[0].message.content and r.usage.completion_tokens <= 4
        with pytest.raises(openai.NotFoundError):  # the model's own name is not the served one
            client.chat.completions.create(model="smollm2-135m", messages=hi, max_tokens=4)
        with pytest.raises(openai.BadRequestError, match="256"):  # prompt + max_tokens beyond --max-model-len
            client.chat.completions.create(model="tiny-chat", messages=hi, max_tokens=256)
    finally:
        serve.stop(30)
