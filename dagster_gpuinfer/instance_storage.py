"""The Dagster instance's PostgreSQL storage, patient with a store that restarts.

dagster_postgres gives up on a refused connection after 5 retries waiting (2^n - 1) x 0.2 s
(+- 0.2 s), about 11 s in all, and the limit cannot be configured (dagster#21209). A
PostgreSQL restart, a managed failover (tens of seconds) or a node drain of the database pod
outlasts that. When it does, a step whose worker pod has committed its partitions fails
writing its STEP_OUTPUT event, the run fails, and Dagster records committed partitions as
failed: neither the step's RetryPolicy (a framework error) nor run retries on
`retry_on_asset_or_op_failure: false` try it again. Measured by the chaos harness's
`--store-down-s 20` probe (bench/results/chaos-2026-12-05b/short-store-down-20s).

These classes are dagster_postgres's run, event log and schedule storages with one change:
opening a connection is retried until `reconnect_for_s` (default 120 s) has passed, with
backoff capped at 5 s, so every Dagster process (run worker, daemon, webserver) waits out
the outage and goes on. Only opening a connection is retried: nothing has been sent yet, so
no statement can run twice. A statement already running when the server goes away still
fails as it does in dagster_postgres. Name them in dagster.yaml (deploy/dagster.yaml):

    run_storage:
      module: dagster_gpuinfer.instance_storage
      class: PatientPostgresRunStorage
      config: {postgres_db: ..., reconnect_for_s: 120}

and the same for `event_log_storage` (PatientPostgresEventLogStorage) and
`schedule_storage` (PatientPostgresScheduleStorage). Needs the `postgres` extra.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import sqlalchemy
from dagster import Field
from dagster._serdes import ConfigurableClassData
from dagster_postgres.event_log import PostgresEventLogStorage
from dagster_postgres.run_storage import PostgresRunStorage
from dagster_postgres.schedule_storage import PostgresScheduleStorage
from dagster_postgres.utils import (
    DagsterPostgresException,
    get_token_provider_from_config,
    pg_config,
    pg_url_from_config,
)

RECONNECT_FOR_S = 120.0
FIRST_WAIT_S = 0.2
LONGEST_WAIT_S = 5.0
# What dagster_postgres's own retry catches: refused, reset, starting up, pool timeout.
RETRIED = (
    sqlalchemy.exc.DatabaseError,
    sqlalchemy.exc.OperationalError,
    sqlalchemy.exc.TimeoutError,
)

log = logging.getLogger(__name__)


def connect_patiently(engine: sqlalchemy.engine.Engine, reconnect_for_s: float):
    """`engine.connect()`, tried again until `reconnect_for_s` has passed since the first try."""
    deadline = time.monotonic() + reconnect_for_s
    wait_s = FIRST_WAIT_S
    tries = 0
    while True:
        tries += 1
        try:
            connection = engine.connect()
        except RETRIED as exc:
            left_s = deadline - time.monotonic()
            if left_s <= 0:
                raise DagsterPostgresException(
                    f"PostgreSQL at {engine.url.host}:{engine.url.port} refused {tries} "
                    f"connections over {reconnect_for_s:.0f} s (reconnect_for_s in dagster.yaml): "
                    f"{exc}"
                ) from exc
            log.warning(
                "PostgreSQL connection failed (try %d, %.0f s left, next in %.1f s): %s",
                tries,
                left_s,
                min(wait_s, left_s),
                exc,
            )
            time.sleep(min(wait_s, left_s))
            wait_s = min(wait_s * 2, LONGEST_WAIT_S)
            continue
        if tries > 1:
            log.warning("PostgreSQL connection open again after %d tries", tries)
        return connection


def patient_config() -> dict[str, Field]:
    """dagster_postgres's storage config plus `reconnect_for_s`."""
    return {
        **pg_config(),
        "reconnect_for_s": Field(
            float,
            default_value=RECONNECT_FOR_S,
            is_required=False,
            description="Seconds to keep trying to open a connection to a PostgreSQL server "
            "that refuses it (a restart, a failover) before the operation fails.",
        ),
    }


class _Patient:
    """A dagster_postgres storage whose connections are opened with `connect_patiently`."""

    _engine: sqlalchemy.engine.Engine

    def __init__(
        self,
        postgres_url: str,
        should_autocreate_tables: bool = True,
        inst_data: ConfigurableClassData | None = None,
        token_provider: Any = None,
        reconnect_for_s: float = RECONNECT_FOR_S,
    ) -> None:
        # Set before the storage's own __init__, which opens the first connection.
        self.reconnect_for_s = float(reconnect_for_s)
        super().__init__(  # type: ignore[call-arg]
            postgres_url,
            should_autocreate_tables,
            inst_data=inst_data,
            token_provider=token_provider,
        )

    @contextmanager
    def _patient_connection(self) -> Iterator[Any]:
        connection = connect_patiently(self._engine, self.reconnect_for_s)
        try:
            yield connection
        finally:
            connection.close()

    @classmethod
    def config_type(cls) -> dict[str, Field]:
        return patient_config()

    @classmethod
    def from_config_value(
        cls, inst_data: ConfigurableClassData | None, config_value: Mapping[str, Any]
    ):
        return cls(
            postgres_url=pg_url_from_config(config_value),
            should_autocreate_tables=config_value.get("should_autocreate_tables", True),
            inst_data=inst_data,
            token_provider=get_token_provider_from_config(config_value),
            reconnect_for_s=config_value.get("reconnect_for_s", RECONNECT_FOR_S),
        )


class PatientPostgresRunStorage(_Patient, PostgresRunStorage):
    """dagster_postgres's run storage; opening a connection waits out a restart."""

    def connect(self):
        return self._patient_connection()


class PatientPostgresEventLogStorage(_Patient, PostgresEventLogStorage):
    """dagster_postgres's event log storage; opening a connection waits out a restart."""

    def _connect(self):
        return self._patient_connection()


class PatientPostgresScheduleStorage(_Patient, PostgresScheduleStorage):
    """dagster_postgres's schedule storage; opening a connection waits out a restart."""

    def connect(self, run_id: str | None = None):
        return self._patient_connection()
