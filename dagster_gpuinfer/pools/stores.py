"""`open_lease_queue`: the lease queue store a location names (PostgreSQL or SQLite), and
where that location comes from when none is given (`QUEUE_ENV`, `default_queue_location`).

Apart from lease_queue.py, which the stores build on, so that neither imports the other.
"""

from __future__ import annotations

import os

from dagster_gpuinfer.pools.lease_queue import Clock, LeaseQueue
from dagster_gpuinfer.pools.postgres_queue import PostgresLeaseQueue
from dagster_gpuinfer.pools.sqlite_queue import SqliteLeaseQueue

# Where a pool worker finds the lease queue: a PostgreSQL URL holds a password, so pods take
# it from a Secret through this variable, never from the command line (`--queue`).
QUEUE_ENV = "GPUINFER_LEASE_QUEUE"


def default_pools_home() -> str:
    """The folder of the default queue and the local pool workers' logs, absolute:
    `$DAGSTER_HOME/gpuinfer`, or `.data` without DAGSTER_HOME."""
    home = os.environ.get("DAGSTER_HOME")
    return os.path.abspath(os.path.join(home, "gpuinfer") if home else ".data")


def default_queue_location() -> str:
    """The lease queue when none is configured (`GpuInferenceResource.pool.queue`) and a
    pool worker is given none: the SQLite file `pools.db` in `default_pools_home()`."""
    return os.path.join(default_pools_home(), "pools.db")


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
