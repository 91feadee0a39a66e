"""The request fields that constrain the output, to one ``StructuredOutputsParams``.

Three spellings reach the same engine constraint: OpenAI's ``response_format``
(``json_object``, ``json_schema``), vLLM's ``structured_outputs`` (``json``, ``regex``,
``choice``, ``grammar``, ``json_object``) and vLLM's older ``guided_json`` / ``guided_regex`` /
``guided_choice`` / ``guided_grammar``. At most one may be set. The constraint is compiled
here, off the event loop, so a schema that does not compile is a 400 naming the field before
anything reaches the engine (whose own compile is then a cache hit).
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

from kvroom.engine.params.structured import StructuredOutputError, StructuredOutputsParams
from kvroom.errors import ConfigError
from kvroom.server.openai.protocol import ApiError, ResponseFormat, StructuredOutputsRequest

_GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


def requested_constraint(body: Any) -> tuple[str, StructuredOutputsParams] | None:
    """``(field, constraint)`` of the body, or None when the output is free.

    Raises:
        ApiError: 400 when two fields constrain the output, or one is malformed.
    """
    found: list[tuple[str, dict[str, Any]]] = []
    if body.response_format is not None:
        fields = _response_format(body.response_format)
        if fields is not None:
            found.append(("response_format", fields))
    if body.structured_outputs is not None:
        found.append(("structured_outputs", _structured_outputs(body.structured_outputs)))
    found.extend(
        (name, {kind: getattr(body, name)})
        for name, kind in _GUIDED.items()
        if getattr(body, name) is not None
    )
    if not found:
        return None
    if len(found) > 1:
        names = ", ".join(f"'{name}'" for name, _ in found)
        raise ApiError(
            400,
            f"{names} each constrain the output; set only one",
            param=found[1][0],
            code="invalid_value",
        )
    return found[0][0], _params(*found[0])


def _response_format(rf: ResponseFormat) -> dict[str, Any] | None:
    if rf.type == "text":
        return None
    if rf.type == "json_object":
        return {"json_object": True}
    if rf.json_schema is None:
        raise ApiError(
            400,
            "'response_format' of type 'json_schema' needs 'json_schema': "
            '{"name": ..., "schema": {...}}',
            param="response_format",
            code="invalid_value",
        )
    schema = rf.json_schema.schema_
    fields: dict[str, Any] = {"json": schema} if schema is not None else {"json_object": True}
    if rf.json_schema.strict is False:
        fields["strict"] = False
    return fields


def _structured_outputs(so: StructuredOutputsRequest) -> dict[str, Any]:
    fields = {
        "json": so.json_,
        "regex": so.regex,
        "choice": so.choice,
        "grammar": so.grammar,
        "json_object": bool(so.json_object),
    }
    if so.disable_any_whitespace is not None:
        fields["disable_any_whitespace"] = so.disable_any_whitespace
    return fields


def _params(field: str, fields: dict[str, Any]) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**fields)
    except ConfigError as exc:
        keep = field == "structured_outputs"  # its sub-field names the culprit
        message = re.sub(
            r"^StructuredOutputsParams(\.\w+)?",
            lambda m: f"'{field}{(m.group(1) or '') if keep else ''}'",
            str(exc),
        )
        raise ApiError(400, message, param=field, code="invalid_value") from exc


async def check_compiles(grammars: Any, field: str, params: StructuredOutputsParams) -> None:
    """Compile ``params`` on a worker thread; a 400 naming ``field`` when it does not compile."""
    if grammars is None:
        raise ApiError(400, "this server cannot constrain outputs (no tokenizer)", param=field)
    try:
        await asyncio.to_thread(grammars.compile, params)
    except StructuredOutputError as exc:
        message = re.sub(r"^structured_outputs\.\w+", f"'{field}'", str(exc))
        raise ApiError(400, message, param=field, code="invalid_value") from exc
