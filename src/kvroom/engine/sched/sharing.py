"""Where a sequence being admitted gets K/V it need not compute (torch-free policy).

Two sources, tried in order; both hand the sequence shared blocks (``BlockManager``)::

    1. a twin     a running sequence with the same prompt (the n choices of one request):
                  fork its blocks for prompt[:-1]; only the last prompt token is computed.
                  A twin still prefilling makes the newcomer wait one step instead of
                  prefilling the same prompt beside it.
    2. the cache  the longest cached prefix of full blocks (``BlockManager.match_prefix``).

Only K/V that is a function of token ids alone may be shared, and only sequences that do not
need their prompt run through the model may skip it: no images (their K/V depends on pixels
behind placeholder tokens), no ``prompt_logprobs`` (they need every prompt position's logits,
as in vLLM), no penalties (the sampler's token history is filled by the computed chunks).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kvroom.engine.kv.block_manager import BlockManager
from kvroom.engine.sched.sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class Claim:
    """K/V a sequence got at admission without computing it."""

    num_tokens: int
    """Leading tokens whose K/V its table now holds (its ``num_computed_tokens``)."""
    forked: bool
    """From a running twin (True) or from the prefix cache (False)."""


NOTHING = Claim(0, forked=False)


def kv_is_token_function(seq: Sequence) -> bool:
    """Its K/V depends on token ids only (no images), so its full blocks may be cached."""
    return seq.multimodal is None


def may_skip_prefill(seq: Sequence) -> bool:
    """It may take K/V it did not compute (see the module docstring)."""
    params = seq.params
    return kv_is_token_function(seq) and params.prompt_logprobs is None and not params.penalised


def claim_prefix(bm: BlockManager, seq: Sequence, running: Iterable[Sequence]) -> Claim | None:
    """Give a waiting ``seq`` the K/V others already computed for its first tokens.

    Returns:
        What it got (possibly nothing), or None while a twin is still prefilling: admit it
        next step, when the twin's blocks can be forked.
    """
    if not bm.shares_blocks or not may_skip_prefill(seq):
        return NOTHING
    shared_len = seq.prompt_len - 1
    if seq.status is SequenceStatus.WAITING and shared_len > 0:
        twins = [r for r in running if _is_twin(r, seq)]
        ready = [t for t in twins if t.num_computed_tokens >= shared_len]
        if ready:
            bm.fork(ready[0].seq_id, seq.seq_id, shared_len)
            return Claim(shared_len, forked=True)
        if twins:
            return None
    return Claim(bm.match_prefix(seq.seq_id, seq.all_token_ids), forked=False)


def _is_twin(other: Sequence, seq: Sequence) -> bool:
    return kv_is_token_function(other) and other.prompt_token_ids == seq.prompt_token_ids
