"""The Qwen3-VL vision tower: transformers' ``Qwen3VLVisionModel``, loaded from the artifact.

Why reuse it rather than write one: the tower is a plain bidirectional ViT over one image's
patches with no KV cache and nothing to page, so kvroom's paged attention brings nothing to it,
while its details (learned position grid resampled per image, 2-D rotary, patch merger,
deepstack mergers) are exactly where a re-implementation would drift from the checkpoint. It
is built on the ``meta`` device and loaded with ``load_state_dict(assign=True)`` like the
decoder, then run on the runtime's device in the runtime's dtype.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from kvroom.errors import ModelSourceError
from kvroom.models.multimodal import EncoderOutput, ImageInput

PREFIX = "model.visual."


class VisionEncoder:
    """Runs one image through the tower: merged features and the deepstack features."""

    def __init__(self, model: Any, device: torch.device) -> None:
        self.model = model
        self.device = device

    @classmethod
    def load(
        cls, folder: Path, vision_config: Any, dtype: torch.dtype, device: torch.device
    ) -> VisionEncoder:
        from transformers.models.qwen3_vl.modeling_qwen3_vl import (
            Qwen3VLVisionModel,
            Qwen3VLVisionRotaryEmbedding,
        )

        vision_config._attn_implementation = "sdpa"
        with torch.device("meta"):
            model = Qwen3VLVisionModel._from_config(vision_config, dtype=dtype)
        state = _read_prefixed(folder, PREFIX, device)
        missing = set(model.state_dict()) - set(state)
        if missing:
            raise ModelSourceError(f"{folder}: vision tower tensors missing: {sorted(missing)[:3]}")
        model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=True, assign=True)
        rotary = Qwen3VLVisionRotaryEmbedding(vision_config)  # its buffers are not in the file
        model.rotary_pos_emb = rotary.to(device)
        model.eval().requires_grad_(False)
        return cls(model, torch.device(device))

    @torch.inference_mode()
    def encode(self, image: ImageInput) -> EncoderOutput:
        pixels = image.pixel_values.to(self.device)
        grid = torch.tensor([image.grid_thw], device=self.device)
        out = self.model(pixels, grid_thw=grid, return_dict=True)
        return EncoderOutput(out.pooler_output, tuple(out.deepstack_features))


def _read_prefixed(folder: Path, prefix: str, device: torch.device) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for file in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(file), framework="pt", device=str(device)) as handle:
            for key in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                if key.startswith(prefix):
                    state[key[len(prefix) :]] = handle.get_tensor(key).clone()
    return state
