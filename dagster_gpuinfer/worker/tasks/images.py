"""Image inputs: read a row's image reference, decode it, and check it, ahead of the engine.

A row's image is encoded bytes (a Parquet binary column, or a `{"bytes", "path"}` struct as
Hugging Face datasets write it) or a reference: a `data:` URI, a path relative to the shard's
folder, an absolute local path under `ImageOptions.local_roots`, an `s3://` URI (through the
worker's storage layer), or an `http(s)` URL whose host is allow-listed. Anything else is
refused before a byte is fetched: a URL in a user's data must not make the worker reach
internal addresses (`http://127.0.0.1/...`, a cloud metadata endpoint).

Decoding (Pillow) reads the header first and refuses a decompression bomb
(`ImageOptions.max_image_pixels`) before any pixel is decoded, then loads the whole image (a
truncated file fails here, not in the engine), applies its EXIF orientation, converts it to
RGB (transparency over white) and fits it to `max_side` or refuses it (`oversize`).
`ImageDecoder` runs this in a thread pool sized by the cores (Pillow's codecs release the
GIL), from the worker's read-ahead, so the engine never waits on decoding; a chunk's images
are decoded together, so memory holds the chunks in preparation and in flight, never more.

Every failure is an `ImageFault` with an error type and a message naming the reference and
what to do; the caller makes it that row's fate. Nothing here raises for one bad image.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import http.client
import io
import os
import posixpath
import time
import urllib.error
import urllib.parse
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from PIL import Image, ImageOps, UnidentifiedImageError

from dagster_gpuinfer.image_options import ImageOptions
from dagster_gpuinfer.spec import StorageOptions
from dagster_gpuinfer.storage import filesystem_for
from dagster_gpuinfer.worker.errors import cap_message
from dagster_gpuinfer.worker.tasks.image_fetch import (
    AddressRefused,
    FetchTimedOut,
    GuardedOpener,
    allowed_endpoint,
    fetch_timeout_message,
    read_within,
)

# The error types of image rows (the `error_type` of their quarantine records).
IMAGE_ERROR_TYPES = (
    "no_image",  # the row's image value is null or empty
    "image_undecodable",  # not an image Pillow reads
    "image_truncated",  # the file ends before its pixels do
    "image_bomb",  # more pixels than max_image_pixels (decompression bomb)
    "image_too_big",  # more encoded bytes than max_image_bytes
    "image_too_large",  # a side over max_side with oversize='refuse'
    "too_many_images",  # more images in one request than max_images_per_request
    "image_missing",  # the file or S3 key does not exist
    "image_url_refused",  # a scheme or host the policy does not allow
    "image_fetch_failed",  # an allowed fetch failed (timeout, HTTP error, storage error)
)


class ImageFault(Exception):
    """One image that cannot be used: its row is quarantined with `error_type`."""

    def __init__(self, error_type: str, message: str) -> None:
        super().__init__(cap_message(message, 600))
        self.error_type = error_type
        self.message = cap_message(message, 600)


@dataclass
class DecodedImage:
    """An image ready for the engine (RGB, fitted) and what it cost to get."""

    image: Image.Image
    encoded_bytes: int
    original_size: tuple[int, int]
    # A digest of the encoded bytes: the image's part of its row's reuse key (its pixels
    # follow from the bytes, the pipeline's image options and the model, all in the key).
    digest: str = ""


def describe(ref: Any) -> str:
    """A short name of an image reference for an error message (never its bytes)."""
    if isinstance(ref, bytes | bytearray | memoryview):
        return f"<{len(ref)} image bytes>"
    if isinstance(ref, dict):
        return describe(ref.get("path") or ref.get("bytes"))
    text = str(ref)
    if text.startswith("data:"):
        return text[: text.find(",") + 1 if "," in text[:80] else 40] + "..."
    return cap_message(text, 200)


class ImageSource:
    """Reads the encoded bytes an image reference names, under the URL policy.

    Args:
        options: The pipeline's image options (roots, hosts, byte limit, timeout).
        storage: The pipeline's storage options, for `s3://` references.
        opener: Fetches an allowed http(s) URL (`open(url, timeout)`; tests inject one);
            default `image_fetch.GuardedOpener`: no redirects, public addresses only, one
            deadline for the whole fetch.
    """

    def __init__(
        self,
        options: ImageOptions,
        storage: StorageOptions | None = None,
        *,
        opener: Any = None,
    ) -> None:
        self.options = options
        self.storage = storage
        self.opener = opener or GuardedOpener()

    def read(self, ref: Any, base_uri: str | None = None) -> bytes:
        """The encoded image `ref` names; `base_uri` (the shard) anchors relative paths.

        Raises:
            ImageFault: the reference is empty, refused, missing, too big or unreadable.
        """
        if isinstance(ref, dict):  # Hugging Face datasets' Image struct
            ref = ref.get("bytes") or ref.get("path")
        if ref is None or (isinstance(ref, str | bytes | bytearray) and len(ref) == 0):
            raise ImageFault("no_image", "the row has no image (null or empty)")
        if isinstance(ref, bytes | bytearray | memoryview):
            return self._capped(bytes(ref), describe(ref))
        if not isinstance(ref, str):
            raise ImageFault(
                "no_image",
                f"the image value is a {type(ref).__name__}, not bytes or a URI string",
            )
        scheme = urllib.parse.urlsplit(ref).scheme.lower() if "://" in ref[:16] else ""
        if ref[:5].lower() == "data:":
            return self._data_uri(ref)
        if scheme in ("http", "https"):
            return self._http(ref)
        if scheme == "s3":
            return self._storage(ref, ref)
        if scheme == "file":
            return self._local(ref.removeprefix("file://"), ref)
        if scheme or ":" in ref.split("/", 1)[0]:
            raise ImageFault(
                "image_url_refused",
                f"image {describe(ref)}: scheme {ref.split(':', 1)[0]!r} is not allowed; use "
                "image bytes, data:, s3://, a path, or an allow-listed http(s) host",
            )
        return self._path(ref, base_uri)

    def _capped(self, data: bytes, what: str) -> bytes:
        limit = self.options.max_image_bytes
        if len(data) > limit:
            raise ImageFault(
                "image_too_big",
                f"image {what}: more than images.max_image_bytes={limit} bytes; shrink it or "
                "raise the pipeline's images.max_image_bytes",
            )
        return data

    def _data_uri(self, ref: str) -> bytes:
        header, comma, payload = ref.partition(",")
        if not comma:
            raise ImageFault("image_undecodable", f"image {describe(ref)}: a data: URI without ','")
        if len(payload) * 3 // 4 > self.options.max_image_bytes:
            self._capped(b"\0" * (self.options.max_image_bytes + 1), describe(ref))
        if header.lower().endswith(";base64"):
            try:
                data = base64.b64decode(payload, validate=True)
            except (binascii.Error, ValueError) as exc:
                raise ImageFault(
                    "image_undecodable", f"image {describe(ref)}: bad base64 ({exc})"
                ) from None
        else:
            data = urllib.parse.unquote_to_bytes(payload)
        return self._capped(data, describe(ref))

    def _http(self, ref: str) -> bytes:
        parts = urllib.parse.urlsplit(ref)
        allowed = self.options.allowed_url_hosts
        if not allowed_endpoint(parts, allowed):
            raise ImageFault(
                "image_url_refused",
                f"image {describe(ref)}: host {parts.netloc.rpartition('@')[2]!r} is not in "
                f"images.allowed_url_hosts ({', '.join(allowed) or 'none'}); http(s) images are "
                "fetched only from hosts the pipeline allows (a `name` entry allows the "
                "scheme's default port only; list `name:port` for another port)",
            )
        timeout = self.options.fetch_timeout_seconds
        started = time.monotonic()
        try:
            with self.opener.open(ref, timeout=timeout) as response:
                data = read_within(response, self.options.max_image_bytes, started + timeout)
        except urllib.error.HTTPError as exc:
            kind = "image_missing" if exc.code in (404, 410) else "image_fetch_failed"
            raise ImageFault(kind, f"image {describe(ref)}: HTTP {exc.code}") from None
        except (OSError, ValueError, http.client.HTTPException) as exc:
            raise self._fetch_fault(ref, exc, time.monotonic() - started) from None
        return self._capped(data, describe(ref))

    def _fetch_fault(self, ref: str, exc: Exception, elapsed: float) -> ImageFault:
        reason = getattr(exc, "reason", exc)
        if isinstance(reason, AddressRefused):
            return ImageFault(
                "image_url_refused",
                f"image {describe(ref)}: {reason.host!r} resolves to "
                f"{', '.join(reason.addresses)}, not a public address (loopback, private, "
                "link-local or metadata addresses are never fetched from a listed name); "
                "serve the images from a public host, or list the address itself in "
                "images.allowed_url_hosts if the pipeline must reach it",
            )
        if isinstance(reason, FetchTimedOut) or elapsed >= self.options.fetch_timeout_seconds:
            message = fetch_timeout_message(self.options)
            return ImageFault("image_fetch_failed", f"image {describe(ref)}: {message}")
        return ImageFault("image_fetch_failed", f"image {describe(ref)}: fetch failed ({exc})")

    def _path(self, ref: str, base_uri: str | None) -> bytes:
        if ref.startswith("/"):
            return self._local(ref, ref)
        if base_uri is None:
            raise ImageFault(
                "image_url_refused", f"image {describe(ref)}: a relative path with no shard"
            )
        base = base_uri.removeprefix("file://")
        folder = posixpath.dirname(base) if "://" in base else os.path.dirname(base)
        joined = posixpath.normpath(posixpath.join(folder, ref))
        if "://" in base:  # normpath folds "s3://" to "s3:/"
            joined = base.split("://", 1)[0] + "://" + joined.split(":/", 1)[1].lstrip("/")
        if ".." in ref.split("/") or not joined.startswith(folder.rstrip("/") + "/"):
            raise ImageFault(
                "image_url_refused",
                f"image {describe(ref)}: a relative path must stay under the shard's folder",
            )
        if "://" in joined:
            return self._storage(joined, ref)
        return self._local(joined, ref, shard_folder=folder)

    def _local(self, path: str, ref: str, *, shard_folder: str | None = None) -> bytes:
        """A local file: under `images.local_roots` (absolute paths), or, for a path
        relative to the shard, under the shard's folder once every link is resolved."""
        real = os.path.realpath(path)
        if shard_folder is not None:
            if not _lies_under(real, [os.path.realpath(shard_folder)]):
                raise ImageFault(
                    "image_url_refused",
                    f"image {describe(ref)}: a link in the shard's folder leads out of it; "
                    "relative paths must stay under the shard's folder: copy the image "
                    "there, or use an absolute path under images.local_roots",
                )
        elif not _lies_under(real, [os.path.realpath(r) for r in self.options.local_roots]):
            raise ImageFault(
                "image_url_refused",
                f"image {describe(ref)}: absolute paths must lie under images.local_roots "
                f"({', '.join(self.options.local_roots) or 'none'}); use a path relative "
                "to the shard or add the folder",
            )
        try:
            size = os.path.getsize(real)
            if size > self.options.max_image_bytes:
                return self._capped(b"\0" * (self.options.max_image_bytes + 1), describe(ref))
            with open(real, "rb") as handle:
                return handle.read()
        except FileNotFoundError:
            raise ImageFault("image_missing", f"image {describe(ref)}: no such file") from None
        except OSError as exc:
            raise ImageFault(
                "image_fetch_failed", f"image {describe(ref)}: cannot be read ({exc})"
            ) from None

    def _storage(self, uri: str, ref: str) -> bytes:
        import pyarrow.fs as pafs

        limit = self.options.max_image_bytes
        try:
            fs, path = filesystem_for(uri, self.storage)
            with fs.open_input_stream(path) as stream:
                data = stream.read(limit + 1)
        except (OSError, ValueError) as exc:
            try:
                missing = fs.get_file_info(path).type == pafs.FileType.NotFound  # type: ignore[possibly-undefined]
            except Exception:
                missing = False
            if missing:
                raise ImageFault("image_missing", f"image {describe(ref)}: no such key") from None
            raise ImageFault(
                "image_fetch_failed", f"image {describe(ref)}: storage read failed ({exc})"
            ) from None
        return self._capped(data, describe(ref))


def _lies_under(path: str, roots: list[str]) -> bool:
    return any(path == root or path.startswith(root.rstrip("/") + "/") for root in roots)


def decode_image(data: bytes, options: ImageOptions, what: str = "image") -> DecodedImage:
    """Decode encoded image bytes into an RGB image the model can take.

    Raises:
        ImageFault: not an image, truncated, a decompression bomb, or too large.
    """
    try:
        image = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError as exc:
        raise ImageFault("image_bomb", f"{what}: {exc}") from None
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as exc:
        raise ImageFault(
            "image_undecodable",
            f"{what}: not an image Pillow can read ({type(exc).__name__}: {exc})",
        ) from None
    width, height = image.size
    if width * height > options.max_image_pixels:
        raise ImageFault(
            "image_bomb",
            f"{what}: {width}x{height} = {width * height} pixels is over "
            f"images.max_image_pixels={options.max_image_pixels} (a decompression bomb, or "
            "raise the limit)",
        )
    max_side = options.max_side
    if max_side is not None and max(width, height) > max_side and options.oversize == "refuse":
        raise ImageFault(
            "image_too_large",
            f"{what}: {width}x{height} has a side over images.max_side={max_side}; resize it "
            "or set images.oversize='resize'",
        )
    try:
        if max_side is not None and image.format == "JPEG":
            image.draft("RGB", (max_side, max_side))  # decode at 1/2..1/8 scale when it can
        image.load()
        image = _upright_rgb(image)
    except Image.DecompressionBombError as exc:
        raise ImageFault("image_bomb", f"{what}: {exc}") from None
    except (OSError, ValueError, SyntaxError, EOFError) as exc:
        truncated = "truncated" in str(exc) or isinstance(exc, EOFError)
        raise ImageFault(
            "image_truncated" if truncated else "image_undecodable",
            f"{what}: {'the file is truncated' if truncated else 'its pixels cannot be decoded'}"
            f" ({type(exc).__name__}: {exc})",
        ) from None
    if max_side is not None and max(image.size) > max_side:
        image.thumbnail((max_side, max_side), Image.Resampling.BICUBIC)
    return DecodedImage(
        image=image,
        encoded_bytes=len(data),
        original_size=(width, height),
        digest=hashlib.blake2b(data, digest_size=16).hexdigest(),
    )


def _upright_rgb(image: Image.Image) -> Image.Image:
    """The image turned by its EXIF orientation, in RGB (transparency composed over white)."""
    try:
        image = ImageOps.exif_transpose(image)
    except (ValueError, TypeError, SyntaxError, KeyError):  # a broken EXIF block: keep as is
        pass
    if image.mode in ("RGBA", "LA") or (image.mode == "P" and "transparency" in image.info):
        rgba = image.convert("RGBA")
        canvas = Image.new("RGB", rgba.size, (255, 255, 255))
        canvas.paste(rgba, mask=rgba.getchannel("A"))
        return canvas
    return image if image.mode == "RGB" else image.convert("RGB")


class ImageDecoder:
    """Reads and decodes many image references at once in a thread pool.

    Args:
        options: The pipeline's image options (`decode_threads`: pool size, default cores).
        storage: For `s3://` references.
        source: The reader of references (tests inject one with a fake http opener).
        fit: The model's image processor's own resize (`worker/tasks/image_fit.py`), run on each
            decoded image in the pool, so the render thread finds it at the model's size;
            None leaves decoded images at their size.
    """

    def __init__(
        self,
        options: ImageOptions,
        storage: StorageOptions | None = None,
        *,
        source: ImageSource | None = None,
        fit: Callable[[Image.Image], Image.Image] | None = None,
    ) -> None:
        self.options = options
        self.source = source or ImageSource(options, storage)
        self.fit = fit
        threads = options.decode_threads or os.cpu_count() or 1
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="gpuinfer-image")

    def load(self, ref: Any, base_uri: str | None = None) -> DecodedImage:
        """One reference read and decoded; raises `ImageFault`."""
        data = self.source.read(ref, base_uri)
        decoded = decode_image(data, self.options, f"image {describe(ref)}")
        if self.fit is not None:
            decoded.image = self.fit(decoded.image)
        return decoded

    def _load_or_fault(self, ref: Any, base_uri: str | None) -> DecodedImage | ImageFault:
        try:
            return self.load(ref, base_uri)
        except ImageFault as fault:
            return fault
        except Exception as exc:  # the row boundary: no image fails the shard
            return ImageFault(
                "image_undecodable",
                f"image {describe(ref)}: {type(exc).__name__}: {cap_message(str(exc), 200)}",
            )

    def load_all(
        self, refs: Sequence[Any], base_uri: str | None = None
    ) -> list[DecodedImage | ImageFault]:
        """Each reference decoded, or the fault that stops it, in order."""
        return list(self.pool.map(lambda ref: self._load_or_fault(ref, base_uri), refs))

    def load_groups(
        self, groups: Sequence[Sequence[Any]], base_uri: str | None = None
    ) -> list[list[DecodedImage] | ImageFault]:
        """Each row's images (a row may carry several), or the first fault of the row; a row
        with more than `max_images_per_request` is refused before any of them is read."""
        limit = self.options.max_images_per_request
        flat = [ref for group in groups if len(group) <= limit for ref in group]
        loaded = iter(self.load_all(flat, base_uri))
        out: list[list[DecodedImage] | ImageFault] = []
        for group in groups:
            if len(group) > limit:
                out.append(
                    ImageFault(
                        "too_many_images",
                        f"the request carries {len(group)} images; the model takes at most "
                        f"images.max_images_per_request={limit} (vLLM's limit_mm_per_prompt)",
                    )
                )
                continue
            images = [next(loaded) for _ in group]
            fault = next((i for i in images if isinstance(i, ImageFault)), None)
            out.append(fault if fault is not None else images)  # type: ignore[arg-type]
        return out

    def close(self, *, wait: bool = False) -> None:
        """Stop the pool: queued decodes are cancelled; `wait` joins its threads (a fetch
        under way ends within `fetch_timeout_seconds`)."""
        self.pool.shutdown(wait=wait, cancel_futures=True)


def chat_image_parts(messages: Any) -> tuple[list[Any], list[str]]:
    """OpenAI chat messages with each `image_url` content part replaced by `{"type":
    "image"}` (the placeholder chat templates render), and the parts' URLs in order.

    Accepts `{"type": "image_url", "image_url": {"url": ...}}` and the short form
    `{"type": "image_url", "image_url": "..."}`; other parts and string contents pass as
    they are. Raises `ImageFault` for an `image_url` part without a URL.
    """
    if not isinstance(messages, list):
        return messages, []
    urls: list[str] = []
    out: list[Any] = []
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            out.append(message)
            continue
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "image_url":
                value = part.get("image_url")
                url = value.get("url") if isinstance(value, dict) else value
                if not isinstance(url, str) or not url:
                    raise ImageFault("no_image", "an image_url content part has no url")
                urls.append(url)
                parts.append({"type": "image"})
            else:
                parts.append(part)
        out.append({**message, "content": parts})
    return out, urls
