"""Run a test on both CPU kernel paths: the native kernels and the pure-torch fallbacks.

The choice is made once per process (``kvroom.models.kernels.cpu_kernels``, ``build.library``,
both cached). ``kernel_path`` is a fixture parametrized over ``native`` and ``torch``:

* ``native`` runs where the kernels build and load on this CPU, and skips with the reason
  otherwise (or under ``KVROOM_NATIVE_KERNELS=0``);
* ``torch`` sets ``KVROOM_NATIVE_KERNELS=0`` and forgets the cached choice for the test, so a
  model loaded inside it takes the torch paths; the choice is made afresh after it.

Load the model inside the test (weights are laid out for the kernels at load). Usage::

    from kernel_paths import kernel_path  # noqa: F401 - a fixture

    def test_x(kernel_path: str) -> None: ...
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from kvroom.models import kernels
from kvroom.models.kernels import build, ops


def forget_kernel_choice() -> None:
    """Drop the cached kernel choice (and the per-head-dim answers derived from it)."""
    cached = [build.library, kernels.cpu_kernels]
    cached += [f for f in vars(ops).values() if callable(f) and hasattr(f, "cache_clear")]
    for fn in cached:
        fn.cache_clear()


@pytest.fixture(params=["native", "torch"])
def kernel_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    if request.param == "native":
        if os.environ.get("KVROOM_NATIVE_KERNELS") == "0":
            pytest.skip("native kernels off (KVROOM_NATIVE_KERNELS=0)")
        if not kernels.cpu_kernels().native:
            pytest.skip("native kernels do not build or load on this CPU (see the kvroom log)")
        yield "native"
        return
    switched = kernels.cpu_kernels().native
    if switched:
        monkeypatch.setenv("KVROOM_NATIVE_KERNELS", "0")
        forget_kernel_choice()
    assert not kernels.cpu_kernels().native
    yield "torch"
    if switched:
        forget_kernel_choice()  # chosen again, with the environment restored, on next use
