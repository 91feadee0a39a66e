"""``kvroom run`` on the tiny artifact: the default length, and every bad flag as one line.

The tiny artifact has ``max_seq_len`` 64, so a default of a fixed 256 new tokens would refuse
every prompt; the default is what the context leaves after the prompt (vLLM's).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from kvroom.cli import main


def run(capsys, *argv: object) -> tuple[int, str, str]:
    try:
        rc = main([str(a) for a in argv])
    except SystemExit as exc:
        rc = int(exc.code or 0)
    out, err = capsys.readouterr()
    return rc, out, err


def assert_one_line_error(rc: int, err: str, message: str) -> None:
    assert rc == 2, err
    lines = [line for line in err.splitlines() if line.startswith("kvroom: error: ")]
    assert lines == [f"kvroom: error: {message}"], err
    assert "Traceback" not in err


def test_without_max_new_tokens_generates_what_the_context_leaves(capsys, tiny_artifact):
    prompt = "Tell me a long story about a dragon."  # 36 byte tokens + the chat template's
    rc, out, err = run(capsys, "run", tiny_artifact, "--prompt", prompt, "--ignore-eos")
    assert rc == 0, err
    assert out.strip()


def test_a_prompt_that_fills_the_context_is_one_line(capsys, tiny_artifact):
    rc, out, err = run(capsys, "run", tiny_artifact, "--prompt", "x" * 80, "--no-chat-template")
    assert out == ""
    assert_one_line_error(
        rc,
        err,
        "the prompt has 80 tokens, which leaves no room to generate within max_seq_len (64); "
        "shorten the prompt",
    )


def test_help_shows_the_sampling_defaults(capsys, tiny_artifact):
    rc, out, _ = run(capsys, "run", "--help")
    assert rc == 0
    text = " ".join(out.split())
    assert "most tokens to generate (default: what max_seq_len leaves after the prompt)" in text
    assert ">= 0; 0 = greedy (default 0)" in text
    assert "(default 1: all)" in text and "(default 0: all)" in text


@pytest.mark.parametrize(
    ("argv", "wanted"),
    [
        (["--help"], "kvroom --get-kvcache-num-blocks OUT, kvroom --set-kvcache-num-blocks N OUT"),
        (["run", "--help"], "N, or auto = re-estimate for this machine's memory (default: the"),
        (["serve", "--help"], "or elastic = follow the memory while serving (default: the"),
        (["compile", "--help"], "unset or 0 = estimate from device memory"),
    ],
)
def test_help_names_every_spelling_and_value(capsys, argv, wanted):
    rc, out, _ = run(capsys, *argv)
    assert rc == 0
    assert wanted in " ".join(out.split())


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--max-new-tokens", "0"], "--max-new-tokens: must be > 0, got 0"),
        (["--temperature", "-1"], "--temperature: must be >= 0, got -1.0"),
        (["--top-p", "2"], "--top-p: must be in (0, 1], got 2.0"),
        (["--top-k", "-2"], "--top-k: must be >= 0 or -1, got -2"),
        (["--device", "tpu"], "device: unknown device 'tpu'; use cpu, cuda or cuda:N"),
    ],
)
def test_bad_flags_name_the_flag(capsys, tiny_artifact, flags, message):
    rc, out, err = run(capsys, "run", tiny_artifact, "--prompt", "hi", *flags)
    assert out == ""
    assert_one_line_error(rc, err, message)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
@pytest.mark.parametrize("command", [["run", "--prompt", "hi"], ["serve", "--port", "0"]])
def test_cuda_on_a_machine_without_it_is_one_line(capsys, tiny_artifact, command):
    rc, out, err = run(capsys, command[0], tiny_artifact, *command[1:], "--device", "cuda")
    assert out == ""
    assert_one_line_error(
        rc,
        err,
        f"device: 'cuda' requested but CUDA is not available here (torch {torch.__version__}); "
        "run with --device cpu",
    )


@pytest.mark.parametrize("command", [["run", "--prompt", "hi"], ["serve", "--port", "0"]])
def test_a_missing_artifact_is_the_only_line(tmp_path, command):
    """Reported before anything is built or logged (no kernels line first)."""
    done = subprocess.run(
        [sys.executable, "-m", "kvroom", command[0], tmp_path / "missing", *command[1:]],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr == f"kvroom: error: {tmp_path / 'missing'}: no such artifact folder\n"
