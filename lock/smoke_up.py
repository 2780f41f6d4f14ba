"""`ucm-serve up` on a free port, one greedy chat request, then SIGTERM: exit 0 only if the chat was answered."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading

import httpx

from launch.ports import free_port  # the checkout is installed in the venv this runs in

START_DEADLINE_S = 600  # a first start converts the model and calibrates the kernels


def main() -> None:
    ucm_serve = sys.argv[1]
    up = subprocess.Popen(
        [ucm_serve, "up", "--port", str(free_port())], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    assert up.stdout is not None
    found: list[str] = []
    ready = threading.Event()

    def pump() -> None:  # echo the cluster's log and catch its URL line
        for line in up.stdout:  # type: ignore[union-attr]
            sys.stderr.write(line)
            if not found and (m := re.search(r"ucm-serve is up: (http://\S+)", line)):
                found.append(m.group(1))
                ready.set()
        ready.set()

    threading.Thread(target=pump, daemon=True).start()
    try:
        ready.wait(START_DEADLINE_S)
        if not found:
            sys.exit(f"ucm-serve up did not come up within {START_DEADLINE_S} s (exit code {up.poll()})")
        body = {
            "model": "smollm2-135m",
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 16,
            "temperature": 0,
        }
        reply = httpx.post(found[0] + "/v1/chat/completions", json=body, timeout=300)
        if reply.status_code != 200 or not reply.json()["choices"][0]["message"]["content"]:
            sys.exit(f"chat answered {reply.status_code}: {reply.text[:2000]}")
        print(f"greedy chat answered: {reply.json()['choices'][0]['message']['content']!r}")
    finally:
        up.send_signal(signal.SIGTERM)
        try:
            up.wait(60)
        except subprocess.TimeoutExpired:
            up.kill()


if __name__ == "__main__":
    main()
