"""Image tasks end to end through Dagster, the worker and vLLM's CPU engine.

One run over two partitions (one engine start): a Parquet shard of encoded images (drawn
shapes in mixed sizes and formats), caption-only text rows and bad images; and a JSONL shard
whose images are URIs (relative paths, `data:` URIs) beside a zoo of refused and missing
ones. Image embeddings must equal transformers' `get_image_features`, text rows its
`get_text_features` (the one space), and every bad row gets its own fate.
"""

from __future__ import annotations

import base64

import dagster as dg
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from support import cpu_resource, materialize_partitions, partition_metadata

from assets.images import bomb_png, draw_shape, encode, shape_rows
from dagster_gpuinfer import InputSpec, inference_assets
from dagster_gpuinfer.spec import OutputSpec
from dagster_gpuinfer.storage import read_errors, read_partition

pytestmark = pytest.mark.engine


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory) -> str:
    from assets.models import make_tiny_clip

    return make_tiny_clip(tmp_path_factory.mktemp("models") / "tiny-clip")


@pytest.fixture(scope="module")
def image_run(tmp_path_factory, clip_dir):
    """One Dagster run over both partitions: one engine start."""
    root = tmp_path_factory.mktemp("images")
    (root / "in" / "img").mkdir(parents=True)
    good = shape_rows(12, seed=3)
    truncated = encode(draw_shape("circle", "red", (90, 60)), "JPEG", quality=90)
    bin_rows = [(row_id, None, data) for row_id, _, data in good]
    bin_rows += [(f"cap-{i}", caption, None) for i, (_, caption, _) in enumerate(good[:4])]
    bin_rows += [
        ("undecodable", None, b"these bytes are not an image"),
        ("truncated", None, truncated[: len(truncated) // 2]),
        ("bomb", None, bomb_png()),
        ("both", "a red circle", good[0][2]),
        ("neither", None, None),
    ]
    pq.write_table(
        pa.table(
            {
                "id": [r[0] for r in bin_rows],
                "text": pa.array([r[1] for r in bin_rows], pa.string()),
                "image": pa.array([r[2] for r in bin_rows], pa.binary()),
            }
        ),
        root / "in" / "bin.parquet",
    )
    # The URI shard: a list<string> image column (a row may carry several images).
    (root / "in" / "img" / "a.png").write_bytes(good[1][2])
    data_uri = "data:image/png;base64," + base64.b64encode(good[2][2]).decode()
    uri_rows = [
        ("path", ["img/a.png"]),
        ("data", [data_uri]),
        ("missing", ["img/none.png"]),
        ("loopback", ["http://127.0.0.1:9/secret.png"]),
        ("ftp", ["ftp://example.com/a.png"]),
        ("outside", ["../bin.parquet"]),
        ("two", ["img/a.png", data_uri]),
    ]
    pq.write_table(
        pa.table(
            {
                "id": [r[0] for r in uri_rows],
                "image": pa.array([r[1] for r in uri_rows], pa.list_(pa.string())),
            }
        ),
        root / "in" / "uri.parquet",
    )
    keys = ["bin", "uri"]
    pipeline = inference_assets(
        name="image_emb",
        model=clip_dir,
        task="image_embed",
        input=InputSpec(uri=str(root / "in" / "{partition_key}.parquet")),
        output_root=str(root / "out"),
        partitions_def=dg.StaticPartitionsDefinition(keys),
        engine={"dtype": "float32", "max_model_len": 77},
        chunk_size=8,
        max_error_rate=1.0,
    )
    with dg.instance_for_test() as instance:
        result = materialize_partitions(pipeline, keys, resource=cpu_resource(), instance=instance)
        yield {
            "root": root,
            "good": good,
            "pipeline": pipeline,
            "result": result,
            "instance": instance,
            "output": OutputSpec(**pipeline.spec["output"]),
        }


def _embeddings(image_run, key: str) -> dict[str, np.ndarray]:
    table = read_partition(image_run["output"], key)
    field_type = table.schema.field("embedding").type
    assert pa.types.is_fixed_size_list(field_type) and field_type.list_size == 128
    return {
        row_id: np.asarray(vector, np.float32)
        for row_id, vector in zip(
            table.column("id").to_pylist(), table.column("embedding").to_pylist(), strict=True
        )
    }


def test_image_and_text_rows_equal_transformers_clip_features(image_run, clip_dir):
    import io

    import torch
    from PIL import Image
    from transformers import CLIPModel, CLIPProcessor

    assert image_run["result"].success
    ours = _embeddings(image_run, "bin")
    good = image_run["good"]
    model = CLIPModel.from_pretrained(clip_dir).eval()
    processor = CLIPProcessor.from_pretrained(clip_dir)
    images = [Image.open(io.BytesIO(data)).convert("RGB") for _, _, data in good]
    captions = [caption for _, caption, _ in good[:4]]
    with torch.no_grad():
        image_ref = model.get_image_features(**processor(images=images, return_tensors="pt"))
        text_ref = model.get_text_features(
            **processor(text=captions, return_tensors="pt", padding=True)
        )
    image_ref = getattr(image_ref, "pooler_output", image_ref).numpy()
    text_ref = getattr(text_ref, "pooler_output", text_ref).numpy()
    image_cos = cosines(np.stack([ours[row_id] for row_id, _, _ in good]), image_ref)
    text_cos = cosines(np.stack([ours[f"cap-{i}"] for i in range(4)]), text_ref)
    assert image_cos.min() >= 0.999, f"image rows: lowest cosine {image_cos.min():.5f}"
    assert text_cos.min() >= 0.999, f"text rows: lowest cosine {text_cos.min():.5f}"
    # One space: the same row of the image tower and the text tower, side by side in one
    # column, each equal to the model's own projection into its joint space.
    assert image_ref.shape[1] == text_ref.shape[1] == len(ours["cap-0"])


def test_bad_images_each_get_their_own_fate_and_the_shard_goes_on(image_run):
    instance, key = image_run["instance"], image_run["pipeline"].output_asset.key
    fates = {}
    for partition in ("bin", "uri"):
        md = partition_metadata(instance, key, partition)
        assert md["rows_in"] == md["rows_out"] + md["rows_errored"]
        errors = read_errors(image_run["output"], partition)
        fates.update(
            zip(
                errors.column("id").to_pylist(),
                errors.column("error_type").to_pylist(),
                strict=True,
            )
        )
    assert fates == {
        "undecodable": "image_undecodable",
        "truncated": "image_truncated",
        "bomb": "image_bomb",
        "both": "image_and_text",
        "neither": "no_image",
        "missing": "image_missing",
        "loopback": "image_url_refused",
        "ftp": "image_url_refused",
        "outside": "image_url_refused",
        "two": "too_many_images",
    }
    uri = _embeddings(image_run, "uri")
    assert set(uri) == {"path", "data"}
    bin_embeddings = _embeddings(image_run, "bin")
    good = image_run["good"]
    # The same image read as bytes, as a relative path and as a data: URI embeds the same.
    assert cosines(uri["path"][None], bin_embeddings[good[1][0]][None])[0] > 0.9999
    assert cosines(uri["data"][None], bin_embeddings[good[2][0]][None])[0] > 0.9999


def test_partition_metadata_counts_images_and_image_bytes(image_run):
    md = partition_metadata(image_run["instance"], image_run["pipeline"].output_asset.key, "bin")
    # 12 good images, the undecodable, truncated and bomb ones (the row with an image and a
    # text is refused before its image is read).
    assert md["images"] == 15
    assert md["image_bytes"] >= sum(len(data) for _, _, data in image_run["good"])
    assert md["image_bytes_per_second"] > 0
    assert (md["rows_in"], md["rows_out"], md["rows_errored"]) == (21, 16, 5)
