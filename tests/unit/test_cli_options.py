"""Start-up flags of ``run`` and ``serve``: what ``LLM(...)`` is given."""

from __future__ import annotations

import pytest

from kvroom.cli import OneLineParser
from kvroom.cli.commands import build_parser
from kvroom.cli.options import startup_overrides


@pytest.mark.parametrize(
    ("flags", "want"),
    [
        ([], {}),
        (["--no-enable-prefix-caching"], {"enable_prefix_caching": False}),
        (["--enable-prefix-caching"], {"enable_prefix_caching": True}),
    ],
)
@pytest.mark.parametrize("command", [["run", "art", "--prompt", "hi"], ["serve", "art"]])
def test_prefix_caching_flags(command: list[str], flags: list[str], want: dict) -> None:
    args = build_parser(OneLineParser).parse_args(command + flags)
    assert startup_overrides(args) == want
