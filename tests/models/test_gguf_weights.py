"""A GGUF artifact runs its quantized blocks: the same logits as the dense model made of the
file's dequantized values, and the projections really are quantized in memory."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from gguf_models import gguf_from_hf
from kvroom.artifact.layout import GGUF_WEIGHTS
from kvroom.engine.kv.pool import KVCachePool
from kvroom.engine.model_runner import ModelRunner, load_model
from kvroom.engine.params.sampling import SamplingParams
from kvroom.engine.sched.output import ScheduledSeq, SchedulerOutput
from kvroom.models.layers import Quantized
from kvroom.models.quant import QuantizedLinear
from kvroom.models.quant.gguf_checkpoint import GgufCheckpoint
from tiny_models import write_tiny_llama

BLOCK = 4


def _type_of(name: str) -> str:
    """A mix as real files have: Q8_0 embedding, Q4_1 attention, Q4_0 MLP, Q8_0 down."""
    if name.startswith("token_embd") or "ffn_down" in name:
        return "Q8_0"
    return "Q4_1" if "attn" in name else "Q4_0"


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(GGUF artifact-like folder, dense folder of the same dequantized values)."""
    src = write_tiny_llama(tmp_path_factory.mktemp("hf"))
    quant = tmp_path_factory.mktemp("gguf")
    shutil.copy(src / "config.json", quant / "config.json")
    gguf_from_hf(src, quant / GGUF_WEIGHTS, _type_of)
    dense = tmp_path_factory.mktemp("dense")
    shutil.copy(src / "config.json", dense / "config.json")
    names = list(_hf_names(src))
    with GgufCheckpoint(quant / GGUF_WEIGHTS, torch.device("cpu"), 4, 2) as ckpt:
        state = {n: _dense(ckpt.get(n)) for n in names if n in ckpt}
    save_file(state, str(dense / "model.safetensors"))
    return quant, dense


def _hf_names(folder: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        return list(f.keys())


def _dense(value: torch.Tensor | QuantizedLinear) -> torch.Tensor:
    return value.dequantize() if isinstance(value, QuantizedLinear) else value.contiguous()


def _logits(folder: Path, tokens: list[int], dtype: torch.dtype) -> torch.Tensor:
    """Logits of a prefill of ``tokens[:-3]`` then three decode steps."""
    model = load_model(folder, dtype, "cpu")
    pool = KVCachePool(
        model.spec,
        num_blocks=16,
        block_size=BLOCK,
        max_seq_len=32,
        num_sliding_slots=0,
        dtype=dtype,
        device="cpu",
    )
    runner = ModelRunner(model, pool, model.spec, block_size=BLOCK, device="cpu")
    blocks = tuple(range(8))
    rows, done = [], 0
    for end in (len(tokens) - 3, *range(len(tokens) - 2, len(tokens) + 1)):
        chunk = ScheduledSeq(
            seq_id=0,
            token_ids=tuple(tokens[done:end]),
            start_pos=done,
            block_table=blocks,
            sliding_slot=0,
            needs_sample=True,
            sampling=SamplingParams(temperature=0.0),
        )
        _, logits = runner.compute_logits(SchedulerOutput((chunk,)))
        rows.append(logits[0])
        done = end
    return torch.stack(rows)


def test_projections_stay_quantized_and_embedding_rows_too(folders: tuple[Path, Path]) -> None:
    model = load_model(folders[0], torch.float32, "cpu")
    layer = model.layers[0]
    assert all(isinstance(getattr(layer, n), Quantized) for n in layer.projections)
    assert layer.qkv.kind == "int4" and layer.down.kind == "int8"
    assert isinstance(model.lm_head, Quantized) and model.lm_head.kind == "int8"
    if model.spec.tie_embeddings:  # the embedding rows are looked up in the head's table
        assert model.embed is None
    else:
        assert isinstance(model.embed, Quantized)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logits_match_the_dequantized_dense_model(
    folders: tuple[Path, Path], dtype: torch.dtype
) -> None:
    tokens = [1, 17, 200, 45, 3, 99, 150, 7, 8, 250, 31]
    got = _logits(folders[0], tokens, dtype)
    expected = _logits(folders[1], tokens, dtype)
    atol = 1e-4 if dtype == torch.float32 else 0.1
    torch.testing.assert_close(got, expected, atol=atol, rtol=0)
