"""`POST /v1/files` read as a stream, under a bound, straight into the file's storage.

Starlette's form parser (which FastAPI's `UploadFile` uses) spools every file part to a
temporary file, whole, before the route runs; the route then read it into memory to size it
(issue 40: an upload over the limit cost 200 MiB + 1 of memory before its 413). Here the
multipart body is parsed chunk by chunk (`python_multipart`, the parser Starlette itself
uses) and the file part's bytes go to the file's storage as they arrive, at most
`FLUSH_BYTES` held at a time; past `max_bytes` the upload stops with a 413 and what was
written is deleted. Everything a refusal can depend on (the filename, the purpose when it
comes first, the announced length) is checked before a byte is written, and the store row
is written before the bytes (status `uploaded` until the last byte is in), so no bytes are
ever left without a row to find and delete them by.
"""

from __future__ import annotations

import functools

import anyio.to_thread
from fastapi import Request
from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header

from dagster_gpuinfer.batch_api.service import ApiError, BatchService, Upload
from dagster_gpuinfer.batch_api.store import Tenant

# Parts a form may hold (file, purpose, and the SDK's optional expires_after fields).
MAX_FORM_PARTS = 8
MAX_FIELD_BYTES = 1024
# Boundaries, part headers and small fields around the file part.
FORM_OVERHEAD_BYTES = 64 * 1024
FLUSH_BYTES = 1024 * 1024


def _bad_form(message: str) -> ApiError:
    return ApiError(
        400,
        f"the upload is not a valid multipart form: {message}; send the file as the form "
        "field 'file' and purpose='batch' (as the openai SDK's files.create does)",
        code="invalid_request",
        param="file",
    )


class MultipartForm:
    """A multipart/form-data body parsed as it is fed: small fields are kept, the one file
    part's bytes are handed out through `take()`, never more than `max_file_bytes` of them.

    Args:
        content_type: The request's Content-Type header (it names the boundary).
        max_file_bytes: The file part's limit; one byte more is a 413.
    """

    def __init__(self, content_type: str, max_file_bytes: int) -> None:
        kind, options = parse_options_header(content_type)
        if kind != b"multipart/form-data" or not options.get(b"boundary"):
            raise _bad_form(f"Content-Type {content_type[:80]!r} is not multipart/form-data")
        self.max_file_bytes = max_file_bytes
        self.fields: dict[str, str] = {}
        self.filename: str | None = None
        self.file_bytes = 0
        self.file_done = False
        self._pending = bytearray()
        self._parts = 0
        self._header = [bytearray(), bytearray()]
        self._disposition = b""
        self._name: str | None = None
        self._field = bytearray()
        self._in_file = False
        self._parser = MultipartParser(
            options[b"boundary"],
            {
                "on_part_begin": self._part_begin,
                "on_header_field": lambda data, start, end: self._header[0].extend(data[start:end]),
                "on_header_value": lambda data, start, end: self._header[1].extend(data[start:end]),
                "on_header_end": self._header_end,
                "on_headers_finished": self._headers_finished,
                "on_part_data": self._part_data,
                "on_part_end": self._part_end,
            },
        )

    def feed(self, chunk: bytes) -> None:
        try:
            self._parser.write(chunk)
        except MultipartParseError as exc:
            raise _bad_form(str(exc)) from None

    def finish(self) -> None:
        self._parser.finalize()
        if self.filename is None:
            raise _bad_form("it has no file part")
        if not self.file_done:
            raise _bad_form("it ended before the file part's closing boundary")

    @property
    def pending_bytes(self) -> int:
        return len(self._pending)

    def take(self) -> bytes:
        """The file bytes received since the last call."""
        data = bytes(self._pending)
        self._pending.clear()
        return data

    def _part_begin(self) -> None:
        self._parts += 1
        if self._parts > MAX_FORM_PARTS:
            raise _bad_form(f"it has more than {MAX_FORM_PARTS} parts")
        self._disposition, self._name, self._in_file = b"", None, False
        self._field.clear()

    def _header_end(self) -> None:
        if bytes(self._header[0]).strip().lower() == b"content-disposition":
            self._disposition = bytes(self._header[1])
        self._header[0].clear()
        self._header[1].clear()

    def _headers_finished(self) -> None:
        _, options = parse_options_header(self._disposition)
        if b"name" not in options:
            raise _bad_form("a part has no Content-Disposition name")
        self._name = options[b"name"].decode("utf-8", "replace")
        if b"filename" not in options:
            return
        if self._name != "file" or self.filename is not None:
            raise _bad_form(f"it has a file part {self._name[:40]!r} besides the one 'file'")
        try:
            self.filename = options[b"filename"].decode("utf-8")
        except UnicodeDecodeError:
            raise _bad_form("the file name is not UTF-8") from None
        self._in_file = True

    def _part_data(self, data: bytes, start: int, end: int) -> None:
        if not self._in_file:
            self._field.extend(data[start:end])
            if len(self._field) > MAX_FIELD_BYTES:
                raise _bad_form(f"field {self._name!r} is over {MAX_FIELD_BYTES} bytes")
            return
        self.file_bytes += end - start
        if self.file_bytes > self.max_file_bytes:
            raise ApiError(
                413,
                f"{self.filename}: more than the limit of {self.max_file_bytes} bytes; split "
                "it into several files (one batch each)",
                code="file_too_large",
                param="file",
            )
        self._pending.extend(data[start:end])

    def _part_end(self) -> None:
        if self._in_file:
            self.file_done = True
        elif self._name is not None:
            self.fields[self._name] = self._field.decode("utf-8", "replace")


async def receive_upload(request: Request, service: BatchService, tenant: Tenant) -> dict:
    """Stream the request's multipart body into a new file; returns the file's row.

    Raises:
        ApiError: 413 over `service.max_bytes` (announced or counted), 400 for a form
            without one 'file' part or with a bad filename or purpose, 429 at the tenant's
            file or byte quota (the announced length is reserved while the bytes come).
    """
    announced = request.headers.get("content-length", "")
    if announced.isdigit() and int(announced) > service.max_bytes + FORM_OVERHEAD_BYTES:
        raise service.refuse_upload(
            tenant,
            ApiError(
                413,
                f"the upload announces {announced} bytes, more than the limit of "
                f"{service.max_bytes} for a file; split it into several files",
                code="file_too_large",
                param="file",
            ),
        )
    upload: Upload | None = None
    try:
        form = MultipartForm(request.headers.get("content-type", ""), service.max_bytes)
        async for chunk in request.stream():
            form.feed(chunk)
            if form.filename is not None and upload is None:
                begin = functools.partial(
                    service.begin_upload,
                    tenant,
                    filename=form.filename,
                    purpose=form.fields.get("purpose"),
                    reserve=int(announced) if announced.isdigit() else 0,
                )
                upload = await anyio.to_thread.run_sync(begin)
            if upload is not None and form.pending_bytes >= FLUSH_BYTES:
                await anyio.to_thread.run_sync(upload.write, form.take())
        form.finish()
        assert upload is not None  # finish() refuses a form without a file part
        await anyio.to_thread.run_sync(upload.write, form.take())
        finish = functools.partial(service.finish_upload, upload, form.fields.get("purpose"))
        return await anyio.to_thread.run_sync(finish)
    except BaseException as exc:
        if upload is not None:
            await anyio.to_thread.run_sync(upload.abandon)
        if isinstance(exc, ApiError):
            raise service.refuse_upload(tenant, exc) from None
        raise
