"""Continuous batching at token granularity (torch-free).

There is no prefill or decode phase: every admitted sequence has ``num_computed_tokens`` that
catch up with ``num_tokens``, by a chunk per step. One ``schedule()`` call is two small passes
over one shared token budget (``max_num_batched_tokens``)::

    1. running   admission order: decodes (the last sampled token)        1 token each
                 then the one seq still mid-prefill, if any               min(left, budget, room)
    2. admit     waiting seqs, FIFO, while seats, budget and blocks last   first chunk

An admitted sequence first takes the K/V it can share (``sharing.claim_prefix``: a running
twin's blocks, or the prefix cache), and its first chunk starts after them; the step's
copy-on-write block copies travel in the ``SchedulerOutput``.

Decodes go first so that a long prompt, split into chunks, never stalls the running requests.
Walking the running list in admission order already puts them first, because of an invariant
(checked by ``check_invariants``): *only the most recently admitted running sequence can be
mid-prefill*. A chunk stops short of the prompt's end only when the budget or the free blocks
ran out, and then nothing after it is admitted in that step.
A running sequence that needs a block when none is free takes one from the most recently
admitted running sequence (preemption): that one loses all its KV, goes back to the *front* of
the waiting queue, and is later re-prefilled from ``prompt + output`` tokens. No admission
happens in a step that preempted, so a freed block is not handed straight back and forth.

``resize`` (between steps) changes the pool size: a grow frees new blocks at once; a shrink
first preempts the most recently admitted sequences only while the used blocks exceed the new
size, then moves the KV of used blocks above it into free ones (``BlockManager.shrink``).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kvroom.engine.kv.block_manager import BlockManager
from kvroom.engine.kv.migration import PoolResize
from kvroom.engine.sched.output import ScheduledSeq, SchedulerOutput
from kvroom.engine.sched.sequence import Sequence, SequenceStatus
from kvroom.engine.sched.sharing import Claim, claim_prefix, kv_is_token_function
from kvroom.errors import AdmissionError, ConfigError


@dataclass
class _Step:
    """What the ``schedule()`` call in progress has decided so far."""

    budget: int
    """Tokens still allowed this step."""
    scheduled: dict[int, ScheduledSeq] = field(default_factory=dict)
    """Insertion order is the output order: decodes, then the prefill chunks."""
    preempted: list[int] = field(default_factory=list)

    def add(self, item: ScheduledSeq) -> None:
        self.scheduled[item.seq_id] = item
        self.budget -= len(item.token_ids)

    def output(self, copies: tuple[tuple[int, int], ...]) -> SchedulerOutput:
        return SchedulerOutput(tuple(self.scheduled.values()), tuple(self.preempted), copies)


class Scheduler:
    """Decides, each step, which tokens of which sequences the runner computes."""

    def __init__(
        self,
        block_manager: BlockManager,
        *,
        max_num_seqs: int,
        max_seq_len: int,
        max_num_batched_tokens: int,
    ) -> None:
        """
        Args:
            block_manager: the pool this scheduler allocates from (exposed as an attribute).
            max_num_seqs: most sequences admitted (RUNNING) at once.
            max_seq_len: longest prompt + generated length a request may ask for.
            max_num_batched_tokens: token budget of one step, decodes and chunks together.

        Raises:
            ConfigError: a bound is not positive; the budget cannot hold one decode per seat;
                or a hybrid pool has fewer sliding slots than seats.
        """
        _check_bounds(block_manager, max_num_seqs, max_seq_len, max_num_batched_tokens)
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_seq_len = max_seq_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.num_preemptions = 0
        """Preemptions since construction (a counter for metrics)."""
        self.num_forked_tokens = 0
        """Prompt tokens not computed because a running twin's blocks were forked."""
        self._waiting: deque[Sequence] = deque()
        self._running: list[Sequence] = []  # admission order: the last one is preempted first
        self._seqs: dict[int, Sequence] = {}

    # -- queries -------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def has_unfinished(self) -> bool:
        return bool(self._seqs)

    def get(self, seq_id: int) -> Sequence | None:
        """The live sequence with this id, or None once it has finished (or never existed)."""
        return self._seqs.get(seq_id)

    # -- requests in and out -------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence (FIFO), or reject one that could never be served.

        Raises:
            AdmissionError: empty prompt, ``prompt + max_tokens > max_seq_len``, or more
                blocks than the whole pool; nothing in the scheduler changes.
        """
        assert seq.status is SequenceStatus.WAITING, f"seq {seq.seq_id} is {seq.status}"
        assert seq.seq_id not in self._seqs, f"seq id {seq.seq_id} is already live"
        self._check_admissible(seq)
        self._waiting.append(seq)
        self._seqs[seq.seq_id] = seq

    def abort(self, seq_id: int) -> Sequence | None:
        """Cancel a sequence in any live state and free everything it holds.

        Returns:
            The aborted sequence, or None when it is unknown or already finished.
        """
        if seq_id not in self._seqs:
            return None
        return self.finish(seq_id, SequenceStatus.FINISHED_ABORTED)

    def finish(self, seq_id: int, status: SequenceStatus) -> Sequence:
        """End a live sequence now (abort, or a stop string the engine found).

        ``seq_id`` must be live (see ``get``); ``status`` must be a finished one.
        """
        seq = self._seqs.pop(seq_id)
        if seq.status is SequenceStatus.RUNNING:
            self._running.remove(seq)
            self.block_manager.free(seq_id)
        else:
            self._waiting.remove(seq)
        seq.finish(status)
        return seq

    # -- one step ------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Pick this step's tokens: running seqs oldest first, then admissions.

        Returns:
            The step's work (possibly empty); pass it to the runner, then to ``update``.
        """
        step = _Step(budget=self.max_num_batched_tokens)
        for seq in list(self._running):  # a copy: preemption removes from the tail
            if seq.status is SequenceStatus.RUNNING and step.budget > 0:
                self._schedule_running(seq, step)
        if not step.preempted:
            self._admit_waiting(step)
        return step.output(self.block_manager.pop_copies())

    def update(self, output: SchedulerOutput, sampled: dict[int, int]) -> list[Sequence]:
        """Record what the runner computed and sampled for ``output``.

        Args:
            output: the ``SchedulerOutput`` this step's ``schedule()`` returned.
            sampled: seq_id -> next token, for every scheduled seq with ``needs_sample``.

        Returns:
            The sequences that got a new token this step, in output order; finished ones
            (max_tokens, EOS, a stop token id) have already released their blocks.
        """
        updated: list[Sequence] = []
        for item in output.seqs:
            seq = self._seqs.get(item.seq_id)
            if seq is None:  # aborted while the runner was busy: nothing left to record
                continue
            assert seq.num_computed_tokens == item.start_pos, f"seq {seq.seq_id} moved"
            seq.num_computed_tokens += len(item.token_ids)
            self._cache_blocks(seq, item.start_pos)
            if item.needs_sample:
                assert item.seq_id in sampled, f"runner returned no token for seq {seq.seq_id}"
                seq.output_token_ids.append(sampled[item.seq_id])
                status = seq.stop_status()
                if status is not None:
                    self.finish(seq.seq_id, status)
                updated.append(seq)
        return updated

    def resize(self, num_blocks: int) -> PoolResize:
        """Make the block manager hold ``num_blocks`` blocks; call between steps only.

        Returns:
            The moves to copy (a shrink) and the sequences preempted to make room.

        Raises:
            ConfigError: fewer blocks than one ``max_seq_len`` sequence needs (an admitted
                request could then never finish).
        """
        bm = self.block_manager
        needed = bm.blocks_for(self.max_seq_len)
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < needed:
            raise ConfigError(
                f"kvcache_num_blocks: must be an int >= {needed} (one max_seq_len="
                f"{self.max_seq_len} sequence), got {num_blocks!r}"
            )
        old = bm.num_total_blocks
        if num_blocks >= old:
            bm.grow(num_blocks)
            return PoolResize(old, num_blocks)
        preempted: list[int] = []
        while bm.num_used_blocks > num_blocks:
            victim = self._running[-1]
            self._requeue(victim)
            preempted.append(victim.seq_id)
        migration = bm.shrink(num_blocks)
        for seq in self._running:
            seq.block_table = bm.block_table(seq.seq_id)
        return PoolResize(old, num_blocks, migration.moves, tuple(preempted))

    # -- policy pieces -------------------------------------------------------------------

    def _check_admissible(self, seq: Sequence) -> None:
        """Reject, with the numbers, what no amount of waiting could ever serve."""
        name = f"request {seq.seq_id}"
        if seq.prompt_len == 0:
            raise AdmissionError(f"{name}: the prompt is empty; send at least one token")
        total = seq.max_len
        where = f"prompt_len ({seq.prompt_len}) + max_tokens ({seq.params.max_tokens}) = {total}"
        if total > self.max_seq_len:
            raise AdmissionError(
                f"{name}: {where} exceeds max_seq_len ({self.max_seq_len}); "
                "shorten the prompt or lower max_tokens"
            )
        bm = self.block_manager
        if bm.blocks_for(total) > bm.num_total_blocks:
            raise AdmissionError(
                f"{name}: {where} tokens need {bm.blocks_for(total)} blocks of "
                f"{bm.block_size} tokens, but the whole KV pool has {bm.num_total_blocks}; "
                "lower max_tokens or give the artifact more KV blocks"
            )

    def _schedule_running(self, seq: Sequence, step: _Step) -> None:
        """Give a running seq its next chunk, preempting younger seqs if the pool is dry."""
        wanted = min(seq.num_uncomputed_tokens, step.budget)
        while True:
            room = self.block_manager.capacity(seq.seq_id, seq.num_computed_tokens)
            room -= seq.num_computed_tokens
            if room > 0:
                step.add(self._chunk(seq, min(wanted, room)))
                return
            victim = self._running[-1]
            self._preempt(victim, step)
            if victim is seq:
                return

    def _admit_waiting(self, step: _Step) -> None:
        """Admit waiting seqs FIFO with a first chunk that fits the budget and free blocks.

        A seq first takes the K/V it can share (``sharing.claim_prefix``); its chunk starts
        after it. A chunk cut short (budget or blocks) ends admission for this step.
        """
        while self._waiting and len(self._running) < self.max_num_seqs and step.budget > 0:
            seq = self._waiting[0]
            claim = claim_prefix(self.block_manager, seq, self._running)
            if claim is None:  # a twin is prefilling the same prompt: fork it next step
                return
            seq.num_computed_tokens = claim.num_tokens
            room = self.block_manager.capacity(seq.seq_id, claim.num_tokens) - claim.num_tokens
            num_tokens = min(seq.num_uncomputed_tokens, step.budget, room)
            if num_tokens <= 0:
                self._unclaim(seq)
                return
            self._count_claim(seq, claim)
            seq.admit()
            self._waiting.popleft()
            self._running.append(seq)
            step.add(self._chunk(seq, num_tokens))
            if seq.num_uncomputed_tokens > num_tokens:
                return

    def _unclaim(self, seq: Sequence) -> None:
        """Give back what ``claim_prefix`` lent a seq that cannot be admitted after all."""
        if seq.seq_id in self.block_manager.table_owners:
            self.block_manager.free(seq.seq_id)
        seq.num_computed_tokens = 0

    def _count_claim(self, seq: Sequence, claim: Claim) -> None:
        cache = self.block_manager.cache
        if claim.forked:
            self.num_forked_tokens += claim.num_tokens
        elif cache is not None and kv_is_token_function(seq):
            cache.record_query(seq.num_tokens, claim.num_tokens)

    def _cache_blocks(self, seq: Sequence, start: int) -> None:
        """Register the full blocks a step completed (not for K/V that depends on images)."""
        bs = self.block_manager.block_size
        if seq.num_computed_tokens // bs > start // bs and kv_is_token_function(seq):
            self.block_manager.cache_blocks(seq.seq_id, seq.all_token_ids, seq.num_computed_tokens)

    def _chunk(self, seq: Sequence, num_tokens: int) -> ScheduledSeq:
        """Allocate blocks for ``num_tokens`` more tokens of ``seq`` and describe the chunk."""
        start = seq.num_computed_tokens
        end = start + num_tokens
        table = self.block_manager.allocate(seq.seq_id, end, start)
        assert table is not None, f"seq {seq.seq_id}: capacity promised {end} tokens"
        seq.block_table = table
        seq.sliding_slot = self.block_manager.sliding_slot(seq.seq_id)
        return ScheduledSeq(
            seq_id=seq.seq_id,
            token_ids=seq.all_token_ids[start:end],
            start_pos=start,
            block_table=table,
            sliding_slot=seq.sliding_slot,
            needs_sample=end == seq.num_tokens,
            sampling=seq.params,
            num_generated=len(seq.output_token_ids),
            stop_token_ids=seq.stop_token_ids if seq.params.min_tokens else frozenset(),
            multimodal=seq.multimodal,
        )

    def _preempt(self, seq: Sequence, step: _Step) -> None:
        """Free all of ``seq``'s KV and requeue it at the front, to be recomputed later.

        The victim is never already scheduled this step: it is the youngest running seq, and
        running seqs are visited oldest first.
        """
        assert seq.seq_id not in step.scheduled, f"seq {seq.seq_id} preempted after scheduling"
        self._requeue(seq)
        step.preempted.append(seq.seq_id)

    def _requeue(self, seq: Sequence) -> None:
        """Preempt: drop ``seq``'s KV and put it at the front of the waiting queue."""
        self._running.remove(seq)
        self.block_manager.free(seq.seq_id)
        seq.preempt()
        self._waiting.appendleft(seq)
        self.num_preemptions += 1

    # -- integrity -----------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Assert the scheduler and its block manager agree; any failure is a kvroom bug.

        Call it between steps (after ``update``), when computed tokens have caught up.
        """
        bm = self.block_manager
        bm.check_invariants()
        assert len(self._running) <= self.max_num_seqs, "more running seqs than seats"
        owners = {s.seq_id for s in self._running}
        assert owners == bm.table_owners, f"running {owners} != table owners {bm.table_owners}"
        for seq in self._running:
            assert seq.status is SequenceStatus.RUNNING, f"seq {seq.seq_id} is {seq.status}"
            assert seq.block_table == bm.block_table(seq.seq_id), f"seq {seq.seq_id} stale"
            assert seq.sliding_slot == bm.sliding_slot(seq.seq_id), f"seq {seq.seq_id} slot"
            assert seq.num_computed_tokens <= len(seq.block_table) * bm.block_size
        mid_prefill = [s.seq_id for s in self._running[:-1] if s.num_uncomputed_tokens != 1]
        assert not mid_prefill, f"only the youngest running seq may be mid-prefill: {mid_prefill}"
        for seq in self._waiting:
            assert seq.status in (SequenceStatus.WAITING, SequenceStatus.PREEMPTED)
            assert seq.num_computed_tokens == 0 and not seq.block_table, f"seq {seq.seq_id}"
        live = [s.seq_id for s in self._running] + [s.seq_id for s in self._waiting]
        assert sorted(live) == sorted(self._seqs), "live seqs and queues disagree"


def _check_bounds(bm: BlockManager, max_num_seqs: int, max_seq_len: int, budget: int) -> None:
    """Reject scheduler bounds that are not positive ints or cannot work together."""
    for name, value in (
        ("max_num_seqs", max_num_seqs),
        ("max_seq_len", max_seq_len),
        ("max_num_batched_tokens", budget),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"Scheduler.{name}: must be an int >= 1, got {value!r}")
    if budget < max_num_seqs:
        raise ConfigError(
            f"Scheduler.max_num_batched_tokens ({budget}) must be >= "
            f"max_num_seqs ({max_num_seqs}) so every running sequence can decode each step"
        )
    if 0 < bm.num_sliding_slots < max_num_seqs:
        raise ConfigError(
            f"Scheduler.max_num_seqs ({max_num_seqs}) exceeds the pool's sliding-window "
            f"slots ({bm.num_sliding_slots}); lower max_num_seqs to {bm.num_sliding_slots} "
            "or build more slots"
        )
