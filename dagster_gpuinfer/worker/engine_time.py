"""Each chunk's share of its engine's time, from which a partition's rates are computed.

Under streaming an engine holds the rows of several chunks, and often of several partitions,
at once, so a partition's rows per second cannot be its rows over any stretch of wall time:
a partition whose first rows are submitted early waits behind the previous one's. Instead
the time the engine spends in `step()` is shared out:

- generation (generate, chat): a decoding request holds the engine at every step it is in
  flight, so each step's time is shared by the chunks in flight during it, in proportion
  to their requests in flight;
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
    """

    def __init__(self, *, pooling: bool) -> None:
        self.pooling = pooling
        # id(chunk) -> [chunk, its requests in flight]; holding the chunk keeps its id unique
        self._in_flight: dict[int, list[Any]] = {}
        self._unassigned = 0.0  # pooling: step time that finished no row yet

    def submitted(self, chunk: Any) -> None:
        """One request of `chunk` was submitted."""
        entry = self._in_flight.setdefault(id(chunk), [chunk, 0])
        entry[1] += 1

    def stepped(self, seconds: float, finished: Sequence[Any]) -> None:
        """A step took `seconds` and finished one request of each chunk in `finished` (a
        chunk appears once per request it finished)."""
        if self.pooling:
            self._unassigned += seconds
            if finished:
                share = self._unassigned / len(finished)
                for chunk in finished:
                    chunk.engine_seconds += share
                self._unassigned = 0.0
        else:
            total = sum(entry[1] for entry in self._in_flight.values())
            for chunk, count in self._in_flight.values():
                chunk.engine_seconds += seconds * count / total
        for chunk in finished:
            entry = self._in_flight.get(id(chunk))
            if entry is not None:
                entry[1] -= 1
                if entry[1] <= 0:
                    del self._in_flight[id(chunk)]
