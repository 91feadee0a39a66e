"""The artifact on disk: file names, the kvroom_config.json schema, reading and writing it.

An artifact is a plain Hugging Face folder (config.json, generation_config.json, tokenizer
files, ``*.safetensors`` with HF parameter names, or ``model.gguf`` for a GGUF source kept as
shipped) plus ``kvroom_config.json``::

    {"format_version": 1, "kvroom_version": "...", "kvcache_num_blocks": N,
     "config": {DecoderOnlyConfig fields, kvcache_num_blocks = N},
     "plan": {MemoryPlan fields, num_blocks = N},
     "planned_for": {"device": ..., "device_memory_bytes": ..., "device_memory_source": ...},
     "model": {"architecture": ..., "num_parameters": ..., "source": ...}}
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvroom.atomic import atomic_write_text
from kvroom.config import CONFIG_CLASSES, DecoderOnlyConfig
from kvroom.errors import ArtifactError, ConfigError, KvroomError
from kvroom.plan import MemoryPlan

FORMAT_VERSION = 1
KVROOM_CONFIG = "kvroom_config.json"
HF_CONFIG = "config.json"
GGUF_WEIGHTS = "model.gguf"
"""A GGUF source's file, copied as shipped (its quantized blocks are what kvroom runs);
transformers loads the artifact with ``from_pretrained(folder, gguf_file="model.gguf")``."""
_REQUIRED_KEYS = ("format_version", "kvcache_num_blocks", "config", "plan", "model")


@dataclass(frozen=True)
class ArtifactInfo:
    """What kvroom_config.json says about an artifact."""

    folder: Path
    config: DecoderOnlyConfig
    plan: MemoryPlan
    model: dict[str, Any]
    """architecture, num_parameters, source."""

    @property
    def num_blocks(self) -> int:
        return self.plan.num_blocks

    def with_plan(self, plan: MemoryPlan) -> ArtifactInfo:
        """The same artifact with another pool size (the config's copy follows the plan)."""
        config = dataclasses.replace(self.config, kvcache_num_blocks=plan.num_blocks)
        return dataclasses.replace(self, config=config, plan=plan)

    def _config_class_entry(self) -> dict[str, str]:
        name = type(self.config).__name__
        return {} if type(self.config) is DecoderOnlyConfig else {"config_class": name}

    def to_json(self) -> str:
        from kvroom import __version__

        doc = {
            "format_version": FORMAT_VERSION,
            "kvroom_version": __version__,
            "kvcache_num_blocks": self.plan.num_blocks,
            "config": self.config.to_dict(),
            **self._config_class_entry(),
            "plan": self.plan.to_dict(),
            "planned_for": {
                "device": self.plan.device,
                "device_memory_bytes": self.plan.device_memory_bytes,
                "device_memory_source": self.plan.device_memory_source,
            },
            "model": self.model,
        }
        return json.dumps(doc, indent=2) + "\n"


def hf_load_kwargs(folder: str | Path) -> dict[str, str]:
    """Extra ``from_pretrained`` arguments transformers needs to load the artifact's weights."""
    return {"gguf_file": GGUF_WEIGHTS} if (Path(folder) / GGUF_WEIGHTS).is_file() else {}


def config_path(folder: Path) -> Path:
    return Path(folder) / KVROOM_CONFIG


def write_info(info: ArtifactInfo) -> None:
    """Replace kvroom_config.json atomically; serialise first so a bad value writes nothing."""
    atomic_write_text(config_path(info.folder), info.to_json())


def read_info(folder: str | Path) -> ArtifactInfo:
    """Read and validate kvroom_config.json of ``folder``.

    Raises:
        ArtifactError: the folder or file is missing, truncated, corrupted, or from the future.
    """
    path = config_path(Path(folder))
    doc = _load_json(Path(folder), path)
    version = doc.get("format_version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise ArtifactError(f"{path}: corrupted: format_version is {version!r}")
    if version > FORMAT_VERSION:
        raise ArtifactError(
            f"{path}: format_version {version} is newer than this kvroom supports "
            f"({FORMAT_VERSION}); upgrade kvroom"
        )
    missing = [k for k in _REQUIRED_KEYS if k not in doc]
    if missing:
        raise ArtifactError(f"{path}: corrupted: missing {', '.join(missing)}")
    not_objects = [k for k in ("config", "plan", "model") if not isinstance(doc[k], dict)]
    if not_objects:
        raise ArtifactError(f"{path}: corrupted: {', '.join(not_objects)} must be JSON objects")
    try:
        config = _config_class(doc).from_dict(doc["config"])
        plan = MemoryPlan.from_dict(doc["plan"])
    except (TypeError, KvroomError) as exc:
        raise ArtifactError(f"{path}: corrupted: {exc}") from None
    if not (doc["kvcache_num_blocks"] == plan.num_blocks == config.kvcache_num_blocks):
        raise ArtifactError(f"{path}: corrupted: kvcache_num_blocks disagrees between sections")
    return ArtifactInfo(Path(folder), config, plan, dict(doc["model"]))


def _config_class(doc: dict[str, Any]) -> type[DecoderOnlyConfig]:
    """The config class named by ``config_class`` (written only for subclasses)."""
    name = doc.get("config_class", DecoderOnlyConfig.__name__)
    if name not in CONFIG_CLASSES:
        raise ConfigError(f"config_class: unknown {name!r}; one of {', '.join(CONFIG_CLASSES)}")
    return CONFIG_CLASSES[name]


def _load_json(folder: Path, path: Path) -> dict[str, Any]:
    if not folder.is_dir():
        raise ArtifactError(f"{folder}: no such artifact folder")
    if not path.is_file():
        raise ArtifactError(f"{folder}: not a kvroom artifact (no {KVROOM_CONFIG})")
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ArtifactError(f"{path}: corrupted or truncated ({exc})") from None
    if not isinstance(doc, dict):
        raise ArtifactError(f"{path}: corrupted: expected a JSON object")
    return doc
