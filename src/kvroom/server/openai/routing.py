"""Which model serves a request: the request's ``model`` picks a ``ServerState``.

A server holds one ``ModelRouter`` on ``app.state.kvroom_models``. Every route that talks to a
model takes a lease for the request's ``model`` (``async with router.lease(body.model) as s``):
the lease keeps that model loaded until the handler returns (its engine requests are queued by
then, so an idle-model eviction sees them). ``SingleModel`` is ``kvroom serve ART``; the
multi-model router is ``server/multi/router.py``.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Protocol

from kvroom.server.async_engine import AsyncEngine
from kvroom.server.openai.protocol import ApiError
from kvroom.server.openai.responses import ModelCard
from kvroom.server.openai.serving import ServerState


class ModelRouter(Protocol):
    """What the routes need from the models a server hosts."""

    def lease(self, model: str | None) -> contextlib.AbstractAsyncContextManager[ServerState]:
        """The state serving ``model`` (loaded), kept loaded while the lease is held.

        Raises:
            ApiError: 404 for a model the server does not serve (OpenAI's shape).
        """
        ...

    def cards(self) -> list[ModelCard]:
        """``/v1/models``: one card per served model."""
        ...

    def engines(self) -> list[AsyncEngine]:
        """The engines running now (health, prefix-cache reset, shutdown)."""
        ...

    def render_metrics(self) -> tuple[bytes, str]:
        """The Prometheus exposition and its content type."""
        ...


def model_not_found(model: str, served: list[str]) -> ApiError:
    """A 404 in OpenAI's shape naming what is served."""
    names = ", ".join(f"'{n}'" for n in served)
    verb = "serves" if len(served) == 1 else "serves the models"
    return ApiError(
        404,
        f"The model '{model}' does not exist; this server {verb} {names}",
        param="model",
        code="model_not_found",
    )


class SingleModel:
    """One model (``kvroom serve ART``): ``model`` may be left out or must match its name."""

    def __init__(self, state: ServerState) -> None:
        self.state = state

    @contextlib.asynccontextmanager
    async def lease(self, model: str | None) -> AsyncIterator[ServerState]:
        if model is not None and model != self.state.model_name:
            raise model_not_found(model, [self.state.model_name])
        yield self.state

    def cards(self) -> list[ModelCard]:
        s = self.state
        return [ModelCard(id=s.model_name, root=s.artifact, max_model_len=s.max_seq_len)]

    def engines(self) -> list[AsyncEngine]:
        return [self.state.engine]

    def render_metrics(self) -> tuple[bytes, str]:
        return self.state.metrics.render()
