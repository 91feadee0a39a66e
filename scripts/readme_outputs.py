"""Regenerate or check the README's output blocks by running the commands they show.

A generated block is a fenced ``text`` block right after a ``<!-- readme-output: NAME -->``
line. NAME is one of ``BLOCKS`` below: each runs its commands, exactly as shown after ``$ ``,
in a scratch folder where ``artifacts/smollm2-135m`` is a copy of the artifact given (weights
linked, so ``set`` changes only the copy's ``kvroom_config.json``). Shown: stdout, the
``kvroom`` lines of stderr except the per-CPU kernel line, and ``(exit N)`` for a failure.

    python scripts/readme_outputs.py --artifact ART --write   # rewrite README.md's blocks
    python scripts/readme_outputs.py --artifact ART           # check; exit 1 with a diff

``ART`` is ``kvroom compile smollm2-135m -o ART`` (the README's numbers come from such an
artifact on the machine the README names). The check compares blocks with every number masked
(memory, timings and block counts depend on the machine and on profiling), and exactly where a
block is marked ``exact`` (the plan of the built-in model for a given memory is the same
everywhere). Text a model generates is not compared.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import json
import os
import re
import select
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"
SHOWN_ARTIFACT = "artifacts/smollm2-135m"
MARKER = re.compile(r"^<!-- readme-output: ([\w-]+) -->\n```text\n(.*?)^```\n", re.M | re.S)
MACHINE_LINES = ("kvroom: CPU kernels", "kvroom: native CPU kernels")
"""Per-CPU log lines, left out of every block."""
GENERATED = "<generated text>"
START_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class Block:
    """How to produce one README block (``render(workdir) -> text``)."""

    render: Callable[[Path], str]
    exact: bool = False
    generated: bool = False
    """Its stdout is text a model generated (not compared)."""


def kvroom(workdir: Path, command: str, *, generated: bool = False) -> str:
    """``$ command`` and what it prints, stdout and stderr in the order they came
    (``generated``: stdout is model text)."""
    argv = [sys.executable, "-m", "kvroom", *shlex.split(command)[1:]]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        argv, cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
    )
    lines = [f"$ {command}"]
    for is_stdout, line in interleaved(proc):
        if is_stdout:
            lines.append((GENERATED if generated else "") + line)
        elif shown_log_line(line):
            lines.append(line)
    if proc.wait(600):
        lines.append(f"(exit {proc.returncode})")
    return "\n".join(lines) + "\n"


def interleaved(proc: subprocess.Popen[bytes]) -> Iterator[tuple[bool, str]]:
    """(from stdout?, line) from both pipes as the lines arrive (never blocking on one pipe
    while the other fills)."""
    assert proc.stdout is not None and proc.stderr is not None
    pending = {proc.stdout.fileno(): b"", proc.stderr.fileno(): b""}
    is_stdout = {proc.stdout.fileno(): True, proc.stderr.fileno(): False}
    while pending:
        ready, _, _ = select.select(list(pending), [], [])
        for fd in ready:
            data = os.read(fd, 65536)
            if data:
                *lines, pending[fd] = (pending[fd] + data).split(b"\n")
            else:  # closed: what is left is the last line
                rest = pending.pop(fd)
                lines = [rest] if rest else []
            for line in lines:
                yield is_stdout[fd], line.decode(errors="replace").rstrip("\r")


def shown_log_line(line: str) -> bool:
    return line.startswith("kvroom") and not line.startswith(MACHINE_LINES)


def shown_log(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if shown_log_line(line)]


# -- the blocks ----------------------------------------------------------------------------


def plan_block(workdir: Path) -> str:
    flags = "--device-memory 16GiB --kvcache-reserve-memory 2GiB"
    return kvroom(workdir, f"kvroom plan smollm2-135m {flags}")


def get_set_block(workdir: Path) -> str:
    commands = [
        f"kvroom get {SHOWN_ARTIFACT}",
        f"kvroom set {SHOWN_ARTIFACT} 512",
        f"kvroom set {SHOWN_ARTIFACT} 64",
        f"kvroom set {SHOWN_ARTIFACT} auto --device-memory 4GiB",
        f"kvroom --get-kvcache-num-blocks {SHOWN_ARTIFACT}",
    ]
    return "".join(kvroom(workdir, c) for c in commands)


def run_block(workdir: Path) -> str:
    prompt = '"What is the capital of France? Answer in one sentence."'
    command = f"kvroom run {SHOWN_ARTIFACT} --prompt {prompt} --max-new-tokens 48"
    return kvroom(workdir, command, generated=True)


def vllm_args_block(workdir: Path) -> str:
    return kvroom(workdir, f"kvroom vllm-args {SHOWN_ARTIFACT}")


SERVE = f"kvroom serve {SHOWN_ARTIFACT} --port 8000 --kvcache-num-blocks 512"
CURL = "curl -s localhost:8000{path} -H 'Content-Type: application/json' -d '{body}'"
REQUESTS = [
    ("/v1/completions", {"model": SHOWN_ARTIFACT, "prompt": "hi", "max_tokens": 0}),
    ("/tokenize", {"prompt": "Hello world"}),
    ("/v1/completions", {"prompt": "hi", "n": 64}),
]


def serve_blocks(workdir: Path) -> dict[str, str]:
    """``serve-start`` (its start-up lines) and ``serve-requests`` (answers to ``REQUESTS``)."""
    with running_server(workdir) as (url, startup):
        answers = []
        for path, body in REQUESTS:
            text = json.dumps(body)
            answers.append(f"$ {CURL.format(path=path, body=text)}\n{post(url + path, text)}\n")
    return {"serve-start": startup, "serve-requests": "".join(answers)}


@contextlib.contextmanager
def running_server(workdir: Path) -> Iterator[tuple[str, str]]:
    """``SERVE`` on a free port: (its URL, its start-up lines as shown on port 8000)."""
    argv = [sys.executable, "-m", "kvroom", *shlex.split(SERVE)[1:], "--no-access-log"]
    argv[argv.index("8000")] = "0"
    log = workdir / "serve.log"
    with log.open("w") as sink:
        proc = subprocess.Popen(argv, cwd=workdir, stdout=sink, stderr=subprocess.STDOUT)
    try:
        url = wait_for_address(proc, log)
        port = url.rsplit(":", 1)[1]
        lines = [line.replace(f":{port} ", ":8000 ") for line in shown_log(log.read_text())]
        yield url, "\n".join([f"$ {SERVE}", *lines]) + "\n"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


def wait_for_address(proc: subprocess.Popen[bytes], log: Path) -> str:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        found = re.search(r"serving .* on (http://[\d.]+:\d+) ", log.read_text())
        if found:
            wait_for_health(found.group(1), deadline)
            return found.group(1)
        if proc.poll() is not None:
            raise SystemExit(f"kvroom serve exited {proc.returncode}:\n{log.read_text()}")
        time.sleep(0.2)
    raise SystemExit(f"kvroom serve did not start:\n{log.read_text()}")


def wait_for_health(url: str, deadline: float) -> None:
    while time.monotonic() < deadline:
        with (
            contextlib.suppress(OSError),
            urllib.request.urlopen(f"{url}/health", timeout=5) as response,
        ):
            if response.status == 200:
                return
        time.sleep(0.2)


def post(url: str, body: str) -> str:
    request = urllib.request.Request(
        url, data=body.encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.read().decode()


BLOCKS: dict[str, Block] = {
    "plan": Block(plan_block, exact=True),
    "get-set": Block(get_set_block),
    "run": Block(run_block, generated=True),
    "vllm-args": Block(vllm_args_block),
    "serve-start": Block(lambda _: ""),  # both come from one server: see serve_blocks
    "serve-requests": Block(lambda _: ""),
}


def render_all(workdir: Path, names: list[str]) -> dict[str, str]:
    """Every block, in the README's order (``set`` changes what later blocks show)."""
    texts: dict[str, str] = {}
    for name in names:
        if name.startswith("serve-"):
            texts.update(serve_blocks(workdir) if name not in texts else {})
        else:
            texts[name] = BLOCKS[name].render(workdir)
    return texts


# -- README ----------------------------------------------------------------------------------


def scratch_copy(artifact: Path, root: Path) -> None:
    """``root/artifacts/smollm2-135m``: small files copied, the rest linked."""
    target = root / SHOWN_ARTIFACT
    target.mkdir(parents=True)
    for file in artifact.iterdir():
        if file.suffix == ".safetensors":
            os.symlink(file.resolve(), target / file.name)
        else:
            shutil.copy2(file, target / file.name)


def normalized(text: str, block: Block, *, in_readme: bool) -> list[str]:
    """The lines compared: exact, or with numbers masked, spaces collapsed and generated text
    left out (in the README it is every line that is not a command, a log line or an exit)."""
    if block.exact:  # a command's log lines may come before or after its stdout (two pipes)
        rows = text.splitlines()
        logs = [line for line in rows if line.startswith("kvroom")]
        return [line for line in rows if not line.startswith("kvroom")] + logs
    lines: list[str] = []
    for line in text.splitlines():
        ours = line.startswith(("$ ", "kvroom", "(exit "))
        if line.startswith(GENERATED) or (block.generated and in_readme and not ours):
            line = GENERATED
        if line == GENERATED and lines[-1:] == [GENERATED]:
            continue
        line = re.sub(r"\d+(?:[.,]\d+)*", "#", line)
        lines.append(" ".join(line.split()))
    return lines


def shown(text: str) -> str:
    """A block as the README shows it (generated text without its marker)."""
    return text.replace(GENERATED, "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--artifact", required=True, type=Path, help="a compiled smollm2-135m")
    parser.add_argument("--write", action="store_true", help="rewrite README.md's blocks")
    parser.add_argument("--readme", type=Path, default=README)
    args = parser.parse_args(argv)
    readme = args.readme.read_text()
    found = {m.group(1): m.group(2) for m in MARKER.finditer(readme)}
    if set(found) != set(BLOCKS):
        raise SystemExit(f"README blocks {sorted(found)} != generated blocks {sorted(BLOCKS)}")
    with tempfile.TemporaryDirectory(prefix="readme-outputs-") as root:
        scratch_copy(args.artifact, Path(root))
        texts = render_all(Path(root), list(found))
    if args.write:
        args.readme.write_text(MARKER.sub(lambda m: fenced(m.group(1), texts), readme))
        return 0
    return check(found, texts)


def fenced(name: str, texts: dict[str, str]) -> str:
    return f"<!-- readme-output: {name} -->\n```text\n{shown(texts[name])}```\n"


def check(found: dict[str, str], texts: dict[str, str]) -> int:
    drift = 0
    for name, text in texts.items():
        want = normalized(found[name], BLOCKS[name], in_readme=True)
        got = normalized(text, BLOCKS[name], in_readme=False)
        if want != got:
            drift += 1
            diff = difflib.unified_diff(want, got, f"README {name}", f"now {name}", lineterm="")
            print("\n".join(diff))
    if drift:
        fix = "python scripts/readme_outputs.py --artifact ART --write"
        print(f"{drift} README block(s) differ; after checking the change: {fix}")
    return 1 if drift else 0


if __name__ == "__main__":
    sys.exit(main())
