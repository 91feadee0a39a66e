"""Resident bytes of an artifact's weights: the RSS a fresh process gains loading the model.

Each artifact is loaded in its own process (``load_model`` only: no pool, no engine) after
what the profiling pass loads first (torch, transformers, kvroom, the tokenizer); the figure is
VmRSS after minus before (heap trimmed), the plan's weights term beside it.

    python benchmarks/weights_resident.py artifacts/smollm2-q4 artifacts/smollm2-fp32
"""

from __future__ import annotations

import json
import subprocess
import sys

MEASURE = """
import json, sys, torch
from transformers import AutoConfig, AutoTokenizer
import kvroom.llm
from kvroom import heap
from kvroom.artifact.layout import read_info
from kvroom.engine.model_runner import load_model
from kvroom.models.quant import gguf_checkpoint
heap.configure()
AutoTokenizer.from_pretrained(sys.argv[1])  # as the profiling pass: tokenizer before weights

def rss():
    heap.trim()
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024

info = read_info(sys.argv[1])
before = rss()
model = load_model(info.folder, getattr(torch, info.config.dtype), "cpu", info.config.quantization)
print(json.dumps({"resident_bytes": rss() - before, "planned_bytes": info.plan.weight_bytes,
                  "weight_types": info.plan.weight_types}))
"""


def main() -> None:
    for folder in sys.argv[1:]:
        out = subprocess.run(
            [sys.executable, "-c", MEASURE, folder], check=True, capture_output=True, text=True
        ).stdout
        row = json.loads(out.strip().splitlines()[-1])
        print(json.dumps({"artifact": folder, **row}))


if __name__ == "__main__":
    main()
