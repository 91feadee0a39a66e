"""``StructuredOutputs``: matcher lifecycle and the step's bitmask, over real xgrammar."""

from __future__ import annotations

import pytest
import torch

from kvroom.engine.params.sampling import SamplingParams
from kvroom.engine.params.structured import StructuredOutputsParams as SO
from kvroom.engine.sched.output import ScheduledSeq
from kvroom.engine.structured.grammar import GrammarCompiler
from kvroom.engine.structured.masks import StructuredOutputs
from tiny_models import build_tiny_tokenizer

VOCAB = 300


@pytest.fixture(scope="module")
def tokenizer():  # noqa: ANN201
    return build_tiny_tokenizer()


@pytest.fixture
def so(tokenizer) -> StructuredOutputs:  # noqa: ANN001
    return StructuredOutputs(GrammarCompiler(tokenizer, VOCAB, [tokenizer.eos_token_id]))


def seq(seq_id: int, num_generated: int = 0, constraint: SO | None = None) -> ScheduledSeq:
    params = SamplingParams(temperature=0, structured_outputs=constraint)
    return ScheduledSeq(seq_id, (1,), 0, (0,), None, True, params, num_generated)


def ids(tokenizer, text: str) -> list[int]:  # noqa: ANN001
    return tokenizer.encode(text, add_special_tokens=False)


def step(
    so: StructuredOutputs, seqs: list[ScheduledSeq], vocab: int = VOCAB
) -> tuple[torch.Tensor, list[int]]:
    """One masked greedy step over flat logits (ties: the lowest id); returns (logits, tokens)."""
    masks = so.begin(seqs)
    logits = torch.zeros(len(seqs), vocab)
    if masks is not None:
        so.apply(masks, logits)
    tokens = logits.argmax(-1).tolist()
    if masks is not None:
        so.accept(masks, tokens)
    return logits, tokens


def test_no_constrained_sequence_costs_nothing(so: StructuredOutputs) -> None:
    assert so.begin([seq(0), seq(1)]) is None
    assert so.num_live == 0


def test_only_constrained_rows_are_masked_and_matchers_advance(so, tokenizer) -> None:  # noqa: ANN001
    regex = SO(regex="ab|ac")
    seqs = [seq(0), seq(1, constraint=regex)]
    logits, tokens = step(so, seqs)
    assert (logits[0] == 0).all()
    allowed = (logits[1] == 0).nonzero().flatten().tolist()
    assert sorted(tokenizer.decode([t]) for t in allowed) == ["a", "ab", "ac"]  # BPE merges
    out = [tokens[1]]
    while out[-1] != tokenizer.eos_token_id:
        n = len(out)
        logits, tokens = step(so, [seq(0, n), seq(1, n, constraint=regex)])
        out.append(tokens[1])
    assert tokenizer.decode(out, skip_special_tokens=True) in ("ab", "ac")


def test_a_matcher_ahead_of_its_sequence_is_rolled_back(so, tokenizer) -> None:  # noqa: ANN001
    regex = SO(regex="[a-z]{1,3}")
    step(so, [seq(7, 0, regex)])
    step(so, [seq(7, 1, regex)])  # the matcher has accepted two tokens
    logits, _ = step(so, [seq(7, 1, regex)])  # the second was dropped: back to one
    reference, _ = step(so, [seq(8, 0, regex)])
    reference, _ = step(so, [seq(8, 1, regex)])
    assert torch.equal(logits, reference)
    with pytest.raises(AssertionError, match="behind its tokens by 2"):
        so.begin([seq(7, 4, regex)])


def test_a_finished_grammar_allows_only_the_stop_tokens(so, tokenizer) -> None:  # noqa: ANN001
    choice = SO(choice=["x"])
    _, tokens = step(so, [seq(3, 0, choice)])
    assert tokens == ids(tokenizer, "x")
    _, tokens = step(so, [seq(3, 1, choice)])
    assert tokens == [tokenizer.eos_token_id]
    logits, _ = step(so, [seq(3, 2, choice)])  # terminated (as if EOS were ignored)
    assert (logits[0] == 0).nonzero().flatten().tolist() == [tokenizer.eos_token_id]
    so.release(3)
    assert so.num_live == 0


def test_a_rejected_token_ends_the_output(so, tokenizer, caplog) -> None:  # noqa: ANN001
    choice = SO(choice=["yes"])
    masks = so.begin([seq(5, 0, choice)])
    assert masks is not None
    so.apply(masks, torch.zeros(1, VOCAB))
    so.accept(masks, ids(tokenizer, "n"))
    assert "grammar rejected sampled token" in caplog.text
    logits, _ = step(so, [seq(5, 1, choice)])
    assert (logits[0] == 0).nonzero().flatten().tolist() == [tokenizer.eos_token_id]


def test_high_stop_ids_set_the_sign_bit(tokenizer) -> None:  # noqa: ANN001
    compiler = GrammarCompiler(tokenizer, 320, [31, 63])
    so = StructuredOutputs(compiler)
    step(so, [seq(0, 0, SO(choice=["x"]))], 320)
    m = so._matchers[0]
    m.failed = True
    masks = so.begin([seq(0, 1, SO(choice=["x"]))])
    assert masks is not None
    logits = torch.zeros(1, 320)
    so.apply(masks, logits)
    assert (logits[0] == 0).nonzero().flatten().tolist() == [31, 63]
