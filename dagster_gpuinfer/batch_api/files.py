"""Where the batch API keeps file bytes: under one root in the output storage (local disk or
S3, through `dagster_gpuinfer.storage`), beside the batch pipelines' outputs::

    <root>/files/<file id>            uploaded input files and finished output/error files
    <root>/inputs/<batch id>.jsonl    the input shard of one batch (its partition)
    <root>/outputs/<pipeline>/<batch id>/   what the worker writes (manifest, chunk markers)

A batch's input is copied to its own shard when it is created, so deleting the uploaded
file never pulls the rows from under a running batch.
"""

from __future__ import annotations

import os
import posixpath
import uuid
from collections.abc import Iterator

from dagster_gpuinfer.spec import OutputSpec, StorageOptions
from dagster_gpuinfer.storage import (
    Manifest,
    OpenAIBatchFiles,
    delete_quietly,
    filesystem_for,
    partition_dir,
    read_bytes,
    read_manifest,
    read_openai_batch_files,
    write_bytes_atomic,
)

# How much of a file `lines` reads at a time.
READ_BYTES = 1024 * 1024


class FileBytes:
    """File bytes under `root` (a local directory or `s3://bucket/prefix`)."""

    def __init__(self, root: str, storage: StorageOptions | None = None) -> None:
        self.root = root.rstrip("/")
        self.storage = storage or StorageOptions()

    def file_uri(self, file_id: str) -> str:
        return f"{self.root}/files/{file_id}"

    @property
    def input_template(self) -> str:
        """The batch pipelines' input uri: one shard per batch id."""
        return f"{self.root}/inputs/{{partition_key}}.jsonl"

    @property
    def output_root(self) -> str:
        return f"{self.root}/outputs"

    def output_spec(self, pipeline: str) -> OutputSpec:
        return OutputSpec(root=self.output_root, asset_name=pipeline, format="openai_batch")

    def write(self, uri: str, data: bytes) -> None:
        fs, path = filesystem_for(uri, self.storage)
        if not uri.startswith("s3://"):
            fs.create_dir(posixpath.dirname(path), recursive=True)
        write_bytes_atomic(fs, path, data)

    def open_writer(self, uri: str):
        """A stream writing `uri` as it is fed (S3: a multipart upload); close it to finish."""
        fs, path = filesystem_for(uri, self.storage)
        if not uri.startswith("s3://"):
            fs.create_dir(posixpath.dirname(path), recursive=True)
        return fs.open_output_stream(path)

    def read(self, uri: str) -> bytes:
        fs, path = filesystem_for(uri, self.storage)
        return read_bytes(fs, path)

    def stream(self, uri: str) -> tuple[int, Iterator[bytes]]:
        """The file's size and its bytes, `READ_BYTES` at a time (a download: a batch's
        output file can be larger than the service's memory). Opened now, so a file gone
        from the storage raises here, before an answer begins; read as the iterator is
        consumed, and closed when it ends or its consumer closes it."""
        fs, path = filesystem_for(uri, self.storage)
        stream = fs.open_input_stream(path)
        size = fs.get_file_info(path).size

        def chunks() -> Iterator[bytes]:
            with stream:
                while chunk := stream.read(READ_BYTES):
                    yield chunk

        return size, chunks()

    def delete(self, uri: str) -> None:
        fs, path = filesystem_for(uri, self.storage)
        delete_quietly(fs, [path])

    def lines(self, uri: str) -> Iterator[bytes]:
        """The file's lines (split at b"\\n", without it), read `READ_BYTES` at a time:
        the file is never held whole, only the lines of one read (and a line that spans
        reads)."""
        buffer = bytearray()
        for chunk in self.stream(uri)[1]:
            buffer += chunk
            end = buffer.rfind(b"\n")
            if end < 0:
                continue
            yield from bytes(buffer[:end]).split(b"\n")
            del buffer[: end + 1]
        if buffer:
            yield bytes(buffer)

    def copy_batch_input(self, source_uri: str, batch_id: str) -> str:
        """Copy an uploaded file to the batch's input shard inside the storage (S3: one
        server-side copy; local: a copy beside it, then a rename), never through memory."""
        uri = self.input_template.replace("{partition_key}", batch_id)
        fs, source = filesystem_for(source_uri, self.storage)
        _, target = filesystem_for(uri, self.storage)
        if uri.startswith("s3://"):
            fs.copy_file(source, target)
            return uri
        fs.create_dir(posixpath.dirname(target), recursive=True)
        temporary = posixpath.join(posixpath.dirname(target), f".tmp-{uuid.uuid4().hex}")
        fs.copy_file(source, temporary)
        os.replace(temporary, target)
        return uri

    def batch_results(self, pipeline: str, batch_id: str) -> OpenAIBatchFiles:
        return read_openai_batch_files(self.output_spec(pipeline), batch_id, self.storage)

    def batch_manifest(self, pipeline: str, batch_id: str) -> Manifest | None:
        """The `_SUCCESS` manifest of the batch's partition; None until it is committed."""
        fs, path = filesystem_for(partition_dir(self.output_spec(pipeline), batch_id), self.storage)
        return read_manifest(fs, path)
