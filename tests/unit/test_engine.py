"""LLMEngine: stop rules (EOS, stop ids, stop strings), abort, ordering, streaming, stats."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
from engine_fakes import FakeRunner, hash_token, reference_output, scripted

from kvroom.engine.engine import LLMEngine, RequestOutput
from kvroom.engine.kv.block_manager import BlockManager
from kvroom.engine.kv.heap_guard import HeapGuard, Resident
from kvroom.engine.params.sampling import SamplingParams
from kvroom.engine.sched.scheduler import Scheduler
from kvroom.errors import AdmissionError

EOS = 0
VOCAB = {0: "<eos>", 1: "a", 2: "b", 3: "c", 4: "d", 5: "e", 6: "xcdy", 7: "\n"}


def detokenize(ids: list[int]) -> str:
    return "".join(VOCAB.get(i, f"<{i}>") for i in ids if i != EOS)


def make_engine(
    script: dict[tuple[int, ...], list[int]] | None = None,
    *,
    num_blocks: int = 16,
    max_num_seqs: int = 4,
    with_text: bool = True,
) -> tuple[LLMEngine, FakeRunner]:
    next_token: Callable[[Sequence[int]], int] = scripted(script) if script else hash_token
    runner = FakeRunner(num_blocks, 4, next_token=next_token)
    sched = Scheduler(
        BlockManager(num_blocks, 4),
        max_num_seqs=max_num_seqs,
        max_seq_len=64,
        max_num_batched_tokens=16,
    )
    engine = LLMEngine(
        sched, runner, eos_token_ids={EOS}, detokenize=detokenize if with_text else None
    )
    return engine, runner


def run_all(engine: LLMEngine, max_steps: int = 200) -> list[RequestOutput]:
    outputs: list[RequestOutput] = []
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return outputs
        outputs += engine.step()
        engine.scheduler.check_invariants()
    raise AssertionError("engine did not finish")


def final(outputs: list[RequestOutput], request_id: str) -> RequestOutput:
    (last,) = [o for o in outputs if o.request_id == request_id and o.finished]
    return last


def params(**kwargs: object) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 8} | kwargs)  # type: ignore[arg-type]


PROMPT = (9, 9)


# -- stop rules --------------------------------------------------------------------------


def test_eos_stops_and_is_kept_in_the_token_ids() -> None:
    engine, _ = make_engine({PROMPT: [1, 2, EOS, 3]})
    rid = engine.add_request(PROMPT, params())
    out = final(run_all(engine), rid)
    assert (out.output_token_ids, out.finish_reason, out.text) == ((1, 2, EOS), "stop", "ab")


def test_ignore_eos_runs_to_max_tokens() -> None:
    engine, _ = make_engine({PROMPT: [1, EOS, 2, EOS]})
    rid = engine.add_request(PROMPT, params(max_tokens=4, ignore_eos=True))
    out = final(run_all(engine), rid)
    assert (out.output_token_ids, out.finish_reason) == ((1, EOS, 2, EOS), "length")


def test_max_tokens_gives_length() -> None:
    engine, _ = make_engine({PROMPT: [1, 2, 3, 4]})
    rid = engine.add_request(PROMPT, params(max_tokens=3))
    out = final(run_all(engine), rid)
    assert (out.output_token_ids, out.finish_reason, out.text) == ((1, 2, 3), "length", "abc")


def test_stop_token_id_gives_stop() -> None:
    engine, _ = make_engine({PROMPT: [1, 5, 2]})
    rid = engine.add_request(PROMPT, params(stop_token_ids=(5,)))
    assert final(run_all(engine), rid).output_token_ids == (1, 5)


def test_stop_string_across_tokens_truncates_text_and_streams_monotonically() -> None:
    engine, runner = make_engine({PROMPT: [1, 2, 3, 4, 5]})
    rid = engine.add_request(PROMPT, params(stop=("cd",)))
    outputs = run_all(engine)
    texts = [o.text for o in outputs]
    assert texts == ["a", "ab", "ab", "ab"], "'c' is held back until it cannot start 'cd'"
    last = final(outputs, rid)
    assert (last.output_token_ids, last.finish_reason) == ((1, 2, 3, 4), "stop")
    assert runner.released == [0]
    assert engine.scheduler.block_manager.num_free_blocks == 16


def test_held_back_text_is_released_when_no_stop_follows() -> None:
    engine, _ = make_engine({PROMPT: [1, 3, 5]})
    rid = engine.add_request(PROMPT, params(max_tokens=3, stop=("cd",)))
    outputs = run_all(engine)
    assert [o.text for o in outputs] == ["a", "a", "ace"]
    assert final(outputs, rid).finish_reason == "length"


def test_stop_string_inside_one_token() -> None:
    engine, _ = make_engine({PROMPT: [1, 6, 2]})
    rid = engine.add_request(PROMPT, params(stop=("cd",)))
    out = final(run_all(engine), rid)
    assert (out.text, out.output_token_ids, out.finish_reason) == ("ax", (1, 6), "stop")


def test_stop_string_in_the_last_allowed_token_reports_stop() -> None:
    engine, _ = make_engine({PROMPT: [1, 7]})
    rid = engine.add_request(PROMPT, params(max_tokens=2, stop=("\n",)))
    out = final(run_all(engine), rid)
    assert (out.text, out.finish_reason) == ("a", "stop")


def test_earliest_of_several_stop_strings_wins() -> None:
    engine, _ = make_engine({PROMPT: [1, 6, 2]})
    rid = engine.add_request(PROMPT, params(stop=("dy", "xc")))
    assert final(run_all(engine), rid).text == "a", "'xc' starts before 'dy' in 'axcdy'"


def test_stop_strings_need_a_detokenizer() -> None:
    engine, _ = make_engine(with_text=False)
    with pytest.raises(
        AdmissionError, match=r"^request '0': stop strings \('x',\) need a detokenizer; pass"
    ):
        engine.add_request(PROMPT, params(stop=("x",)))
    assert not engine.has_unfinished()


def test_without_detokenizer_text_is_none() -> None:
    engine, _ = make_engine({PROMPT: [1, 2]}, with_text=False)
    engine.add_request(PROMPT, params(max_tokens=2))
    assert all(o.text is None for o in run_all(engine))


# -- requests ----------------------------------------------------------------------------


def test_duplicate_live_request_id_is_rejected() -> None:
    engine, _ = make_engine()
    engine.add_request(PROMPT, params(), request_id="r")
    with pytest.raises(AdmissionError, match=r"^request 'r': this id is already in flight$"):
        engine.add_request(PROMPT, params(), request_id="r")
    run_all(engine)
    assert engine.add_request(PROMPT, params(), request_id="r") == "r", "reusable once done"


def test_scheduler_rejection_leaves_no_trace() -> None:
    engine, runner = make_engine()
    with pytest.raises(AdmissionError, match="exceeds max_seq_len"):
        engine.add_request(range(60), params(max_tokens=8))
    assert not engine.has_unfinished() and engine.stats.num_waiting == 0


def test_abort_waiting_and_running_requests() -> None:
    engine, runner = make_engine(max_num_seqs=1)
    running = engine.add_request(PROMPT, params(max_tokens=8))
    waiting = engine.add_request((5, 5), params(max_tokens=8))
    first = engine.step()
    assert [o.request_id for o in first] == [running]
    assert engine.abort(running) and engine.abort(waiting)
    assert not engine.abort(running), "a second abort is a no-op"
    assert not engine.abort("nope")
    outs = engine.step()
    assert [(o.request_id, o.finished, o.finish_reason, o.new_token_ids) for o in outs] == [
        (running, True, "abort", ()),
        (waiting, True, "abort", ()),
    ]
    assert outs[0].output_token_ids == first[0].output_token_ids
    assert not engine.has_unfinished()
    assert sorted(runner.released) == [0, 1]
    assert engine.stats.num_free_blocks == 16


def test_requests_are_served_in_arrival_order() -> None:
    engine, _ = make_engine(max_num_seqs=1)
    ids = [engine.add_request((i, i), params(max_tokens=2)) for i in (3, 1, 2)]
    done = [o.request_id for o in run_all(engine) if o.finished]
    assert done == ids


def test_streamed_tokens_add_up_and_match_the_reference_under_preemption() -> None:
    engine, runner = make_engine(num_blocks=6)
    prompts = {engine.add_request(range(i, i + 3 + i), params(max_tokens=9)): i for i in range(4)}
    outputs = run_all(engine)
    assert engine.stats.num_preemptions > 0, "the pool is small enough to force preemption"
    for rid, i in prompts.items():
        mine = [o for o in outputs if o.request_id == rid]
        assert sum((o.new_token_ids for o in mine), ()) == mine[-1].output_token_ids
        expected = reference_output(range(i, i + 3 + i), params(max_tokens=9), frozenset({EOS}))
        assert list(mine[-1].output_token_ids) == expected
        assert [o.finished for o in mine] == [False] * (len(mine) - 1) + [True]
    assert sorted(runner.released) == [0, 1, 2, 3]


def test_stats_count_blocks_queues_and_tokens() -> None:
    engine, _ = make_engine({(1, 2, 3): [1, 2, 3], (4, 5): [4, 5, 6]}, max_num_seqs=1)
    engine.add_request((1, 2, 3), params(max_tokens=3))
    engine.add_request((4, 5), params(max_tokens=3))
    engine.step()
    stats = engine.stats
    assert (stats.num_running, stats.num_waiting) == (1, 1)
    assert (stats.num_total_blocks, stats.num_used_blocks, stats.num_free_blocks) == (16, 1, 15)
    assert (stats.num_prompt_tokens_total, stats.num_generation_tokens_total) == (3, 1)
    run_all(engine)
    stats = engine.stats
    assert (stats.num_prompt_tokens_total, stats.num_generation_tokens_total) == (5, 6)
    assert (stats.num_running, stats.num_waiting, stats.num_free_blocks) == (0, 0, 16)


def test_step_with_nothing_to_do_does_not_call_the_runner() -> None:
    engine, runner = make_engine()
    assert engine.step() == []
    assert runner.steps == []


def test_the_heap_guard_reads_around_every_step_that_computed() -> None:
    engine, _ = make_engine()
    reads: list[int] = []

    def read() -> Resident:
        reads.append(1)
        return Resident(0, 0)

    engine.heap_guard = HeapGuard(lambda serving: 1 << 40, read=read)
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True))
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    engine.step()  # nothing scheduled: no read
    assert len(reads) == 2 * steps  # before and after each step
