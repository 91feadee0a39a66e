"""Run a kvroom artifact under vLLM: ``vllm.LLM`` keyword arguments and ``vllm serve`` flags
(the launcher that checks vLLM's KV line against the plan is ``kvroom.integrations.vllm_serve``).

An artifact is a plain Hugging Face folder, so vLLM loads it as it is; what vLLM cannot read
from the folder is the pool kvroom chose, and that is what these arguments carry::

    plan_tokens = kvcache_num_blocks x kvcache_block_size              (kvroom's pool)
    vllm_blocks = floor(plan_tokens / vllm_block_size)                 (never past the plan)
    kv_cache_memory_bytes = vllm_blocks x vllm_block_size x kv_bytes_per_token_per_rank

vLLM is never imported here: it lives in its own environment (it pins torch and
transformers), so kvroom only computes arguments and starts a process.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvroom.artifact.layout import GGUF_WEIGHTS, ArtifactInfo
from kvroom.artifact.resize import startup_plan
from kvroom.errors import ArtifactError, ConfigError
from kvroom.plan import MemoryPlan
from kvroom.units import KV_QUANT_BITS, cdiv

POOLS: tuple[str, ...] = ("blocks", "bytes")
CPU_BLOCK_SIZE = 128  # vLLM's block size on its CPU backend when none is given
CUDA_BLOCK_SIZE = 16  # vLLM's default on CUDA
POOL_KEYS = ("num_gpu_blocks_override", "kv_cache_memory_bytes")
KV_CACHE_DTYPES = {"float8_e4m3fn": "fp8_e4m3", "float8_e5m2": "fp8_e5m2"}
"""kvroom kv_dtype -> vLLM kv_cache_dtype, where the KV dtype differs from the model's."""


class VllmPoolTooSmallError(ConfigError):
    """The plan's pool, in whole vLLM blocks, cannot serve one request under vLLM."""


@dataclass(frozen=True)
class VllmPool:
    """The artifact's KV pool in vLLM's units. Bytes are per rank."""

    block_size: int
    """vLLM tokens per block."""
    num_blocks: int
    """floor(plan_tokens / block_size)."""
    bytes_per_block: int
    """One vLLM block of every full-attention layer on one rank."""
    plan_tokens: int
    """kvcache_num_blocks x kvcache_block_size of the plan."""
    max_model_len: int
    kv_cache_memory_bytes: int
    """num_blocks x bytes_per_block; for a sliding-window model the plan's whole KV bytes."""
    comparable: bool
    """True when vLLM's KV line counts the same tokens (full attention only)."""

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def expected_kv_tokens(self) -> int:
        """What vLLM logs: concurrency x max_model_len = num_blocks / cdiv(L, V) x L, which is
        num_blocks x V when max_model_len is a multiple of V (vLLM's get_kv_cache_capacity)."""
        per_request = cdiv(self.max_model_len, self.block_size)
        return int(self.num_blocks / per_request * self.max_model_len)


@dataclass(frozen=True)
class VllmLaunch:
    """Everything needed to start vLLM on an artifact: its arguments and the pool to check."""

    args: dict[str, Any]
    pool: VllmPool
    plan: MemoryPlan
    target: str
    """cpu or cuda: the vLLM backend the arguments are for."""


def engine_args(path: str | Path, **overrides: Any) -> dict[str, Any]:
    """Keyword arguments for ``vllm.LLM(**args)`` / ``vllm.EngineArgs`` that reproduce the
    artifact: model folder, dtype, ``max_model_len``, ``max_num_seqs``,
    ``max_num_batched_tokens``, ``tensor_parallel_size``, ``block_size`` and the KV pool.

    kvroom's overrides (keyword-only): ``device`` ("cpu"/"cuda", default the artifact's),
    ``block_size`` (vLLM's; default 128 on CPU, 16 on CUDA), ``pool`` ("blocks"/"bytes"), and the
    start-up override of ``kvroom run``/``serve``: ``kvcache_num_blocks`` (N or "auto"),
    ``device_memory``, ``kvcache_reserve_memory``, ``kvcache_memory_fraction`` (``replan``).
    Any other keyword is a vLLM engine argument passed through (``enforce_eager=True``, ...).

    The pool knob:

    - ``kv_cache_memory_bytes`` = vllm_blocks x vllm_block_size x KV bytes per token per rank,
      on the CPU backend and for models with sliding-window layers. vLLM's CPU worker reserves
      ``gpu_memory_utilization`` (0.92) x RAM at start unless it is given a byte size, and
      refuses to start when that much is not free, as on any shared machine; an explicit size
      skips that reservation. A hybrid model's sliding and full layers share one vLLM pool, so
      block counts do not correspond there, but the bytes kvroom planned do.
    - ``num_gpu_blocks_override`` = vllm_blocks on CUDA (full attention): the count is exact
      whatever vLLM's profiling or page padding finds; ``gpu_memory_utilization`` carries the
      artifact's ``kvcache_memory_fraction`` for vLLM's start-up memory check.

    vllm_blocks = floor(plan tokens / vLLM block size): never rounded up past the plan.

    Raises:
        VllmPoolTooSmallError: the pool is under one vLLM block, or under vLLM's minimum for one
            ``max_model_len`` request (its null block + cdiv(max_model_len, block_size)).
        ConfigError: a bad knob, or an argument that must come from the artifact.
    """
    return prepare(path, **overrides).args


def prepare(
    path: str | Path,
    *,
    device: str | None = None,
    block_size: int | None = None,
    pool: str | None = None,
    kvcache_num_blocks: int | str | None = None,
    device_memory: int | str | None = None,
    kvcache_reserve_memory: int | str | None = None,
    kvcache_memory_fraction: float | None = None,
    **vllm_overrides: Any,
) -> VllmLaunch:
    """``engine_args`` with the pool it encodes (see there for the arguments).

    Raises:
        ArtifactError: the artifact keeps GGUF weights as shipped (vLLM runs no GGUF).
    """
    require_vllm_weights(Path(path))
    info, plan = startup_plan(
        path,
        kvcache_num_blocks,
        device_memory=device_memory,
        kvcache_reserve_memory=kvcache_reserve_memory,
        kvcache_memory_fraction=kvcache_memory_fraction,
    )
    target = target_of(device or info.config.device)
    size = default_block_size(target) if block_size is None else block_size
    choice = choose_pool(plan, target, pool)
    vpool = vllm_pool(plan, size)
    args = {**artifact_args(info, plan, size), **pool_args(plan, vpool, choice, target)}
    fixed = sorted(set(vllm_overrides) & {*args, *POOL_KEYS} - {"gpu_memory_utilization"})
    if fixed:
        raise ConfigError(
            f"{', '.join(fixed)}: set by the artifact; change it with kvroom "
            "(kvcache_num_blocks=N for the pool, block_size=V for vLLM's block size)"
        )
    return VllmLaunch({**args, **vllm_overrides}, vpool, plan, target)


def require_vllm_weights(folder: Path) -> None:
    """Refuse, in one line, an artifact whose weights vLLM cannot load (``model.gguf``)."""
    if (folder / GGUF_WEIGHTS).is_file():
        raise ArtifactError(
            f"{folder}: its weights are a GGUF kept as shipped, which vLLM does not run; "
            "for vLLM compile a dequantized artifact: kvroom compile MODEL --dequantize -o OUT"
        )


def artifact_args(info: ArtifactInfo, plan: MemoryPlan, block_size: int) -> dict[str, Any]:
    """The engine arguments that describe the model and its limits."""
    return {
        "model": str(info.folder),
        "dtype": info.config.dtype,
        "kv_cache_dtype": kv_cache_dtype(info.config.dtype, plan.kv_dtype),
        "max_model_len": plan.max_seq_len,
        "max_num_seqs": plan.batch_size,
        "max_num_batched_tokens": info.config.max_num_batched_tokens,
        "tensor_parallel_size": plan.tensor_parallel_size,
        "block_size": block_size,
    }


def pool_args(plan: MemoryPlan, pool: VllmPool, choice: str, target: str) -> dict[str, Any]:
    """``kv_cache_memory_bytes``, or ``num_gpu_blocks_override`` (+ the fraction on CUDA)."""
    if choice == "bytes":
        return {"kv_cache_memory_bytes": pool.kv_cache_memory_bytes}
    args: dict[str, Any] = {"num_gpu_blocks_override": pool.num_blocks}
    if target == "cuda":
        args["gpu_memory_utilization"] = plan.kvcache_memory_fraction
    return args


def target_of(device: str) -> str:
    """``cpu`` or ``cuda`` (vLLM takes no device index: pick the GPU with CUDA_VISIBLE_DEVICES)."""
    kind = str(device).partition(":")[0].strip().lower()
    if kind not in ("cpu", "cuda"):
        raise ConfigError(f"device: vLLM targets cpu or cuda, got {device!r}")
    return kind


def default_block_size(target: str) -> int:
    return CPU_BLOCK_SIZE if target == "cpu" else CUDA_BLOCK_SIZE


def choose_pool(plan: MemoryPlan, target: str, pool: str | None) -> str:
    """bytes on CPU and for sliding-window models, blocks on CUDA (see ``engine_args``)."""
    hybrid = plan.sliding_window_bytes > 0
    if pool is None:
        return "bytes" if target == "cpu" or hybrid else "blocks"
    if pool not in POOLS:
        raise ConfigError(f"pool: must be one of {', '.join(POOLS)}, got {pool!r}")
    if pool == "blocks" and hybrid:
        raise ConfigError(
            "pool: 'blocks' cannot express a model with sliding-window layers (vLLM shares one "
            "pool between layer kinds); use 'bytes'"
        )
    return pool


def kv_cache_dtype(dtype: str, kv_dtype: str) -> str:
    """vLLM's ``kv_cache_dtype``: "auto" (the model's dtype) or an fp8 kind."""
    if kv_dtype == dtype:
        return "auto"
    if kv_dtype in KV_CACHE_DTYPES:
        return KV_CACHE_DTYPES[kv_dtype]
    if kv_dtype in KV_QUANT_BITS:
        raise ConfigError(
            f"kv_dtype: vLLM's CPU backend has no {kv_dtype} KV cache (its per-token-head int8/"
            "int4 KV is GPU-only); rebuild with --kv-dtype fp8 or the model dtype to hand off"
        )
    raise ConfigError(
        f"kv_dtype: vLLM keeps KV in the model dtype or fp8; kv_dtype {kv_dtype} with dtype "
        f"{dtype} has no vLLM equivalent; rebuild with kv_dtype equal to dtype"
    )


def vllm_pool(plan: MemoryPlan, block_size: int) -> VllmPool:
    """The plan's pool in whole vLLM blocks of ``block_size`` tokens (rounded down).

    Raises:
        VllmPoolTooSmallError: fewer than one block, or fewer than vLLM needs for one
            max_model_len request: cdiv(max_model_len, block_size) + 1 (vLLM's null block).
    """
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ConfigError(f"block_size: must be a positive integer, got {block_size!r}")
    tokens = plan.num_tokens
    num_blocks = tokens // block_size
    pool_text = f"{plan.num_blocks} blocks x {plan.kvcache_block_size} = {tokens} tokens"
    if num_blocks == 0:
        raise VllmPoolTooSmallError(
            f"Memory is not enough for vLLM: the plan's pool ({pool_text}) is less than one "
            f"vLLM block of {block_size} tokens; raise kvcache_num_blocks to at least "
            f"{cdiv(block_size, plan.kvcache_block_size)} or pass a smaller vLLM block size"
        )
    need = cdiv(plan.max_seq_len, block_size) + 1
    if num_blocks < need and plan.sliding_window_bytes == 0:
        raise VllmPoolTooSmallError(
            f"Memory is not enough for vLLM: the plan's pool ({pool_text}) is {num_blocks} "
            f"vLLM blocks of {block_size}; one request of max_model_len {plan.max_seq_len} "
            f"needs {need} (vLLM holds one back); raise kvcache_num_blocks to at least "
            f"{cdiv(need * block_size, plan.kvcache_block_size)}"
        )
    per_token, rest = divmod(plan.kv_bytes_per_block_per_rank, plan.kvcache_block_size)
    assert rest == 0, "kv_bytes_per_block is layers x block_size x bytes per token"
    per_block = per_token * block_size
    hybrid = plan.sliding_window_bytes > 0
    return VllmPool(
        block_size=block_size,
        num_blocks=num_blocks,
        bytes_per_block=per_block,
        plan_tokens=tokens,
        max_model_len=plan.max_seq_len,
        kv_cache_memory_bytes=plan.kv_bytes if hybrid else num_blocks * per_block,
        comparable=not hybrid,
    )


def cli_flags(args: Mapping[str, Any]) -> list[str]:
    """``vllm serve`` arguments: the model folder, then ``--kebab-case VALUE`` per key."""
    out = [str(args["model"])]
    for key, value in args.items():
        name = "--" + key.replace("_", "-")
        if key == "model" or value is None:
            continue
        if isinstance(value, bool):
            out.append(name if value else "--no-" + key.replace("_", "-"))
        else:
            out += [name, str(value)]
    return out
