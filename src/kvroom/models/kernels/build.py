"""Build and load the native CPU kernels (``cpu_kernels.cpp``) once per CPU and compiler.

The library is compiled on first use with ``g++ -O3 -march=native -fopenmp`` (about 2 s) into
``$KVROOM_CACHE_DIR/kernels`` (default ``~/.cache/kvroom/kernels``), named by a hash of the
sources, the compiler and the CPU's flags, so a machine with another CPU builds its own copy and
a rebuild happens only when one of them changes. The sources are split by ISA (AVX-512 code in
its own headers, compiled where the target has it); ``build_library(..., march=LEVEL)`` builds
them for an x86-64 level (``LEVELS``) whatever the CPU, which the tests do for every level.
The build writes a temporary file and renames it, so concurrent processes never load a
half-written library. ``-fopenmp`` links
``libgomp.so.1``, the SONAME of the OpenMP runtime torch already loaded, so the kernels run on
torch's thread pool with torch's thread count.

Where there is no compiler, the build fails, or ``KVROOM_NATIVE_KERNELS=0``, ``library()`` is
None and every caller takes its pure-torch path. A failed build logs one line naming the log file
that holds the compiler's output, and is not retried until the sources or the compiler change.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

log = logging.getLogger("kvroom.kernels")

SOURCE = Path(__file__).with_name("cpu_kernels.cpp")
ABI_VERSION = 12
LEVELS = ("x86-64-v2", "x86-64-v3", "x86-64-v4")
"""x86-64 levels the sources build for: SSE4.2, AVX2 + FMA, AVX-512 (F, BW, DQ, VL)."""
_FLAGS = ["-O3", "-ffp-contract=fast", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]
_FLAGS += ["-Wno-psabi"]  # 32-byte vectors passed between inlined helpers on SSE-only levels


def cpu_flags() -> frozenset[str]:
    """The ``flags`` of ``/proc/cpuinfo`` (empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return frozenset(line.partition(":")[2].split())


def cache_dir() -> Path:
    root = os.environ.get("KVROOM_CACHE_DIR") or Path.home() / ".cache" / "kvroom"
    return Path(root) / "kernels"


def has_compiler() -> bool:
    return _compiler() is not None


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def sources(source: Path | None = None) -> list[Path]:
    """The files one build reads: the entry points (``SOURCE``) and the headers beside them."""
    source = source or SOURCE
    return [source, *sorted(source.parent.glob("*.h"))]


def _build(cxx: str, target: Path, source: Path = SOURCE, march: str = "native") -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        cmd = [cxx, *_FLAGS, f"-march={march}", "-o", tmp, str(source)]
        subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=300)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _signature(lib: ctypes.CDLL) -> ctypes.CDLL:
    i64, i32, f32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_void_p
    lib.kvroom_decode_attention.argtypes = [
        ptr,
        i64,
        i32,
        ptr,
        i32,
        ptr,
        i64,
        ptr,
        ptr,
        i32,
        i32,
        i32,
        i32,
        i32,
        f32,
        f32,
        i32,
    ]
    lib.kvroom_decode_attention.restype = i32
    lib.kvroom_prefill_attention.argtypes = [ptr, i64, i32, ptr, i32, ptr, i64, ptr, ptr, ptr]
    lib.kvroom_prefill_attention.argtypes += [i32, i32, i32, i32, i32, f32]
    lib.kvroom_prefill_attention.restype = i32
    lib.kvroom_silu_mul.argtypes = [ptr, ptr, i32, i64, i64, i32]
    lib.kvroom_silu_mul.restype = i32
    lib.kvroom_add_rms_norm.argtypes = [ptr, ptr, ptr, ptr, i32, i64, i64, f32, i32]
    lib.kvroom_add_rms_norm.restype = i32
    for gemm in (lib.kvroom_panel_gemm, lib.kvroom_panel_gemm_bf16):
        gemm.argtypes = [ptr, i64, ptr, ptr, ptr, i64, i64, i32, i64, i32]
        gemm.restype = i32
    for glu in (lib.kvroom_panel_glu, lib.kvroom_panel_glu_bf16):
        glu.argtypes = [ptr, i64, ptr, ptr, i64, i32, i64]
        glu.restype = i32
    lib.kvroom_quant_gemm.argtypes = [ptr, i64, ptr, ptr, ptr, i32, i32, i32, ptr, ptr, i32, i64]
    lib.kvroom_quant_gemm.argtypes += [i64, i32, i64, i32, i32]
    lib.kvroom_quant_gemm.restype = i32
    lib.kvroom_decode_vectorized.argtypes = [i32]
    lib.kvroom_decode_vectorized.restype = i32
    lib.kvroom_prefill_vectorized.argtypes = [i32]
    lib.kvroom_prefill_vectorized.restype = i32
    _signature_q(lib)
    _signature_layers(lib)
    return lib


def _signature_layers(lib: ctypes.CDLL) -> None:
    """The whole-step decode entry point (``decode_layers.h``)."""
    i64, i32, f32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_void_p
    lib.kvroom_decode_layers.argtypes = [ptr, i32, ptr, i32, ptr, i32, ptr, ptr, i64, ptr, ptr]
    lib.kvroom_decode_layers.argtypes += [i32] * 7 + [f32, f32, ptr, i32, i32, i32]
    lib.kvroom_decode_layers.restype = i32
    lib.kvroom_decode_layers_work.argtypes = [i32] * 6
    lib.kvroom_decode_layers_work.restype = i64


def _signature_q(lib: ctypes.CDLL) -> None:
    """The int8/int4 KV attention entry points (``kvq_attention.h``)."""
    i64, i32, f32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_void_p
    lib.kvroom_decode_attention_q.argtypes = [ptr, i64, i32, ptr, i32, ptr, i64, ptr, ptr]
    lib.kvroom_decode_attention_q.argtypes += [i32, i32, i32, i32, i32, f32, f32, i32]
    lib.kvroom_decode_attention_q.restype = i32
    lib.kvroom_prefill_attention_q.argtypes = [ptr, i64, i32, ptr, i32, ptr, i64, ptr, ptr, ptr]
    lib.kvroom_prefill_attention_q.argtypes += [i32, i32, i32, i32, i32, f32]
    lib.kvroom_prefill_attention_q.restype = i32
    lib.kvroom_hadamard_rows.argtypes = [ptr, i64, ptr, i64, i32, i64, i32, i32]
    lib.kvroom_hadamard_rows.restype = i32
    lib.kvroom_kv_quantize.argtypes = [ptr, i64, i32, i32, ptr]
    lib.kvroom_kv_quantize.restype = i32


def compile_library(source: Path, target: Path, march: str = "native") -> None:
    """Compile ``source`` (its headers beside it) into ``target`` for ``march`` without loading
    it: a level this CPU cannot run still builds. Raises ``OSError`` where there is no compiler,
    ``CalledProcessError`` (the compiler's output in ``stderr``) where the build fails."""
    cxx = _compiler()
    if cxx is None:
        raise OSError("no C++ compiler (g++) found")
    _build(cxx, target, source, march)


def build_library(source: Path, target: Path, march: str = "native") -> ctypes.CDLL:
    """``source`` (another version of ``cpu_kernels.cpp``, its headers beside it) built as the
    package's own is, or for an x86-64 level (``march``), and loaded, so a benchmark can time two
    versions of a kernel in one process and the tests can run each level's code. Raises where
    there is no compiler, the build fails, or the source has another ABI (its entry points
    differ)."""
    compile_library(source, target, march)
    return load_library(target, source)


def load_library(path: Path, source: Path | None = None) -> ctypes.CDLL:
    """A built library loaded, its ABI checked (``OSError`` naming ``source`` otherwise)."""
    lib = ctypes.CDLL(str(path))
    if lib.kvroom_abi_version() != ABI_VERSION:
        name = source or path
        raise OSError(f"{name}: kernels ABI {lib.kvroom_abi_version()}, expected {ABI_VERSION}")
    return _signature(lib)


@cache
def library() -> ctypes.CDLL | None:
    """The loaded kernels, built first if needed; None when they cannot be had (logged once)."""
    if os.environ.get("KVROOM_NATIVE_KERNELS", "1") == "0":
        log.info("native CPU kernels: off (KVROOM_NATIVE_KERNELS=0); using torch kernels")
        return None
    cxx = _compiler()
    if cxx is None:
        log.warning("native CPU kernels: no C++ compiler (g++) found; using torch kernels")
        return None
    key = _build_key(cxx)
    target = cache_dir() / f"kvroom_cpu_{key}.so"
    failed = cache_dir() / f"build-{key}.log"
    if not target.exists() and failed.exists():
        log.warning(_did_not_build("an earlier build failed", failed))
        return None
    try:
        if not target.exists():
            _build(cxx, target, SOURCE)
        lib = _signature(ctypes.CDLL(str(target)))
        if lib.kvroom_abi_version() != ABI_VERSION:
            raise OSError(f"{target}: ABI {lib.kvroom_abi_version()}, expected {ABI_VERSION}")
    except subprocess.CalledProcessError as exc:
        failed.write_text(f"$ {' '.join(map(str, exc.cmd))}\n{exc.stdout}{exc.stderr}")
        log.warning(_did_not_build(f"{Path(cxx).name} exit {exc.returncode}", failed))
        return None
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("native CPU kernels did not load (%s); using torch kernels", exc)
        return None
    return lib


def _build_key(cxx: str) -> str:
    """Hash of the sources, the compiler and its flags, and the CPU's flags."""
    key = hashlib.sha256()
    for path in sources():
        key.update(path.name.encode() + path.read_bytes())
    key.update(" ".join([cxx, *_FLAGS, "-march=native", *sorted(cpu_flags())]).encode())
    key.update(subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout.encode())
    return key.hexdigest()[:16]


def _did_not_build(why: str, log_path: Path) -> str:
    return f"native CPU kernels did not build ({why}; log: {log_path}); using torch kernels"
