"""Scheduler: admission, chunked prefill, preemption with recompute, abort, stop rules."""

from __future__ import annotations

import pytest
from engine_fakes import BLOCK_SIZE, Driver, make_scheduler, make_seq, reference_output, sizes
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroom.engine.params.sampling import SamplingParams
from kvroom.engine.sched.scheduler import Scheduler
from kvroom.engine.sched.sequence import Sequence, SequenceStatus
from kvroom.errors import AdmissionError, ConfigError

# -- admission ---------------------------------------------------------------------------


def test_rejects_prompt_plus_max_tokens_over_max_seq_len() -> None:
    sched = make_scheduler(max_seq_len=16)
    with pytest.raises(
        AdmissionError,
        match=r"^request 7: prompt_len \(10\) \+ max_tokens \(7\) = 17 exceeds max_seq_len "
        r"\(16\); shorten the prompt or lower max_tokens$",
    ):
        sched.add(make_seq(7, prompt_len=10, max_tokens=7))


def test_rejects_request_larger_than_the_whole_pool() -> None:
    sched = make_scheduler(num_blocks=3)
    with pytest.raises(
        AdmissionError,
        match=r"^request 1: prompt_len \(10\) \+ max_tokens \(3\) = 13 tokens need 4 blocks of "
        r"4 tokens, but the whole KV pool has 3; lower max_tokens or give the artifact more",
    ):
        sched.add(make_seq(1, prompt_len=10, max_tokens=3))


def test_accepts_request_that_exactly_fills_the_pool() -> None:
    sched = make_scheduler(num_blocks=3)
    sched.add(make_seq(1, prompt_len=10, max_tokens=2))
    assert Driver(sched).run()[1].finish_reason == "length"


def test_rejects_empty_prompt() -> None:
    sched = make_scheduler()
    with pytest.raises(AdmissionError, match=r"^request 2: the prompt is empty; send at least"):
        sched.add(make_seq(2, prompt_len=0))


def test_rejection_disturbs_nothing() -> None:
    sched = make_scheduler(max_seq_len=16)
    sched.add(make_seq(1))
    Driver(sched).step()
    before = (sched.num_running, sched.num_waiting, sched.block_manager.num_free_blocks)
    with pytest.raises(AdmissionError):
        sched.add(make_seq(2, prompt_len=20))
    assert (sched.num_running, sched.num_waiting, sched.block_manager.num_free_blocks) == before
    assert sched.get(2) is None
    sched.check_invariants()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_num_seqs": 0}, r"^Scheduler.max_num_seqs: must be an int >= 1, got 0$"),
        ({"max_seq_len": 1.5}, r"^Scheduler.max_seq_len: must be an int >= 1, got 1.5$"),
        (
            {"max_num_seqs": 8, "max_num_batched_tokens": 4},
            r"^Scheduler.max_num_batched_tokens \(4\) must be >= max_num_seqs \(8\)",
        ),
        (
            {"max_num_seqs": 4, "num_sliding_slots": 2},
            r"max_num_seqs \(4\) exceeds the pool's sliding-window slots \(2\); lower",
        ),
    ],
)
def test_bad_bounds_raise_config_error(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        make_scheduler(**kwargs)  # type: ignore[arg-type]


# -- batching ----------------------------------------------------------------------------


def test_prefill_samples_then_decode_feeds_the_last_sampled_token() -> None:
    sched = make_scheduler()
    sched.add(make_seq(0, prompt_len=4))
    driver = Driver(sched)
    (item,) = driver.step().seqs
    assert (item.start_pos, item.token_ids, item.block_table) == (0, (100, 101, 102, 103), (0,))
    assert item.needs_sample and item.num_generated == 0
    seq = sched.get(0)
    assert seq.num_computed_tokens == 4 and len(seq.output_token_ids) == 1
    (item,) = driver.step().seqs
    assert (item.start_pos, item.token_ids, item.num_generated) == (
        4,
        (seq.output_token_ids[0],),
        1,
    )
    assert item.block_table == (0, 1), "position 4 starts a second block"


def test_long_prompt_is_chunked_while_decodes_continue_every_step() -> None:
    sched = make_scheduler(max_num_seqs=2, max_num_batched_tokens=6)
    sched.add(make_seq(0, prompt_len=2, max_tokens=8))
    driver = Driver(sched)
    driver.step()
    sched.add(make_seq(1, prompt_len=17, max_tokens=2))
    steps = [driver.step() for _ in range(4)]
    assert [sizes(o) for o in steps] == [
        [(0, 1), (1, 5)],
        [(0, 1), (1, 5)],
        [(0, 1), (1, 5)],
        [(0, 1), (1, 2)],
    ]
    chunks = [o.seqs[1] for o in steps]
    assert [c.start_pos for c in chunks] == [0, 5, 10, 15]
    assert [c.needs_sample for c in chunks] == [False, False, False, True]
    assert all(o.seqs[0].needs_sample for o in steps), "the decode samples every step"
    assert sum((c.token_ids for c in chunks), ()) == sched.get(1).prompt_token_ids


def test_prefill_chunks_take_the_budget_decodes_leave() -> None:
    sched = make_scheduler(max_num_seqs=2, max_num_batched_tokens=4)
    sched.add(make_seq(0, prompt_len=12))
    sched.add(make_seq(1, prompt_len=1))
    driver = Driver(sched)
    assert sizes(driver.step()) == [(0, 4)]
    assert sizes(driver.step()) == [(0, 4)]
    assert sizes(driver.step()) == [(0, 4)], "seq 1 waits: the budget is spent"
    assert sizes(driver.step()) == [(0, 1), (1, 1)]


def test_batch_is_bounded_by_max_num_seqs() -> None:
    sched = make_scheduler(num_blocks=32, max_num_seqs=2, max_num_batched_tokens=32)
    for i in range(5):
        sched.add(make_seq(i, prompt_len=2, max_tokens=3))
    driver = Driver(sched)
    first = driver.step()
    assert [s.seq_id for s in first.seqs] == [0, 1]
    assert (sched.num_running, sched.num_waiting) == (2, 3)
    driver.run()
    assert max(len(o.seqs) for o in driver.outputs) == 2
    assert sorted(driver.finished) == [0, 1, 2, 3, 4]


def test_admission_is_fifo() -> None:
    sched = make_scheduler(num_blocks=32, max_num_seqs=1)
    for i in (3, 1, 2):
        sched.add(make_seq(i, prompt_len=2, max_tokens=1))
    driver = Driver(sched)
    assert [driver.step().seqs[0].seq_id for _ in range(3)] == [3, 1, 2]


def test_admission_chunk_is_limited_by_free_blocks() -> None:
    sched = make_scheduler(num_blocks=4, max_num_batched_tokens=32)
    sched.add(make_seq(0, prompt_len=9, max_tokens=4))
    sched.add(make_seq(1, prompt_len=8, max_tokens=4))
    out = Driver(sched).step()
    assert sizes(out) == [(0, 9), (1, 4)], "one free block left: seq 1 gets a 4-token chunk"
    assert not out.seqs[1].needs_sample


def test_sliding_slots_follow_running_sequences() -> None:
    sched = make_scheduler(num_blocks=16, max_num_seqs=2, num_sliding_slots=2)
    for i in range(3):
        sched.add(make_seq(i, prompt_len=2, max_tokens=2))
    driver = Driver(sched)
    out = driver.step()
    assert [s.sliding_slot for s in out.seqs] == [0, 1]
    driver.step()  # both finish (max_tokens=2), freeing their slots
    out = driver.step()
    assert [(s.seq_id, s.sliding_slot) for s in out.seqs] == [(2, 0)]
    driver.run()
    assert sched.block_manager.num_free_sliding_slots == 2


# -- preemption --------------------------------------------------------------------------


def test_youngest_preempts_itself_and_recomputes_prompt_plus_output() -> None:
    sched = make_scheduler(num_blocks=3, max_num_batched_tokens=16)
    sched.add(make_seq(0, prompt_len=4, max_tokens=6))
    sched.add(make_seq(1, prompt_len=4, max_tokens=6))
    driver = Driver(sched)
    driver.step()  # both prefilled: blocks 0 and 1; one free block
    driver.step()  # seq 0 takes it for position 4; seq 1, the youngest, yields its own
    victim = sched.get(1)
    assert victim.status is SequenceStatus.PREEMPTED
    assert driver.outputs[-1].preempted_seq_ids == (1,)
    assert sched.num_preemptions == 1
    generated = list(victim.output_token_ids)
    assert victim.num_computed_tokens == 0 and victim.block_table == ()
    finished = driver.run()
    chunks = [s for o in driver.outputs[2:] for s in o.seqs if s.seq_id == 1]
    chunks = chunks[: next(i for i, c in enumerate(chunks) if c.needs_sample) + 1]
    last_start = max(i for i, c in enumerate(chunks) if c.start_pos == 0)  # may be re-preempted
    recompute = chunks[last_start:]
    assert sum((c.token_ids for c in recompute), ()) == victim.prompt_token_ids + tuple(generated)
    assert all(c.num_generated == len(generated) == 1 for c in recompute)
    for seq in finished.values():
        assert seq.output_token_ids == reference_output(seq.prompt_token_ids, seq.params)


def test_preempted_sequence_goes_to_the_front_of_the_queue() -> None:
    sched = make_scheduler(num_blocks=3, max_num_batched_tokens=16)
    sched.add(make_seq(0, prompt_len=4, max_tokens=6))
    sched.add(make_seq(1, prompt_len=4, max_tokens=6))
    driver = Driver(sched)
    driver.step()
    sched.add(make_seq(2, prompt_len=1, max_tokens=1))
    out = driver.step()
    assert out.preempted_seq_ids == (1,)
    assert [s.seq_id for s in out.seqs] == [0], "no admission in a step that preempted"
    assert [s.seq_id for s in sched._waiting] == [1, 2]


def test_outputs_under_preemption_equal_an_unconstrained_run() -> None:
    def run(num_blocks: int) -> tuple[dict[int, list[int]], int]:
        sched = make_scheduler(num_blocks, max_num_seqs=4, max_num_batched_tokens=8)
        for i in range(6):
            sched.add(make_seq(i, prompt_len=3 + i, max_tokens=7))
        done = Driver(sched).run()
        return {i: s.output_token_ids for i, s in done.items()}, sched.num_preemptions

    tight, num_preempted = run(num_blocks=5)
    loose, none = run(num_blocks=64)
    assert num_preempted > 0 and none == 0
    assert tight == loose


def test_preempts_the_most_recently_admitted_first() -> None:
    sched = make_scheduler(num_blocks=3, max_num_batched_tokens=16)
    for i in range(3):
        sched.add(make_seq(i, prompt_len=4, max_tokens=4))
    driver = Driver(sched)
    driver.step()  # one block each, none free
    out = driver.step()  # seq 0 takes seq 2's block; seq 1, now youngest, yields its own
    assert out.preempted_seq_ids == (2, 1)
    assert sizes(out) == [(0, 1)]
    assert [s.seq_id for s in sched._waiting] == [1, 2], "admission order is kept"
    assert sched.num_preemptions == 2
    for seq in driver.run().values():
        assert seq.output_token_ids == reference_output(seq.prompt_token_ids, seq.params)


# -- stop rules --------------------------------------------------------------------------


def step_with(sched: Scheduler, token: int) -> list[Sequence]:
    out = sched.schedule()
    return sched.update(out, {s.seq_id: token for s in out.seqs if s.needs_sample})


def test_finishes_on_max_tokens_and_frees_blocks() -> None:
    sched = make_scheduler()
    sched.add(make_seq(0, max_tokens=2))
    assert not step_with(sched, 5)[0].is_finished
    (seq,) = step_with(sched, 6)
    assert seq.status is SequenceStatus.FINISHED_LENGTH and seq.finish_reason == "length"
    assert seq.output_token_ids == [5, 6]
    assert sched.block_manager.num_free_blocks == 8 and not sched.has_unfinished()


@pytest.mark.parametrize(
    ("eos", "params", "finished"),
    [
        ({9}, {}, True),
        ({9}, {"ignore_eos": True}, False),
        (set(), {"stop_token_ids": (9,)}, True),
        (set(), {"stop_token_ids": (9,), "ignore_eos": True}, True),
        (set(), {}, False),
    ],
)
def test_stop_token_rules(eos: set[int], params: dict[str, object], finished: bool) -> None:
    sched = make_scheduler()
    seq = Sequence(0, (1, 2), SamplingParams(max_tokens=5, **params), frozenset(eos))
    sched.add(seq)
    step_with(sched, 9)
    assert seq.is_finished is finished
    assert seq.output_token_ids == [9], "a stop token is kept in the output"
    if finished:
        assert seq.finish_reason == "stop"


def test_update_skips_a_sequence_aborted_during_the_step() -> None:
    sched = make_scheduler()
    sched.add(make_seq(0))
    out = sched.schedule()
    sched.abort(0)
    assert sched.update(out, {0: 5}) == []
    sched.check_invariants()


# -- abort -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("requests", "num_steps", "state", "num_computed"),
    [
        ([(0, 3, 4)], 0, SequenceStatus.WAITING, 0),
        ([(0, 18, 2)], 1, SequenceStatus.RUNNING, 16),  # budget 16: mid-prefill
        ([(0, 6, 4)], 1, SequenceStatus.RUNNING, 6),  # decoding
        ([(1, 12, 8), (0, 4, 4)], 2, SequenceStatus.PREEMPTED, 0),  # seq 0 yields to seq 1
    ],
    ids=["waiting", "partially-prefilled", "decoding", "preempted"],
)
def test_abort_in_each_state_frees_everything(
    requests: list[tuple[int, int, int]], num_steps: int, state: SequenceStatus, num_computed: int
) -> None:
    sched = make_scheduler(num_blocks=5, max_num_batched_tokens=16)
    driver = Driver(sched)
    for seq_id, prompt_len, max_tokens in requests:
        sched.add(make_seq(seq_id, prompt_len, max_tokens))
    for _ in range(num_steps):
        driver.step()
    assert (sched.get(0).status, sched.get(0).num_computed_tokens) == (state, num_computed)
    seq = sched.abort(0)
    assert seq is not None and seq.finish_reason == "abort" and seq.block_table == ()
    assert sched.get(0) is None
    sched.check_invariants()
    driver.run()
    assert sched.block_manager.num_free_blocks == 5 and not sched.has_unfinished()


def test_abort_unknown_or_finished_returns_none() -> None:
    sched = make_scheduler()
    sched.add(make_seq(0, max_tokens=1))
    Driver(sched).run()
    assert sched.abort(0) is None
    assert sched.abort(42) is None


# -- property ----------------------------------------------------------------------------

request = st.tuples(st.integers(0, 12), st.integers(1, 8))  # prompt_len, max_tokens
abort_event = st.tuples(st.integers(0, 30), st.integers(0, 7))  # step, request index


@settings(max_examples=120, deadline=None)
@given(
    requests=st.lists(request, min_size=1, max_size=8),
    num_blocks=st.integers(5, 12),
    max_num_seqs=st.integers(1, 4),
    extra_budget=st.integers(0, 12),
    sliding=st.booleans(),
    aborts=st.lists(abort_event, max_size=3),
)
def test_random_mixes_complete_and_free_everything(
    requests: list[tuple[int, int]],
    num_blocks: int,
    max_num_seqs: int,
    extra_budget: int,
    sliding: bool,
    aborts: list[tuple[int, int]],
) -> None:
    sched = make_scheduler(
        num_blocks,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_seqs + extra_budget,
        num_sliding_slots=max_num_seqs if sliding else 0,
    )
    seqs = [make_seq(i, p, m) for i, (p, m) in enumerate(requests)]
    accepted = []
    for seq in seqs:
        if seq.prompt_len > 0 and -(-seq.max_len // BLOCK_SIZE) <= num_blocks:
            sched.add(seq)
            accepted.append(seq)
        else:
            with pytest.raises(AdmissionError):
                sched.add(seq)
    driver = Driver(sched)
    aborted = set()
    for step in range(500):
        if not sched.has_unfinished():
            break
        for when, index in aborts:
            if when == step and sched.abort(index) is not None:
                aborted.add(index)
        driver.step()
    assert not sched.has_unfinished(), "every request completes"
    assert sched.block_manager.num_free_blocks == num_blocks
    for seq in accepted:
        assert seq.is_finished
        if seq.seq_id not in aborted:
            assert seq.output_token_ids == reference_output(seq.prompt_token_ids, seq.params)
