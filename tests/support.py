"""Helpers shared by the tests: resources, shard writers, runs, event queries."""

from __future__ import annotations

import contextlib
import json
import os
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import dagster as dg
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dagster_gpuinfer import GpuInferenceResource, InferenceSpec, InputSpec, inference_assets

RANGE_START = "dagster/asset_partition_range_start"
RANGE_END = "dagster/asset_partition_range_end"


def cpu_resource(load_log: Path | None = None, **kwargs: Any) -> GpuInferenceResource:
    """The local launcher configured for vLLM's CPU build, as resources/local.py does."""
    env = {
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "VLLM_LOGGING_LEVEL": "WARNING",
    }
    if load_log is not None:
        env["GPUINFER_MODEL_LOAD_LOG"] = str(load_log)
    env.update(kwargs.pop("env", {}))
    overrides = {"gpu_memory_utilization": 0.2, "enforce_eager": True}
    overrides.update(kwargs.pop("engine_overrides", {}))
    return GpuInferenceResource(launcher="local", env=env, engine_overrides=overrides, **kwargs)


def model_loads(load_log: Path) -> int:
    return len(load_log.read_text().splitlines()) if load_log.exists() else 0


def write_parquet(
    path: Path, columns: dict[str, list[Any]], row_group_size: int | None = None
) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns), path, row_group_size=row_group_size)
    return path


def write_jsonl(path: Path, records: Sequence[Any]) -> Path:
    """Each record is a dict (dumped as JSON) or bytes/str (written verbatim, for bad lines)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as handle:
        for record in records:
            if isinstance(record, bytes):
                line = record
            elif isinstance(record, str):
                line = record.encode()
            else:
                line = json.dumps(record).encode()
            handle.write(line + b"\n")
    return path


def materialize_partitions(
    pipeline: Any,
    keys: Sequence[str],
    *,
    resource: GpuInferenceResource,
    instance: dg.DagsterInstance,
    raise_on_error: bool = True,
    run_config: dict[str, Any] | None = None,
) -> dg.ExecuteInProcessResult:
    """One Dagster run over `keys` (a partition range), as a backfill run would be."""
    return dg.materialize(
        pipeline.assets,
        selection=[pipeline.output_asset.key],
        instance=instance,
        resources={"gpu": resource},
        tags={RANGE_START: keys[0], RANGE_END: keys[-1]},
        raise_on_error=raise_on_error,
        run_config=run_config,
    )


def partition_metadata(
    instance: dg.DagsterInstance, asset_key: dg.AssetKey, partition: str
) -> dict[str, Any]:
    """The metadata of the latest materialization of one partition, as plain values."""
    records = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=asset_key, asset_partitions=[partition]), limit=1
    ).records
    assert records, f"partition {partition} of {asset_key.to_user_string()} was never materialized"
    return {k: v.value for k, v in records[0].asset_materialization.metadata.items()}


def failure_message(result: dg.ExecuteInProcessResult) -> str:
    """The text of the step failure(s) of a failed run."""
    texts = []
    for event in result.all_events:
        if event.is_step_failure:
            error = event.step_failure_data.error
            texts.append(error.to_string() if error else "")
    return "\n".join(texts)


def step_attempts(result: dg.ExecuteInProcessResult) -> int:
    return 1 + sum(1 for e in result.all_events if e.event_type_value == "STEP_UP_FOR_RETRY")


def gen_pipeline(root: Path, model: str, *, chunk_size: int, retries: int, partitions=("p0",)):
    return inference_assets(
        name="gen",
        model=model,
        task="generate",
        input=InputSpec(uri=str(root / "in" / "{partition_key}.jsonl"), text_column="prompt"),
        output_root=str(root / "out"),
        partitions_def=dg.StaticPartitionsDefinition(list(partitions)),
        engine={"max_model_len": 256},
        sampling={"max_tokens": 16},
        chunk_size=chunk_size,
        retry_policy=dg.RetryPolicy(max_retries=retries),
    )


def write_prompts(path: Path, rows: int) -> None:
    write_jsonl(
        path,
        [{"id": f"id-{i}", "prompt": f"Question {i}: what is {i} plus {i}?"} for i in range(rows)],
    )


def embed_pipeline(root: Path, keys: Sequence[str], **changes: Any):
    """An embed pipeline over `root/in/{partition_key}.parquet` (model folder
    `root/model`, output under `root/out`) with static partitions `keys`; `changes` set or
    override any other argument of `inference_assets`."""
    settings = {
        "name": "emb",
        "model": str(root / "model"),
        "task": "embed",
        "input": InputSpec(uri=str(root / "in" / "{partition_key}.parquet")),
        "output_root": str(root / "out"),
        "partitions_def": dg.StaticPartitionsDefinition(list(keys)),
        **changes,
    }
    return inference_assets(**settings)


def write_text_shard(root: Path, key: str, rows: int) -> None:
    """The input shard of `key` for `embed_pipeline`: ids `<key>-<i>`, a text each."""
    write_parquet(
        root / "in" / f"{key}.parquet",
        {"id": [f"{key}-{i}" for i in range(rows)], "text": [f"{key} {i}" for i in range(rows)]},
    )


def embedding_rows(
    key: str, rows: int, dim: int, *, seed: int = 0, nan_at: int | None = None
) -> pa.Table:
    """Output rows as the embed task writes them: id, embedding (fixed-size float32 of
    `dim`, random by key and seed; NaN in the first value of row `nan_at`), prompt_tokens."""
    rng = np.random.default_rng(abs(hash((key, seed))) % (2**32))
    vectors = rng.standard_normal((rows, dim)).astype(np.float32)
    if nan_at is not None:
        vectors[nan_at, 0] = np.nan
    return pa.table(
        {
            "id": pa.array([f"{key}-{i}" for i in range(rows)], pa.string()),
            "embedding": pa.FixedSizeListArray.from_arrays(pa.array(vectors.ravel()), dim),
            "prompt_tokens": pa.array([3] * rows, pa.int32()),
        }
    )


def commit_rows(pipeline: Any, key: str, *parts: pa.Table) -> Any:
    """`commit_by_hand` of the pipeline's spec: `key` committed with `parts` as part files."""
    return commit_by_hand(InferenceSpec.model_validate(pipeline.spec), key, parts=list(parts))


def commit_by_hand(spec: Any, key: str, parts: Sequence[pa.Table] = (), **fields: Any) -> Any:
    """A partition committed as a worker leaves it: the manifest names the spec hash and the
    versions of the shard and model folder as they are now, and one part file per table of
    `parts` (none by default; with parts, rows_in and rows_out default to their rows).
    `fields` set the manifest's counts and figures (rows_in, wall_seconds, ...)."""
    import uuid

    from dagster_gpuinfer.storage import (
        FileEntry,
        Manifest,
        chunk_part_name,
        commit_partition,
        filesystem_for,
        model_version,
        partition_dir,
        source_version,
        table_to_parquet_bytes,
        write_file_entry,
    )

    fs, path = filesystem_for(partition_dir(spec.output, key), spec.storage)
    fs.create_dir(path, recursive=True)
    attempt = uuid.uuid4().hex[:8]
    entries = [
        write_file_entry(
            fs,
            path,
            chunk_part_name(spec.spec_hash(), index, attempt, ".parquet"),
            table_to_parquet_bytes(table),
            table.num_rows,
        )
        for index, table in enumerate(parts)
    ]
    rows = sum(table.num_rows for table in parts)
    fields = {"rows_in": rows, "rows_out": rows, **fields} if parts else fields
    manifest = Manifest(
        partition_key=key,
        spec_hash=spec.spec_hash(),
        source=source_version(spec, key, model=model_version(spec)),
        model=spec.model,
        task=spec.task,
        output_format=spec.output.format,
        parts=entries,
        errors=FileEntry(name="errors.parquet", rows=0, bytes=0, sha256=""),
        **fields,
    )
    return commit_partition(fs, path, manifest, [])


def postgres_server_url() -> str:
    """The suite's PostgreSQL server (GPUINFER_TEST_POSTGRES_URL, which `make test`
    starts). Fails, saying how to start one, when none is given: a skip would hide that
    the store went untested."""
    url = os.environ.get("GPUINFER_TEST_POSTGRES_URL")
    if not url:
        pytest.fail(
            "GPUINFER_TEST_POSTGRES_URL is not set: run the suite with `make test`, or start a "
            "server with `bash deploy/local/test-postgres.sh` and export the URL it prints"
        )
    return url


def pgvector_server_url() -> str:
    """The suite's PostgreSQL server with pgvector (GPUINFER_TEST_PGVECTOR_URL, which `make
    test` starts). Fails, saying how to start one, when none is given."""
    url = os.environ.get("GPUINFER_TEST_PGVECTOR_URL")
    if not url:
        pytest.fail(
            "GPUINFER_TEST_PGVECTOR_URL is not set: run the suite with `make test`, or start a "
            "server with `PY=.venv/bin/python bash deploy/local/test-pgvector.sh` and export "
            "the URL it prints"
        )
    return url


def pg_query(url: str, statement: str, params=()) -> list[tuple]:
    """The rows `statement` returns on the database at `url`."""
    import psycopg2

    with psycopg2.connect(url) as conn, conn.cursor() as cur:
        cur.execute(statement, params)
        rows = cur.fetchall()
    conn.close()
    return rows


@contextlib.contextmanager
def fresh_postgres_database(prefix: str, *, pgvector: bool = False) -> Iterator[str]:
    """A new database on the suite's PostgreSQL server (`postgres_server_url`), or its
    pgvector server (`pgvector_server_url`), dropped afterwards; yields its URL."""
    url = pgvector_server_url() if pgvector else postgres_server_url()
    import psycopg2

    database = f"{prefix}_{uuid.uuid4().hex[:10]}"
    admin = psycopg2.connect(url)
    admin.autocommit = True
    admin.cursor().execute(f"CREATE DATABASE {database}")
    try:
        yield url.rsplit("/", 1)[0] + f"/{database}"
    finally:
        admin.cursor().execute(f"DROP DATABASE {database} WITH (FORCE)")
        admin.close()
