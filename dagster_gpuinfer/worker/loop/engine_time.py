"""Each chunk's share of its engine's time, from which a partition's rates are computed.

Under streaming an engine holds the rows of several chunks, and often of several partitions,
at once, so a partition's rows per second cannot be its rows over any stretch of wall time:
a partition whose first rows are submitted early waits behind the previous one's. Instead
the time the engine spends in `step()` is shared out:

- generation (generate, chat): each step's time is shared by the requests it runs, by
  chunk. vLLM schedules first come, first served, up to `max_num_seqs` at a time, so the
  requests running are taken to be the `max_num_seqs` oldest in flight; the others wait
  in its queue and hold nothing (the window is about twice `max_num_seqs`);
- pooling (embed; score and classify run whole chunks and are timed by their call): a
  pooling request is done in the step that runs it, so each step's time (with that of any
  steps before it that finished nothing) goes to the rows it finished, equally.

The shares of all chunks add up to the engine's time in `step()`. The streaming loop calls
`submitted` for each request and `stepped` after each step, before its rows are handed on;
each chunk's share accumulates in its `engine_seconds` attribute.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class EngineTimeShares:
    """Shares out an engine's step time among the chunks it serves.

    Args:
        pooling: The engine serves pooling requests (see the module's docstring).
        max_running: The engine's `max_num_seqs`: generation requests it runs at once.
    """

    def __init__(self, *, pooling: bool, max_running: int) -> None:
        self.pooling = pooling
        self.max_running = max(1, max_running)
        # id(chunk) -> [chunk, its requests running]; holding the chunk keeps its id unique
        self._running: dict[int, list[Any]] = {}
        self._running_ids: dict[str, Any] = {}
        self._waiting: dict[str, Any] = {}  # request id -> chunk, in submission order
        self._unassigned = 0.0  # pooling: step time that finished no row yet

    def submitted(self, request_id: str, chunk: Any) -> None:
        """Request `request_id` of `chunk` was submitted."""
        if self.pooling:
            return
        if len(self._running_ids) < self.max_running:
            self._run(request_id, chunk)
        else:
            self._waiting[request_id] = chunk

    def stepped(self, seconds: float, finished: Sequence[tuple[str, Any]]) -> None:
        """A step took `seconds` and finished these (request id, chunk) requests."""
        if self.pooling:
            self._unassigned += seconds
            if finished:
                share = self._unassigned / len(finished)
                for _, chunk in finished:
                    chunk.engine_seconds += share
                self._unassigned = 0.0
            return
        if self._running_ids:
            per_request = seconds / len(self._running_ids)
            for chunk, count in self._running.values():
                chunk.engine_seconds += per_request * count
        for request_id, chunk in finished:
            if self._running_ids.pop(request_id, None) is None:
                self._waiting.pop(request_id, None)  # done before its turn by this count
                continue
            entry = self._running[id(chunk)]
            entry[1] -= 1
            if entry[1] == 0:
                del self._running[id(chunk)]
        while self._waiting and len(self._running_ids) < self.max_running:
            request_id = next(iter(self._waiting))
            self._run(request_id, self._waiting.pop(request_id))

    def _run(self, request_id: str, chunk: Any) -> None:
        self._running_ids[request_id] = chunk
        self._running.setdefault(id(chunk), [chunk, 0])[1] += 1
