"""Names and label values of the objects a launch creates: the run's identity, pod names
(DNS labels) and label values (63 characters, hashed when longer), from any user string.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass

LABEL_NAME = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")


@dataclass(frozen=True)
class RunIdentity:
    """Which Dagster run, step attempt and launch a pod belongs to.

    Attributes:
        run_id: The Dagster run id.
        asset_key: The output asset, as a user string (`prefix/name`).
        job_name: The Dagster job.
        retry_number: Dagster's step retry number (0 on the first attempt).
        launch_attempt: Launches within one step attempt (1 after an out-of-memory step-down).
    """

    run_id: str
    asset_key: str
    job_name: str | None = None
    retry_number: int = 0
    launch_attempt: int = 0


# --------------------------------------------------------------------------- names and labels


def _short_hash(text: str, length: int = 10) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:length]


def _hashed_label(readable: str, original: str) -> str:
    """`readable` cleaned to label characters and cut to fit a hash of `original` after it."""
    digest = _short_hash(original)
    head = re.sub(r"[^A-Za-z0-9._-]+", "-", readable)[: 63 - len(digest) - 1]
    head = re.sub(r"^[^A-Za-z0-9]+|[^A-Za-z0-9]+$", "", head)
    return f"{head}-{digest}" if head else digest


def label_value(text: str) -> str:
    """`text` as a valid label value: at most 63 of `[A-Za-z0-9._-]`, alphanumeric at both ends.

    A value that had to change (invalid characters, too long) gets a hash of the original
    appended, so two different inputs never share a label value.
    """
    if LABEL_NAME.match(text) and len(text) <= 63:
        return text
    return _hashed_label(text, text)


def dns_label(text: str, max_length: int = 63) -> str:
    """`text` as a DNS-1123 label (lowercase alphanumerics and `-`), at most `max_length`."""
    cleaned = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")
    cleaned = re.sub(r"-{2,}", "-", cleaned)[:max_length].strip("-")
    return cleaned or _short_hash(text, 8)


def worker_pod_name(identity: RunIdentity) -> str:
    """`gpuinfer-<asset>-<run id>-r<retry>-a<launch>`: unique per launch, stable per input."""
    asset = dns_label(identity.asset_key.replace("/", "-"), 24)
    run = dns_label(identity.run_id.replace("-", ""), 12)
    return f"gpuinfer-{asset}-{run}-r{identity.retry_number}-a{identity.launch_attempt}"


def partition_label(partition_keys: list[str]) -> str:
    """One label value for the run's partitions: the key itself when there is one valid
    key, else a readable `first..last` with a hash of the full list."""
    if not partition_keys:
        return "none"
    if len(partition_keys) == 1:
        return label_value(partition_keys[0])
    readable = f"{partition_keys[0]}..{partition_keys[-1]}"
    return _hashed_label(readable, json.dumps(partition_keys))
