"""Property-based test of the row contract: random OpenAI batch lines of random shapes, types,
depths and sizes, through the reader, the parameter mapper and the validator (with the real
tiny-llama tokenizer and chat template). Whatever the lines hold, nothing raises, and every
line is answered exactly once: a row for the engine, or a quarantined row with a reason.

The real engine sees a sample of such lines in tests/test_engine_faults.py.
"""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from dagster_gpuinfer import InferenceSpec
from dagster_gpuinfer.spec import RowLimits, SamplingParams
from dagster_gpuinfer.worker.rows.readers import ShardReader
from dagster_gpuinfer.worker.rows.request_params import RequestBuilder
from dagster_gpuinfer.worker.rows.validate import RowValidator, screen_ids
from dagster_gpuinfer.worker.tasks.params import GENERATION_KEYS

LIMITS = RowLimits(max_line_bytes=4096, max_prompt_chars=600, max_json_depth=12)

big_ints = st.one_of(
    st.integers(-5, 50),
    st.integers(-(2**70), 2**70),
    st.sampled_from([2**63 - 1, 2**63, -(2**63), -(2**63) - 1, 10**20]),
)
floats = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, 0.5, 1.0, 2.0])
)
scalars = st.one_of(st.none(), st.booleans(), big_ints, floats, st.text(max_size=30))
json_values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)
regexes = st.sampled_from(
    ["[a-z]+", "(a+)+b", r"\p{L}+", "(?<=x)y", r"(a)\1", "a**", "a(?i)b", r"\z", "[", ".*"]
)
param_values = st.one_of(
    json_values,
    st.builds(lambda r: {"regex": r}, regexes),
    st.builds(
        lambda r: {"type": "json_schema", "json_schema": {"schema": {"pattern": r}}}, regexes
    ),
    st.just({"type": "json_object"}),
)
params = st.dictionaries(
    st.one_of(st.sampled_from(sorted(GENERATION_KEYS | {"model", "tools"})), st.text(max_size=6)),
    param_values,
    max_size=5,
)
contents = st.one_of(st.text(max_size=40), st.text(min_size=590, max_size=700), json_values)
messages = st.one_of(
    st.lists(
        st.fixed_dictionaries(
            {"role": st.sampled_from(["user", "system", "assistant", "robot"]), "content": contents}
        ),
        max_size=3,
    ),
    json_values,
)


def _nested(depth: int) -> str:
    return '{"messages": ' + "[" * depth + "]" * depth + "}"


@st.composite
def lines(draw) -> list[bytes]:
    out: list[bytes] = []
    for index in range(draw(st.integers(1, 12))):
        kind = draw(st.sampled_from(["chat", "chat", "chat", "value", "bytes", "deep"]))
        custom_id = draw(st.one_of(st.just(f"id-{index}"), st.just(f"id-{index}"), scalars))
        if kind == "bytes":
            # Blank lines are not rows (the reader skips them): every drawn line has a byte.
            out.append(b"x" + draw(st.binary(max_size=60)).replace(b"\n", b" "))
            continue
        if kind == "deep":
            body = _nested(draw(st.sampled_from([13, 900, 5000])))
            out.append(
                f'{{"custom_id": {json.dumps(custom_id)}, "url": "/v1/chat/completions", '
                f'"body": {body}}}'.encode()
            )
            continue
        if kind == "value":
            record = draw(json_values)
        else:
            body = {"messages": draw(messages), **draw(params)}
            record = {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions"}
            record["body"] = body
            for key in draw(st.lists(st.sampled_from(["method", "url", "body"]), max_size=1)):
                record.pop(key)
        out.append(json.dumps(record, allow_nan=True).encode())
    return out


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir):
    return AutoTokenizer.from_pretrained(tiny_llama_dir)


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(batch=lines())
def test_every_line_is_answered_exactly_once_whatever_it_holds(batch, tokenizer, tmp_path):
    shard = tmp_path / "s.jsonl"
    shard.write_bytes(b"\n".join(batch) + b"\n")
    spec = InferenceSpec.model_validate(
        {
            "model": "/m",
            "task": "chat",
            "input": {"uri": str(tmp_path / "{partition_key}.jsonl"), "format": "openai_batch"},
            "output": {"root": str(tmp_path / "out"), "asset_name": "a"},
            "limits": LIMITS.model_dump(),
        }
    )
    reader = ShardReader(spec, "s")
    reader.preflight()
    validator = RowValidator(
        task="chat",
        tokenizer=tokenizer,
        max_model_len=256,
        requests=RequestBuilder(
            task="chat", defaults=SamplingParams().to_vllm_kwargs(), limits=LIMITS
        ),
    )
    rows_in = kept = errored = 0
    kept_ids: list[str] = []
    seen: set[str] = set()
    for chunk in reader.chunks(5):
        valid = validator.validate(screen_ids(chunk, seen))  # as the worker: ids screened
        rows_in += chunk.rows_in
        kept += len(valid.ids)
        errored += len(valid.errors)
        kept_ids += valid.ids
        assert len(valid.token_ids) == len(valid.ids) == len(valid.requests)
        for error in valid.errors:
            assert error.error_type and error.message and len(error.message) < 2100
        for request in valid.requests:
            sampling = request.sampling
            assert sampling.n <= LIMITS.max_n
            assert all(
                math.isfinite(v)
                for v in (sampling.temperature, sampling.top_p, sampling.presence_penalty)
            )
    assert rows_in == len(batch)
    assert kept + errored == rows_in
    assert len(kept_ids) == len(set(kept_ids))  # an id reaches the engine once at most
