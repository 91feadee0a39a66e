"""Weight-only quantized GEMM on this CPU: kvroom's tile-dequantize GEMM against PyTorch's own
kernels and the dense fp32 GEMM, at decode (1-32 rows) and prefill (512 rows) sizes.

Shapes are SmolLM2-135M's projections (qkv 960x576, o 576x576, gate_up 3072x576, down
576x1536), ``--layers`` times (30, the model's layers: the weights stream from memory as in a
decode step, not from cache), and its LM head (49152x576). Each weight is random, built once;
the time is the best of ``--repeats`` runs of every shape one after another; with
``--threads 1`` the time is the thread's CPU time (robust on a machine other processes share),
else wall time.

    kvroom_panels  QuantPanels.matmul: the native quantized GEMM (K blocks dequantized in L1)
    kvroom_tiles   QuantizedLinear.matmul: a tile of rows dequantized to fp32, one GEMM per tile
    int4pack       torch.ops.aten._weight_int4pack_mm_for_cpu (group 32, the same values)
    int8pack       torch.ops.aten._weight_int8pack_mm (per output channel: a different format)
    dense_fp32     layers.prepare_weight + layers.matmul (oneDNN-packed fp32, today's path)

    python benchmarks/quant_gemm.py --threads 2 --json benchmarks/results-quant-gemm.json
    python benchmarks/quant_gemm.py --threads 1 --methods dense_fp32,kvroom_panels
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from kvroom.models.layers import matmul, prepare_weight
from kvroom.models.quant import QuantizedLinear
from kvroom.models.quant.panels import QuantPanels

PROJECTIONS = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
HEAD = [(49152, 576)]
GROUP = 32


def build(shapes: list[tuple[int, int]], kind: str) -> list[dict]:
    out = []
    for n, k in shapes:
        q = torch.randint(0, 16, (n, k), dtype=torch.uint8)
        scales = (torch.rand(n, k // GROUP) * 0.01 + 1e-3).half()
        mins = (torch.randn(n, k // GROUP) * 0.01).half()
        if kind == "int8":
            qweight = (q.to(torch.int16) * 16 - 128).to(torch.int8)
            w = QuantizedLinear("int8", qweight, scales, None, GROUP)
        else:
            w = QuantizedLinear("int4", q[:, 0::2] | (q[:, 1::2] << 4), scales, mins, GROUP)
        dense = w.dequantize()
        zero = mins.float() + 8 * scales.float() if kind == "int4" else None
        entry = {"k": k, "quant": w, "dense": prepare_weight(dense.t()), "panels": QuantPanels(w)}
        if zero is not None:
            entry["int4pack"] = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.int(), 2)
            entry["sz"] = torch.stack([scales.float().t(), zero.t()], -1).contiguous()
        entry["int8"] = w.values().to(torch.int8) if kind == "int8" else None
        entry["per_channel"] = scales.float().mean(1)
        out.append(entry)
    return out


def run(weights: list[dict], method: str, rows: int) -> None:
    for e in weights:
        x = torch.randn(rows, e["k"])
        if method == "kvroom_panels":
            e["panels"].matmul(x)
        elif method == "kvroom_tiles":
            e["quant"].matmul(x)
        elif method == "dense_fp32":
            matmul(x, e["dense"])
        elif method == "int4pack":
            torch.ops.aten._weight_int4pack_mm_for_cpu(x, e["int4pack"], GROUP, e["sz"])
        elif method == "int8pack":
            torch.ops.aten._weight_int8pack_mm(x, e["int8"], e["per_channel"])


def best_ms(weights: list[dict], method: str, rows: int, repeats: int, clock) -> float:
    run(weights, method, rows)
    best = float("inf")
    for _ in range(repeats):
        start = clock()
        run(weights, method, rows)
        best = min(best, clock() - start)
    return round(best * 1e3, 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rows", default="1,8,32,512")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--methods", default="dense_fp32,kvroom_panels,kvroom_tiles,torch")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    # one thread: its CPU time, which other processes on a shared machine do not inflate
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    cases = {
        "projections int4 (Q4_1-like)": (build(PROJECTIONS * args.layers, "int4"), ["int4pack"]),
        "lm head int8 (Q8_0-like)": (build(HEAD, "int8"), ["int8pack"]),
    }
    results = {
        "cpu": torch.backends.cpu.get_cpu_capability(),
        "threads": args.threads,
        "clock": clock.__name__,
        "layers": args.layers,
    }
    for name, (weights, extra) in cases.items():
        for rows in (int(r) for r in args.rows.split(",")):
            chosen = args.methods.split(",")
            methods = [m for m in ["dense_fp32", "kvroom_panels", "kvroom_tiles"] if m in chosen]
            methods += extra if "torch" in chosen else []
            skip = {"int4pack", "int8pack"} if rows > 32 else set()  # minutes per call there
            times = {
                m: best_ms(weights, m, rows, args.repeats, clock) for m in methods if m not in skip
            }
            results[f"{name}, {rows} rows"] = times
            print(f"{name}, {rows} rows: {times}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
