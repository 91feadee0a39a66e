"""The whole-step native decode (``models/fused_decode.py``) computes what the layers compute
from Python, bit for bit, and steps aside wherever it does not apply."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvroom.engine.params.sampling import SamplingParams
from kvroom.llm import LLM
from kvroom.models.fused_decode import FusedDecode
from kvroom.models.kernels import cpu_kernels
from tiny_models import compile_tiny_artifact, write_tiny_model

pytestmark = pytest.mark.skipif(
    not cpu_kernels().native, reason="native kernels not built (KVROOM_NATIVE_KERNELS=0)"
)

HEAD_DIM_64 = {
    "hidden_size": 128,
    "intermediate_size": 96,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,
}
"""A tiny Llama whose head dim the decode kernel vectorizes (64) and whose projections are
whole panels of 32 (qkv 256, gate_up 192, o and down 128)."""
PROMPTS = [[5, 9, 31, 7], [8, 3, 12, 40, 41, 42, 43], [60, 61]]


@pytest.fixture(scope="module")
def tiny_source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("fused") / "llama", "llama", **HEAD_DIM_64)


def run_both(art: Path, max_tokens: int = 6, key_shift: bool = False) -> tuple[Any, Any, int]:
    """Greedy outputs (token ids and their log-probabilities) with the fused step, then with
    the layers run from Python; and how many steps ran fused. ``key_shift``: every layer
    takes a random one (an int8/int4 pool)."""
    llm = LLM(str(art))
    model = llm.runtime.runner.model
    if key_shift:
        spec = llm.runtime.spec
        gen = torch.Generator().manual_seed(3)
        shape = (spec.num_layers, spec.num_kv_heads, spec.head_dim)
        model.set_key_shift(torch.randn(shape, generator=gen))
    fused = model._fused
    assert isinstance(fused, FusedDecode)
    calls = {"fused": 0}
    run = fused.run

    def counting_run(*args: Any) -> bool:
        ran = run(*args)
        calls["fused"] += ran
        return ran

    fused.run = counting_run  # type: ignore[method-assign]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    with_fused = _outputs(llm.generate(PROMPTS, params))
    model._fused = None
    without = _outputs(llm.generate(PROMPTS, params))
    return with_fused, without, calls["fused"]


def _outputs(results: list[Any]) -> list[tuple[list[int], list[float]]]:
    out = []
    for r in results:
        c = r.outputs[0]
        chosen = [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs, strict=True)]
        out.append((list(c.token_ids), chosen))
    return out


@pytest.mark.parametrize(
    ("dtype", "quantization", "kv_dtype"),
    [
        ("float32", "none", None),
        ("float32", "none", "bfloat16"),
        ("bfloat16", "none", None),
        ("float32", "int4", None),
        ("float32", "int8", None),
        ("bfloat16", "int4", None),
        ("float32", "none", "int8"),
        ("float32", "none", "int4"),
        ("float32", "none", "int4-norot"),
        ("bfloat16", "int4", "int8"),
        ("bfloat16", "none", "int4"),
    ],
)
def test_fused_step_equals_the_layers_run_from_python(
    tiny_source: Path, tmp_path: Path, dtype: str, quantization: str, kv_dtype: str | None
) -> None:
    """Also over int8/int4 pools (rotated or not), with a key shift on every layer: the same
    rows stored, the same tokens and log-probabilities."""
    config: dict[str, Any] = {"dtype": dtype, "quantization": quantization}
    if kv_dtype is not None:
        config["kv_dtype"] = kv_dtype.removesuffix("-norot")
        if kv_dtype.endswith("-norot"):
            config["kv_rotation"] = "none"
    art = compile_tiny_artifact(tiny_source, tmp_path / "art", **config)
    with_fused, without, fused_steps = run_both(art, key_shift=kv_dtype in ("int8", "int4"))
    assert fused_steps > 0
    assert with_fused == without


def test_bias_and_batches_of_one_and_several(tmp_path: Path) -> None:
    src = write_tiny_model(tmp_path / "qwen2", "qwen2", **HEAD_DIM_64)  # q/k/v biases
    art = compile_tiny_artifact(src, tmp_path / "art", quantization="int8")
    with_fused, without, fused_steps = run_both(art)
    assert fused_steps > 0 and with_fused == without


@pytest.mark.parametrize(
    "overrides",
    [{"head_dim": 8, "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2}],
)
def test_models_it_does_not_fit_run_their_layers_from_python(
    tmp_path: Path, overrides: dict[str, Any]
) -> None:
    src = write_tiny_model(tmp_path / "llama", "llama", **{**HEAD_DIM_64, **overrides})
    art = compile_tiny_artifact(src, tmp_path / "art")
    assert LLM(str(art)).runtime.runner.model._fused is None


def test_turned_off_by_the_environment(
    tiny_source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVROOM_FUSED_DECODE", "0")
    art = compile_tiny_artifact(tiny_source, tmp_path / "art")
    assert LLM(str(art)).runtime.runner.model._fused is None


def test_descriptors_hold_one_row_per_layer(tiny_source: Path, tmp_path: Path) -> None:
    art = compile_tiny_artifact(tiny_source, tmp_path / "art", quantization="int4")
    fused = LLM(str(art)).runtime.runner.model._fused
    assert fused is not None
    assert fused.descriptors.shape == (2, 35) and fused.descriptors.dtype == torch.int64
