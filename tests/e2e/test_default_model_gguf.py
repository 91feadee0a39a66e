"""The default model with its GGUF weights as shipped: the same greedy tokens as the artifact
dequantized to fp32, the plan counts what is resident, and transformers still loads it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvroom.artifact.layout import GGUF_WEIGHTS, hf_load_kwargs, read_info
from kvroom.compile import compile as kvroom_compile
from kvroom.engine.params.sampling import SamplingParams
from kvroom.llm import LLM
from kvroom.models.layers import Quantized
from kvroom.sources import builtin_gguf_path

pytestmark = pytest.mark.real_model

PROMPTS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write one sentence about the sea.",
    "What is 12 times 12?",
    "Give me a synonym for happy.",
    "Why is the sky blue? Explain briefly.",
    "Hi",
    "List two planets of the solar system.",
]


CONFIG = {"max_seq_len": 512, "batch_size": 8, "kvcache_num_blocks": 256}


@pytest.fixture(scope="module")
def artifacts(
    tmp_path_factory: pytest.TempPathFactory, smol_fp32_artifact: Path
) -> dict[str, Path]:
    """The GGUF kept as shipped, and (shared) the same model dequantized to fp32."""
    pytest.importorskip("gguf")
    out = tmp_path_factory.mktemp("gguf-real") / "gguf"
    kvroom_compile("smollm2-135m", out, CONFIG, profile=False)
    return {"gguf": out, "fp32": smol_fp32_artifact}


def test_the_file_is_kept_as_shipped_and_planned_as_loaded(artifacts: dict[str, Path]) -> None:
    folder = artifacts["gguf"]
    assert (folder / GGUF_WEIGHTS).read_bytes() == builtin_gguf_path("smollm2-135m").read_bytes()
    assert not list(folder.glob("*.safetensors"))
    plan = read_info(folder).plan
    types = dict(plan.weight_types)
    assert set(types) == {"int4 (Q4_1)", "int8 (Q8_0)", "float32"}
    assert plan.weight_bytes < 0.45 * read_info(artifacts["fp32"]).plan.weight_bytes
    llm = LLM(folder)
    model = llm.runtime.runner.model
    quantized = [m for m in model.modules() if isinstance(m, Quantized)]
    # the folded norms ride along as input scales; the plan counts them as float32 norms
    norms = sum(m.input_scale.nbytes for m in quantized if m.input_scale is not None)
    resident = sum(m.resident_bytes for m in quantized) - norms
    assert resident == types["int4 (Q4_1)"] + types["int8 (Q8_0)"]


def test_greedy_tokens_equal_the_dequantized_fp32_artifact(artifacts: dict[str, Path]) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    tokens = {}
    for name, folder in artifacts.items():
        llm = LLM(folder)
        chats = [[{"role": "user", "content": p}] for p in PROMPTS]
        tokens[name] = [list(r.token_ids) for r in llm.chat(chats, params)]
    assert tokens["gguf"] == tokens["fp32"]


def test_transformers_loads_the_gguf_artifact(artifacts: dict[str, Path]) -> None:
    from transformers import AutoModelForCausalLM

    folder = artifacts["gguf"]
    model = AutoModelForCausalLM.from_pretrained(
        str(folder), dtype=torch.float32, **hf_load_kwargs(folder)
    )
    assert model.config.num_hidden_layers == 30
