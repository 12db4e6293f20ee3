"""The lease queue in PostgreSQL: production, shared by every host of the pools.

Why plain SQL and not a Postgres queue library (procrastinate, pgqueuer, pgmq): the queue
here is a table of leases that the scaler, the metrics and a Dagster step read as rows
(depth per pool and priority, lease age, per-job progress), handed out by a fair-share
order across jobs that none of them offers (they order by priority and arrival), and it
must behave exactly as the embedded SQLite store does, with one set of tests for both.
procrastinate and pgqueuer are task runners that own the worker loop and dispatch to
functions; pgmq needs an extension installed in the server, which managed databases and
the Dagster instance's own database may not allow. `SELECT ... FOR UPDATE SKIP LOCKED` is
the mechanism all three are built on, and takes a few lines here.

The tables live in the database of `url` (the Dagster instance's database will do: the
names start with `gpuinfer_pool_`). psycopg2 comes with the `postgres` extra.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from dagster_gpuinfer.pools.doorbell import Doorbell, PostgresDoorbell
from dagster_gpuinfer.pools.lease_queue import Clock, QueueUnavailable
from dagster_gpuinfer.pools.sql_queue import (
    WORKERS,
    SqlLeaseQueue,
    Transaction,
    schema_statements,
)

SERVED_SEQUENCE = "gpuinfer_pool_served"
# pg_advisory_xact_lock key that serialises creating the tables (several workers may start
# at once, and CREATE TABLE IF NOT EXISTS races with itself in PostgreSQL).
SCHEMA_LOCK = 0x6770755F706F6F6C  # "gpu_pool"


class PostgresLeaseQueue(SqlLeaseQueue):
    """The lease queue in the PostgreSQL database at `url` (tables created if missing).

    Args:
        url: `postgresql://user@host:port/database`.
        clock: Seconds since the epoch; `time.time` by default. Every host's clock should
            be in step (NTP), as leases expire by it.
        connect_timeout_s: How long to wait for the server when connecting.
    """

    lock_clause = " FOR UPDATE SKIP LOCKED"
    row_lock_clause = " FOR UPDATE"

    def __init__(self, url: str, *, clock: Clock = time.time, connect_timeout_s: int = 10) -> None:
        try:
            import psycopg2
        except ImportError:  # pragma: no cover - the postgres extra is missing
            raise ImportError(
                "the PostgreSQL lease queue needs psycopg2: install dagster-gpuinfer[postgres] "
                "(or psycopg2-binary), or use the SQLite store (a file path)"
            ) from None
        super().__init__(clock=clock)
        self._psycopg2 = psycopg2
        self.url = url
        self.location = "postgresql " + url.rsplit("@", 1)[-1]  # no user or password
        self._connect_timeout_s = connect_timeout_s
        self._create_schema()

    def _create_schema(self) -> None:
        """Create the tables once. A queue that exists takes no lock at all: DDL on it
        (even `CREATE INDEX IF NOT EXISTS`) would lock its tables against running leases.
        The workers table is created last, so a store that has it has every table; one
        made before the events and workers tables existed gets them (once)."""
        with self._transaction() as tx:
            if tx.one("SELECT to_regclass(?)", (WORKERS,))[0] is not None:
                return
            tx.execute("SELECT pg_advisory_xact_lock(?)", (SCHEMA_LOCK,))
            if tx.one("SELECT to_regclass(?)", (WORKERS,))[0] is not None:
                return  # another process created it while this one waited
            tx.execute(f"CREATE SEQUENCE IF NOT EXISTS {SERVED_SEQUENCE}")
            for statement in schema_statements(
                id_column="BIGSERIAL PRIMARY KEY", real="DOUBLE PRECISION"
            ):
                tx.execute(statement)

    def _connect(self) -> Any:
        try:
            return self._psycopg2.connect(self.url, connect_timeout=self._connect_timeout_s)
        except self._psycopg2.OperationalError as exc:
            raise QueueUnavailable(
                f"cannot reach the lease queue at {self.location}: {str(exc).strip()}. Check "
                "that the server runs and the URL (host, port, database, user) is right"
            ) from exc

    @contextmanager
    def _transaction(self, *, write: bool = True) -> Iterator[Transaction]:
        connection = self._connection()
        try:
            yield Transaction(connection.cursor(), self._psycopg2.paramstyle)
        except BaseException as exc:
            try:
                connection.rollback()
            except self._psycopg2.Error:
                pass
            if connection.closed:  # the server went away: reconnect on the next call
                self._forget_connection()
                if isinstance(exc, self._psycopg2.Error):
                    raise self._lost(exc) from exc
            raise
        try:
            connection.commit()
        except self._psycopg2.Error as exc:
            if not connection.closed:
                raise
            self._forget_connection()
            raise self._lost(exc) from exc

    def _lost(self, exc: Exception) -> QueueUnavailable:
        first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        return QueueUnavailable(
            f"lost the connection to the lease queue at {self.location} ({first_line}); "
            "the next call connects again"
        )

    def _next_served(self) -> str:
        return f"nextval('{SERVED_SEQUENCE}')"

    def doorbell(self) -> Doorbell:
        """`LISTEN`/`NOTIFY` (`pools.doorbell.PostgresDoorbell`): waiters on every host
        wake as soon as a change they wait for commits."""
        return PostgresDoorbell(self._notify, self._connect)

    def _notify(self, channel: str) -> None:
        with self._transaction() as tx:
            tx.execute("SELECT pg_notify(?, '')", (channel,))
