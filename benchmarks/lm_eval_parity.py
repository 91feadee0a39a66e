"""lm-eval against ``kvroom serve`` (``local-completions``) and against its ``hf`` backend.

Both score the local multiple-choice task ``benchmarks/lm_eval/facts_mc.yaml`` on the same
artifact (an artifact folder is a HF model folder, so ``hf`` loads it directly); the script
prints both accuracies and the largest per-choice loglikelihood difference. lm-eval needs
its API client and ``accelerate`` (``pip install "lm-eval[api]" accelerate``).

python benchmarks/lm_eval_parity.py artifacts/smollm2-135m \
    --lm-eval /path/to/lm-eval-env/bin/lm_eval
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).parent / "lm_eval"
TASK = "kvroom_facts_mc"
ADDRESS = re.compile(r"serving .* on (http://127\.0\.0\.1:\d+) ")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("artifact")
    p.add_argument("--lm-eval", default="lm_eval", help="the lm_eval script of lm-eval's venv")
    p.add_argument("--batch-size", type=int, default=8)
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kvroom-lm-eval-"))
    tasks = _task_dir(work)
    api = _run_api(args, tasks, work / "api")
    hf = _run_lm_eval(args, tasks, work / "hf", "hf", f"pretrained={args.artifact},dtype=float32")
    print(json.dumps({"kvroom serve (local-completions)": api, "hf": hf}, indent=2))
    diffs = _loglikelihood_diffs(work / "api", work / "hf")
    print(f"per-choice loglikelihoods compared: {len(diffs)}; max |diff| = {max(diffs):.2e}")
    shutil.rmtree(work)
    return 0


def _task_dir(work: Path) -> Path:
    tasks = work / "tasks"
    tasks.mkdir()
    data = (HERE / "facts_mc.jsonl").resolve()
    text = (HERE / "facts_mc.yaml").read_text().replace("test: facts_mc.jsonl", f"test: {data}")
    (tasks / "facts_mc.yaml").write_text(text)
    return tasks


def _run_api(args: argparse.Namespace, tasks: Path, out: Path) -> dict[str, float]:
    argv = [sys.executable, "-m", "kvroom", "serve", args.artifact, "--port", "0"]
    server = subprocess.Popen(
        [*argv, "--no-access-log", "--served-model-name", "smol"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        url = _address(server)
        model_args = (
            f"model=smol,base_url={url}/v1/completions,tokenizer={args.artifact},"
            "tokenizer_backend=huggingface,num_concurrent=4,max_retries=1"
        )
        return _run_lm_eval(args, tasks, out, "local-completions", model_args)
    finally:
        server.terminate()
        server.wait(60)


def _address(server: subprocess.Popen[str]) -> str:
    assert server.stdout is not None
    deadline = time.monotonic() + 300
    for line in server.stdout:
        match = ADDRESS.search(line)
        if match:
            return match.group(1)
        if time.monotonic() > deadline:
            break
    raise RuntimeError("kvroom serve did not print its address")


def _run_lm_eval(
    args: argparse.Namespace, tasks: Path, out: Path, model: str, model_args: str
) -> dict[str, float]:
    cmd = [args.lm_eval, "--model", model, "--model_args", model_args, "--tasks", TASK]
    cmd += ["--include_path", str(tasks), "--output_path", str(out), "--log_samples"]
    cmd += ["--batch_size", str(args.batch_size)]
    if model == "hf":
        cmd += ["--device", "cpu"]
    subprocess.run(cmd, check=True)
    results = json.loads(next(out.rglob("results_*.json")).read_text())["results"][TASK]
    return {k: v for k, v in results.items() if isinstance(v, float)}


def _loglikelihood_diffs(api: Path, hf: Path) -> list[float]:
    def samples(folder: Path) -> dict[int, list[float]]:
        rows = [json.loads(line) for line in next(folder.rglob("samples_*.jsonl")).open()]
        return {r["doc_id"]: [float(x[0]) for x in r["filtered_resps"]] for r in rows}

    a, b = samples(api), samples(hf)
    return [abs(x - y) for d in a for x, y in zip(a[d], b[d], strict=True)]


if __name__ == "__main__":
    raise SystemExit(main())
