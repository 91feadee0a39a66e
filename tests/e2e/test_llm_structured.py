"""Structured outputs through ``LLM.generate`` on the tiny random model.

A random model writes garbage, so every well-formed output here is the grammar's doing; and
an unconstrained sequence batched with constrained ones must come out exactly as without them.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from kvroom import StructuredOutputsParams
from kvroom.engine.params.sampling import SamplingParams
from kvroom.errors import AdmissionError, ConfigError
from kvroom.llm import LLM

# Not ``maxLength``: xgrammar 0.2.9 then lets control characters into the string unescaped.
SCHEMA = {
    "type": "object",
    "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 99},
        "b": {"type": "boolean"},
        "c": {"enum": ["x", "y"]},
    },
    "required": ["a", "b", "c"],
    "additionalProperties": False,
}
PROMPTS = ["Hello there", "A b c", "Once upon", "JSON:"]


@pytest.fixture(scope="module")
def llm(tiny_artifact: Path) -> LLM:
    return LLM(tiny_artifact)


def params(so: StructuredOutputsParams | None = None, **kw: object) -> SamplingParams:
    return SamplingParams(**{"temperature": 0, "max_tokens": 40, "structured_outputs": so, **kw})


def check_schema(text: str) -> None:
    value = json.loads(text)
    assert set(value) == {"a", "b", "c"}
    assert isinstance(value["a"], int) and 0 <= value["a"] <= 99
    assert isinstance(value["b"], bool) and value["c"] in ("x", "y")


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema(llm: LLM, temperature: float) -> None:
    so = StructuredOutputsParams(json=SCHEMA)
    results = llm.generate(PROMPTS, params(so, temperature=temperature, seed=3))
    for r in results:
        assert r.outputs[0].finish_reason == "stop", r.text
        check_schema(r.text)


def test_regex_choice_and_grammar(llm: LLM) -> None:
    regex = r"[a-c]{2,4}-\d{3}"
    cases = [
        (StructuredOutputsParams(regex=regex), lambda t: re.fullmatch(regex, t)),
        (StructuredOutputsParams(choice=["yes", "no"]), lambda t: t in ("yes", "no")),
        (
            StructuredOutputsParams(grammar='root ::= "(" [0-9] ("+" [0-9])* ")"'),
            lambda t: re.fullmatch(r"\([0-9](\+[0-9])*\)", t),
        ),
    ]
    for so, ok in cases:
        for r in llm.generate(PROMPTS, params(so, temperature=1.0, seed=11)):
            out = r.outputs[0]
            assert out.finish_reason == "stop", (so.kind, out.text)
            assert ok(out.text), (so.kind, out.text)


def test_json_object(llm: LLM) -> None:
    r = llm.generate(["x"], params(StructuredOutputsParams(json_object=True)))[0]
    assert r.text.startswith("{")
    if r.outputs[0].finish_reason == "stop":
        assert isinstance(json.loads(r.text), dict)


def test_unconstrained_sequences_are_untouched_by_constrained_neighbours(llm: LLM) -> None:
    free = llm.generate(PROMPTS, params(ignore_eos=True, max_tokens=20))
    so = StructuredOutputsParams(json=SCHEMA)
    mixed = llm.generate(
        PROMPTS, [params(so) if i % 2 else params(ignore_eos=True, max_tokens=20) for i in range(4)]
    )
    for i in (0, 2):
        assert mixed[i].token_ids == free[i].token_ids
    for i in (1, 3):
        assert mixed[i].token_ids != free[i].token_ids
        if mixed[i].outputs[0].finish_reason == "stop":
            check_schema(mixed[i].text)


def test_n_choices_each_follow_the_grammar(llm: LLM) -> None:
    so = StructuredOutputsParams(regex=r"[a-z]{3,8}")
    r = llm.generate(["Hi"], params(so, n=4, temperature=1.0, seed=5))[0]
    texts = [o.text for o in r.outputs]
    assert len(texts) == 4 and len(set(texts)) > 1
    assert all(re.fullmatch(r"[a-z]{3,8}", t) for t in texts), texts


def test_preempted_constrained_sequences_resume_their_grammar(llm: LLM) -> None:
    """Shrinking the pool mid-run preempts sequences; recomputed, they finish the same."""
    so = StructuredOutputsParams(json=SCHEMA)
    engine = llm.runtime.engine
    reference = [r.token_ids for r in llm.generate(PROMPTS, params(so))]
    ids = [engine.add_request(llm.tokenizer(p)["input_ids"], params(so)) for p in PROMPTS]
    finals: dict[str, tuple[int, ...]] = {}
    steps = 0
    while engine.has_unfinished():
        if steps == 16:
            done = llm.resize_kv_cache(16)
            assert done.num_preempted > 0
        finals.update({o.request_id: o.output_token_ids for o in engine.step() if o.finished})
        steps += 1
    llm.resize_kv_cache(64)
    assert [finals[i] for i in ids] == reference


def test_bad_constraints_are_refused_up_front(llm: LLM) -> None:
    with pytest.raises(ConfigError, match=r"regular expression does not compile"):
        llm.generate(["x"], params(StructuredOutputsParams(regex="(a")))
    assert llm.generate(["x"], params(max_tokens=2))[0].token_ids  # still serving
    with pytest.raises(ConfigError, match="min_tokens: must be unset with structured_outputs"):
        params(StructuredOutputsParams(regex="a"), min_tokens=1)


def test_an_engine_without_a_tokenizer_refuses_constraints(llm: LLM) -> None:
    engine = llm.runtime.engine
    grammars, engine.grammars = engine.grammars, None
    try:
        with pytest.raises(AdmissionError, match="structured outputs need the model's tokenizer"):
            engine.add_request([1, 2], params(StructuredOutputsParams(regex="a")))
    finally:
        engine.grammars = grammars
