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


def test_status_bytes_reads_the_asked_fields_in_bytes_and_leaves_out_unknown_ones() -> None:
    fields = heap.status_bytes("VmRSS", "VmHWM", "NoSuchField")
    assert set(fields) == {"VmRSS", "VmHWM"}
    assert fields["VmHWM"] >= fields["VmRSS"] > 1 << 20  # kB scaled to bytes


def test_status_bytes_is_empty_where_the_file_cannot_be_read(monkeypatch) -> None:
    monkeypatch.setattr(heap, "PROC_STATUS", "/nonexistent/status")
    assert heap.status_bytes("VmRSS") == {}
