"""The input side of arrivals: the files under a prefix, on local disk or S3, in name order.

Used by the arrival sensor (`sensors.py`) through `arrivals.py`, which keeps the cursor; the
worker never lists prefixes (it reads the files a partition names).
"""

from __future__ import annotations

import os
import posixpath
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs

from dagster_gpuinfer.spec import StorageOptions
from dagster_gpuinfer.storage import filesystem_for, s3_client


@dataclass(frozen=True)
class ListedFile:
    """A file under a listed prefix: its name after the prefix and its size in bytes."""

    name: str
    size: int


class PrefixListing:
    """The files under a prefix, in ascending name order, from any name on; and reads of them.

    The prefix is a directory (`/data/in/`, `s3://bucket/in/`) or a directory plus the start
    of a name (`/data/in/2026-`). Local listings go through `pyarrow.fs` and skip folders
    whose name starts with `.` or `_` (temporary and bookkeeping folders). S3 listings use
    ListObjectsV2 with `StartAfter`, which pyarrow does not offer: S3 lists keys in
    ascending UTF-8 byte order, which is Python's string order, so a name saved in a cursor
    resumes the listing exactly. Reads (`open`) are pyarrow's seekable files, ranged GETs
    on S3.

    Args:
        prefix: Local path, `file://` path or `s3://bucket/prefix` to list under.
        storage: S3 endpoint and region.
        client: The boto3 client to list S3 with (e.g. an `S3Resource`'s); default:
            `s3_client(storage)`.
        credentials: Explicit AWS keys for reads, as in `filesystem_for`.
        page_size: Keys per S3 list request.
    """

    def __init__(
        self,
        prefix: str,
        storage: StorageOptions | None = None,
        *,
        client: Any = None,
        credentials: Mapping[str, str] | None = None,
        page_size: int = 1000,
    ) -> None:
        self.storage = storage or StorageOptions()
        self.credentials = credentials
        self.page_size = page_size
        self.is_s3 = prefix.startswith("s3://")
        if self.is_s3:
            self.bucket, _, self.key_prefix = prefix[len("s3://") :].partition("/")
            if not self.bucket:
                raise ValueError(f"{prefix!r} names no bucket; use s3://bucket/prefix/")
            self.prefix = prefix
            self._client = client
        else:
            local = os.path.abspath(os.path.expanduser(prefix.removeprefix("file://")))
            self.prefix = local + "/" if prefix.endswith(("/", os.sep)) else local
            self.root = self.prefix if self.prefix.endswith("/") else posixpath.dirname(local)

    def list_after(self, start_after: str) -> Iterator[ListedFile]:
        """Files whose name sorts after `start_after` ("" for all), in ascending order."""
        if self.is_s3:
            yield from self._list_s3(start_after)
        else:
            yield from self._list_local(start_after)

    def open(self, name: str) -> pa.NativeFile:
        """A seekable binary file of `name` (after the prefix), e.g. for a Parquet footer."""
        fs, path = filesystem_for(self.prefix + name, self.storage, credentials=self.credentials)
        return fs.open_input_file(path)

    def _list_local(self, start_after: str) -> Iterator[ListedFile]:
        selector = pafs.FileSelector(self.root, recursive=True, allow_not_found=True)
        found = []
        for info in pafs.LocalFileSystem().get_file_info(selector):
            if info.type != pafs.FileType.File or not info.path.startswith(self.prefix):
                continue
            # The folders between the root and the file (string slicing: posixpath.relpath
            # cost more than the rest of the listing together at 100,000 files).
            folders = info.path[len(self.root) :].lstrip("/").split("/")[:-1]
            if folders and any(folder.startswith((".", "_")) for folder in folders):
                continue
            name = info.path[len(self.prefix) :]
            if name > start_after:
                found.append(ListedFile(name, info.size))
        yield from sorted(found, key=lambda listed: listed.name)

    def _list_s3(self, start_after: str) -> Iterator[ListedFile]:
        if self._client is None:
            self._client = s3_client(self.storage)
        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Prefix": self.key_prefix}
        if start_after:
            kwargs["StartAfter"] = self.key_prefix + start_after
        paginator = self._client.get_paginator("list_objects_v2")
        for page in paginator.paginate(**kwargs, PaginationConfig={"PageSize": self.page_size}):
            for item in page.get("Contents", ()):
                key = item["Key"]
                if key.endswith("/"):  # a directory marker, not a file
                    continue
                yield ListedFile(key[len(self.key_prefix) :], int(item["Size"]))
