"""Output checks after generation run in time linear in the output and never crash.

Regexes (the `regex` constraint, JSON-schema `pattern` / `patternProperties`) go through RE2;
a pattern RE2 cannot compile is refused when the row's parameters are mapped, naming the key.
"""

from __future__ import annotations

import time

import pytest

from dagster_gpuinfer.spec import SamplingParams, StructuredOutputs
from dagster_gpuinfer.worker.rows.request_params import RequestBuilder
from dagster_gpuinfer.worker.tasks.params import ParameterError
from dagster_gpuinfer.worker.tasks.structured import check_output, pattern_problem


def builder() -> RequestBuilder:
    return RequestBuilder(task="chat", defaults=SamplingParams().to_vllm_kwargs())


@pytest.mark.parametrize(
    "constraint",
    [
        StructuredOutputs(regex="(x+x+)+y"),
        StructuredOutputs(regex="(b|bb)*c"),
        StructuredOutputs(json={"type": "string", "pattern": "^(x+x+)+y$"}),
        StructuredOutputs(
            json={"type": "object", "patternProperties": {"^(x+x+)+y$": {"type": "integer"}}}
        ),
        StructuredOutputs(
            json={
                "type": "object",
                "patternProperties": {"^(x|xx)+z$": {}},
                "additionalProperties": False,
            }
        ),
    ],
)
def test_backtracking_patterns_are_checked_in_linear_time(constraint):
    text = "x" * 50_000 if constraint.regex == "(x+x+)+y" else "b" * 50_000
    if constraint.json_schema is not None:
        key = "x" * 50_000
        schema = constraint.json_schema
        text = f'"{key}"' if schema["type"] == "string" else f'{{"{key}": "v"}}'
    started = time.perf_counter()
    problem = check_output(constraint, text)
    assert time.perf_counter() - started < 2.0
    # A key matching no patternProperties pattern is unconstrained; the others fail.
    unconstrained = "patternProperties" in (constraint.json_schema or {}) and (
        "additionalProperties" not in constraint.json_schema
    )
    assert (problem is None) == unconstrained


def test_patterns_check_with_re2_semantics():
    assert check_output(StructuredOutputs(regex=r"\p{L}+"), "héllo") is None
    assert check_output(StructuredOutputs(regex=r"(?i)abc"), "ABC") is None
    assert check_output(StructuredOutputs(regex=r"\x{41}b"), "Ab") is None
    schema = {"type": "object", "properties": {"code": {"type": "string", "pattern": r"^\d{3}$"}}}
    assert check_output(StructuredOutputs(json=schema), '{"code": "123"}') is None
    assert "does not match" in check_output(StructuredOutputs(json=schema), '{"code": "12a"}')


@pytest.mark.parametrize(
    ("params", "key"),
    [
        ({"structured_outputs": {"regex": "(?<=a)b"}}, "structured_outputs"),
        ({"structured_outputs": {"regex": r"(q)\1"}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "b++c**"}}, "structured_outputs"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "schema": {"type": "object", "properties": {"a": {"pattern": "(?!x)"}}}
                    },
                }
            },
            "response_format",
        ),
        (
            {
                "structured_outputs": {
                    "json": {"type": "object", "patternProperties": {"(?=k)": {}}}
                }
            },
            "structured_outputs",
        ),
    ],
)
def test_patterns_the_checker_cannot_compile_are_refused_at_parameter_time(params, key):
    with pytest.raises(ParameterError) as caught:
        builder().build(params)
    assert caught.value.error_type == "invalid_parameter"
    assert caught.value.key == key
    assert "RE2" in str(caught.value)


def test_a_property_named_pattern_is_not_taken_for_a_regex():
    schema = {"type": "object", "properties": {"pattern": {"type": "string"}}}
    assert pattern_problem(StructuredOutputs(json=schema)) is None
    assert check_output(StructuredOutputs(json=schema), '{"pattern": "x"}') is None


def test_json_is_compact_by_default_with_an_opt_out():
    from dagster_gpuinfer import InferenceSpec
    from dagster_gpuinfer.worker.loop.engine import engine_kwargs, with_compact_json

    def spec(extra=None, task="chat"):
        return InferenceSpec.model_validate(
            {
                "model": "/m",
                "task": task,
                "engine": {"extra": extra or {}},
                "input": {"uri": "/in/{partition_key}.jsonl"},
                "output": {"root": "/out", "asset_name": "a"},
            }
        )

    def config(s):
        return with_compact_json(s, engine_kwargs(s)).get("structured_outputs_config")

    # vLLM takes disable_any_whitespace only with the xgrammar or guidance backend.
    assert config(spec()) == {"backend": "xgrammar", "disable_any_whitespace": True}
    assert config(spec({"structured_outputs_config": {"backend": "guidance"}})) == {
        "backend": "guidance",
        "disable_any_whitespace": True,
    }
    opted_out = spec({"structured_outputs_config": {"disable_any_whitespace": False}})
    assert config(opted_out) == {"disable_any_whitespace": False}
    other = spec({"structured_outputs_config": {"backend": "outlines"}})
    assert config(other) == {"backend": "outlines"}
    assert config(spec(task="embed")) is None
