"""Read or change an artifact's pool size in place; only kvroom_config.json is rewritten.

``replan`` is the shared core of ``kvroom set`` and of the start-up override of ``run``/``serve``
(which applies the result without writing it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

from kvroom.adjust import require_estimate_fits, validate_num_blocks
from kvroom.artifact.layout import ArtifactInfo, config_path, read_info, write_info
from kvroom.atomic import locked
from kvroom.device import resolve_device_memory
from kvroom.errors import ConfigError
from kvroom.plan import MemoryPlan
from kvroom.units import parse_bytes

AUTO = "auto"


def get_kvcache_num_blocks(path: str | Path) -> int:
    """The pool size recorded in the artifact at ``path``."""
    return read_info(path).num_blocks


def set_kvcache_num_blocks(
    path: str | Path, num_blocks: int | str, *, device_memory: int | str | None = None
) -> MemoryPlan:
    """Validate ``num_blocks`` (an int, or ``"auto"``) and write it into the artifact atomically.

    Under the artifact's lock: read, re-validate, replace kvroom_config.json. Weights are not
    touched. Returns the new plan.
    """
    read_info(path)  # a missing or non-artifact folder fails here, before a lock file is made
    with locked(config_path(Path(path))):
        info = read_info(path)
        plan = replan(info, num_blocks, source="set", device_memory=device_memory)
        write_info(info.with_plan(plan))
    return plan


def startup_plan(
    path: str | Path,
    num_blocks: int | str | None = None,
    *,
    device_memory: int | str | None = None,
    kvcache_reserve_memory: int | str | None = None,
    kvcache_memory_fraction: float | None = None,
    widens_bf16: Callable[[], bool] | None = None,
) -> tuple[ArtifactInfo, MemoryPlan]:
    """The artifact at ``path`` and the plan a start-up override gives it (``replan`` with
    ``source="override"``); the artifact is not changed.

    ``widens_bf16``: asks whether this CPU widens bf16 projections to fp32 at load; the
    measured weights are adjusted to it when the measuring CPU differed
    (``MeasuredTerms.on_cpu``). It is asked only once the artifact has been read (answering
    builds the CPU kernels), so a missing artifact is reported first.
    """
    info = read_info(path)
    if widens_bf16 is not None:
        info = info.with_plan(info.plan.on_cpu(widens_bf16()))
    plan = replan(
        info,
        num_blocks,
        source="override",
        device_memory=device_memory,
        kvcache_reserve_memory=kvcache_reserve_memory,
        kvcache_memory_fraction=kvcache_memory_fraction,
    )
    return info, plan


def replan(
    info: ArtifactInfo,
    num_blocks: int | str | None,
    *,
    source: str,
    device_memory: int | str | None = None,
    kvcache_reserve_memory: int | str | None = None,
    kvcache_memory_fraction: float | None = None,
) -> MemoryPlan:
    """The artifact's plan with another pool size, by the same policy as at build time.

    ``num_blocks`` None keeps the recorded size; an int is validated against the recorded
    estimate (or against a re-fit when a memory knob is given); ``"auto"`` re-estimates for
    this machine (or ``device_memory``) with the persisted declarative policy, or the given one.
    """
    knobs = dict(
        device_memory=device_memory,
        kvcache_reserve_memory=kvcache_reserve_memory,
        kvcache_memory_fraction=kvcache_memory_fraction,
    )
    policy_given = any(v is not None for v in knobs.values())
    if num_blocks is None and not policy_given:
        return info.plan
    if num_blocks is None:
        num_blocks = AUTO
    fitted = refit_for_here(info, **knobs) if num_blocks == AUTO or policy_given else info.plan
    if num_blocks == AUTO:
        require_estimate_fits(fitted)
        return fitted.with_num_blocks(fitted.estimated_num_blocks, "auto")
    n = validate_num_blocks(parse_num_blocks(num_blocks), fitted, source=source)
    return fitted.with_num_blocks(n, source)


def refit_for_here(
    info: ArtifactInfo,
    *,
    device_memory: int | str | None = None,
    kvcache_reserve_memory: int | str | None = None,
    kvcache_memory_fraction: float | None = None,
) -> MemoryPlan:
    """Re-fit the recorded needs into this machine's memory under the (given or saved) policy."""
    config = info.config
    policy = {
        k: v
        for k, v in dict(
            kvcache_reserve_memory=kvcache_reserve_memory,
            kvcache_memory_fraction=kvcache_memory_fraction,
        ).items()
        if v is not None
    }
    if policy:
        config = dataclasses.replace(config, **policy)  # re-validates the knobs
    # The persisted device_memory described the build machine; "here" means probe, unless told.
    memory = resolve_device_memory(config.device, device_memory)
    return info.plan.refit(
        memory,
        kvcache_memory_fraction=config.kvcache_memory_fraction,
        kvcache_reserve_bytes=parse_bytes(config.kvcache_reserve_memory),
    )


def parse_num_blocks(value: int | str) -> int:
    """``"128"`` or ``128`` -> 128; anything else that is not an integer is a ``ConfigError``."""
    if isinstance(value, bool):
        raise ConfigError(f"kvcache_num_blocks: must be an integer or 'auto', got {value!r}")
    if isinstance(value, int):
        return value
    text = str(value).strip()
    if text.lstrip("-").isdigit():
        return int(text)
    raise ConfigError(f"kvcache_num_blocks: must be an integer or 'auto', got {value!r}")
