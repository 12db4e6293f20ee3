"""Finding new input files and turning them into partition keys, without Dagster.

The arrival sensor (`dagster_gpuinfer.sensors`) is a thin layer over this module:

- `WatchedFiles` reads a pipeline's input template (`s3://bucket/in/{partition_key}.jsonl`)
  as a prefix to list and a suffix to match: the file `s3://bucket/in/2026/a.jsonl` is
  partition `2026/a`.
- A lister (`listing.PrefixListing`, local disk or S3) yields the files under the prefix in
  key order, starting after a given name, so a tick can stop anywhere and the next one go on
  from there.
- `scan_arrivals` walks one page of that listing and keeps the files whose partition is not
  registered yet; `plan_partition_keys` turns them into keys, splitting large files into row
  or byte ranges (`big@rows=0-100000`, `big@bytes=0-67108864`).

Names starting with `.` or `_` are never inputs: they are temporary files of writers that
rename when done, and markers such as `_SUCCESS`. Local writers should write under such a
name and rename, so a half-written file is never registered.

Lists and reads through `dagster_gpuinfer.storage`; never imports torch or vllm.
"""

from __future__ import annotations

import fnmatch
import posixpath
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Literal, Protocol

import pyarrow.parquet as pq

from dagster_gpuinfer.listing import ListedFile
from dagster_gpuinfer.spec import (
    PARTITION_KEY_PLACEHOLDER,
    InputFormat,
    range_partition_key,
    split_partition_key,
    unsafe_partition_key_reason,
)

# Substrings Dagster refuses in partition keys (dagster's INVALID_PARTITION_SUBSTRINGS).
INVALID_KEY_SUBSTRINGS = ("...", "\a", "\b", "\f", "\n", "\r", "\t", "\v", "\0")


class FileLister(Protocol):
    """Lists the files under one prefix in ascending name order (`listing.PrefixListing`)."""

    def list_after(self, start_after: str) -> Iterator[ListedFile]:
        """Files whose name sorts after `start_after` ("" for all), in ascending order."""
        ...

    def open(self, name: str) -> Any:
        """A seekable binary file object for reading the footer of a Parquet file."""
        ...


@dataclass(frozen=True)
class WatchedFiles:
    """Which files belong to a pipeline: the input template's prefix, suffix and a glob.

    Args:
        uri_template: The pipeline's input uri, e.g. `s3://bkt/in/{partition_key}.parquet`.
        glob: `fnmatch` pattern matched against the name after the prefix (`*` matches `/`
            too), e.g. `2026-*/*.parquet`.
    """

    uri_template: str
    glob: str = "*"

    def __post_init__(self) -> None:
        if self.uri_template.count(PARTITION_KEY_PLACEHOLDER) != 1:
            raise ValueError(
                f"input uri {self.uri_template!r} must hold {PARTITION_KEY_PLACEHOLDER} exactly "
                "once to be watched for arrivals, e.g. 's3://bucket/in/{partition_key}.jsonl'"
            )
        if "{" in self.suffix or "}" in self.suffix:
            raise ValueError(
                f"input uri {self.uri_template!r} has a template field after "
                f"{PARTITION_KEY_PLACEHOLDER}; only the file suffix may follow it"
            )

    @cached_property
    def prefix(self) -> str:
        """The uri up to the placeholder: a directory (`s3://bkt/in/`) or a name prefix."""
        return self.uri_template.split(PARTITION_KEY_PLACEHOLDER)[0]

    @cached_property
    def suffix(self) -> str:
        return self.uri_template.split(PARTITION_KEY_PLACEHOLDER)[1]

    def file_key(self, name: str) -> str | None:
        """The partition key of the file `name` (after the prefix), or None if not an input."""
        if not name.endswith(self.suffix) or len(name) == len(self.suffix):
            return None
        if posixpath.basename(name).startswith((".", "_")):
            return None
        if not fnmatch.fnmatchcase(name, self.glob):
            return None
        return name[: len(name) - len(self.suffix)] if self.suffix else name


def refused_key_reason(key: str) -> str | None:
    """Why the file key `key` cannot be a partition key (what to do included), or None."""
    unsafe = unsafe_partition_key_reason(key)
    if unsafe is not None:
        return f"its partition key {key!r} is refused: {unsafe}; rename the file"
    bad = [s for s in INVALID_KEY_SUBSTRINGS if s in key]
    if bad:
        return (
            f"its partition key would contain {bad[0]!r}, which Dagster does not allow in "
            "partition keys; rename the file"
        )
    return None


# --------------------------------------------------------------------------- scanning


@dataclass
class ArrivalScan:
    """What one page of the listing found."""

    new_files: list[ListedFile] = field(default_factory=list)
    next_start_after: str = ""
    listed: int = 0
    reached_end: bool = False
    rejected: list[tuple[str, str]] = field(default_factory=list)


def scan_arrivals(
    lister: FileLister,
    watched: WatchedFiles,
    *,
    start_after: str,
    is_known: Callable[[str], bool],
    max_new_files: int,
    max_listed: int,
    keys_arrive_in_order: bool = False,
) -> ArrivalScan:
    """List from `start_after` until `max_new_files` unknown inputs or `max_listed` files.

    Reaching the end of the listing wraps around: the same call goes on from the beginning
    up to `start_after`, so a file that landed behind the listing position is found by the
    next tick, and a tick that finishes a pass starts the next one from the beginning.

    Args:
        is_known: Whether a file key is registered already (as a whole or in ranges).
        keys_arrive_in_order: New files always sort after older ones (date-stamped names):
            the listing never wraps around and only ever lists after the newest name seen.

    Returns:
        The new files in name order, and where the next page starts.
    """
    scan = ArrivalScan(next_start_after=start_after)

    def visit(arrived: ListedFile) -> bool:
        """Take one listed file; True when this page is full."""
        scan.listed += 1
        scan.next_start_after = arrived.name
        key = watched.file_key(arrived.name)
        if key is not None and not is_known(key):
            refused = refused_key_reason(key)
            if refused is not None:
                scan.rejected.append((arrived.name, refused))
            else:
                scan.new_files.append(arrived)
        return len(scan.new_files) >= max_new_files or scan.listed >= max_listed

    for arrived in lister.list_after(start_after):
        if visit(arrived):
            return scan
    if keys_arrive_in_order:
        scan.reached_end = True
        return scan
    if start_after:
        for arrived in lister.list_after(""):
            if arrived.name > start_after:
                break
            if visit(arrived):
                return scan
    scan.reached_end = True
    scan.next_start_after = ""
    return scan


# --------------------------------------------------------------------------- splitting


@dataclass(frozen=True)
class SplitLargeFiles:
    """Split files of at least `min_bytes` into several partitions.

    JSONL files split into byte ranges of `jsonl_bytes_per_partition` (a line belongs to the
    range holding its first byte), computed from the size alone. Parquet files split into row
    ranges of whole row groups, at least `parquet_rows_per_partition` rows each, read from
    the footer.
    """

    min_bytes: int = 512 * 1024 * 1024
    jsonl_bytes_per_partition: int = 128 * 1024 * 1024
    parquet_rows_per_partition: int = 200_000

    def __post_init__(self) -> None:
        if (
            min(self.min_bytes, self.jsonl_bytes_per_partition, self.parquet_rows_per_partition)
            <= 0
        ):
            raise ValueError("SplitLargeFiles sizes must be positive")


def byte_ranges(size: int, per_partition: int) -> list[tuple[int, int]]:
    """`[start, end)` byte ranges of at most `per_partition` bytes covering `size` bytes."""
    return [(start, min(start + per_partition, size)) for start in range(0, size, per_partition)]


def row_group_ranges(group_rows: list[int], per_partition: int) -> list[tuple[int, int]]:
    """`[start, end)` row ranges of whole row groups, each closed once it holds at least
    `per_partition` rows (the last one may hold fewer)."""
    ranges: list[tuple[int, int]] = []
    start = end = 0
    for rows in group_rows:
        end += rows
        if end - start >= per_partition:
            ranges.append((start, end))
            start = end
    if end > start:
        ranges.append((start, end))
    return ranges


def plan_partition_keys(
    files: list[ListedFile],
    watched: WatchedFiles,
    input_format: InputFormat,
    split: SplitLargeFiles | None,
    lister: FileLister,
) -> list[str]:
    """The partition keys of new files, in listing order: one per file, or one per range."""
    keys: list[str] = []
    for arrived in files:
        key = watched.file_key(arrived.name)
        assert key is not None
        if split is None or arrived.size < split.min_bytes:
            keys.append(key)
            continue
        unit: Literal["rows", "bytes"]
        if input_format == "parquet":
            with lister.open(arrived.name) as handle:
                metadata = pq.ParquetFile(handle).metadata
                group_rows = [
                    metadata.row_group(i).num_rows for i in range(metadata.num_row_groups)
                ]
            ranges, unit = row_group_ranges(group_rows, split.parquet_rows_per_partition), "rows"
        else:
            ranges, unit = byte_ranges(arrived.size, split.jsonl_bytes_per_partition), "bytes"
        if len(ranges) <= 1:
            keys.append(key)
        else:
            keys.extend(range_partition_key(key, unit, start, end) for start, end in ranges)
    return keys


def registered_file_keys(partition_keys: Collection[str]) -> set[str]:
    """The file keys behind registered partitions: `big@rows=0-10` and `big` both mean `big`.

    A file counts as registered once any of its partitions is, so changing the split
    settings never registers a file a second time under other ranges.
    """
    return {split_partition_key(key)[0] for key in partition_keys}
