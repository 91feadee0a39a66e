"""``kvroom compile --quantization int8|int4``: a full-precision checkpoint runs with quantized
projections, the plan counts their bytes, and the artifact keeps weights others can load."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvroom import LLM, SamplingParams
from kvroom.artifact.layout import read_info
from kvroom.models.layers import Quantized
from kvroom.quant_schemes import SCHEMES
from tiny_models import compile_tiny_artifact, write_tiny_llama


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("src"))


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantized_artifact_plans_and_runs(source: Path, tmp_path: Path, scheme: str) -> None:
    dense = read_info(compile_tiny_artifact(source, tmp_path / "dense"))
    art = compile_tiny_artifact(source, tmp_path / scheme, quantization=scheme)
    info = read_info(art)
    types = dict(info.plan.weight_types)
    # 2 layers of q 32x32, k and v 16x32, o 32x32, gate and up 64x32, down 32x64
    shapes = [(32, 32), (16, 32), (16, 32), (32, 32), (64, 32), (64, 32), (32, 64)]
    expected = 2 * sum(SCHEMES[scheme].resident_bytes(*s) for s in shapes)
    assert types[f"{SCHEMES[scheme].kind} ({scheme})"] == expected
    assert info.plan.weight_bytes < dense.plan.weight_bytes
    assert (art / "model.safetensors").is_file()  # transformers and vLLM load it as before
    llm = LLM(str(art))
    layer = llm.runtime.runner.model.layers[0]
    assert isinstance(layer.gate_up, Quantized) and layer.gate_up.kind == SCHEMES[scheme].kind
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    out = llm.generate(["hello"], greedy)
    assert len(out[0].outputs[0].token_ids) == 4


def test_get_set_and_live_resize_work_on_a_quantized_artifact(source: Path, tmp_path: Path) -> None:
    from kvroom import get_kvcache_num_blocks, set_kvcache_num_blocks

    art = compile_tiny_artifact(source, tmp_path / "int4", quantization="int4")
    set_kvcache_num_blocks(art, 32)
    assert get_kvcache_num_blocks(art) == 32
    llm = LLM(str(art))
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    before = llm.generate(["hello"], greedy)[0].token_ids
    assert llm.resize_kv_cache(16).to_blocks == 16
    assert llm.generate(["hello"], greedy)[0].token_ids == before
