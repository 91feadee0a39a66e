"""Sub-commands that run an artifact (added once the runtime exists)."""

from __future__ import annotations

from typing import Any


def add_runtime_commands(sub: Any) -> None:
    return None
