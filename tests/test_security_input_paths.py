"""Inputs: traversal partition keys refused (spec and arrival sensor), manifest part names must
be plain file names.

Security findings of issue 12 (split from test_security.py by theme)."""

from __future__ import annotations

import json

import dagster as dg
import pyarrow as pa
import pytest
from dagster_aws.s3 import S3Resource
from security_support import worker_spec

from dagster_gpuinfer import GpuInferenceResource, InputSpec, inference_assets
from dagster_gpuinfer.arrivals import WatchedFiles, scan_arrivals
from dagster_gpuinfer.listing import ListedFile
from dagster_gpuinfer.resource import InvalidInferenceSpec, validate_spec
from dagster_gpuinfer.sensors import arrival_sensor
from dagster_gpuinfer.spec import InferenceSpec
from dagster_gpuinfer.storage import (
    MANIFEST_NAME,
    FileEntry,
    filesystem_for,
    partition_dir,
    read_partition,
    table_to_parquet_bytes,
    write_bytes_atomic,
    write_file_entry,
)

# --------------------------------------------------------------------------- inputs


@pytest.mark.parametrize(
    "key",
    ["../../../etc/x", "a/../../b", "/etc/passwd", "\\\\server\\share", "a\\..\\b", "a\x00b", ".."],
)
def test_traversal_partition_keys_are_refused_naming_the_key(key):
    raw = {**worker_spec().model_dump(), "partition_keys": [key]}
    with pytest.raises(InvalidInferenceSpec) as caught:
        validate_spec(raw, where="test")
    assert repr(key) in str(caught.value)


@pytest.mark.parametrize("key", ["2026/01/a", "a..b", "big@rows=0-100", ".hidden-ok/x", "x.."])
def test_ordinary_partition_keys_pass(key):
    InferenceSpec.model_validate({**worker_spec().model_dump(), "partition_keys": [key]})


def test_a_traversal_key_cannot_read_a_local_file_outside_the_input_root(tmp_path):
    root = tmp_path / "inputs"
    root.mkdir()
    (tmp_path / "secret.jsonl").write_text('{"id": "1", "text": "not yours"}\n')
    raw = {
        **worker_spec().model_dump(),
        "input": {"uri": f"{root}/{{partition_key}}.jsonl"},
        "partition_keys": ["../secret"],
    }
    with pytest.raises(InvalidInferenceSpec, match="'../secret'"):
        validate_spec(raw, where="test")


class ListedKeys:
    """A FileLister over a fixed listing: object stores list such keys as they are."""

    def __init__(self, names: list[str]) -> None:
        self.names = sorted(names)

    def list_after(self, start_after: str):
        return iter([ListedFile(n, 10) for n in self.names if n > start_after])

    def open(self, name: str):  # pragma: no cover - no splitting here
        raise AssertionError(name)


def test_the_arrival_scan_refuses_traversal_keys_naming_them():
    watched = WatchedFiles("s3://bucket/in/{partition_key}.jsonl")
    lister = ListedKeys(
        ["good.jsonl", "a/../../etc/x.jsonl", "x\\..\\..\\up.jsonl", "2026/ok.jsonl"]
    )
    scan = scan_arrivals(
        lister, watched, start_after="", is_known=lambda _: False, max_new_files=10, max_listed=10
    )
    assert [f.name for f in scan.new_files] == ["2026/ok.jsonl", "good.jsonl"]
    reasons = dict(scan.rejected)
    assert "'a/../../etc/x'" in reasons["a/../../etc/x.jsonl"]
    assert "'x\\\\..\\\\..\\\\up'" in reasons["x\\..\\..\\up.jsonl"]


def test_the_arrival_sensor_on_s3_registers_no_traversal_key(s3_server):
    bucket = s3_server.new_bucket("traversal")
    for key in ("in/good.jsonl", "in/x/../../../etc/passwd.jsonl"):
        s3_server.client.put_object(Bucket=bucket, Key=key, Body=b'{"id": "1", "text": "t"}\n')
    pipeline = inference_assets(
        name="traversal_guard",
        model="/models/x",
        task="embed",
        input=InputSpec(uri=f"s3://{bucket}/in/{{partition_key}}.jsonl"),
        output_root=f"s3://{bucket}/out",
        partitions_def=dg.DynamicPartitionsDefinition(name="traversal_files"),
    )
    sensor = arrival_sensor(pipeline, s3_resource_key="s3")
    s3 = S3Resource(endpoint_url=s3_server.endpoint_url, region_name=s3_server.region)
    with dg.instance_for_test() as instance:
        context = dg.build_sensor_context(
            instance=instance, resources={"gpu": GpuInferenceResource(), "s3": s3}
        )
        result = sensor(context)
    assert [k for r in result.dynamic_partitions_requests for k in r.partition_keys] == ["good"]


@pytest.mark.parametrize(
    "name", ["/etc/passwd", "../other/part.parquet", "sub/part.parquet", "a\\b.parquet", "..", ""]
)
def test_manifest_part_names_must_be_plain_file_names(name):
    with pytest.raises(ValueError, match="not a plain file name"):
        FileEntry(name=name, rows=1, bytes=1, sha256="0" * 64)


def test_read_partition_refuses_a_manifest_naming_a_file_outside_the_partition(tmp_path):
    outside = tmp_path / "outside.parquet"
    outside.write_bytes(table_to_parquet_bytes(pa.table({"id": ["stolen"]})))
    spec = worker_spec().model_copy(
        update={"output": worker_spec().output.model_copy(update={"root": str(tmp_path / "out")})}
    )
    fs, path = filesystem_for(partition_dir(spec.output, "p"), spec.storage)
    errors = write_file_entry(fs, path, "errors.parquet", table_to_parquet_bytes(pa.table({})), 0)
    manifest = {
        "partition_key": "p",
        "spec_hash": spec.spec_hash(),
        "model": spec.model,
        "task": spec.task,
        "output_format": "parquet",
        "rows_in": 1,
        "rows_out": 1,
        "rows_errored": 0,
        "parts": [{"name": str(outside), "rows": 1, "bytes": 1, "sha256": "0" * 64}],
        "errors": errors.model_dump(),
    }
    write_bytes_atomic(fs, f"{path}/{MANIFEST_NAME}", json.dumps(manifest).encode())
    with pytest.raises(ValueError, match="not a plain file name"):
        read_partition(spec.output, "p", spec.storage)
