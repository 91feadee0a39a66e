"""``GrammarCompiler`` over the tiny byte-level tokenizer: errors, cache, padding, choice."""

from __future__ import annotations

import pytest
import torch
import xgrammar as xgr

from kvroom.engine.params.structured import StructuredOutputError
from kvroom.engine.params.structured import StructuredOutputsParams as SO
from kvroom.engine.structured.grammar import GrammarCompiler, choice_grammar
from tiny_models import build_tiny_tokenizer

VOCAB = 320  # logits wider than the tokenizer's 300 tokens (padded embeddings)


@pytest.fixture(scope="module")
def tokenizer():  # noqa: ANN201
    return build_tiny_tokenizer()


@pytest.fixture(scope="module")
def compiler(tokenizer) -> GrammarCompiler:  # noqa: ANN001
    return GrammarCompiler(tokenizer, VOCAB, [tokenizer.eos_token_id])


def allowed(compiler: GrammarCompiler, so: SO, text: str, tokenizer) -> list[int]:  # noqa: ANN001
    matcher = xgr.GrammarMatcher(compiler.compile(so))
    for t in tokenizer.encode(text, add_special_tokens=False):
        assert matcher.accept_token(t)
    mask = xgr.allocate_token_bitmask(1, VOCAB)
    matcher.fill_next_token_bitmask(mask)
    logits = torch.zeros(1, VOCAB)
    xgr.apply_token_bitmask_inplace(logits, mask, vocab_size=VOCAB)
    return (logits[0] == 0).nonzero().flatten().tolist()


@pytest.mark.parametrize(
    ("so", "message"),
    [
        (
            SO(json={"type": "nope"}),
            r"^structured_outputs.json: the JSON schema does not "
            r'compile: Unsupported type "nope"$',
        ),
        (
            SO(regex="(a"),
            r"^structured_outputs.regex: the regular expression does not compile: "
            r"Regex parsing error at position 3: The parenthesis is not closed.$",
        ),
        (
            SO(grammar="root ::= foo"),
            r"^structured_outputs.grammar: the grammar does not "
            r'compile: EBNF parser error at line 1, column 10: Rule "foo" is not defined$',
        ),
    ],
)
def test_what_does_not_compile_is_named(compiler: GrammarCompiler, so: SO, message: str) -> None:
    with pytest.raises(StructuredOutputError, match=message):
        compiler.compile(so)


def test_compiled_grammars_are_cached_by_key(compiler: GrammarCompiler) -> None:
    a = compiler.compile(SO(json={"type": "object", "properties": {"a": {"type": "integer"}}}))
    b = compiler.compile(SO(json='{"properties": {"a": {"type": "integer"}}, "type": "object"}'))
    assert a is b


def test_padded_ids_and_ids_past_the_tokenizer_are_never_allowed(compiler, tokenizer) -> None:  # noqa: ANN001
    ids = allowed(compiler, SO(json_object=True), "", tokenizer)
    assert ids == tokenizer.encode("{", add_special_tokens=False)
    done = allowed(compiler, SO(regex="ab"), "ab", tokenizer)
    assert done == [tokenizer.eos_token_id]


def test_choice_is_one_of_the_strings_escaped(compiler, tokenizer) -> None:  # noqa: ANN001
    assert choice_grammar(['say "hi"', "x\\y"]) == 'root ::= "say \\"hi\\"" | "x\\\\y"'
    so = SO(choice=['say "hi"', "no"])
    first = allowed(compiler, so, "", tokenizer)
    assert sorted(first) == sorted(tokenizer.encode("sn", add_special_tokens=False))
    assert allowed(compiler, so, 'say "hi"', tokenizer) == [tokenizer.eos_token_id]
