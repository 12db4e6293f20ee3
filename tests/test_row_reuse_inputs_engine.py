"""Row reuse keys for every input kind, end to end through Dagster and vLLM's CPU engine.

Image rows are keyed by their images' bytes, not their paths: a shard of image paths is
committed, one image file is rewritten in place under the same path and a row appended;
the re-run computes the edited image's row and the appended one, copies the others, and
its embeddings equal a full recompute's. OpenAI Batch lines are keyed by the request as
rendered (chat template, tokens, parameters), not by `custom_id`: an edited message and an
edited `max_tokens` are computed again, a line renamed but unchanged is copied.
"""

from __future__ import annotations

from pathlib import Path

import dagster as dg
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from support import cpu_resource, materialize_partitions, partition_metadata, write_jsonl

from assets.images import draw_shape, encode, shape_rows
from dagster_gpuinfer import InputSpec, inference_assets, read_partition
from dagster_gpuinfer.spec import OutputSpec

pytestmark = pytest.mark.engine


def _runs(root: Path, make_pipeline, first, change) -> dict:
    """`first` writes the shard; the pipeline `inc` commits it; `change` edits it; then
    `inc` runs again and `full` (its own output, nothing to copy) computes it whole."""
    inc, full = make_pipeline("inc"), make_pipeline("full")
    first()
    runs = {}
    with dg.instance_for_test() as instance:
        for name, pipeline in (("first", inc), ("change", None), ("rerun", inc), ("full", full)):
            if pipeline is None:
                change()
                continue
            materialize_partitions(pipeline, ["p0"], resource=cpu_resource(), instance=instance)
            runs[name] = {
                "metadata": partition_metadata(instance, pipeline.output_asset.key, "p0"),
                "table": read_partition(OutputSpec(**pipeline.spec["output"]), "p0"),
            }
    return runs


def _counts(run: dict) -> tuple[int, int, int]:
    meta = run["metadata"]
    return meta["rows_computed"], meta["rows_reused"], meta["rows_deduplicated"]


# --------------------------------------------------------------------------- images


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory) -> str:
    from assets.models import make_tiny_clip

    return make_tiny_clip(tmp_path_factory.mktemp("models") / "tiny-clip")


@pytest.fixture(scope="module")
def image_runs(tmp_path_factory, clip_dir):
    root = tmp_path_factory.mktemp("image-reuse")
    images = root / "in" / "img"
    images.mkdir(parents=True)
    good = shape_rows(5, seed=7)

    def shard(count: int) -> None:
        table = pa.table(
            {"id": [f"r{i}" for i in range(count)], "image": [f"img/{i}.png" for i in range(count)]}
        )
        pq.write_table(table, root / "in" / "p0.parquet")

    def first() -> None:
        for i, (_, _, data) in enumerate(good[:4]):
            (images / f"{i}.png").write_bytes(data)
        shard(4)

    def change() -> None:  # image 1 redrawn under the same path; a row appended
        (images / "1.png").write_bytes(encode(draw_shape("square", "blue", (64, 48)), "PNG"))
        (images / "4.png").write_bytes(good[4][2])
        shard(5)

    def pipeline(name: str):
        return inference_assets(
            name=f"img_{name}",
            model=clip_dir,
            task="image_embed",
            input=InputSpec(uri=str(root / "in" / "{partition_key}.parquet")),
            output_root=str(root / "out"),
            partitions_def=dg.StaticPartitionsDefinition(["p0"]),
            engine={"dtype": "float32", "max_model_len": 77},
            chunk_size=8,
        )

    return _runs(root, pipeline, first, change)


def test_an_image_edited_under_the_same_path_is_computed_and_the_others_copied(image_runs):
    assert _counts(image_runs["first"]) == (4, 0, 0)
    assert _counts(image_runs["rerun"]) == (2, 3, 0)  # image 1 edited, row 4 appended
    assert _counts(image_runs["full"]) == (5, 0, 0)
    first = image_runs["first"]["table"].column("reuse_key").to_pylist()
    again = image_runs["rerun"]["table"].column("reuse_key").to_pylist()
    assert again[0] == first[0] and again[2:4] == first[2:4] and again[1] != first[1]


def test_the_image_re_run_equals_a_full_recompute(image_runs):
    rerun, full = image_runs["rerun"]["table"], image_runs["full"]["table"]
    assert (
        rerun.column("id").to_pylist()
        == full.column("id").to_pylist()
        == [f"r{i}" for i in range(5)]
    )
    assert rerun.column("reuse_key").to_pylist() == full.column("reuse_key").to_pylist()
    a = np.asarray(rerun.column("embedding").to_pylist(), np.float32)
    b = np.asarray(full.column("embedding").to_pylist(), np.float32)
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)
    before = np.asarray(image_runs["first"]["table"].column("embedding").to_pylist(), np.float32)
    assert not np.allclose(a[1], before[1], atol=1e-3)  # the edited image's is new


# --------------------------------------------------------------------------- OpenAI lines


def _line(custom_id: str, content: str, **body) -> dict:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": "tiny",
            "messages": [{"role": "user", "content": content}],
            "max_tokens": 4,
            "temperature": 0,
            **body,
        },
    }


@pytest.fixture(scope="module")
def line_runs(tmp_path_factory, tiny_llama_dir):
    root = tmp_path_factory.mktemp("line-reuse")
    shard = root / "in" / "p0.jsonl"
    lines = [_line(f"c{i}", f"Describe river number {i}.") for i in range(4)]

    def change() -> None:
        edited = [
            lines[0],  # unchanged
            _line("c1", "Describe a mountain instead."),  # message edited
            _line("c2", "Describe river number 2.", max_tokens=6),  # a parameter edited
            {**lines[3], "custom_id": "renamed"},  # renamed, the same request
            _line("c4", "Describe river number 4."),  # appended
        ]
        write_jsonl(shard, edited)

    def pipeline(name: str):
        return inference_assets(
            name=f"lines_{name}",
            model=tiny_llama_dir,
            task="chat",
            input=InputSpec(uri=str(root / "in" / "{partition_key}.jsonl"), format="openai_batch"),
            output_root=str(root / "out"),
            partitions_def=dg.StaticPartitionsDefinition(["p0"]),
            engine={"max_model_len": 256},
            chunk_size=8,
        )

    return _runs(root, pipeline, lambda: write_jsonl(shard, lines), change)


def test_an_edited_openai_line_is_computed_and_an_unchanged_one_copied(line_runs):
    assert _counts(line_runs["first"]) == (4, 0, 0)
    assert _counts(line_runs["rerun"]) == (3, 2, 0)  # message, max_tokens, appended
    first = line_runs["first"]["table"].column("reuse_key").to_pylist()
    again = line_runs["rerun"]["table"].column("reuse_key").to_pylist()
    assert again[0] == first[0] and again[3] == first[3]
    assert again[1] != first[1] and again[2] != first[2]
    rerun, full = line_runs["rerun"]["table"], line_runs["full"]["table"]
    assert rerun.column("id").to_pylist() == ["c0", "c1", "c2", "renamed", "c4"]
    assert rerun.column("text").to_pylist() == full.column("text").to_pylist()
    assert rerun.column("reuse_key").to_pylist() == full.column("reuse_key").to_pylist()
