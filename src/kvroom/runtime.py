"""Assemble a running engine from an artifact: plan -> pool -> model -> runner -> scheduler.

The pool is sized by the plan it is given (the artifact's, or a start-up override of it) and
is allocated once, here; nothing else allocates KV memory.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvroom import heap
from kvroom.artifact.layout import HF_CONFIG, ArtifactInfo
from kvroom.config import validate_device_name
from kvroom.engine.engine import LLMEngine
from kvroom.engine.key_shift import calibrate_key_shift
from kvroom.engine.kv.block_manager import BlockManager
from kvroom.engine.kv.heap_guard import HeapGuard
from kvroom.engine.kv.pool import KVCachePool
from kvroom.engine.model_runner import ModelRunner, load_model
from kvroom.engine.sched.scheduler import Scheduler
from kvroom.engine.structured.grammar import GrammarCompiler
from kvroom.errors import ConfigError
from kvroom.model_spec import ModelSpec
from kvroom.models.kv_quant import codec_for, pool_dtype
from kvroom.plan import MemoryPlan

logger = logging.getLogger("kvroom")


@dataclass
class Runtime:
    """The pieces of a loaded artifact, kept together for the facades and the server."""

    info: ArtifactInfo
    plan: MemoryPlan
    spec: ModelSpec
    pool: KVCachePool
    runner: ModelRunner
    engine: LLMEngine
    tokenizer: Any | None


def _heap_guard(plan: MemoryPlan, pool: KVCachePool, device: str) -> HeapGuard | None:
    """A guard that holds the process under the plan's total for the pool's size now, with
    the plan's room for one step kept free (CPU plans with measured terms only)."""
    if plan.measured is None or not str(device).startswith("cpu"):
        return None

    def total_bytes(serving: bool) -> int:
        now = plan.with_num_blocks(pool.num_blocks, plan.num_blocks_source)
        return now.serve_total_bytes if serving else now.total_bytes

    return HeapGuard(total_bytes, plan.measured.step_bytes, settled=lambda: pool.populated)


def require_device(device: str) -> None:
    """Check that this process can run on ``device`` before any weight is loaded.

    Raises:
        ConfigError: an unknown device name, or a CUDA device this machine does not have.
    """
    validate_device_name(device)
    if not device.startswith("cuda"):
        return
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise ConfigError(
            f"device: {device!r} requested but CUDA is not available here (torch "
            f"{torch.__version__}); run with --device cpu"
        )
    index = torch.device(device).index or 0
    if index >= count:
        raise ConfigError(
            f"device: {device!r} requested but this machine has {count} CUDA device(s): "
            f"use cuda:0 to cuda:{count - 1}"
        )


def read_spec(folder: Path) -> ModelSpec:
    return ModelSpec.from_hf_config(json.loads((folder / HF_CONFIG).read_text()))


def build_runtime(
    info: ArtifactInfo,
    plan: MemoryPlan,
    *,
    device: str | None = None,
    tokenizer: Any | None = None,
    max_num_blocks: int | None = None,
    enable_prefix_caching: bool = True,
) -> Runtime:
    """Load the weights, allocate exactly ``plan.num_blocks`` blocks, and wire the engine.

    The pool reserves room to grow live up to ``max_num_blocks`` (default: the larger of
    ``plan.num_full_blocks`` and ``plan.num_blocks``); only ``plan.num_blocks`` are committed.
    Prefix caching stays off for models with sliding-window layers (``prefix_caching_for``).
    """
    import torch

    heap.configure()  # before the runtime starts threads (see kvroom/heap.py)
    device = device or info.config.device
    require_device(device)
    cfg = info.config
    model = load_model(info.folder, getattr(torch, cfg.dtype), device, cfg.quantization)
    return assemble_runtime(
        info,
        plan,
        model,
        device=device,
        tokenizer=tokenizer,
        max_num_blocks=max_num_blocks,
        enable_prefix_caching=enable_prefix_caching,
    )


def assemble_runtime(
    info: ArtifactInfo,
    plan: MemoryPlan,
    model: Any,
    *,
    device: str | None = None,
    tokenizer: Any | None = None,
    max_num_blocks: int | None = None,
    enable_prefix_caching: bool = True,
) -> Runtime:
    """Allocate exactly ``plan.num_blocks`` blocks and wire the engine around a loaded model
    (``build_runtime`` without the load; the profiling pass measures the two apart)."""

    cfg = info.config
    device = device or cfg.device
    spec = read_spec(info.folder)
    kinds = spec.layer_kinds(cfg.max_seq_len)
    num_slots = cfg.batch_size if "sliding" in kinds else 0
    if hasattr(model, "configure_multimodal"):
        model.configure_multimodal(info.folder, cfg)
    pool = KVCachePool(
        spec,
        num_blocks=plan.num_blocks,
        max_seq_len=cfg.max_seq_len,
        block_size=cfg.kvcache_block_size,
        num_sliding_slots=num_slots,
        dtype=pool_dtype(cfg.kv_dtype or cfg.dtype),
        device=device,
        max_num_blocks=max_num_blocks or max(plan.num_full_blocks, plan.num_blocks),
        kv_codec=codec_for(cfg.kv_dtype or cfg.dtype, cfg.kv_rotation or "none"),
    )
    eos_ids = _eos_ids(info.folder, tokenizer)
    grammars = None if tokenizer is None else GrammarCompiler(tokenizer, spec.vocab_size, eos_ids)
    runner = ModelRunner(
        model, pool, spec, block_size=cfg.kvcache_block_size, device=device, grammars=grammars
    )
    _calibrate_key_shift(runner, min(cfg.max_num_batched_tokens, cfg.max_seq_len))
    blocks = BlockManager(
        plan.num_blocks,
        cfg.kvcache_block_size,
        num_sliding_slots=num_slots,
        enable_prefix_caching=prefix_caching_for(enable_prefix_caching, num_slots),
    )
    scheduler = Scheduler(
        blocks,
        max_num_seqs=cfg.batch_size,
        max_seq_len=cfg.max_seq_len,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
    )
    engine = LLMEngine(
        scheduler,
        runner,
        eos_token_ids=eos_ids,
        detokenize=_detokenizer(tokenizer),
        pool=pool,
        grammars=grammars,
        heap_guard=_heap_guard(plan, pool, device),
    )
    logger.info(plan.summary_line())
    return Runtime(info, plan, spec, pool, runner, engine, tokenizer)


def _calibrate_key_shift(runner: ModelRunner, max_tokens: int) -> None:
    """An int4 pool's key shift (``engine/key_shift.py``), measured before anything is served."""
    start = time.perf_counter()
    if calibrate_key_shift(runner, max_tokens) is not None:
        took = time.perf_counter() - start
        logger.info("int4 KV: key shift measured in %.2f s (one calibration forward)", took)


def prefix_caching_for(requested: bool, num_sliding_slots: int) -> bool:
    """Prefix caching as asked, but off (logged) when sliding-window rings hold the K/V."""
    if requested and num_sliding_slots:
        logger.info(
            "prefix caching is off: this model has sliding-window layers, whose per-sequence "
            "K/V rings cannot be shared or cached"
        )
        return False
    return requested


def _eos_ids(folder: Path, tokenizer: Any | None) -> set[int]:
    """EOS ids of generation_config.json (an int or a list), else config.json, else tokenizer."""
    ids: set[int] = set()
    for name in ("generation_config.json", HF_CONFIG):
        path = folder / name
        if path.is_file():
            value = json.loads(path.read_text()).get("eos_token_id")
            if value is not None:
                ids.update(value if isinstance(value, list) else [value])
                break
    if not ids and tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids


def _detokenizer(tokenizer: Any | None) -> Any | None:
    if tokenizer is None:
        return None

    def detokenize(ids: list[int], skip_special_tokens: bool = True) -> str:
        return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    return detokenize
