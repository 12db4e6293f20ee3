"""Chunk-range leases on the real engine (tests/test_pool_ranges.py has the rest): the pool
worker command serves two ranges of one partition and commits it once."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from pool_worker_fakes import POOL, spec_dict
from test_pool_ranges import KEY, range_job, results, where, write_shard

from dagster_gpuinfer import InferenceSpec, read_partition
from dagster_gpuinfer.pools import SqliteLeaseQueue
from dagster_gpuinfer.storage import read_manifest, verify_manifest

pytestmark = pytest.mark.engine


def test_the_worker_command_commits_a_split_partition_on_a_real_engine(tmp_path, minilm_dir):
    """`python -m dagster_gpuinfer.worker --pool` on the real embed engine: two ranges of
    one partition, one engine build; the second range commits the partition with every
    row once, as computed by the job."""
    rows = 40
    write_shard(tmp_path, KEY, rows)
    spec = spec_dict(
        tmp_path,
        [KEY],
        model=minilm_dir,
        chunk_size=8,
        engine={"enforce_eager": True, "extra": {"kv_cache_memory_bytes": 256 << 20}},
    )
    location = tmp_path / "pools.db"
    with SqliteLeaseQueue(location) as queue:
        queue.submit(range_job("run-1", spec, spans=[(0, 2), (2, 5)]))
    load_log = tmp_path / "loads.log"
    env = {**os.environ, "GPUINFER_MODEL_LOAD_LOG": str(load_log), "VLLM_LOGGING_LEVEL": "WARNING"}
    command = [sys.executable, "-m", "dagster_gpuinfer.worker", "--pool", POOL]
    command += ["--queue", str(location), "--worker-id", "real", "--idle-ttl", "3"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]

    assert len(load_log.read_text().splitlines()) == 1
    with SqliteLeaseQueue(location) as queue:
        served = results(queue, "run-1")
        assert queue.job_progress("run-1").state == "done"
    commits = [m for r in served.values() for m in r["messages"] if m["type"] == "partition"]
    assert [m["computed"] for m in commits] == [True]  # the first range only wrote chunks
    fs, path = where(spec)
    manifest = read_manifest(fs, path)
    assert verify_manifest(fs, path, manifest) == []
    assert (manifest.rows_out, manifest.computed.rows_in, manifest.rows_resumed) == (rows, rows, 0)
    table = read_partition(InferenceSpec.model_validate(spec).output, KEY)
    assert table.column("id").to_pylist() == [f"{KEY}-{i}" for i in range(rows)]
    assert len(table.column("embedding")[0].as_py()) == 384
