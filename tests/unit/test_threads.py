"""Idle OpenMP threads spin briefly on free cores and sleep at once on oversubscribed ones."""

from __future__ import annotations

import pytest

from kvroom import threads


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in threads.WAIT_ENV:  # recorded, so what a test sets is undone after it
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    return monkeypatch


def test_free_cores_get_a_bounded_spin(env: pytest.MonkeyPatch) -> None:
    env.setattr(threads.os, "getloadavg", lambda: (1.5, 1.0, 1.0))
    threads.choose_wait_policy()
    assert threads.os.environ["GOMP_SPINCOUNT"] == str(threads.SPIN_COUNT)
    assert "OMP_WAIT_POLICY" not in threads.os.environ
    assert threads.describe() == f"GOMP_SPINCOUNT={threads.SPIN_COUNT}"


def test_oversubscribed_cores_sleep_at_once(env: pytest.MonkeyPatch) -> None:
    env.setattr(threads.os, "getloadavg", lambda: (14.0, 14.0, 14.0))
    threads.choose_wait_policy()
    assert threads.os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    assert "GOMP_SPINCOUNT" not in threads.os.environ


def test_the_environment_wins(env: pytest.MonkeyPatch) -> None:
    env.setenv("OMP_WAIT_POLICY", "ACTIVE")
    env.setattr(threads.os, "getloadavg", lambda: (14.0, 14.0, 14.0))
    threads.choose_wait_policy()
    assert threads.os.environ["OMP_WAIT_POLICY"] == "ACTIVE"
    assert "GOMP_SPINCOUNT" not in threads.os.environ
