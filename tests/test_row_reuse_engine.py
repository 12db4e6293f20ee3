"""Row-level reuse end to end through Dagster with the real vLLM CPU engine (MiniLM): a shard
committed, then 10% rows appended and 1% edited; the re-run computes exactly the appended
and edited rows (its partition metadata says so), copies the others from the earlier
output, and its output equals a full recompute of the changed shard by a second pipeline.
"""

from __future__ import annotations

from pathlib import Path

import dagster as dg
import numpy as np
import pytest
from support import cpu_resource, materialize_partitions, partition_metadata, write_parquet

from dagster_gpuinfer import InputSpec, OutputSpec, inference_assets, read_partition

pytestmark = pytest.mark.engine

ROWS = 200
APPENDED = 20  # 10%
EDITED = (17, 141)  # 1%
TOPICS = ["rivers", "compilers", "sourdough", "glaciers", "telescopes", "orchards"]


def _texts(rows: int, variant: str) -> list[str]:
    return [
        f"A short note on {TOPICS[i % len(TOPICS)]}, number {i} ({variant})." for i in range(rows)
    ]


def _pipeline(root: Path, name: str):
    return inference_assets(
        name=name,
        model=str(root / "model"),
        task="embed",
        input=InputSpec(uri=str(root / name / "{partition_key}.parquet"), id_column="doc_id"),
        output_root=str(root / "out"),
        partitions_def=dg.StaticPartitionsDefinition(["p0"]),
        engine={"dtype": "float32"},
        chunk_size=32,
    )


@pytest.fixture(scope="module")
def reuse_runs(tmp_path_factory, minilm_dir):
    root = tmp_path_factory.mktemp("reuse")
    (root / "model").symlink_to(minilm_dir)
    texts = _texts(ROWS, "first")
    write_parquet(
        root / "inc" / "p0.parquet", {"doc_id": [f"d{i}" for i in range(ROWS)], "text": texts}
    )
    changed = list(texts)
    for i in EDITED:
        changed[i] = f"An edited note about {TOPICS[i % len(TOPICS)]}, row {i}."
    changed += _texts(ROWS + APPENDED, "appended")[ROWS:]
    ids = [f"d{i}" for i in range(ROWS + APPENDED)]
    incremental, full = _pipeline(root, "inc"), _pipeline(root, "full")
    runs = {}
    with dg.instance_for_test() as instance:

        def materialize(pipeline, name: str) -> None:
            result = materialize_partitions(
                pipeline, ["p0"], resource=cpu_resource(), instance=instance
            )
            runs[name] = {
                "result": result,
                "metadata": partition_metadata(instance, pipeline.output_asset.key, "p0"),
                "table": read_partition(OutputSpec(**pipeline.spec["output"]), "p0"),
            }

        materialize(incremental, "first")
        write_parquet(root / "inc" / "p0.parquet", {"doc_id": ids, "text": changed})
        write_parquet(root / "full" / "p0.parquet", {"doc_id": ids, "text": changed})
        materialize(incremental, "rerun")
        materialize(full, "full")
        yield runs


def test_a_re_run_computes_exactly_the_appended_and_edited_rows(reuse_runs):
    first, rerun = reuse_runs["first"]["metadata"], reuse_runs["rerun"]["metadata"]
    assert reuse_runs["rerun"]["result"].success
    assert (first["rows_computed"], first["rows_reused"]) == (ROWS, 0)
    assert rerun["computed_in_this_run"] is True
    assert rerun["rows_out"] == ROWS + APPENDED
    assert rerun["rows_computed"] == APPENDED + len(EDITED)
    assert rerun["rows_reused"] == ROWS - len(EDITED)
    assert rerun["rows_deduplicated"] == 0


def test_the_re_run_equals_a_full_recompute(reuse_runs):
    rerun, full = reuse_runs["rerun"]["table"], reuse_runs["full"]["table"]
    assert reuse_runs["full"]["metadata"]["rows_computed"] == ROWS + APPENDED
    assert rerun.column("id").to_pylist() == full.column("id").to_pylist()
    assert rerun.column("reuse_key").to_pylist() == full.column("reuse_key").to_pylist()
    a = np.asarray(rerun.column("embedding").to_pylist(), np.float32)
    b = np.asarray(full.column("embedding").to_pylist(), np.float32)
    assert np.allclose(a, b, atol=1e-5), float(np.abs(a - b).max())
    # The edited rows are new embeddings, not the first run's.
    old = np.asarray(reuse_runs["first"]["table"].column("embedding").to_pylist(), np.float32)
    for i in EDITED:
        assert not np.allclose(old[i], a[i], atol=1e-3)
