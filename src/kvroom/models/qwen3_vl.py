"""Qwen3-VL (``Qwen3VLForConditionalGeneration``): the Qwen3 decoder plus what images add.

* the decoder is the Llama-family one with Qwen3's q/k norms; its tensors live under
  ``model.language_model.``;
* M-RoPE: every token has (time, height, width) positions; rotary pair ``i`` turns by the
  axis ``mrope_axes[i]`` (interleaved sections, as ``Qwen3VLTextRotaryEmbedding`` lays them
  out; like it, kvroom interleaves whatever ``mrope_interleaved`` says). Text tokens have the
  same position on all axes, which is plain rotary;
* image placeholder rows take the vision encoder's features, and its deepstack features are
  added to the image rows after each of the first decoder layers;
* the vision tower is transformers' own ``Qwen3VLVisionModel`` (``vision.py``), run on the
  runtime's device; its outputs are kept in a bounded ``EncoderCache``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from kvroom.model_spec import ModelSpec
from kvroom.models.attention import AttentionMetadata
from kvroom.models.decoder import DecoderModel
from kvroom.models.multimodal import Chunk, EncoderCache, EncoderOutput, ImageInput, build_step


def mrope_axes(head_dim: int, sections: list[int]) -> torch.Tensor:
    """Axis (0 time, 1 height, 2 width) of each rotary pair: height at pairs 1, 4, 7, ...
    below ``3 x sections[1]``, width at 2, 5, 8, ... below ``3 x sections[2]``, else time."""
    axes = torch.zeros(head_dim // 2, dtype=torch.long)
    for axis, offset in ((1, 1), (2, 2)):
        axes[offset : sections[axis] * 3 : 3] = axis
    return axes


def mrope_cis(
    pos3: torch.Tensor, inv_freq: torch.Tensor, scale: float, axes: torch.Tensor
) -> torch.Tensor:
    """Per-token rotations ``[T, 1, D/2]`` from ``[3, T]`` positions (float32 angles)."""
    pos = pos3.to(torch.float32)[axes]  # [D/2, T]: each pair's axis
    angles = pos.t() * inv_freq[None, :]
    cos, sin = torch.cos(angles), torch.sin(angles)
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return torch.complex(cos, sin)[:, None, :]


class Qwen3VLModel(DecoderModel):
    """The decoder of Qwen3-VL with M-RoPE and deepstack, and its vision encoder."""

    hf_decoder_prefix = "model.language_model."
    image_placeholder = "<|vision_start|><|image_pad|><|vision_end|>"
    """What a prompt holds once per image (expanded to the image's tokens)."""

    def __init__(
        self, spec: ModelSpec, hf_config: Any, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        text = hf_config.get_text_config()
        super().__init__(spec, text, dtype, device)
        self.vl_config = hf_config
        sections = list(text.rope_parameters.get("mrope_section", [24, 20, 20]))
        self.axes = mrope_axes(spec.head_dim, sections)
        self.vision: Any = None
        """``vision.VisionEncoder``, loaded by ``load_extra``."""
        self.encoder_cache = EncoderCache(4)
        self.max_images = 1
        self.max_image_tokens = 0
        """Tokens per image the plan holds (``plan.vision.tokens_per_image``)."""
        self.processor: Any = None

    def hf_top_names(self) -> dict[str, str]:
        p = self.hf_decoder_prefix
        head = f"{p}embed_tokens.weight" if self.spec.tie_embeddings else "lm_head.weight"
        return {
            "embed": f"{p}embed_tokens.weight",
            "final_norm": f"{p}norm.weight",
            "lm_head": head,
        }

    def load_extra(self, folder: Path) -> None:
        """Load the vision tower (outside the decoder's state dict) from ``folder``."""
        from kvroom.models.vision import VisionEncoder

        self.vision = VisionEncoder.load(
            folder, self.vl_config.vision_config, self.dtype, self.device
        )

    def post_load(self) -> None:
        super().post_load()
        self.axes = self.axes.to(self.device)

    def configure_multimodal(self, folder: Path, config: Any) -> None:
        """Take the artifact's image limits and processor, and size the encoder cache."""
        from kvroom.models.qwen3_vl_inputs import folder_image_budget, load_image_processor
        from kvroom.plan.vision import tokens_per_image

        self.max_images = int(getattr(config, "max_images_per_request", 1))
        pixels = int(getattr(config, "max_image_pixels", 512 * 512))
        budget = folder_image_budget(folder, pixels, self.vl_config)
        assert self.spec.vision is not None
        self.max_image_tokens = tokens_per_image(self.spec.vision, budget.max_pixels)
        processor = getattr(config, "image_processor", None)
        self.processor = processor or load_image_processor(folder, pixels, self.vl_config)
        self.encoder_cache = EncoderCache(int(getattr(config, "encoder_cache_images", 4)))

    def prepare_prompt(self, token_ids: list[int], images: list[Any]) -> tuple[list[int], Any]:
        """Expanded token ids and ``MultimodalInputs`` of a prompt with PIL ``images``.

        Raises:
            ConfigError: more images than ``max_images_per_request``, an image with more
                tokens than the plan holds per image, or placeholders and images that
                disagree in number.
        """
        from kvroom.errors import ConfigError
        from kvroom.models.qwen3_vl_inputs import (
            ImageTokens,
            check_image_tokens,
            expand_prompt,
            preprocess,
        )

        if len(images) > self.max_images:
            raise ConfigError(
                f"multi_modal_data: {len(images)} images, more than max_images_per_request="
                f"{self.max_images}"
            )
        inputs = preprocess(images, self.processor)
        check_image_tokens(inputs, self.max_image_tokens)
        return expand_prompt(token_ids, inputs, ImageTokens.from_config(self.vl_config))

    def image_features(self, image: ImageInput) -> EncoderOutput:
        """The encoder output of ``image``, from the cache or a fresh encoder run."""
        return self.encoder_cache.get(image, self.vision.encode)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        multimodal: list[Chunk] | None = None,
    ) -> torch.Tensor:
        """``DecoderModel.forward`` with M-RoPE positions and image features (``multimodal``:
        per scheduled chunk in row order, see ``multimodal.build_step``)."""
        h = self.embed_tokens(input_ids)
        inv_freq, scale = self._rope[0]
        if multimodal is None:
            cis = self._rope_cis(positions, inv_freq, scale)
            step = None
        else:
            step = build_step(multimodal, positions, self.image_features)
            cis = mrope_cis(step.positions, inv_freq, scale, self.axes)
            if step.rows is not None:
                h.index_copy_(0, step.rows, step.embeds.to(h.dtype))
        for i, (layer, cache, batch) in enumerate(
            zip(self.layers, kv_caches, meta.layers, strict=True)
        ):
            layer(h, cis, cache, batch)
            if step is not None and step.rows is not None and i < len(step.deepstack):
                h.index_add_(0, step.rows, step.deepstack[i].to(h.dtype))
        return h

    @staticmethod
    def _rope_cis(positions: torch.Tensor, inv_freq: torch.Tensor, scale: float) -> torch.Tensor:
        from kvroom.models.layers import rope_cis

        return rope_cis(positions, inv_freq, scale)
