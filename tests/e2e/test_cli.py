"""The ``kvroom`` command line on tiny models: plan, compile, get, set, and every bad input.

Most cases drive ``kvroom.cli.main`` in-process (fast); a few run ``python -m kvroom`` to check
the real exit code and that stderr is one line with no traceback.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvroom.artifact.layout import FORMAT_VERSION, KVROOM_CONFIG, read_info
from kvroom.cli import main
from kvroom.compile import compile as kvroom_compile
from kvroom.compile import plan_model
from kvroom.config import DecoderOnlyConfig
from kvroom.model_spec import SUPPORTED_ARCHITECTURES
from kvroom.plan.measured import IN_TURN, STEP_SHAPES
from tiny_models import TINY_COMPILE_CONFIG

TINY_FLAGS = [
    "--max-seq-len",
    "64",
    "--batch-size",
    "4",
    "--kvcache-block-size",
    "4",
    "--device-memory",
    "1GiB",
]
ESTIMATE = 64
ARTIFACT_FILES = {
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    KVROOM_CONFIG,
}


def run(capsys, *argv: str) -> tuple[int, str, str]:
    """``kvroom.cli.main(argv)`` -> (exit code, stdout, stderr); argparse errors included."""
    try:
        rc = main([str(a) for a in argv])
    except SystemExit as exc:
        rc = exc.code
    out, err = capsys.readouterr()
    return rc, out, err


def assert_one_line_error(rc: int, err: str, message: str) -> None:
    assert rc == 2, err
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert err.startswith("kvroom: error: "), err
    assert "Traceback" not in err
    assert re.search(message, err), err


def config_bytes(folder: Path) -> bytes:
    return (folder / KVROOM_CONFIG).read_bytes()


# -- plan ------------------------------------------------------------------------------------


def test_plan_prints_the_table(capsys, tiny_llama_dir):
    before = sorted(p.name for p in tiny_llama_dir.iterdir())
    rc, out, err = run(capsys, "plan", tiny_llama_dir, *TINY_FLAGS)
    assert rc == 0, err
    lines = out.splitlines()
    num_parameters = plan_model(tiny_llama_dir, TINY_COMPILE_CONFIG).source.num_parameters
    assert lines[0] == f"model: {tiny_llama_dir} (LlamaForCausalLM, {num_parameters:,} parameters)"
    assert re.search(r"^device memory \(cpu, explicit\) +1\.00 GiB$", out, re.M)
    assert re.search(r"^blocks for one full sequence \(64 tokens\) +16$", out, re.M)
    assert re.search(r"^estimated kvcache_num_blocks +64$", out, re.M)
    assert re.search(r"^chosen kvcache_num_blocks \(estimate\) +64$", out, re.M)
    assert lines[-1] == "64 blocks x 4 tokens = 256 tokens = 4 full-length sequences"
    assert sorted(p.name for p in tiny_llama_dir.iterdir()) == before  # plan writes nothing


def test_plan_json(capsys, tiny_llama_dir):
    rc, out, err = run(capsys, "plan", tiny_llama_dir, *TINY_FLAGS, "--json")
    assert rc == 0, err
    doc = json.loads(out)
    assert doc == plan_model(tiny_llama_dir, TINY_COMPILE_CONFIG).plan.to_dict()
    assert doc["num_blocks"] == doc["estimated_num_blocks"] == ESTIMATE
    assert doc["num_min_blocks"] == 16
    assert doc["device_memory_bytes"] == 2**30


def test_plan_pinned_value_below_min(capsys, tiny_llama_dir):
    rc, _, err = run(capsys, "plan", tiny_llama_dir, *TINY_FLAGS, "--kvcache-num-blocks", "8")
    assert_one_line_error(
        rc, err, r"kvcache_num_blocks: 8 blocks is below the minimum of 16 \(one max_seq_len=64"
    )


def test_plan_hybrid_model(capsys, tiny_gemma3_dir):
    rc, out, err = run(capsys, "plan", tiny_gemma3_dir, *TINY_FLAGS, "--json")
    assert rc == 0, err
    doc = json.loads(out)
    # 2 sliding layers x 4 seqs x window 8 x (2 x 2 kv heads x 8 x 4 bytes)
    assert doc["sliding_window_bytes"] == 2 * 4 * 8 * 128
    # 2 full layers x 4 tokens x 128 bytes
    assert doc["kv_bytes_per_block"] == 2 * 4 * 128


# -- compile ---------------------------------------------------------------------------------


def test_compile_writes_all_files(capsys, tiny_llama_dir, tmp_path):
    # The real CLI path, profiling pass included; 4 GiB leaves room for any measured runtime.
    out_dir = tmp_path / "out"
    flags = [*TINY_FLAGS[:-1], "4GiB"]
    rc, out, err = run(capsys, "compile", tiny_llama_dir, "-o", out_dir, *flags)
    assert rc == 0, err
    assert out.startswith(f"wrote {out_dir}: KV cache: 64 blocks x 4 tokens = 256 tokens")
    assert {p.name for p in out_dir.iterdir()} >= ARTIFACT_FILES
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temp folder left beside it
    info = read_info(out_dir)
    assert info.num_blocks == ESTIMATE
    measured = info.plan.measured
    assert measured is not None
    assert tuple(measured.step_peak_bytes) == (*STEP_SHAPES, IN_TURN)
    assert info.model == {
        "architecture": "LlamaForCausalLM",
        "num_parameters": plan_model(tiny_llama_dir, TINY_COMPILE_CONFIG).source.num_parameters,
        "source": str(tiny_llama_dir),
    }
    hf_config = json.loads((out_dir / "config.json").read_text())
    assert hf_config["architectures"] == ["LlamaForCausalLM"]
    assert hf_config["dtype"] == "float32"


def test_artifact_loads_in_transformers_with_the_same_logits(tiny_artifact, tiny_llama_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()
    artifact = AutoModelForCausalLM.from_pretrained(tiny_artifact).eval()
    ids = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = source(ids).logits
        got = artifact(ids).logits
    assert torch.equal(got, expected)
    tokenizer = AutoTokenizer.from_pretrained(tiny_artifact)
    assert len(tokenizer) == 300
    assert tokenizer.eos_token == "</s>"
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert chat == "<s>user: hi</s>assistant:"


def test_hybrid_artifact_loads_with_the_same_logits(tiny_gemma3_artifact, tiny_gemma3_dir):
    import torch
    from transformers import AutoModelForCausalLM

    source = AutoModelForCausalLM.from_pretrained(tiny_gemma3_dir).eval()
    artifact = AutoModelForCausalLM.from_pretrained(tiny_gemma3_artifact).eval()
    ids = torch.randint(0, 300, (1, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(artifact(ids).logits, source(ids).logits)
    assert read_info(tiny_gemma3_artifact).plan.sliding_window_bytes == 2 * 4 * 8 * 128


def test_compile_bfloat16_stores_bfloat16(tiny_llama_dir, tmp_path):
    from safetensors import safe_open

    out = tmp_path / "bf16"
    kvroom_compile(tiny_llama_dir, out, {**TINY_COMPILE_CONFIG, "dtype": "bf16"}, profile=False)
    with safe_open(str(out / "model.safetensors"), framework="pt") as handle:
        dtypes = {str(handle.get_slice(k).get_dtype()) for k in handle.keys()}  # noqa: SIM118
    assert dtypes == {"BF16"}
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert read_info(out).plan.weight_bytes == 2 * read_info(out).model["num_parameters"]


def test_compile_with_a_halving_adjuster(tiny_llama_dir, tmp_path):
    out = tmp_path / "halved"
    config = DecoderOnlyConfig(
        **TINY_COMPILE_CONFIG, kvcache_num_blocks_adjuster=lambda n, c: n // 2
    )
    info = kvroom_compile(tiny_llama_dir, out, config, profile=False)
    assert info.plan.estimated_num_blocks == ESTIMATE
    assert info.num_blocks == ESTIMATE // 2
    assert info.plan.num_blocks_source == "adjuster"
    text = config_bytes(out).decode()
    assert "adjuster" not in text.replace('"num_blocks_source": "adjuster"', "")
    doc = json.loads(text)
    assert "kvcache_num_blocks_adjuster" not in doc["config"]
    assert doc["kvcache_num_blocks"] == doc["config"]["kvcache_num_blocks"] == ESTIMATE // 2
    assert read_info(out).num_blocks == ESTIMATE // 2


def test_compile_into_a_non_empty_folder(capsys, tiny_llama_dir, tmp_path):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    (out_dir / "keep.txt").write_text("mine")
    rc, _, err = run(capsys, "compile", tiny_llama_dir, "-o", out_dir, *TINY_FLAGS)
    assert_one_line_error(
        rc, err, rf"{re.escape(str(out_dir))}: exists and is not empty \(pass --overwrite"
    )
    assert [p.name for p in out_dir.iterdir()] == ["keep.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]

    kvroom_compile(tiny_llama_dir, out_dir, TINY_COMPILE_CONFIG, overwrite=True, profile=False)
    assert not (out_dir / "keep.txt").exists()
    assert read_info(out_dir).num_blocks == ESTIMATE


def test_compile_onto_a_file(capsys, tiny_llama_dir, tmp_path):
    target = tmp_path / "file"
    target.write_text("x")
    rc, _, err = run(capsys, "compile", tiny_llama_dir, "-o", target, "--overwrite", *TINY_FLAGS)
    assert_one_line_error(rc, err, r": exists and is not a folder$")
    assert target.read_text() == "x"


# -- get / set -------------------------------------------------------------------------------


def test_get(capsys, tiny_artifact):
    rc, out, err = run(capsys, "get", tiny_artifact)
    assert (rc, out, err) == (0, f"{ESTIMATE}\n", "")


def test_get_json(capsys, tiny_artifact):
    rc, out, _ = run(capsys, "get", tiny_artifact, "--json")
    assert rc == 0
    assert json.loads(out) == read_info(tiny_artifact).plan.to_dict()


def test_set_n(capsys, artifact_copy):
    rc, out, err = run(capsys, "set", artifact_copy, "20")
    assert (rc, out) == (0, "20\n")
    assert err == (
        f"kvroom: {artifact_copy}: KV cache: 20 blocks x 4 tokens = 80 tokens (0.0 MiB); "
        "max concurrency at max_seq_len: 1\n"
    )
    assert run(capsys, "get", artifact_copy)[1] == "20\n"


def test_set_auto_with_device_memory(capsys, artifact_copy):
    run(capsys, "set", artifact_copy, "20")
    rc, out, err = run(capsys, "set", artifact_copy, "auto", "--device-memory", "1GiB")
    assert (rc, out) == (0, f"{ESTIMATE}\n"), err
    plan = read_info(artifact_copy).plan
    assert (plan.num_blocks, plan.num_blocks_source) == (ESTIMATE, "auto")


def test_upstream_spellings(capsys, artifact_copy):
    rc, out, _ = run(capsys, "--get-kvcache-num-blocks", artifact_copy)
    assert (rc, out) == (0, f"{ESTIMATE}\n")
    rc, out, err = run(capsys, "--set-kvcache-num-blocks", "24", artifact_copy)
    assert (rc, out) == (0, "24\n"), err
    assert run(capsys, "--get-kvcache-num-blocks", artifact_copy)[1] == "24\n"
    rc, out, err = run(
        capsys, "--set-kvcache-num-blocks", "auto", artifact_copy, "--device-memory", "1GiB"
    )
    assert (rc, out) == (0, f"{ESTIMATE}\n"), err


def test_set_above_estimate_warns(caplog, capsys, artifact_copy):
    rc, out, _ = run(capsys, "set", artifact_copy, "100")
    assert (rc, out) == (0, "100\n")
    assert "kvcache_num_blocks=100 is above the memory estimate of 64 blocks" in caplog.text


# -- bad input: exit 2, one line naming the problem ------------------------------------------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["set", "{art}", "abc"], r"kvcache_num_blocks: must be an integer or 'auto', got 'abc'$"),
        (["set", "{art}", "1.5"], r"kvcache_num_blocks: must be an integer or 'auto', got '1.5'$"),
        (["set", "{art}", "-3"], r"kvcache_num_blocks must be > 0, got -3$"),
        (["set", "{art}", "0"], r"kvcache_num_blocks must be > 0, got 0$"),
        (["--set-kvcache-num-blocks", "-3", "{art}"], r"kvcache_num_blocks must be > 0, got -3$"),
        (["--set-kvcache-num-blocks", "x", "{art}"], r"must be an integer or 'auto', got 'x'$"),
        (["set", "{art}", "15"], r"error: set: 15 blocks is below the minimum of 16 \(one "),
        (
            ["set", "{art}", "auto", "--device-memory", "1MiB"],
            r"Memory is not enough: weights .* exceed the 921\.60 KiB usable",
        ),
        (["set", "{art}", "auto", "--device-memory", "2XB"], r"cannot parse '2XB' as a byte size"),
    ],
)
def test_bad_set_exits_2_and_writes_nothing(capsys, artifact_copy, argv, message):
    before = config_bytes(artifact_copy)
    rc, out, err = run(capsys, *[a.format(art=artifact_copy) for a in argv])
    assert out == ""
    assert_one_line_error(rc, err, message)
    assert config_bytes(artifact_copy) == before


def corrupt(folder: Path, how: str) -> None:
    path = folder / KVROOM_CONFIG
    if how == "truncated":
        path.write_bytes(path.read_bytes()[:100])
    elif how == "garbage":
        path.write_text("this is not json")
    elif how == "future":
        doc = json.loads(path.read_text())
        doc["format_version"] = FORMAT_VERSION + 1
        path.write_text(json.dumps(doc))
    elif how == "disagree":
        doc = json.loads(path.read_text())
        doc["plan"]["num_blocks"] = 20
        path.write_text(json.dumps(doc))


@pytest.mark.parametrize("command", [["get"], ["get", "--json"], ["set", "20"]])
@pytest.mark.parametrize(
    ("how", "message"),
    [
        ("truncated", r"kvroom_config\.json: corrupted or truncated \("),
        ("garbage", r"kvroom_config\.json: corrupted or truncated \("),
        ("future", rf"format_version {FORMAT_VERSION + 1} is newer than this kvroom supports"),
        ("disagree", r"corrupted: kvcache_num_blocks disagrees between sections$"),
    ],
)
def test_broken_artifact(capsys, artifact_copy, command, how, message):
    corrupt(artifact_copy, how)
    before = config_bytes(artifact_copy)
    rc, out, err = run(capsys, command[0], artifact_copy, *command[1:])
    assert out == ""
    assert_one_line_error(rc, err, message)
    assert config_bytes(artifact_copy) == before


@pytest.mark.parametrize("command", [["get"], ["set", "20"], ["--get-kvcache-num-blocks"]])
def test_missing_and_non_artifact_folders(capsys, tmp_path, tiny_llama_dir, command):
    rc, _, err = run(capsys, command[0], tmp_path / "missing", *command[1:])
    assert_one_line_error(rc, err, r"missing: no such artifact folder$")
    assert not (tmp_path / "missing").exists()
    before = sorted(p.name for p in tiny_llama_dir.iterdir())
    rc, _, err = run(capsys, command[0], tiny_llama_dir, *command[1:])
    assert_one_line_error(rc, err, r": not a kvroom artifact \(no kvroom_config\.json\)$")
    assert sorted(p.name for p in tiny_llama_dir.iterdir()) == before


def broken_source(folder: Path, src: Path, how: str) -> Path:
    shutil.copytree(src, folder)
    config = json.loads((folder / "config.json").read_text())
    if how == "no-config":
        (folder / "config.json").unlink()
    elif how == "bad-config":
        (folder / "config.json").write_text("{oops")
    elif how == "no-weights":
        (folder / "model.safetensors").unlink()
    elif how == "bad-weights":
        (folder / "model.safetensors").write_bytes(b"\x01\x02")
    elif how == "unsupported":
        config.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
        (folder / "config.json").write_text(json.dumps(config))
    return folder


SUPPORTED = re.escape(", ".join(SUPPORTED_ARCHITECTURES))


@pytest.mark.parametrize("command", ["plan", "compile"])
@pytest.mark.parametrize(
    ("how", "message"),
    [
        ("missing", r"model '.*missing': no such file or folder \(give an HF folder"),
        ("no-config", r"config\.json not found \(not an HF model folder\)$"),
        ("bad-config", r"cannot read .*config\.json: Expecting property name"),
        ("no-weights", r"no \*\.safetensors weights in "),
        ("bad-weights", r"cannot read safetensors header of .*model\.safetensors"),
        ("unsupported", rf"unsupported architecture GPT2LMHeadModel; supported: {SUPPORTED}$"),
    ],
)
def test_bad_model_source(capsys, tmp_path, tiny_llama_dir, command, how, message):
    model = tmp_path / "missing"
    if how != "missing":
        model = broken_source(tmp_path / "model", tiny_llama_dir, how)
    extra = ["-o", str(tmp_path / "out")] if command == "compile" else []
    rc, out, err = run(capsys, command, model, *extra, *TINY_FLAGS)
    assert out == ""
    assert_one_line_error(rc, err, message)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--kvcache-memory-fraction", "1.5"], r"kvcache_memory_fraction: must be in \(0, 1\]"),
        (["--kvcache-memory-fraction", "0"], r"kvcache_memory_fraction: must be in \(0, 1\]"),
        (["--kvcache-reserve-memory", "2XB"], r"kvcache_reserve_memory: cannot parse '2XB'"),
        (["--device-memory", "lots"], r"device_memory: cannot parse 'lots' as a byte size"),
        (["--device-memory", "0"], r"device_memory: must be > 0 bytes, got 0$"),
        (["--max-seq-len", "0"], r"max_seq_len: must be a positive int, got 0$"),
        (["--batch-size", "-1"], r"batch_size: must be a positive int, got -1$"),
        (["--dtype", "int8"], r"dtype: unknown dtype 'int8'; supported: float32"),
        (
            ["--dtype", "float8_e4m3fn"],
            r"dtype: float8_e4m3fn cannot hold weights and activations; supported: float32, "
            r"bfloat16, float16 \(float8 is for kv_dtype only\)$",
        ),
        (["--device", "tpu"], r"device: unknown device 'tpu'; use cpu, cuda or cuda:N$"),
    ],
)
def test_bad_config_flags(capsys, tiny_llama_dir, tmp_path, flags, message):
    for command in (["plan"], ["compile", "-o", str(tmp_path / "out")]):
        rc, out, err = run(capsys, command[0], tiny_llama_dir, *command[1:], *TINY_FLAGS, *flags)
        assert out == ""
        assert_one_line_error(rc, err, message)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (  # plan only: compile gets past this check (a measured runtime might fit), then fails
            ["--device-memory", "1MiB"],
            r"Memory is not enough: weights [\d.]+ KiB \+ runtime buffers [\d.]+ KiB = [\d.]+ KiB "
            r"exceed the 921\.60 KiB usable .* To fit: give kvroom at least 1\.09 MiB of device "
            r"memory \(device_memory now 1\.00 MiB, explicit\)",
        ),
        (
            ["--device-memory", "100KiB"],
            r"Memory is not enough: the weights alone \(110\.12 KiB\) exceed the 90\.00 KiB usable",
        ),
        (
            ["--kvcache-reserve-memory", "1TiB"],
            r"Memory is not enough: kvcache_reserve_memory \(1\.00 TiB\) leaves nothing of the "
            r"921\.60 MiB kvroom may use .* To fit: reserve at most [\d.]+ MiB$",
        ),
    ],
)
def test_too_little_memory_names_the_term_that_does_not_fit(
    capsys, tiny_llama_dir, tmp_path, flags, message
):
    commands = [["plan"], ["compile", "-o", str(tmp_path / "out")]]
    for command in commands[: 1 if flags[1] == "1MiB" else 2]:
        rc, out, err = run(capsys, command[0], tiny_llama_dir, *command[1:], *TINY_FLAGS, *flags)
        assert out == ""
        assert_one_line_error(rc, err, message)
        assert not re.search(r"-\d", err), err  # no negative budget in the message
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["plan", "{src}", "--max-seq-len", "abc"], r"argument --max-seq-len: expected an integer"),
        (["plan", "{src}", "--batch-size", "1.5"], r"argument --batch-size: expected an integer"),
        (
            ["plan", "{src}", "--kvcache-memory-fraction", "x"],
            r"argument --kvcache-memory-fraction: expected a number, got 'x'",
        ),
        (["set", "{src}"], r"the following arguments are required: num_blocks"),
        (["compile", "{src}"], r"the following arguments are required: -o/--output"),
        (["frobnicate"], r"invalid choice: 'frobnicate'"),
    ],
)
def test_usage_errors_are_one_line(capsys, tiny_llama_dir, argv, message):
    rc, out, err = run(capsys, *[a.format(src=tiny_llama_dir) for a in argv])
    assert rc == 2
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("kvroom"), err
    assert re.search(message, err), err


# -- the real process: exit code and a single stderr line ------------------------------------


def kvroom(*args: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvroom", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def assert_process_error(done: subprocess.CompletedProcess[str], message: str) -> None:
    assert done.returncode == 2, done.stderr
    assert done.stdout == ""
    assert done.stderr.count("\n") == 1, done.stderr
    assert "Traceback" not in done.stderr
    assert re.search(message, done.stderr), done.stderr


def test_process_get_missing_folder(tmp_path):
    done = kvroom("get", tmp_path / "missing")
    assert_process_error(done, r"^kvroom: error: .*missing: no such artifact folder\n$")


def test_process_bad_set_keeps_the_file(artifact_copy):
    before = config_bytes(artifact_copy)
    done = kvroom("set", artifact_copy, "abc")
    assert_process_error(done, r"^kvroom: error: kvcache_num_blocks: must be an integer or 'auto'")
    done = kvroom("--set-kvcache-num-blocks", "15", artifact_copy)
    assert_process_error(done, r"^kvroom: error: set: 15 blocks is below the minimum of 16 ")
    assert config_bytes(artifact_copy) == before


def test_process_set_and_get(artifact_copy):
    done = kvroom("set", artifact_copy, "20")
    assert (done.returncode, done.stdout) == (0, "20\n"), done.stderr
    done = kvroom("get", artifact_copy)
    assert (done.returncode, done.stdout) == (0, "20\n"), done.stderr


def test_process_unsupported_architecture(tmp_path, tiny_llama_dir):
    model = broken_source(tmp_path / "model", tiny_llama_dir, "unsupported")
    done = kvroom("plan", model, *TINY_FLAGS)
    assert_process_error(done, rf"unsupported architecture GPT2LMHeadModel; supported: {SUPPORTED}")


def test_process_compile_into_non_empty_folder(tmp_path, tiny_llama_dir):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    done = kvroom("compile", tiny_llama_dir, "-o", out, *TINY_FLAGS)
    assert_process_error(done, r"exists and is not empty \(pass --overwrite to replace it\)\n$")


def test_process_usage_error(tmp_path):
    done = kvroom("set", tmp_path)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1, done.stderr
    assert "required: num_blocks" in done.stderr
