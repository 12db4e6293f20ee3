"""Row fuzzing at volume: generated input lines through the worker's row path, no engine.

    python -m bench.fuzz_rows --lines 100000 --workers 2 --seed 1 --json bench/results/fuzz.json
    python -m bench.fuzz_rows --images 100000 --workers 2   # image rows' guards instead

Each worker is a child process (as the real worker is one) that runs hypothesis over shards
of generated rows, each shard through what the worker does with it before and after the
engine: `ShardReader.preflight` and `chunks`, `screen_ids`, `RowValidator.validate` (the real
tiny-llama tokenizer and chat template), and `commit.write_chunk` of the chunk with a made-up
engine result (the Parquet or OpenAI batch output part, the quarantined rows' errors table,
the marker). Shards are OpenAI batch JSONL (chat, completions and embeddings lines), plain
JSONL with id/params columns, and Parquet (string columns, some holding bytes that are not
UTF-8); values are random JSON of random depth, sizes, numbers at the edges, lone UTF-16
surrogates, regexes and schemas.

Whatever a shard holds, no exception may leave that path (one would fail the partition on
every retry: a worker death by one line), and every line is answered once: a row for the
engine or a quarantined row. A child that fails prints hypothesis's shrunk example and
exits 1; the parent reports every child's exit status, the lines it ran and their rate.

Why hypothesis and not a coverage-guided fuzzer (atheris): the inputs that matter here are
structured (JSON records whose keys the mapper knows, parameter values at type edges,
nesting, ids across lines); byte mutation of JSON mostly finds the JSON parser's errors, and
hypothesis is already a pinned test dependency, so the slow run and the fast suite share one
generator and every shrunk failure is a readable regression case.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from hypothesis import strategies as st

from dagster_gpuinfer.task_table import TASKS, task_facts

# --------------------------------------------------------------------------- generators

big_ints = st.one_of(
    st.integers(-5, 50),
    st.integers(-(2**70), 2**70),
    st.sampled_from([2**63 - 1, 2**63, -(2**63), -(2**63) - 1, 10**20]),
)
floats = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, 0.5, 1.0, 2.0])
)
# Text, sometimes with lone UTF-16 surrogates (JSON may escape them: "\ud800").
texts = st.one_of(
    st.text(max_size=30),
    st.text(st.one_of(st.characters(), st.characters(categories=["Cs"])), max_size=12),
)
scalars = st.one_of(st.none(), st.booleans(), big_ints, floats, texts)
json_values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
regexes = st.sampled_from(
    ["[a-z]+", "(a+)+b", r"\p{L}+", "(?<=x)y", r"(a)\1", "a**", "a(?i)b", r"\z", "[", ".*", ""]
)
schemas = st.one_of(
    st.builds(lambda r: {"type": "string", "pattern": r}, regexes),
    st.sampled_from([{"type": "object"}, {"type": "integer"}, {"$ref": "#/x"}, {}, True]),
    json_values,
)


def _param_values() -> Any:
    return st.one_of(
        json_values,
        st.builds(lambda r: {"regex": r}, regexes),
        st.builds(lambda s: {"type": "json_schema", "json_schema": {"schema": s}}, schemas),
        st.builds(lambda s: {"json": s}, schemas),
        st.just({"type": "json_object"}),
        st.lists(st.integers(-3, 40_000), max_size=4),
    )


def _params() -> Any:
    from dagster_gpuinfer.worker.tasks.params import EMBEDDING_KEYS, GENERATION_KEYS

    keys = sorted(GENERATION_KEYS | EMBEDDING_KEYS | {"model", "tools", "seed", "n", "logprobs"})
    return st.dictionaries(
        st.one_of(st.sampled_from(keys), st.text(max_size=6)), _param_values(), max_size=5
    )


# Long texts (past limits.max_prompt_chars=600) built from a short one: drawing 600
# characters one by one costs hypothesis more than the whole row path.
long_texts = st.builds(
    lambda t, k: (t or "a") * (k // max(len(t), 1)), texts, st.integers(560, 900)
)
contents = st.one_of(texts, long_texts, json_values)
messages = st.one_of(
    st.lists(
        st.fixed_dictionaries(
            {"role": st.sampled_from(["user", "system", "assistant", "robot"]), "content": contents}
        ),
        max_size=3,
    ),
    json_values,
)
ids = st.one_of(st.just("same"), texts, scalars)
# The tasks fuzzed here, from the task table: those whose rows are text or chat lines of an
# OpenAI endpoint streamed to the engine (score's pairs and image rows have their own tests).
FUZZED = [
    name for name, facts in TASKS.items() if facts.streams and facts.endpoints and not facts.images
]
# Each task's own endpoint and the body field that carries its input (its first in the table).
URL = {name: next(iter(TASKS[name].endpoints)) for name in FUZZED}
BODY_FIELD = {name: TASKS[name].endpoints[URL[name]] for name in FUZZED}
# Payloads by body field: messages lists (chat); otherwise texts and token id lists.
PAYLOADS = {"messages": messages}
TEXT_PAYLOADS = st.one_of(contents, st.lists(st.integers(-2, 40_000), max_size=5))
# Shards' tasks: message lines drawn twice as often (theirs have the most shapes).
SHARD_TASKS = [*FUZZED, *(name for name in FUZZED if BODY_FIELD[name] in PAYLOADS)]


def _payload(draw: Any, task: str) -> Any:
    return draw(PAYLOADS.get(BODY_FIELD[task], TEXT_PAYLOADS))


def _payload_column(task: str) -> str:
    """The Parquet/JSONL column of `task`'s payload: the default of the `InputSpec` field
    its worker entry reads (`text`, chat's `messages`)."""
    from dagster_gpuinfer.spec import InputSpec
    from dagster_gpuinfer.worker.tasks.table import worker_task

    return InputSpec.model_fields[worker_task(task).payload_settings[0]].default


def _encode(draw: Any, record: Any) -> bytes:
    """A record as one line: ASCII JSON (surrogates escaped) or raw UTF-8 (surrogates as
    bytes no UTF-8 decoder takes)."""
    if draw(st.booleans()):
        return json.dumps(record, allow_nan=True).encode()
    text = json.dumps(record, allow_nan=True, ensure_ascii=False)
    return text.encode("utf-8", "surrogatepass")


def _openai_line(draw: Any, task: str, index: int) -> bytes:
    kind = draw(st.sampled_from(["line", "line", "line", "value", "bytes", "deep"]))
    if kind == "bytes":
        return b"x" + draw(st.binary(max_size=60)).replace(b"\n", b" ")
    if kind == "deep":
        depth = draw(st.sampled_from([13, 900, 5000, 100_000]))
        return b'{"custom_id": "d", "body": {"messages": ' + b"[" * depth + b"]" * depth + b"}}"
    if kind == "value":
        return _encode(draw, draw(json_values))
    url = URL[draw(st.sampled_from([task, task, task, *FUZZED]))]
    body = {BODY_FIELD[task]: _payload(draw, task), **draw(_params())}
    record: dict[str, Any] = {
        "custom_id": draw(st.one_of(st.just(f"id-{index}"), ids)),
        "method": "POST",
        "url": draw(st.one_of(st.just(url), texts)),
        "body": draw(st.one_of(st.just(body), json_values)),
    }
    for key in draw(st.lists(st.sampled_from(["method", "url", "body", "custom_id"]), max_size=1)):
        record.pop(key)
    return _encode(draw, record)


def _table_record(draw: Any, task: str, index: int) -> dict[str, Any]:
    column = _payload_column(task)
    params = draw(st.one_of(st.none(), _params(), json_values))
    return {
        "id": draw(st.one_of(st.just(f"id-{index}"), ids)),
        column: _payload(draw, task),
        "params": draw(st.one_of(st.just(params), st.just(json.dumps(params, allow_nan=True)))),
    }


@st.composite
def shards(draw: Any, max_rows: int = 120) -> dict[str, Any]:
    """One shard: its format, task and rows (lines of bytes, or Parquet column values)."""
    fmt = draw(st.sampled_from(["openai_batch", "openai_batch", "jsonl", "parquet"]))
    task = draw(st.sampled_from(SHARD_TASKS))
    count = draw(st.integers(1, max_rows))
    if fmt == "openai_batch":
        rows = [_openai_line(draw, task, i) for i in range(count)]
    elif fmt == "jsonl":
        # The first line sets the shard's columns (a shard without them is refused whole).
        rows = [
            _encode(draw, _table_record(draw, task, i))
            if i == 0 or draw(st.integers(0, 9))
            else _openai_line(draw, task, i)
            for i in range(count)
        ]
    else:
        rows = [_table_record(draw, task, i) for i in range(count)]
    # What an engine answers is text it decoded: never a lone surrogate.
    outputs = st.one_of(
        st.sampled_from(["x", "{}", '{"a": 1}', "", "null", "aab"]), st.text(max_size=30)
    )
    return {
        "format": fmt,
        "task": task,
        "rows": rows,
        "output_format": draw(st.sampled_from(["parquet", "openai_batch"]))
        if fmt == "openai_batch"
        else "parquet",
        "engine_text": draw(outputs),
        "chunk_size": draw(st.sampled_from([3, 16, 64, 256])),
        "bad_utf8": draw(st.booleans()) if fmt == "parquet" else False,
    }


# --------------------------------------------------------------------------- one shard


def _parquet_bytes(shard: dict[str, Any]) -> bytes:
    """The shard's rows as Parquet string columns; with `bad_utf8`, values whose bytes are
    not UTF-8 (surrogates as bytes, and a stray 0xff), as a writer that skips validation
    leaves them."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    def column(values: list[Any]) -> pa.Array:
        raw = [
            None
            if v is None
            else (v if isinstance(v, str) else json.dumps(v, allow_nan=True)).encode(
                "utf-8", "surrogatepass"
            )
            for v in values
        ]
        if not shard["bad_utf8"]:
            return pa.array([None if b is None else b.decode("utf-8", "replace") for b in raw])
        raw = [b"\xff" + b if i == 0 and b is not None else b for i, b in enumerate(raw)]
        return pa.array(raw, pa.binary()).view(pa.string())

    rows = shard["rows"]
    names = list(rows[0])
    table = pa.table({name: column([row[name] for row in rows]) for name in names})
    sink = io.BytesIO()
    pq.write_table(table, sink, row_group_size=max(1, len(rows) // 3))
    return sink.getvalue()


def _spec(shard: dict[str, Any], folder: Path) -> Any:
    from dagster_gpuinfer import InferenceSpec
    from dagster_gpuinfer.spec import RowLimits

    fmt = shard["format"]
    suffix = ".parquet" if fmt == "parquet" else ".jsonl"
    input_spec: dict[str, Any] = {"uri": str(folder / ("{partition_key}" + suffix)), "format": fmt}
    if fmt != "openai_batch":
        input_spec.update(id_column="id", params_column="params")
    limits = RowLimits(max_line_bytes=4096, max_prompt_chars=600, max_json_depth=12)
    return InferenceSpec.model_validate(
        {
            "model": "/m",
            "task": shard["task"],
            "input": input_spec,
            "output": {
                "root": str(folder / "out"),
                "asset_name": "a",
                "format": shard["output_format"],
            },
            "limits": limits.model_dump(),
        }
    )


def _engine_result(task: str, valid: Any, text: str) -> Any:
    """What an engine could answer for the chunk's rows: zero vectors, or `text` as every
    choice of every row."""
    import numpy as np

    from dagster_gpuinfer.worker.stage_messages import ChunkResult

    if task_facts(task).embeds:
        n = len(valid.token_ids)
        return ChunkResult(
            embeddings=np.zeros((n, 4), np.float32),
            prompt_tokens=[len(t) for t in valid.token_ids],
            generated_tokens=[0] * n,
        )
    choices = [
        [
            {
                "index": i,
                "text": text,
                "finish_reason": "stop",
                "generated_tokens": 1,
                "logprobs": None,
                "output_valid": None,
                "output_error": None,
            }
            for i in range(getattr(request.sampling, "n", 1) or 1)
        ]
        for request in valid.requests
    ]
    n = len(valid.ids)
    return ChunkResult(
        texts=[c[0]["text"] for c in choices],
        finish_reasons=["stop"] * n,
        prompt_tokens=[len(t) for t in valid.token_ids[:n]],
        generated_tokens=[len(c) for c in choices],
        cached_tokens=[0] * n,
        choices=choices,
    )


class ShardRunner:
    """Runs shards through the worker's row path and counts what came out."""

    def __init__(self, folder: Path, tokenizer: Any) -> None:
        self.folder = folder
        self.tokenizer = tokenizer
        self.validators: dict[str, Any] = {}
        self.counts: Counter[str] = Counter()

    def validator(self, spec: Any) -> Any:
        from dagster_gpuinfer.spec import SamplingParams
        from dagster_gpuinfer.worker.rows.request_params import RequestBuilder
        from dagster_gpuinfer.worker.rows.validate import RowValidator

        if spec.task not in self.validators:
            defaults = SamplingParams().to_vllm_kwargs() if task_facts(spec.task).samples else {}
            self.validators[spec.task] = RowValidator(
                task=spec.task,
                tokenizer=self.tokenizer,
                max_model_len=256,
                requests=RequestBuilder(task=spec.task, defaults=defaults, limits=spec.limits),
            )
        return self.validators[spec.task]

    def write(self, shard: dict[str, Any]) -> Any:
        import shutil

        shutil.rmtree(self.folder, ignore_errors=True)
        self.folder.mkdir(parents=True)
        spec = _spec(shard, self.folder)
        if shard["format"] == "parquet":
            (self.folder / "s.parquet").write_bytes(_parquet_bytes(shard))
        else:
            (self.folder / "s.jsonl").write_bytes(b"\n".join(shard["rows"]) + b"\n")
        return spec

    def run(self, shard: dict[str, Any]) -> None:
        """One shard through reader, validator and commit; raises on any broken promise."""
        from dagster_gpuinfer.worker.commit import partition_reading, write_chunk
        from dagster_gpuinfer.worker.errors import ShardError
        from dagster_gpuinfer.worker.rows.readers import ShardReader
        from dagster_gpuinfer.worker.rows.validate import screen_ids

        spec = self.write(shard)
        reader = ShardReader(spec, "s")
        try:
            reader.preflight()
        except ShardError as exc:  # refused whole before any engine starts, by design
            assert "no column" in str(exc), exc
            self.counts["shards refused at preflight"] += 1
            return
        validator = self.validator(spec)
        where = partition_reading(spec, "s", model=None)
        seen: set[str] = set()
        rows_in = kept = 0
        kept_ids: list[str] = []
        for chunk in reader.chunks(shard["chunk_size"]):
            valid = validator.validate(screen_ids(chunk, seen))
            assert len(valid.ids) + len(valid.errors) == chunk.rows_in
            for error in valid.errors:
                assert error.error_type and error.message, error
                self.counts[f"quarantined: {error.error_type}"] += 1
            result = _engine_result(spec.task, valid, shard["engine_text"])
            marker = write_chunk(spec, where, chunk, valid, result, "fuzz")
            assert marker.rows_out == len(valid.ids) and marker.rows_in == chunk.rows_in
            rows_in += chunk.rows_in
            kept += len(valid.ids)
            kept_ids += valid.ids
        assert rows_in == len(shard["rows"]), (rows_in, len(shard["rows"]))
        assert len(kept_ids) == len(set(kept_ids))
        self.counts["lines"] += rows_in
        self.counts["rows for the engine"] += kept
        self.counts["shards"] += 1
        self.counts[f"shards: {shard['format']} {shard['task']}"] += 1


# --------------------------------------------------------------------------- image rows


def _base_images() -> list[bytes]:
    """Small real images in the formats Pillow reads, to mutate."""
    import io

    from PIL import Image

    out = []
    for fmt, mode in (
        ("PNG", "RGBA"),
        ("JPEG", "RGB"),
        ("GIF", "P"),
        ("BMP", "RGB"),
        ("WEBP", "RGB"),
    ):
        sink = io.BytesIO()
        Image.new(mode, (23, 17), 7).save(sink, format=fmt)
        out.append(sink.getvalue())
    return out


def _mutated(base: bytes, edits: list[tuple[int, int]], cut: int) -> bytes:
    data = bytearray(base)
    for position, value in edits:
        data[position % len(data)] = value
    return bytes(data[: max(cut, 0) or len(data)])


def image_groups(bases: list[bytes]) -> Any:
    """Rows of image references as an image task reads them: bytes (real images with bytes
    changed or cut off), data URIs, datasets structs, paths inside and outside the shard's
    folder, URLs of hosts not allowed, and values that are no image at all."""
    import base64

    image_bytes = st.builds(
        _mutated,
        st.sampled_from(bases),
        st.lists(st.tuples(st.integers(0, 4096), st.integers(0, 255)), max_size=6),
        st.integers(-20, 400),
    )
    refs = st.one_of(
        image_bytes,
        st.builds(lambda b: "data:image/png;base64," + base64.b64encode(b).decode(), image_bytes),
        st.builds(
            lambda b, t: f"data:{t};base64," + base64.b64encode(b).decode(),
            st.binary(max_size=40),
            texts,
        ),
        st.builds(lambda b, p: {"bytes": b, "path": p}, st.one_of(st.none(), image_bytes), texts),
        st.sampled_from(
            [
                "img/a.png",
                "../secret.png",
                "/etc/passwd",
                "file:///etc/passwd",
                "img/../../x.png",
                "img/none.png",
            ]
        ),
        st.builds(
            lambda h, p: f"http://{h}/{p}",
            st.sampled_from(["169.254.169.254", "localhost", "example.com", "[::1]"]),
            texts,
        ),
        texts,
        scalars,
    )
    return st.lists(st.lists(refs, max_size=4), min_size=1, max_size=8)


def fuzz_images(rows: int, seed: int, folder: Path) -> dict[str, Any]:
    """Hypothesis over rows of image references through `ImageDecoder.load_groups` (no URL
    host allowed, so nothing leaves the machine) until `rows` rows have run: every row gets
    its images or one fault with a type and a message; nothing raises."""
    import hypothesis
    from hypothesis import HealthCheck, given, settings

    from dagster_gpuinfer.spec import ImageOptions
    from dagster_gpuinfer.worker.tasks.images import DecodedImage, ImageDecoder, ImageFault

    (folder / "img").mkdir(parents=True, exist_ok=True)
    bases = _base_images()
    (folder / "img" / "a.png").write_bytes(bases[0])
    decoder = ImageDecoder(
        ImageOptions(
            max_side=64, max_image_pixels=4_000_000, max_images_per_request=4, decode_threads=2
        )
    )
    counts: Counter[str] = Counter()

    def check(groups: list[list[Any]]) -> None:
        for group, result in zip(
            groups, decoder.load_groups(groups, str(folder / "s.parquet")), strict=True
        ):
            if isinstance(result, ImageFault):
                assert result.error_type and result.message, result
                counts[f"refused: {result.error_type}"] += 1
            else:
                assert len(result) == len(group) and all(
                    isinstance(i, DecodedImage) for i in result
                )
                counts["rows decoded"] += 1
            counts["image rows"] += 1

    started, rounds = time.perf_counter(), 0
    try:
        while counts["image rows"] < rows:
            test = settings(
                max_examples=100,
                deadline=None,
                database=None,
                suppress_health_check=list(HealthCheck),
            )(given(groups=image_groups(bases))(check))
            hypothesis.seed(seed * 1_000_003 + rounds)(test)()
            rounds += 1
    finally:
        decoder.close()
    seconds = time.perf_counter() - started
    return {
        "seed": seed,
        "seconds": round(seconds, 1),
        "rows_per_second": round(counts["image rows"] / seconds, 1),
        "counts": dict(sorted(counts.items())),
    }


# --------------------------------------------------------------------------- processes


def fuzz(lines: int, seed: int, folder: Path, crash_file: Path | None = None) -> dict[str, Any]:
    """Hypothesis over shards until `lines` lines have run; rounds of up to 100 examples
    (fewer near the end: shards held 36 rows on average in the recorded run), round r
    seeded `seed * 1_000_003 + r`. Raises hypothesis's shrunk failure if any shard breaks
    the path (after writing that shard to `crash_file`)."""
    import hypothesis
    from hypothesis import HealthCheck, given, settings
    from transformers import AutoTokenizer

    from assets.models import make_tiny_llama
    from assets.paths import generation_model_dir

    runner = ShardRunner(
        folder, AutoTokenizer.from_pretrained(make_tiny_llama(generation_model_dir()))
    )

    def check(shard: dict[str, Any]) -> None:
        try:
            runner.run(shard)
        except BaseException:
            if crash_file is not None:
                crash_file.write_text(repr(shard))
            raise

    started = time.perf_counter()
    rounds = 0
    while runner.counts["lines"] < lines:
        test = given(shard=shards())(check)
        test = settings(
            max_examples=min(100, max(3, (lines - runner.counts["lines"]) // 36)),
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        )(test)
        hypothesis.seed(seed * 1_000_003 + rounds)(test)()
        rounds += 1
    seconds = time.perf_counter() - started
    return {
        "seed": seed,
        "rounds": rounds,
        "seconds": round(seconds, 1),
        "lines_per_second": round(runner.counts["lines"] / seconds, 1),
        "counts": dict(sorted(runner.counts.items())),
    }


def child(args: argparse.Namespace) -> int:
    import traceback

    report = Path(args.report)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            if args.images:
                result = fuzz_images(args.images, args.seed, Path(tmp))
            else:
                result = fuzz(
                    args.lines, args.seed, Path(tmp) / "shard", report.with_suffix(".crash")
                )
    except BaseException as exc:  # a broken promise: hypothesis's shrunk example, in full
        failure = "".join(traceback.format_exception(exc))
        report.write_text(json.dumps({"seed": args.seed, "failure": failure}, indent=2))
        print(failure, file=sys.stderr)
        return 1
    report.write_text(json.dumps(result, indent=2))
    return 0


def run_children(lines: int, workers: int, seed: int, images: int = 0) -> dict[str, Any]:
    """`workers` child processes sharing `lines`; their exit statuses and reports."""
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        procs = []
        for i in range(workers):
            report = Path(tmp) / f"worker-{i}.json"
            share = -(-lines // workers)
            command = [sys.executable, "-m", "bench.fuzz_rows", "--child", "--lines", str(share)]
            command += ["--seed", str(seed + i), "--report", str(report)]
            if images:
                command += ["--images", str(-(-images // workers))]
            procs.append((subprocess.Popen(command, env=os.environ.copy()), report))
        children = []
        for proc, report in procs:
            status = proc.wait()
            body = json.loads(report.read_text()) if report.exists() else {}
            crash = report.with_suffix(".crash")
            if status != 0 and crash.exists():
                body["crash_shard"] = crash.read_text()
            children.append({"exit_status": status, **body})
    seconds = time.perf_counter() - started
    total: Counter[str] = Counter()
    for report in children:
        total.update(report.get("counts", {}))
    return {
        "command": "python -m bench.fuzz_rows " + " ".join(sys.argv[1:]),
        "workers": workers,
        "seconds": round(seconds, 1),
        "lines": total["lines"],
        "lines_per_second": round(total["lines"] / seconds, 1),
        "image_rows": total["image rows"],
        "worker_deaths": sum(1 for c in children if c["exit_status"] != 0),
        "counts": dict(sorted(total.items())),
        "children": children,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.fuzz_rows")
    parser.add_argument("--lines", type=int, default=100_000, help="lines to run, all workers")
    parser.add_argument("--workers", type=int, default=2, help="child processes")
    parser.add_argument("--seed", type=int, default=1, help="worker i runs seed + i")
    parser.add_argument("--json", help="also write the summary to this JSON file")
    parser.add_argument(
        "--images",
        type=int,
        default=0,
        help="instead of lines: this many rows of image references through the image decoder",
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--report", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(args)
    summary = run_children(args.lines, args.workers, args.seed, args.images)
    for child_report in summary["children"]:
        if child_report["exit_status"]:
            print(child_report.get("failure", ""), child_report.get("crash_shard", ""))
    print(json.dumps({k: v for k, v in summary.items() if k != "children"}, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
    return 1 if summary["worker_deaths"] else 0


if __name__ == "__main__":
    sys.exit(main())
