"""What a structured-output request asks for (torch-free, no grammar engine).

vLLM's ``StructuredOutputsParams`` (vLLM >= 0.11; ``GuidedDecodingParams`` before): exactly one
of ``json``, ``regex``, ``choice``, ``grammar`` or ``json_object``. The grammar engine that
turns it into token masks is ``engine/structured/grammar.py``; this module only validates the
shape, so ``SamplingParams`` can carry it without importing xgrammar.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from kvroom.errors import ConfigError

StructuredKind = Literal["json", "regex", "choice", "grammar", "json_object"]
_KINDS: tuple[StructuredKind, ...] = ("json", "regex", "choice", "grammar", "json_object")


class StructuredOutputError(ConfigError):
    """A schema, regex or grammar that the grammar engine cannot compile; names which."""


@dataclass(frozen=True)
class StructuredOutputsParams:
    """The constraint on one request's output (vLLM's names)."""

    json: str | dict[str, Any] | None = None
    """A JSON schema (a dict or its JSON text); the output is one JSON value matching it."""
    regex: str | None = None
    """The output fully matches this regular expression."""
    choice: tuple[str, ...] | None = None
    """The output is exactly one of these strings (a list is accepted)."""
    grammar: str | None = None
    """An EBNF grammar in xgrammar's (GBNF-style) syntax, with a ``root`` rule."""
    json_object: bool = False
    """Any JSON object (OpenAI's ``response_format: {"type": "json_object"}``)."""
    disable_any_whitespace: bool = True
    """Generate JSON on one line with ``", "`` and ``": "`` separators. kvroom's default is
    True, unlike vLLM's: with free whitespace a small model can emit newlines until
    ``max_tokens`` (vLLM added this flag for that failure); False allows any whitespace."""
    strict: bool = True
    """JSON schema: no properties or items beyond those the schema names (OpenAI's
    ``strict``; xgrammar's ``strict_mode``)."""

    def __post_init__(self) -> None:
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
        if isinstance(self.json, str):
            object.__setattr__(self, "json", _parse_schema(self.json))
        set_kinds = [k for k in _KINDS if _is_set(getattr(self, k))]
        if len(set_kinds) != 1:
            raise ConfigError(
                "StructuredOutputsParams: set exactly one of json, regex, choice, grammar, "
                f"json_object; got {set_kinds or 'none'}"
            )
        if self.choice is not None and not (
            self.choice and all(isinstance(c, str) and c for c in self.choice)
        ):
            raise ConfigError(
                "StructuredOutputsParams.choice: must be a non-empty list of non-empty "
                f"strings, got {list(self.choice)!r}"
            )
        if self.json is not None and not isinstance(self.json, dict):
            raise ConfigError(
                f"StructuredOutputsParams.json: a JSON schema is an object, got {self.json!r}"
            )

    @property
    def kind(self) -> StructuredKind:
        """Which constraint is set."""
        return next(k for k in _KINDS if _is_set(getattr(self, k)))

    @property
    def key(self) -> tuple[str, ...]:
        """A hashable identity of the compiled grammar (the compile cache's key)."""
        kind = self.kind
        if kind == "json":
            body = json.dumps(self.json, sort_keys=True)
        elif kind == "choice":
            body = json.dumps(self.choice)
        elif kind == "json_object":
            body = ""
        else:
            body = str(getattr(self, kind))
        return (kind, body, str(self.disable_any_whitespace), str(self.strict))


def _is_set(value: object) -> bool:
    return value is not None and value is not False


def _parse_schema(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise StructuredOutputError(
            f"StructuredOutputsParams.json: the schema is not valid JSON: {exc}"
        ) from exc
