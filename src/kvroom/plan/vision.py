"""Memory of images: tokens per image, the vision encoder's peak, the encoder cache.

With ``P = max_image_pixels``, patch ``p``, spatial merge ``m``, ``a`` = activation dtype bytes::

    tokens_per_image   = floor(P / (p x m)^2)              (the processor resizes to <= P pixels)
    image_tokens       = max_images_per_request x tokens_per_image   (must fit in max_seq_len)
    encoder_peak       = a x N x (6 x hidden + intermediate) + 4 x heads x N^2
                         N = P / p^2 patches: residual, norm, qkv, attention out, MLP | fp32 scores
    encoder_cache      = encoder_cache_images x tokens_per_image x out_hidden x (1 + deepstack) x a

``vision_bytes = encoder_peak + encoder_cache``: one image is encoded at a time, and the cache
holds at most ``encoder_cache_images`` outputs, so both are bounded constants of the plan.
"""

from __future__ import annotations

from kvroom.errors import ConfigError
from kvroom.model_spec import VisionSpec
from kvroom.units import DTYPE_BYTES


def tokens_per_image(vision: VisionSpec, max_image_pixels: int) -> int:
    """Decoder tokens of the largest image the processor lets through."""
    unit = (vision.patch_size * vision.spatial_merge_size) ** 2
    return max(1, max_image_pixels // unit)


def encoder_peak_bytes(vision: VisionSpec, max_image_pixels: int, dtype: str) -> int:
    """The formula's ``encoder_peak`` (one image of the largest size)."""
    patches = max(1, max_image_pixels // vision.patch_size**2)
    per_patch = 6 * vision.hidden_size + vision.intermediate_size
    return DTYPE_BYTES[dtype] * patches * per_patch + 4 * vision.num_heads * patches**2


def encoder_cache_bytes(
    vision: VisionSpec, max_image_pixels: int, encoder_cache_images: int, dtype: str
) -> int:
    """The formula's ``encoder_cache``."""
    per_token = vision.out_hidden_size * (1 + vision.num_deepstack) * DTYPE_BYTES[dtype]
    return encoder_cache_images * tokens_per_image(vision, max_image_pixels) * per_token


def vision_bytes(
    vision: VisionSpec,
    *,
    max_images_per_request: int,
    max_image_pixels: int,
    encoder_cache_images: int,
    max_seq_len: int,
    dtype: str,
) -> int:
    """``encoder_peak + encoder_cache``.

    Raises:
        ConfigError: ``max_images_per_request`` images of the largest size do not fit in
            ``max_seq_len`` tokens.
    """
    image_tokens = max_images_per_request * tokens_per_image(vision, max_image_pixels)
    if image_tokens >= max_seq_len:
        raise ConfigError(
            f"max_images_per_request: {max_images_per_request} images of up to "
            f"{max_image_pixels} pixels take {image_tokens} tokens, not below max_seq_len="
            f"{max_seq_len}; lower max_image_pixels or max_images_per_request"
        )
    peak = encoder_peak_bytes(vision, max_image_pixels, dtype)
    return peak + encoder_cache_bytes(vision, max_image_pixels, encoder_cache_images, dtype)
