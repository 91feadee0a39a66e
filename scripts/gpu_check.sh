#!/usr/bin/env bash
# The CUDA check, about 5 minutes on one GPU: `make test-cuda` (pool bytes = plan, logits vs
# HF in fp16/bf16, plan vs torch.cuda.max_memory_reserved, `kvroom serve` answers), then the
# CPU benchmark's workloads (batch 32 x 64, single 1 x 128, TTFT 8 x 1500) timed on the GPU,
# side by side with vLLM when KVROOM_VLLM_PYTHON names a python with (CUDA) vLLM.
#
#   bash scripts/gpu_check.sh            # PY=/path/to/python to use another interpreter
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PY:-.venv/bin/python}"
ART="${ART:-artifacts/gpu-check/smollm2-135m-bf16}"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
start=$(date +%s)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA'; print('torch', torch.__version__, torch.cuda.get_device_name())"
timeout 200 "$PY" -m pytest -m gpu tests/gpu -rA -s -p no:cacheprovider
"$PY" -m kvroom compile smollm2-135m -o "$ART" --device cuda --dtype bfloat16 --dequantize \
    --kvcache-num-blocks 1024 --overwrite >/dev/null
if [ -n "${KVROOM_VLLM_PYTHON:-}" ]; then
    timeout 240 "$PY" benchmarks/vllm_peer.py "$ART" --repeats 2 --json "$ART/../vllm-peer.json"
else
    echo "KVROOM_VLLM_PYTHON not set: timing kvroom alone on the GPU"
    timeout 120 "$PY" - "$ART" <<'PYEOF'
import statistics, sys
sys.path.insert(0, "benchmarks")
from vllm_peer import run_kvroom, workloads
from kvroom.llm import LLM
llm = LLM(sys.argv[1])
loads = workloads(llm, 32, 64)
for name, w in loads.items():
    run_kvroom(llm, w)  # warm-up
    secs = statistics.median(run_kvroom(llm, w)[0] for _ in range(3))
    tokens = len(w["prompts"]) * w["max_tokens"]
    figure = f"{secs:.3f} s" if name == "ttft" else f"{tokens / secs:.1f} tok/s"
    print(f"kvroom cuda {name}: {figure}")
PYEOF
fi
echo "gpu_check: done in $(( $(date +%s) - start )) s"
