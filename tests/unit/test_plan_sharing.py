"""What a shared prefix buys: hand-computed concurrency figures."""

from __future__ import annotations

import pytest

from kvroom.errors import ConfigError
from kvroom.plan.sharing import shared_prefix_concurrency, shared_prefix_row

POOL = {"num_blocks": 1000, "block_size": 16, "max_seq_len": 2048, "batch_size": 64}


@pytest.mark.parametrize(
    ("prefix_len", "expected"),
    [
        (0, 7),  # 1000 // 128
        (15, 7),  # no full block to share
        (1024, 14),  # (1000 - 64) // (128 - 64) = 14.6
        (2000, 64),  # (1000 - 125) // 3 = 291, capped by batch_size
        (2048, 64),  # the last block stays private: (1000 - 127) // 1
    ],
)
def test_shared_prefix_concurrency(prefix_len: int, expected: int) -> None:
    assert shared_prefix_concurrency(**POOL, prefix_len=prefix_len) == expected


def test_a_pool_smaller_than_one_sequence_holds_none() -> None:
    pool = {**POOL, "num_blocks": 100}
    assert shared_prefix_concurrency(**pool, prefix_len=1024) == 0


@pytest.mark.parametrize("bad", [-1, 2049, 1.5, True])
def test_bad_prefix_len(bad: object) -> None:
    with pytest.raises(ConfigError, match="shared prefix length"):
        shared_prefix_concurrency(**POOL, prefix_len=bad)  # type: ignore[arg-type]


def test_row_uses_half_max_seq_len_and_says_why_hybrid_models_have_none() -> None:
    row = shared_prefix_row(**POOL, has_sliding_layers=False)
    assert row == ("  with a shared prefix of 1024 tokens", "14")
    capped = shared_prefix_row(**{**POOL, "batch_size": 8}, has_sliding_layers=False)
    assert capped[1] == "8 (batch_size; the pool holds 14)"
    hybrid = shared_prefix_row(**POOL, has_sliding_layers=True)
    assert hybrid[1] == "n/a (sliding-window layers: no prefix caching)"
