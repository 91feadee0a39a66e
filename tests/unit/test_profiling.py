"""``kvroom.profiling``: the peak-shape and cache-filling steps (no model needed)."""

from __future__ import annotations

from types import SimpleNamespace

from kvroom.config import DecoderOnlyConfig
from kvroom.plan.measured import STEP_SHAPES
from kvroom.profiling import FILL_TOKEN_COUNTS, _chunk_sizes, fill_steps, peak_steps


def _info(**kwargs: int) -> SimpleNamespace:
    base = dict(max_seq_len=32, batch_size=4, kvcache_block_size=4, max_num_batched_tokens=16)
    return SimpleNamespace(config=DecoderOnlyConfig(**{**base, **kwargs}))


def test_chunk_sizes_seat_as_many_sequences_as_the_budget_does() -> None:
    assert _chunk_sizes(4, 32, 16) == [10, 2, 2, 2]  # longest first, two tokens at least
    assert _chunk_sizes(4, 8, 64) == [8, 8, 8, 8]  # capped at max_seq_len
    assert _chunk_sizes(8, 32, 6) == [2, 2, 2]  # three seats of two tokens
    assert sum(_chunk_sizes(32, 2048, 512)) == 512


def test_peak_steps_are_at_full_context_and_within_the_budget() -> None:
    steps = peak_steps(_info(), vocab_size=100)
    assert tuple(steps) == STEP_SHAPES
    for step in steps.values():
        assert step.num_tokens <= 16
        for s in step.seqs:
            assert s.start_pos + len(s.token_ids) == 32  # ends at max_seq_len
            assert s.block_table == tuple(reversed(range(8)))  # never the contiguous path
            assert s.sampling.top_p < 1.0 and s.needs_sample
    assert [len(s.token_ids) for s in steps["decode"].seqs] == [1, 1, 1, 1]
    assert [len(s.token_ids) for s in steps["prefill"].seqs] == [16]
    assert [len(s.token_ids) for s in steps["mixed"].seqs] == [1, 1, 1, 13]


def test_fill_steps_have_every_size_once() -> None:
    sizes = [s.num_tokens for s in fill_steps(_info(max_num_batched_tokens=64), 100)]
    assert sizes == list(range(1, FILL_TOKEN_COUNTS + 1))
    assert [s.num_tokens for s in fill_steps(_info(max_num_batched_tokens=4), 100)] == [1, 2, 3, 4]
