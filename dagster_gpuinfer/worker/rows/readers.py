"""Streaming shard readers: Parquet, JSONL and OpenAI Batch API JSONL, local or S3.

A reader yields `RawChunk`s of exactly `chunk_size` input rows (the last one shorter), so
chunk boundaries depend only on the file and the chunk size: a restarted worker cuts the
same chunks and can skip the committed ones. Memory is bounded by one chunk, never the shard.

A partition whose key ends in a range (`big@rows=0-100000`, `big@bytes=0-67108864`; see
`dagster_gpuinfer.spec.ShardRange`) reads only that part of its file: Parquet rows through the
row groups that overlap the range, JSONL lines by number, or JSONL lines whose first byte lies
in the byte range (so consecutive byte ranges cover every line exactly once).

A Delta Lake table scan (`input.format="delta"`) reads the partition's data files, as the
table's log lists them now, in path order, as one Parquet shard: the same chunks, ranges,
ids and row guards as a Parquet file (`storage.delta`).

Rows that cannot even be parsed (a JSONL line that is not JSON, not UTF-8, longer than
`limits.max_line_bytes`, nested deeper than `limits.max_json_depth`, or an OpenAI batch line
for an endpoint the task does not serve) are returned as errors of their chunk, never
raised: one bad row does not fail the shard, whatever the parser meets in it. A shard that
cannot be read at all, or lacks a required column, raises `ShardError`, which fails the
partition fast.
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
from pydantic import ValidationError

from dagster_gpuinfer.spec import InferenceSpec, split_partition_key
from dagster_gpuinfer.storage import display_uri, filesystem_for
from dagster_gpuinfer.storage.delta import DeltaUnavailable, table_partition
from dagster_gpuinfer.storage.digests import columns_digests, line_digest
from dagster_gpuinfer.worker.errors import (
    SURROGATE_ESCAPE,
    RowError,
    ShardError,
    cap_message,
    lone_surrogate_in,
)
from dagster_gpuinfer.worker.tasks.openai_batch import ENDPOINTS as OPENAI_ENDPOINTS
from dagster_gpuinfer.worker.tasks.openai_batch import BatchRequestLine
from dagster_gpuinfer.worker.tasks.stages import OpenAIRequest
from dagster_gpuinfer.worker.tasks.table import worker_task

# Body fields that carry a score/rerank request's input (the rest are parameters).
SCORE_BODY_FIELDS = frozenset(
    {"text_1", "text_2", "queries", "documents", "data_1", "data_2", "query"}
)

# The custom_id of a line too long to parse, found in its first bytes (as OpenAI's files
# write it: near the start), so its error line still answers it.
CUSTOM_ID_NEAR_START = re.compile(rb'"custom_id"\s*:\s*"((?:[^"\\]|\\.){1,512})"')


def json_depth_exceeds(value: Any, limit: int) -> bool:
    """Whether `value` (parsed JSON) nests lists/objects deeper than `limit`; iterative, so
    any depth is safe to ask about."""
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            children: Any = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children)
    return False


def column_values(table: pa.Table, name: str, broken: dict[int, str]) -> list[Any]:
    """The column's values; a value whose string bytes are not UTF-8 (a writer that skipped
    validation) is None, its row added to `broken` with the column's name."""
    column = table.column(name)
    try:
        return column.to_pylist()
    except UnicodeDecodeError:
        pass
    values: list[Any] = []
    for i in range(len(column)):
        try:
            values.append(column[i].as_py())
        except UnicodeDecodeError:
            values.append(None)
            broken.setdefault(i, name)
    return values


@dataclass
class RawChunk:
    """One chunk of input rows, before validation.

    `rows` holds `(row number, id, payload)` for the rows that parsed; `payload` is a string
    for embed/generate, a messages value for chat, a `(query, document)` tuple or a score
    body for score (validated later). `params` holds the per-request parameters of the rows
    that carry any, by row number (an OpenAI line's body minus its input; the
    `input.params_column` value). `adapters` holds the `input.adapter_column` values that
    are not null, by row number. `errors` holds the rows of this chunk that failed to
    parse. `rows_in` counts both.
    """

    index: int
    source: str
    rows: list[tuple[int, str | None, Any]] = field(default_factory=list)
    errors: list[RowError] = field(default_factory=list)
    rows_in: int = 0
    params: dict[int, Any] = field(default_factory=dict)
    adapters: dict[int, Any] = field(default_factory=dict)
    shard_uri: str | None = None  # the shard's file: image paths relative to it resolve there
    # Each parsed row's input digest, by row number, and the columns it covers (None: the
    # JSONL line): written beside its output for the backfill estimate (`storage.digests`).
    digests: dict[int, str] = field(default_factory=dict)
    digest_columns: list[str] | None = None


class ShardReader:
    """Opens one shard and checks it can be read before any model is loaded."""

    def __init__(self, spec: InferenceSpec, partition_key: str) -> None:
        self.spec = spec
        self.partition_key = partition_key
        self.uri = spec.input.shard_uri(partition_key)
        self.format = spec.input.resolved_format()
        self.range = spec.input.shard_range(partition_key)
        self.fs, self.path = filesystem_for(self.uri, spec.storage)
        self.source = display_uri(self.fs, self.path) + (self.range.suffix() if self.range else "")
        # A Delta table's partition: its data files, found when first needed.
        self.table_files: list[str] | None = None
        if spec.input.is_table():
            where = f"[{spec.input.partition_column}={self._table_value()}]"
            self.source = (
                display_uri(self.fs, self.path)
                + where
                + (self.range.suffix() if self.range else "")
            )
        self.task = worker_task(spec.task)
        # The columns carrying the payload; several (score: text and pair) zip into tuples.
        self.payload_columns = self.task.payload_columns(spec.input)
        # Payload columns a shard may lack (image_embed's text): read as nulls.
        self.optional_columns = {
            getattr(spec.input, setting) for setting in self.task.optional_payload_settings
        }

    # ------------------------------------------------------------------ preflight

    def preflight(self) -> None:
        """Fail fast, before any engine starts, when the shard cannot serve this spec."""
        if self.spec.input.is_table():
            self._preflight_table()
            return
        try:
            info = self.fs.get_file_info(self.path)
        except OSError as exc:
            raise ShardError(
                f"shard {self.source} of partition {self.partition_key!r} cannot be reached: "
                f"{exc}. Check the input uri and storage credentials",
                partition_key=self.partition_key,
            ) from exc
        if info.type != pafs.FileType.File:
            raise ShardError(
                f"shard {self.source} of partition {self.partition_key!r} does not exist. "
                f"Check input.uri ({self.spec.input.uri!r}) or register only partitions whose "
                "files exist",
                partition_key=self.partition_key,
            )
        if self.range is not None and self.range.unit == "bytes" and self.range.end > info.size:
            raise ShardError(
                f"shard {self.source} of partition {self.partition_key!r} asks for bytes up to "
                f"{self.range.end} but the file holds {info.size}: it changed after it was split. "
                "Register the file's partitions again (delete them and let the sensor re-add them)",
                partition_key=self.partition_key,
            )
        if self.format == "parquet":
            self._preflight_parquet()
        else:
            self._preflight_jsonl()

    def _required_columns(self) -> list[str]:
        columns = list(self.payload_columns)
        if self.spec.input.params_column:
            columns.append(self.spec.input.params_column)
        if self.spec.input.adapter_column:
            columns.append(self.spec.input.adapter_column)
        if self.spec.input.id_column:
            columns.insert(0, self.spec.input.id_column)
        return columns

    def _missing_column_error(self, missing: list[str], present: list[str]) -> ShardError:
        return ShardError(
            f"shard {self.source} has no column {', '.join(repr(m) for m in missing)} "
            f"(columns: {', '.join(present) or 'none'}). Set input.id_column / "
            f"{' / '.join(f'input.{setting}' for setting in self.task.payload_settings)}"
            f"{' / input.params_column' if self.spec.input.params_column else ''}"
            f"{' / input.adapter_column' if self.spec.input.adapter_column else ''} to the "
            "right names",
            partition_key=self.partition_key,
        )

    def _table_value(self) -> str:
        """The value of the table's partition column this partition reads."""
        return split_partition_key(self.partition_key)[0]

    def _parquet_files(self) -> list[tuple[pafs.FileSystem, str]]:
        """The Parquet files of the shard, in order: its one file, or a table partition's."""
        if not self.spec.input.is_table():
            return [(self.fs, self.path)]
        if self.table_files is None:
            self.table_files = list(self._table_partition().files)
        return [filesystem_for(uri, self.spec.storage) for uri in self.table_files]

    def _table_partition(self) -> Any:
        column = self.spec.input.partition_column or ""
        try:
            return table_partition(self.uri, self.spec.storage, column, self._table_value())
        except FileNotFoundError as exc:
            raise ShardError(
                f"shard {self.source} of partition {self.partition_key!r} is not there ({exc}). "
                "Register only partitions whose values the table holds",
                partition_key=self.partition_key,
            ) from None
        except (ValueError, DeltaUnavailable) as exc:
            raise ShardError(str(exc), partition_key=self.partition_key) from None
        except Exception as exc:  # delta-rs: the log or the storage cannot be read
            raise ShardError(
                f"shard {self.source} of partition {self.partition_key!r} cannot be read: "
                f"{type(exc).__name__}: {cap_message(str(exc), 300)}",
                partition_key=self.partition_key,
            ) from None

    def _preflight_table(self) -> None:
        self.table_files = list(self._table_partition().files)
        self._preflight_parquet()

    def _preflight_parquet(self) -> None:
        num_rows = 0
        try:
            for index, (fs, path) in enumerate(self._parquet_files()):
                with fs.open_input_file(path) as handle:
                    parquet = pq.ParquetFile(handle)
                    if index == 0:
                        schema = parquet.schema_arrow
                    num_rows += parquet.metadata.num_rows
        except (pa.ArrowInvalid, OSError) as exc:
            raise ShardError(
                f"shard {self.source} is not a readable Parquet file: {exc}",
                partition_key=self.partition_key,
            ) from exc
        if self.range is not None and self.range.end > num_rows:
            raise ShardError(
                f"shard {self.source} of partition {self.partition_key!r} asks for rows up to "
                f"{self.range.end} but the file holds {num_rows}: it changed after it was split. "
                "Register the file's partitions again (delete them and let the sensor re-add them)",
                partition_key=self.partition_key,
            )
        missing = [c for c in self._required_columns() if c not in schema.names]
        missing = [c for c in missing if c not in self.optional_columns]
        if missing:
            raise self._missing_column_error(missing, schema.names)

    def _preflight_jsonl(self) -> None:
        """The first parseable line decides the columns of a JSONL shard."""
        if self.format == "openai_batch":
            return
        for line in self._lines():
            try:
                first = json.loads(line)
            except (ValueError, UnicodeDecodeError):
                continue
            if isinstance(first, dict):
                missing = [c for c in self._required_columns() if c not in first]
                missing = [c for c in missing if c not in self.optional_columns]
                if missing:
                    raise self._missing_column_error(missing, list(first))
            return

    # ------------------------------------------------------------------ streaming

    def chunks(self, chunk_size: int) -> Iterator[RawChunk]:
        if self.format in ("parquet", "delta"):
            yield from self._parquet_chunks(chunk_size)
        else:
            yield from self._jsonl_chunks(chunk_size)

    def _parquet_chunks(self, chunk_size: int) -> Iterator[RawChunk]:
        id_column = self.spec.input.id_column
        pending: list[pa.RecordBatch] = []
        pending_rows = 0
        index = 0
        row = self.range.start if self.range is not None else 0
        for batch in self._parquet_batches(chunk_size):
            pending.append(batch)
            pending_rows += batch.num_rows
            while pending_rows >= chunk_size:
                table = pa.Table.from_batches(pending)
                head, tail = table.slice(0, chunk_size), table.slice(chunk_size)
                yield self._parquet_chunk(index, row, head, id_column)
                index += 1
                row += head.num_rows
                pending = tail.to_batches()
                pending_rows = tail.num_rows
        if pending_rows:
            yield self._parquet_chunk(index, row, pa.Table.from_batches(pending), id_column)

    def _parquet_batches(self, chunk_size: int) -> Iterator[pa.RecordBatch]:
        """The shard's rows in range, in order, across its files (one, or a table
        partition's), never empty batches; the columns a chunk needs only."""
        required = self._required_columns()
        offset = 0  # rows of the shard's files before this one
        for fs, path in self._parquet_files():
            with fs.open_input_file(path) as handle:
                parquet = pq.ParquetFile(handle)
                file_rows = parquet.metadata.num_rows
                if self.range is None:
                    start, end = 0, file_rows
                else:
                    start = max(self.range.start - offset, 0)
                    end = min(self.range.end - offset, file_rows)
                offset += file_rows
                if end <= start:
                    continue
                names = parquet.schema_arrow.names
                columns = [c for c in required if c in names or c not in self.optional_columns]
                row_groups, skip, take = self._row_groups_in_range(parquet, start, end)
                for batch in parquet.iter_batches(
                    batch_size=chunk_size, columns=columns, row_groups=row_groups
                ):
                    if skip:
                        dropped = min(skip, batch.num_rows)
                        batch, skip = batch.slice(dropped), skip - dropped
                    batch, take = batch.slice(0, take), take - min(take, batch.num_rows)
                    if batch.num_rows:
                        yield batch
                    if take == 0:
                        break

    @staticmethod
    def _row_groups_in_range(
        parquet: pq.ParquetFile, start: int, end: int
    ) -> tuple[list[int], int, int]:
        """The row groups of the file holding its rows `[start, end)`, how many leading rows
        of those groups to drop, and how many rows to keep."""
        metadata = parquet.metadata
        groups: list[int] = []
        first_row = None
        group_start = 0
        for group in range(metadata.num_row_groups):
            group_end = group_start + metadata.row_group(group).num_rows
            if group_end > start and group_start < end:
                groups.append(group)
                if first_row is None:
                    first_row = group_start
            group_start = group_end
        first_row = start if first_row is None else first_row
        return groups, start - first_row, end - start

    def _parquet_chunk(
        self, index: int, first_row: int, table: pa.Table, id_column: str | None
    ) -> RawChunk:
        broken: dict[int, str] = {}  # row in chunk -> a column whose bytes are not UTF-8
        columns = [
            column_values(table, name, broken)
            if name in table.column_names
            else [None] * len(table)
            for name in self.payload_columns
        ]
        payloads = columns[0] if len(columns) == 1 else list(zip(*columns, strict=True))
        if id_column:
            ids = [None if v is None else str(v) for v in column_values(table, id_column, broken)]
        else:
            ids = [self._default_id(first_row + i) for i in range(table.num_rows)]
        chunk = RawChunk(index=index, source=self.source, rows_in=len(table), shard_uri=self.uri)
        chunk.digest_columns = [c for c in self._required_columns() if c != id_column]
        read = dict(zip(self.payload_columns, columns, strict=True))
        values = [
            read[name] if name in read else column_values(table, name, broken)
            for name in chunk.digest_columns
        ]
        chunk.digests = {
            first_row + i: digest
            for i, digest in enumerate(columns_digests(values, table.num_rows))
        }
        for column, by_row in (
            (self.spec.input.params_column, chunk.params),
            (self.spec.input.adapter_column, chunk.adapters),
        ):
            if column:
                for i, value in enumerate(column_values(table, column, broken)):
                    if value is not None and i not in broken:
                        by_row[first_row + i] = value
        for i in range(table.num_rows):
            if i not in broken:
                chunk.rows.append((first_row + i, ids[i], payloads[i]))
                continue
            chunk.errors.append(
                RowError.quarantined(
                    None if broken[i] == id_column else ids[i],
                    self.source,
                    first_row + i,
                    "invalid_utf8",
                    f"{self.source} row {first_row + i}: column {broken[i]!r} holds bytes "
                    "that are not UTF-8 in a string column; rewrite the file with valid text "
                    "(or store the value as binary)",
                )
            )
        return chunk

    def _default_id(self, row: int) -> str:
        return f"{self.partition_key}:{row}"

    def _lines(self) -> Iterator[bytes]:
        """Non-blank lines of this partition's part of the file, streamed in blocks."""
        if self.range is None:
            yield from self._all_lines()
        elif self.range.unit == "rows":
            yield from itertools.islice(self._all_lines(), self.range.start, self.range.end)
        else:
            yield from self._lines_in_bytes(self.range.start, self.range.end)

    def _lines_in_bytes(self, start: int, end: int, block_size: int = 1 << 20) -> Iterator[bytes]:
        """Non-blank lines whose first byte lies in `[start, end)`.

        A line that begins before `start` belongs to the previous range, however far it
        reaches; the last line that begins before `end` is read to its newline. Consecutive
        ranges therefore cover every line of the file exactly once.
        """
        with self.fs.open_input_file(self.path) as handle:
            offset = max(start - 1, 0)  # file offset of buffer[0]
            handle.seek(offset)
            buffer = b""
            pos = 0
            if start > 0:  # skip the end of the line that began before `start`
                while True:
                    block = handle.read(block_size)
                    if not block:
                        return
                    newline = block.find(b"\n")
                    if newline >= 0:
                        buffer, offset = block[newline + 1 :], offset + newline + 1
                        break
                    offset += len(block)
            while offset + pos < end:
                newline = buffer.find(b"\n", pos)
                if newline < 0:
                    block = handle.read(block_size)
                    if not block:
                        if buffer[pos:].strip():
                            yield buffer[pos:]
                        return
                    buffer, offset, pos = buffer[pos:] + block, offset + pos, 0
                    continue
                line = buffer[pos:newline]
                pos = newline + 1
                if line.strip():
                    yield line

    def _all_lines(self) -> Iterator[bytes]:
        """The file's non-blank lines. A line longer than `limits.max_line_bytes` is cut to
        its first `max_line_bytes + 1` bytes while it is read (the rest is skipped, never
        held), so however long a line is, memory holds at most the limit of it."""
        keep = self.spec.limits.max_line_bytes + 1
        with self.fs.open_input_stream(self.path) as stream:
            rest: list[bytes] = []  # the pieces of the line read so far
            held = 0
            while True:
                block = stream.read(1 << 20)
                if not block:
                    break
                lines = block.split(b"\n")
                last = lines.pop()
                for line in lines:
                    if rest:
                        line = b"".join(rest) + line[: keep - held]
                        rest, held = [], 0
                    line = line[:keep]
                    if line.strip():
                        yield line
                if held < keep and last:
                    rest.append(last[: keep - held])
                    held += len(rest[-1])
            line = b"".join(rest)
            if line.strip():
                yield line

    def _jsonl_chunks(self, chunk_size: int) -> Iterator[RawChunk]:
        chunk = RawChunk(index=0, source=self.source, shard_uri=self.uri)
        # Row numbers count from the file's first line, except in a byte range, where they
        # count from the range's first line (the source names the range).
        first_row = self.range.start if self.range and self.range.unit == "rows" else 0
        for row, line in enumerate(self._lines(), start=first_row):
            if chunk.rows_in == chunk_size:
                yield chunk
                chunk = RawChunk(index=chunk.index + 1, source=self.source, shard_uri=self.uri)
            chunk.rows_in += 1
            try:
                parsed = self._parse_line(row, line)
            except Exception as exc:  # the row boundary: nothing in one line fails the shard
                parsed = RowError.quarantined(
                    None,
                    self.source,
                    row,
                    "invalid_request",
                    f"{self.source} line {row + 1}: could not be read "
                    f"({type(exc).__name__}: {cap_message(str(exc), 200)})",
                )
            if isinstance(parsed, RowError):
                chunk.errors.append(parsed)
            else:
                row_params = parsed[3] if len(parsed) > 3 else None
                if row_params:
                    chunk.params[row] = row_params
                if len(parsed) > 4 and parsed[4] is not None:
                    chunk.adapters[row] = parsed[4]
                chunk.rows.append(parsed[:3])
                chunk.digests[row] = line_digest(line)
        if chunk.rows_in:
            yield chunk

    def _parse_line(self, row: int, line: bytes) -> tuple[Any, ...] | RowError:
        limits = self.spec.limits
        if len(line) > limits.max_line_bytes:
            return RowError.quarantined(
                self._custom_id_near_start(line),
                self.source,
                row,
                "line_too_long",
                f"{self.source} line {row + 1}: more than "
                f"limits.max_line_bytes={limits.max_line_bytes} bytes; shorten the line or raise "
                "the pipeline's limits.max_line_bytes",
            )
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as exc:
            return RowError.quarantined(
                None,
                self.source,
                row,
                "invalid_utf8",
                f"{self.source} line {row + 1}: not valid UTF-8 ({exc.reason} at byte {exc.start})",
            )
        try:
            record = json.loads(text)
        except RecursionError:
            record = None
            too_deep = True
        except ValueError as exc:
            return RowError.quarantined(
                None,
                self.source,
                row,
                "invalid_json",
                f"{self.source} line {row + 1}: not valid JSON ({exc})",
            )
        else:
            too_deep = json_depth_exceeds(record, limits.max_json_depth)
        if too_deep:
            return RowError.quarantined(
                self._custom_id_near_start(line),
                self.source,
                row,
                "too_deep",
                f"{self.source} line {row + 1}: JSON nested deeper than "
                f"limits.max_json_depth={limits.max_json_depth} levels; flatten it or raise "
                "the pipeline's limits.max_json_depth",
            )
        if SURROGATE_ESCAPE.search(line) and lone_surrogate_in(record):
            return self._lone_surrogate_error(row, record)
        if not isinstance(record, dict):
            return RowError.quarantined(
                None,
                self.source,
                row,
                "invalid_json",
                f"{self.source} line {row + 1}: a JSON {type(record).__name__}, not an object",
            )
        if self.format == "openai_batch":
            return self._parse_openai_request(row, record)
        id_column = self.spec.input.id_column
        row_id = self._default_id(row) if id_column is None else record.get(id_column)
        values = tuple(record.get(name) for name in self.payload_columns)
        payload = values[0] if len(values) == 1 else values
        params_column = self.spec.input.params_column
        params = record.get(params_column) if params_column else None
        adapter_column = self.spec.input.adapter_column
        adapter = record.get(adapter_column) if adapter_column else None
        return (row, None if row_id is None else str(row_id), payload, params, adapter)

    def _lone_surrogate_error(self, row: int, record: Any) -> RowError:
        """A line whose JSON escapes half a UTF-16 surrogate pair (`"\\ud800"`): its text is
        not Unicode, so no output or error file could hold it. The error keeps the line's id
        when the id itself is clean."""
        id_key = "custom_id" if self.format == "openai_batch" else self.spec.input.id_column
        if id_key is None:
            return self._surrogate_row_error(row, self._default_id(row))
        row_id = record.get(id_key) if isinstance(record, dict) else None
        if row_id is not None and not isinstance(row_id, (dict, list)):
            row_id = str(row_id)
            row_id = None if lone_surrogate_in(row_id) else cap_message(row_id, 512) or None
        else:
            row_id = None
        return self._surrogate_row_error(row, row_id)

    def _surrogate_row_error(self, row: int, row_id: str | None) -> RowError:
        return RowError.quarantined(
            row_id,
            self.source,
            row,
            "invalid_unicode",
            f"{self.source} line {row + 1}: escapes half of a UTF-16 surrogate pair (a "
            "\\uD800-\\uDFFF escape without its partner), which is not Unicode text; write "
            "the text as UTF-8, or escape both halves of the pair",
        )

    def _custom_id_near_start(self, line: bytes) -> str | None:
        """An OpenAI line's custom_id, found without parsing the line (too long, too deep)."""
        if self.format != "openai_batch":
            return None
        found = CUSTOM_ID_NEAR_START.search(line, 0, 65536)
        if found is None:
            return None
        try:
            custom_id = json.loads(b'"' + found.group(1) + b'"')
        except ValueError:
            return None
        return custom_id or None

    def _parse_openai_request(self, row: int, record: dict[str, Any]) -> OpenAIRequest:
        custom_id = record.get("custom_id")
        row_id = None if custom_id is None or custom_id == "" else cap_message(str(custom_id), 512)
        url = record.get("url")
        body = record.get("body")
        if row_id is None:
            return RowError.quarantined(
                None,
                self.source,
                row,
                "missing_id",
                f"{self.source} line {row + 1}: no custom_id; every OpenAI batch line needs a "
                "non-empty custom_id",
            )
        try:
            BatchRequestLine.model_validate(record)
        except ValidationError as exc:
            error = exc.errors(include_input=False)[0]
            where = ".".join(str(p) for p in error["loc"]) or "line"
            return RowError.quarantined(
                row_id,
                self.source,
                row,
                "invalid_request",
                f"{self.source} line {row + 1}: not an OpenAI batch request line: {where}: "
                f"{error['msg']}",
            )
        endpoint = OPENAI_ENDPOINTS.get(url) if isinstance(url, str) else None
        if endpoint is None:
            return RowError.quarantined(
                row_id,
                self.source,
                row,
                "unsupported_url",
                f"{self.source} line {row + 1}: url {url!r} is not supported; use one of "
                f"{', '.join(OPENAI_ENDPOINTS)}",
            )
        if url not in self.task.facts.endpoints:
            return RowError.quarantined(
                row_id,
                self.source,
                row,
                "unsupported_url",
                f"{self.source} line {row + 1}: url {url} asks for task {endpoint[0]!r} but "
                f"this pipeline runs {self.spec.task!r}",
            )
        return self.task.openai_request(self, row, row_id, url, body)

    def score_request(self, row: int, row_id: str, url: str, body: Any) -> OpenAIRequest:
        """A score or rerank line's pairs (`pooling_tasks.parse_score_payload` reads them)
        and its parameters, or the `RowError` of a body with no pairs."""
        if not isinstance(body, dict) or not SCORE_BODY_FIELDS & set(body):
            return RowError.quarantined(
                row_id,
                self.source,
                row,
                "invalid_request",
                f"{self.source} line {row + 1}: body has neither text_1/text_2 (score) nor "
                "query/documents (rerank)",
            )
        payload = {k: v for k, v in body.items() if k in SCORE_BODY_FIELDS}
        if url.endswith("rerank") and "query" not in payload:
            payload["query"] = None
        params = {k: v for k, v in body.items() if k not in SCORE_BODY_FIELDS}
        return (row, row_id, payload, params)

    def body_field_request(
        self, row: int, row_id: str, body: Any, body_field: str
    ) -> OpenAIRequest:
        """A line's input (its body's `body_field`) and the rest of the body as parameters,
        or the `RowError` of a body without it."""
        if not isinstance(body, dict) or body_field not in body:
            return RowError.quarantined(
                row_id,
                self.source,
                row,
                "invalid_request",
                f"{self.source} line {row + 1}: body has no {body_field!r}",
            )
        params = {k: v for k, v in body.items() if k != body_field}
        return (row, row_id, body[body_field], params)
