"""Memory of images: tokens per image, the vision encoder's peak, the encoder cache.

The image processor resizes every image to between its ``min_pixels`` and ``max_pixels``;
kvroom caps the second at ``max_image_pixels`` (``image_budget``), so with ``P`` = the smaller
of the two, patch ``p``, spatial merge ``m``, ``a`` = activation dtype bytes::

    tokens_per_image   = floor(P / (p x m)^2)              (the processor resizes to <= P pixels)
    image_tokens       = max_images_per_request x tokens_per_image   (must fit in max_seq_len)
    encoder_peak       = a x N x (6 x hidden + intermediate) + 4 x heads x N^2
                         N = P / p^2 patches: residual, norm, qkv, attention out, MLP | fp32 scores
    encoder_cache      = encoder_cache_images x tokens_per_image x out_hidden x (1 + deepstack) x a

``vision_bytes = encoder_peak + encoder_cache``: one image is encoded at a time, and the cache
holds at most ``encoder_cache_images`` outputs, so both are bounded constants of the plan. The
processor never makes a side shorter than one token, so a long, thin image may resize to more
tokens than ``tokens_per_image``; the runtime refuses it (``check_image_tokens``) rather than
planning every image for that case.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvroom.errors import ConfigError
from kvroom.model_spec import VisionSpec
from kvroom.units import DTYPE_BYTES


@dataclass(frozen=True)
class ImageBudget:
    """The pixels of an image after the processor's resize, as the runtime sets them."""

    min_pixels: int
    max_pixels: int
    limit: str
    """What set ``max_pixels``: ``max_image_pixels`` or ``the processor's max_pixels``."""

    def describe(self) -> str:
        """``at most 16384 pixels: the processor's max_pixels``."""
        return f"at most {self.max_pixels} pixels: {self.limit}"


def image_budget(vision: VisionSpec, max_image_pixels: int) -> ImageBudget:
    """``max_image_pixels`` or the processor's ``max_pixels``, whichever is tighter.

    Raises:
        ConfigError: ``max_image_pixels`` is below the processor's ``min_pixels`` (it scales
            every image up to that).
    """
    low = vision.processor_min_pixels
    if max_image_pixels < low:
        raise ConfigError(
            f"max_image_pixels: {max_image_pixels} is below the image processor's min_pixels="
            f"{low} (it scales every image up to that); give at least {low}"
        )
    if vision.processor_max_pixels < max_image_pixels:
        return ImageBudget(low, vision.processor_max_pixels, "the processor's max_pixels")
    return ImageBudget(low, max_image_pixels, "max_image_pixels")


@dataclass(frozen=True)
class VisionPlan:
    """What images cost a plan."""

    nbytes: int
    """``encoder_peak + encoder_cache``."""
    tokens_per_image: int
    budget: ImageBudget


def tokens_per_image(vision: VisionSpec, max_pixels: int) -> int:
    """Decoder tokens of the largest image the processor lets through."""
    unit = (vision.patch_size * vision.spatial_merge_size) ** 2
    return max(1, max_pixels // unit)


def encoder_peak_bytes(vision: VisionSpec, max_pixels: int, dtype: str) -> int:
    """The formula's ``encoder_peak`` (one image of the largest size)."""
    patches = max(1, max_pixels // vision.patch_size**2)
    per_patch = 6 * vision.hidden_size + vision.intermediate_size
    return DTYPE_BYTES[dtype] * patches * per_patch + 4 * vision.num_heads * patches**2


def encoder_cache_bytes(
    vision: VisionSpec, max_pixels: int, encoder_cache_images: int, dtype: str
) -> int:
    """The formula's ``encoder_cache``."""
    per_token = vision.out_hidden_size * (1 + vision.num_deepstack) * DTYPE_BYTES[dtype]
    return encoder_cache_images * tokens_per_image(vision, max_pixels) * per_token


def plan_vision(
    vision: VisionSpec,
    *,
    max_images_per_request: int,
    max_image_pixels: int,
    encoder_cache_images: int,
    max_seq_len: int,
    dtype: str,
) -> VisionPlan:
    """The image budget, the tokens of one image and ``encoder_peak + encoder_cache``.

    Raises:
        ConfigError: ``max_images_per_request`` images of the largest size do not fit in
            ``max_seq_len`` tokens, or ``max_image_pixels`` is below the processor's minimum.
    """
    budget = image_budget(vision, max_image_pixels)
    tokens = tokens_per_image(vision, budget.max_pixels)
    if max_images_per_request * tokens >= max_seq_len:
        raise ConfigError(
            f"max_images_per_request: {max_images_per_request} images of {budget.describe()} "
            f"take {max_images_per_request * tokens} tokens, not below max_seq_len="
            f"{max_seq_len}; lower max_image_pixels or max_images_per_request"
        )
    peak = encoder_peak_bytes(vision, budget.max_pixels, dtype)
    cache = encoder_cache_bytes(vision, budget.max_pixels, encoder_cache_images, dtype)
    return VisionPlan(peak + cache, tokens, budget)
