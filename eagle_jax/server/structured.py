"""Structured output on the wire: OpenAI's ``response_format`` and vLLM's
``structured_outputs`` / ``guided_*`` fields, read into one ``StructuredOutput``.

Accepted (one constraint per request; two are a 400):

* ``response_format``: ``{"type": "text"}`` (none), ``{"type": "json_object"}``,
  ``{"type": "json_schema", "json_schema": {"name": .., "schema": {..}}}``;
* ``structured_outputs``: ``{"json": schema}``, ``{"regex": ".."}``, ``{"choice": [..]}``,
  ``{"grammar": ".."}`` (EBNF, start rule ``root``), ``{"json_object": true}``;
* ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar`` (vLLM's older
  names for the same).

The shapes are checked here (a 400 naming the field); whether a schema, regex or grammar
compiles is the engine's check (``eagle_jax.grammar``), also a 400.
"""

from __future__ import annotations

import json
from typing import Any

from ..sampling import StructuredOutput


class StructuredOutputError(ValueError):
    """A malformed structured-output field: ``param`` names it."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def _schema_text(value: Any, param: str) -> str:
    """A JSON schema given as an object or as JSON text, as JSON text."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise StructuredOutputError(f"{param} is not valid JSON: {e}", param) from None
    if not isinstance(value, (dict, bool)):
        raise StructuredOutputError(f"{param} must be a JSON schema (an object), got "
                                    f"{type(value).__name__}", param)
    return json.dumps(value)


def _text(value: Any, param: str) -> str:
    if not isinstance(value, str) or not value:
        raise StructuredOutputError(f"{param} must be a non-empty string, got {value!r:.100}",
                                    param)
    return value


def _choices(value: Any, param: str) -> tuple[str, ...]:
    if (not isinstance(value, list) or not value
            or not all(isinstance(c, str) and c for c in value)):
        raise StructuredOutputError(f"{param} must be a non-empty list of non-empty strings, "
                                    f"got {value!r:.100}", param)
    return tuple(value)


def _from_response_format(value: Any) -> StructuredOutput | None:
    param = "response_format"
    if not isinstance(value, dict) or "type" not in value:
        raise StructuredOutputError(f"{param} must be an object with a type, got "
                                    f"{value!r:.100}", param)
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput("json_object")
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise StructuredOutputError(
                f"{param}.json_schema must be an object with a schema, got {spec!r:.100}",
                f"{param}.json_schema")
        return StructuredOutput("json", _schema_text(spec["schema"], f"{param}.json_schema"))
    raise StructuredOutputError(f"{param}.type must be text, json_object or json_schema, got "
                                f"{kind!r}", f"{param}.type")


def _from_vllm(fields: dict[str, Any], prefix: str) -> list[StructuredOutput]:
    """``fields`` (json, regex, choice, grammar, json_object) given, each as one
    constraint; ``prefix`` names them in errors (``structured_outputs.`` or ``guided_``)."""
    out = []
    for name, value in fields.items():
        if value is None or value is False:
            continue
        param = f"{prefix}{name}"
        if name == "json":
            out.append(StructuredOutput("json", _schema_text(value, param)))
        elif name == "json_object":
            out.append(StructuredOutput("json_object"))
        elif name == "regex":
            out.append(StructuredOutput("regex", _text(value, param)))
        elif name == "choice":
            out.append(StructuredOutput("choice", choices=_choices(value, param)))
        elif name == "grammar":
            out.append(StructuredOutput("grammar", _text(value, param)))
    return out


def structured_output(response_format: Any, structured_outputs: Any,
                      guided: dict[str, Any]) -> StructuredOutput | None:
    """The request's one constraint, or None. ``guided``: guided_json .. guided_grammar by
    their suffix (json, regex, choice, grammar)."""
    found = []
    if response_format is not None:
        spec = _from_response_format(response_format)
        found += [spec] if spec is not None else []
    if structured_outputs is not None:
        if not isinstance(structured_outputs, dict):
            raise StructuredOutputError("structured_outputs must be an object, got "
                                        f"{structured_outputs!r:.100}", "structured_outputs")
        known = {k: structured_outputs.get(k)
                 for k in ("json", "regex", "choice", "grammar", "json_object")}
        found += _from_vllm(known, "structured_outputs.")
    found += _from_vllm(guided, "guided_")
    if len(found) > 1:
        raise StructuredOutputError(
            "a request takes one structured-output constraint; it gave "
            f"{len(found)} ({', '.join(s.kind for s in found)})", "response_format")
    return found[0] if found else None
