"""A pool's backlog as one PostgreSQL query, for scalers that run SQL themselves.

KEDA's PostgreSQL scaler (deploy/pools/keda-scaledjob.yaml) polls a query that returns one
integer; this is the query: the pool's work items that are waiting for a lease or under one,
over its jobs that are still active, which is `LeaseQueue.pool_stats(pool).backlog` computed
in the database. A lease past its expiry counts (it is leasable again) unless that expiry
used its job's last attempt (the item is failed, as `pool_stats` reads it).

The pool key is written into the SQL (KEDA passes no parameters); only keys that are valid
Kubernetes label values are accepted, which leaves no quote or other SQL character in them.
"""

from __future__ import annotations

import re

from dagster_gpuinfer.pools.sql_queue import ITEMS, JOBS

_POOL_KEY = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")


def backlog_query(pool_key: str) -> str:
    """SQL returning the backlog (queued + leased items of active jobs) of `pool_key`.

    Args:
        pool_key: The pool (`pool_key(spec)`): a valid label value.

    Returns:
        One `SELECT` of one integer column, for the PostgreSQL store's tables.

    Raises:
        ValueError: `pool_key` is not a valid label value.

    Examples:
        >>> "pool_key = 'minilm-0123456789ab'" in backlog_query("minilm-0123456789ab")
        True
    """
    if not _POOL_KEY.match(pool_key):
        raise ValueError(
            f"pool key {pool_key!r} is not a valid label value; make it with "
            "dagster_gpuinfer.pools.pool_key(spec)"
        )
    return (
        f"SELECT COUNT(*) FROM {ITEMS} i JOIN {JOBS} j ON j.job_id = i.job_id "
        f"WHERE i.pool_key = '{pool_key}' AND j.state = 'active' "
        "AND i.state IN ('queued', 'leased') AND NOT (i.state = 'leased' "
        "AND i.expires_at <= EXTRACT(EPOCH FROM clock_timestamp()) "
        "AND i.failures + 1 >= j.max_attempts)"
    )
