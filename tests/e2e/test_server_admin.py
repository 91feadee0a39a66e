"""Admin endpoints (``/kv_cache``) and ``kvroom resize``: refused without the key, allowed with
it, and a live resize under traffic that loses no request."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from server_harness import ThreadServer

from kvroom.artifact.resize import get_kvcache_num_blocks
from kvroom.cli import main
from kvroom.llm import LLM
from kvroom.server.app import create_app

pytestmark = pytest.mark.server

KEY = "s3cret"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def servers(tiny_artifact: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    import shutil

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    art = Path(shutil.copytree(tiny_artifact, tmp_path_factory.mktemp("admin") / "art"))
    keyed = ThreadServer(create_app(LLM(art), served_model_name="tiny", admin_key=KEY))
    open_ = ThreadServer(create_app(LLM(tiny_artifact), served_model_name="tiny"))
    yield {"keyed": keyed, "open": open_, "artifact": art}
    keyed.stop()
    open_.stop()
    torch.set_num_threads(threads)


def test_without_a_configured_key_the_admin_routes_do_not_exist(servers: dict) -> None:
    server = servers["open"]
    assert server.get("/kv_cache").status_code == 404
    r = server.post("/kv_cache", json={"num_blocks": 32}, headers=AUTH)
    assert r.status_code == 404 and "start with --admin-key" in r.json()["error"]["message"]
    assert server.metrics()["kvroom_kv_cache_num_blocks"] == 64


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer nope"}, {"Authorization": KEY}])
def test_a_missing_or_wrong_key_is_forbidden(servers: dict, headers: dict) -> None:
    server = servers["keyed"]
    r = server.post("/kv_cache", json={"num_blocks": "not even valid"}, headers=headers)
    assert r.status_code == 403
    assert r.json()["error"]["message"] == "admin endpoint: missing or wrong admin key"
    assert server.post("/kv_cache", headers=headers).status_code == 403


def test_get_shows_the_pool_and_the_plan(servers: dict) -> None:
    import httpx

    r = httpx.get(f"{servers['keyed'].base_url}/kv_cache", headers=AUTH, timeout=30)
    assert r.status_code == 200
    state = r.json()
    assert (state["num_blocks"], state["block_size"], state["num_tokens"]) == (64, 4, 256)
    assert state["min_num_blocks"] == 16 and state["max_num_blocks"] == 64
    assert state["bytes"] == 64 * state["bytes_per_block"]
    assert state["plan"]["num_blocks"] == 64


def test_resize_under_traffic_keeps_every_request_and_updates_metrics(servers: dict) -> None:
    server = servers["keyed"]
    before = server.metrics().get("kvroom_kv_cache_resizes_total", 0)

    async def traffic() -> list[str]:
        client = server.async_client()
        jobs = [
            client.completions.create(model="tiny", prompt=f"hello {i}", max_tokens=24,
                                      temperature=0, extra_body={"ignore_eos": True})
            for i in range(6)
        ]  # fmt: skip
        resize = asyncio.to_thread(server.post, "/kv_cache", json={"num_blocks": 16}, headers=AUTH)
        *outs, r = await asyncio.gather(*jobs, resize)
        assert r.status_code == 200, r.text
        assert r.json()["num_blocks"] == 16 and r.json()["resize"]["from_blocks"] == 64
        return [o.choices[0].finish_reason for o in outs]

    assert asyncio.run(traffic()) == ["length"] * 6
    metrics = server.metrics()
    assert metrics["kvroom_kv_cache_num_blocks"] == 16
    assert metrics["kvroom_kv_cache_resizes_total"] == before + 1
    r = server.post("/kv_cache", json={"num_blocks": 15}, headers=AUTH)
    assert r.status_code == 400
    assert r.json()["error"]["message"].startswith(
        "resize: 15 blocks is below the minimum of 16 (one max_seq_len=64 sequence"
    )
    r = server.post("/kv_cache", json={"num_blocks": 65}, headers=AUTH)
    assert r.status_code == 400 and "above the 64 blocks of address space" in r.text
    r = server.post("/kv_cache", json={"num_blocks": "lots"}, headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["param"] == "num_blocks"


def test_kvroom_resize_cli(servers: dict, capsys: pytest.CaptureFixture) -> None:
    url = servers["keyed"].base_url
    assert main(["resize", url, "48", "--admin-key", KEY]) == 0
    line = capsys.readouterr().out
    assert line.startswith("KV cache resized ") and "-> 48 blocks" in line
    assert main(["resize", url, "--admin-key", KEY, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["num_blocks"] == 48
    assert main(["resize", url, "32", "--admin-key", "wrong"]) == 2
    assert "HTTP 403: admin endpoint: missing or wrong admin key" in capsys.readouterr().err
    assert main(["resize", url, "8", "--admin-key", KEY]) == 2
    err = capsys.readouterr().err
    assert "HTTP 400: resize: 8 blocks is below the minimum of 16" in err
    assert "Memory is not enough" not in err  # memory is not what is wrong


def test_persist_writes_the_artifact(servers: dict) -> None:
    art = servers["artifact"]
    r = servers["keyed"].post("/kv_cache", json={"num_blocks": 40, "persist": True}, headers=AUTH)
    assert r.status_code == 200 and get_kvcache_num_blocks(art) == 40
    r = servers["keyed"].post("/kv_cache", json={"num_blocks": "auto"}, headers=AUTH)
    assert r.status_code == 200 and r.json()["source"] == "auto"
    assert get_kvcache_num_blocks(art) == 40
