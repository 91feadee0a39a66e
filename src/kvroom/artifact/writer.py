"""Write an artifact folder: HF-named safetensors in the target dtype (or a GGUF source's file
as shipped, ``model.gguf``), HF configs, tokenizer,
and kvroom_config.json last. Everything goes to a temp folder renamed into place at the end, so
an interrupted compile leaves nothing half-written under the output name."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tqdm.auto import tqdm

from kvroom.artifact.layout import GGUF_WEIGHTS, HF_CONFIG, ArtifactInfo, write_info
from kvroom.errors import ArtifactError

SHARD_BYTES = 2 * 2**30
"""Largest safetensors shard, as in ``save_pretrained``'s default ("2GB"-ish)."""


@dataclass(frozen=True)
class ShippedGguf:
    """A GGUF source written as it ships: the file copied to ``model.gguf``, its blocks
    untouched; ``config`` and ``generation_config`` as transformers reads them off its header."""

    path: Path
    config: Any
    generation_config: Any


def torch_dtype(name: str) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16`` (names are normalised by ``DecoderOnlyConfig``)."""
    return getattr(torch, name)


def write_artifact(
    out: Path,
    *,
    model: Any,
    tokenizer: Any,
    info: ArtifactInfo,
    overwrite: bool = False,
    finalize: Callable[[Path], ArtifactInfo] | None = None,
) -> ArtifactInfo:
    """Write ``model`` (a transformers PreTrainedModel, or a ``ShippedGguf``), ``tokenizer``
    and ``info`` to ``out``.

    ``finalize(tmp_folder)``, if given, runs on the complete temp folder before it is renamed
    into place (compile's profiling pass) and returns the info to write instead.

    Raises:
        ArtifactError: ``out`` exists and is not empty, and ``overwrite`` is False.
    """
    out = Path(out)
    check_output_folder(out, overwrite=overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))
    try:
        if isinstance(model, ShippedGguf):
            shutil.copyfile(model.path, tmp / GGUF_WEIGHTS)
        else:
            _write_weights(tmp, model, torch_dtype(info.config.dtype))
        _write_hf_config(tmp, model, info)
        model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        write_info(_moved(info, tmp))
        if finalize is not None:
            info = finalize(tmp)
            write_info(_moved(info, tmp))
        _chmod_like_mkdir(tmp)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return _moved(info, out)


def check_output_folder(out: Path, *, overwrite: bool) -> None:
    """Fail early (before any weight is loaded) when ``out`` cannot receive an artifact.

    Raises:
        ArtifactError: ``out`` is a file, or a non-empty folder and ``overwrite`` is False.
    """
    if out.exists() and not out.is_dir():
        raise ArtifactError(f"{out}: exists and is not a folder")
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise ArtifactError(f"{out}: exists and is not empty (pass --overwrite to replace it)")


def _chmod_like_mkdir(folder: Path) -> None:
    """mkdtemp makes 0o700 (and safetensors writes 0o600): give the folder and its files the
    modes a plain mkdir and open would, so other users of the machine can read the artifact."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(folder, 0o777 & ~umask)
    for path in folder.iterdir():
        if path.is_file():
            os.chmod(path, 0o666 & ~umask)


def _moved(info: ArtifactInfo, folder: Path) -> ArtifactInfo:
    from dataclasses import replace

    return replace(info, folder=folder)


def _write_weights(folder: Path, model: Any, dtype: torch.dtype) -> None:
    """HF parameter names, tied LM head dropped (as ``save_pretrained`` does), sharded."""
    state = model.state_dict()
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    converted: dict[str, torch.Tensor] = {}
    for name, tensor in tqdm(state.items(), desc="Converting weights", unit="tensor"):
        converted[name] = tensor.detach().to(dtype).contiguous()
    shards = _shard(converted)
    index: dict[str, str] = {}
    for i, shard in enumerate(tqdm(shards, desc="Writing safetensors", unit="shard")):
        filename = (
            "model.safetensors"
            if len(shards) == 1
            else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        )
        save_file(shard, str(folder / filename), metadata={"format": "pt"})
        index.update(dict.fromkeys(shard, filename))
    if len(shards) > 1:
        total = sum(t.nbytes for t in converted.values())
        doc = {"metadata": {"total_size": total}, "weight_map": index}
        (folder / "model.safetensors.index.json").write_text(json.dumps(doc, indent=2))


def _shard(tensors: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        if size and size + tensor.nbytes > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += tensor.nbytes
    return shards


def _write_hf_config(folder: Path, model: Any, info: ArtifactInfo) -> None:
    """config.json that plain transformers loads: no GGUF quantization, real architecture."""
    doc = model.config.to_diff_dict()
    doc.pop("quantization_config", None)
    doc["architectures"] = [info.model["architecture"]]
    doc["dtype"] = info.config.dtype
    doc.pop("_name_or_path", None)
    (folder / HF_CONFIG).write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
