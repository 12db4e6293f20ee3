"""The chaos run's store faults (bench/chaos/store_faults.py), without an engine: the
harness's own PostgreSQL server restarted under a Dagster instance, the batch API service
SIGKILLed with a batch in flight and started again, the injector's hand for both, and the
verdict on batches. (`make chaos` injects them during the backfill; tests/test_chaos.py
keeps a short seed.)"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import tempfile
from pathlib import Path
from types import SimpleNamespace

import dagster as dg
import psutil
import pytest
from dagster._core.test_utils import create_run_for_test

from bench.chaos.faults import KINDS, Fault, Injector, schedule
from bench.chaos.store_faults import (
    FINAL,
    OWNER,
    PREFIX,
    STORE_FAULTS,
    BatchApi,
    Postgres,
    Stores,
    batch_lines,
    inject,
    instance_storage,
    postgres,
    routes,
    stop_orphans,
    summary_rows,
    verdict,
)


def gone(pid: int, wait_s: float = 10.0) -> bool:
    """The process `pid` has ended (it may take a moment to leave once stopped)."""
    try:
        psutil.Process(pid).wait(wait_s)
    except psutil.NoSuchProcess:
        return True
    except psutil.TimeoutExpired:
        return False
    return True


@pytest.fixture(scope="module")
def server():
    with postgres() as found:
        yield found


def test_the_store_kinds_are_scheduled_like_the_others():
    assert set(STORE_FAULTS) <= set(KINDS)
    faults = schedule(11, len(KINDS), 300.0)
    assert {f.kind for f in faults} == set(KINDS)
    store = [f for f in faults if f.kind in STORE_FAULTS]
    assert all(1 <= f.seconds <= 5 and f.rate == 0 for f in store)  # a down time, no rate


@pytest.mark.parametrize("mode", ["fast", "immediate"])
def test_a_restart_is_a_new_server_process_and_the_instance_goes_on(server, tmp_path, mode):
    url = server.database(f"restart_{mode}")
    with dg.instance_for_test(overrides=instance_storage(url), temp_dir=str(tmp_path)) as instance:
        run = create_run_for_test(instance, job_name="before_the_restart")
        before = server.server_pid()
        note = server.restart(0.5, mode)
        assert server.server_pid() != before
        assert psutil.pid_exists(server.server_pid())
        assert gone(before)
        assert f"-m {mode}" in note
        assert instance.get_run_by_id(run.run_id).job_name == "before_the_restart"
        create_run_for_test(instance, job_name="after_the_restart")
        assert len(instance.get_runs()) == 2


def test_the_harness_server_is_not_a_child_of_the_harness(server):
    """`leftovers` counts this process's children: the server must not be among them."""
    children = {p.pid for p in psutil.Process().children(recursive=True)}
    assert server.server_pid() not in children


@pytest.fixture
def open_folder():
    """A folder the server's `postgres` user can enter (pytest's tmp_path is root's, 0700)."""
    folder = Path(tempfile.mkdtemp(prefix="gpuinfer-orphans-"))
    folder.chmod(0o755)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def test_a_server_left_by_a_killed_harness_is_stopped_by_the_next(open_folder):
    tmp_path = open_folder
    dead = subprocess.Popen(["true"])
    dead.wait()
    (tmp_path / f"{PREFIX}left").mkdir()
    left = Postgres(folder=tmp_path / f"{PREFIX}left").start()
    (left.folder / OWNER).write_text(str(dead.pid))  # its harness was SIGKILLed
    (tmp_path / f"{PREFIX}live").mkdir()
    (tmp_path / f"{PREFIX}live" / OWNER).write_text(str(os.getpid()))  # a harness at work
    (tmp_path / f"{PREFIX}starting").mkdir()  # not started yet: no owner
    pid = left.server_pid()
    assert pid is not None and psutil.pid_exists(pid)
    assert stop_orphans(tmp_path) == [left.folder]
    assert gone(pid)
    assert not left.folder.exists()
    assert (tmp_path / f"{PREFIX}live").exists() and (tmp_path / f"{PREFIX}starting").exists()


@pytest.fixture
def api(server, tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    url = server.database("api_dagster")
    (home / "dagster.yaml").write_text(f"storage:\n  postgres:\n    postgres_url: {url}\n")
    dg.DagsterInstance.from_config(str(home)).dispose()  # its tables, before the service
    service = BatchApi(
        folder=tmp_path,
        store_url=server.database("api_batches"),
        files_root=str(tmp_path / "files"),
        routes=routes("/models/not-loaded-here", 4),
        dagster_home=str(home),
        s3_endpoint="",
    )
    service.create_key()
    service.start()
    try:
        yield service
    finally:
        service.close()


def test_a_killed_service_comes_back_with_its_batch_in_flight(api, server):
    data, ids = batch_lines("b0", 5, random.Random(1))
    batch_id = api.submit("b0", data, ids)
    stores = Stores(server, "", api, seed=1)
    first = api.process.pid
    note = stores.inject("batch_api_restart", 0.2, random.Random(1))
    assert note is not None and f"SIGKILL pid {first}" in note and "1 batch(es) in flight" in note
    assert api.process.pid != first and gone(first)
    assert api.statuses() == {batch_id: "in_progress"}  # no run yet: still in flight
    assert api.kills == 1


def test_answers_while_the_store_is_down_are_tallied_by_kind(api, server):
    """Chaos seed 3 (session 21) counted 3 batch API 5xx answers and could not say which:
    the tally now names each kind, and a store outage's are 503 store_unavailable."""
    assert api.request("GET", "/batches").status_code == 200
    server.stop("fast")
    try:
        answer = api.request("GET", "/batches")
    finally:
        server.start()
    assert answer.status_code == 503
    tally = api.tally(timeout_s=5)
    assert tally["answers_5xx"] == 1
    assert tally["answers_5xx_by_kind"] == {"503 store_unavailable": 1}
    row = dict(summary_rows())["batch API 5xx answers"]
    assert row(SimpleNamespace(batches=tally)) == "1 (503 store_unavailable: 1)"


def test_no_batch_in_flight_means_no_restart(api, server):
    stores = Stores(server, "", api, seed=1)
    assert stores.inject("batch_api_restart", 0.1, random.Random(1)) is None
    assert api.kills == 0


def test_the_injector_skips_a_store_fault_it_cannot_do_and_records_one_done(server):
    idle = Stores(server, "", None, seed=1)
    injector = Injector([], None, None, None, 1, give_up_s=1.0, stores=idle)
    inject(injector, Fault(0.0, "batch_api_restart", 0.1), random.Random(1), 0.0)
    assert [f.kind for f in injector.skipped] == ["batch_api_restart"]
    inject(injector, Fault(0.0, "postgres_restart", 0.2), random.Random(1), 0.0)
    [done] = injector.done
    assert done.target == "postgres" and "s down" in done.note


def test_a_restart_that_does_not_come_back_is_a_problem_not_a_hang(tmp_path):
    broken = Postgres(folder=tmp_path)  # never started: stop fails
    stores = Stores(broken, "", None, seed=1)
    injector = Injector([], None, None, None, 1, give_up_s=1.0, stores=stores)
    inject(injector, Fault(0.0, "postgres_restart", 0.1), random.Random(1), 0.0)
    assert [f.kind for f in injector.skipped] == ["postgres_restart"]
    assert stores.failures and "pg_ctl stop" in stores.failures[0]


def test_the_verdict_names_batches_not_completed_and_lines_lost_or_twice():
    good = {
        "submitted": 2,
        "completed": 2,
        "statuses": {"a": "completed", "b": "completed"},
        "lines": 8,
        "lines_lost": 0,
        "lines_duplicated": 0,
        "lines_unexpected": 0,
    }
    assert verdict(SimpleNamespace(batches=good)) == []
    assert verdict(SimpleNamespace(batches={})) == []
    bad = {**good, "completed": 1, "statuses": {"a": "completed", "b": "failed"}}
    bad.update(lines_lost=2, lines_duplicated=1)
    wrong = verdict(SimpleNamespace(batches=bad))
    assert any("'b': 'failed'" in w for w in wrong)
    assert "2 batch lines lost" in wrong and "1 batch lines duplicated" in wrong
    assert "completed" in FINAL


@pytest.mark.slow
@pytest.mark.engine
def test_a_short_store_chaos_seed_completes_every_batch_line_once(tmp_path):
    """Four partitions in two runs and two batches through the batch API, with its service
    SIGKILLed while they are in flight, the PostgreSQL server restarted and a preemption:
    every row and every batch line answered once, nothing left."""
    import json

    from bench.chaos.__main__ import main

    kinds = ("postgres_restart", "batch_api_restart", "pod_delete")
    argv = ["--seed", "3", "--partitions", "4", "--per-run", "2", "--rows", "12"]
    argv += ["--chunk-size", "4", "--faults", "3", "--kinds", ",".join(kinds)]
    argv += ["--batches", "2", "--batch-lines", "8", "--span-s", "60", "--no-baseline"]
    code = main([*argv, "--results", str(tmp_path)])
    report = (tmp_path / "RESULTS.md").read_text()
    assert code == 0, report
    [chaos] = json.loads((tmp_path / "results.json").read_text())["phases"]
    assert sorted(i["fault"]["kind"] for i in chaos["injected"]) == sorted(kinds), report
    assert chaos["committed"] == chaos["asked"] == 4
    assert chaos["lost"] == chaos["duplicated"] == 0
    batches = chaos["batches"]
    assert batches["submitted"] == batches["completed"] == 2, report
    assert batches["lines"] == 16 and batches["api_kills"] == 1
    assert batches["lines_lost"] == batches["lines_duplicated"] == 0
    assert chaos["leftover_processes"] == []


def test_the_batch_api_answers_503_with_retry_after_while_its_store_is_down(api, server):
    """Seen in the chaos run's probe: with the store's server stopped every request was a
    bare `500 Internal Server Error` (text, no `Retry-After`): a client could not tell a
    store outage it should wait out from a bug. Now 503 in OpenAI's error shape, with
    `Retry-After`, and the same objects once the server is back."""
    import httpx

    data, ids = batch_lines("b0", 3, random.Random(1))
    batch_id = api.submit("b0", data, ids)
    server.stop("fast")
    try:
        upload = {"files": {"file": ("x.jsonl", data)}, "data": {"purpose": "batch"}}
        for method, path, extra in [
            ("GET", f"/batches/{batch_id}", {}),
            ("GET", "/files", {}),
            ("POST", "/files", upload),
        ]:
            answer = api.request(method, path, **extra)
            assert answer.status_code == 503, (method, path, answer.text)
            error = answer.json()["error"]
            assert error["code"] == "store_unavailable"
            assert "store" in error["message"] and "retry" in error["message"].lower()
            assert int(answer.headers["Retry-After"]) > 0
        health = httpx.get(api.base_url.removesuffix("/v1") + "/health", timeout=10)
        assert health.status_code == 503 and health.json()["error"]["code"] == "store_unavailable"
    finally:
        server.start()
    assert api.statuses() == {batch_id: "in_progress"}
    assert api.request("GET", "/files").status_code == 200


def test_the_chaos_code_location_gains_the_batch_pipeline_and_its_sensor_with_a_batch_setup():
    from bench.chaos.defs import TRANSIENT_RETRIES
    from bench.chaos.store_faults import BatchSetup, batch_defs

    assert batch_defs(SimpleNamespace(batch=None), TRANSIENT_RETRIES) == []
    batch = BatchSetup(routes("/models/m", 4), "s3://bucket/chaos-batches", "sqlite:///x.db")
    [defs] = batch_defs(SimpleNamespace(batch=batch), TRANSIENT_RETRIES)
    [sensor] = defs.sensors
    assert sensor.name == "batch_api_sensor" and sensor.minimum_interval_seconds == 1
    [pipeline] = [
        a
        for a in defs.assets
        if isinstance(a, dg.AssetsDefinition) and dg.AssetKey("chaos_batches") in a.keys
    ]
    assert pipeline.node_def.retry_policy == TRANSIENT_RETRIES


def test_store_down_time_can_be_set_for_every_store_fault_and_only_those():
    from bench.chaos.store_faults import with_down_time

    faults = schedule(4, len(KINDS), 300.0)
    assert with_down_time(faults, None) == faults
    longer = with_down_time(faults, 20.0)
    assert [f.kind for f in longer] == [f.kind for f in faults]
    for before, after in zip(faults, longer, strict=True):
        expected = 20.0 if before.kind in STORE_FAULTS else before.seconds
        assert after.seconds == expected and after.at == before.at


def test_the_harness_waits_out_a_store_that_is_down_longer_than_dagsters_retries():
    """A 20 s PostgreSQL restart crashed the harness itself: `wait_for_backfill` got
    Dagster's 'too many retries for DB connection' after about 11 s."""
    from dagster_postgres.utils import DagsterPostgresException

    from bench.chaos.run import wait_for_backfill

    answers = [DagsterPostgresException("too many retries for DB connection")] * 2

    class Instance:
        def get_backfill(self, backfill_id):
            if answers:
                raise answers.pop()
            return SimpleNamespace(status=SimpleNamespace(value="COMPLETED_SUCCESS"))

        def get_runs(self, filters=None):
            return []

    wait_for_backfill(Instance(), "b1", timeout_s=60)
    assert answers == []


def test_a_backfill_dagster_records_as_failed_is_no_pass_even_with_every_row_in_s3():
    """The 20 s store-down probe printed PASS with its backfill COMPLETED_FAILED: the
    worker had committed both partitions, then the step's output event could not be
    written (Dagster's connection retries end after about 11 s)."""
    from bench.chaos.report import verdict as report_verdict

    phase = SimpleNamespace(
        committed=4, asked=4, lost=0, duplicated=0, unexpected=0, leftover_processes=[],
        backfill_status="COMPLETED_FAILED", runs_failed=1, problems=[], batches={},
    )  # fmt: skip
    assert report_verdict(phase) == ["backfill COMPLETED_FAILED: 1 run(s) failed"]
    phase.backfill_status, phase.runs_failed = "COMPLETED_SUCCESS", 0
    assert report_verdict(phase) == []
