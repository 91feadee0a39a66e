"""Torch-free stand-ins for the model runner, shared by the scheduler and engine tests.

``FakeRunner`` behaves like a paged model: it writes each scheduled token into a fake KV pool
through the block table, reads the whole history back through the table, and samples a token
that is a pure function of that history. Outputs therefore do not depend on scheduling, so a run
under preemption must equal an unconstrained one, and a block handed to two live sequences
corrupts a history and shows up as an assertion here or as a wrong token.
"""

from __future__ import annotations

import collections.abc as abc
import zlib
from collections.abc import Callable

from kvroom.engine.kv.block_manager import BlockManager
from kvroom.engine.params.sampling import SamplingParams
from kvroom.engine.sched.output import SchedulerOutput
from kvroom.engine.sched.scheduler import Scheduler
from kvroom.engine.sched.sequence import Sequence

VOCAB_SIZE = 50
BLOCK_SIZE = 4


def make_scheduler(
    num_blocks: int = 8,
    *,
    max_num_seqs: int = 4,
    max_seq_len: int = 64,
    max_num_batched_tokens: int = 16,
    num_sliding_slots: int = 0,
    enable_prefix_caching: bool | None = None,
) -> Scheduler:
    if enable_prefix_caching is None:  # on where the pool can share, as in the engine
        enable_prefix_caching = num_sliding_slots == 0
    bm = BlockManager(
        num_blocks, BLOCK_SIZE, num_sliding_slots, enable_prefix_caching=enable_prefix_caching
    )
    return Scheduler(
        bm,
        max_num_seqs=max_num_seqs,
        max_seq_len=max_seq_len,
        max_num_batched_tokens=max_num_batched_tokens,
    )


def make_seq(seq_id: int, prompt_len: int = 3, max_tokens: int = 4, **params: object) -> Sequence:
    prompt = tuple(100 + 10 * seq_id + i for i in range(prompt_len))
    return Sequence(seq_id, prompt, SamplingParams(max_tokens=max_tokens, **params))


def sizes(out: SchedulerOutput) -> list[tuple[int, int]]:
    return [(s.seq_id, len(s.token_ids)) for s in out.seqs]


def hash_token(history: abc.Sequence[int]) -> int:
    """A deterministic "model": next token from the whole history, in [1, VOCAB_SIZE)."""
    return 1 + zlib.crc32(",".join(map(str, history)).encode()) % (VOCAB_SIZE - 1)


def reference_output(
    prompt: abc.Sequence[int],
    params: SamplingParams,
    eos: frozenset[int] = frozenset(),
    next_token: Callable[[abc.Sequence[int]], int] = hash_token,
) -> list[int]:
    """What an unconstrained engine generates for ``prompt``: the oracle for every test."""
    stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos))
    out: list[int] = []
    while len(out) < params.max_tokens:
        out.append(next_token(list(prompt) + out))
        if out[-1] in stops:
            break
    return out


def scripted(outputs: dict[tuple[int, ...], list[int]]) -> Callable[[abc.Sequence[int]], int]:
    """A "model" that answers each known prompt with a fixed continuation."""

    def next_token(history: abc.Sequence[int]) -> int:
        for prompt, script in outputs.items():
            n = len(prompt)
            if tuple(history[:n]) == prompt and list(history[n:]) == script[: len(history) - n]:
                return script[len(history) - n]
        raise AssertionError(f"no script for history {list(history)}")

    return next_token


class FakeRunner:
    """A paged fake model that checks the scheduler's contract on every step."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        num_sliding_slots: int = 0,
        next_token: Callable[[abc.Sequence[int]], int] = hash_token,
    ) -> None:
        self.block_size = block_size
        self.num_sliding_slots = num_sliding_slots
        self.next_token = next_token
        self.pool: list[list[int | None]] = [[None] * block_size for _ in range(num_blocks)]
        self.written: dict[int, list[int]] = {}  # seq_id -> tokens whose "KV" it wrote
        self.steps: list[SchedulerOutput] = []
        self.released: list[int] = []
        self.max_num_blocks = 4 * num_blocks
        self.num_moved = 0
        self.num_copied = 0
        """Copy-on-write block copies run."""
        self.num_computed = 0
        """Tokens computed (prompt chunks and decodes)."""

    # -- the ``ResizablePool`` side: the fake pool resizes like ``KVCachePool`` ------------

    def resize(self, num_blocks: int) -> None:
        assert 0 < num_blocks <= self.max_num_blocks, f"resize({num_blocks})"
        kept = self.pool[:num_blocks]
        self.pool = kept + [[None] * self.block_size for _ in range(num_blocks - len(kept))]

    def copy_blocks(self, moves: abc.Sequence[tuple[int, int]]) -> None:
        """Every src is read before any dst is written, as ``KVCachePool.copy_blocks``."""
        read = [list(self.pool[src]) for src, _ in moves]
        for (_, dst), contents in zip(moves, read, strict=True):
            self.pool[dst] = contents
        self.num_moved += len(moves)

    def contents(self, table: abc.Sequence[int], num_tokens: int) -> list[int | None]:
        """What the fake pool holds for the first ``num_tokens`` positions of ``table``."""
        return [self._read(tuple(table), p) for p in range(num_tokens)]

    def execute(self, output: SchedulerOutput) -> dict[int, int]:
        assert not output.is_empty, "the engine must not execute an empty step"
        self.steps.append(output)
        for seq_id in output.preempted_seq_ids:
            self.written.pop(seq_id, None)
        self._check_step(output)
        self.copy_blocks(output.block_copies)
        self.num_copied += len(output.block_copies)
        self.num_computed += output.num_tokens
        sampled: dict[int, int] = {}
        for item in output.seqs:
            if item.start_pos == 0:  # a new or recomputed sequence starts from scratch
                self.written[item.seq_id] = []
            elif len(self.written.get(item.seq_id, ())) != item.start_pos:
                # new or recomputed after a preemption, with a shared prefix: its K/V is
                # checked by the outputs (and by ``Driver``) against the sequence's tokens
                prefix = self.contents(item.block_table, item.start_pos)
                assert None not in prefix, f"seq {item.seq_id}: shared K/V never written"
                self.written[item.seq_id] = prefix  # type: ignore[assignment]
            history = self.written[item.seq_id]
            assert item.start_pos == len(history), f"seq {item.seq_id}: KV gap or rewind"
            for i, token in enumerate(item.token_ids):
                self._write(item.block_table, item.start_pos + i, token)
            history.extend(item.token_ids)
        for item in output.seqs:  # read back only after every write of the step
            end = item.start_pos + len(item.token_ids)
            read = [self._read(item.block_table, p) for p in range(end)]
            assert read == self.written[item.seq_id], f"seq {item.seq_id}: KV corrupted"
            if item.needs_sample:
                sampled[item.seq_id] = self.next_token(read)
        return sampled

    def release(self, seq_id: int) -> None:
        self.released.append(seq_id)
        self.written.pop(seq_id, None)

    def _check_step(self, output: SchedulerOutput) -> None:
        ids = [s.seq_id for s in output.seqs]
        assert len(set(ids)) == len(ids), f"a seq is scheduled twice: {ids}"
        assert not set(ids) & set(output.preempted_seq_ids), "a preempted seq is scheduled"
        for s in output.seqs:  # a block written this step is read by no other scheduled seq
            end = s.start_pos + len(s.token_ids)
            written = {s.block_table[p // self.block_size] for p in range(s.start_pos, end)}
            others = {b for o in output.seqs if o is not s for b in o.block_table}
            assert not written & others, f"seq {s.seq_id} writes shared blocks {written & others}"
        slots = [s.sliding_slot for s in output.seqs]
        if self.num_sliding_slots:
            assert all(s is not None and 0 <= s < self.num_sliding_slots for s in slots)
            assert len(set(slots)) == len(slots), f"two seqs share a sliding slot: {slots}"
        else:
            assert all(s is None for s in slots), "sliding slot without sliding layers"
        for s in output.seqs:
            end = s.start_pos + len(s.token_ids)
            assert s.token_ids, f"seq {s.seq_id}: empty chunk"
            assert len(s.block_table) * self.block_size >= end, f"seq {s.seq_id}: short table"

    def _write(self, table: tuple[int, ...], pos: int, token: int) -> None:
        self.pool[table[pos // self.block_size]][pos % self.block_size] = token

    def _read(self, table: tuple[int, ...], pos: int) -> int | None:
        return self.pool[table[pos // self.block_size]][pos % self.block_size]


class Driver:
    """Runs a scheduler against a FakeRunner, checking invariants after every step."""

    def __init__(self, sched: Scheduler) -> None:
        bm = sched.block_manager
        self.sched = sched
        self.runner = FakeRunner(
            bm.num_total_blocks, bm.block_size, num_sliding_slots=bm.num_sliding_slots
        )
        self.outputs: list[SchedulerOutput] = []
        self.finished: dict[int, Sequence] = {}

    def step(self) -> SchedulerOutput:
        out = self.sched.schedule()
        assert out.num_tokens <= self.sched.max_num_batched_tokens
        assert len(out.seqs) <= self.sched.max_num_seqs
        is_decode = [0 < s.start_pos == self.sched.get(s.seq_id).num_tokens - 1 for s in out.seqs]
        assert is_decode == sorted(is_decode, reverse=True), "decodes must come first"
        sampled = {} if out.is_empty else self.runner.execute(out)
        for s in out.seqs:  # shared or not, the K/V a step reads is the sequence's own tokens
            tokens = self.sched.get(s.seq_id).all_token_ids[: s.start_pos + len(s.token_ids)]
            assert self.runner.contents(s.block_table, len(tokens)) == list(tokens), s.seq_id
        for seq in self.sched.update(out, sampled):
            if seq.is_finished:
                self.finished[seq.seq_id] = seq
        self.sched.check_invariants()
        self.outputs.append(out)
        return out

    def run(self, max_steps: int = 500) -> dict[int, Sequence]:
        for _ in range(max_steps):
            if not self.sched.has_unfinished():
                return self.finished
            self.step()
        raise AssertionError(f"not done after {max_steps} steps")
