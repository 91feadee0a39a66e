"""Session fixtures: tiny HF source folders and artifacts compiled from them, built once.

The session artifacts are shared: a test that changes an artifact takes ``artifact_copy``.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tiny_models import compile_tiny_artifact, write_tiny_gemma3, write_tiny_llama


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama HF folder (see ``tiny_models.LLAMA_TINY``). Do not modify."""
    return write_tiny_llama(tmp_path_factory.mktemp("sources") / "tiny-llama")


@pytest.fixture(scope="session")
def tiny_gemma3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random hybrid Gemma3 HF folder (see ``tiny_models.GEMMA3_TINY``). Do not modify."""
    return write_tiny_gemma3(tmp_path_factory.mktemp("sources") / "tiny-gemma3")


@pytest.fixture(scope="session")
def tiny_artifact(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``tiny_llama_dir`` compiled with ``tiny_models.TINY_COMPILE_CONFIG`` (64 blocks of 4
    tokens, max_seq_len 64, batch 4, planned for 1 GiB). Shared: do not modify."""
    return compile_tiny_artifact(tiny_llama_dir, tmp_path_factory.mktemp("artifacts") / "llama")


@pytest.fixture(scope="session")
def tiny_gemma3_artifact(tiny_gemma3_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``tiny_gemma3_dir`` compiled like ``tiny_artifact``. Shared: do not modify."""
    return compile_tiny_artifact(tiny_gemma3_dir, tmp_path_factory.mktemp("artifacts") / "gemma3")


@pytest.fixture(scope="session")
def smol_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default model compiled with the default config for 16 GiB, pinned to 256 blocks
    (no profiling pass). Shared: do not modify."""
    pytest.importorskip("gguf")
    from kvroom.compile import compile as kvroom_compile

    out = tmp_path_factory.mktemp("real") / "smollm2"
    config = {"device_memory": "16GiB", "kvcache_num_blocks": 256}
    kvroom_compile("smollm2-135m", out, config, profile=False)
    return out


@pytest.fixture
def artifact_copy(tiny_artifact: Path, tmp_path: Path) -> Path:
    """A private copy of ``tiny_artifact`` that the test may change."""
    return Path(shutil.copytree(tiny_artifact, tmp_path / "artifact"))


SMOL_CONFIG = {"max_seq_len": 512, "batch_size": 8, "kvcache_num_blocks": 256}
"""The real default model's test artifacts (``real_model`` tests), without profiling."""


@pytest.fixture(scope="session")
def smol_fp32_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2-135M-Instruct dequantized to fp32 (``--dequantize``). Shared: do not modify."""
    pytest.importorskip("gguf")
    from kvroom.compile import compile as kvroom_compile

    out = tmp_path_factory.mktemp("real") / "smollm2-fp32"
    kvroom_compile("smollm2-135m", out, {**SMOL_CONFIG, "quantization": "none"}, profile=False)
    return out
