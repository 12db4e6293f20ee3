"""Check each generated output against the structured-output constraint it was generated under.

vLLM constrains decoding token by token, but an output can still miss its constraint: it
stops at `max_tokens` in the middle of an object, or the tokenizer does not decode to the
bytes the grammar matched (a WordPiece tokenizer joins tokens with spaces). So every output
is checked after generation: JSON schema outputs must parse and validate (`jsonschema`),
`json_object` outputs must parse to an object, `regex` outputs must match the whole text,
`choice` outputs must be one of the choices. A failure flags the row (`output_valid` false,
`output_error` says why) and counts in the manifest's `rows_invalid_output`; the row is kept.

Checks run in time linear in the output: regexes (the `regex` constraint, a JSON schema's
`pattern` and `patternProperties`) go through RE2 (`google-re2`), never Python's
backtracking `re` (`(a+)+b` on a run of a's is exponential there). A pattern RE2 cannot
compile (lookarounds, backreferences, `a**`) is refused when the row's parameters are mapped
(`pattern_problem`), so the check after generation never meets one.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from functools import lru_cache
from typing import Any

import re2

from dagster_gpuinfer.spec import StructuredOutputs


def check_output(constraint: StructuredOutputs, text: str) -> str | None:
    """Why `text` does not satisfy `constraint`, or None when it does."""
    if constraint.choice is not None:
        if text in constraint.choice:
            return None
        return f"output {_clip(text)} is not one of the choices {constraint.choice}"
    if constraint.regex is not None:
        if _compiled(constraint.regex).fullmatch(text) is not None:
            return None
        return f"output {_clip(text)} does not match the regex {constraint.regex!r}"
    try:
        value = json.loads(text)
    except ValueError as exc:
        return f"output is not valid JSON ({exc}): {_clip(text)}"
    if constraint.json_object:
        return None if isinstance(value, dict) else "output is JSON but not an object"
    if constraint.json_schema is not None:
        return _schema_problem(json.dumps(constraint.json_schema, sort_keys=True), value)
    return None


def _schema_problem(schema_text: str, value: Any) -> str | None:
    validator = _validator(schema_text)
    error = next(iter(validator.iter_errors(value)), None)
    if error is None:
        return None
    where = "/".join(str(part) for part in error.absolute_path) or "(root)"
    return f"output does not validate against the schema at {where}: {error.message}"


def pattern_problem(constraint: StructuredOutputs) -> tuple[str, str] | None:
    """(pattern, why) for the first pattern of `constraint` that the output check cannot
    compile, or None when every pattern compiles."""
    patterns: list[str] = []
    if constraint.regex is not None:
        patterns.append(constraint.regex)
    if constraint.json_schema is not None:
        patterns.extend(_schema_patterns(constraint.json_schema))
    for pattern in patterns:
        if not isinstance(pattern, str):
            return repr(pattern), "a pattern must be a string"
        try:
            _compiled(pattern)
        except re2.error as exc:
            reason = exc.args[0].decode() if exc.args and isinstance(exc.args[0], bytes) else exc
            return pattern, f"{reason} (patterns are RE2 syntax: no lookarounds, no backreferences)"
    return None


def _schema_patterns(schema: Any) -> Iterator[Any]:
    """Every `pattern` value and `patternProperties` key in a JSON schema (iterative)."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            # A `pattern` that is a dict is a property named "pattern", not a regex.
            if "pattern" in node and not isinstance(node["pattern"], (dict, list)):
                yield node["pattern"]
            properties = node.get("patternProperties")
            if isinstance(properties, dict):
                yield from properties
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)


def _re2_pattern(validator: Any, pattern: str, instance: Any, schema: Any) -> Iterator[Any]:
    from jsonschema.exceptions import ValidationError

    if validator.is_type(instance, "string") and _compiled(pattern).search(instance) is None:
        yield ValidationError(f"{_clip(instance)} does not match {pattern!r}")


def _re2_pattern_properties(validator: Any, properties: Any, instance: Any, schema: Any) -> Any:
    if not validator.is_type(instance, "object"):
        return
    for pattern, subschema in properties.items():
        for key, value in instance.items():
            if _compiled(pattern).search(key) is not None:
                yield from validator.descend(value, subschema, path=key, schema_path=pattern)


def _re2_additional_properties(validator: Any, allowed: Any, instance: Any, schema: Any) -> Any:
    from jsonschema.exceptions import ValidationError

    if not validator.is_type(instance, "object"):
        return
    properties = schema.get("properties", {})
    patterns = [_compiled(p) for p in schema.get("patternProperties", {})]
    extras = [
        key
        for key in instance
        if key not in properties and not any(p.search(key) is not None for p in patterns)
    ]
    if validator.is_type(allowed, "object"):
        for extra in extras:
            yield from validator.descend(instance[extra], allowed, path=extra)
    elif not allowed and extras:
        names = ", ".join(repr(extra) for extra in sorted(extras))
        yield ValidationError(f"Additional properties are not allowed ({names} unexpected)")


@lru_cache(maxsize=64)
def _validator(schema_text: str) -> Any:
    import jsonschema

    schema = json.loads(schema_text)
    base = jsonschema.validators.validator_for(schema)
    linear = jsonschema.validators.extend(
        base,
        {
            "pattern": _re2_pattern,
            "patternProperties": _re2_pattern_properties,
            "additionalProperties": _re2_additional_properties,
        },
    )
    return linear(schema)


_RE2_OPTIONS = re2.Options()
_RE2_OPTIONS.log_errors = False  # a refused pattern is reported per row, not on stderr


@lru_cache(maxsize=256)
def _compiled(pattern: str) -> Any:
    return re2.compile(pattern, _RE2_OPTIONS)


def _clip(text: str, limit: int = 80) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")
