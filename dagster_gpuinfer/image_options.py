"""How a pipeline's image inputs are read, checked and decoded (`InputSpec.images`).

Both sides import this module (the spec carries it): pydantic and the standard library only.
The worker's `worker/tasks/images.py` applies it; every limit here turns a bad image into a
quarantined row with the limit named, never a failed shard.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class ImageOptions(BaseModel):
    """The URL policy and the decoding limits of a pipeline's image inputs.

    An image reference in a row is one of: encoded bytes (a Parquet binary column, or a
    `{"bytes": ..., "path": ...}` struct as Hugging Face datasets write it); a `data:` URI; a
    path relative to the shard's folder (local or S3); an absolute local path under one of
    `local_roots`; an `s3://` URI (read with the pipeline's storage settings); an
    `http(s)://` URL whose host is in `allowed_url_hosts` (none by default: a URL in a
    user's data must not make the worker fetch internal addresses such as
    `http://127.0.0.1/...` or a cloud metadata endpoint).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    allowed_url_hosts: tuple[str, ...] = Field(
        (),
        description="Hosts the worker may fetch http(s) image URLs from: `name` (the "
        "scheme's default port only, 80 or 443) or `name:port` (that port), exact match. A "
        "listed name is fetched only from the public addresses it resolves to; list an IP "
        "address itself to reach a private one. Empty: http(s) URLs are refused.",
    )
    local_roots: tuple[str, ...] = Field(
        (),
        description="Local folders absolute image paths may lie under. Relative paths "
        "always resolve against the shard's own folder.",
    )
    max_image_bytes: int = Field(
        32 << 20, ge=1, description="Bytes of one encoded image (quarantined as image_too_big)."
    )
    max_image_pixels: int = Field(
        40_000_000,
        ge=1,
        description="Pixels (width x height) of one image, read from its header before "
        "decoding: the decompression-bomb limit (quarantined as image_bomb).",
    )
    max_side: int | None = Field(
        1024,
        ge=1,
        description="Longest side the model takes. A larger image is resized to fit "
        "(oversize='resize', aspect kept) or quarantined (oversize='refuse').",
    )
    oversize: Literal["resize", "refuse"] = Field(
        "resize", description="What a larger image than `max_side` gets."
    )
    max_images_per_request: int = Field(
        1,
        ge=1,
        description="Images one request may carry, vLLM's `limit_mm_per_prompt` for images "
        "(quarantined as too_many_images).",
    )
    fetch_timeout_seconds: float = Field(
        10.0, gt=0, description="Timeout of one allowed http(s) image fetch."
    )
    decode_threads: int | None = Field(
        None,
        ge=1,
        description="Threads decoding images in the read-ahead. Default: the CPU cores.",
    )

    @field_validator("allowed_url_hosts")
    @classmethod
    def _lower_hosts(cls, hosts: tuple[str, ...]) -> tuple[str, ...]:
        for host in hosts:
            if not host or "/" in host or "@" in host or not _port_ok(host):
                raise ValueError(
                    f"allowed_url_hosts entry {host!r} is not a host name: give `name` or "
                    "`name:port` with a port from 1 to 65535, e.g. 'images.example.com' or "
                    "'images.example.com:8443'"
                )
        return tuple(host.lower() for host in hosts)


def _port_ok(entry: str) -> bool:
    """Whether the port of `name:port` / `[v6]:port` is a number from 1 to 65535 (an entry
    without a port, a bare IPv6 address included, has none to check)."""
    if entry.startswith("["):
        rest = entry.partition("]")[2]
        port = rest[1:] if rest.startswith(":") else None
        if rest and port is None:
            return False
    elif entry.count(":") == 1:
        port = entry.split(":")[1]
    else:
        port = None
    return port is None or (port.isascii() and port.isdigit() and 1 <= int(port) <= 65535)
