"""``LLM.resize_kv_cache``: a real model keeps every greedy token through live resizes."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvroom.engine.params.sampling import SamplingParams
from kvroom.errors import ConfigError
from kvroom.llm import LLM
from tiny_models import compile_tiny_artifact, write_tiny_llama

NUM_REQUESTS = 32


@pytest.fixture(scope="module")
def big_pool_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny llama, max_seq_len 512 in blocks of 4, batch 32: num_full_blocks = 4096."""
    root = tmp_path_factory.mktemp("resize")
    src = write_tiny_llama(root / "src", max_position_embeddings=512)
    return compile_tiny_artifact(
        src,
        root / "art",
        max_seq_len=512,
        batch_size=32,
        max_num_batched_tokens=512,
        kvcache_num_blocks=4096,
    )


def _requests() -> list[tuple[list[int], SamplingParams]]:
    return [
        (
            [3 + (7 * i + j) % 250 for j in range(60 + i % 17)],
            SamplingParams(temperature=0.0, max_tokens=12 + (17 * i) % 24, ignore_eos=True),
        )
        for i in range(NUM_REQUESTS)
    ]


def _run(llm: LLM, resizes: dict[int, int]) -> tuple[dict[str, tuple[int, ...]], list]:
    engine = llm.runtime.engine
    ids = [engine.add_request(p, sp, request_id=str(i)) for i, (p, sp) in enumerate(_requests())]
    finals: dict[str, tuple[int, ...]] = {}
    results = []
    step = 0
    while engine.has_unfinished():
        if step in resizes:
            results.append(llm.resize_kv_cache(resizes[step]))
            engine.scheduler.check_invariants()
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out.output_token_ids
        step += 1
    assert sorted(finals) == sorted(ids)
    return finals, results


def test_greedy_outputs_of_32_requests_survive_4096_512_4096(big_pool_artifact: Path) -> None:
    llm = LLM(big_pool_artifact)
    want, _ = _run(llm, {})
    got, results = _run(llm, {9: 512, 16: 4096})
    assert got == want
    shrink, grow = results
    assert (shrink.from_blocks, shrink.to_blocks, grow.to_blocks) == (4096, 512, 4096)
    assert shrink.num_moved_blocks > 0 and shrink.num_preempted > 0, "both paths exercised"
    state = llm.kv_cache_state()
    assert (state.num_blocks, state.num_resizes, state.plan.num_blocks_source) == (
        4096,
        2,
        "resize",
    )
    assert llm.runtime.pool.nbytes() == llm.runtime.plan.kv_bytes


def test_policy_refusals_leave_the_pool_alone(big_pool_artifact: Path) -> None:
    llm = LLM(big_pool_artifact, kvcache_num_blocks=256)
    with pytest.raises(ConfigError, match=r"^resize: 127 blocks is below the minimum of 128 "):
        llm.resize_kv_cache(127)
    with pytest.raises(ConfigError, match="integer or 'auto', got 'lots'"):
        llm.resize_kv_cache("lots")
    with pytest.raises(ConfigError, match="4097 is above the 4096 blocks of address space"):
        llm.resize_kv_cache(4097)
    assert llm.kv_cache_state().num_blocks == 256
    result = llm.resize_kv_cache("auto")
    assert result.to_blocks == 4096 and llm.runtime.plan.num_blocks_source == "auto"


def test_persist_writes_the_new_size_through_set(big_pool_artifact: Path, tmp_path: Path) -> None:
    import shutil

    from kvroom.artifact.resize import get_kvcache_num_blocks

    art = Path(shutil.copytree(big_pool_artifact, tmp_path / "art"))
    llm = LLM(art)
    llm.resize_kv_cache(1024)
    assert get_kvcache_num_blocks(art) == 4096
    llm.resize_kv_cache(768, persist=True)
    assert get_kvcache_num_blocks(art) == 768
