"""The process's native memory policy: one malloc arena, fixed thresholds, a tight load phase,
bounded kernel caches.

The plan promises a peak resident set, so the heap must not keep more than the runtime uses,
and must behave the same in the profiling process as in the deployment. glibc's defaults get
in the way three ways, each measured on SmolLM2 fp32:

* **Loading.** Weights are read, fused, then replaced by packed copies. Under the default
  dynamic thresholds a dense weight of a few MiB comes from the heap, and freeing it after its
  packed copy was allocated above it leaves a hole that stays resident: the load peaked
  113 MB over the resident set it settled at. Inside ``loading()`` every allocation of
  ``LOAD_MMAP_THRESHOLD`` or more gets a mapping of its own, returned to the kernel when
  freed, and the load's peak is its end state (948 MB peak, 942 MB after).
* **Thresholds that move.** By default the mmap threshold rises to the largest chunk freed so
  far (and the trim threshold to twice that), so what the heap keeps depends on the process's
  history. After loading they are fixed at the top of that range (``RUN_MMAP_THRESHOLD``,
  ``RUN_TRIM_THRESHOLD``): step buffers under 32 MiB are reused from the heap as before, and
  the profiling pass sees the same heap the deployment will.
* **Arenas.** Each thread that allocates may get an arena of its own (up to 8 x cores), each
  keeping its own free memory. The engine's work runs on the caller's thread offline and on
  an engine thread in the server; with one arena (``ARENA_MAX``) both keep the same heap.
  Python and torch allocate under the GIL or outside parallel regions, so one arena costs no
  contention worth measuring here.

* **Kernel caches.** oneDNN keeps a compiled primitive per weight and input shape, and
  ideep (torch's oneDNN layer) an LRU of them, 1024 entries each by default: a workload whose
  step sizes vary (a server) grew the resident set by 0.3 MB a step until the caches were
  full (measured +31 MB over 112 steps of a mixed workload on a tiny model; flat after 20 steps
  with the caches bounded). ``bound_kernel_caches`` (run by ``import kvroom``) bounds both at
  ``KERNEL_CACHE_CAPACITY``, and the profiling pass fills them, so their bytes are in the
  plan rather than growing past it.

Everything is a no-op where the C library has no ``mallopt`` (musl, macOS).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
from collections.abc import Iterator

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8

ARENA_MAX = 1
LOAD_MMAP_THRESHOLD = 64 * 2**10
RUN_MMAP_THRESHOLD = 32 * 2**20
"""glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit: the most the dynamic threshold reaches."""
RUN_TRIM_THRESHOLD = 2 * RUN_MMAP_THRESHOLD
"""Twice the mmap threshold, the ratio glibc's dynamic rule keeps."""

KERNEL_CACHE_CAPACITY = 8
"""Entries of oneDNN's primitive cache and of ideep's LRU: one step size's projections and
LM head (five kernels) stay cached through a run of decode steps; an entry measured about
300 KB, so 1024 (the default) could hold 300 MB, and 64 still grew 17 MB over 96 steps."""
KERNEL_CACHE_ENV = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")

PROC_STATUS = "/proc/self/status"

_lock = threading.Lock()
_configured = False


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt  # noqa: B018 - probe: AttributeError where there is no mallopt
        libc.malloc_trim  # noqa: B018
    except (OSError, AttributeError):
        return None
    return libc


def _set(option: int, value: int) -> None:
    libc = _libc()
    if libc is not None:
        libc.mallopt(ctypes.c_int(option), ctypes.c_int(value))


def configure() -> None:
    """Set the run-time heap policy (one arena, fixed thresholds, bounded kernel caches);
    once per process.

    Call before the runtime starts threads or runs its first kernel; later calls do nothing.
    """
    global _configured
    with _lock:
        if _configured:
            return
        _configured = True
        bound_kernel_caches()
        _set(M_ARENA_MAX, ARENA_MAX)
        _run_thresholds()


def bound_kernel_caches() -> None:
    """Bound oneDNN's and ideep's kernel caches (unless the environment sets them already).

    They read the environment when torch loads them, so ``import kvroom`` calls this before
    anything imports torch; where torch came first the caches keep torch's defaults.
    """
    for name in KERNEL_CACHE_ENV:
        os.environ.setdefault(name, str(KERNEL_CACHE_CAPACITY))


def _run_thresholds() -> None:
    _set(M_MMAP_THRESHOLD, RUN_MMAP_THRESHOLD)
    _set(M_TRIM_THRESHOLD, RUN_TRIM_THRESHOLD)


@contextlib.contextmanager
def loading() -> Iterator[None]:
    """Give every allocation of ``LOAD_MMAP_THRESHOLD`` or more a mapping of its own while
    weights load; afterwards the run-time thresholds apply and the heap is trimmed."""
    configure()
    _set(M_MMAP_THRESHOLD, LOAD_MMAP_THRESHOLD)
    try:
        yield
    finally:
        _run_thresholds()
        trim()


def trim() -> None:
    """Return the heap's free pages to the kernel (``malloc_trim(0)``)."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(ctypes.c_size_t(0))


def status_bytes(*keys: str) -> dict[str, int]:
    """The ``kB`` fields ``keys`` of ``/proc/self/status`` (``VmRSS``, ``VmHWM``,
    ``RssFile``...) in bytes, read at once; a field the kernel does not show is left out, and
    where the file cannot be read the dict is empty."""
    wanted = tuple(f"{k}:".encode() for k in keys)
    try:
        with open(PROC_STATUS, "rb") as f:
            status = f.read()
    except OSError:
        return {}
    found = {}
    for line in status.splitlines():
        if line.startswith(wanted):
            key, value = line.split()[:2]
            found[key[:-1].decode()] = int(value) * 1024
    return found
