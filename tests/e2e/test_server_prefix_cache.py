"""``POST /reset_prefix_cache`` and the prefix-cache counters of ``/metrics``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from server_harness import ThreadServer

from kvroom.llm import LLM
from kvroom.server.app import create_app

pytestmark = pytest.mark.server

SYSTEM = [(5 * i) % 89 + 3 for i in range(24)]  # 6 full blocks of 4


@pytest.fixture(scope="module")
def servers(tiny_artifact: Path) -> Iterator[dict[str, ThreadServer]]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    made = {
        "on": ThreadServer(create_app(LLM(tiny_artifact), served_model_name="tiny")),
        "off": ThreadServer(
            create_app(LLM(tiny_artifact, enable_prefix_caching=False), served_model_name="tiny")
        ),
        "keyed": ThreadServer(create_app(LLM(tiny_artifact), api_key="k", served_model_name="t")),
    }
    yield made
    for server in made.values():
        server.stop()
    torch.set_num_threads(threads)


def complete(server: ThreadServer, tail: list[int]) -> list[int]:
    body = {"model": "tiny", "prompt": SYSTEM + tail, "max_tokens": 4, "temperature": 0}
    r = server.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def counters(server: ThreadServer) -> tuple[float, float]:
    m = server.metrics()
    return m["kvroom_prefix_cache_queries_total"], m["kvroom_prefix_cache_hits_total"]


def test_hits_are_counted_in_tokens_and_reset_empties_the_cache(
    servers: dict[str, ThreadServer],
) -> None:
    on, off = servers["on"], servers["off"]
    assert complete(on, [1, 2]) == complete(off, [1, 2])
    queries, hits = counters(on)
    assert (queries, hits) == (26, 0)
    assert complete(on, [3]) == complete(off, [3])
    queries, hits = counters(on)
    assert (queries, hits) == (26 + 25, 24)
    r = on.post("/reset_prefix_cache")
    assert r.status_code == 200 and r.json()["num_dropped_blocks"] >= 6
    complete(on, [4])
    assert counters(on) == (26 + 25 + 25, 24), "nothing left to hit"
    assert counters(off) == (0, 0)
    assert off.post("/reset_prefix_cache").json() == {"num_dropped_blocks": 0}


def test_reset_needs_the_api_key_when_there_is_one(servers: dict[str, ThreadServer]) -> None:
    keyed = servers["keyed"]
    r = keyed.post("/reset_prefix_cache")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = keyed.post("/reset_prefix_cache", headers={"Authorization": "Bearer k"})
    assert r.status_code == 200
