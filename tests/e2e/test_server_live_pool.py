"""``kvroom serve`` with a live pool, as a real process: a shrink returns memory to the OS, and
the elastic mode gives memory up to a hog beside it and takes it back, losing no request."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from server_harness import ServerProcess

from tiny_models import compile_tiny_artifact, write_tiny_llama

pytestmark = [pytest.mark.server, pytest.mark.slow]

KEY = "k"
AUTH = {"Authorization": f"Bearer {KEY}"}
BLOCK_BYTES = 2 * 2 * 8 * 64 * 16 * 4
"""2 layers x (K, V) x 8 kv heads x 64 dims x 16 tokens x fp32 = 128 KiB."""


@pytest.fixture(scope="module")
def wide_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny llama with wide KV (128 KiB per block): 4096 blocks are 512 MiB."""
    root = tmp_path_factory.mktemp("wide")
    src = write_tiny_llama(
        root / "src",
        num_attention_heads=8,
        num_key_value_heads=8,
        head_dim=64,
        hidden_size=512,
        max_position_embeddings=256,
    )
    return compile_tiny_artifact(
        src,
        root / "art",
        max_seq_len=256,
        batch_size=4,
        kvcache_block_size=16,
        kvcache_num_blocks=4096,
        device_memory="8GiB",
    )


def _state(server: ServerProcess) -> dict:
    r = httpx.get(f"{server.base_url}/kv_cache", headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def _wait(predicate, timeout_s: float, every_s: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(every_s)
    return predicate()


@pytest.fixture
def server(wide_artifact: Path, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator:
    flags = getattr(request, "param", ())
    server = ServerProcess.start(wide_artifact, tmp_path, "--admin-key", KEY, *flags)
    yield server
    assert server.terminate() == 0


def test_a_shrink_on_an_idle_server_returns_the_memory_within_5_s(server: ServerProcess) -> None:
    start_rss = server.rss_bytes()
    r = server.client().completions.create(
        model=str(server_model(server)), prompt="hi", max_tokens=2
    )
    assert r.choices[0].text is not None
    pool = _state(server)["bytes"]
    assert pool == 4096 * BLOCK_BYTES
    # the first step starts the background fault-in of the whole pool
    assert _wait(lambda: _state(server)["populated"], 60), "never resident"
    assert server.rss_bytes() - start_rss >= 0.9 * pool
    before = server.rss_bytes()
    r = server.post("/kv_cache", json={"num_blocks": 256}, headers=AUTH)
    assert r.status_code == 200, r.text
    freed = pool - r.json()["bytes"]
    assert freed == (4096 - 256) * BLOCK_BYTES
    assert _wait(lambda: before - server.rss_bytes() >= 0.9 * freed, 5.0), (
        f"RSS {before / 2**20:.0f} -> {server.rss_bytes() / 2**20:.0f} MiB, freed "
        f"{freed / 2**20:.0f} MiB"
    )
    assert "KV cache resized: 4096 -> 256 blocks (admin request)" in server.log


def server_model(server: ServerProcess) -> str:
    return server.client().models.list().data[0].id


def _available_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no MemAvailable")


HOG_MAX_BYTES = 6 * 2**30


def test_elastic_pool_shrinks_for_a_hog_and_grows_back(wide_artifact: Path, tmp_path: Path) -> None:
    """The reserve is set so that the pool can have about 2 GiB of what is free now;
    a child then takes 3 GiB for a few seconds."""
    reserve = max(_available_bytes() - 2 * 2**30, 2**30)
    server = ServerProcess.start(
        wide_artifact,
        tmp_path,
        "--admin-key",
        KEY,
        "--kvcache-num-blocks",
        "elastic",
        "--kvcache-max-blocks",
        "4096",
        "--kvcache-reserve-memory",
        str(reserve),
    )
    failures: list[BaseException] = []
    done = threading.Event()

    def traffic() -> None:
        client = server.client()
        model = server_model(server)
        while not done.is_set():
            try:
                client.completions.create(model=model, prompt="hello", max_tokens=8)
            except BaseException as exc:
                failures.append(exc)

    try:
        assert _wait(lambda: _state(server)["num_blocks"] >= 2048, 30), server.log
        grown = _state(server)["num_blocks"]
        thread = threading.Thread(target=traffic)
        thread.start()
        # the machine is shared: take what brings "available" 1 GiB under the reserve now
        hog_bytes = min(max(_available_bytes() - reserve + 2**30, 2**30), HOG_MAX_BYTES)
        hog = subprocess.Popen([sys.executable, "-c", HOG.format(n=hog_bytes)])
        assert _wait(lambda: _state(server)["num_blocks"] < grown // 2, 20), server.log
        shrunk = _state(server)["num_blocks"]
        hog.wait(60)
        assert _wait(lambda: _state(server)["num_blocks"] > shrunk, 30), server.log
        done.set()
        thread.join(30)
        assert not failures, failures[:3]
        assert server.proc.poll() is None
        assert "elastic shrink:" in server.log and "elastic grow:" in server.log
    finally:
        done.set()
        assert server.terminate() == 0


HOG = "import time; b = b'x' * {n}; time.sleep(6)"
"""A child that makes n bytes resident (bytes * n writes every page), holds them 6 s, exits."""
