"""``kvroom.profiling``: the peak-shape and cache-filling steps (no model needed)."""

from __future__ import annotations

from types import SimpleNamespace

from kvroom.config import DecoderOnlyConfig
from kvroom.plan.measured import STEP_SHAPES
from kvroom.profiling import (
    CHURN_START,
    FILL_TOKEN_COUNTS,
    _chunk_sizes,
    _fresh_sizes,
    _ladder,
    churn_steps,
    fill_steps,
    peak_steps,
    round_order,
)


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
    for name, step in steps.items():
        assert step.num_tokens <= 16
        for s in step.seqs:
            if name == "prefill_fresh":  # new prompts
                assert s.start_pos == 0
            else:
                assert s.start_pos + len(s.token_ids) == 32  # ends at max_seq_len
            assert s.block_table == tuple(reversed(range(8)))  # never the contiguous path
            assert s.sampling.top_p < 1.0 and s.needs_sample
    assert [len(s.token_ids) for s in steps["decode"].seqs] == [1, 1, 1, 1]
    assert [len(s.token_ids) for s in steps["prefill"].seqs] == [16]
    assert [len(s.token_ids) for s in steps["mixed"].seqs] == [1, 1, 12, 2]
    assert [len(s.token_ids) for s in steps["prefill_fresh"].seqs] == [16]


def test_fresh_steps_fill_the_budget_with_prompts_of_one_length() -> None:
    assert _fresh_sizes(32, 256, 2048) == [256] * 8
    assert _fresh_sizes(3, 256, 2048) == [256] * 3  # as many prompts as the batch seats
    assert _fresh_sizes(8, 512, 300) == [300]  # one prompt of the whole budget


def test_fill_steps_have_every_size_once() -> None:
    sizes = [s.num_tokens for s in fill_steps(_info(max_num_batched_tokens=64), 100)]
    assert sizes == list(range(1, FILL_TOKEN_COUNTS + 1))
    assert [s.num_tokens for s in fill_steps(_info(max_num_batched_tokens=4), 100)] == [1, 2, 3, 4]


def test_ladder_grows_by_half_and_ends_at_the_stop() -> None:
    assert _ladder(9, 64) == [9, 13, 19, 28, 42, 63, 64]
    assert _ladder(9, 9) == [9]
    assert _ladder(9, 8) == []


def test_churn_steps_cover_chunks_decode_batches_and_mixed_steps() -> None:
    info = _info(max_seq_len=128, batch_size=32, max_num_batched_tokens=64)
    steps = churn_steps(info, vocab_size=100)
    shapes = [[len(s.token_ids) for s in step.seqs] for step in steps]
    chunks = [x[0] for x in shapes if len(x) == 1]
    assert chunks == [9, 13, 19, 28, 42, 63, 64]  # one chunk each, up to the budget
    decodes = [len(x) for x in shapes if len(x) > 1 and set(x) == {1}]
    assert decodes == [9, 13, 19, 28, 32]  # every batch size range, up to batch_size
    mixed = [x for x in shapes if len(x) > 1 and x[-1] == CHURN_START]
    assert [len(x) for x in mixed] == [2, 9, 13, 19, 28, 32]
    for step in steps:
        assert step.num_tokens <= 64
        for s in step.seqs:
            assert s.start_pos + len(s.token_ids) == 128  # at full context, context cached
            assert s.sampling.temperature == 0.0


def test_churn_steps_stay_within_a_short_context_and_small_batch() -> None:
    steps = churn_steps(_info(max_seq_len=16, batch_size=4, max_num_batched_tokens=64), 100)
    shapes = [[len(s.token_ids) for s in step.seqs] for step in steps]
    assert shapes == [[9], [13], [15], [1, 9]]


def test_round_order_puts_each_shape_after_a_different_one() -> None:
    names = list(STEP_SHAPES)
    orders = [round_order(names, r) for r in range(len(names) + 1)]
    assert orders[0] == names
    assert orders[len(names)] == names
    assert {o[0] for o in orders[: len(names)]} == set(names)
    assert all(sorted(o) == sorted(names) for o in orders)
