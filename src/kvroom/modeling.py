"""``KvroomModelForCausalLM``: the Hugging Face-style face of kvroom.

model = KvroomModelForCausalLM.from_pretrained("smollm2-135m", export=True,
                                               kvroom_config={"kvcache_reserve_memory": "2GiB"})
model.save_pretrained("artifacts/smollm2")              # the artifact folder
model = KvroomModelForCausalLM.from_pretrained("artifacts/smollm2")  # load, no estimate
out = model.generate(input_ids, max_new_tokens=32, do_sample=False)
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvroom.compile import compile
from kvroom.config import DecoderOnlyConfig
from kvroom.engine.params.sampling import SamplingParams
from kvroom.errors import ConfigError
from kvroom.llm import LLM

logger = logging.getLogger("kvroom")

_LOAD_OVERRIDES = (
    "kvcache_num_blocks",
    "device_memory",
    "kvcache_reserve_memory",
    "kvcache_memory_fraction",
    "kvcache_num_blocks_adjuster",
)


class KvroomModelForCausalLM:
    """A kvroom artifact loaded for generation, built with ``from_pretrained(export=True)``."""

    def __init__(self, llm: LLM, folder: Path, owns_folder: bool = False) -> None:
        self.llm = llm
        self.folder = folder
        self._owns_folder = owns_folder
        self.config = llm.runtime.info.config
        self.plan = llm.runtime.plan

    @classmethod
    def from_pretrained(
        cls,
        model_id: str | Path,
        *,
        export: bool = False,
        kvroom_config: DecoderOnlyConfig | Mapping[str, Any] | None = None,
    ) -> KvroomModelForCausalLM:
        """``export=True``: plan and build ``model_id`` (HF folder, .gguf or built-in name)
        into a temporary artifact; ``save_pretrained`` keeps it. ``export=False``: load the
        artifact at ``model_id``; only start-up knobs of ``kvroom_config`` apply there
        (kvcache_num_blocks, device_memory, kvcache_reserve_memory, kvcache_memory_fraction)."""
        if export:
            folder = Path(tempfile.mkdtemp(prefix="kvroom-export-")) / "artifact"
            compile(model_id, folder, kvroom_config)
            return cls(LLM(folder), folder, owns_folder=True)
        overrides = _load_overrides(kvroom_config)
        return cls(LLM(model_id, **overrides), Path(model_id))

    def save_pretrained(self, out: str | Path) -> Path:
        """Copy the artifact folder to ``out`` (it is self-contained)."""
        out = Path(out)
        if out.resolve() != self.folder.resolve():
            shutil.copytree(self.folder, out, dirs_exist_ok=True)
        return out

    def generate(
        self,
        input_ids: Any,
        attention_mask: Any | None = None,
        *,
        max_new_tokens: int = 20,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        **unsupported: Any,
    ) -> Any:
        """HF ``generate``: ``[B, L]`` ids (left padding marked by ``attention_mask``) ->
        ``[B, L + new]`` ids, right-padded with the pad token where a row stopped early."""
        import torch

        if unsupported:
            raise ConfigError(f"generate: unsupported arguments {', '.join(sorted(unsupported))}")
        ids = torch.as_tensor(input_ids)
        ids = ids[None] if ids.dim() == 1 else ids
        mask = torch.ones_like(ids) if attention_mask is None else torch.as_tensor(attention_mask)
        prompts = [row[m.bool()].tolist() for row, m in zip(ids, mask, strict=True)]
        params = SamplingParams(
            temperature=temperature if do_sample else 0.0,
            top_p=top_p,
            top_k=top_k,
            max_tokens=max_new_tokens,
            seed=seed,
        )
        results = self.llm.generate(prompts, params)
        pad = self.llm.tokenizer.pad_token_id
        pad = pad if pad is not None else next(iter(self.llm.runtime.engine.eos_token_ids), 0)
        width = max(len(r.token_ids) for r in results)
        rows = [list(r.token_ids) + [pad] * (width - len(r.token_ids)) for r in results]
        return torch.cat([ids, torch.tensor(rows, dtype=ids.dtype)], dim=1)

    def __del__(self) -> None:
        if getattr(self, "_owns_folder", False):
            shutil.rmtree(self.folder.parent, ignore_errors=True)


def _load_overrides(kvroom_config: DecoderOnlyConfig | Mapping[str, Any] | None) -> dict[str, Any]:
    if kvroom_config is None:
        return {}
    if isinstance(kvroom_config, DecoderOnlyConfig):  # its memory knobs are all defaulted
        given = {
            "kvcache_num_blocks": kvroom_config.kvcache_num_blocks,
            "kvcache_num_blocks_adjuster": kvroom_config.kvcache_num_blocks_adjuster,
        }
    else:
        given = dict(kvroom_config)
    ignored = sorted(k for k in given if k not in _LOAD_OVERRIDES)
    if ignored:
        logger.warning("kvroom_config keys %s are build-time settings, ignored at load", ignored)
    return {k: v for k, v in given.items() if k in _LOAD_OVERRIDES and v is not None}
