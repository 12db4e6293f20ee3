"""Check each generated output against the structured-output constraint it was generated under.

vLLM constrains decoding token by token, but an output can still miss its constraint: it
stops at `max_tokens` in the middle of an object, or the tokenizer does not decode to the
bytes the grammar matched (a WordPiece tokenizer joins tokens with spaces). So every output
is checked after generation: JSON schema outputs must parse and validate (`jsonschema`),
`json_object` outputs must parse to an object, `regex` outputs must match the whole text,
`choice` outputs must be one of the choices. A failure flags the row (`output_valid` false,
`output_error` says why) and counts in the manifest's `rows_invalid_output`; the row is kept.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from typing import Any

from dagster_gpuinfer.spec import StructuredOutputs


def check_output(constraint: StructuredOutputs, text: str) -> str | None:
    """Why `text` does not satisfy `constraint`, or None when it does."""
    if constraint.choice is not None:
        if text in constraint.choice:
            return None
        return f"output {_clip(text)} is not one of the choices {constraint.choice}"
    if constraint.regex is not None:
        if _compiled(constraint.regex).fullmatch(text):
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


@lru_cache(maxsize=64)
def _validator(schema_text: str) -> Any:
    import jsonschema

    schema = json.loads(schema_text)
    return jsonschema.validators.validator_for(schema)(schema)


@lru_cache(maxsize=64)
def _compiled(pattern: str) -> re.Pattern[str]:
    return re.compile(pattern)


def _clip(text: str, limit: int = 80) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")
