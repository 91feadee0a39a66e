"""``kvroom serve`` start-up and shutdown: the pool override, ``--persist``, SIGTERM, bad ports.

Each test starts its own ``python -m kvroom serve`` subprocess on a private copy of the tiny
artifact (64 blocks recorded), so it can check the artifact's bytes before and after.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from server_harness import ServerProcess

from kvroom.artifact.layout import KVROOM_CONFIG
from kvroom.artifact.resize import get_kvcache_num_blocks

pytestmark = pytest.mark.server

RECORDED = 64
MODEL = "tiny"


def read_stream(server: ServerProcess, first_chunk: threading.Event, out: list[object]) -> None:
    """Stream a long completion into ``out`` (chunks, or the exception that ended it)."""
    try:
        stream = server.client().completions.create(
            model=MODEL,
            prompt="abc",
            max_tokens=56,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        for chunk in stream:
            out.append(chunk)
            first_chunk.set()
    except Exception as exc:  # recorded for the test to inspect, not swallowed
        out.append(exc)
    finally:
        first_chunk.set()


def start(artifact: Path, tmp_path: Path, *flags: str) -> ServerProcess:
    return ServerProcess.start(artifact, tmp_path, "--served-model-name", MODEL, *flags)


def test_override_is_served_artifact_untouched_and_sigterm_drains_then_exits_0(
    artifact_copy, tmp_path
):
    config = artifact_copy / KVROOM_CONFIG
    original = config.read_bytes()
    server = start(artifact_copy, tmp_path, "--kvcache-num-blocks", "40")
    assert "KV cache: 40 blocks x 4 tokens = 160 tokens" in server.log
    assert "(artifact unchanged)" in server.log
    assert server.metrics()["kvroom_kv_cache_num_blocks"] == 40
    assert server.metrics()["kvroom_kv_cache_num_free_blocks"] == 40
    assert config.read_bytes() == original

    chunks = sigterm_mid_stream(server)
    assert not any(isinstance(c, Exception) for c in chunks), chunks[-1]
    assert chunks[-1].choices[0].finish_reason == "length"  # in flight at SIGTERM: finished
    assert "kvroom serve: server stopped" in server.log
    assert "Traceback" not in server.log, server.log
    assert config.read_bytes() == original


def sigterm_mid_stream(server) -> list:
    """Start a streamed request, SIGTERM the server at its first chunk (exit code 0 asserted),
    and return what the stream received once its reader has ended."""
    first_chunk, chunks = threading.Event(), []
    reader = threading.Thread(target=read_stream, args=(server, first_chunk, chunks))
    reader.start()
    assert first_chunk.wait(30)
    assert server.terminate() == 0, server.log
    reader.join(30)
    assert not reader.is_alive()
    return chunks


def test_persist_writes_the_chosen_size_and_a_drain_timeout_aborts(artifact_copy, tmp_path):
    config = artifact_copy / KVROOM_CONFIG
    original = config.read_bytes()
    flags = ("--kvcache-num-blocks", "48", "--persist", "--shutdown-timeout", "0")
    server = start(artifact_copy, tmp_path, *flags)
    assert "(persisted 48 blocks to the artifact)" in server.log
    assert server.metrics()["kvroom_kv_cache_num_blocks"] == 48
    assert config.read_bytes() != original
    assert get_kvcache_num_blocks(artifact_copy) == 48

    sigterm_mid_stream(server)
    assert "kvroom serve: server stopped" in server.log


def test_a_taken_port_is_one_line_and_exit_2(tiny_artifact):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "kvroom", "serve", str(tiny_artifact), "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith(
        f"kvroom: error: --host/--port: cannot listen on 127.0.0.1:{port}"
    )


def test_a_bad_pool_override_is_one_line_and_exit_2(artifact_copy):
    config = artifact_copy / KVROOM_CONFIG
    original = config.read_bytes()
    result = subprocess.run(
        [sys.executable, "-m", "kvroom", "serve", str(artifact_copy), "--port", "0"]
        + ["--kvcache-num-blocks", "3", "--persist"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines()[-1] == (
        "kvroom: error: kvcache_num_blocks: 3 blocks is below the minimum of 16 (one "
        "max_seq_len=64 sequence in blocks of 4 tokens); use at least 16, or a lower max_seq_len "
        "at compile"
    )
    assert config.read_bytes() == original
    assert get_kvcache_num_blocks(artifact_copy) == RECORDED
