"""Per-request parameters and structured-output checks, without an engine.

`RequestBuilder` builds real `vllm.SamplingParams` (vLLM's own constructor judges values);
checking against a running engine (`verify`) is covered by tests/test_requests_engine.py.
"""

from __future__ import annotations

import pytest
from pydantic import BaseModel

from dagster_gpuinfer.spec import SamplingParams, StructuredOutputs
from dagster_gpuinfer.worker.rows.readers import RawChunk
from dagster_gpuinfer.worker.rows.request_params import RequestBuilder
from dagster_gpuinfer.worker.tasks.params import ParameterError, parse_params_value
from dagster_gpuinfer.worker.tasks.structured import check_output


def builder(task: str = "chat", **defaults) -> RequestBuilder:
    return RequestBuilder(task=task, defaults=SamplingParams(**defaults).to_vllm_kwargs())


def test_row_parameters_override_the_pipeline_defaults_and_keep_the_rest():
    request = builder(max_tokens=16, temperature=0.5).build(
        {"model": "gpt-4o", "max_completion_tokens": 3, "seed": 7, "stop": "."}
    )
    assert request.sampling.max_tokens == 3
    assert request.sampling.seed == 7
    assert request.sampling.temperature == 0.5  # the pipeline's, the row left it out
    assert request.sampling.stop == ["."]


def test_rows_without_parameters_share_the_pipeline_request():
    build = builder(max_tokens=9)
    assert build.build(None) is build.build({})
    assert build.build(None).sampling.max_tokens == 9


@pytest.mark.parametrize("key", ["guided_json", "tools", "functions", "suffix", "best_of"])
def test_keys_the_platform_does_not_honour_are_named(key):
    with pytest.raises(ParameterError) as caught:
        builder().build({key: {"x": 1}})
    assert caught.value.error_type == "unsupported_parameter"
    assert caught.value.key == key and f"'{key}'" in str(caught.value)


@pytest.mark.parametrize(
    "params, key",
    [
        ({"temperature": -1}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"n": 0}, "n"),
        ({"stream": True}, "stream"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logit_bias": {"abc": 1.0}}, "logit_bias"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
    ],
)
def test_values_vllm_rejects_are_named(params, key):
    with pytest.raises(ParameterError) as caught:
        builder().build(params)
    assert caught.value.error_type == "invalid_parameter"
    assert caught.value.key == key and f"'{key}'" in str(caught.value)


def test_chat_logprobs_map_to_vllms_count():
    request = builder().build({"logprobs": True, "top_logprobs": 4})
    assert request.sampling.logprobs == 4 and request.top_logprobs == 4
    assert builder().build({"logprobs": True}).top_logprobs == 0
    assert builder().build({"logprobs": False}).top_logprobs is None
    assert builder("generate").build({"logprobs": 2}).sampling.logprobs == 2


def test_response_format_becomes_vllms_structured_outputs():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    request = builder().build(
        {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}}
    )
    assert request.sampling.structured_outputs.json == schema
    assert request.constraint == StructuredOutputs(json=schema)
    assert builder().build({"response_format": {"type": "json_object"}}).constraint.json_object
    assert builder().build({"response_format": {"type": "text"}}).constraint is None


def test_pipeline_structured_outputs_take_a_pydantic_model():
    class Ticket(BaseModel):
        title: str
        urgent: bool

    sampling = SamplingParams(structured_outputs={"json": Ticket})
    assert sampling.structured_outputs.json_schema == Ticket.model_json_schema()
    request = RequestBuilder(task="generate", defaults=sampling.to_vllm_kwargs()).build(None)
    assert request.sampling.structured_outputs.json == Ticket.model_json_schema()
    # A row's response_format replaces the pipeline's constraint for that row.
    row = RequestBuilder(task="generate", defaults=sampling.to_vllm_kwargs()).build(
        {"response_format": {"type": "json_object"}}
    )
    assert row.constraint.json_object and row.sampling.structured_outputs.json is None


def test_structured_outputs_take_exactly_one_constraint():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputs(regex="a+", choice=["a"])
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputs()


def test_embedding_and_score_rows_take_only_their_own_keys():
    with pytest.raises(ParameterError, match="'temperature'"):
        builder("embed").build({"temperature": 0.1})
    assert builder("embed").build({"encoding_format": "float", "model": "m"}).sampling is None
    assert builder("score").build({"top_n": 2}).top_n == 2
    with pytest.raises(ParameterError, match="'dimensions'"):
        builder("embed").build({"dimensions": 8})


def test_params_values_may_be_json_text():
    assert parse_params_value('{"max_tokens": 3}') == {"max_tokens": 3}
    assert parse_params_value(None) == {} and parse_params_value("") == {}
    with pytest.raises(ParameterError):
        parse_params_value("[1, 2]")


@pytest.mark.parametrize(
    "constraint, text, valid",
    [
        (StructuredOutputs(json={"type": "object", "required": ["a"]}), '{"a": 1}', True),
        (StructuredOutputs(json={"type": "object", "required": ["a"]}), '{"b": 1}', False),
        (StructuredOutputs(json={"type": "object"}), '{"a": ', False),
        (StructuredOutputs(json_object=True), "[1]", False),
        (StructuredOutputs(json_object=True), "{}", True),
        (StructuredOutputs(regex="[a-z]+ [0-9]{2}"), "abc 12", True),
        (StructuredOutputs(regex="[a-z]+ [0-9]{2}"), "abc 123", False),
        (StructuredOutputs(choice=["yes", "no"]), "yes", True),
        (StructuredOutputs(choice=["yes", "no"]), "maybe", False),
    ],
)
def test_outputs_are_checked_against_their_constraint(constraint, text, valid):
    assert (check_output(constraint, text) is None) is valid


def test_unsupported_row_parameters_quarantine_only_their_row(tiny_llama_dir):
    from transformers import AutoTokenizer

    from dagster_gpuinfer.worker.rows.validate import RowValidator

    validator = RowValidator(
        task="generate",
        tokenizer=AutoTokenizer.from_pretrained(tiny_llama_dir),
        max_model_len=64,
        requests=builder("generate", max_tokens=8),
    )
    chunk = RawChunk(
        index=0,
        source="s.jsonl",
        rows=[(0, "a", "one"), (1, "b", "two"), (2, "c", "three")],
        rows_in=3,
    )
    chunk.params = {1: {"guided_json": {}}, 2: {"max_tokens": 2}}
    out = validator.validate(chunk)
    assert out.ids == ["a", "c"]
    assert [(e.id, e.error_type) for e in out.errors] == [("b", "unsupported_parameter")]
    assert "'guided_json'" in out.errors[0].message
    assert [r.sampling.max_tokens for r in out.requests] == [8, 2]


def test_null_parameters_keep_the_default_as_a_struct_column_gives_them():
    request = builder(max_tokens=9).build({"max_tokens": None, "guided_json": None, "seed": 4})
    assert request.sampling.max_tokens == 9 and request.sampling.seed == 4
