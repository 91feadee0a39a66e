"""The streaming client and server start-up that the HTTP benchmarks share.

``start_server`` runs ``kvroom serve ARTIFACT --port 0`` on 127.0.0.1 and waits for its
address and ``/health``; ``one_request`` streams one greedy ``/v1/completions`` request (EOS
ignored, usage included) and times every chunk that carries text, on the client's clock.
Any OpenAI-compatible server that takes vLLM's ``ignore_eos`` works as the other end.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ADDRESS = re.compile(r"kvroom serve: serving .* on (http://127\.0\.0\.1:\d+) ")


@dataclass
class RequestTiming:
    start: float
    chunk_times: list[float] = field(default_factory=list)
    completion_tokens: int = 0

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.start

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:], strict=False)]


def percentiles(values: list[float], qs: tuple[int, ...] = (50, 90, 99)) -> list[float]:
    if len(values) < 2:
        return [values[0] if values else float("nan")] * len(qs)
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    return [cuts[q - 1] for q in qs]


def start_server(
    artifact: str, extra: list[str], env: list[str], log_path: Path
) -> tuple[subprocess.Popen, str]:
    """``kvroom serve`` on any free port; (process, base URL) once ``/health`` answers."""
    argv = [sys.executable, "-m", "kvroom", "serve", artifact, "--host", "127.0.0.1"]
    argv += ["--port", "0", "--no-access-log", *extra]
    environ = {**os.environ, **dict(item.split("=", 1) for item in env)}
    with log_path.open("wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=environ)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        match = ADDRESS.search(log_path.read_text(errors="replace"))
        if match and healthy(match.group(1)):
            return proc, match.group(1)
        if proc.poll() is not None:
            raise SystemExit(f"server exited {proc.returncode}:\n{log_path.read_text()}")
        time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"server did not start:\n{log_path.read_text()}")


def healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.TransportError:
        return False  # bound but not listening yet


async def one_request(
    http: httpx.AsyncClient, prompt: str | list[int], max_tokens: int, model: str | None = None
) -> RequestTiming:
    """Stream one greedy completion of ``max_tokens`` tokens (EOS ignored) and time it."""
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if model is not None:
        body["model"] = model
    timing = RequestTiming(start=time.perf_counter())
    async with http.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            if chunk["choices"] and chunk["choices"][0]["text"]:
                timing.chunk_times.append(time.perf_counter())
            if chunk.get("usage"):
                timing.completion_tokens = chunk["usage"]["completion_tokens"]
    return timing


def start_vllm_server(
    artifact: str, vllm_python: str, extra: list[str], env: dict[str, str], log_path: Path
) -> tuple[subprocess.Popen, str]:
    """``kvroom serve --engine vllm`` (``vllm serve`` given the artifact's pool, its KV line
    checked against the plan) on a free port; (process, base URL) once ``/health`` answers.
    vLLM takes minutes to start on a CPU, hence the long wait."""
    from kvroom.cli.serve_command import bind_socket

    sock = bind_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    sock.close()
    argv = [sys.executable, "-m", "kvroom", "serve", artifact, "--engine", "vllm"]
    argv += ["--vllm-python", vllm_python, "--port", str(port), *extra]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env}
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if healthy(url):
            return proc, url
        if proc.poll() is not None:
            raise SystemExit(f"vllm serve exited {proc.returncode}:\n{log_path.read_text()}")
        time.sleep(1)
    proc.kill()
    raise SystemExit(f"vllm serve did not start:\n{log_path.read_text()}")
