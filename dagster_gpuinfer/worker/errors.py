"""Errors of the worker, split by what a retry can change.

`ShardError` and `SpecError` are the user's to fix (a missing file, a missing column, a model
directory that is not there): retrying cannot help, so the control plane turns them into a
non-retryable Dagster `Failure`. Anything else that escapes the worker (an engine crash, a
killed process, a storage hiccup) is treated as transient and left to Dagster's retries.
`RowError` is not an exception: it is a quarantined row with its reason.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

# The most characters of a message kept in an error file, a Pipes message or a log line: a
# row's own text (a 100k-entry `logit_bias`, a megabyte of `max_tokens`) never makes a
# megabyte message.
MESSAGE_LIMIT = 2000


def cap_message(message: str, limit: int = MESSAGE_LIMIT) -> str:
    """`message`, cut at `limit` characters with "... N more bytes" saying what was cut."""
    if len(message) <= limit:
        return message
    rest = len(message[limit:].encode("utf-8", "replace"))
    return f"{message[:limit]}... {rest} more bytes"


# A UTF-16 surrogate code point: JSON may escape one ("\ud800") without its pair, and Python
# decodes it into a str that no UTF-8 writer (Parquet, the errors table) can encode.
LONE_SURROGATE = re.compile("[\ud800-\udfff]")
# The only way a line of valid UTF-8 bytes can carry one: a \uD800-\uDFFF escape.
SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def lone_surrogate_in(value: Any) -> bool:
    """Whether parsed JSON holds a lone surrogate in any string or key; iterative, so any
    depth is safe to ask about. (A pair escaped in JSON decodes to one code point.)"""
    stack = [value]
    while stack:
        node = stack.pop()
        if isinstance(node, str):
            if LONE_SURROGATE.search(node):
                return True
        elif isinstance(node, dict):
            stack.extend(node.keys())
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return False


def utf8_safe(text: str | None) -> str | None:
    """`text` as it can be written as UTF-8: any lone surrogate as its `\\udXXX` escape."""
    if text is None or not LONE_SURROGATE.search(text):
        return text
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


class WorkerError(Exception):
    """An error the user must fix; not retried."""

    error_type = "worker_error"

    def __init__(self, message: str, *, partition_key: str | None = None) -> None:
        super().__init__(cap_message(message))
        self.partition_key = partition_key


class ShardError(WorkerError):
    """A shard cannot be processed at all: unreadable, missing, or missing a column."""

    error_type = "bad_shard"


class SpecError(WorkerError):
    """The job spec cannot run: unknown model directory, invalid arguments."""

    error_type = "bad_spec"


class Drained(Exception):
    """SIGTERM stopped the run after its chunks in flight were committed (not the user's to
    fix, and not a crash of the work: a rerun resumes from the committed chunks)."""


class EngineDied(Exception):
    """An engine process died under the worker (a killed executor worker, an engine core that
    crashed): not the user's to fix; the worker exits `lifecycle.EXIT_ENGINE_DIED` (75) and a
    retry resumes from the committed chunks."""


def engine_death_in(exc: BaseException) -> BaseException | None:
    """The engine's death in `exc` or the exceptions it was raised from or during: vLLM's
    `EngineDeadError` (matched by name: the worker's lower rooms never import vLLM) or
    `EngineDied`; None when there is none."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, EngineDied) or type(current).__name__ == "EngineDeadError":
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


# How every row error ends that is not about a row kept instead (`duplicate_id`).
QUARANTINED = "the row was quarantined"


@dataclass(frozen=True)
class RowError:
    """One quarantined input row: which row, why, and what to do.

    Build it with `RowError.quarantined(...)`, which words the quarantine once; the plain
    constructor takes the message as it is.
    """

    id: str | None
    source: str
    row: int
    error_type: str
    message: str
    prompt_tokens: int | None = None

    @classmethod
    def quarantined(
        cls,
        id: str | None,
        source: str,
        row: int,
        error_type: str,
        reason: str,
        *,
        prompt_tokens: int | None = None,
    ) -> RowError:
        """The row's error with `reason` (which row, what is wrong, what to do) followed by
        "; the row was quarantined"."""
        return cls(id, source, row, error_type, f"{reason}; {QUARANTINED}", prompt_tokens)

    def __post_init__(self) -> None:
        object.__setattr__(self, "message", cap_message(self.message))

    def as_record(self) -> dict[str, object]:
        # The errors table is UTF-8: a lone surrogate that reached an id or a message (a
        # line's own text) is written as its escape, never fails the chunk's commit.
        return {
            "id": utf8_safe(self.id),
            "source": utf8_safe(self.source),
            "row": self.row,
            "error_type": self.error_type,
            "message": utf8_safe(self.message),
            "prompt_tokens": self.prompt_tokens,
        }
