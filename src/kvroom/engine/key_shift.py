"""An int4 pool's key shift: the mean key of each layer and kv head, measured once at start-up.

Keys are stored less this mean (``models/kv_quant.py``, "Key shift"), which leaves attention
unchanged and the int4 rounding finer. The mean comes from one forward of
``CALIBRATION_TOKENS`` seeded random token ids (no text is needed: on the default model such
keys gave a mean that served as well as that of 1,024 tokens of English text), read back from
the pool, before the engine serves anything::

    pool blocks 0 .. n/bs-1 (sliding: slot 0)  <- the calibration prompt's K/V, positions 0 .. n-1
    shift[layer] = mean over positions CALIBRATION_SKIP .. n-1 of dequantize(K) H^T

The first positions are left out of the mean: a model's first keys (its attention sink) sit
far from the rest and made the mean depend on the seed (``benchmarks/RESULTS.md``, "KV at 8
and 4 bits"). The blocks the prompt used are free again afterwards: the block manager never
handed them out, and nothing caches them.
"""

from __future__ import annotations

import torch

from kvroom.engine.model_runner import ModelRunner
from kvroom.engine.params.sampling import SamplingParams
from kvroom.engine.sched.output import ScheduledSeq, SchedulerOutput
from kvroom.models import kv_quant
from kvroom.units import cdiv

CALIBRATION_TOKENS = 256
"""Tokens of the calibration prompt (fewer where the step budget or the pool is smaller)."""
CALIBRATION_SKIP = 4
"""First positions left out of the mean."""
CALIBRATION_SEED = 0
MIN_CALIBRATION_TOKENS = 64
"""Below this many tokens the mean is too noisy to help: no shift."""


def calibrate_key_shift(runner: ModelRunner, max_tokens: int) -> torch.Tensor | None:
    """Measure the key shift and hand it to the model (``DecoderModel.set_key_shift``).

    Args:
        runner: a fresh runner (its pool holds nothing yet) over an int4 pool.
        max_tokens: the most tokens one step may run and one sequence may hold
            (``max_num_batched_tokens``, ``max_seq_len``).

    Returns:
        ``[layers, kv_heads, head_dim]`` float32 (zeros for layers without a shift), or None
        where nothing applies: a pool without ``shifts_keys``, a model without such layers,
        or fewer than ``MIN_CALIBRATION_TOKENS`` tokens that fit.
    """
    model, pool = runner.model, runner.pool
    layers = model.key_shift_layers()
    n = min(CALIBRATION_TOKENS, max_tokens, pool.num_blocks * pool.block_size)
    if pool.kv_codec is None or not pool.kv_codec.shifts_keys or not layers:
        return None
    if n < MIN_CALIBRATION_TOKENS:
        return None
    gen = torch.Generator().manual_seed(CALIBRATION_SEED)
    ids = torch.randint(0, runner.spec.vocab_size, (n,), generator=gen).tolist()
    table = tuple(range(cdiv(n, pool.block_size)))
    slot = 0 if pool.sliding_window is not None else None
    seq = ScheduledSeq(0, tuple(ids), 0, table, slot, False, SamplingParams())
    runner.compute_logits(SchedulerOutput((seq,)))
    spec = runner.spec
    shift = torch.zeros(spec.num_layers, spec.num_kv_heads, spec.head_dim)
    for i in layers:
        shift[i] = _mean_key(runner, i, n)
    model.set_key_shift(shift)
    return shift


def _mean_key(runner: ModelRunner, layer: int, n: int) -> torch.Tensor:
    """``[kv_heads, D]`` mean of layer ``layer``'s stored keys at positions ``SKIP .. n-1``,
    dequantized and rotated back."""
    pool = runner.pool
    cache = pool.layers[layer]
    positions = torch.arange(CALIBRATION_SKIP, n)
    if pool.layer_kinds[layer] == "full":  # blocks 0, 1, ...: position p at flat row p
        used = cache[: cdiv(n, pool.block_size)]
        rows = used.reshape(-1, *cache.shape[2:])[positions.to(cache.device), 0]
    else:  # slot 0's ring: position p at entry p % window, the last ``window`` of them kept
        window = cache.shape[1]
        kept = positions[positions >= n - window] % window
        rows = cache[0, kept.to(cache.device), 0]
    assert pool.kv_codec is not None
    keys = kv_quant.decode(rows, torch.float32, pool.kv_codec)
    h = pool.kv_codec.rotation(keys.shape[-1], keys.device)
    return kv_quant.rotate(keys, h).mean(0).cpu()
