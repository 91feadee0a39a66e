"""kvroom.artifact.resize and layout: get/set of the pool size, and reading kvroom_config.json."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from pathlib import Path

import pytest

from kvroom.artifact.layout import FORMAT_VERSION, KVROOM_CONFIG, read_info
from kvroom.artifact.resize import get_kvcache_num_blocks, replan, set_kvcache_num_blocks
from kvroom.errors import ArtifactError, ConfigError, MemoryNotEnoughError
from tiny_models import compile_tiny_artifact, write_tiny_llama

ESTIMATE = 64  # batch 4 x 16 blocks; 1 GiB holds far more (see tiny_models.TINY_COMPILE_CONFIG)
MIN_BLOCKS = 16  # max_seq_len 64 / block 4
LOCK_FILE = f".{KVROOM_CONFIG}.lock"


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("resize")
    return compile_tiny_artifact(write_tiny_llama(root / "src"), root / "artifact")


@pytest.fixture
def art(compiled, tmp_path) -> Path:
    return Path(shutil.copytree(compiled, tmp_path / "artifact"))


def config_bytes(folder: Path) -> bytes:
    return (folder / KVROOM_CONFIG).read_bytes()


def snapshot(folder: Path) -> dict[str, tuple[str, int, int]]:
    """name -> (sha256, st_mtime_ns, st_size) of every file except kvroom_config.json."""
    out = {}
    for file in sorted(folder.iterdir()):
        if file.name in (KVROOM_CONFIG, LOCK_FILE):
            continue
        st = file.stat()
        out[file.name] = (hashlib.sha256(file.read_bytes()).hexdigest(), st.st_mtime_ns, st.st_size)
    return out


def assert_consistent(folder: Path, n: int) -> None:
    doc = json.loads(config_bytes(folder))
    assert doc["kvcache_num_blocks"] == doc["config"]["kvcache_num_blocks"] == n
    assert doc["plan"]["num_blocks"] == n
    info = read_info(folder)
    assert info.num_blocks == info.config.kvcache_num_blocks == n


# -- get / set -------------------------------------------------------------------------------


def test_get_reads_the_compiled_estimate(art):
    assert get_kvcache_num_blocks(art) == ESTIMATE
    info = read_info(art)
    assert info.plan.estimated_num_blocks == ESTIMATE
    assert info.plan.num_min_blocks == MIN_BLOCKS
    assert info.plan.num_blocks_source == "estimate"
    assert info.model["architecture"] == "LlamaForCausalLM"


@pytest.mark.parametrize("n", [MIN_BLOCKS, 20, ESTIMATE, "33", " 40 "])
def test_set_get_round_trip(art, n):
    plan = set_kvcache_num_blocks(art, n)
    expected = int(n)
    assert plan.num_blocks == expected
    assert plan.num_blocks_source == "set"
    assert plan.estimated_num_blocks == ESTIMATE  # the recorded estimate is kept
    assert get_kvcache_num_blocks(art) == expected
    assert read_info(art).plan == plan
    assert_consistent(art, expected)


def test_set_twice(art):
    set_kvcache_num_blocks(art, 20)
    set_kvcache_num_blocks(art, 30)
    assert_consistent(art, 30)


def test_set_rewrites_only_kvroom_config(art):
    before = snapshot(art)
    old_names = {p.name for p in art.iterdir()}
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= set(before)
    set_kvcache_num_blocks(art, 20)
    assert snapshot(art) == before  # bytes, mtimes and sizes of every other file unchanged
    new_names = {p.name for p in art.iterdir()} - old_names
    assert new_names <= {LOCK_FILE}  # at most the (empty) lock file beside it
    assert not list(art.glob(f".{KVROOM_CONFIG}.*.tmp"))


def test_set_keeps_the_file_mode(art):
    path = art / KVROOM_CONFIG
    path.chmod(0o640)
    set_kvcache_num_blocks(art, 20)
    assert path.stat().st_mode & 0o777 == 0o640


def test_set_below_min_names_the_minimum_and_writes_nothing(art):
    before = config_bytes(art)
    with pytest.raises(
        ConfigError,
        match=rf"^set: 15 blocks is below the minimum of {MIN_BLOCKS} \(one max_seq_len=64 "
        rf"sequence in blocks of 4 tokens\); use at least {MIN_BLOCKS}, or a lower max_seq_len",
    ) as info:
        set_kvcache_num_blocks(art, MIN_BLOCKS - 1)
    assert not isinstance(info.value, MemoryNotEnoughError)  # the memory holds far more
    assert config_bytes(art) == before


@pytest.mark.parametrize(
    ("value", "error", "message"),
    [
        (0, ConfigError, r"^set: kvcache_num_blocks must be > 0, got 0$"),
        (-5, ConfigError, r"^set: kvcache_num_blocks must be > 0, got -5$"),
        ("-5", ConfigError, r"^set: kvcache_num_blocks must be > 0, got -5$"),
        ("abc", ConfigError, r"^kvcache_num_blocks: must be an integer or 'auto', got 'abc'$"),
        ("1.5", ConfigError, r"^kvcache_num_blocks: must be an integer or 'auto', got '1.5'$"),
        ("", ConfigError, r"^kvcache_num_blocks: must be an integer or 'auto', got ''$"),
        (True, ConfigError, r"^kvcache_num_blocks: must be an integer or 'auto', got True$"),
        ("AUTO", ConfigError, r"got 'AUTO'$"),
    ],
)
def test_set_bad_values_write_nothing(art, value, error, message):
    before = config_bytes(art)
    with pytest.raises(error, match=message):
        set_kvcache_num_blocks(art, value)
    assert config_bytes(art) == before


def test_set_above_estimate_warns_and_is_honoured(art, caplog):
    with caplog.at_level(logging.WARNING, logger="kvroom"):
        plan = set_kvcache_num_blocks(art, 100)
    assert plan.num_blocks == 100
    assert_consistent(art, 100)
    warnings = [r for r in caplog.records if r.name == "kvroom" and r.levelno == logging.WARNING]
    assert len(warnings) == 1
    expected = (
        f"set: kvcache_num_blocks=100 is above the memory estimate of {ESTIMATE} blocks "
        "(1.00 GiB device memory, explicit); honoured"
    )
    assert warnings[0].getMessage().startswith(expected)


def test_set_at_estimate_does_not_warn(art, caplog):
    with caplog.at_level(logging.WARNING, logger="kvroom"):
        set_kvcache_num_blocks(art, ESTIMATE)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_set_auto_re_estimates_for_device_memory(art):
    old = read_info(art).plan
    fixed = old.weight_bytes + old.runtime_bytes + old.sliding_window_bytes
    # Memory for 20 blocks and half a block more: by hand, usable = int(mem * 0.9) - 0,
    # budget = usable - weights - runtime - sliding, fit = budget // bytes_per_block.
    wanted_usable = fixed + 20 * old.kv_bytes_per_block + old.kv_bytes_per_block // 2
    device_memory = -(-wanted_usable * 10 // 9)  # ceil(wanted / 0.9)
    usable = int(device_memory * 0.9)
    expected = min(old.num_full_blocks, (usable - fixed) // old.kv_bytes_per_block)
    assert expected == 20

    plan = set_kvcache_num_blocks(art, "auto", device_memory=device_memory)
    assert plan.num_blocks == plan.estimated_num_blocks == plan.num_fit_blocks == 20
    assert plan.num_blocks_source == "auto"
    assert plan.device_memory_bytes == device_memory
    assert plan.device_memory_source == "explicit"
    assert plan.usable_bytes == usable
    assert plan.kv_budget_bytes == usable - fixed
    assert_consistent(art, 20)
    assert read_info(art).plan == plan


def test_set_auto_then_n_is_checked_against_the_new_estimate(art, caplog):
    set_kvcache_num_blocks(art, "auto", device_memory="1GiB")
    assert get_kvcache_num_blocks(art) == ESTIMATE
    with caplog.at_level(logging.WARNING, logger="kvroom"):
        set_kvcache_num_blocks(art, ESTIMATE + 1)
    assert "above the memory estimate of 64 blocks" in caplog.text


def test_set_auto_with_a_profile(art):
    plan = set_kvcache_num_blocks(art, "auto", device_memory="h100-80gb")
    assert plan.num_blocks == ESTIMATE  # capped at batch_size full sequences
    assert plan.device_memory_source == "profile:h100-80gb"
    assert plan.device_memory_bytes == 81559 * 2**20


def test_set_auto_with_too_little_memory_errors_and_writes_nothing(art):
    before = config_bytes(art)
    with pytest.raises(
        MemoryNotEnoughError,
        match=r"^Memory is not enough: weights [\d.]+ KiB \+ runtime buffers [\d.]+ KiB = "
        r"[\d.]+ KiB exceed the 921\.60 KiB usable \(1\.00 MiB device memory x "
        r"kvcache_memory_fraction 0\.9\)\. To fit: give kvroom at least 1\.09 MiB",
    ):
        set_kvcache_num_blocks(art, "auto", device_memory="1MiB")
    assert config_bytes(art) == before


def test_set_auto_with_unparsable_memory(art):
    before = config_bytes(art)
    with pytest.raises(ConfigError, match=r"^device_memory: cannot parse '2XB' as a byte size"):
        set_kvcache_num_blocks(art, "auto", device_memory="2XB")
    assert config_bytes(art) == before


def test_replan_without_change_returns_the_recorded_plan(art):
    info = read_info(art)
    assert replan(info, None, source="override") is info.plan


def test_replan_override_does_not_write(art):
    before = config_bytes(art)
    plan = replan(read_info(art), 20, source="override")
    assert (plan.num_blocks, plan.num_blocks_source) == (20, "override")
    assert config_bytes(art) == before


# -- read_info errors --------------------------------------------------------------------------


def test_read_missing_folder(tmp_path):
    with pytest.raises(ArtifactError, match=r"nope: no such artifact folder$"):
        read_info(tmp_path / "nope")
    with pytest.raises(ArtifactError, match=r"no such artifact folder"):
        get_kvcache_num_blocks(tmp_path / "nope")
    with pytest.raises(ArtifactError, match=r"no such artifact folder"):
        set_kvcache_num_blocks(tmp_path / "nope", 20)
    assert not (tmp_path / "nope").exists()  # set created nothing


def test_read_folder_without_kvroom_config(tmp_path):
    with pytest.raises(ArtifactError, match=r": not a kvroom artifact \(no kvroom_config\.json\)$"):
        read_info(tmp_path)


def rewrite(folder: Path, edit) -> None:
    doc = json.loads(config_bytes(folder))
    edit(doc)
    (folder / KVROOM_CONFIG).write_text(json.dumps(doc))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (None, r"corrupted or truncated \("),  # None: the real file cut in half
        ("", r"corrupted or truncated \("),
        ("garbage {", r"corrupted or truncated \("),
        ("\x00\x01\x02", r"corrupted or truncated \("),
        ("[1, 2]", r"corrupted: expected a JSON object$"),
        ("null", r"corrupted: expected a JSON object$"),
    ],
    ids=["truncated", "empty", "garbage", "binary", "list", "null"],
)
def test_read_corrupted_json(art, text, message):
    path = art / KVROOM_CONFIG
    if text is None:
        text = path.read_text()[: len(path.read_text()) // 2]
    path.write_text(text)
    with pytest.raises(ArtifactError, match=message):
        read_info(art)


def test_read_invalid_utf8(art):
    (art / KVROOM_CONFIG).write_bytes(b'{"format_version": "\xff"}')
    with pytest.raises(ArtifactError, match=r"corrupted or truncated"):
        read_info(art)


def test_read_format_version_from_the_future(art):
    rewrite(art, lambda d: d.update(format_version=FORMAT_VERSION + 1, plan="a new layout"))
    with pytest.raises(
        ArtifactError,
        match=rf"format_version {FORMAT_VERSION + 1} is newer than this kvroom supports "
        rf"\({FORMAT_VERSION}\); upgrade kvroom$",
    ):
        read_info(art)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d.pop("format_version"), r"corrupted: format_version is None$"),
        (lambda d: d.update(format_version="1"), r"corrupted: format_version is '1'$"),
        (lambda d: d.update(format_version=True), r"corrupted: format_version is True$"),
        (lambda d: d.update(format_version=0), r"corrupted: format_version is 0$"),
        (lambda d: d.pop("plan"), r"corrupted: missing plan$"),
        (lambda d: (d.pop("config"), d.pop("model")), r"corrupted: missing config, model$"),
        (lambda d: d.update(model=5), r"corrupted: model must be JSON objects$"),
        (lambda d: d.update(config=["ab"], plan=[1]), r"corrupted: config, plan must be JSON"),
        (lambda d: d["plan"].pop("num_blocks"), r"corrupted: .*missing 1 required .*num_blocks"),
        (lambda d: d["plan"].update(extra=1), r"corrupted: .*unexpected keyword argument 'extra'"),
        (lambda d: d["config"].update(extra=1), r"corrupted: .*unknown field\(s\) extra$"),
        (
            lambda d: d["config"].update(batch_size=-1),
            r"corrupted: batch_size: must be a positive int, got -1$",
        ),
    ],
)
def test_read_corrupted_document(art, edit, message):
    rewrite(art, edit)
    with pytest.raises(ArtifactError, match=message):
        read_info(art)


@pytest.mark.parametrize(
    "edit",
    [
        lambda d: d.update(kvcache_num_blocks=20),
        lambda d: d["config"].update(kvcache_num_blocks=20),
        lambda d: d["plan"].update(num_blocks=20),
        lambda d: d.update(kvcache_num_blocks="64"),
    ],
    ids=["top", "config", "plan", "top-as-string"],
)
def test_read_sections_disagreeing(art, edit):
    rewrite(art, edit)
    with pytest.raises(
        ArtifactError, match=r"corrupted: kvcache_num_blocks disagrees between sections$"
    ):
        read_info(art)


def test_set_on_a_corrupted_artifact_writes_nothing(art):
    rewrite(art, lambda d: d["plan"].update(num_blocks=20))
    before = config_bytes(art)
    with pytest.raises(ArtifactError, match=r"disagrees between sections"):
        set_kvcache_num_blocks(art, 30)
    assert config_bytes(art) == before


def test_set_on_a_non_artifact_folder_leaves_it_untouched(tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(ArtifactError, match=r"not a kvroom artifact"):
        set_kvcache_num_blocks(tmp_path, 20)
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]  # no lock file left
