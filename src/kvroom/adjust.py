"""The one policy for a KV pool size, shared by compile, ``set`` and the start-up override.

- not an int (a bool is not an int here) or <= 0: ``ConfigError`` (a ``ValueError``);
- below ``num_min_blocks`` (one full-length sequence): ``ConfigError`` naming the minimum;
- an estimate below ``num_min_blocks``: ``MemoryNotEnoughError``, whose message starts
  ``Memory is not enough`` and names the term that does not fit (``plan.shortfall``);
- above the estimate: a warning, and the value is honoured (the caller knows its machine).
"""

from __future__ import annotations

import logging

from kvroom.config import DecoderOnlyConfig, NumBlocksAdjuster
from kvroom.errors import ConfigError, KvroomError, MemoryNotEnoughError
from kvroom.plan import MemoryPlan
from kvroom.plan.shortfall import shortfall_message
from kvroom.units import format_bytes

logger = logging.getLogger("kvroom")

SOURCE_NAMES = {"override": "kvcache_num_blocks"}
"""How a size's source is named in messages (a start-up override is the user's
``kvcache_num_blocks``)."""


class AdjusterError(KvroomError, RuntimeError):
    """The user's ``kvcache_num_blocks_adjuster`` raised; the original is the ``__cause__``."""


def resolve_num_blocks(plan: MemoryPlan, cfg: DecoderOnlyConfig) -> MemoryPlan:
    """Choose the pool size at build time: the manual value, else the (adjusted) estimate.

    Raises:
        MemoryNotEnoughError: the estimate is below ``num_min_blocks``.
        ConfigError: the manual or adjusted value is not a positive int, or is below
            ``num_min_blocks``.
        AdjusterError: the adjuster raised.
    """
    if cfg.kvcache_num_blocks is not None:
        n = validate_num_blocks(cfg.kvcache_num_blocks, plan, source="kvcache_num_blocks")
        return plan.with_num_blocks(n, "manual")
    require_estimate_fits(plan)
    if cfg.kvcache_num_blocks_adjuster is None:
        return plan
    adjusted = call_adjuster(cfg.kvcache_num_blocks_adjuster, plan.estimated_num_blocks, cfg)
    n = validate_num_blocks(adjusted, plan, source="kvcache_num_blocks_adjuster")
    return plan.with_num_blocks(n, "adjuster")


def require_estimate_fits(plan: MemoryPlan) -> None:
    """Raise ``MemoryNotEnoughError`` when the budget cannot hold one full-length sequence."""
    if plan.estimated_num_blocks < plan.num_min_blocks:
        raise MemoryNotEnoughError(shortfall_message(plan))


def call_adjuster(adjuster: NumBlocksAdjuster, estimated: int, cfg: DecoderOnlyConfig) -> object:
    """Call the user's adjuster; an exception inside it is chained and marked as coming from it."""
    try:
        return adjuster(estimated, cfg)
    except Exception as exc:
        note = f"raised inside kvcache_num_blocks_adjuster({estimated}, config)"
        exc.add_note(note)
        raise AdjusterError(f"{note}: {type(exc).__name__}: {exc}") from exc


def validate_num_blocks(n: object, plan: MemoryPlan, *, source: str) -> int:
    """Apply the policy to ``n`` (from ``source``, named in messages) and return it.

    Raises:
        ConfigError: ``n`` is not an int, is <= 0, or is below ``plan.num_min_blocks``.
    """
    if isinstance(n, bool) or not isinstance(n, int):
        raise ConfigError(f"{source}: kvcache_num_blocks must be an int, got {n!r}")
    if n <= 0:
        raise ConfigError(f"{source}: kvcache_num_blocks must be > 0, got {n}")
    if n < plan.num_min_blocks:
        raise ConfigError(below_minimum_message(plan, n, source))
    if n > plan.estimated_num_blocks:
        logger.warning(
            "%s: kvcache_num_blocks=%d is above the memory estimate of %d blocks "
            "(%s device memory, %s); honoured, make sure the memory is there",
            source,
            n,
            plan.estimated_num_blocks,
            format_bytes(plan.device_memory_bytes),
            plan.device_memory_source,
        )
    return n


def below_minimum_message(plan: MemoryPlan, requested: int, source: str) -> str:
    """A size below one full-length sequence: the floor is the problem, not the memory."""
    return (
        f"{SOURCE_NAMES.get(source, source)}: {requested} blocks is below the minimum of "
        f"{plan.num_min_blocks} (one max_seq_len={plan.max_seq_len} sequence in blocks of "
        f"{plan.kvcache_block_size} tokens); use at least {plan.num_min_blocks}, or a lower "
        f"max_seq_len at compile"
    )
