"""`open_lease_queue`: the lease queue store a location names (PostgreSQL or SQLite), and
the variable a pool worker reads that location from (`QUEUE_ENV`).

Apart from lease_queue.py, which the stores build on, so that neither imports the other.
"""

from __future__ import annotations

from dagster_gpuinfer.pools.lease_queue import Clock, LeaseQueue
from dagster_gpuinfer.pools.postgres_queue import PostgresLeaseQueue
from dagster_gpuinfer.pools.sqlite_queue import SqliteLeaseQueue

# Where a pool worker finds the lease queue: a PostgreSQL URL holds a password, so pods take
# it from a Secret through this variable, never from the command line (`--queue`).
QUEUE_ENV = "GPUINFER_LEASE_QUEUE"


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
