"""Outputs, errors and manifests on S3, through the same pyarrow layer as local files,
against a real S3 wire protocol on loopback (moto's server). The end-to-end run of the
worker on S3 (upload shards, backfill, read back with boto3) is in
tests/test_schedules_backfills.py, which shares its engine starts with the backfill."""

from __future__ import annotations

import io
import json
import posixpath
from typing import Any

import dagster as dg
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from dagster_aws.s3 import S3Resource

from dagster_gpuinfer import (
    GpuInferenceResource,
    InferenceSpec,
    InputSpec,
    Manifest,
    StorageOptions,
    inference_assets,
)
from dagster_gpuinfer.aws import gpu_settings_from_s3_resource
from dagster_gpuinfer.sensors import arrival_sensor
from dagster_gpuinfer.storage import (
    ERRORS_SCHEMA,
    FileEntry,
    commit_partition,
    committed_manifest,
    filesystem_for,
    partition_dir,
    read_errors,
    read_partition,
    source_version,
    table_to_parquet_bytes,
    verify_manifest,
    write_file_entry,
)


@pytest.fixture
def bucket(s3_server):
    return s3_server.new_bucket("storage")


@pytest.fixture
def storage(s3_server) -> StorageOptions:
    return StorageOptions(
        endpoint_url=s3_server.endpoint_url, region=s3_server.region, allow_http=True
    )


@pytest.fixture
def fault_proxy(s3_server):
    """bench/chaos's fault-injecting proxy in front of the loopback S3 server, and storage
    options that go through it."""
    from urllib.parse import urlparse

    from bench.chaos.s3_proxy import FaultProxy

    upstream = urlparse(s3_server.endpoint_url)
    proxy = FaultProxy("127.0.0.1", (upstream.hostname, upstream.port), seed=1).start()
    try:
        yield (
            proxy,
            StorageOptions(endpoint_url=proxy.endpoint, region=s3_server.region, allow_http=True),
        )
    finally:
        proxy.stop()


def make_spec(
    bucket: str, storage: StorageOptions, model: str = "sentence-transformers/all-MiniLM-L6-v2"
) -> InferenceSpec:
    return InferenceSpec(
        model=model,
        task="embed",
        input=InputSpec(uri=f"s3://{bucket}/in/{{partition_key}}.jsonl"),
        output={"root": f"s3://{bucket}/out", "asset_name": "vectors"},
        storage=storage,
        partition_keys=["day/1"],
    )


def commit_example(spec: InferenceSpec, key: str) -> Manifest:
    """Commit a partition the way the worker does: part file, errors, then the manifest,
    which records the version of the shard it was computed from."""
    shard_fs, shard_path = filesystem_for(spec.input.shard_uri(key), spec.storage)
    with shard_fs.open_output_stream(shard_path) as out:
        out.write(b'{"id": "a", "text": "x"}\n')
    fs, path = filesystem_for(partition_dir(spec.output, key), spec.storage)
    part = pa.table({"id": ["a", "b", "c"], "embedding": [[0.0, 1.0], [1.0, 0.0], [0.6, 0.8]]})
    entry = write_file_entry(
        fs, path, f"part-{spec.spec_hash()}-00000.parquet", table_to_parquet_bytes(part), 3
    )
    # A leftover of an earlier attempt that the commit must clear.
    write_file_entry(fs, posixpath.join(path, "_chunks", spec.spec_hash()), "00000.json", b"{}", 0)
    errors = pa.Table.from_pylist(
        [
            {
                "id": "d",
                "source": "s3://x",
                "row": 3,
                "error_type": "empty",
                "message": "row 4 is empty; the row was quarantined",
                "prompt_tokens": None,
            }
        ],
        schema=ERRORS_SCHEMA,
    )
    manifest = Manifest(
        partition_key=key,
        spec_hash=spec.spec_hash(),
        source=source_version(spec, key, model=None),
        model=spec.model,
        task=spec.task,
        output_format="parquet",
        rows_in=4,
        rows_out=3,
        rows_errored=1,
        parts=[entry],
        errors=FileEntry(name="errors.parquet", rows=0, bytes=0, sha256=""),
        error_types={"empty": 1},
    )
    return commit_partition(fs, path, manifest, [errors], spec.storage)


def test_committed_partition_on_s3_reads_back_with_boto3_and_through_its_manifest(
    s3_server, bucket, storage
):
    spec = make_spec(bucket, storage)
    commit_example(spec, "day/1")

    keys = s3_server.keys(bucket, "out/")
    prefix = "out/vectors/day%2F1/"  # "/" in a key never adds a folder level
    files = sorted(k[len(prefix) :] for k in keys if not k.endswith("/"))
    manifest = Manifest.model_validate_json(s3_server.read(bucket, prefix + "_SUCCESS"))
    assert files == sorted(
        ["_SUCCESS", manifest.errors.name, f"part-{spec.spec_hash()}-00000.parquet"]
    )
    assert not [k for k in keys if "_chunks/" in k or ".tmp-" in k]

    manifest = Manifest.model_validate_json(s3_server.read(bucket, prefix + "_SUCCESS"))
    assert (manifest.rows_in, manifest.rows_out, manifest.rows_errored) == (4, 3, 1)
    part = pq.read_table(io.BytesIO(s3_server.read(bucket, prefix + manifest.parts[0].name)))
    assert part.column("id").to_pylist() == ["a", "b", "c"]
    errors = pq.read_table(io.BytesIO(s3_server.read(bucket, prefix + manifest.errors.name)))
    assert errors.column("error_type").to_pylist() == ["empty"]

    assert read_partition(spec.output, "day/1", storage).column("id").to_pylist() == ["a", "b", "c"]
    assert read_errors(spec.output, "day/1", storage).num_rows == 1
    fs, path = filesystem_for(partition_dir(spec.output, "day/1"), storage)
    assert verify_manifest(fs, path, manifest) == []
    assert committed_manifest(spec, "day/1", model=None) == manifest
    other = make_spec(bucket, storage, model="sentence-transformers/other")
    assert committed_manifest(other, "day/1", model=None) is None


def test_a_rewritten_shard_on_s3_makes_its_committed_partition_stale(s3_server, bucket, storage):
    spec = make_spec(bucket, storage)
    manifest = commit_example(spec, "day/1")
    etag = s3_server.client.head_object(Bucket=bucket, Key="in/day/1.jsonl")["ETag"].strip('"')
    assert manifest.source is not None and manifest.source.input.startswith(f"s3:{etag}:")
    assert committed_manifest(spec, "day/1", model=None) == manifest

    # Same key, same size, other bytes: the ETag (the content's digest) changes.
    rewritten = b'{"id": "a", "text": "y"}\n'
    s3_server.client.put_object(Bucket=bucket, Key="in/day/1.jsonl", Body=rewritten)
    assert committed_manifest(spec, "day/1", model=None) is None
    # The shard removed: nothing proves the outputs are its.
    s3_server.client.delete_object(Bucket=bucket, Key="in/day/1.jsonl")
    assert committed_manifest(spec, "day/1", model=None) is None


def test_a_tampered_part_file_on_s3_fails_verification(s3_server, bucket, storage):
    spec = make_spec(bucket, storage)
    manifest = commit_example(spec, "day/1")
    short = table_to_parquet_bytes(pa.table({"id": ["a"], "embedding": [[0.0, 1.0]]}))
    s3_server.client.put_object(
        Bucket=bucket, Key=f"out/vectors/day%2F1/{manifest.parts[0].name}", Body=short
    )
    fs, path = filesystem_for(partition_dir(spec.output, "day/1"), storage)
    problems = verify_manifest(fs, path, manifest)
    assert any("holds 1 rows, the manifest says 3" in p for p in problems)


def test_reading_an_uncommitted_partition_on_s3_says_to_materialize_it(bucket, storage):
    spec = make_spec(bucket, storage)
    with pytest.raises(
        FileNotFoundError, match=rf"no _SUCCESS in s3://{bucket}/out/vectors/day%2F9.*materialize"
    ):
        read_partition(spec.output, "day/9", storage)


def test_plain_http_endpoint_is_refused_unless_allowed(s3_server, bucket):
    storage = StorageOptions(endpoint_url=s3_server.endpoint_url, region=s3_server.region)
    with pytest.raises(ValueError, match="plain http.*s3_allow_http=True"):
        filesystem_for(f"s3://{bucket}/out", storage)


def test_the_job_spec_never_carries_credentials(s3_server, bucket):
    with pytest.raises(ValueError, match="aws_secret_access_key"):
        StorageOptions(endpoint_url=s3_server.endpoint_url, aws_secret_access_key="x")  # type: ignore[call-arg]
    s3 = S3Resource(
        endpoint_url=s3_server.endpoint_url,
        region_name=s3_server.region,
        aws_access_key_id=dg.EnvVar("RESOURCE_KEY_ID"),
        aws_secret_access_key=dg.EnvVar("RESOURCE_SECRET"),
    )
    settings = gpu_settings_from_s3_resource(s3)
    # By name only: the values are read by the worker from its own environment.
    assert settings["env_references"]["AWS_SECRET_ACCESS_KEY"] == "RESOURCE_SECRET"
    assert settings["env"] == {}
    assert settings["s3_allow_http"] is True
    gpu = GpuInferenceResource(**settings)
    spec = gpu.prepare_spec(make_spec(bucket, StorageOptions()))
    sent = json.dumps({"spec": spec.model_dump(mode="json")})  # what Pipes extras carry
    assert spec.storage.endpoint_url == s3_server.endpoint_url
    assert "RESOURCE_SECRET" not in sent and "RESOURCE_KEY_ID" not in sent


def keys_from_s3_resource_sensor(
    bucket: str, suffix: str, s3: S3Resource, **sensor_kwargs: Any
) -> list[str]:
    """One tick of an arrival sensor over `s3://bucket/in/` that uses `s3` (key `s3`), while
    the gpu resource points nowhere useful: the partition keys it registers."""
    pipeline = inference_assets(
        name=f"listed_{suffix}",
        model="/models/x",
        task="embed",
        input=InputSpec(uri=f"s3://{bucket}/in/{{partition_key}}.{suffix}"),
        output_root=f"s3://{bucket}/out",
        partitions_def=dg.DynamicPartitionsDefinition(name=f"listed_{suffix}_files"),
    )
    sensor = arrival_sensor(pipeline, s3_resource_key="s3", **sensor_kwargs)
    with dg.instance_for_test() as instance:
        context = dg.build_sensor_context(
            instance=instance,
            resources={
                "gpu": GpuInferenceResource(s3_endpoint_url="https://unused.invalid"),
                "s3": s3,
            },
        )
        result = sensor(context)
    return [k for r in result.dynamic_partitions_requests for k in r.partition_keys]


def test_sensor_lists_s3_with_the_client_of_an_s3_resource(s3_server, bucket):
    s3_server.client.put_object(Bucket=bucket, Key="in/a.jsonl", Body=b"{}\n")
    s3 = S3Resource(endpoint_url=s3_server.endpoint_url, region_name=s3_server.region)
    assert keys_from_s3_resource_sensor(bucket, "jsonl", s3) == ["a"]


def test_sensor_reads_parquet_footers_through_the_s3_resource_endpoint(s3_server, bucket):
    from dagster_gpuinfer.arrivals import SplitLargeFiles

    sink = pa.BufferOutputStream()
    pq.write_table(pa.table({"id": [str(i) for i in range(40)]}), sink, row_group_size=10)
    data = sink.getvalue().to_pybytes()
    s3_server.client.put_object(Bucket=bucket, Key="in/big.parquet", Body=data)
    s3 = S3Resource(
        endpoint_url=s3_server.endpoint_url,
        region_name=s3_server.region,
        aws_access_key_id="AKIA-FROM-RESOURCE",
        aws_secret_access_key="secret-from-resource",
    )
    split = SplitLargeFiles(min_bytes=1, parquet_rows_per_partition=20)
    keys = keys_from_s3_resource_sensor(bucket, "parquet", s3, split=split)
    assert keys == ["big@rows=0-20", "big@rows=20-40"]


def test_manifest_creation_on_s3_is_exclusive(s3_server, bucket):
    """The conditional PUT (If-None-Match) that lets exactly one racing worker commit."""
    from dagster_gpuinfer.spec import StorageOptions
    from dagster_gpuinfer.storage import create_exclusive, filesystem_for

    options = StorageOptions(
        endpoint_url=s3_server.endpoint_url, region=s3_server.region, allow_http=True
    )
    fs, path = filesystem_for(f"s3://{bucket}/out/p/_SUCCESS", options)
    assert create_exclusive(fs, path, b"first", options) is True
    assert create_exclusive(fs, path, b"second", options) is False
    assert s3_server.read(bucket, "out/p/_SUCCESS") == b"first"


@pytest.mark.parametrize("variant", ["500-after", "reset-after"])
def test_a_manifest_put_that_applied_but_failed_still_commits_the_partition(
    s3_server, bucket, storage, fault_proxy, variant
):
    """S3 applied the manifest's PUT but answered 500 (or reset the connection); the client
    retried it and its `If-None-Match` failed on the object it had just written. That is the
    commit's own manifest, not a rival's: the commit stands, keeps the errors file the
    manifest names and clears the leftovers (before the fix it raised `CommitConflict`, and
    the worker's yield then deleted its own errors file under its own manifest)."""
    proxy, through_proxy = fault_proxy
    proxy.fail_once("PUT", "/_SUCCESS", variant)
    manifest = commit_example(make_spec(bucket, through_proxy), "day/1")
    assert proxy.injected[variant] == 1
    spec = make_spec(bucket, storage)
    fs, path = filesystem_for(partition_dir(spec.output, "day/1"), spec.storage)
    assert committed_manifest(spec, "day/1", model=None) == manifest
    assert verify_manifest(fs, path, manifest) == []
    keys = s3_server.keys(bucket, "out/")
    assert not [key for key in keys if "/_chunks/" in key], keys
    assert read_errors(spec.output, "day/1", spec.storage).num_rows == 1


def test_yielding_to_a_manifest_never_deletes_a_file_it_names(tmp_path):
    """`yield_to` removes the attempt's own files the winner does not count; a file the
    winning manifest names (its errors file too) stays, whoever wrote it."""
    from dagster_gpuinfer.storage import PartitionOutput, error_file_names, list_names

    spec = InferenceSpec(
        model="m",
        task="embed",
        input=InputSpec(uri=str(tmp_path / "in" / "{partition_key}.jsonl")),
        output={"root": str(tmp_path / "out"), "asset_name": "vectors"},
        partition_keys=["p"],
    )
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "p.jsonl").write_text('{"id": "a", "text": "x"}\n')
    where = PartitionOutput.of(spec, "p", source=source_version(spec, "p", model=None))
    part = write_file_entry(
        where.fs,
        where.path,
        f"part-{spec.spec_hash()}-00000-abc.parquet",
        table_to_parquet_bytes(pa.table({"id": ["a"]})),
        1,
    )
    stray = write_file_entry(
        where.fs,
        where.path,
        f"part-{spec.spec_hash()}-00001-abc.parquet",
        table_to_parquet_bytes(pa.table({"id": ["b"]})),
        1,
    )
    manifest = commit_partition(
        where.fs,
        where.path,
        Manifest(
            partition_key="p",
            spec_hash=spec.spec_hash(),
            source=where.source,
            model="m",
            task="embed",
            output_format="parquet",
            rows_in=1,
            rows_out=1,
            rows_errored=0,
            parts=[part],
            errors=FileEntry(name="errors.parquet", rows=0, bytes=0, sha256=""),
        ),
        [],
        attempt="abc",
    )
    assert manifest.errors.name == error_file_names(spec.spec_hash(), "abc")[0]
    assert where.is_own(manifest, "abc") and not where.is_own(manifest, "abd")
    # A leftover of the same attempt that the manifest does not name.
    write_file_entry(where.fs, where.path, stray.name, b"x", 1)
    where.yield_to(manifest, "abc")
    assert verify_manifest(where.fs, where.path, manifest) == []
    assert stray.name not in list_names(where.fs, where.path)


def test_reads_and_the_conditional_commit_outlast_a_burst_of_s3_errors(
    s3_server, bucket, fault_proxy
):
    """Four 503s in a row (a flaky endpoint) on a HeadObject, as the step's manifest check
    makes, and on the conditional manifest PUT cost retries, not the chunk or the step:
    pyarrow's and boto3's default of 3 attempts gave up on them (the chaos seeds' lost runs).
    """
    from dagster_gpuinfer.storage import create_exclusive

    proxy, options = fault_proxy
    s3_server.client.put_object(Bucket=bucket, Key="burst/a", Body=b"payload")
    fs, path = filesystem_for(f"s3://{bucket}/burst/a", options)
    for _ in range(4):
        proxy.fail_once("HEAD", "/burst/a", "503-before")
    assert fs.get_file_info(path).size == len(b"payload")
    fs, path = filesystem_for(f"s3://{bucket}/burst/_SUCCESS", options)
    for _ in range(4):
        proxy.fail_once("PUT", "/burst/_SUCCESS", "503-before")
    assert create_exclusive(fs, path, b"manifest", options) is True
    assert proxy.injected["503-before"] == 8
    assert s3_server.read(bucket, "burst/_SUCCESS") == b"manifest"
