"""The MLP block as kvroom runs it against the same block in separate ops, in one process.

.venv/bin/python benchmarks/mlp_block.py [--rows 1,32,256,512] [--layers 30]
    [--dtype float32|bfloat16] [--rounds 9]

kvroom's block (``layers.add_mlp_`` on panel weights): the gate_up GEMM applies the SiLU-GLU in
its epilogue (``ops.panel_glu``) and the down GEMM adds its product into the residual stream
(``ops.panel_gemm(..., out=h)``). The separate ops: gate_up's ``[T, 2I]`` product, ``silu_mul``,
the down GEMM's output, then ``h.add_``. SmolLM2-135M's shapes (hidden 576, intermediate 1,536),
each layer's weights distinct (read cold, as a step reads them); the two take turns and must
leave the same residual, bit for bit. Needs the native panel GEMM (an AVX-512 CPU; bf16: one
without AMX).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from kvroom.models.kernels import cpu_kernels, ops
from kvroom.models.layers import add_mlp_

HIDDEN, INTER = 576, 1536
Block = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


def fused(h: torch.Tensor, x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> None:
    add_mlp_(h, x, gate_up, down, "silu")


def separate(h: torch.Tensor, x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> None:
    gu = ops.silu_mul(ops.panel_gemm(x, gate_up))
    assert gu is not None
    h.add_(ops.panel_gemm(gu, down))


def step_time(block: Block, layers: list[tuple[torch.Tensor, torch.Tensor]], x, h) -> float:
    start = time.perf_counter()
    for gate_up, down in layers:
        block(h, x, gate_up, down)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,32,256,512")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--rounds", type=int, default=9, help="timed turns of each")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    if not cpu_kernels().panels(dtype):
        raise SystemExit(f"the native {args.dtype} panel GEMM does not run on this CPU")
    torch.manual_seed(0)
    layers = [
        (
            ops.pack_panels((torch.randn(HIDDEN, 2 * INTER) * 0.05).to(dtype)),
            ops.pack_panels((torch.randn(INTER, HIDDEN) * 0.05).to(dtype)),
        )
        for _ in range(args.layers)
    ]
    print(f"{'rows':>5} {'separate ms':>12} {'kvroom ms':>10} {'kvroom/separate':>16}")
    for rows in (int(r) for r in args.rows.split(",")):
        x = torch.randn(rows, HIDDEN).to(dtype)
        h0 = torch.randn(rows, HIDDEN).to(dtype)
        residual = {name: h0.clone() for name in ("separate", "kvroom")}
        step_time(separate, layers[:1], x, residual["separate"])
        step_time(fused, layers[:1], x, residual["kvroom"])
        assert torch.equal(residual["separate"], residual["kvroom"]), f"{rows} rows differ"
        times: dict[str, list[float]] = {"separate": [], "kvroom": []}
        for r in range(args.rounds + 1):
            turns = [("separate", separate), ("kvroom", fused)]
            for name, block in turns if r % 2 else reversed(turns):
                t = step_time(block, layers, x, residual[name])
                if r:
                    times[name].append(t)
        a, b = statistics.median(times["separate"]), statistics.median(times["kvroom"])
        print(f"{rows:5d} {a * 1e3:12.2f} {b * 1e3:10.2f} {b / a:16.3f}", flush=True)


if __name__ == "__main__":
    main()
