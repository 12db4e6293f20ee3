"""The lease queue in a SQLite file: the embedded default (no server to run).

WAL journal, so readers (the scaler's read-outs, a step polling its progress) never wait on
writers; `BEGIN IMMEDIATE` on every change, so changes run one at a time across threads
and processes, each waiting up to `busy_timeout_s` for the write lock. Keep the file on a
local disk: SQLite's locking is not safe on network file systems (NFS, SMB), and WAL needs
every process on one host. Several hosts share a queue through `PostgresLeaseQueue`.
"""

from __future__ import annotations

import os
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager

from dagster_gpuinfer.pools.doorbell import Doorbell, LocalDoorbell
from dagster_gpuinfer.pools.lease_queue import Clock
from dagster_gpuinfer.pools.sql_queue import JOBS, SqlLeaseQueue, Transaction, schema_statements

# RETURNING (used to reclaim lapsed leases in one statement) came with SQLite 3.35.
MIN_SQLITE = (3, 35, 0)


class SqliteLeaseQueue(SqlLeaseQueue):
    """The lease queue in the SQLite file at `path` (created with its tables if missing).

    Args:
        path: The database file; its folder is created if missing.
        clock: Seconds since the epoch; `time.time` by default (tests pass a fake).
        busy_timeout_s: How long a change waits for another process's write to finish
            before it raises `sqlite3.OperationalError: database is locked`.

    Examples:
        >>> import tempfile
        >>> from dagster_gpuinfer.pools import JobSubmission, WorkItem
        >>> with SqliteLeaseQueue(tempfile.mkdtemp() + "/leases.db") as queue:
        ...     _ = queue.submit(JobSubmission("run-1", "pool-a", [WorkItem("part-0")]))
        ...     lease = queue.lease("pool-a", worker_id="w1", ttl_s=30)
        ...     queue.complete(lease)
        True
    """

    def __init__(
        self, path: str | os.PathLike[str], *, clock: Clock = time.time, busy_timeout_s: float = 30
    ) -> None:
        if sqlite3.sqlite_version_info < MIN_SQLITE:
            raise RuntimeError(
                f"the SQLite lease queue needs SQLite >= {'.'.join(map(str, MIN_SQLITE))}; "
                f"this Python links {sqlite3.sqlite_version}. Use a newer Python build, or "
                "the PostgreSQL store (a postgresql:// URL)"
            )
        super().__init__(clock=clock)
        self.path = os.path.abspath(os.fspath(path))
        self.location = f"sqlite {self.path}"
        self._busy_timeout_s = busy_timeout_s
        self._doorbell: LocalDoorbell | None = None
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        with self._transaction() as tx:
            for statement in schema_statements(id_column="INTEGER PRIMARY KEY", real="REAL"):
                tx.execute(statement)

    def _connect(self) -> sqlite3.Connection:
        connection = sqlite3.connect(
            self.path,
            timeout=self._busy_timeout_s,
            isolation_level=None,  # transactions are explicit: BEGIN IMMEDIATE ... COMMIT
            check_same_thread=False,
        )
        connection.execute("PRAGMA journal_mode=WAL")
        connection.execute("PRAGMA foreign_keys=ON")
        return connection

    @contextmanager
    def _transaction(self, *, write: bool = True) -> Iterator[Transaction]:
        connection = self._connection()
        connection.execute("BEGIN IMMEDIATE" if write else "BEGIN")
        try:
            yield Transaction(connection.cursor(), sqlite3.paramstyle)
        except BaseException:
            connection.execute("ROLLBACK")
            raise
        connection.execute("COMMIT")

    def _next_served(self) -> str:
        return f"(SELECT COALESCE(MAX(served_seq), 0) + 1 FROM {JOBS})"

    def doorbell(self) -> Doorbell:
        """Unix datagram sockets beside the file (`pools.doorbell.LocalDoorbell`): the
        waiters of this host wake as soon as a change they wait for commits."""
        if self._doorbell is None:
            self._doorbell = LocalDoorbell(self.path + ".bells")
        return self._doorbell
