"""Qwen3-VL prompts with images -> token ids and ``MultimodalInputs`` (vLLM's convention).

The prompt holds ``<|vision_start|><|image_pad|><|vision_end|>`` once per image; each
``<|image_pad|>`` is expanded to the image's token count (``t x h x w / merge^2``), as vLLM and
transformers' processor do. Images are preprocessed by the model's own PIL image processor
(``Qwen2VLImageProcessorPil``: no torchvision), with its config and its ``min_pixels``, and
``max_pixels`` capped at ``max_image_pixels`` (``plan.vision.image_budget``).

M-RoPE positions follow ``Qwen3VLModel.get_rope_index``: text tokens advance all three axes
together; an image's tokens sit at ``(start, start + row, start + col)`` on its merged grid,
and the text after it resumes at ``start + max(rows, cols)``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvroom.errors import ConfigError
from kvroom.models.multimodal import ImageInput, MultimodalInputs
from kvroom.plan.vision import ImageBudget, image_budget


@dataclass(frozen=True)
class ImageTokens:
    """Special token ids of the checkpoint."""

    image: int
    vision_start: int
    vision_end: int
    merge_size: int

    @classmethod
    def from_config(cls, hf_config: Any) -> ImageTokens:
        return cls(
            hf_config.image_token_id,
            hf_config.vision_start_token_id,
            hf_config.vision_end_token_id,
            hf_config.vision_config.spatial_merge_size,
        )


def load_image_processor(folder: Path, max_image_pixels: int, hf_config: Any) -> Any:
    """The image processor of ``folder`` (its config in ``preprocessor_config.json`` or, as
    transformers 5 saves it, ``processor_config.json``; its defaults without one), resizing to
    the plan's ``image_budget``: its own ``min_pixels``, and ``max_pixels`` capped at
    ``max_image_pixels``.

    Raises:
        ConfigError: ``max_image_pixels`` is below the processor's ``min_pixels``.
        ModelSourceError: a processor config that cannot be read.
    """
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    from kvroom.sources import read_image_processor_config

    v = hf_config.vision_config
    config = read_image_processor_config(Path(folder))
    budget = _image_budget(config, max_image_pixels, hf_config)
    kwargs = {"patch_size": v.patch_size, "temporal_patch_size": v.temporal_patch_size}
    kwargs["merge_size"] = v.spatial_merge_size
    proc = Qwen2VLImageProcessorPil.from_dict(dict(config or {}), **kwargs)
    proc.size = {"shortest_edge": budget.min_pixels, "longest_edge": budget.max_pixels}
    for name in ("min_pixels", "max_pixels"):  # deprecated spellings would override ``size``
        if hasattr(proc, name):
            setattr(proc, name, None)
    return proc


def folder_image_budget(folder: Path, max_image_pixels: int, hf_config: Any) -> ImageBudget:
    """The plan's ``image_budget`` for the image processor config in ``folder``."""
    from kvroom.sources import read_image_processor_config

    return _image_budget(read_image_processor_config(Path(folder)), max_image_pixels, hf_config)


def _image_budget(
    config: dict[str, Any] | None, max_image_pixels: int, hf_config: Any
) -> ImageBudget:
    from kvroom.model_spec import VisionSpec

    vision = VisionSpec.from_hf(hf_config.vision_config.to_dict(), config)
    return image_budget(vision, max_image_pixels)


def check_image_tokens(images: Sequence[ImageInput], max_tokens: int) -> None:
    """Every image within the tokens per image the plan holds.

    The processor keeps an image's pixels under its ``max_pixels``, but not always its tokens:
    it never makes a side shorter than one token, so a very long, thin image (aspect ratio up
    to 200) can take several times ``max_pixels / (patch x merge)^2``.

    Raises:
        ConfigError: an image takes more than ``max_tokens`` tokens.
    """
    for i, image in enumerate(images):
        if image.num_tokens > max_tokens:
            _, h, w = image.grid_thw
            raise ConfigError(
                f"multi_modal_data: image {i} takes {image.num_tokens} tokens after the "
                f"processor's resize ({h}x{w} patches), more than the {max_tokens} per image "
                "the plan holds; crop it closer to square"
            )


def preprocess(images: Sequence[Any], processor: Any) -> list[ImageInput]:
    """PIL images -> ``ImageInput`` s (pixel values, grid, token count, content key)."""
    if not images:
        return []
    out = processor(images=list(images), return_tensors="pt")
    grids = out["image_grid_thw"].tolist()
    merge = processor.merge_size
    inputs, start = [], 0
    for t, h, w in grids:
        n = t * h * w
        pixels = out["pixel_values"][start : start + n].contiguous()
        start += n
        key = hashlib.sha256(pixels.numpy().tobytes() + bytes(str((t, h, w)), "ascii"))
        inputs.append(ImageInput(pixels, (t, h, w), n // merge**2, key.hexdigest()))
    return inputs


def expand_prompt(
    token_ids: Sequence[int], images: Sequence[ImageInput], tokens: ImageTokens
) -> tuple[list[int], MultimodalInputs]:
    """Expand each ``<|image_pad|>`` to its image's tokens and compute M-RoPE positions.

    Raises:
        ConfigError: the prompt's placeholders and the images disagree in number.
    """
    pads = [i for i, t in enumerate(token_ids) if t == tokens.image]
    if len(pads) != len(images):
        raise ConfigError(
            f"multi_modal_data: {len(images)} image(s) but the prompt has {len(pads)} "
            "<|image_pad|> placeholder(s); write <|vision_start|><|image_pad|><|vision_end|> "
            "once per image"
        )
    ids: list[int] = []
    offsets: list[int] = []
    cols: list[torch.Tensor] = []
    pos = 0
    previous = 0
    for pad, image in zip(pads, images, strict=True):
        text = token_ids[previous:pad]
        ids.extend(text)
        cols.append(torch.arange(pos, pos + len(text)).expand(3, -1))
        pos += len(text)
        offsets.append(len(ids))
        ids.extend([tokens.image] * image.num_tokens)
        grid = _image_positions(image.grid_thw, tokens.merge_size, pos)
        cols.append(grid)
        _, h, w = image.grid_thw
        pos += max(h, w) // tokens.merge_size
        previous = pad + 1
    tail = token_ids[previous:]
    ids.extend(tail)
    cols.append(torch.arange(pos, pos + len(tail)).expand(3, -1))
    positions = torch.cat(cols, dim=1)
    delta = int(positions.max()) + 1 - len(ids) if len(ids) else 0
    return ids, MultimodalInputs(tuple(images), tuple(offsets), positions, delta)


def _image_positions(grid_thw: tuple[int, int, int], merge: int, start: int) -> torch.Tensor:
    t, h, w = grid_thw[0], grid_thw[1] // merge, grid_thw[2] // merge
    tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
    return torch.stack([tt, hh, ww]).reshape(3, -1) + start
