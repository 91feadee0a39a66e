"""The runtime end to end on tiny artifacts: pool size, start-up override, preemption, APIs."""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import pytest
import torch

from kvroom.artifact.layout import config_path
from kvroom.engine.params.sampling import SamplingParams
from kvroom.errors import AdmissionError, ConfigError
from kvroom.llm import LLM
from kvroom.modeling import KvroomModelForCausalLM

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15, 16, 17], [20] * 20, [30, 31]]


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def llm(tiny_artifact: Path) -> LLM:
    return LLM(tiny_artifact)


def test_pool_bytes_equal_the_plan(llm: LLM) -> None:
    plan = llm.runtime.plan
    assert plan.num_blocks == 64
    assert llm.runtime.pool.nbytes() == plan.kv_bytes
    assert llm.runtime.engine.stats.num_total_blocks == 64


def test_hybrid_pool_bytes_include_the_sliding_slots(tiny_gemma3_artifact: Path) -> None:
    runtime = LLM(tiny_gemma3_artifact).runtime
    assert runtime.plan.sliding_window_bytes > 0
    assert runtime.pool.nbytes() == runtime.plan.kv_bytes


def test_generate_returns_text_and_tokens_in_order(llm: LLM) -> None:
    results = llm.generate(PROMPTS, GREEDY)
    assert [r.prompt_token_ids for r in results] == [tuple(p) for p in PROMPTS]
    assert all(len(r.token_ids) == 12 for r in results)
    alone = [llm.generate([p], GREEDY)[0].token_ids for p in PROMPTS]
    assert [r.token_ids for r in results] == alone
    assert results[0].text == llm.tokenizer.decode(
        list(results[0].token_ids), skip_special_tokens=True
    )
    assert llm.runtime.engine.stats.num_free_blocks == 64


def test_text_prompt_and_chat(llm: LLM) -> None:
    by_text = llm.generate("hello world", GREEDY)[0]
    ids = llm.tokenizer("hello world")["input_ids"]
    assert by_text.token_ids == llm.generate([ids], GREEDY)[0].token_ids
    chat = llm.chat([{"role": "user", "content": "hi"}], GREEDY)[0]
    assert chat.prompt_token_ids == tuple(
        llm.apply_chat_template([{"role": "user", "content": "hi"}])
    )


def test_seeded_sampling_is_reproducible(llm: LLM) -> None:
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=10, seed=7, ignore_eos=True)
    first = llm.generate(PROMPTS[:2], params)
    again = llm.generate(PROMPTS[:2], params)
    assert [r.token_ids for r in first] == [r.token_ids for r in again]


def test_too_long_request_is_rejected_and_nothing_is_left_running(llm: LLM) -> None:
    with pytest.raises(AdmissionError, match="exceeds max_seq_len"):
        llm.generate([[1] * 10, [1] * 60], SamplingParams(max_tokens=10))
    assert not llm.runtime.engine.has_unfinished()
    assert llm.runtime.engine.stats.num_free_blocks == 64


def test_small_pool_preempts_and_outputs_match(tiny_artifact: Path, llm: LLM) -> None:
    """16 blocks hold one full-length sequence; four 44-token requests cannot run together."""
    before = digest(config_path(tiny_artifact))
    small = LLM(tiny_artifact, kvcache_num_blocks=16)
    params = SamplingParams(temperature=0.0, max_tokens=36, ignore_eos=True)
    prompts = [[3 + i] * 8 for i in range(4)]
    got = small.generate(prompts, params)
    want = llm.generate(prompts, params)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    stats = small.runtime.engine.stats
    assert stats.num_preemptions > 0
    assert stats.num_free_blocks == stats.num_total_blocks == 16
    assert small.runtime.pool.nbytes() == small.runtime.plan.kv_bytes
    assert digest(config_path(tiny_artifact)) == before


def test_startup_override_policy(tiny_artifact: Path, caplog: pytest.LogCaptureFixture) -> None:
    before = digest(config_path(tiny_artifact))
    with pytest.raises(ConfigError, match="^kvcache_num_blocks: 15 blocks is below the minimum"):
        LLM(tiny_artifact, kvcache_num_blocks=15)
    with pytest.raises(ConfigError, match="integer or 'auto'"):
        LLM(tiny_artifact, kvcache_num_blocks="many")
    with caplog.at_level(logging.WARNING, logger="kvroom"):
        big = LLM(tiny_artifact, kvcache_num_blocks=80)
    assert big.runtime.plan.num_blocks == 80
    assert "above the memory estimate" in caplog.text
    auto = LLM(tiny_artifact, kvcache_num_blocks="auto", device_memory="1GiB")
    assert auto.runtime.plan.num_blocks == 64
    assert auto.runtime.plan.num_blocks_source == "auto"
    assert digest(config_path(tiny_artifact)) == before


def test_adjuster_at_load_is_ignored_with_a_notice(
    tiny_artifact: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="kvroom"):
        loaded = LLM(tiny_artifact, kvcache_num_blocks_adjuster=lambda n, c: 1)
    assert loaded.runtime.plan.num_blocks == 64
    assert caplog.text.count("adjuster is ignored") == 1


def test_hf_style_export_save_load_generate(tiny_llama_dir: Path, tmp_path: Path) -> None:
    config = {
        "max_seq_len": 64,
        "batch_size": 4,
        "kvcache_block_size": 4,
        "device_memory": "1GiB",
        "kvcache_num_blocks_adjuster": lambda n, c: n // 2,
    }
    model = KvroomModelForCausalLM.from_pretrained(
        tiny_llama_dir, export=True, kvroom_config=config
    )
    assert model.plan.num_blocks == 32
    out = model.save_pretrained(tmp_path / "saved")
    loaded = KvroomModelForCausalLM.from_pretrained(out)
    assert loaded.plan.num_blocks == 32
    ids = torch.tensor([[0, 0, 5, 6, 7], [9, 10, 11, 12, 13]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    generated = loaded.generate(ids, attention_mask=mask, max_new_tokens=6)
    assert generated.shape[0] == 2 and generated.shape[1] <= 5 + 6
    first = loaded.llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=6))[0]
    assert generated[0, 5 : 5 + len(first.token_ids)].tolist() == list(first.token_ids)
    with pytest.raises(ConfigError, match="unsupported arguments num_beams"):
        loaded.generate(ids, num_beams=2)
