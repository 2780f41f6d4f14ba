"""`ucm-serve up`: starts store, nodes and router, prints the URL, serves, and SIGTERM leaves no process behind."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

from launch.child import Child
from launch.ports import free_port
from tests.cluster_helpers import wait_until

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow


def _children_of(pid: int) -> set[int]:
    kids = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            kids.add(int(stat.parent.name))
    return kids


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_up_serves_and_shuts_down_cleanly(tmp_path, monkeypatch) -> None:
    # Started from another directory, as a user would: only what the venv installed is importable (the checkout's
    # folders are not on sys.path), next to Hugging Face's `kernels`, which transformers installs.
    monkeypatch.chdir(tmp_path)
    port = free_port()
    up = Child(
        "up",
        [
            sys.executable,
            "-m",
            "launch.cli",
            "up",
            "--prefill",
            "1",
            "--decode",
            "1",
            "--port",
            str(port),
            "--kv-cache-memory",
            "64MiB",
        ],
        sink=open(os.devnull, "w"),
    )
    try:
        url = up.wait_for(r"ucm-serve is up: (http://\S+)", 300).group(1)
        assert url == f"http://127.0.0.1:{port}"
        up.wait_for(r"curl http://127\.0\.0\.1:\d+/v1/chat/completions", 10)
        out = up.output()
        for prefix in ("[store]", "[router]", "[prefill-0]", "[decode-0]"):
            assert prefix in out, f"no {prefix} lines in:\n{out[-2000:]}"
        # its disk tier is a temporary folder, removed at stop: a victim tier, written when DRAM evicts blocks that
        # come back (ucm/reuse_admission.py)
        assert "(writes: reused)" in out, out[-2000:]
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
        r = client.chat.completions.create(
            model="smollm2-135m", messages=[{"role": "user", "content": "Hi!"}], max_tokens=4, temperature=0
        )
        assert r.choices[0].message.content and r.usage.completion_tokens <= 4
        kids = _children_of(up.proc.pid)
        assert len(kids) >= 4, kids  # store, router, prefill, decode (+ pump threads are not processes)
        up.proc.send_signal(signal.SIGTERM)
        assert up.proc.wait(60) == 0
        # `up` waited for its children before it exited: any still alive after a generous bound were left behind
        wait_until("ucm-serve up's children to exit", lambda: not any(_alive(k) for k in kids), timeout=60, poll_s=0.1)
    finally:
        up.stop()
