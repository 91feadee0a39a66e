"""``kvroom.heap``: the heap policy calls are safe to repeat and trim gives memory back."""

from __future__ import annotations

from kvroom import heap


def test_configure_is_idempotent_and_loading_restores() -> None:
    heap.configure()
    heap.configure()
    with heap.loading():
        block = bytearray(1 << 20)
        del block
    heap.trim()
