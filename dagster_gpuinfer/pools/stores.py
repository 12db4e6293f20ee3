"""`open_lease_queue`: the lease queue store a location names (PostgreSQL or SQLite).

Apart from lease_queue.py, which the stores build on, so that neither imports the other.
"""

from __future__ import annotations

from dagster_gpuinfer.pools.lease_queue import Clock, LeaseQueue
from dagster_gpuinfer.pools.postgres_queue import PostgresLeaseQueue
from dagster_gpuinfer.pools.sqlite_queue import SqliteLeaseQueue


def open_lease_queue(location: str, *, clock: Clock | None = None) -> LeaseQueue:
    """Open the lease queue at `location`: a `postgresql://` URL or a SQLite file path
    (`sqlite:///path` or a plain path).

    Args:
        location: Where the queue lives.
        clock: Seconds since the epoch; `time.time` by default (tests pass a fake).

    Returns:
        The store; close it (or use it as a context manager) when done.
    """
    kwargs = {} if clock is None else {"clock": clock}
    if location.startswith(("postgresql://", "postgres://")):
        return PostgresLeaseQueue(location, **kwargs)
    return SqliteLeaseQueue(location.removeprefix("sqlite:///"), **kwargs)
