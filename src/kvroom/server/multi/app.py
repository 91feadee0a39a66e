"""A multi-model server: several artifacts, one budget, one arbiter thread.

Start-up, in order (``kvroom serve A B C``): read every artifact's plan (no weights), build
each model's cost (``plan/budget.ModelCost``), refuse a set whose floors do not fit the budget
(``Memory is not enough``, naming the models), load every model with its share
(``SharedBudget.split``), then serve; the arbiter ticks every ``policy.interval_s`` while the
app runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI

from kvroom.errors import ConfigError
from kvroom.plan.budget import ModelCost
from kvroom.server.app import install_routes
from kvroom.server.limits import DEFAULT_MAX_REQUEST_BYTES
from kvroom.server.multi.admin import install_multi_admin
from kvroom.server.multi.arbiter import ArbiterPolicy
from kvroom.server.multi.budget_source import FixedBudget
from kvroom.server.multi.models import MultiModels
from kvroom.server.multi.slot import ModelEntry, ModelSlot

logger = logging.getLogger("kvroom")


def build_models(
    entries: list[ModelEntry],
    budget: FixedBudget,
    *,
    policy: ArbiterPolicy | None = None,
    load_options: dict[str, Any] | None = None,
) -> MultiModels:
    """The slots of ``entries`` (nothing loaded yet; ``MultiModels.load_all`` loads them).

    Raises:
        ConfigError: two entries share a served name; a floor below one sequence.
        ArtifactError: an artifact cannot be read.
    """
    from kvroom.artifact.resize import startup_plan
    from kvroom.models.layers import widens_bf16_weights

    names = [e.name for e in entries]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ConfigError(
            f"--served-model-name: {', '.join(twice)} is served twice; give each artifact its "
            "own name (--served-model-name once per artifact, in order)"
        )
    options = {"device": None, "enable_prefix_caching": True} | (load_options or {})
    here = None if options["device"] not in (None, "cpu") else widens_bf16_weights
    slots = []
    for entry in entries:
        _, plan = startup_plan(entry.artifact, widens_bf16=here)
        cost = ModelCost.of(entry.name, plan, min_blocks=entry.min_blocks, priority=entry.priority)
        slots.append(ModelSlot(entry, cost, plan.max_seq_len, options))
    return MultiModels(slots, budget, policy or ArbiterPolicy())


class ArbiterThread:
    """Calls ``models.tick()`` every ``interval_s`` (a daemon thread); a failed tick is logged
    and the next one runs."""

    def __init__(self, models: MultiModels) -> None:
        self.models = models
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvroom-arbiter", daemon=True)
        self.num_errors = 0

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.models.policy.interval_s):
            try:
                self.models.tick()
            except Exception as exc:  # one refused move must not end the arbitration
                self.num_errors += 1
                logger.warning("arbiter: %s: %s", type(exc).__name__, exc)


def create_multi_app(
    models: MultiModels,
    *,
    api_key: str | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    admin_key: str | None = None,
) -> FastAPI:
    """An app over ``models`` (loaded: ``load_all`` first); the arbiter runs while it does."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        arbiter = ArbiterThread(models)
        arbiter.start()
        try:
            yield
        finally:
            await asyncio.to_thread(arbiter.stop)
            await asyncio.to_thread(models.shutdown)

    app = FastAPI(title="kvroom", lifespan=lifespan)
    install_multi_admin(app, models, admin_key)
    install_routes(app, models, api_key=api_key, max_request_bytes=max_request_bytes)
    return app
