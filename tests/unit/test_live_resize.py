"""Live resize through LLMEngine + Scheduler + BlockManager over the paged fake runner.

The fake runner reads every sequence's whole history back through its block table on every
step, so a migration that loses or misplaces a token fails there; outputs are a pure function
of the history, so any changed token fails the comparison with the unresized reference.
"""

from __future__ import annotations

import pytest
from engine_fakes import FakeRunner, reference_output
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvroom.engine.engine import LLMEngine, RequestOutput
from kvroom.engine.kv.block_manager import BlockManager
from kvroom.engine.params.sampling import SamplingParams
from kvroom.engine.sched.scheduler import Scheduler
from kvroom.errors import ConfigError

MAX_SEQ_LEN = 32  # 8 blocks of 4: the smallest pool the scheduler accepts


def make_engine(num_blocks: int, max_num_seqs: int = 6) -> tuple[LLMEngine, FakeRunner]:
    runner = FakeRunner(num_blocks, 4)
    runner.max_num_blocks = 64
    sched = Scheduler(
        BlockManager(num_blocks, 4),
        max_num_seqs=max_num_seqs,
        max_seq_len=MAX_SEQ_LEN,
        max_num_batched_tokens=16,
    )
    return LLMEngine(sched, runner, eos_token_ids=set(), detokenize=None, pool=runner), runner


def check_kv_matches_history(engine: LLMEngine, runner: FakeRunner) -> None:
    """Every running sequence's KV, read through its (rewritten) table, is what it wrote."""
    for seq_id, history in runner.written.items():
        seq = engine.scheduler.get(seq_id)
        if seq is None or not seq.block_table:
            continue
        got = runner.contents(seq.block_table, seq.num_computed_tokens)
        assert got == history[: seq.num_computed_tokens], f"seq {seq_id}: KV changed"


def prompts(n: int) -> list[tuple[int, ...]]:
    return [tuple(range(10 + i, 10 + i + 2 + i % 5)) for i in range(n)]


PARAMS = SamplingParams(max_tokens=12, ignore_eos=True)


def test_shrink_migrates_running_sequences_and_grow_admits_waiting_ones() -> None:
    engine, runner = make_engine(num_blocks=40)
    ids = [engine.add_request(p, PARAMS) for p in prompts(6)]
    for _ in range(3):
        engine.step()
    finished = [i for i in range(2)]
    for i in finished:  # free low blocks, so the shrink has holes to move into
        engine.abort(ids[i])
    engine.step()
    used = engine.stats.num_used_blocks
    result = engine.resize_kv_cache(used + 1)
    assert (result.from_blocks, result.to_blocks, result.num_preempted) == (40, used + 1, 0)
    assert result.num_moved_blocks > 0 and runner.num_moved == result.num_moved_blocks
    engine.scheduler.check_invariants()
    check_kv_matches_history(engine, runner)
    grown = engine.resize_kv_cache(48)
    assert (grown.to_blocks, engine.stats.num_free_blocks) == (48, 48 - used)
    outs: list[RequestOutput] = []
    while engine.has_unfinished():
        outs += engine.step()
    for rid, p in zip(ids[2:], prompts(6)[2:], strict=True):
        (last,) = [o for o in outs if o.request_id == rid and o.finished]
        assert list(last.output_token_ids) == reference_output(p, PARAMS)
    assert engine.stats.num_kv_resizes == 2


def test_shrink_below_the_used_blocks_preempts_the_newest_only() -> None:
    engine, runner = make_engine(num_blocks=40)
    for p in prompts(5):
        engine.add_request(p, PARAMS)
    for _ in range(4):
        engine.step()
    sched = engine.scheduler
    running = [s.seq_id for s in sched._running]
    result = engine.resize_kv_cache(MAX_SEQ_LEN // 4)
    assert result.num_preempted > 0
    kept = [s.seq_id for s in sched._running]
    assert kept == running[: len(kept)], "only the most recently admitted are preempted"
    sched.check_invariants()
    check_kv_matches_history(engine, runner)


def test_refused_sizes_change_nothing() -> None:
    engine, _ = make_engine(num_blocks=16)
    with pytest.raises(ConfigError, match=r"must be an int >= 8 \(one max_seq_len=32 sequence\)"):
        engine.resize_kv_cache(7)
    with pytest.raises(
        ConfigError,
        match=r"^kvcache_num_blocks: 65 is above the 64 blocks of address space reserved",
    ):
        engine.resize_kv_cache(65)
    assert engine.stats.num_total_blocks == 16 and engine.stats.num_kv_resizes == 0


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    num_requests=st.integers(1, 10),
    max_tokens=st.lists(st.integers(1, 14), min_size=10, max_size=10),
    resizes=st.lists(st.tuples(st.integers(0, 12), st.integers(8, 64)), max_size=6),
)
def test_random_resizes_never_change_a_token(
    num_requests: int, max_tokens: list[int], resizes: list[tuple[int, int]]
) -> None:
    engine, runner = make_engine(num_blocks=24)
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in max_tokens]
    ids = {engine.add_request(p, params[i]): i for i, p in enumerate(prompts(num_requests))}
    at = dict(resizes)  # step -> new size
    outs: list[RequestOutput] = []
    step = 0
    while engine.has_unfinished():
        if step in at:
            engine.resize_kv_cache(at[step])
            engine.scheduler.check_invariants()
            check_kv_matches_history(engine, runner)
        outs += engine.step()
        engine.scheduler.check_invariants()
        step += 1
        assert step < 500, "no progress"
    for rid, i in ids.items():
        (last,) = [o for o in outs if o.request_id == rid and o.finished]
        assert list(last.output_token_ids) == reference_output(prompts(num_requests)[i], params[i])
