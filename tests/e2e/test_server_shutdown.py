"""SIGTERM while requests run past ``--shutdown-timeout``: each still gets a whole answer.

A plain request ends with ``finish_reason`` "abort" (what it generated so far) and a stream
with a last chunk whose ``finish_reason`` is "abort", then ``data: [DONE]``; the server exits 0
with no traceback in its log. The artifact allows 4,096 tokens, so the two requests are still
generating when the deadline (0.5 s after the signal) comes.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_harness import ServerProcess

from tiny_models import compile_tiny_artifact, write_tiny_llama

pytestmark = pytest.mark.server

MAX_SEQ_LEN = 4096
BODY = {
    "model": "tiny",
    "prompt": "abc",
    "max_tokens": MAX_SEQ_LEN - 16,
    "temperature": 0,
    "ignore_eos": True,
}


@pytest.fixture(scope="module")
def long_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("shutdown")
    src = write_tiny_llama(root / "src", max_position_embeddings=MAX_SEQ_LEN)
    return compile_tiny_artifact(
        src, root / "art", max_seq_len=MAX_SEQ_LEN, batch_size=2, kvcache_block_size=16
    )


def post_plain(server: ServerProcess, out: dict[str, Any]) -> None:
    try:
        response = server.post("/v1/completions", json=BODY)
        out["status"], out["body"] = response.status_code, response.json()
    except Exception as exc:  # recorded for the test to inspect, not swallowed
        out["error"] = exc


def read_stream(server: ServerProcess, first: threading.Event, lines: list[str]) -> None:
    try:
        url = f"{server.base_url}/v1/completions"
        with httpx.stream("POST", url, json={**BODY, "stream": True}, timeout=60) as response:
            for line in response.iter_lines():
                if line:
                    lines.append(line)
                    first.set()
    except Exception as exc:  # recorded for the test to inspect, not swallowed
        lines.append(repr(exc))
    finally:
        first.set()


def test_requests_past_the_deadline_end_with_abort_and_done(long_artifact, tmp_path):
    server = ServerProcess.start(
        long_artifact, tmp_path, "--served-model-name", "tiny", "--shutdown-timeout", "0.5"
    )
    plain: dict[str, Any] = {}
    first, lines = threading.Event(), []
    threads = [
        threading.Thread(target=post_plain, args=(server, plain)),
        threading.Thread(target=read_stream, args=(server, first, lines)),
    ]
    for thread in threads:
        thread.start()
    assert first.wait(60)
    assert server.wait_for_metric("kvroom_num_requests_running", 2, timeout_s=60) == 2
    assert server.terminate() == 0, server.log
    for thread in threads:
        thread.join(60)
        assert not thread.is_alive()

    assert "error" not in plain, plain
    assert plain["status"] == 200, plain
    choice = plain["body"]["choices"][0]
    assert choice["finish_reason"] == "abort"
    assert 0 < plain["body"]["usage"]["completion_tokens"] < BODY["max_tokens"]

    assert lines[-1] == "data: [DONE]", lines[-3:]
    last = json.loads(lines[-2].removeprefix("data: "))
    assert last["choices"][0]["finish_reason"] == "abort", lines[-3:]
    assert all(json.loads(x[6:])["choices"][0]["finish_reason"] is None for x in lines[:-2])

    log = server.log
    assert "request(s) still running after --shutdown-timeout 0.5s; aborting them" in log
    assert "Traceback" not in log and "CancelledError" not in log, log
    assert "kvroom serve: server stopped" in log
