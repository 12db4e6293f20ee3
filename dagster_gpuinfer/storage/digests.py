"""Input digests: each output row's digest of the input row it was computed from, so that a
backfill estimate can tell, reading only the shard and the earlier output's digest column,
which rows of a changed shard row reuse will copy (`estimate.reuse_counts`).

A Parquet row's digest covers the values the worker reads from it (its payload, parameter
and adapter columns; not its id), in the order named in the part file's schema metadata
(`DIGEST_COLUMNS_KEY`); a JSONL line's covers its bytes (`LINES`: the whole line, id
included, so a renamed line counts as changed: an upper bound). Equal digests under an
unchanged spec and model mean equal reuse keys; the converse need not hold.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Sequence
from typing import Any

INPUT_DIGEST_COLUMN = "input_digest"
REUSE_KEY_COLUMN = "reuse_key"  # each output row's reuse key (`worker/loop/reuse.py`)
# Part files' schema metadata: the input columns the digests cover (JSON list), or LINES;
# and the spec's reuse scope (`InferenceSpec.reuse_scope`) the rows' keys were made under.
DIGEST_COLUMNS_KEY = b"gpuinfer.input_digest_columns"
REUSE_SCOPE_KEY = b"gpuinfer.reuse_scope"
LINES = "<jsonl line>"


def _feed(digest: Any, value: Any) -> None:
    if isinstance(value, bytes | bytearray | memoryview):
        data = b"b" + bytes(value)
    else:
        data = b"r" + repr(value).encode("utf-8", "surrogatepass")
    digest.update(struct.pack("<Q", len(data)) + data)


def row_digest(values: Sequence[Any]) -> str:
    """The digest of one input row's values (as pyarrow's `to_pylist` gives them)."""
    digest = hashlib.blake2b(b"gpuinfer-input-1", digest_size=12)
    for value in values:
        _feed(digest, value)
    return digest.hexdigest()


def line_digest(line: bytes) -> str:
    """The digest of one JSONL line (surrounding whitespace left out)."""
    return row_digest([line.strip()])


def columns_digests(columns: Sequence[Sequence[Any]], rows: int) -> list[str]:
    """Each row's digest over `columns` (one value list per column, each `rows` long)."""
    return [row_digest([column[i] for column in columns]) for i in range(rows)]


def digest_columns_metadata(columns: Sequence[str] | None, scope: str) -> dict[bytes, bytes]:
    """The schema metadata naming what the digests cover (None: JSONL lines) and the
    reuse scope of the rows' keys."""
    covers = LINES if columns is None else list(columns)
    return {DIGEST_COLUMNS_KEY: json.dumps(covers).encode(), REUSE_SCOPE_KEY: scope.encode()}


def digest_columns_of(metadata: dict[bytes, bytes] | None) -> list[str] | str | None:
    """What a part file's digests cover: its column names, LINES, or None (not recorded)."""
    raw = (metadata or {}).get(DIGEST_COLUMNS_KEY)
    return None if raw is None else json.loads(raw)


def reuse_scope_of(metadata: dict[bytes, bytes] | None) -> str | None:
    """The reuse scope a part file's keys were made under, or None (not recorded)."""
    raw = (metadata or {}).get(REUSE_SCOPE_KEY)
    return None if raw is None else raw.decode()
