"""Public names and the import paths the README shows keep working whatever the layout."""

import importlib
import subprocess
import sys

import pytest

import kvroom


@pytest.mark.parametrize("name", kvroom.__all__)
def test_every_public_name_resolves(name: str) -> None:
    assert getattr(kvroom, name) is not None


@pytest.mark.parametrize(
    ("module", "name"),
    [
        ("kvroom.llm", "LLM"),
        ("kvroom.engine.sampling", "SamplingParams"),
        ("kvroom.artifact.layout", "read_info"),
        ("kvroom.compile", "compile"),
        ("kvroom.cli", "main"),
        ("kvroom.cli.serve_command", "bind_socket"),
        ("kvroom.runtime", "read_spec"),
    ],
)
def test_documented_import_paths(module: str, name: str) -> None:
    assert hasattr(importlib.import_module(module), name)


def test_top_level_names_are_the_rooms_objects() -> None:
    from kvroom.engine.params.sampling import SamplingParams
    from kvroom.engine.params.structured import StructuredOutputsParams
    from kvroom.engine.sampling import SamplingParams as documented

    assert kvroom.SamplingParams is SamplingParams is documented
    assert kvroom.StructuredOutputsParams is StructuredOutputsParams


def test_protocol_and_params_import_without_torch() -> None:
    code = (
        "import sys, kvroom.server.openai.protocol, kvroom.engine.sampling; "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
