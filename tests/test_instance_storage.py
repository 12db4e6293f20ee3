"""The deployed instance storage waits out a PostgreSQL restart longer than dagster_postgres's
own retries (dagster_gpuinfer/instance_storage.py), on a real server stopped and started with
pg_ctl (the chaos harness's private server), through a real run on a real instance."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import dagster as dg
import pytest
import yaml
from dagster_postgres.utils import DagsterPostgresException

from bench.chaos.store_faults import Postgres, instance_storage, postgres
from dagster_gpuinfer.instance_storage import (
    PatientPostgresEventLogStorage,
    PatientPostgresRunStorage,
    PatientPostgresScheduleStorage,
)

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
# dagster_postgres gives up after 5 retries waiting (2^n - 1) x 0.2 s +- 0.2 s: at most
# 12.4 s. The outage outlasts that by a margin.
DOWN_S = 20.0


@pytest.fixture(scope="module")
def server():
    with postgres() as found:
        yield found


def home(tmp_path: Path, name: str, storage: dict) -> Path:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "dagster.yaml").write_text(yaml.safe_dump(storage))
    return folder


def outage(server: Postgres, down_s: float) -> threading.Thread:
    """The server stopped now (`-m fast`) and started `down_s` later, from a thread."""
    server.stop("fast")
    restart = threading.Thread(target=lambda: (time.sleep(down_s), server.start()))
    restart.start()
    return restart


def test_the_deployed_storage_sections_are_the_patient_classes():
    deployed = yaml.safe_load((DEPLOY / "dagster.yaml").read_text())
    classes = {
        "run_storage": PatientPostgresRunStorage,
        "event_log_storage": PatientPostgresEventLogStorage,
        "schedule_storage": PatientPostgresScheduleStorage,
    }
    for section, cls in classes.items():
        assert deployed[section]["module"] == cls.__module__
        assert deployed[section]["class"] == cls.__name__
        assert deployed[section]["config"]["reconnect_for_s"] >= 60
    assert "storage" not in deployed  # one or the other: Dagster refuses both
    # The chaos harness's instance is the deployed one, on its own server.
    assert set(instance_storage("postgresql://x@h:1/d")) == set(classes)


def test_an_outage_past_dagster_postgres_retries_fails_its_storage_not_the_patient_one(
    server, tmp_path
):
    stock = dg.DagsterInstance.from_config(
        str(home(tmp_path, "stock", {"storage": {"postgres": {"postgres_url": server.url}}}))
    )
    patient = dg.DagsterInstance.from_config(
        str(home(tmp_path, "patient", instance_storage(server.database("patient"))))
    )
    assert isinstance(patient.event_log_storage, PatientPostgresEventLogStorage)
    got: dict[str, object] = {}

    def read(name: str, instance: dg.DagsterInstance) -> None:
        try:
            got[name] = instance.get_runs()
        except DagsterPostgresException as exc:
            got[name] = exc

    restart = outage(server, DOWN_S)
    readers = [
        threading.Thread(target=read, args=(name, instance))
        for name, instance in (("stock", stock), ("patient", patient))
    ]
    for reader in readers:
        reader.start()
    for thread in [restart, *readers]:
        thread.join(120)
    assert isinstance(got["stock"], DagsterPostgresException), got["stock"]
    assert "too many retries" in str(got["stock"])
    assert got["patient"] == []
    stock.dispose()
    patient.dispose()


def test_a_step_whose_output_event_meets_the_outage_succeeds(server, tmp_path):
    """The store goes down as the step's body returns: the STEP_OUTPUT and materialization
    events are written once it is back, and the run succeeds (with dagster_postgres's own
    storage the step fails: bench/results/chaos-2026-12-05b/short-store-down-20s)."""
    folder = home(tmp_path, "run", instance_storage(server.database("run")))
    restarts: list[threading.Thread] = []

    @dg.asset
    def committed_before_the_outage() -> int:
        restarts.append(outage(server, DOWN_S))
        return 7

    with dg.DagsterInstance.from_config(str(folder)) as instance:
        result = dg.materialize([committed_before_the_outage], instance=instance)
        restarts[0].join(120)
        assert result.success
        assert result.output_for_node("committed_before_the_outage") == 7
        key = dg.AssetKey("committed_before_the_outage")
        assert instance.get_latest_materialization_event(key).run_id == result.run_id
        run = instance.get_run_by_id(result.run_id)
        assert run.status == dg.DagsterRunStatus.SUCCESS


def test_a_store_that_stays_down_fails_with_the_setting_named(server, tmp_path):
    storage = instance_storage(server.database("gone"))
    for section in storage.values():
        section["config"]["reconnect_for_s"] = 2.0
    with dg.DagsterInstance.from_config(str(home(tmp_path, "gone", storage))) as instance:
        restart = outage(server, 6.0)
        with pytest.raises(DagsterPostgresException, match="reconnect_for_s"):
            instance.get_runs()
        restart.join(60)
        assert instance.get_runs() == []
