"""``StructuredOutputsParams`` and its place in ``SamplingParams`` (torch-free)."""

from __future__ import annotations

import pytest

from kvroom.engine.params.sampling import SamplingParams
from kvroom.engine.params.structured import StructuredOutputError, StructuredOutputsParams
from kvroom.errors import ConfigError


def test_exactly_one_constraint() -> None:
    with pytest.raises(ConfigError, match=r"exactly one of .*; got none"):
        StructuredOutputsParams()
    with pytest.raises(ConfigError, match=r"got \['regex', 'choice'\]"):
        StructuredOutputsParams(regex="a", choice=["b"])


def test_json_text_is_parsed_and_keys_are_canonical() -> None:
    a = StructuredOutputsParams(json='{"type": "object", "required": ["a"]}')
    b = StructuredOutputsParams(json={"required": ["a"], "type": "object"})
    assert a.json == b.json and a.key == b.key and a.kind == "json"
    assert a.key != StructuredOutputsParams(json=b.json, strict=False).key
    with pytest.raises(StructuredOutputError, match=r"json: the schema is not valid JSON"):
        StructuredOutputsParams(json="{bad")
    with pytest.raises(ConfigError, match=r"a JSON schema is an object, got \[1\]"):
        StructuredOutputsParams(json="[1]")


def test_choice_must_be_non_empty_strings() -> None:
    assert StructuredOutputsParams(choice=["a", "b"]).choice == ("a", "b")
    with pytest.raises(ConfigError, match=r"choice: must be a non-empty list"):
        StructuredOutputsParams(choice=["a", ""])


@pytest.mark.parametrize("field", [{"min_tokens": 2}, {"ignore_eos": True}])
def test_sampling_params_refuse_what_fights_the_grammar(field: dict[str, object]) -> None:
    so = StructuredOutputsParams(regex="[a-z]+")
    name = next(iter(field))
    with pytest.raises(ConfigError, match=rf"SamplingParams.{name}: must be unset with structured"):
        SamplingParams(structured_outputs=so, **field)


def test_children_keep_the_constraint() -> None:
    so = StructuredOutputsParams(choice=["x"])
    params = SamplingParams(n=3, structured_outputs=so, seed=1)
    assert all(params.child(i).structured_outputs is so for i in range(3))
    with pytest.raises(ConfigError, match=r"structured_outputs: must be None or a Structured"):
        SamplingParams(structured_outputs={"regex": "a"})  # type: ignore[arg-type]
