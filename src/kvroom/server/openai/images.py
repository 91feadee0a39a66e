"""``image_url`` parts of ``/v1/chat/completions``: where an image may come from.

* ``data:image/<type>;base64,...``: decoded in the request;
* ``file:///abs/path`` or a bare absolute path: only inside ``--allowed-local-media-path``
  (resolved, so ``..`` and symlinks cannot leave it); refused when the flag is not given;
* ``http(s)://``: refused, the server never fetches from the network.

Every refusal is an ``ApiError`` 400 naming the part; the server keeps serving.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from kvroom.errors import ConfigError
from kvroom.media import load_image
from kvroom.server.openai.protocol import ApiError


def load_image_url(url: str, allowed_local_media_path: Path | None, index: int) -> Any:
    """The decoded image of the ``index``-th ``image_url`` part.

    Raises:
        ApiError: 400 for a network URL, a local path outside the allowed folder, or an image
            that does not decode.
    """
    where = f"messages: image_url part {index}"
    scheme = urlparse(url).scheme.lower()
    if scheme in ("http", "https"):
        raise ApiError(
            400,
            f"{where}: {scheme} URLs are not fetched (the server makes no network requests); "
            "send the image as a data:image/...;base64 URL",
            param="messages",
            code="invalid_value",
        )
    try:
        if scheme == "data":
            return load_image(url)
        if scheme in ("file", ""):
            return load_image(_local_path(url, allowed_local_media_path, where))
    except ConfigError as exc:
        raise ApiError(400, f"{where}: {exc}", param="messages", code="invalid_value") from exc
    raise ApiError(
        400, f"{where}: unsupported URL scheme {scheme!r}", param="messages", code="invalid_value"
    )


def _local_path(url: str, allowed: Path | None, where: str) -> Path:
    path = Path(unquote(urlparse(url).path) if url.startswith("file:") else url)
    if allowed is None:
        raise ApiError(
            400,
            f"{where}: local files are refused; start the server with "
            "--allowed-local-media-path DIR to allow files under DIR",
            param="messages",
            code="invalid_value",
        )
    resolved = path.resolve()
    if not resolved.is_relative_to(allowed.resolve()):
        raise ApiError(
            400,
            f"{where}: {path} is outside --allowed-local-media-path {allowed}",
            param="messages",
            code="invalid_value",
        )
    return resolved


class ChatImages:
    """What the chat route needs to take images for one model."""

    def __init__(self, model: Any, allowed_local_media_path: Path | None) -> None:
        self.placeholder: str = model.image_placeholder
        self.prepare = model.prepare_prompt
        self.allowed = allowed_local_media_path

    def prepare_prompt(self, ids: list[int], urls: list[str]) -> tuple[list[int], Any]:
        """Expanded prompt ids and the model's multimodal inputs.

        Raises:
            ApiError: 400 for any bad image (see ``load_image_url``) or count.
        """
        images = [load_image_url(u, self.allowed, i) for i, u in enumerate(urls)]
        try:
            return self.prepare(ids, images)
        except ConfigError as exc:
            raise ApiError(400, str(exc), param="messages", code="invalid_value") from exc
