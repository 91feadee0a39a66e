"""Servers on 127.0.0.1 for the server tests, two ways:

- ``ServerProcess.start(artifact, log_dir, *flags)`` runs the real ``python -m kvroom serve
  ARTIFACT --port 0 ...`` subprocess, reads the bound address from its start-up line, and waits
  for ``/health``. It runs with ``OMP_NUM_THREADS=1``: the models are tiny, and on a 2-core CI
  machine a second torch thread only spins against the HTTP thread and the test's clients.
- ``ThreadServer(app)`` runs ``create_app(llm)`` under uvicorn on a thread of the test process:
  the same HTTP stack without a second interpreter's start-up (for the many bad-input cases).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

ADDRESS_LINE = re.compile(r"kvroom serve: serving .* on (http://127\.0\.0\.1:\d+) ")
START_TIMEOUT_S = 90.0


class _Client:
    """HTTP helpers shared by both kinds of server (``base_url`` is set by the subclass)."""

    base_url: str

    def client(self, **kwargs: Any) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.base_url}/v1", api_key="unused", max_retries=0, **kwargs
        )

    def async_client(self, **kwargs: Any) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=f"{self.base_url}/v1", api_key="unused", max_retries=0, **kwargs
        )

    def post(self, path: str, **kwargs: Any) -> httpx.Response:
        return httpx.post(f"{self.base_url}{path}", timeout=30, **kwargs)

    def get(self, path: str) -> httpx.Response:
        return httpx.get(f"{self.base_url}{path}", timeout=30)

    def metrics(self) -> dict[str, float]:
        """``/metrics`` as {sample name (with labels, if any): value}."""
        values: dict[str, float] = {}
        for family in text_string_to_metric_families(self.get("/metrics").text):
            for sample in family.samples:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
                values[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
        return values

    def wait_for_metric(self, name: str, value: float, timeout_s: float = 10.0) -> float:
        """Poll ``/metrics`` until ``name`` equals ``value``; returns the last value seen."""
        deadline = time.monotonic() + timeout_s
        seen = self.metrics()[name]
        while seen != value and time.monotonic() < deadline:
            time.sleep(0.05)
            seen = self.metrics()[name]
        return seen


class ThreadServer(_Client):
    """uvicorn serving ``app`` on 127.0.0.1 (a free port) from a thread; ``stop()`` ends it."""

    def __init__(self, app: Any) -> None:
        from kvroom.cli.serve_command import bind_socket

        sock = bind_socket("127.0.0.1", 0)
        self.base_url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        config = uvicorn.Config(app, loop="asyncio", http="h11", access_log=False)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]})
        self.thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        assert not self.thread.is_alive(), "uvicorn did not stop"


class ServerProcess(_Client):
    """A running ``kvroom serve`` subprocess, its log and its base URL."""

    def __init__(self, proc: subprocess.Popen[bytes], log_path: Path, base_url: str) -> None:
        self.proc = proc
        self.log_path = log_path
        self.base_url = base_url

    @classmethod
    def start(cls, artifact: Path, log_dir: Path, *flags: str) -> ServerProcess:
        log_path = log_dir / "server.log"
        argv = [sys.executable, "-m", "kvroom", "serve", str(artifact), "--port", "0"]
        argv += ["--no-access-log", *flags]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
        with log_path.open("wb") as log:
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
        server = cls(proc, log_path, "")
        server.base_url = server._wait_for_address()
        server._wait_for_health()
        return server

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def peak_rss_bytes(self) -> int:
        """VmHWM of the server process (its peak resident set since start)."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmHWM in /proc/PID/status")

    def rss_bytes(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmRSS in /proc/PID/status")

    def terminate(self, timeout_s: float = 30.0) -> int:
        """SIGTERM, then the exit code (SIGKILL and fail if it does not exit in time)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"server ignored SIGTERM for {timeout_s}s:\n{self.log}") from None

    def _wait_for_address(self) -> str:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            match = ADDRESS_LINE.search(self.log)
            if match:
                return match.group(1)
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited {self.proc.returncode}:\n{self.log}")
            time.sleep(0.05)
        self.proc.kill()
        raise AssertionError(f"server did not print its address:\n{self.log}")

    def _wait_for_health(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                if self.get("/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass  # not listening yet: uvicorn starts right after the address line
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited {self.proc.returncode}:\n{self.log}")
            time.sleep(0.05)
        self.proc.kill()
        raise AssertionError(f"server never became healthy:\n{self.log}")
