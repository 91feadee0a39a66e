"""Gemma 4 through the whole stack: plan == pool, compile with an adjuster, the scheduler with
preemption against transformers' greedy output, and the CLI (plan, compile, run)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import transformers

from kvroom.artifact.layout import read_info
from kvroom.cli import main
from kvroom.engine.params.sampling import SamplingParams
from kvroom.llm import LLM
from tiny_models import TINY_COMPILE_CONFIG, compile_tiny_artifact, write_tiny_gemma4

GROUPS = [
    "2 sliding-window layers, 2 KV heads x 8 dims; 1 layer shares earlier KV",
    "1 full-attention layer, K=V, 1 KV head x 16 dims; 1 layer shares earlier KV",
]


@pytest.fixture(scope="module")
def gemma4_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gemma4(tmp_path_factory.mktemp("sources") / "tiny-gemma4")


@pytest.fixture(scope="module")
def gemma4_artifact(gemma4_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return compile_tiny_artifact(gemma4_dir, tmp_path_factory.mktemp("artifacts") / "gemma4")


def test_plan_counts_one_k_eq_v_layer_and_the_pool_matches(gemma4_artifact: Path) -> None:
    """Block: 1 K=V layer x 4 tokens x 1 entry x 1 head x 16 dims x 4 B = 256 B (a K/V
    layout would be 512 B, and 1024 B with the consumer layer counted). Sliding: 2 layers x
    4 seqs x 8 window x 2 x 2 heads x 8 dims x 4 B = 8 KiB (the consumer holds none)."""
    llm = LLM(gemma4_artifact)
    plan = llm.runtime.plan
    assert (plan.kv_bytes_per_block, plan.sliding_window_bytes) == (256, 8192)
    assert list(plan.kv_groups) == GROUPS
    assert llm.runtime.pool.nbytes() == plan.kv_bytes == 64 * 256 + 8192


def test_compile_with_a_halving_adjuster_saves_half_the_estimate(
    gemma4_dir: Path, tmp_path: Path
) -> None:
    out = compile_tiny_artifact(
        gemma4_dir, tmp_path / "half", kvcache_num_blocks_adjuster=lambda n, cfg: n // 2
    )
    saved = json.loads((out / "kvroom_config.json").read_text())
    info = read_info(out)
    assert info.plan.estimated_num_blocks == 64
    assert info.plan.num_blocks == 32 and info.plan.num_blocks_source == "adjuster"
    assert "kvcache_num_blocks_adjuster" not in json.dumps(saved)


def test_small_pool_preempts_and_matches_transformers(gemma4_dir: Path, gemma4_artifact: Path):
    """16 blocks hold one 64-token sequence: four 32-token requests preempt each other, and
    every output still equals transformers' greedy generate, token for token."""
    small = LLM(gemma4_artifact, kvcache_num_blocks=16)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = [[3 + i, 40 + i, 7, 9 + 2 * i, 11, 12, 13, 14] for i in range(4)]
    got = small.generate(prompts, params)
    hf = transformers.AutoModelForCausalLM.from_pretrained(gemma4_dir).eval()
    for prompt, result in zip(prompts, got, strict=True):
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([prompt]), max_new_tokens=24, min_new_tokens=24, do_sample=False
            )
        assert list(result.token_ids) == ref[0, len(prompt) :].tolist()
    stats = small.runtime.engine.stats
    assert stats.num_preemptions > 0
    assert stats.num_free_blocks == stats.num_total_blocks == 16


def test_cli_plan_compile_run(gemma4_dir: Path, tmp_path: Path, capsys) -> None:
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in TINY_COMPILE_CONFIG.items()]
    assert main(["plan", str(gemma4_dir), *flags]) == 0
    table = capsys.readouterr().out
    assert re.search(rf"^KV pool tensor 2 +{re.escape(GROUPS[1])}$", table, re.MULTILINE)
    out = tmp_path / "art"
    assert main(["compile", str(gemma4_dir), "-o", str(out), *flags]) == 0
    capsys.readouterr()
    assert (
        main(["run", str(out), "--prompt", "hello", "--max-new-tokens", "4", "--ignore-eos"]) == 0
    )
    assert capsys.readouterr().out.strip()
