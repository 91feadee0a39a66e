"""Images in: a PIL image, bytes, a local path or a ``data:`` URL -> a decoded RGB PIL image.

Transparency is composited onto white, as transformers' image processors do (``convert_to_rgb``),
so a PNG with an alpha channel reaches the vision tower as it reaches transformers' (dropping
the alpha channel instead would show the vision tower what lies under transparent pixels).

Nothing here fetches from the network; the server decides which local paths a request may
name (``--allowed-local-media-path``) before it calls ``load_image``.
"""

from __future__ import annotations

import base64
import binascii
import io
from pathlib import Path
from typing import Any

from kvroom.errors import ConfigError

SUPPORTED_FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP")
"""Image formats accepted (as Pillow names them)."""


def load_image(item: Any) -> Any:
    """Decode one image.

    Args:
        item: a ``PIL.Image.Image``, ``bytes``, a ``data:image/...;base64,`` URL, or a path.

    Raises:
        ConfigError: the item cannot be read or decoded, or its format is not supported.
    """
    from PIL import Image

    if isinstance(item, Image.Image):
        return to_rgb(item)
    if isinstance(item, bytes | bytearray):
        return _decode(bytes(item), "image bytes")
    if isinstance(item, str) and item.startswith("data:"):
        return _decode(decode_data_url(item), "data: URL")
    if isinstance(item, str | Path):
        path = Path(item)
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise ConfigError(f"image {str(item)[:80]!r}: cannot read ({exc.strerror})") from None
        return _decode(data, str(path))
    raise ConfigError(
        f"image: expected a PIL image, bytes, a path or a data: URL, got {type(item).__name__}"
    )


def to_rgb(image: Any) -> Any:
    """``image`` as RGB, transparent pixels composited onto white."""
    from PIL import Image

    if "A" not in image.getbands() and image.info.get("transparency") is None:
        return image.convert("RGB")
    rgba = image.convert("RGBA")
    white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    return Image.alpha_composite(white, rgba).convert("RGB")


def decode_data_url(url: str) -> bytes:
    """The bytes of ``data:<mime>;base64,<payload>``.

    Raises:
        ConfigError: not a base64 ``data:`` URL of an image.
    """
    header, sep, payload = url.partition(",")
    if not sep or not header.endswith(";base64") or not header[5:].startswith("image/"):
        raise ConfigError(f"image_url: expected data:image/<type>;base64,..., got {header[:40]!r}")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ConfigError("image_url: the data: URL's base64 payload does not decode") from None


def _decode(data: bytes, what: str) -> Any:
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data))
        fmt = image.format
        if fmt not in SUPPORTED_FORMATS:
            raise ConfigError(
                f"{what}: unsupported image format {fmt}; supported: {', '.join(SUPPORTED_FORMATS)}"
            )
        return to_rgb(image)
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"{what}: not a decodable image ({type(exc).__name__})") from None
