"""The lease queue in SQL, shared by the SQLite and PostgreSQL stores.

Two tables: `gpuinfer_pool_jobs` (one row per job) and `gpuinfer_pool_items` (one row per
work item, with its live lease in place: token, holder, expiry); beside them
`gpuinfer_pool_events` (the jobs' events, `seq` increasing) and `gpuinfer_pool_workers` (one
row per worker, upserted as it reports). Every operation is one short transaction.

Events of one job are posted under its job row's lock (PostgreSQL: `FOR UPDATE`, taken after
the item row, as everywhere here), so within a job `seq` order is commit order and a reader
polling with the last `seq` it saw never skips one committed late.

The stores differ only in how a transaction excludes others:

- SQLite: `BEGIN IMMEDIATE` takes the database's one write lock, so transactions run one
  at a time across threads and processes (WAL lets readers go on meanwhile).
- PostgreSQL: rows. `lease` picks its item with `FOR UPDATE SKIP LOCKED`, so concurrent
  workers take different items without waiting on each other; an operation on one lease
  locks that item's row (`FOR UPDATE`).

The SQL here is written once, with `?` parameters and the store's `lock_clause`
(`FOR UPDATE SKIP LOCKED` or nothing) and `row_lock_clause` spliced in.
"""

from __future__ import annotations

import abc
import json
import os
import threading
import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

from dagster_gpuinfer.pools.doorbell import job_channel, pool_channel
from dagster_gpuinfer.pools.lease_queue import (
    EVENT_KINDS,
    WORKER_STATES,
    Clock,
    ItemState,
    ItemStatus,
    JobConflictError,
    JobEvent,
    JobProgress,
    JobSubmission,
    Lease,
    LeaseLostError,
    LeaseQueue,
    PoolStats,
    PoolWorker,
    UnknownJobError,
    check_choice,
    check_ttl,
)

JOBS = "gpuinfer_pool_jobs"
ITEMS = "gpuinfer_pool_items"
EVENTS = "gpuinfer_pool_events"
WORKERS = "gpuinfer_pool_workers"

# A worker record past its expiry by this long is deleted when any worker reports (the
# read-outs skip expired ones at once; this only keeps the table small).
FORGET_WORKERS_AFTER_S = 3600.0

# Jobs ranked per lease: how many of the pool's best-ranked jobs `lease` tries before it
# says the pool has nothing (only PostgreSQL skips locked items, so only there can a job
# with waiting items yield none; 32 such jobs at once would take 32 concurrent leasers).
RANKED_JOBS = 32

# An item's state as `lease` would leave it: a lease past its expiry reads as queued (it is
# leasable), or as failed when that expiry used the job's last attempt. One parameter: now.
_LIVE_STATE = (
    f"CASE WHEN {ITEMS}.state = 'leased' AND {ITEMS}.expires_at <= ? THEN (CASE WHEN "
    f"{ITEMS}.failures + 1 >= (SELECT max_attempts FROM {JOBS} WHERE {JOBS}.job_id = "
    f"{ITEMS}.job_id) THEN 'failed' ELSE 'queued' END) ELSE {ITEMS}.state END"
)

_ITEM_COLUMNS = (
    "item_id, job_id, item_key, state, lease_token, worker_id, leased_at, expires_at, ttl_s, "
    "leases, failures, lease_ended"
)


class Transaction:
    """A DB-API cursor inside one transaction, taking `?` parameters on every store."""

    def __init__(self, cursor: Any, paramstyle: str) -> None:
        self._cursor = cursor
        self._format = paramstyle in ("format", "pyformat")  # psycopg2: %s

    def _sql(self, sql: str) -> str:
        return sql.replace("?", "%s") if self._format else sql

    def execute(self, sql: str, params: Sequence[Any] = ()) -> int:
        """Run one statement; returns the rows it changed."""
        self._cursor.execute(self._sql(sql), tuple(params))
        return self._cursor.rowcount

    def executemany(self, sql: str, rows: Sequence[Sequence[Any]]) -> None:
        """Run one statement for each row of parameters."""
        self._cursor.executemany(self._sql(sql), [tuple(row) for row in rows])

    def one(self, sql: str, params: Sequence[Any] = ()) -> tuple[Any, ...] | None:
        """The first row of a query, or None."""
        self._cursor.execute(self._sql(sql), tuple(params))
        return self._cursor.fetchone()

    def all(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        """Every row of a query."""
        self._cursor.execute(self._sql(sql), tuple(params))
        return list(self._cursor.fetchall())


class SqlLeaseQueue(LeaseQueue):
    """`LeaseQueue` over a SQL store; subclasses open connections and transactions.

    Args:
        clock: Seconds since the epoch, read once per operation.
    """

    lock_clause = ""  # appended to `lease`'s item pick: skip items others hold
    row_lock_clause = ""  # appended to reading one item before changing it
    location = ""  # for messages

    def __init__(self, *, clock: Clock) -> None:
        self._clock = clock
        self._local = threading.local()
        self._all_connections: list[Any] = []
        self._connections_lock = threading.Lock()

    # ------------------------------------------------------------------ store specifics

    @abc.abstractmethod
    def _connect(self) -> Any:
        """A new DB-API connection to the store."""

    @abc.abstractmethod
    @contextmanager
    def _transaction(self, *, write: bool = True) -> Iterator[Transaction]:
        """One transaction on this thread's connection: committed when the block ends,
        rolled back when it raises."""

    @abc.abstractmethod
    def _next_served(self) -> str:
        """A SQL expression for the next value of the served-order counter."""

    def _connection(self) -> Any:
        """This thread's connection, opened on first use (again after a fork)."""
        pid = os.getpid()
        if getattr(self._local, "pid", None) != pid:
            self._local.connection = self._connect()
            self._local.pid = pid
            with self._connections_lock:
                self._all_connections.append(self._local.connection)
        return self._local.connection

    def _forget_connection(self) -> None:
        """Drop this thread's connection (after it broke): the next call opens another."""
        self._local.pid = None

    def _ring(self, channel: str) -> None:
        """Wake the listeners of `channel` after a change (`pools.doorbell`; best effort)."""
        try:
            self.doorbell().ring(channel)
        except Exception:  # noqa: BLE001 - the change is committed; a ring is a hint
            pass

    def close(self) -> None:
        """Close every connection this object opened (in this process)."""
        with self._connections_lock:
            connections, self._all_connections = self._all_connections, []
        for connection in connections:
            try:
                connection.close()
            except Exception:  # noqa: BLE001 - closing what is already broken
                pass
        self._local = threading.local()

    # ------------------------------------------------------------------ submit

    def submit(self, job: JobSubmission) -> JobProgress:
        now = self._clock()
        with self._transaction() as tx:
            inserted = tx.execute(
                f"INSERT INTO {JOBS} (job_id, pool_key, priority, payload, max_attempts, "
                "state, submitted_at, served_seq) VALUES (?, ?, ?, ?, ?, 'active', ?, 0) "
                "ON CONFLICT (job_id) DO NOTHING",
                (
                    job.job_id,
                    job.pool_key,
                    job.priority,
                    _dumps(job.payload),
                    job.max_attempts,
                    now,
                ),
            )
            if inserted != 1:
                self._check_same_job(tx, job)
            else:
                tx.executemany(
                    f"INSERT INTO {ITEMS} (job_id, pool_key, item_key, seq, payload, state, "
                    "leases, failures, expirations) VALUES (?, ?, ?, ?, ?, 'queued', 0, 0, 0)",
                    [
                        (job.job_id, job.pool_key, item.key, seq, _dumps(item.payload))
                        for seq, item in enumerate(job.items)
                    ],
                )
            progress = self._progress(tx, job.job_id, now)
        self._ring(pool_channel(job.pool_key))
        return progress

    def _check_same_job(self, tx: Transaction, job: JobSubmission) -> None:
        row = tx.one(f"SELECT pool_key FROM {JOBS} WHERE job_id = ?", (job.job_id,))
        keys = [
            k for (k,) in tx.all(f"SELECT item_key FROM {ITEMS} WHERE job_id = ?", (job.job_id,))
        ]
        if (
            row is None
            or row[0] != job.pool_key
            or sorted(keys) != sorted(i.key for i in job.items)
        ):
            raise JobConflictError(
                f"job {job.job_id!r} was already submitted to {self.location} with "
                f"{'pool ' + repr(row[0]) if row else 'another pool'} and {len(keys)} work "
                f"items; this submission has pool {job.pool_key!r} and {len(job.items)} items. "
                "Submit it under a new job id, or cancel the old job first"
            )

    # ------------------------------------------------------------------ lease

    def lease(self, pool_key: str, *, worker_id: str, ttl_s: float) -> Lease | None:
        ttl = check_ttl(ttl_s)
        now = self._clock()
        with self._transaction() as tx:
            self._reclaim(tx, now, pool_key)
            item_id = self._pick_item(tx, pool_key)
            if item_id is None:
                return None
            token = uuid.uuid4().hex
            tx.execute(
                f"UPDATE {ITEMS} SET state = 'leased', lease_token = ?, worker_id = ?, "
                "leased_at = ?, expires_at = ?, ttl_s = ?, leases = leases + 1, "
                "lease_ended = NULL, first_leased_at = COALESCE(first_leased_at, ?) "
                "WHERE item_id = ?",
                (token, worker_id, now, now + ttl, ttl, now, item_id),
            )
            row = tx.one(
                f"SELECT i.job_id, i.item_key, i.leases, i.payload, j.priority, j.payload "
                f"FROM {ITEMS} i JOIN {JOBS} j ON j.job_id = i.job_id WHERE i.item_id = ?",
                (item_id,),
            )
            assert row is not None
            job_id, item_key, leases, item_payload, priority, job_payload = row
            tx.execute(
                f"UPDATE {JOBS} SET served_seq = {self._next_served()} WHERE job_id = ?",
                (job_id,),
            )
        return Lease(
            item_id=int(item_id),
            job_id=job_id,
            item_key=item_key,
            pool_key=pool_key,
            token=token,
            worker_id=worker_id,
            attempt=int(leases),
            priority=int(priority),
            leased_at=now,
            expires_at=now + ttl,
            ttl_s=ttl,
            job_payload=json.loads(job_payload),
            item_payload=json.loads(item_payload),
        )

    def _pick_item(self, tx: Transaction, pool_key: str) -> int | None:
        """The next item of the pool by fair share: the best-ranked job's first waiting
        item that no other transaction holds."""
        jobs = tx.all(
            f"SELECT j.job_id FROM {JOBS} j WHERE j.pool_key = ? AND j.state = 'active' "
            f"AND EXISTS (SELECT 1 FROM {ITEMS} q WHERE q.job_id = j.job_id "
            "AND q.state = 'queued') "
            f"ORDER BY j.priority DESC, (SELECT COUNT(*) FROM {ITEMS} l "
            "WHERE l.job_id = j.job_id AND l.state = 'leased') ASC, "
            f"j.served_seq ASC, j.job_seq ASC LIMIT {RANKED_JOBS}",
            (pool_key,),
        )
        for (job_id,) in jobs:
            row = tx.one(
                f"SELECT item_id FROM {ITEMS} WHERE job_id = ? AND state = 'queued' "
                f"ORDER BY seq LIMIT 1{self.lock_clause}",
                (job_id,),
            )
            if row is not None:
                return int(row[0])
        return None

    def _reclaim(self, tx: Transaction, now: float, pool_key: str | None) -> int:
        """Lapsed leases back to the queue (or to failed, out of attempts).

        Locks item rows only (skipping those others hold), never a job row: every
        transaction here takes item rows before job rows, so none waits in a cycle.
        """
        where, params = ("pool_key = ? AND ", [pool_key]) if pool_key is not None else ("", [])
        return tx.execute(
            f"UPDATE {ITEMS} SET failures = failures + 1, expirations = expirations + 1, "
            f"state = CASE WHEN failures + 1 >= (SELECT max_attempts FROM {JOBS} "
            f"WHERE {JOBS}.job_id = {ITEMS}.job_id) THEN 'failed' ELSE 'queued' END, "
            "lease_ended = 'expired', "
            "last_error = 'the lease of ' || COALESCE(worker_id, '') || ' expired' "
            f"WHERE item_id IN (SELECT item_id FROM {ITEMS} WHERE {where}state = 'leased' "
            f"AND expires_at <= ?{self.lock_clause})",
            (*params, now),
        )

    def reclaim_expired(self, pool_key: str | None = None) -> int:
        now = self._clock()
        with self._transaction() as tx:
            return self._reclaim(tx, now, pool_key)

    # ------------------------------------------------------------------ one lease

    def _held_item(self, tx: Transaction, lease: Lease) -> tuple[Any, ...]:
        row = tx.one(
            f"SELECT {_ITEM_COLUMNS} FROM {ITEMS} WHERE item_id = ?{self.row_lock_clause}",
            (lease.item_id,),
        )
        if row is None or row[1] != lease.job_id or row[2] != lease.item_key:
            raise LeaseLostError(
                f"{_describe(lease)}: the item is not in {self.location} (its job was "
                "deleted); stop work on it",
                reason="unknown",
            )
        return row

    def _check_live(self, row: tuple[Any, ...], lease: Lease, now: float) -> None:
        """Refuse unless `lease` is the item's live lease."""
        state, token, worker, expires_at, ended = row[3], row[4], row[5], row[7], row[11]
        if state == "leased" and token == lease.token and expires_at > now:
            return
        if state == "cancelled":
            reason, why = "cancelled", "its job was cancelled"
        elif token != lease.token:
            reason, why = "taken_over", f"the item was leased again (to {worker!r}, lease {row[9]})"
        elif state == "leased" or ended == "expired":
            reason, why = "expired", f"it expired {now - expires_at:.1f} s ago"
        elif state == "done":
            reason, why = "completed", "it was completed"
        elif state == "failed":
            reason, why = "failed", "the item failed and is out of attempts"
        else:
            reason, why = "released", "it was handed back to the queue"
        raise LeaseLostError(
            f"{_describe(lease)} is no longer live: {why}. Stop work on it; whatever it "
            "committed stays committed (the chunk markers), and the next holder skips it",
            reason=reason,
        )

    def heartbeat(self, lease: Lease, *, ttl_s: float | None = None) -> Lease:
        ttl = lease.ttl_s if ttl_s is None else check_ttl(ttl_s)
        now = self._clock()
        with self._transaction() as tx:
            self._check_live(self._held_item(tx, lease), lease, now)
            tx.execute(
                f"UPDATE {ITEMS} SET expires_at = ?, ttl_s = ? WHERE item_id = ?",
                (now + ttl, ttl, lease.item_id),
            )
        return replace(lease, expires_at=now + ttl, ttl_s=ttl)

    def complete(self, lease: Lease, result: Mapping[str, Any] | None = None) -> bool:
        now = self._clock()
        payload = None if result is None else _dumps(result)
        with self._transaction() as tx:
            row = self._held_item(tx, lease)
            if row[3] == "done" and row[4] == lease.token:
                return False
            self._check_live(row, lease, now)
            tx.execute(
                f"UPDATE {ITEMS} SET state = 'done', completed_at = ? WHERE item_id = ?",
                (now, lease.item_id),
            )
            if payload is not None:
                self._insert_event(tx, lease, "result", payload, now)
            self._finish_if_drained(tx, lease.job_id)
        self._ring(job_channel(lease.job_id))
        return True

    # ------------------------------------------------------------------ events

    def post_event(self, lease: Lease, kind: str, payload: Mapping[str, Any]) -> int:
        check_choice("event kind", kind, EVENT_KINDS)
        body = _dumps(payload)
        now = self._clock()
        with self._transaction() as tx:
            self._check_live(self._held_item(tx, lease), lease, now)
            seq = self._insert_event(tx, lease, kind, body, now)
        self._ring(job_channel(lease.job_id))
        return seq

    def _insert_event(self, tx: Transaction, lease: Lease, kind: str, body: str, now: float) -> int:
        """Insert one event under the job row's lock (see the module docstring)."""
        tx.one(f"SELECT job_id FROM {JOBS} WHERE job_id = ?{self.row_lock_clause}", (lease.job_id,))
        row = tx.one(
            f"INSERT INTO {EVENTS} (job_id, item_key, worker_id, kind, at, payload) "
            "VALUES (?, ?, ?, ?, ?, ?) RETURNING seq",
            (lease.job_id, lease.item_key, lease.worker_id, kind, now, body),
        )
        assert row is not None
        return int(row[0])

    def job_events(self, job_id: str, *, after_seq: int = 0, limit: int = 1000) -> list[JobEvent]:
        with self._transaction(write=False) as tx:
            self._job_row(tx, job_id)
            rows = tx.all(
                f"SELECT seq, item_key, worker_id, kind, at, payload FROM {EVENTS} "
                f"WHERE job_id = ? AND seq > ? ORDER BY seq LIMIT {max(0, int(limit))}",
                (job_id, int(after_seq)),
            )
        return [
            JobEvent(
                seq=int(seq),
                job_id=job_id,
                item_key=item_key,
                worker_id=worker,
                kind=kind,
                at=float(at),
                payload=json.loads(payload),
            )
            for seq, item_key, worker, kind, at, payload in rows
        ]

    # ------------------------------------------------------------------ workers

    def report_worker(
        self,
        pool_key: str,
        worker_id: str,
        *,
        state: str,
        ttl_s: float,
        info: Mapping[str, Any] | None = None,
    ) -> PoolWorker:
        check_choice("worker state", state, WORKER_STATES)
        ttl = check_ttl(ttl_s)
        if not pool_key or not worker_id:
            raise ValueError("report_worker: pool_key and worker_id must be non-empty strings")
        body = _dumps(dict(info or {}))
        new_info = "excluded.info" if info is not None else f"{WORKERS}.info"  # None: keep
        now = self._clock()
        with self._transaction() as tx:
            tx.execute(
                f"DELETE FROM {WORKERS} WHERE expires_at <= ?", (now - FORGET_WORKERS_AFTER_S,)
            )
            tx.execute(
                f"INSERT INTO {WORKERS} (worker_id, pool_key, state, started_at, last_seen, "
                "expires_at, info) VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (worker_id) DO "
                "UPDATE SET pool_key = excluded.pool_key, state = excluded.state, "
                "last_seen = excluded.last_seen, expires_at = excluded.expires_at, "
                f"info = {new_info}",
                (worker_id, pool_key, state, now, now, now + ttl, body),
            )
            row = tx.one(
                f"SELECT {_WORKER_COLUMNS} FROM {WORKERS} WHERE worker_id = ?", (worker_id,)
            )
        assert row is not None
        return _worker(row)

    def remove_worker(self, worker_id: str) -> None:
        with self._transaction() as tx:
            tx.execute(f"DELETE FROM {WORKERS} WHERE worker_id = ?", (worker_id,))

    def pool_workers(self, pool_key: str) -> list[PoolWorker]:
        now = self._clock()
        with self._transaction(write=False) as tx:
            rows = tx.all(
                f"SELECT {_WORKER_COLUMNS} FROM {WORKERS} WHERE pool_key = ? AND expires_at > ? "
                "ORDER BY started_at, worker_id",
                (pool_key, now),
            )
        return [_worker(row) for row in rows]

    def release(self, lease: Lease, reason: str) -> None:
        now = self._clock()
        with self._transaction() as tx:
            self._check_live(self._held_item(tx, lease), lease, now)
            tx.execute(
                f"UPDATE {ITEMS} SET state = 'queued', expires_at = ?, last_error = ?, "
                "lease_ended = 'released' "
                "WHERE item_id = ?",
                (now, f"released by {lease.worker_id}: {reason}", lease.item_id),
            )
        self._ring(pool_channel(lease.pool_key))

    def fail(self, lease: Lease, reason: str) -> ItemState:
        now = self._clock()
        with self._transaction() as tx:
            row = self._held_item(tx, lease)
            self._check_live(row, lease, now)
            (max_attempts,) = tx.one(
                f"SELECT max_attempts FROM {JOBS} WHERE job_id = ?", (lease.job_id,)
            ) or (1,)
            state: ItemState = "failed" if row[10] + 1 >= max_attempts else "queued"
            tx.execute(
                f"UPDATE {ITEMS} SET state = ?, failures = failures + 1, expires_at = ?, "
                "last_error = ?, lease_ended = 'failed' WHERE item_id = ?",
                (state, now, f"failed on {lease.worker_id}: {reason}", lease.item_id),
            )
            if state == "failed":
                self._finish_if_drained(tx, lease.job_id)
        self._ring(pool_channel(lease.pool_key) if state == "queued" else job_channel(lease.job_id))
        return state

    def _finish_if_drained(self, tx: Transaction, job_id: str) -> None:
        """Mark an active job finished once none of its items is queued or leased, so
        `lease` no longer ranks it (a job drained by expiries alone stays ranked: `lease`
        skips it, as it has nothing queued)."""
        tx.execute(
            f"UPDATE {JOBS} SET state = 'finished' WHERE job_id = ? AND state = 'active' "
            f"AND NOT EXISTS (SELECT 1 FROM {ITEMS} WHERE job_id = ? "
            "AND state IN ('queued', 'leased'))",
            (job_id, job_id),
        )

    # ------------------------------------------------------------------ jobs

    def cancel(self, job_id: str, reason: str) -> JobProgress:
        now = self._clock()
        with self._transaction() as tx:
            self._reclaim(tx, now, self._job_row(tx, job_id)[0])  # lapsed: exact counts
            tx.execute(  # item rows first, the job row last (see `_reclaim`)
                f"UPDATE {ITEMS} SET state = 'cancelled', last_error = ? "
                "WHERE job_id = ? AND state IN ('queued', 'leased')",
                (f"cancelled: {reason}", job_id),
            )
            tx.execute(
                f"UPDATE {JOBS} SET state = 'cancelled', cancel_reason = ? "
                "WHERE job_id = ? AND state = 'active'",
                (reason, job_id),
            )
            progress = self._progress(tx, job_id, now)
        self._ring(job_channel(job_id))
        return progress

    def _job_row(self, tx: Transaction, job_id: str) -> tuple[Any, ...]:
        row = tx.one(
            f"SELECT pool_key, priority, state, cancel_reason, submitted_at FROM {JOBS} "
            "WHERE job_id = ?",
            (job_id,),
        )
        if row is None:
            raise UnknownJobError(
                f"no job {job_id!r} in the lease queue at {self.location}; submit it first, "
                "or check that the step and the workers use the same queue"
            )
        return row

    def _progress(self, tx: Transaction, job_id: str, now: float) -> JobProgress:
        pool_key, priority, state, cancel_reason, _ = self._job_row(tx, job_id)
        counts = dict.fromkeys(("queued", "leased", "done", "failed", "cancelled"), 0)
        leases = 0
        for live_state, count, leased in tx.all(
            f"SELECT {_LIVE_STATE}, COUNT(*), SUM(leases) FROM {ITEMS} WHERE job_id = ? GROUP BY 1",
            (now, job_id),
        ):
            counts[live_state] += int(count)
            leases += int(leased or 0)
        return JobProgress(
            job_id=job_id,
            pool_key=pool_key,
            priority=int(priority),
            cancelled=state == "cancelled",
            total=sum(counts.values()),
            queued=counts["queued"],
            leased=counts["leased"],
            done=counts["done"],
            failed=counts["failed"],
            leases=leases,
            cancel_reason=cancel_reason,
        )

    def job_progress(self, job_id: str) -> JobProgress:
        now = self._clock()
        with self._transaction(write=False) as tx:
            return self._progress(tx, job_id, now)

    def job_items(self, job_id: str) -> list[ItemStatus]:
        now = self._clock()
        with self._transaction(write=False) as tx:
            submitted_at = float(self._job_row(tx, job_id)[4])
            rows = tx.all(
                f"SELECT item_key, {_LIVE_STATE}, leases, failures, worker_id, "
                f"first_leased_at, last_error FROM {ITEMS} WHERE job_id = ? ORDER BY seq",
                (now, job_id),
            )
        return [
            ItemStatus(
                key=key,
                state=state,
                leases=int(leases),
                failures=int(failures),
                worker_id=worker,
                queue_wait_s=None if first is None else float(first) - submitted_at,
                last_error=error,
            )
            for key, state, leases, failures, worker, first, error in rows
        ]

    # ------------------------------------------------------------------ read-outs

    def pool_stats(self, pool_key: str) -> PoolStats:
        now = self._clock()
        with self._transaction(write=False) as tx:
            queued = tx.all(
                f"SELECT (SELECT priority FROM {JOBS} WHERE {JOBS}.job_id = {ITEMS}.job_id), "
                f"COUNT(*) FROM {ITEMS} WHERE pool_key = ? AND state IN ('queued', 'leased') "
                f"AND {_LIVE_STATE} = 'queued' GROUP BY 1",
                (pool_key, now),
            )
            leased, oldest = tx.one(
                f"SELECT COUNT(*), MIN(leased_at) FROM {ITEMS} WHERE pool_key = ? "
                "AND state = 'leased' AND expires_at > ?",
                (pool_key, now),
            ) or (0, None)
            expired, done, failed = tx.one(
                "SELECT COALESCE(SUM(expirations), 0) + COALESCE(SUM(CASE WHEN state = "
                "'leased' AND expires_at <= ? THEN 1 ELSE 0 END), 0), COALESCE(SUM(CASE WHEN "
                f"state = 'done' THEN 1 ELSE 0 END), 0), COALESCE(SUM(CASE WHEN {_LIVE_STATE} "
                f"= 'failed' THEN 1 ELSE 0 END), 0) FROM {ITEMS} WHERE pool_key = ?",
                (now, now, pool_key),
            ) or (0, 0, 0)
        return PoolStats(
            pool_key=pool_key,
            queued_by_priority={int(p): int(n) for p, n in sorted(queued, reverse=True)},
            leased=int(leased),
            oldest_lease_age_s=None if oldest is None else now - float(oldest),
            expired_leases=int(expired),
            done=int(done),
            failed=int(failed),
        )

    def pools(self) -> list[str]:
        with self._transaction(write=False) as tx:
            rows = tx.all(
                f"SELECT DISTINCT pool_key FROM {ITEMS} WHERE state IN ('queued', 'leased')"
            )
        return sorted(pool for (pool,) in rows)


_WORKER_COLUMNS = "worker_id, pool_key, state, started_at, last_seen, expires_at, info"


def _worker(row: Sequence[Any]) -> PoolWorker:
    worker_id, pool_key, state, started_at, last_seen, expires_at, info = row
    return PoolWorker(
        worker_id=worker_id,
        pool_key=pool_key,
        state=state,
        started_at=float(started_at),
        last_seen=float(last_seen),
        expires_at=float(expires_at),
        info=json.loads(info),
    )


def schema_statements(*, id_column: str, real: str) -> list[str]:
    """The tables and indexes, for a store's id column type and float type. The workers
    table comes last: a store that has it has them all (PostgreSQL checks for it)."""
    return [
        f"CREATE TABLE IF NOT EXISTS {JOBS} (job_seq {id_column}, job_id TEXT NOT NULL "
        "UNIQUE, pool_key TEXT NOT NULL, priority INTEGER NOT NULL, payload TEXT NOT NULL, "
        "max_attempts INTEGER NOT NULL, state TEXT NOT NULL, cancel_reason TEXT, "
        f"submitted_at {real} NOT NULL, served_seq BIGINT NOT NULL)",
        f"CREATE INDEX IF NOT EXISTS {JOBS}_pool ON {JOBS} (pool_key, state)",
        f"CREATE TABLE IF NOT EXISTS {ITEMS} (item_id {id_column}, job_id TEXT NOT NULL "
        f"REFERENCES {JOBS} (job_id) ON DELETE CASCADE, pool_key TEXT NOT NULL, "
        "item_key TEXT NOT NULL, seq INTEGER NOT NULL, payload TEXT NOT NULL, "
        "state TEXT NOT NULL, lease_token TEXT, worker_id TEXT, "
        f"leased_at {real}, expires_at {real}, ttl_s {real}, first_leased_at {real}, "
        f"completed_at {real}, leases INTEGER NOT NULL, failures INTEGER NOT NULL, "
        "expirations INTEGER NOT NULL, lease_ended TEXT, last_error TEXT, "
        "UNIQUE (job_id, item_key))",
        f"CREATE INDEX IF NOT EXISTS {ITEMS}_job ON {ITEMS} (job_id, state, seq)",
        f"CREATE INDEX IF NOT EXISTS {ITEMS}_pool ON {ITEMS} (pool_key, state, expires_at)",
        f"CREATE TABLE IF NOT EXISTS {EVENTS} (seq {id_column}, job_id TEXT NOT NULL "
        f"REFERENCES {JOBS} (job_id) ON DELETE CASCADE, item_key TEXT, worker_id TEXT, "
        f"kind TEXT NOT NULL, at {real} NOT NULL, payload TEXT NOT NULL)",
        f"CREATE INDEX IF NOT EXISTS {EVENTS}_job ON {EVENTS} (job_id, seq)",
        f"CREATE TABLE IF NOT EXISTS {WORKERS} (worker_id TEXT PRIMARY KEY, "
        f"pool_key TEXT NOT NULL, state TEXT NOT NULL, started_at {real} NOT NULL, "
        f"last_seen {real} NOT NULL, expires_at {real} NOT NULL, info TEXT NOT NULL)",
        f"CREATE INDEX IF NOT EXISTS {WORKERS}_pool ON {WORKERS} (pool_key, expires_at)",
    ]


def _dumps(value: Any) -> str:
    try:
        return json.dumps(value, sort_keys=True, separators=(",", ":"))
    except TypeError as exc:
        raise ValueError(
            f"a job or work item payload is not JSON-ready ({exc}); pass dicts of str, "
            "numbers, bools, None and lists (e.g. `spec.model_dump(mode='json')`)"
        ) from None


def _describe(lease: Lease) -> str:
    return (
        f"lease {lease.token[:8]} of item {lease.item_key!r} of job {lease.job_id!r} "
        f"(pool {lease.pool_key!r}, held by {lease.worker_id!r})"
    )
