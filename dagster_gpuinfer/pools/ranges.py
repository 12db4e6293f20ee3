"""Chunk-range leases: a big partition split so that several pool workers share it.

A job's work item is one partition, or one *range* of a partition's chunks (chunk i covers
input rows [i * chunk_size, (i + 1) * chunk_size), as the commit protocol numbers them). The
step splits a partition whose rows it can count cheaply (a Parquet shard's footer) when it
is bigger than the job's *range size* (`range_rows`: about the job's rows over
`RANGES_PER_WORKER` leases per worker of the pool, at least `MIN_RANGE_CHUNKS` chunks), so
that two workers share a big partition instead of one worker running it while the other
idles. Whole partitions stay whole leases: a range only pays off on a big one.

How a range is computed and committed (worker/run/coordinator.py):

- Each range's holder reads the shard from its start and screens ids in shard order (the
  first occurrence of an id wins, as in one run), hands the engine only its own chunks not
  committed yet, and tags each chunk marker with the job (`ChunkMarker.job`).
- The partition's commit (the `_SUCCESS` manifest) is made by the worker that finds every
  chunk of it committed after writing its own: the last range to finish. Its check comes
  after its markers are written, so of ranges finishing together at least the last sees
  them all; two that both see them race on the exclusive manifest, and exactly one
  commits (the other yields, `storage.commit`). A range whose holder dies after its last
  marker and before the commit is leased again; the next holder finds nothing to compute
  and commits. The lease is completed only after this, so a job is done only when each of
  its split partitions was committed or failed by some range.
- The manifest means what a one-worker commit means: the rows, parts and quarantined rows
  of every chunk; as computed, every chunk its job wrote (on any worker, under any lease);
  as resumed, the chunks committed before the job.
- Every range checks that the shard is still the version the step counted
  (`input_version`), so all ranges compute the same rows and the chunk count holds.

The item payload (the contract between the step and the pool worker):
`{"partition_key": key, "chunks": [start, end], "total_chunks": n, "input_version": v}`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# Leases per worker of the pool a job's rows are cut into, about (the balance the ranges
# can reach: the last lease to finish is at most about 1 / this of a worker's share).
RANGES_PER_WORKER = 4
# A range is never smaller than this many chunks (each range reads the shard up to its end).
MIN_RANGE_CHUNKS = 1


@dataclass(frozen=True)
class ChunkRange:
    """Chunks [start, end) of a partition of `total` chunks, as one lease of `job`.

    Attributes:
        start: The first chunk index of the range.
        end: One past its last (at most `total`).
        total: The partition's chunks, as the step counted them.
        input_version: The shard's version when the step counted it
            (`storage.input_version`).
        job: The job whose lease it is (tags the markers the range writes).
    """

    start: int
    end: int
    total: int
    input_version: str
    job: str = ""

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.end <= self.total:
            raise ValueError(
                f"chunk range [{self.start}, {self.end}) of {self.total} chunks is not a "
                "non-empty range of the partition's chunks"
            )

    @property
    def whole(self) -> bool:
        """The range is the whole partition."""
        return self.start == 0 and self.end == self.total

    def payload(self, partition_key: str) -> dict[str, Any]:
        """The work item's payload for this range of `partition_key`."""
        return {
            "partition_key": partition_key,
            "chunks": [self.start, self.end],
            "total_chunks": self.total,
            "input_version": self.input_version,
        }

    @classmethod
    def of_item(cls, payload: Mapping[str, Any], job: str) -> ChunkRange | None:
        """The range an item payload names, or None for a whole-partition item.

        Raises:
            ValueError: the payload names a range that is not one (say which field).
        """
        if "chunks" not in payload:
            return None
        try:
            start, end = (int(v) for v in payload["chunks"])
            return cls(
                start=start,
                end=end,
                total=int(payload["total_chunks"]),
                input_version=str(payload["input_version"]),
                job=job,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(
                f"work item payload {dict(payload)!r} names a chunk range but not a valid one "
                f"({exc}): it needs chunks=[start, end], total_chunks and input_version"
            ) from None


def range_rows(job_rows: int, max_workers: int, chunk_size: int) -> int:
    """Rows per range for a job of `job_rows` rows on a pool of `max_workers` workers: about
    `RANGES_PER_WORKER` leases per worker, in whole chunks, at least `MIN_RANGE_CHUNKS`."""
    per_lease = math.ceil(job_rows / max(1, max_workers * RANGES_PER_WORKER))
    chunks = max(MIN_RANGE_CHUNKS, math.ceil(per_lease / chunk_size))
    return chunks * chunk_size


def split_chunks(rows: int, chunk_size: int, target_rows: int) -> list[tuple[int, int]]:
    """The chunk ranges [start, end) a partition of `rows` rows is leased in: one range when
    it is not bigger than `target_rows`, else `rows / target_rows` ranges (rounded up) of
    about equal chunk counts."""
    total = math.ceil(rows / chunk_size)
    if rows <= target_rows or total <= 1:
        return [(0, max(total, 1))]
    ranges = min(total, math.ceil(rows / target_rows))
    bounds = [round(i * total / ranges) for i in range(ranges + 1)]
    return [(bounds[i], bounds[i + 1]) for i in range(ranges)]
