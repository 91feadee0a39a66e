"""Several tiny models in one server under one budget: routing by ``model``, the arbiter moving
blocks toward the busy model, a budget cut by priority with unchanged greedy outputs, an idle
model evicted and reloaded on demand, and the bad inputs (unknown model, names served twice).

Both models are the tiny Llama artifact under two names (1 KiB blocks, floor 16, at most 64);
the budget is set in blocks over the fixed bytes, so every size below is exact.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_harness import ServerProcess, ThreadServer

from kvroom.cli import main
from kvroom.server.multi.app import build_models, create_multi_app
from kvroom.server.multi.arbiter import ArbiterPolicy
from kvroom.server.multi.budget_source import FixedBudget
from kvroom.server.multi.models import MultiModels
from kvroom.server.multi.slot import ModelEntry

pytestmark = pytest.mark.server

KEY = "k"
AUTH = {"Authorization": f"Bearer {KEY}"}
BLOCK = 1024
FAST = ArbiterPolicy(interval_s=0.05, patience_s=0.2, cooldown_s=5.0)


class Multi:
    """A running two-model server and its models."""

    def __init__(self, art: Path, pool_blocks: int, priorities: dict[str, float]) -> None:
        self.budget = FixedBudget(0)
        entries = [ModelEntry(str(art), n, priority=priorities.get(n, 1.0)) for n in "ab"]
        self.models: MultiModels = build_models(entries, self.budget, policy=FAST)
        self.fixed = {n: s.cost.fixed_bytes for n, s in self.models.slots.items()}
        self.budget.set(self.budget_for(pool_blocks))
        self.models.load_all()
        self.server = ThreadServer(create_multi_app(self.models, admin_key=KEY))

    def budget_for(self, pool_blocks: int, models: str = "ab") -> int:
        fixed = sum(self.fixed[n] for n in models)
        return self.models.shared_bytes + fixed + pool_blocks * BLOCK

    def state(self) -> dict[str, Any]:
        r = httpx.get(f"{self.server.base_url}/kv_cache", headers=AUTH, timeout=30)
        assert r.status_code == 200, r.text
        return r.json()

    def blocks(self) -> dict[str, int]:
        pools = self.state()["models"]
        return {n: p["num_blocks"] if p["loaded"] else 0 for n, p in pools.items()}

    def cut(self, budget_bytes: int) -> dict[str, Any]:
        body = {"memory_budget": budget_bytes}
        r = httpx.post(f"{self.server.base_url}/kv_cache", headers=AUTH, json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()

    def complete(self, model: str, prompt: str, max_tokens: int) -> Any:
        return self.server.client(timeout=120).completions.create(
            model=model, prompt=prompt, max_tokens=max_tokens, temperature=0
        )


@pytest.fixture
def multi(tiny_artifact: Path, request: pytest.FixtureRequest) -> Iterator[Multi]:
    pool_blocks, priorities = request.param
    m = Multi(tiny_artifact, pool_blocks, priorities)
    yield m
    m.server.stop()


PROMPTS = [f"prompt {i} says" for i in range(8)]


@pytest.mark.parametrize("multi", [(48, {})], indirect=True)
def test_the_busy_models_pool_grows_at_the_idle_ones_expense_and_no_request_fails(
    multi: Multi,
) -> None:
    assert multi.blocks() == {"a": 24, "b": 24}
    stop = threading.Event()
    results: list[Any] = []
    errors: list[BaseException] = []

    def flood() -> None:
        while not stop.is_set():
            try:
                results.append(multi.complete("a", "hello", 44))
            except BaseException as exc:  # noqa: BLE001 - every failure is the test's
                errors.append(exc)

    workers = [threading.Thread(target=flood) for _ in range(6)]
    for w in workers:
        w.start()
    deadline = time.monotonic() + 120
    while multi.blocks()["a"] <= 24 and time.monotonic() < deadline:
        time.sleep(0.05)
    stop.set()
    for w in workers:
        w.join()
    state = multi.state()
    assert errors == []
    assert results and all(r.usage.completion_tokens == 44 for r in results)
    assert multi.blocks() == {"a": 32, "b": 16}  # b gave all above its floor, a took it
    pools = sum(p["bytes"] for p in state["models"].values())
    assert pools <= state["kv_pool_budget_bytes"]
    moves = [(d["model"], d["action"], d["why"]) for d in state["decisions"]]
    assert ("b", "shrink", "to a (starved)") in moves
    metrics = multi.server.metrics()
    assert metrics['kvroom_arbiter_moves_total{kind="grow",model="a"}'] == 1
    assert metrics['kvroom_kv_cache_num_blocks{model="b"}'] == 16


@pytest.mark.parametrize("multi", [(128, {"a": 2.0, "b": 1.0})], indirect=True)
def test_a_budget_cut_mid_run_shrinks_by_priority_and_greedy_outputs_do_not_change(
    multi: Multi,
) -> None:
    assert multi.blocks() == {"a": 64, "b": 64}
    reference = {(m, p): multi.complete(m, p, 40).choices[0].text for m in "ab" for p in PROMPTS}
    got: dict[tuple[str, str], str] = {}

    def run(model: str, prompt: str) -> None:
        got[(model, prompt)] = multi.complete(model, prompt, 40).choices[0].text

    threads = [threading.Thread(target=run, args=key) for key in reference]
    for t in threads:
        t.start()
    while not any(p["num_used_blocks"] for p in multi.state()["models"].values()):
        time.sleep(0.01)
    state = multi.cut(multi.budget_for(40))  # the floors (32) and 8 blocks more
    assert multi.blocks() == {"a": 24, "b": 16}  # b (priority 1) to its floor first
    for t in threads:
        t.join()
    assert got == reference
    assert sum(p["bytes"] for p in state["models"].values()) <= state["kv_pool_budget_bytes"]
    assert multi.server.get("/health").status_code == 200


@pytest.mark.parametrize("multi", [(64, {"a": 2.0, "b": 1.0})], indirect=True)
def test_an_idle_model_is_evicted_when_the_floors_do_not_fit_and_reloaded_on_demand(
    multi: Multi,
) -> None:
    before = {m: multi.complete(m, "same prompt", 12).choices[0].text for m in "ab"}
    b = multi.models.slots["b"]
    assert b.live is not None
    weights = weakref.ref(b.live.runtime.runner.model)
    state = multi.cut(multi.budget_for(20, models="a"))  # one model and 20 blocks
    assert {n: p["loaded"] for n, p in state["models"].items()} == {"a": True, "b": False}
    assert state["models"]["a"]["num_blocks"] == 16
    assert state["decisions"][-1]["action"] == "evict"
    gc.collect()
    assert weights() is None  # the weights are freed, not just unreferenced by the slot
    assert multi.server.metrics()['kvroom_model_loaded{model="b"}'] == 0

    assert multi.complete("b", "same prompt", 12).choices[0].text == before["b"]
    state = multi.state()
    assert {n: p["loaded"] for n, p in state["models"].items()} == {"a": False, "b": True}
    assert state["models"]["b"]["num_loads"] == 2
    assert (state["decisions"][-1]["model"], state["decisions"][-1]["action"]) == ("b", "load")
    assert multi.complete("a", "same prompt", 12).choices[0].text == before["a"]
    assert multi.blocks() == {"a": 20, "b": 0}


@pytest.mark.parametrize("multi", [(48, {})], indirect=True)
def test_routing_listing_metrics_and_bad_models(
    multi: Multi, capsys: pytest.CaptureFixture[str]
) -> None:
    client = multi.server.client()
    assert [m.id for m in client.models.list().data] == ["a", "b"]
    assert multi.complete("b", "hi", 3).model == "b"
    r = multi.server.post(
        "/v1/chat/completions", json={"model": "c", "messages": [{"role": "user", "content": "hi"}]}
    )
    assert r.status_code == 404
    assert r.json() == {
        "error": {
            "message": "The model 'c' does not exist; this server serves the models 'a', 'b'",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
    }
    r = multi.server.post("/v1/completions", json={"prompt": "hi"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"
    metrics = multi.server.metrics()
    assert metrics['kvroom_generation_tokens_total{model="b"}'] == 3
    assert metrics['kvroom_generation_tokens_total{model="a"}'] == 0
    r = httpx.post(
        f"{multi.server.base_url}/kv_cache", headers=AUTH, json={"model": "a", "num_blocks": 64}
    )
    assert r.status_code == 400 and "do not fit" in r.json()["error"]["message"]
    url = multi.server.base_url
    assert main(["resize", url, "20", "--model", "a", "--pin", "--admin-key", KEY]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "resized 24 -> 20 blocks"
    assert out[2].startswith("a: KV cache: 20 blocks x 4 tokens") and out[2].endswith(", pinned")
    assert multi.state()["models"]["a"]["pinned"] is True
    assert multi.blocks() == {"a": 20, "b": 24}
    assert multi.server.get("/health").status_code == 200


def test_two_artifacts_under_one_served_name_are_refused_at_start(
    tiny_artifact: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    art = str(tiny_artifact)
    argv = ["serve", art, art, "--port", "0", "--served-model-name", "x"]
    assert main([*argv, "--served-model-name", "x"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "kvroom: error: --served-model-name: x is served twice; give each artifact its own "
        "name (--served-model-name once per artifact, in order)\n"
    )


@pytest.mark.slow
def test_kvroom_serve_with_two_artifacts_answers_both_and_stops_cleanly(
    tiny_artifact: Path, tmp_path: Path
) -> None:
    art = str(tiny_artifact)
    argv = [sys.executable, "-m", "kvroom", "serve", art, art, "--port", "0", "--no-access-log"]
    argv += ["--served-model-name", "a", "--served-model-name", "b", "--memory-budget", "64MiB"]
    log_path = tmp_path / "server.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    with log_path.open("wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
    server = ServerProcess(proc, log_path, "")
    server.base_url = server._wait_for_address()
    server._wait_for_health()
    try:
        client = server.client()
        assert {
            client.completions.create(model=m, prompt="hi", max_tokens=2).model for m in "ab"
        } == {"a", "b"}
        assert "kvroom serve: memory budget 64.00 MiB, --memory-budget" in server.log
        assert "kvroom serve: model a: " in server.log
    finally:
        assert server.terminate() == 0
