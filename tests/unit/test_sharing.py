"""Shared prefixes through the scheduler (and the engine) over the paged fake runner.

The fake runner samples from the history it reads back through the block table, so a wrong
shared block changes a token and fails the comparison with ``reference_output``; the
``Driver`` also checks every step's K/V against the sequence's own tokens.
"""

from __future__ import annotations

from engine_fakes import Driver, FakeRunner, make_scheduler, reference_output
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvroom.engine.engine import LLMEngine, RequestOutput
from kvroom.engine.params.sampling import SamplingParams
from kvroom.engine.sched.sequence import Sequence

SYSTEM = tuple(range(1, 10))  # 9 tokens: two full blocks of 4 and one more
PARAMS = SamplingParams(max_tokens=5, ignore_eos=True)


def seq(seq_id: int, prompt: tuple[int, ...], params: SamplingParams = PARAMS) -> Sequence:
    return Sequence(seq_id, prompt, params)


def run(driver: Driver, seqs: list[Sequence]) -> dict[int, Sequence]:
    for s in seqs:
        driver.sched.add(s)
    return driver.run()


def check_outputs(done: dict[int, Sequence]) -> None:
    for s in done.values():
        assert s.output_token_ids == reference_output(s.prompt_token_ids, s.params), s.seq_id


def test_the_n_choices_of_a_prompt_prefill_it_once() -> None:
    driver = Driver(make_scheduler(num_blocks=16, max_num_seqs=4, max_num_batched_tokens=32))
    prompt = SYSTEM + (20,)  # 10 tokens: the last block is partial, so it is copied on write
    done = run(driver, [seq(i, prompt) for i in range(4)])
    check_outputs(done)
    first, second = driver.outputs[:2]
    assert [(s.seq_id, s.start_pos, len(s.token_ids)) for s in first.seqs] == [(0, 0, 10)]
    assert [(s.start_pos, len(s.token_ids)) for s in second.seqs[1:]] == [(9, 1)] * 3
    assert driver.runner.num_computed == 10 + 3 + 4 * 4  # one prefill, 3 last tokens, decodes
    assert driver.sched.num_forked_tokens == 3 * 9
    assert driver.runner.num_copied == 3, "each writer of the shared partial block but one"


def test_a_second_request_with_the_same_system_prompt_hits_the_cache() -> None:
    driver = Driver(make_scheduler(num_blocks=16))
    run(driver, [seq(0, SYSTEM + (20, 21))])
    done = run(driver, [seq(1, SYSTEM + (30,))])
    check_outputs(done)
    first_chunk = driver.outputs[-5].seqs[0]
    assert (first_chunk.seq_id, first_chunk.start_pos) == (1, 8)
    cache = driver.sched.block_manager.cache
    assert cache is not None
    assert (cache.num_query_tokens, cache.num_hit_tokens) == (11 + 10, 8)


def test_prompt_logprobs_and_penalties_compute_the_whole_prompt() -> None:
    driver = Driver(make_scheduler(num_blocks=16))
    run(driver, [seq(0, SYSTEM)])
    asks = [
        SamplingParams(max_tokens=2, prompt_logprobs=0),
        SamplingParams(max_tokens=2, repetition_penalty=1.2),
        SamplingParams(max_tokens=2, presence_penalty=0.5),
    ]
    for i, params in enumerate(asks, start=1):
        run(driver, [seq(i, SYSTEM, params)])
        chunks = [s for out in driver.outputs for s in out.seqs if s.seq_id == i]
        assert chunks[0].start_pos == 0 and len(chunks[0].token_ids) == len(SYSTEM)


def test_prefix_caching_off_computes_everything() -> None:
    driver = Driver(make_scheduler(num_blocks=16, enable_prefix_caching=False))
    run(driver, [seq(0, SYSTEM)])
    run(driver, [seq(1, SYSTEM + (5,))])
    assert driver.runner.num_computed == (9 + 4) + (10 + 4)
    assert driver.sched.block_manager.cache is None


def test_a_twin_waits_for_a_prefill_split_into_chunks() -> None:
    driver = Driver(make_scheduler(num_blocks=16, max_num_batched_tokens=6))
    done = run(driver, [seq(0, SYSTEM + (7,)), seq(1, SYSTEM + (7,)), seq(2, (40, 41))])
    check_outputs(done)
    assert [s.seq_id for s in driver.outputs[0].seqs] == [0], "the twin and seq 2 wait"
    assert driver.sched.num_forked_tokens == 9


SHARED_PROMPTS = st.lists(
    st.tuples(st.sampled_from([(), SYSTEM[:4], SYSTEM]), st.lists(st.integers(1, 3), max_size=6)),
    min_size=1,
    max_size=8,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    prompts=SHARED_PROMPTS,
    num_choices=st.lists(st.integers(1, 3), min_size=8, max_size=8),
    max_tokens=st.lists(st.integers(1, 9), min_size=8, max_size=8),
    arrivals=st.lists(st.integers(0, 6), min_size=8, max_size=8),
    resizes=st.lists(st.tuples(st.integers(0, 12), st.integers(8, 40)), max_size=4),
)
def test_random_shared_prefixes_preemption_and_resizes_never_change_a_token(
    prompts: list[tuple[tuple[int, ...], list[int]]],
    num_choices: list[int],
    max_tokens: list[int],
    arrivals: list[int],
    resizes: list[tuple[int, int]],
) -> None:
    sched = make_scheduler(num_blocks=10, max_num_seqs=5, max_seq_len=32)
    runner = FakeRunner(10, 4)
    runner.max_num_blocks = 64
    engine = LLMEngine(sched, runner, eos_token_ids=set(), detokenize=None, pool=runner)
    wanted: dict[str, tuple[tuple[int, ...], SamplingParams]] = {}
    outs: list[RequestOutput] = []
    at = dict(resizes)
    for step in range(400):
        for i, (prefix, tail) in enumerate(prompts):
            if arrivals[i] == step:
                prompt = prefix + tuple(tail) or (1,)
                params = SamplingParams(max_tokens=max_tokens[i], ignore_eos=True)
                for _ in range(num_choices[i]):
                    wanted[engine.add_request(prompt, params)] = (prompt, params)
        if step in at:
            engine.resize_kv_cache(at[step])
            sched.check_invariants()
        outs += engine.step()
        sched.check_invariants()
        if step > max(arrivals) and not engine.has_unfinished():
            break
    assert not engine.has_unfinished(), "no progress"
    for rid, (prompt, params) in wanted.items():
        (last,) = [o for o in outs if o.request_id == rid and o.finished]
        assert list(last.output_token_ids) == reference_output(prompt, params), rid
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_total_blocks
