"""int4 KV row formats compared on the default model: perplexity and key error, in one harness.

The float32 artifact of ``kv_quality.py`` runs its perplexity measure (the same windows), each
layer's K/V rounded first as a candidate int4 format would store them (rotated, rounded,
rotated back), so formats kvroom does not implement are measured the same way as the one it
does; ``affine`` is ``kv_quant``'s own round trip, and ``--key-shift-tokens`` subtracts the
mean key of a calibration forward (``engine/key_shift.py``) before rounding::

    python benchmarks/kv_int4_formats.py --workdir /path/to/workdir \\
        --text /path/to/ARCHITECTURE.md /path/to/README.md \\
        --formats symmetric affine affine-4starts affine-g32 [--key-shift-tokens 256 --seed 0]

Formats (bytes per 64-value row):

* ``symmetric`` (36): levels -7..7, a float32 scale, the best of 1.0/0.9/0.8/0.7 x max|x| / 7;
* ``affine`` (36): ``kv_quant``'s int4 row (16 levels, float16 scale and min, fitted);
* ``affine-4starts`` (36): its fit from four narrowed ranges (1.0, 0.9, 0.8, 0.7), the best kept;
* ``affine-g32`` (40): ``affine`` per group of 32 values (two float16 scale and min pairs).

Prints one JSON line per format: perplexity, its ratio to ``--reference`` (an artifact of
``kv_quality.py``, default bfloat16), and the keys' squared error over their squared norm
(rotated, after the shift).
"""

from __future__ import annotations

import json
from collections.abc import Callable

import torch
from kv_quality import artifact, perplexity, text_windows, workdir_and_text_parser

from kvroom import LLM, SamplingParams
from kvroom.engine import key_shift
from kvroom.engine.sched.output import ScheduledSeq, SchedulerOutput
from kvroom.models import decoder, kv_quant

Rounding = Callable[[torch.Tensor], torch.Tensor]


def symmetric(x: torch.Tensor) -> torch.Tensor:
    full = x.abs().amax(-1, keepdim=True) / 7
    best, best_err = x, None
    for ratio in (1.0, 0.9, 0.8, 0.7):
        scale = full * ratio
        y = torch.round(x / scale.clamp_min(1e-30)).clamp(-7, 7) * scale
        err = (y - x).square().sum(-1, keepdim=True)
        if best_err is None:
            best, best_err = y, err
        else:
            best, best_err = torch.where(err < best_err, y, best), torch.minimum(err, best_err)
    return best


def affine(x: torch.Tensor) -> torch.Tensor:
    return kv_quant.dequantize(kv_quant.quantize(x, 4), 4, torch.float32)


def affine_4starts(x: torch.Tensor) -> torch.Tensor:
    start = kv_quant.AFFINE_START
    best, best_err = x, None
    try:
        for ratio in (1.0, 0.9, 0.8, 0.7):
            kv_quant.AFFINE_START = ratio
            y = affine(x)
            err = (y - x).square().sum(-1, keepdim=True)
            if best_err is None:
                best, best_err = y, err
            else:
                best = torch.where(err < best_err, y, best)
                best_err = torch.minimum(err, best_err)
    finally:
        kv_quant.AFFINE_START = start
    return best


def affine_g32(x: torch.Tensor) -> torch.Tensor:
    return affine(x.unflatten(-1, (-1, 32))).flatten(-2)


FORMATS: dict[str, Rounding] = {
    "symmetric": symmetric,
    "affine": affine,
    "affine-4starts": affine_4starts,
    "affine-g32": affine_g32,
}


def mean_keys(llm: LLM, tokens: int, seed: int) -> torch.Tensor:
    """``[layers, kv_heads, D]`` mean key of positions ``CALIBRATION_SKIP .. tokens - 1`` after
    a forward of ``tokens`` seeded random ids (float32 pool: the keys as computed)."""
    runner, pool = llm.runtime.runner, llm.runtime.pool
    ids = torch.randint(
        0, runner.spec.vocab_size, (tokens,), generator=torch.Generator().manual_seed(seed)
    )
    table = tuple(range(-(-tokens // pool.block_size)))
    seq = ScheduledSeq(0, tuple(ids.tolist()), 0, table, None, False, SamplingParams())
    runner.compute_logits(SchedulerOutput((seq,)))
    skip = key_shift.CALIBRATION_SKIP
    return torch.stack([t[: len(table)].flatten(0, 1)[skip:tokens, 0].mean(0) for t in pool.layers])


def rounded_attention(rounding: Rounding, shift: torch.Tensor | None, stats: list[float]):
    """``decoder.paged_attention`` over K/V rounded by ``rounding`` (rotated, as stored)."""
    attend, h = decoder.paged_attention, kv_quant.hadamard(64)
    layer = iter(range(10**12))

    def paged_attention(q, kv, cache, batch, scale, softcap=None, key_shift=None):
        i = next(layer) % len(shift) if shift is not None else 0
        x = kv.float()
        k = x[:, 0] - (shift[i] if shift is not None else 0)
        kr, vr = k @ h, x[:, 1] @ h
        k_back = rounding(kr)
        stats[0] += (k_back - kr).square().sum().item()
        stats[1] += kr.square().sum().item()
        k = k_back @ h + (shift[i] if shift is not None else 0)
        out = torch.stack([k, rounding(vr) @ h], dim=1).to(kv.dtype)
        return attend(q, out, cache, batch, scale, softcap)

    return paged_attention


def main() -> None:
    parser = workdir_and_text_parser(__doc__.splitlines()[0])
    parser.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS))
    parser.add_argument("--key-shift-tokens", type=int, default=0, help="0: no key shift")
    parser.add_argument("--seed", type=int, default=key_shift.CALIBRATION_SEED)
    parser.add_argument("--reference", default="bfloat16")
    args = parser.parse_args()
    text = "\n\n".join(p.read_text() for p in args.text)
    ref = LLM(str(artifact(args.workdir, args.reference)), kvcache_num_blocks=512)
    base = perplexity(ref, text_windows(ref, text, 1024, 8))
    del ref
    llm = LLM(str(artifact(args.workdir, "float32")), kvcache_num_blocks=512)
    windows = text_windows(llm, text, 1024, 8)
    shift = mean_keys(llm, args.key_shift_tokens, args.seed) if args.key_shift_tokens else None
    attend = decoder.paged_attention
    for name in args.formats:
        stats = [0.0, 0.0]
        decoder.paged_attention = rounded_attention(FORMATS[name], shift, stats)
        try:
            ppl = perplexity(llm, windows)
        finally:
            decoder.paged_attention = attend
        row = {"format": name, "key_shift_tokens": args.key_shift_tokens, "seed": args.seed}
        row |= {"perplexity": ppl, f"vs_{args.reference}": ppl / base - 1}
        print(json.dumps(row | {"key_sq_error": stats[0] / stats[1]}), flush=True)


if __name__ == "__main__":
    main()
