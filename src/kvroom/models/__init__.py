"""Model registry: HF ``architectures`` name -> the kvroom class that runs it.

Classes are imported on first use, so importing ``kvroom.models`` stays cheap.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kvroom.errors import ModelSourceError

if TYPE_CHECKING:
    import torch

    from kvroom.model_spec import ModelSpec
    from kvroom.models.decoder import DecoderModel

REGISTRY: dict[str, str] = {
    "LlamaForCausalLM": "kvroom.models.decoder:DecoderModel",
    "MistralForCausalLM": "kvroom.models.decoder:DecoderModel",
    "Qwen2ForCausalLM": "kvroom.models.decoder:DecoderModel",
    "Qwen3ForCausalLM": "kvroom.models.decoder:DecoderModel",
    "Gemma3ForCausalLM": "kvroom.models.gemma3:Gemma3Model",
    "Gemma4ForCausalLM": "kvroom.models.gemma4:Gemma4Model",
    "Gemma4ForConditionalGeneration": "kvroom.models.gemma4:Gemma4Model",
    "Qwen3VLForConditionalGeneration": "kvroom.models.qwen3_vl:Qwen3VLModel",
}
"""HF architecture name -> ``module:Class`` of its builder."""


def model_class(architecture: str) -> type[DecoderModel]:
    """The class that runs ``architecture``.

    Raises:
        ModelSourceError: the architecture is not registered (the message lists those that are).
    """
    if architecture not in REGISTRY:
        raise ModelSourceError(
            f"unsupported architecture {architecture!r}; supported: {', '.join(REGISTRY)}"
        )
    module, name = REGISTRY[architecture].split(":")
    return getattr(importlib.import_module(module), name)


def build_model(
    spec: ModelSpec, hf_config: Any, dtype: torch.dtype, device: torch.device | str
) -> DecoderModel:
    """Construct ``spec.architecture`` on the meta device (weights come from ``load_weights``)."""
    return model_class(spec.architecture)(spec, hf_config, dtype, device)
