"""Throughput of kvroom against HF transformers on one artifact (same as ``kvroom bench``).

python benchmarks/throughput.py artifacts/smollm2-135m [--num-requests 32 --new-tokens 64]
"""

from __future__ import annotations

import sys

from kvroom.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["bench", *sys.argv[1:]]))
