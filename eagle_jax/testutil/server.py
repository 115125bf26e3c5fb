"""The server as a subprocess for tests and the serving benchmark: start scripts/serve.py,
wait until healthy, parse SSE."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time

import httpx

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``python scripts/serve.py ARGS`` on a free loopback port; ``base_url`` when healthy
    (``wait=False``: returns at once; ``wait_healthy`` then waits).

    The server runs on the CPU unless ``env`` or the caller's environment sets
    ``JAX_PLATFORMS`` (the test suite's default): a benchmark on a device passes
    ``env={"JAX_PLATFORMS": ""}`` (an 8B pair started without it ran on the host CPU)."""

    def __init__(self, args: list[str], env: dict | None = None, log_path: str | None = None,
                 startup_timeout: float = 240.0, wait: bool = True):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, os.path.join(REPO, "scripts", "serve.py"), *args,
               "--host", "127.0.0.1", "--port", str(self.port)]
        full_env = dict(os.environ)
        full_env.setdefault("JAX_PLATFORMS", "cpu")
        full_env["PYTHONUNBUFFERED"] = "1"
        full_env.update(env or {})
        self.log_path = log_path or os.path.join(
            os.environ.get("TMPDIR", "/tmp"), f"eagle_jax_serve_{self.port}.log")
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=full_env, cwd=REPO)
        if wait:
            self.wait_healthy(startup_timeout)

    def log_text(self) -> str:
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")

    def wait_healthy(self, timeout: float) -> None:
        """Returns once /health answers 200; stops the server and raises otherwise."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n"
                                   f"{self.log_text()[-5000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.base_url + "/health", timeout=2).status_code == 200:
                    return
            time.sleep(0.25)
        self.stop()
        raise TimeoutError(f"server not healthy after {timeout}s:\n{self.log_text()[-5000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()


def parse_sse(text: str) -> list:
    """SSE body -> list of JSON payloads; the final '[DONE]' is returned as the string."""
    events = []
    for block in text.split("\n\n"):
        block = block.strip()
        if not block:
            continue
        assert block.startswith("data: "), block
        payload = block[len("data: "):]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events
