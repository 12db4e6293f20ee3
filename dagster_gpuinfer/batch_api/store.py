"""The batch API's metadata: tenants, API keys, files and batches, in SQL.

SQLite by default (`sqlite:///<path>`), PostgreSQL in deployment (the Dagster instance's
database, e.g. `postgresql://user:pass@host/dagster`: the tables are prefixed `gpuinfer_batch_`
so they sit beside Dagster's own). SQLAlchemy 2.0 Core, no ORM: every write is one statement,
and status changes are compare-and-set (`UPDATE ... WHERE status IN (...)`), so the API's
request handlers and its reconcile loop (or two API replicas) never undo each other.
File bytes are not here: they live in the output storage (dagster_gpuinfer.batch_api.files).
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite

from dagster_gpuinfer.batch_api.keys import NewKey, new_key, secret_matches, split_token
from dagster_gpuinfer.batch_api.webhooks import batch_event, new_webhook_id

METADATA = sa.MetaData()
PREFIX = "gpuinfer_batch_"

TENANTS = sa.Table(
    f"{PREFIX}tenants",
    METADATA,
    sa.Column("name", sa.String(128), primary_key=True),
    sa.Column("kueue_queue", sa.String(253), nullable=True),
    sa.Column("created_at", sa.Integer, nullable=False),
)

KEYS = sa.Table(
    f"{PREFIX}api_keys",
    METADATA,
    sa.Column("key_id", sa.String(32), primary_key=True),
    sa.Column("tenant", sa.String(128), nullable=False, index=True),
    sa.Column("salt", sa.String(64), nullable=False),
    sa.Column("digest", sa.String(64), nullable=False),
    sa.Column("created_at", sa.Integer, nullable=False),
    sa.Column("revoked_at", sa.Integer, nullable=True),
)

# The batch object's `*_at` fields (OpenAI's names), a column each.
BATCH_TIMESTAMPS = (
    "created",
    "in_progress",
    "expires",
    "finalizing",
    "completed",
    "failed",
    "expired",
    "cancelling",
    "cancelled",
)

FILES = sa.Table(
    f"{PREFIX}files",
    METADATA,
    sa.Column("seq", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("id", sa.String(64), nullable=False, unique=True),
    sa.Column("tenant", sa.String(128), nullable=False, index=True),
    sa.Column("purpose", sa.String(32), nullable=False),
    sa.Column("filename", sa.String(512), nullable=False),
    sa.Column("bytes", sa.BigInteger, nullable=False),
    sa.Column("created_at", sa.Integer, nullable=False),
    sa.Column("status", sa.String(16), nullable=False),
    sa.Column("path", sa.Text, nullable=False),
    # Output and error files of a batch with `output_expires_after`: deleted after this.
    sa.Column("expires_at", sa.Integer, nullable=True, index=True),
)

BATCHES = sa.Table(
    f"{PREFIX}batches",
    METADATA,
    sa.Column("seq", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("id", sa.String(64), nullable=False, unique=True),
    sa.Column("tenant", sa.String(128), nullable=False, index=True),
    sa.Column("endpoint", sa.String(64), nullable=False),
    sa.Column("model", sa.String(256), nullable=True),
    sa.Column("pipeline", sa.String(128), nullable=True),
    sa.Column("input_file_id", sa.String(64), nullable=False),
    sa.Column("completion_window", sa.String(16), nullable=False),
    sa.Column("metadata", sa.Text, nullable=True),
    sa.Column("status", sa.String(16), nullable=False, index=True),
    sa.Column("total", sa.Integer, nullable=False, default=0),
    sa.Column("completed", sa.Integer, nullable=False, default=0),
    sa.Column("failed", sa.Integer, nullable=False, default=0),
    # Token usage (OpenAI's `usage`): prompt and generated tokens of the rows done so far.
    sa.Column("input_tokens", sa.BigInteger, nullable=True),
    sa.Column("output_tokens", sa.BigInteger, nullable=True),
    sa.Column("output_file_id", sa.String(64), nullable=True),
    sa.Column("error_file_id", sa.String(64), nullable=True),
    sa.Column("errors", sa.Text, nullable=True),
    sa.Column("finalizing_to", sa.String(16), nullable=True),
    sa.Column("run_id", sa.String(64), nullable=True),
    # `output_expires_after.seconds`: its output and error files expire this long after
    # they are written (OpenAI's anchor `created_at` is the file's creation).
    sa.Column("output_expires_after", sa.Integer, nullable=True),
    *(sa.Column(f"{name}_at", sa.Integer, nullable=True) for name in BATCH_TIMESTAMPS),
)


# The webhook outbox (webhooks.py): an event per batch state change that has endpoints to
# go to, written in the transaction that makes the change; a delivery per event and
# endpoint, done when the endpoint answers 2xx. Secrets are not here, only endpoint names.
WEBHOOK_EVENTS = sa.Table(
    f"{PREFIX}webhook_events",
    METADATA,
    sa.Column("seq", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("id", sa.String(64), nullable=False, unique=True),
    sa.Column("tenant", sa.String(128), nullable=False),
    sa.Column("batch_id", sa.String(64), nullable=False, index=True),
    sa.Column("type", sa.String(32), nullable=False),
    sa.Column("created_at", sa.Integer, nullable=False),
    sa.Column("body", sa.Text, nullable=False),
)

WEBHOOK_DELIVERIES = sa.Table(
    f"{PREFIX}webhook_deliveries",
    METADATA,
    sa.Column("seq", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("id", sa.String(64), nullable=False, unique=True),  # the `webhook-id` header
    sa.Column("event_id", sa.String(64), nullable=False, index=True),
    sa.Column("tenant", sa.String(128), nullable=False),
    sa.Column("endpoint", sa.String(2048), nullable=False),
    sa.Column("url", sa.Text, nullable=False),
    sa.Column("attempts", sa.Integer, nullable=False, default=0),
    sa.Column("next_attempt_at", sa.Float, nullable=False, index=True),
    sa.Column("delivered_at", sa.Integer, nullable=True),
    sa.Column("abandoned_at", sa.Integer, nullable=True),
    sa.Column("last_error", sa.String(512), nullable=True),
    sa.UniqueConstraint("event_id", "endpoint"),
)

# A token bucket per API key (limits.py): requests it may still send now, as of `updated_at`
# (Unix seconds, fractional). One row per key; every request takes a token from it in one
# upsert, so every replica behind the store draws from the same bucket.
RATE_BUCKETS = sa.Table(
    f"{PREFIX}rate_buckets",
    METADATA,
    sa.Column("key_id", sa.String(32), primary_key=True),
    sa.Column("tokens", sa.Float, nullable=False),
    sa.Column("updated_at", sa.Float, nullable=False),
)

# A batch status that ends it, and the event each one sends.
FINAL_STATUSES = ("failed", "completed", "expired", "cancelled")
IN_FLIGHT_STATUSES = ("validating", "in_progress", "finalizing", "cancelling")


class QuotaExceeded(Exception):
    """A write refused because the tenant is at a quota: `what` is "files", "bytes" or
    "batches", `held` what the tenant has now."""

    def __init__(self, what: str, held: int) -> None:
        super().__init__(f"{what} quota: {held} held")
        self.what, self.held = what, held


@dataclass(frozen=True)
class Usage:
    """What a tenant holds: files, their bytes, batches not yet final."""

    files: int
    stored_bytes: int
    batches_in_flight: int


@dataclass(frozen=True)
class Tenant:
    """Who a key belongs to, and the Kueue LocalQueue its work is admitted through."""

    name: str
    kueue_queue: str | None
    key_id: str


def now() -> int:
    return int(time.time())


class BatchStore:
    """Tenants, keys, files and batches in one SQL database.

    Args:
        url: A SQLAlchemy URL: `sqlite:///path.sqlite` or `postgresql://...`.
    """

    def __init__(self, url: str) -> None:
        self.url = url
        kwargs: dict[str, Any] = {"future": True}
        if url.startswith("sqlite"):
            kwargs["connect_args"] = {"check_same_thread": False, "timeout": 30}
        else:
            kwargs["pool_pre_ping"] = True
        self.engine = sa.create_engine(url, **kwargs)
        # SQLite serves one process: this lock makes its quota checks race-free (tenant_writes)
        self._local_lock = threading.Lock()
        METADATA.create_all(self.engine)
        _add_missing_columns(self.engine)

    def close(self) -> None:
        self.engine.dispose()

    # ---------------------------------------------------------------- tenants and keys

    def create_key(self, tenant: str, *, kueue_queue: str | None = None) -> NewKey:
        """A new key for `tenant` (created if new; its queue set when `kueue_queue` is)."""
        key = new_key()
        with self.engine.begin() as conn:
            existing = conn.execute(sa.select(TENANTS).where(TENANTS.c.name == tenant)).first()
            if existing is None:
                conn.execute(
                    TENANTS.insert().values(name=tenant, kueue_queue=kueue_queue, created_at=now())
                )
            elif kueue_queue is not None:
                conn.execute(
                    TENANTS.update().where(TENANTS.c.name == tenant).values(kueue_queue=kueue_queue)
                )
            conn.execute(
                KEYS.insert().values(
                    key_id=key.key_id,
                    tenant=tenant,
                    salt=key.salt,
                    digest=key.digest,
                    created_at=now(),
                )
            )
        return key

    def revoke_key(self, key_id: str) -> bool:
        with self.engine.begin() as conn:
            result = conn.execute(
                KEYS.update()
                .where(KEYS.c.key_id == key_id, KEYS.c.revoked_at.is_(None))
                .values(revoked_at=now())
            )
        return result.rowcount == 1

    def list_keys(self) -> list[dict[str, Any]]:
        query = sa.select(KEYS.c.key_id, KEYS.c.tenant, KEYS.c.created_at, KEYS.c.revoked_at)
        with self.engine.connect() as conn:
            return [dict(row._mapping) for row in conn.execute(query.order_by(KEYS.c.created_at))]

    def authenticate(self, token: str) -> Tenant | None:
        """The tenant of a valid, unrevoked key; None for anything else."""
        parts = split_token(token)
        if parts is None:
            return None
        key_id, secret = parts
        query = (
            sa.select(KEYS, TENANTS.c.kueue_queue)
            .join(TENANTS, TENANTS.c.name == KEYS.c.tenant)
            .where(KEYS.c.key_id == key_id)
        )
        with self.engine.connect() as conn:
            row = conn.execute(query).first()
        if row is None or row.revoked_at is not None:
            return None
        if not secret_matches(secret, row.salt, row.digest):
            return None
        return Tenant(name=row.tenant, kueue_queue=row.kueue_queue, key_id=key_id)

    def tenant_queue(self, tenant: str) -> str | None:
        with self.engine.connect() as conn:
            row = conn.execute(sa.select(TENANTS).where(TENANTS.c.name == tenant)).first()
        return None if row is None else row.kueue_queue

    # ---------------------------------------------------------------- limits (limits.py)

    def take_token(self, key_id: str, *, rate: float, burst: int, at: float) -> float:
        """Take one request's token from the key's bucket at time `at` (Unix seconds).

        Returns 0.0 when taken, else the seconds until the bucket holds one. One upsert
        refills the bucket by the time passed, capped at `burst`, and takes a token only if
        one is there (`ON CONFLICT DO UPDATE ... WHERE`): a compare-and-set on the row, so
        concurrent requests on any replica never take the same token twice. A clock behind
        the bucket's refills nothing (the elapsed time is never negative)."""
        postgres = self.engine.dialect.name == "postgresql"
        least = sa.func.least if postgres else sa.func.min
        greatest = sa.func.greatest if postgres else sa.func.max
        bucket = RATE_BUCKETS.c
        level = least(bucket.tokens + greatest(at - bucket.updated_at, 0.0) * rate, float(burst))
        insert = (postgresql if postgres else sqlite).insert(RATE_BUCKETS)
        statement = (
            insert.values(key_id=key_id, tokens=float(burst) - 1, updated_at=at)
            .on_conflict_do_update(
                index_elements=["key_id"],
                set_={"tokens": level - 1, "updated_at": greatest(bucket.updated_at, at)},
                where=level >= 1,
            )
            .returning(bucket.tokens)
        )
        with self.engine.begin() as conn:
            if conn.execute(statement).first() is not None:
                return 0.0
            row = conn.execute(
                sa.select(bucket.tokens, bucket.updated_at).where(bucket.key_id == key_id)
            ).one()
        now_level = min(float(burst), row.tokens + max(0.0, at - row.updated_at) * rate)
        return max(0.0, (1 - now_level) / rate)

    def usage(self, tenant: str, conn: sa.Connection | None = None) -> Usage:
        """What the tenant holds now: files, their bytes, batches not yet final."""
        files = sa.select(sa.func.count(), sa.func.coalesce(sa.func.sum(FILES.c.bytes), 0))
        batches = sa.select(sa.func.count()).where(
            BATCHES.c.tenant == tenant, BATCHES.c.status.in_(IN_FLIGHT_STATUSES)
        )
        with contextlib.ExitStack() as stack:
            if conn is None:
                conn = stack.enter_context(self.engine.connect())
            count, stored = conn.execute(files.where(FILES.c.tenant == tenant)).one()
            in_flight = conn.execute(batches).scalar_one()
        return Usage(files=count, stored_bytes=int(stored), batches_in_flight=in_flight)

    @contextlib.contextmanager
    def tenant_writes(self, tenant: str) -> Iterator[sa.Connection]:
        """A transaction in which no other writer counts or adds the tenant's files or
        batches: on PostgreSQL a transaction-scoped advisory lock on the tenant (held
        across every replica), on SQLite a lock of this process (SQLite serves one)."""
        if self.engine.dialect.name == "postgresql":
            with self.engine.begin() as conn:
                conn.execute(
                    sa.text("SELECT pg_advisory_xact_lock(hashtext(:name))"),
                    {"name": f"{PREFIX}quota:{tenant}"},
                )
                yield conn
        else:
            with self._local_lock, self.engine.begin() as conn:
                yield conn

    # ---------------------------------------------------------------- files

    def add_file(
        self,
        record: dict[str, Any],
        *,
        max_files: int | None = None,
        max_bytes: int | None = None,
    ) -> Usage | None:
        """Insert a file row; with `max_files` / `max_bytes`, only if the tenant stays
        within them counting this row (its `bytes`: what the upload reserves). Returns what
        the tenant held before it (None without limits).

        Raises:
            QuotaExceeded: the row would take the tenant over a limit; nothing was written.
        """
        if max_files is None and max_bytes is None:
            with self.engine.begin() as conn:
                conn.execute(FILES.insert().values(**record))
            return None
        with self.tenant_writes(record["tenant"]) as conn:
            held = self.usage(record["tenant"], conn)
            if max_files is not None and held.files + 1 > max_files:
                raise QuotaExceeded("files", held.files)
            if max_bytes is not None and held.stored_bytes + record["bytes"] > max_bytes:
                raise QuotaExceeded("bytes", held.stored_bytes)
            conn.execute(FILES.insert().values(**record))
        return held

    def put_file(self, record: dict[str, Any]) -> None:
        """Insert or replace a file row by id (output files are rewritten on a re-finalize).

        One upsert (`INSERT ... ON CONFLICT (id) DO UPDATE`), so two finalizers of one batch
        (a poll and the reconcile loop, or two replicas) both succeed: a delete then an
        insert let both inserts through on PostgreSQL, and the second broke the unique id."""
        dialect = {"postgresql": postgresql, "sqlite": sqlite}[self.engine.dialect.name]
        statement = dialect.insert(FILES).values(**record)
        changed = {name: statement.excluded[name] for name in record if name != "id"}
        with self.engine.begin() as conn:
            conn.execute(statement.on_conflict_do_update(index_elements=["id"], set_=changed))

    def get_file(self, file_id: str, tenant: str) -> dict[str, Any] | None:
        query = sa.select(FILES).where(FILES.c.id == file_id, FILES.c.tenant == tenant)
        with self.engine.connect() as conn:
            row = conn.execute(query).first()
        return None if row is None else dict(row._mapping)

    def delete_file(self, file_id: str, tenant: str) -> bool:
        with self.engine.begin() as conn:
            result = conn.execute(
                FILES.delete().where(FILES.c.id == file_id, FILES.c.tenant == tenant)
            )
        return result.rowcount == 1

    def files_expired_by(self, at: int, limit: int = 500) -> list[dict[str, Any]]:
        """Files whose `expires_at` has passed at `at` (batch outputs with an expiry)."""
        query = (
            sa.select(FILES)
            .where(FILES.c.expires_at.is_not(None), FILES.c.expires_at <= at)
            .order_by(FILES.c.expires_at)
            .limit(limit)
        )
        with self.engine.connect() as conn:
            return [dict(row._mapping) for row in conn.execute(query)]

    def files_uploading_since(self, before: int, limit: int = 500) -> list[dict[str, Any]]:
        """Files still `uploaded` (bytes coming in) that were created before `before`."""
        query = (
            sa.select(FILES)
            .where(FILES.c.status == "uploaded", FILES.c.created_at < before)
            .order_by(FILES.c.seq)
            .limit(limit)
        )
        with self.engine.connect() as conn:
            return [dict(row._mapping) for row in conn.execute(query)]

    def list_files(
        self,
        tenant: str,
        *,
        purpose: str | None = None,
        after: str | None = None,
        limit: int = 10_000,
        order: str = "desc",
    ) -> tuple[list[dict[str, Any]], bool]:
        """A tenant's files by creation (`order` "desc": newest first, or "asc"), starting
        after the file `after`; and whether more follow. An `after` that is not the tenant's
        file starts from the first."""
        query = sa.select(FILES).where(FILES.c.tenant == tenant)
        if purpose:
            query = query.where(FILES.c.purpose == purpose)
        rows, has_more = _page(
            self.engine, FILES, query, tenant, after=after, limit=limit, order=order
        )
        return [dict(row._mapping) for row in rows], has_more

    # ---------------------------------------------------------------- batches

    def add_batch(self, record: dict[str, Any], *, max_in_flight: int | None = None) -> None:
        """Insert a batch row; with `max_in_flight`, only if the tenant then has at most
        that many batches not yet final.

        Raises:
            QuotaExceeded: the tenant has `max_in_flight` already; nothing was written.
        """
        record = dict(record)
        for name in ("metadata", "errors"):
            if record.get(name) is not None:
                record[name] = json.dumps(record[name])
        if max_in_flight is None:
            with self.engine.begin() as conn:
                conn.execute(BATCHES.insert().values(**record))
            return
        with self.tenant_writes(record["tenant"]) as conn:
            held = self.usage(record["tenant"], conn).batches_in_flight
            if held >= max_in_flight:
                raise QuotaExceeded("batches", held)
            conn.execute(BATCHES.insert().values(**record))

    def get_batch(self, batch_id: str, tenant: str | None = None) -> dict[str, Any] | None:
        query = sa.select(BATCHES).where(BATCHES.c.id == batch_id)
        if tenant is not None:
            query = query.where(BATCHES.c.tenant == tenant)
        with self.engine.connect() as conn:
            row = conn.execute(query).first()
        return None if row is None else _batch(row)

    def list_batches(
        self, tenant: str, *, after: str | None = None, limit: int = 20
    ) -> tuple[list[dict[str, Any]], bool]:
        """A tenant's batches, newest first, starting after the batch `after`; and whether
        more follow. An `after` that is not the tenant's batch starts from the newest."""
        query = sa.select(BATCHES).where(BATCHES.c.tenant == tenant)
        rows, has_more = _page(self.engine, BATCHES, query, tenant, after=after, limit=limit)
        return [_batch(row) for row in rows], has_more

    def batches_in(self, statuses: Iterable[str], limit: int = 500) -> list[dict[str, Any]]:
        query = (
            sa.select(BATCHES)
            .where(BATCHES.c.status.in_(list(statuses)))
            .order_by(BATCHES.c.seq)
            .limit(limit)
        )
        with self.engine.connect() as conn:
            return [_batch(row) for row in conn.execute(query)]

    def update_batch(
        self,
        batch_id: str,
        *,
        when_status: Iterable[str] | None = None,
        notify: Sequence[tuple[str, str]] = (),
        **values: Any,
    ) -> bool:
        """Set `values` on a batch; with `when_status`, only if its status is one of them.
        Returns whether a row changed (False: another writer moved it first).

        When `values` set a final status and the row changed, the batch's event and one
        delivery per `notify` endpoint (name, url) are written in the same transaction:
        the change and its webhooks happen together, once (webhooks.py)."""
        for name in ("metadata", "errors"):
            if values.get(name) is not None:
                values[name] = json.dumps(values[name])
        statement = BATCHES.update().where(BATCHES.c.id == batch_id)
        if when_status is not None:
            statement = statement.where(BATCHES.c.status.in_(list(when_status)))
        status = values.get("status")
        with self.engine.begin() as conn:
            changed = conn.execute(statement.values(**values)).rowcount == 1
            if changed and notify and status in FINAL_STATUSES:
                stamp = values.get(f"{status}_at") or now()
                _add_event(conn, batch_id, status, stamp, notify)
            return changed

    # ---------------------------------------------------------------- webhook outbox

    def due_deliveries(self, at: float, limit: int = 100) -> list[dict[str, Any]]:
        """Deliveries neither done nor given up whose next try is due at `at`, oldest first,
        each with its event's `body` and `type`."""
        query = (
            sa.select(WEBHOOK_DELIVERIES, WEBHOOK_EVENTS.c.body, WEBHOOK_EVENTS.c.type)
            .join(WEBHOOK_EVENTS, WEBHOOK_EVENTS.c.id == WEBHOOK_DELIVERIES.c.event_id)
            .where(
                WEBHOOK_DELIVERIES.c.delivered_at.is_(None),
                WEBHOOK_DELIVERIES.c.abandoned_at.is_(None),
                WEBHOOK_DELIVERIES.c.next_attempt_at <= at,
            )
            .order_by(WEBHOOK_DELIVERIES.c.next_attempt_at, WEBHOOK_DELIVERIES.c.seq)
            .limit(limit)
        )
        with self.engine.connect() as conn:
            return [dict(row._mapping) for row in conn.execute(query)]

    def claim_delivery(self, delivery: dict[str, Any], until: float) -> bool:
        """Take a due delivery for one try (compare-and-set on its next try time, moved to
        `until`): another sender that read it too gets False and leaves it."""
        statement = (
            WEBHOOK_DELIVERIES.update()
            .where(
                WEBHOOK_DELIVERIES.c.id == delivery["id"],
                WEBHOOK_DELIVERIES.c.next_attempt_at == delivery["next_attempt_at"],
                WEBHOOK_DELIVERIES.c.delivered_at.is_(None),
            )
            .values(next_attempt_at=until)
        )
        with self.engine.begin() as conn:
            return conn.execute(statement).rowcount == 1

    def record_try(
        self,
        delivery_id: str,
        *,
        attempts: int,
        delivered: bool,
        next_attempt_at: float | None,
        error: str | None,
    ) -> None:
        """What one try came to: delivered, due again at `next_attempt_at`, or given up
        (neither)."""
        values: dict[str, Any] = {"attempts": attempts, "last_error": error}
        if delivered:
            values["delivered_at"] = now()
        elif next_attempt_at is None:
            values["abandoned_at"] = now()
        else:
            values["next_attempt_at"] = next_attempt_at
        statement = WEBHOOK_DELIVERIES.update().where(WEBHOOK_DELIVERIES.c.id == delivery_id)
        with self.engine.begin() as conn:
            conn.execute(statement.values(**values))

    def deliveries(self, batch_id: str) -> list[dict[str, Any]]:
        """Every delivery of a batch's events, with the event type (oldest first)."""
        query = (
            sa.select(WEBHOOK_DELIVERIES, WEBHOOK_EVENTS.c.type)
            .join(WEBHOOK_EVENTS, WEBHOOK_EVENTS.c.id == WEBHOOK_DELIVERIES.c.event_id)
            .where(WEBHOOK_EVENTS.c.batch_id == batch_id)
            .order_by(WEBHOOK_DELIVERIES.c.seq)
        )
        with self.engine.connect() as conn:
            return [dict(row._mapping) for row in conn.execute(query)]


def _add_event(
    conn: sa.Connection, batch_id: str, status: str, stamp: int, notify: Sequence[tuple[str, str]]
) -> None:
    """The event of a batch that reached `status`, and a delivery per endpoint, due now."""
    tenant = conn.execute(sa.select(BATCHES.c.tenant).where(BATCHES.c.id == batch_id)).scalar()
    event_id, body = batch_event(batch_id, status, stamp)
    conn.execute(
        WEBHOOK_EVENTS.insert().values(
            id=event_id,
            tenant=tenant,
            batch_id=batch_id,
            type=f"batch.{status}",
            created_at=stamp,
            body=body.decode(),
        )
    )
    conn.execute(
        WEBHOOK_DELIVERIES.insert(),
        [
            {
                "id": new_webhook_id(),
                "event_id": event_id,
                "tenant": tenant,
                "endpoint": name,
                "url": url,
                "attempts": 0,
                "next_attempt_at": float(stamp),
            }
            for name, url in notify
        ],
    )


def _page(
    engine: sa.Engine,
    table: sa.Table,
    query: sa.Select,
    tenant: str,
    *,
    after: str | None,
    limit: int,
    order: str = "desc",
) -> tuple[list[Any], bool]:
    """One page of `query` over `table` in insertion order (`seq`), keyset-paginated: the
    rows after the tenant's row `after` (an unknown id starts from the first), at most
    `limit` of them, and whether more follow (one extra row is read to tell)."""
    ascending = order == "asc"
    with engine.connect() as conn:
        if after:
            cursor = conn.execute(
                sa.select(table.c.seq).where(table.c.id == after, table.c.tenant == tenant)
            ).scalar()
            if cursor is not None:
                query = query.where(table.c.seq > cursor if ascending else table.c.seq < cursor)
        by = table.c.seq.asc() if ascending else table.c.seq.desc()
        rows = conn.execute(query.order_by(by).limit(limit + 1)).all()
    return rows[:limit], len(rows) > limit


def _batch(row: Any) -> dict[str, Any]:
    record = dict(row._mapping)
    for name in ("metadata", "errors"):
        if record.get(name) is not None:
            record[name] = json.loads(record[name])
    return record


def _add_missing_columns(engine: sa.Engine) -> None:
    """Add the nullable columns a newer version declares to tables an older one created
    (`create_all` creates missing tables only). Columns are only ever added, never changed,
    so this is the whole migration story; it is a no-op on an up-to-date database."""
    inspector = sa.inspect(engine)
    with engine.begin() as conn:
        for table in METADATA.sorted_tables:
            present = {column["name"] for column in inspector.get_columns(table.name)}
            for column in table.columns:
                if column.name in present:
                    continue
                if not column.nullable:
                    raise RuntimeError(
                        f"table {table.name} lacks the required column {column.name}; "
                        "it was created by an incompatible version: migrate it by hand"
                    )
                kind = column.type.compile(dialect=engine.dialect)
                add = f'ALTER TABLE "{table.name}" ADD COLUMN "{column.name}" {kind}'
                conn.execute(sa.text(add))
