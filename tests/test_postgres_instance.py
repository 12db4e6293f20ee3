"""A Dagster instance on a real PostgreSQL server (dagster-postgres), as deployed.

`make test` starts a throwaway server (deploy/local/test-postgres.sh) and passes its URL in
GPUINFER_TEST_POSTGRES_URL. Without it the test fails and says how to start one: it is
never silently skipped.
"""

from __future__ import annotations

import os
import stat
import sys
import uuid

import dagster as dg
import psycopg2
import pytest
from support import cpu_resource, materialize_partitions, model_loads, step_attempts, write_parquet

from dagster_gpuinfer import InputSpec, inference_assets

pytestmark = pytest.mark.engine


@pytest.fixture
def postgres_url():
    url = os.environ.get("GPUINFER_TEST_POSTGRES_URL")
    if not url:
        pytest.fail(
            "GPUINFER_TEST_POSTGRES_URL is not set: run the suite with `make test`, or start a "
            "server with `bash deploy/local/test-postgres.sh` and export the URL it prints"
        )
    database = f"dagster_{uuid.uuid4().hex[:10]}"
    admin = psycopg2.connect(url)
    admin.autocommit = True
    admin.cursor().execute(f"CREATE DATABASE {database}")
    yield url.rsplit("/", 1)[0] + f"/{database}"
    admin.cursor().execute(f"DROP DATABASE {database} WITH (FORCE)")
    admin.close()


def flaky_python(tmp_path) -> str:
    """A worker interpreter that fails every other launch: a planted transient failure
    (like a pod lost to a node failure) on the first attempt of each run."""
    counter = tmp_path / "launches"
    script = tmp_path / "flaky-python"
    script.write_text(
        "#!/usr/bin/env bash\n"
        f"n=$(( $(cat {counter} 2>/dev/null || echo 0) + 1 )); echo $n > {counter}\n"
        "if [ $((n % 2)) -eq 1 ]; then\n"
        '  echo "planted transient failure (launch $n)" >&2; exit 3\n'
        "fi\n"
        f'exec {sys.executable} "$@"\n'
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(script)


def test_backfill_on_postgres_instance_survives_transient_failures_by_retry(
    tmp_path, postgres_url, minilm_dir
):
    keys = [f"s{i}" for i in range(4)]
    for key in keys:
        write_parquet(
            tmp_path / "in" / f"{key}.parquet",
            {
                "id": [f"{key}-{i}" for i in range(20)],
                "text": [f"row {i} of {key}" for i in range(20)],
            },
        )
    pipeline = inference_assets(
        name="emb",
        model=minilm_dir,
        task="embed",
        input=InputSpec(uri=str(tmp_path / "in" / "{partition_key}.parquet")),
        output_root=str(tmp_path / "out"),
        partitions_def=dg.StaticPartitionsDefinition(keys),
        backfill_policy=dg.BackfillPolicy.multi_run(max_partitions_per_run=2),
        retry_policy=dg.RetryPolicy(max_retries=2),
    )
    load_log = tmp_path / "loads.log"
    resource = cpu_resource(load_log, python_executable=flaky_python(tmp_path))
    overrides = {"storage": {"postgres": {"postgres_url": postgres_url}}}
    with dg.instance_for_test(overrides=overrides) as instance:
        assert type(instance.run_storage).__name__ == "PostgresRunStorage"
        results = [
            materialize_partitions(pipeline, batch, resource=resource, instance=instance)
            for batch in (keys[:2], keys[2:])
        ]
        assert all(r.success for r in results)
        assert [step_attempts(r) for r in results] == [2, 2]
        assert instance.get_materialized_partitions(pipeline.output_asset.key) == set(keys)
        runs = instance.get_run_records()
        assert len(runs) == 2 and all(r.dagster_run.is_success for r in runs)
    assert model_loads(load_log) == 2  # failed attempts died before loading anything
    assert (tmp_path / "launches").read_text().strip() == "4"
