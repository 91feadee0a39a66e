"""The command line on GGUF weights: an unsupported block type or a truncated file is one line
and exit 2 with nothing written; vLLM is refused an artifact that keeps a GGUF as shipped."""

from __future__ import annotations

import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest

from gguf_models import gguf_from_hf, random_blocks
from kvroom.artifact.layout import GGUF_WEIGHTS
from kvroom.cli import main
from kvroom.errors import ArtifactError
from kvroom.integrations.vllm import require_vllm_weights
from tiny_models import TINY_COMPILE_CONFIG, compile_tiny_artifact, write_tiny_llama


def _gguf_source(path: Path, q_type: str) -> Path:
    """A llama GGUF transformers can read a config from, ``attn_q`` in block type ``q_type``."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(128)
    writer.add_embedding_length(256)
    writer.add_block_count(1)
    writer.add_feed_forward_length(256)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(300)
    q8 = gguf.GGMLQuantizationType.Q8_0
    writer.add_tensor("token_embd.weight", random_blocks("Q8_0", 300, 256), raw_dtype=q8)
    qtype = gguf.GGMLQuantizationType[q_type]
    values, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = np.random.default_rng(0).integers(0, 255, (256, 256 // values * size), dtype=np.uint8)
    writer.add_tensor("blk.0.attn_q.weight", raw, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _one_line_exit_2(capsys: pytest.CaptureFixture, *argv: str) -> str:
    assert main(list(argv)) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err
    return err


@pytest.mark.parametrize("command", ["plan", "compile"])
def test_unsupported_block_type_is_named(tmp_path: Path, capsys, command: str) -> None:
    source = _gguf_source(tmp_path / "iq.gguf", "IQ2_XXS")
    out = tmp_path / "out"
    argv = [command, str(source), "--device-memory", "1GiB"]
    err = _one_line_exit_2(capsys, *argv, *(["-o", str(out)] if command == "compile" else []))
    assert "block type IQ2_XXS is not supported as shipped; supported: F32, F16, BF16" in err
    assert not out.exists() and not list(tmp_path.glob(".out*"))


def test_truncated_gguf_writes_nothing(tmp_path: Path, capsys) -> None:
    source = _gguf_source(tmp_path / "t.gguf", "Q4_0")
    source.write_bytes(source.read_bytes()[:-4096])
    out = tmp_path / "out"
    err = _one_line_exit_2(
        capsys, "compile", str(source), "-o", str(out), "--device-memory", "1GiB"
    )
    assert "t.gguf" in err
    assert not out.exists() and not list(tmp_path.glob(".out*"))


def test_vllm_refuses_an_artifact_with_gguf_weights(tmp_path: Path, capsys) -> None:
    src = write_tiny_llama(tmp_path / "src")
    art = compile_tiny_artifact(src, tmp_path / "art", **TINY_COMPILE_CONFIG)
    require_vllm_weights(art)  # safetensors: fine
    for file in art.glob("*.safetensors"):
        file.unlink()
    gguf_from_hf(src, art / GGUF_WEIGHTS, lambda name: "Q8_0")
    with pytest.raises(ArtifactError, match="GGUF kept as shipped, which vLLM does not run"):
        require_vllm_weights(art)
    capsys.readouterr()  # the compile's progress bars
    err = _one_line_exit_2(capsys, "vllm-args", str(art))
    assert "--dequantize" in err
    shutil.rmtree(art)
