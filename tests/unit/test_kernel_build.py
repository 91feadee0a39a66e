"""A build of the native kernels that fails is one line for the user, naming the log that holds
the compiler's output, and is not retried until the sources or the compiler change."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

from kvroom.models.kernels import build

pytestmark = pytest.mark.skipif(not build.has_compiler(), reason="no C++ compiler (g++)")


@pytest.fixture
def broken_source(tmp_path, monkeypatch) -> Path:
    source = tmp_path / "src" / "cpu_kernels.cpp"
    source.parent.mkdir()
    source.write_text("int kvroom_abi_version() { return undeclared_name; }\n")
    monkeypatch.setattr(build, "SOURCE", source)
    monkeypatch.setenv("KVROOM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("KVROOM_NATIVE_KERNELS", "1")
    return source


def _load(caplog) -> list[str]:
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvroom.kernels"):
        assert build.library.__wrapped__() is None
    return [r.getMessage() for r in caplog.records]


def test_a_failed_build_is_one_line_naming_its_log(broken_source, caplog, monkeypatch) -> None:
    (message,) = _load(caplog)
    assert "\n" not in message
    assert re.match(r"native CPU kernels did not build \(\S+ exit 1; log: ", message), message
    assert message.endswith("); using torch kernels")
    log_path = Path(message.split("log: ")[1].split(")")[0])
    assert "undeclared_name" in log_path.read_text()  # the compiler's output is in the log
    runs = []
    monkeypatch.setattr(build, "_build", lambda *a, **k: runs.append(a))
    (again,) = _load(caplog)
    assert runs == [] and "an earlier build failed" in again and str(log_path) in again


def test_a_changed_source_is_built_again(broken_source, caplog, monkeypatch) -> None:
    _load(caplog)
    broken_source.write_text(broken_source.read_text() + "// edited\n")
    runs = []
    monkeypatch.setattr(build, "_build", lambda *a, **k: runs.append(a))
    _load(caplog)
    assert len(runs) == 1
