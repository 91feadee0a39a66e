"""lm-eval against ``kvroom serve`` and against its ``hf`` backend, on the same artifact.

Two local tasks (JSON Lines under ``benchmarks/lm_eval/``, no hub), each scored twice:

* ``mc`` (``facts_mc.yaml``, loglikelihood): ``local-completions`` -> ``kvroom serve``
  (``echo`` + ``logprobs``, token-id prompts) vs ``hf``; prints both accuracies and the largest
  per-choice loglikelihood difference;
* ``gen`` (``facts_gen.yaml``, generate_until, greedy): ``local-chat-completions`` ->
  ``kvroom serve`` (the server applies the artifact's chat template) vs ``hf`` with
  ``--apply_chat_template``; prints both scores and how many of the replies are identical.

An artifact folder is a HF model folder, so ``hf`` loads it directly. lm-eval needs its API
client and ``accelerate`` (``pip install "lm-eval[api]" accelerate``).

python benchmarks/lm_eval_parity.py artifacts/smollm2-135m \
    --lm-eval /path/to/lm-eval-env/bin/lm_eval [--tasks mc,gen] [--skip-hf]

``--skip-hf`` scores ``kvroom serve`` alone: the KV formats of ``kv_quality.py`` (the
artifact's KV dtype changes what the server computes, not what ``hf`` would).
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
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).parent / "lm_eval"
ADDRESS = re.compile(r"serving .* on (http://127\.0\.0\.1:\d+) ")
MODEL = "smol"


@dataclass(frozen=True)
class Task:
    name: str
    """lm-eval's task name."""
    yaml: str
    api_model: str
    """lm-eval's model type against kvroom serve."""
    endpoint: str
    chat: bool
    """Both sides with ``--apply_chat_template``."""


TASKS = {
    "mc": Task("kvroom_facts_mc", "facts_mc.yaml", "local-completions", "completions", False),
    "gen": Task(
        "kvroom_facts_gen", "facts_gen.yaml", "local-chat-completions", "chat/completions", True
    ),
}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("artifact")
    p.add_argument("--lm-eval", default="lm_eval", help="the lm_eval script of lm-eval's venv")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--tasks", default="mc,gen", help="comma list of mc, gen (default both)")
    p.add_argument(
        "--skip-hf",
        action="store_true",
        help="kvroom serve only (artifacts hf cannot load: int8 KV...)",
    )
    args = p.parse_args()
    tasks = [TASKS[t] for t in args.tasks.split(",")]
    work = Path(tempfile.mkdtemp(prefix="kvroom-lm-eval-"))
    folder = _task_dir(work)
    api = _run_api(args, folder, work, tasks)
    for task in tasks:
        if args.skip_hf:
            print(json.dumps({task.name: {f"kvroom serve ({task.api_model})": api[task]}}))
            continue
        hf_args = f"pretrained={args.artifact},dtype=float32"
        hf = _run_lm_eval(args, folder, work / f"hf-{task.name}", task, "hf", hf_args)
        print(json.dumps({task.name: {f"kvroom serve ({task.api_model})": api[task], "hf": hf}}))
        print(_compare(task, work / f"api-{task.name}", work / f"hf-{task.name}"))
    shutil.rmtree(work)
    return 0


def _task_dir(work: Path) -> Path:
    """The task files, with the data file's path made absolute."""
    tasks = work / "tasks"
    tasks.mkdir()
    data = (HERE / "facts_mc.jsonl").resolve()
    for task in TASKS.values():
        text = (HERE / task.yaml).read_text().replace("test: facts_mc.jsonl", f"test: {data}")
        (tasks / task.yaml).write_text(text)
    shutil.copy(HERE / "facts_gen_utils.py", tasks)
    return tasks


def _run_api(args: argparse.Namespace, folder: Path, work: Path, tasks: list[Task]) -> dict:
    """Every task through lm-eval's API models against one ``kvroom serve``."""
    argv = [sys.executable, "-m", "kvroom", "serve", args.artifact, "--port", "0"]
    server = subprocess.Popen(
        [*argv, "--no-access-log", "--served-model-name", MODEL],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        url = _address(server)
        results = {}
        for task in tasks:
            model_args = f"model={MODEL},base_url={url}/v1/{task.endpoint},num_concurrent=4"
            model_args += ",max_retries=1"
            if not task.chat:  # token-id prompts need lm-eval's own tokenizer
                model_args += f",tokenizer={args.artifact},tokenizer_backend=huggingface"
            out = work / f"api-{task.name}"
            results[task] = _run_lm_eval(args, folder, out, task, task.api_model, model_args)
        return results
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
    args: argparse.Namespace, folder: Path, out: Path, task: Task, model: str, model_args: str
) -> dict[str, float]:
    cmd = [args.lm_eval, "--model", model, "--model_args", model_args, "--tasks", task.name]
    cmd += ["--include_path", str(folder), "--output_path", str(out), "--log_samples"]
    cmd += ["--batch_size", "1" if model == "local-chat-completions" else str(args.batch_size)]
    if task.chat:
        cmd.append("--apply_chat_template")
    if model == "hf":
        cmd += ["--device", "cpu"]
    subprocess.run(cmd, check=True)
    results = json.loads(next(out.rglob("results_*.json")).read_text())["results"][task.name]
    return {k: v for k, v in results.items() if isinstance(v, float)}


def _samples(folder: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in next(folder.rglob("samples_*.jsonl")).open()]
    return {r["doc_id"]: r for r in rows}


def _compare(task: Task, api: Path, hf: Path) -> str:
    """Per-choice loglikelihood differences (mc), or identical replies (gen)."""
    a, b = _samples(api), _samples(hf)
    if not task.chat:
        diffs = [
            abs(float(x[0]) - float(y[0]))
            for d in a
            for x, y in zip(a[d]["filtered_resps"], b[d]["filtered_resps"], strict=True)
        ]
        return f"per-choice loglikelihoods compared: {len(diffs)}; max |diff| = {max(diffs):.2e}"
    differ = [d for d in sorted(a) if a[d]["filtered_resps"] != b[d]["filtered_resps"]]
    lines = [f"replies identical: {len(a) - len(differ)} of {len(a)}"]
    for d in differ:
        lines.append(f"  doc {d}: api {a[d]['filtered_resps']!r} hf {b[d]['filtered_resps']!r}")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
