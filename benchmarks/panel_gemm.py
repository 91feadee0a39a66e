"""The native panel GEMM against oneDNN's prepacked GEMM on one model's projections.

.venv/bin/python benchmarks/panel_gemm.py [--rows 1,8,16,32,64,128,512] [--layers 30]
    [--dtype float32|bfloat16] [--against OTHER.cpp]

SmolLM2-135M's shapes by default (per layer: qkv 576x960, o 576x576, gate/up 576x3072, down
1536x576; then the 576x49152 LM head), each layer's weights distinct, so a step reads them
cold as decode does. Per row count, the two take turns for ``--rounds`` (5) after a warm-up;
the median step time of each and their ratio are printed. Needs the native kernels and an AVX2 or
AVX-512 CPU (bf16: one without AMX; ``kvroom.models.kernels``); oneDNN runs bf16 as its prepacked
bf16 GEMM where the CPU has one, else as fp32 over weights widened at load.

``--against OTHER.cpp`` times the panel GEMM of another version of the kernels' source instead
of oneDNN (built with the same flags into a temporary folder, loaded beside the package's own;
the two products must be equal), e.g. the last commit's (the headers beside it)::

    git archive HEAD~1 src/kvroom/models/kernels | tar -x -C /path/to/before
    .venv/bin/python benchmarks/panel_gemm.py --rows 1,32,512 \
        --against /path/to/before/src/kvroom/models/kernels/cpu_kernels.cpp
"""

from __future__ import annotations

import argparse
import functools
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from kvroom.models import layers
from kvroom.models.kernels import cpu_kernels, ops
from kvroom.models.kernels.build import build_library

SHAPES = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576)}
HEAD = (576, 49152)
Gemm = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def step_time(
    weights: list[list[torch.Tensor]],
    dims: list[list[int]],
    gemm,
    rows: int,
    clock=time.perf_counter,
) -> float:
    """One step: every layer's projections, then the head, on fresh ``rows``-row inputs."""
    dtype = weights[0][0].dtype
    inputs = {k: torch.randn(rows, k).to(dtype) for k in {k for lay in dims for k in lay}}
    start = clock()
    for layer, layer_dims in zip(weights, dims, strict=True):
        for w, k in zip(layer, layer_dims, strict=True):
            gemm(inputs[k], w)
    return clock() - start


def baseline(
    args: argparse.Namespace, dense: list[list[torch.Tensor]], tmp: Path
) -> tuple[str, list[list[torch.Tensor]], Gemm]:
    """The GEMM to time the package's against: oneDNN's prepacked, or ``--against``'s build."""
    if args.against is None:
        weights = [
            [torch.ops.mkldnn._reorder_linear_weight(w.t().contiguous(), None) for w in lay]
            for lay in dense
        ]
        return "oneDNN", weights, layers.matmul
    try:
        lib = build_library(args.against, tmp / "other.so")
    except (OSError, subprocess.CalledProcessError) as exc:
        raise SystemExit(f"--against: {exc}") from None
    return (
        args.against.stem,
        [[ops.pack_panels(w) for w in lay] for lay in dense],
        functools.partial(ops.panel_gemm, lib=lib),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,8,16,32,64,128,512")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--against", type=Path, help="another version of cpu_kernels.cpp")
    parser.add_argument(
        "--cpu-time",
        action="store_true",
        help="time by CPU time, not the wall clock (with OMP_NUM_THREADS=1: steady under load)",
    )
    parser.add_argument("--rounds", type=int, default=5, help="timed turns of each")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        compare(args, Path(tmp))


def compare(args: argparse.Namespace, tmp: Path) -> None:
    dtype = getattr(torch, args.dtype)
    clock = time.process_time if args.cpu_time else time.perf_counter
    if not cpu_kernels().panels(dtype):
        raise SystemExit(f"the native {args.dtype} panel GEMM does not run on this CPU")
    torch.manual_seed(0)
    dense = [
        [(torch.randn(k, n) * 0.02).to(dtype) for k, n in SHAPES.values()]
        for _ in range(args.layers)
    ]
    dense[-1].append((torch.randn(*HEAD) * 0.02).to(dtype))  # the head, after the last layer
    other, other_weights, other_gemm = baseline(args, dense, tmp)
    panels = [[ops.pack_panels(w) for w in lay] for lay in dense]
    dims = [[w.shape[0] for w in lay] for lay in dense]
    flops = 2 * sum(k * n for k, n in SHAPES.values()) * args.layers + 2 * HEAD[0] * HEAD[1]
    print(
        f"{'rows':>5} {other + ' ms':>12} {'panel ms':>9} {'panel/' + other:>14} "
        f"{'panel GFLOP/s':>14}"
    )
    for rows in (int(r) for r in args.rows.split(",")):
        if args.against is not None:
            x = torch.randn(rows, dims[0][0]).to(dtype)
            same = torch.equal(other_gemm(x, other_weights[0][0]), ops.panel_gemm(x, panels[0][0]))
            assert same, f"{rows} rows: the two builds' products differ"
        runs = {"other": (other_weights, other_gemm), "panel": (panels, ops.panel_gemm)}
        times: dict[str, list[float]] = {k: [] for k in runs}
        for r in range(args.rounds + 1):
            for name, (weights, gemm) in runs.items() if r % 2 else reversed(runs.items()):
                t = step_time(weights, dims, gemm, rows, clock)
                if r:
                    times[name].append(t)
        a, b = statistics.median(times["other"]), statistics.median(times["panel"])
        print(
            f"{rows:5d} {a * 1e3:12.1f} {b * 1e3:9.1f} {b / a:14.2f} {rows * flops / b / 1e9:14.0f}"
        )


if __name__ == "__main__":
    main()
