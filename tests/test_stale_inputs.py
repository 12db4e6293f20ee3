"""A committed partition is reused only while its shard and its model folder's files are the
ones it was computed from: a rewritten shard or new weights behind the same path are computed
again, never served as current. End to end through Dagster with the real vLLM CPU engine.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import dagster as dg
import numpy as np
import pytest
from support import (
    cpu_resource,
    materialize_partitions,
    model_loads,
    partition_metadata,
    write_parquet,
)

from dagster_gpuinfer import InputSpec, OutputSpec, inference_assets, read_partition

pytestmark = pytest.mark.engine

ROWS = 24
SENTENCES = [
    "The river floods every spring after the snow melts.",
    "Compilers translate source code into machine instructions.",
    "A good sourdough needs a lively starter and patience.",
    "Glaciers carve valleys over thousands of years.",
]


def _write_shard(root: Path, key: str, rows: int, variant: str) -> None:
    ids = [f"{key}-{i}" for i in range(rows)]
    texts = [f"{SENTENCES[i % len(SENTENCES)]} ({variant} {i})" for i in range(rows)]
    write_parquet(root / "in" / f"{key}.parquet", {"doc_id": ids, "text": texts})


def _negate_word_embeddings(model_dir: Path) -> None:
    """New weights written over the folder's weights file, as a retrained checkpoint copied
    into the same path would be."""
    from safetensors.numpy import load_file, save_file

    path = model_dir / "model.safetensors"
    tensors = load_file(str(path))
    tensors["embeddings.word_embeddings.weight"] = -tensors["embeddings.word_embeddings.weight"]
    save_file(tensors, str(path), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def stale_runs(tmp_path_factory, minilm_dir):
    root = tmp_path_factory.mktemp("stale")
    model_dir = Path(shutil.copytree(minilm_dir, root / "minilm"))
    for key in ("p0", "p1"):
        _write_shard(root, key, ROWS, "first")
    pipeline = inference_assets(
        name="emb",
        model=str(model_dir),
        task="embed",
        input=InputSpec(uri=str(root / "in" / "{partition_key}.parquet"), id_column="doc_id"),
        output_root=str(root / "out"),
        partitions_def=dg.StaticPartitionsDefinition(["p0", "p1"]),
        engine={"dtype": "float32"},
        chunk_size=8,
    )
    output = OutputSpec(**pipeline.spec["output"])
    load_log = root / "loads.log"
    runs = {}
    with dg.instance_for_test() as instance:

        def materialize(name: str) -> None:
            result = materialize_partitions(
                pipeline, ["p0", "p1"], resource=cpu_resource(load_log), instance=instance
            )
            runs[name] = {
                "result": result,
                "loads": model_loads(load_log),
                "metadata": {
                    key: partition_metadata(instance, pipeline.output_asset.key, key)
                    for key in ("p0", "p1")
                },
                "tables": {key: read_partition(output, key) for key in ("p0", "p1")},
            }

        materialize("first")
        # p1 rewritten under the same key: 18 of its 24 rows kept, every text changed.
        _write_shard(root, "p1", 18, "rewritten")
        materialize("input_changed")
        _negate_word_embeddings(model_dir)
        materialize("weights_changed")
        yield runs


def test_a_rewritten_shard_is_computed_again_and_the_others_are_reused(stale_runs):
    first, second = stale_runs["first"], stale_runs["input_changed"]
    assert second["result"].success
    assert second["loads"] == first["loads"] + 1
    p0, p1 = second["metadata"]["p0"], second["metadata"]["p1"]
    assert p0["computed_in_this_run"] is False
    assert p1["computed_in_this_run"] is True
    assert (p1["rows_in"], p1["rows_out"], p1["rows_errored"]) == (18, 18, 0)
    assert p1["input_version"] != first["metadata"]["p1"]["input_version"]
    assert p1["engine_versions"].startswith("vllm ") and ", torch " in p1["engine_versions"]
    assert p0["input_version"] == first["metadata"]["p0"]["input_version"]
    table = second["tables"]["p1"]
    assert table.column("id").to_pylist() == [f"p1-{i}" for i in range(18)]
    # The new rows' embeddings, not the old ones: every text changed.
    old = np.array(first["tables"]["p1"].column("embedding").to_pylist()[:18])
    new = np.array(table.column("embedding").to_pylist())
    assert not np.allclose(old, new, atol=1e-3)
    assert second["tables"]["p0"].equals(first["tables"]["p0"])


def test_the_checks_of_a_recomputed_shard_count_its_new_rows(stale_runs):
    evaluations = stale_runs["input_changed"]["result"].get_asset_check_evaluations()
    assert {e.check_name: e.passed for e in evaluations} == {
        "rows_balanced": True,
        "error_rate": True,
    }


def test_new_weights_in_the_model_folder_recompute_every_partition(stale_runs):
    before, after = stale_runs["input_changed"], stale_runs["weights_changed"]
    assert after["result"].success
    assert after["loads"] == before["loads"] + 1
    for key in ("p0", "p1"):
        md = after["metadata"][key]
        assert md["computed_in_this_run"] is True
        assert md["model_files_version"] != before["metadata"][key]["model_files_version"]
        assert md["input_version"] == before["metadata"][key]["input_version"]
        old = np.array(before["tables"][key].column("embedding").to_pylist())
        new = np.array(after["tables"][key].column("embedding").to_pylist())
        assert old.shape == new.shape and not np.allclose(old, new, atol=1e-3)
