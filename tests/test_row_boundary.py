"""The row boundary: no single line, whatever its shape, takes down its chunk or partition.

One test per class of hostile line (issue 17), with other instances than the issue's
examples: deep nesting, integers past 64 bits and non-finite floats, fan-out (`n`,
`n` x `top_logprobs`), size before tokenizing, unbounded messages, a line without
`custom_id`, and a request the engine refuses at submit. No engine: readers, the parameter
mapper and the validator are pure, and the streaming loop runs against a fake engine.
"""

from __future__ import annotations

import json
import os
import queue

import pyarrow.parquet as pq
import pytest
from support import write_jsonl

from dagster_gpuinfer import InferenceSpec
from dagster_gpuinfer.spec import SamplingParams
from dagster_gpuinfer.storage import SourceVersion
from dagster_gpuinfer.worker.errors import MESSAGE_LIMIT, RowError, cap_message
from dagster_gpuinfer.worker.loop.engine_loop import serve_chunks
from dagster_gpuinfer.worker.rows.readers import RawChunk, ShardReader
from dagster_gpuinfer.worker.rows.request_params import RequestBuilder
from dagster_gpuinfer.worker.rows.validate import RowValidator
from dagster_gpuinfer.worker.stage_messages import RequestRejected, WorkChunk


def openai_spec(tmp_path, task="chat", **extra) -> InferenceSpec:
    return InferenceSpec.model_validate(
        {
            "model": "/m",
            "task": task,
            "input": {"uri": str(tmp_path / "{partition_key}.jsonl"), "format": "openai_batch"},
            "output": {"root": str(tmp_path / "out"), "asset_name": "a"},
            **extra,
        }
    )


def chat_line(custom_id, **body):
    body.setdefault("messages", [{"role": "user", "content": "hi"}])
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}


def read_rows(spec, lines, tmp_path):
    write_jsonl(tmp_path / "s.jsonl", lines)
    reader = ShardReader(spec, "s")
    reader.preflight()
    (chunk,) = list(reader.chunks(1000))
    return chunk


def builder(**limits) -> RequestBuilder:
    from dagster_gpuinfer.spec import RowLimits

    return RequestBuilder(
        task="chat", defaults=SamplingParams().to_vllm_kwargs(), limits=RowLimits(**limits)
    )


def build_error(build: RequestBuilder, params):
    from dagster_gpuinfer.worker.tasks.params import ParameterError

    with pytest.raises(ParameterError) as caught:
        build.build(params)
    return caught.value


# ------------------------------------------------------------------ deep nesting


def test_deeply_nested_lines_are_quarantined_not_raised(tmp_path):
    spec = openai_spec(tmp_path)
    deep_object = b'{"k":' * 900 + b'"x"' + b"}" * 900  # under json's recursion limit
    lines = [
        chat_line("ok"),
        b'{"custom_id": "lists", "body": {"messages": ' + b"[" * 20000 + b"]" * 20000 + b"}}",
        b'{"custom_id": "dicts", "url": "/v1/chat/completions", "body": {"metadata": '
        + deep_object
        + b"}}",
        chat_line(
            "schema",
            response_format={
                "type": "json_schema",
                "json_schema": {"schema": json.loads('{"items":' * 200 + "{}" + "}" * 200)},
            },
        ),
        chat_line("after"),
    ]
    chunk = read_rows(spec, lines, tmp_path)
    assert chunk.rows_in == 5
    assert [r[1] for r in chunk.rows] == ["ok", "after"]
    errors = {e.id: e.error_type for e in chunk.errors}
    assert errors == {"lists": "too_deep", "dicts": "too_deep", "schema": "too_deep"}


def test_deep_parameters_of_a_params_column_are_quarantined():
    validator = RowValidator(
        task="chat",
        tokenizer=None,
        max_model_len=64,
        requests=builder(max_json_depth=8),
    )
    deep = "[" * 5000 + "]" * 5000
    chunk = RawChunk(
        index=0,
        source="s.jsonl",
        rows=[(0, "a", [{"role": "user", "content": "x"}])],
        rows_in=1,
        params={0: json.dumps({"stop": json.loads("[" * 20 + "]" * 20)}) + " " * 0},
    )
    out = validator.validate(chunk)
    assert [e.error_type for e in out.errors] == ["too_deep"]
    chunk.params = {0: '{"stop": ' + deep + "}"}
    out = validator.validate(chunk)
    assert [e.error_type for e in out.errors] == ["too_deep"]


# ------------------------------------------------------------------ numbers


@pytest.mark.parametrize(
    ("params", "key"),
    [
        ({"seed": 2**63}, "seed"),
        ({"max_tokens": -(2**64) - 5}, "max_tokens"),
        ({"stop_token_ids": [1, 2**90]}, "stop_token_ids"),
        ({"logit_bias": {"5": float("inf")}}, "logit_bias"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_k": 10**30}, "top_k"),
    ],
)
def test_numbers_past_64_bits_or_not_finite_are_refused_before_submit(params, key):
    error = build_error(builder(), params)
    assert error.error_type == "invalid_parameter" and error.key == key


def test_the_largest_64_bit_seed_is_accepted():
    assert builder().build({"seed": 2**63 - 1}).sampling.seed == 2**63 - 1


# ------------------------------------------------------------------ fan-out


def test_n_and_n_times_top_logprobs_are_bounded_by_the_pipelines_limits():
    error = build_error(builder(), {"n": 17})
    assert error.key == "n" and "limits.max_n" in str(error)
    error = build_error(builder(), {"n": 8, "logprobs": True, "top_logprobs": 41})
    assert error.key == "top_logprobs" and "328" in str(error)
    # A pipeline may raise its limits.
    wide = builder(max_n=64, max_n_logprobs=2000)
    request = wide.build({"n": 40, "temperature": 1.0, "logprobs": True, "top_logprobs": 20})
    assert request.sampling.n == 40


def test_pipeline_defaults_past_the_limits_are_refused_with_the_spec(tmp_path):
    with pytest.raises(ValueError, match="limits.max_n"):
        openai_spec(tmp_path, sampling={"n": 40})
    openai_spec(tmp_path, sampling={"n": 40}, limits={"max_n": 40})


# ------------------------------------------------------------------ size


class CountingTokenizer:
    """Token ids from characters; fails the test if a prompt past the limit reaches it."""

    def __init__(self, most_chars: int) -> None:
        self.most_chars = most_chars

    def __len__(self) -> int:
        return 128

    def __call__(self, texts, add_special_tokens=True):
        assert all(len(t) <= self.most_chars for t in texts), "a long prompt was tokenized"
        return {"input_ids": [[ord(c) % 128 for c in t] for t in texts]}

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        return "".join(m["content"] for m in messages)


def test_lines_and_prompts_past_their_size_limits_are_quarantined_before_tokenizing(tmp_path):
    spec = openai_spec(tmp_path, limits={"max_line_bytes": 20000, "max_prompt_chars": 5000})
    long_content = [{"role": "user", "content": "y" * 3000}] * 2  # 6000 characters together
    lines = [
        chat_line("big-line", messages=[{"role": "user", "content": "z" * 30000}]),
        chat_line("long-chat", messages=long_content),
        chat_line("fits", messages=[{"role": "user", "content": "w" * 4000}]),
    ]
    chunk = read_rows(spec, lines, tmp_path)
    assert [(e.id, e.error_type) for e in chunk.errors] == [("big-line", "line_too_long")]
    validator = RowValidator(
        task="chat",
        tokenizer=CountingTokenizer(5000),
        max_model_len=10000,
        requests=RequestBuilder(task="chat", defaults={}, limits=spec.limits),
    )
    out = validator.validate(chunk)
    assert out.ids == ["fits"]
    assert [(e.id, e.error_type) for e in out.errors][-1] == ("long-chat", "prompt_too_long")
    assert "limits.max_prompt_chars=5000" in out.errors[-1].message


def test_a_line_too_long_keeps_its_custom_id_for_its_error_line(tmp_path):
    spec = openai_spec(tmp_path, limits={"max_line_bytes": 100})
    line = json.dumps(chat_line('q"1', messages=[{"role": "user", "content": "a" * 500}]))
    chunk = read_rows(spec, [line.encode()], tmp_path)
    assert [(e.id, e.error_type) for e in chunk.errors] == [('q"1', "line_too_long")]


# ------------------------------------------------------------------ messages and ids


def test_error_messages_are_capped_with_the_bytes_left_out(tmp_path):
    spec = openai_spec(tmp_path)
    lines = [
        chat_line("bias", logit_bias={f"x{i}": 1.0 for i in range(100_000)}),
        chat_line("huge", max_tokens="9" * 1_000_000),
    ]
    chunk = read_rows(spec, lines, tmp_path)
    validator = RowValidator(
        task="chat", tokenizer=CountingTokenizer(100), max_model_len=64, requests=builder()
    )
    out = validator.validate(chunk)
    assert {e.id: e.error_type for e in out.errors} == {
        "bias": "invalid_parameter",
        "huge": "invalid_parameter",
    }
    for error in out.errors:
        assert len(error.message) < MESSAGE_LIMIT + 40
    long = RowError("x", "s", 0, "t", "m" * 10_000)
    assert long.message.endswith(f"... {10_000 - MESSAGE_LIMIT} more bytes")
    assert cap_message("short") == "short"


def test_an_openai_line_without_custom_id_is_quarantined_as_missing_id(tmp_path):
    spec = openai_spec(tmp_path)
    line = chat_line("x")
    del line["custom_id"]
    empty = chat_line("")
    chunk = read_rows(spec, [line, empty, chat_line("y")], tmp_path)
    assert [r[1] for r in chunk.rows] == ["y"]
    assert [e.error_type for e in chunk.errors] == ["missing_id", "missing_id"]


def test_whatever_a_check_raises_for_one_row_quarantines_only_that_row():
    class Breaking(RequestBuilder):
        def _build(self, params):
            if params and params.get("boom"):
                raise KeyError("unforeseen")
            return super()._build(params)

    validator = RowValidator(
        task="chat",
        tokenizer=CountingTokenizer(100),
        max_model_len=64,
        requests=Breaking(task="chat", defaults={}),
    )
    messages = [{"role": "user", "content": "hi"}]
    chunk = RawChunk(
        index=0,
        source="s.jsonl",
        rows=[(0, "a", messages), (1, "b", messages)],
        rows_in=2,
        params={0: {"temperature": 0.5}},
    )
    out = validator.validate(chunk)
    assert out.ids == ["a", "b"]
    chunk.params = {0: {"boom": 1}, 1: {"max_tokens": 3}}
    out = validator.validate(chunk)
    assert out.ids == ["b"]
    assert [(e.id, e.error_type) for e in out.errors] == [("a", "invalid_parameter")]
    assert "KeyError" in out.errors[0].message


# ------------------------------------------------------------------ submit


class _Pooled:
    def __init__(self, token_ids):
        self.prompt_token_ids = token_ids
        self.outputs = type("Data", (), {"data": [float(len(token_ids)), 1.0]})()
        self.finished = True


class FakeEmbedEngine:
    """The streaming loop's view of an engine; refuses prompts holding token 0 at submit."""

    window = 4
    max_num_seqs = 2
    max_model_len = 64
    requests = None

    def __init__(self) -> None:
        self.tokenizer = CountingTokenizer(100)
        self.pending: dict[str, list[int]] = {}

    @property
    def in_flight(self) -> int:
        return len(self.pending)

    def submit(self, request_id, token_ids, params=None):
        if 0 in token_ids:
            raise RequestRejected("the engine refused the request (OverflowError: too big)")
        self.pending[request_id] = token_ids

    def step(self):
        done = [(rid, _Pooled(ids)) for rid, ids in self.pending.items()]
        self.pending.clear()
        return done


def test_a_request_the_engine_refuses_at_submit_quarantines_only_its_row(tmp_path):
    spec = InferenceSpec.model_validate(
        {
            "model": "/m",
            "task": "embed",
            "input": {"uri": str(tmp_path / "{partition_key}.jsonl")},
            "output": {"root": str(tmp_path / "out"), "asset_name": "a"},
        }
    )
    rows = [(i, f"r{i}", text) for i, text in enumerate(["ab", "\x00bad", "cd", "ef", "\x80x"])]
    work: queue.Queue = queue.Queue()
    chunk = RawChunk(0, "s.jsonl", rows=rows, rows_in=len(rows))
    work.put(WorkChunk("s", "att1", chunk, SourceVersion(input="test rows")))
    work.put(None)
    markers = []
    served = serve_chunks(FakeEmbedEngine(), spec, work.get, markers.append)
    assert served == 3
    (message,) = markers
    marker = message.marker
    assert (marker.rows_in, marker.rows_out, marker.rows_errored) == (5, 3, 2)
    (part,) = (tmp_path / "out").rglob(marker.part.name)
    assert pq.read_table(part).column("id").to_pylist() == ["r0", "r2", "r3"]


# ------------------------------------------------------------------ commit race


def test_a_losing_racer_touches_no_file_the_winner_owns(tmp_path):
    import pyarrow as pa

    from dagster_gpuinfer.storage import (
        CommitConflict,
        FileEntry,
        Manifest,
        PartitionOutput,
        commit_partition,
        filesystem_for,
        partition_error_files,
        table_to_parquet_bytes,
        verify_manifest,
        write_file_entry,
    )
    from dagster_gpuinfer.worker.rows.writers import errors_table

    spec = openai_spec(tmp_path)
    where = PartitionOutput.of(spec, "p", source=SourceVersion(input="test rows"))
    fs, path = where.fs, where.path
    fs.create_dir(path)

    def commit(attempt: str, reason: str):
        table = pa.table({"id": ["a"], "text": ["t"]})
        part = write_file_entry(
            fs, path, f"part-{where.spec_hash}-00000-{attempt}.parquet",
            table_to_parquet_bytes(table), 1,
        )  # fmt: skip
        manifest = Manifest(
            partition_key="p", spec_hash=where.spec_hash, source=where.source, model="m",
            task="chat",
            output_format="openai_batch", rows_in=2, rows_out=1, rows_errored=1, parts=[part],
            errors=FileEntry(name="errors.parquet", rows=0, bytes=0, sha256=""),
        )  # fmt: skip
        errors = errors_table([RowError("b", "s", 1, reason, reason)])
        return commit_partition(
            fs, path, manifest, [errors], openai_errors=b"{}\n", attempt=attempt
        )

    winner = commit("w1", "empty_input")
    owned = {name: (tmp_path / "out" / "a" / "p" / name) for name in os.listdir(path)}
    before = {name: file.read_bytes() for name, file in owned.items()}
    with pytest.raises(CommitConflict):
        commit("l2", "another_reason")  # differs: a shared name would show
    where.yield_to(winner, "l2")
    assert {name: file.read_bytes() for name, file in owned.items()} == before
    assert set(os.listdir(path)) == set(owned)
    assert verify_manifest(fs, path, winner) == []
    files = partition_error_files(spec.output, "p")
    assert files["parquet"].endswith(f"errors-{where.spec_hash}-w1.parquet")
    assert files["openai_jsonl"].endswith(f"errors-{where.spec_hash}-w1.jsonl")
    assert filesystem_for(files["parquet"])[0] is not None


# ------------------------------------------------------------------ memory

MEMORY_PROBE = """
import json, resource, sys
from transformers import AutoTokenizer
from dagster_gpuinfer import InferenceSpec
from dagster_gpuinfer.worker.rows.readers import ShardReader
from dagster_gpuinfer.worker.rows.request_params import RequestBuilder
from dagster_gpuinfer.worker.rows.validate import RowValidator

root, model = sys.argv[1], sys.argv[2]
spec = InferenceSpec.model_validate({
    "model": "/m", "task": "chat",
    "input": {"uri": root + "/{partition_key}.jsonl", "format": "openai_batch"},
    "output": {"root": root + "/out", "asset_name": "a"},
})
validator = RowValidator(
    task="chat", tokenizer=AutoTokenizer.from_pretrained(model), max_model_len=256,
    requests=RequestBuilder(task="chat", defaults={}, limits=spec.limits),
)
errors = {}
for chunk in ShardReader(spec, "s").chunks(4):
    for error in validator.validate(chunk).errors:
        errors[error.id] = error.error_type
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"errors": errors, "peak": peak}))
"""


def test_size_and_fan_out_lines_keep_the_worker_under_3_gib(tmp_path, tiny_llama_dir):
    import subprocess
    import sys

    def line(custom_id, content, **body):
        messages = [{"role": "user", "content": content}]
        return json.dumps(chat_line(custom_id, messages=messages, **body)).encode()

    with open(tmp_path / "s.jsonl", "wb") as shard:
        shard.write(line("huge-line", "a b " * 5_000_000) + b"\n")  # 20 MB
        shard.write(line("long-prompt", "word " * 1_500_000) + b"\n")  # 7.5 MB, one prompt
        shard.write(line("fan-out", "hi", n=300, logprobs=True, top_logprobs=20) + b"\n")
    done = subprocess.run(
        [sys.executable, "-c", MEMORY_PROBE, str(tmp_path), tiny_llama_dir],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["errors"] == {
        "huge-line": "line_too_long",
        "long-prompt": "prompt_too_long",
        "fan-out": "invalid_parameter",
    }
    assert report["peak"] < 3 * 2**30, f"peak RSS {report['peak'] / 2**30:.2f} GiB"


def test_a_pipeline_sets_its_own_limits(tmp_path):
    import dagster as dg

    from dagster_gpuinfer import InputSpec, RowLimits, inference_assets

    pipeline = inference_assets(
        name="wide",
        model="/m",
        task="chat",
        input=InputSpec(uri=str(tmp_path / "{partition_key}.jsonl"), format="openai_batch"),
        output_root=str(tmp_path / "out"),
        partitions_def=dg.StaticPartitionsDefinition(["p"]),
        limits=RowLimits(max_n=64, max_line_bytes=1 << 30),
    )
    spec = InferenceSpec.model_validate(pipeline.spec)
    assert (spec.limits.max_n, spec.limits.max_line_bytes) == (64, 1 << 30)
    assert (
        spec.spec_hash()
        != InferenceSpec.model_validate({**pipeline.spec, "limits": {}}).spec_hash()
    )


def test_a_row_error_words_the_quarantine_once():
    error = RowError.quarantined("a", "s.jsonl", 3, "empty_input", "s.jsonl row 3: empty")
    assert error.message == "s.jsonl row 3: empty; the row was quarantined"
    capped = RowError.quarantined("a", "s", 0, "t", "m" * 10_000, prompt_tokens=7)
    assert capped.prompt_tokens == 7 and len(capped.message) < MESSAGE_LIMIT + 40
