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


# --------------------------------------------------------------------------- found by the
# volume run (`make fuzz`, bench/fuzz_rows.py): each broke a chunk's commit or read, which
# fails the partition on every retry.


@pytest.fixture
def runner(tokenizer, tmp_path):
    from bench.fuzz_rows import ShardRunner

    return ShardRunner(tmp_path / "shard", tokenizer)


def _errors_written(folder) -> list[dict]:
    import pyarrow.parquet as pq

    found = sorted(folder.glob("out/**/errors-*.parquet"))
    return [row for path in found for row in pq.read_table(path).to_pylist()]


def _chat_line(custom_id: str, content: str) -> bytes:
    # JSON escapes as the bytes say: `\ud800` alone is half a surrogate pair.
    return (
        b'{"custom_id": "' + custom_id.encode() + b'", "url": "/v1/chat/completions", '
        b'"body": {"messages": [{"role": "user", "content": "' + content.encode() + b'"}]}}'
    )


@pytest.mark.parametrize("output_format", ["parquet", "openai_batch"])
def test_a_lone_surrogate_escape_is_quarantined_and_the_chunk_commits(runner, output_format):
    """`"\\ud800"` is valid JSON that decodes to no Unicode text: it reached the errors
    table (UTF-8) and failed the commit with UnicodeEncodeError."""
    shard = {
        "format": "openai_batch",
        "task": "chat",
        "output_format": output_format,
        "engine_text": "x",
        "chunk_size": 8,
        "bad_utf8": False,
        "rows": [
            _chat_line("\\ud800", "hi"),  # in the id
            _chat_line("a", "hi \\udc00 there"),  # in the text
            _chat_line("b", "hi \\ud83d\\ude00"),  # a whole pair: an emoji, kept
        ],
    }
    runner.run(shard)
    assert runner.counts["rows for the engine"] == 1
    errors = _errors_written(runner.folder)
    assert [(e["id"], e["error_type"]) for e in errors] == [
        (None, "invalid_unicode"),
        ("a", "invalid_unicode"),
    ]
    assert "surrogate" in errors[0]["message"] and "line 1" in errors[0]["message"]


def test_parquet_text_bytes_that_are_not_utf8_quarantine_their_row_only(runner):
    """A string column holding bytes that are not UTF-8 (a writer that skipped validation)
    raised UnicodeDecodeError out of the reader: the whole shard failed."""
    shard = {
        "format": "parquet",
        "task": "generate",
        "output_format": "parquet",
        "engine_text": "x",
        "chunk_size": 16,
        "bad_utf8": True,  # the first row's values get a stray 0xff byte
        "rows": [{"id": f"r{i}", "text": f"hello {i}", "params": None} for i in range(3)],
    }
    runner.run(shard)
    assert runner.counts["rows for the engine"] == 2
    errors = _errors_written(runner.folder)
    assert [(e["id"], e["row"], e["error_type"]) for e in errors] == [(None, 0, "invalid_utf8")]
    assert "column 'text'" in errors[0]["message"] and "not UTF-8" in errors[0]["message"]


def test_the_volume_fuzzer_runs_a_small_budget_in_a_child_process(tmp_path):
    """`make fuzz`'s driver, small: its child process runs lines through the whole row path
    and exits 0; the summary counts what it ran."""
    import subprocess
    import sys

    out = tmp_path / "fuzz.json"
    command = [sys.executable, "-m", "bench.fuzz_rows", "--lines", "150", "--workers", "1"]
    done = subprocess.run([*command, "--json", str(out)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads(out.read_text())
    assert summary["worker_deaths"] == 0 and summary["lines"] >= 150
    assert (
        summary["counts"]["rows for the engine"]
        + sum(v for k, v in summary["counts"].items() if k.startswith("quarantined"))
        == summary["lines"]
    )


def test_params_or_messages_json_escaping_half_a_surrogate_pair_quarantine_the_row(runner):
    """A Parquet params or messages column holds JSON text: `"\\ud800"` in it would reach
    the engine's stop strings or chat template as text that is not Unicode."""
    rows = [
        {
            "id": "p",
            "messages": '[{"role": "user", "content": "hi"}]',
            "params": '{"stop": ["\\ud800"]}',
        },
        {"id": "m", "messages": '[{"role": "user", "content": "\\udfff"}]', "params": None},
        {"id": "ok", "messages": '[{"role": "user", "content": "\\ud83d\\ude00"}]', "params": None},
    ]
    shard = {
        "format": "parquet",
        "task": "chat",
        "output_format": "parquet",
        "engine_text": "x",
        "chunk_size": 16,
        "bad_utf8": False,
        "rows": rows,
    }
    runner.run(shard)
    errors = {e["id"]: e for e in _errors_written(runner.folder)}
    assert runner.counts["rows for the engine"] == 1 and set(errors) == {"p", "m"}
    assert errors["p"]["error_type"] == "invalid_unicode"
    assert "surrogate" in errors["m"]["message"]


def test_the_image_reference_fuzzer_answers_every_row(tmp_path):
    """`python -m bench.fuzz_rows --images N`, small: rows of mutated image bytes, data
    URIs, structs, paths and refused URLs through the image decoder; each row is decoded or
    refused with a type, none raises."""
    from bench.fuzz_rows import fuzz_images

    result = fuzz_images(120, seed=3, folder=tmp_path)
    counts = result["counts"]
    refused = sum(v for k, v in counts.items() if k.startswith("refused"))
    assert counts["image rows"] >= 120 and refused + counts["rows decoded"] == counts["image rows"]
