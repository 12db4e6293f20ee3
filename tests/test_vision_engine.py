"""Vision-language generation through the platform on vLLM's CPU build: a tiny random
BLIP-2 (`assets.models.make_tiny_blip2`), greedy, against transformers' own `generate`.

`vision_generate` reads an image column and a prompt column; `vision_chat` reads OpenAI
Batch chat lines whose `content` parts carry `image_url`s. Both are `slow` (an engine start
each); `tests/test_images_engine.py` keeps the image path in `make test`.
"""

from __future__ import annotations

import base64
import io
import json

import dagster as dg
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from support import cpu_resource, materialize_partitions, partition_metadata, write_jsonl

from assets.images import draw_shape, encode
from dagster_gpuinfer import InputSpec, inference_assets
from dagster_gpuinfer.spec import OutputSpec
from dagster_gpuinfer.storage import read_errors, read_openai_batch_files, read_partition

pytestmark = [pytest.mark.engine, pytest.mark.slow]

MAX_TOKENS = 6


@pytest.fixture(scope="module")
def blip2_dir(tmp_path_factory) -> str:
    from assets.models import make_tiny_blip2

    return make_tiny_blip2(tmp_path_factory.mktemp("models") / "tiny-blip2")


def images() -> list[bytes]:
    return [
        encode(draw_shape("circle", "red", (80, 60), seed=1)),
        encode(draw_shape("square", "blue", (64, 64), seed=2), "JPEG", quality=90),
        encode(draw_shape("stripes", "green", (200, 90), seed=3)),
    ]


def reference_tokens(model_dir: str, image: bytes, prompt: str) -> list[int]:
    """transformers' greedy tokens for one image and prompt (the text after the prompt)."""
    import torch
    from PIL import Image
    from transformers import Blip2ForConditionalGeneration, Blip2Processor

    model = Blip2ForConditionalGeneration.from_pretrained(model_dir).eval()
    processor = Blip2Processor.from_pretrained(model_dir)
    encoded = processor(
        images=Image.open(io.BytesIO(image)).convert("RGB"), text=prompt, return_tensors="pt"
    )
    with torch.no_grad():
        out = model.generate(**encoded, max_new_tokens=MAX_TOKENS, do_sample=False)
    return out[0].tolist()[encoded["input_ids"].shape[1] :]


def test_vision_generate_matches_transformers_greedy(tmp_path, blip2_dir):
    from transformers import AutoTokenizer

    data = images()
    prompts = ["Question: what shape is it? Answer:", "Describe:", "Colour?"]
    rows = {
        "id": ["red", "blue", "green", "junk", "none"],
        "image": pa.array([*data, b"not an image", None], pa.binary()),
        "text": prompts + ["x", "y"],
    }
    pq.write_table(pa.table(rows), (tmp_path / "in").mkdir() or tmp_path / "in" / "p0.parquet")
    pipeline = inference_assets(
        name="captions",
        model=blip2_dir,
        task="vision_generate",
        input=InputSpec(uri=str(tmp_path / "in" / "{partition_key}.parquet")),
        output_root=str(tmp_path / "out"),
        partitions_def=dg.StaticPartitionsDefinition(["p0"]),
        engine={"dtype": "float32", "max_model_len": 128},
        sampling={"temperature": 0.0, "max_tokens": MAX_TOKENS},
        max_error_rate=1.0,
    )
    with dg.instance_for_test() as instance:
        result = materialize_partitions(
            pipeline, ["p0"], resource=cpu_resource(), instance=instance
        )
        assert result.success
        md = partition_metadata(instance, pipeline.output_asset.key, "p0")
    output = OutputSpec(**pipeline.spec["output"])
    table = read_partition(output, "p0")
    texts = dict(zip(table.column("id").to_pylist(), table.column("text").to_pylist(), strict=True))
    generated = dict(
        zip(
            table.column("id").to_pylist(),
            table.column("generated_tokens").to_pylist(),
            strict=True,
        )
    )
    tokenizer = AutoTokenizer.from_pretrained(blip2_dir)
    for row_id, image, prompt in zip(["red", "blue", "green"], data, prompts, strict=True):
        tokens = reference_tokens(blip2_dir, image, prompt)
        expected = tokenizer.decode(tokens)
        # vLLM holds back bytes that are not yet whole UTF-8 characters; transformers
        # decodes them as U+FFFD. The tokens agree either way.
        assert texts[row_id] == expected.replace("\ufffd", ""), row_id
        assert generated[row_id] == len(tokens), row_id
    errors = read_errors(output, "p0")
    assert dict(
        zip(errors.column("id").to_pylist(), errors.column("error_type").to_pylist(), strict=True)
    ) == {"junk": "image_undecodable", "none": "no_image"}
    assert (md["rows_in"], md["rows_out"], md["rows_errored"], md["images"]) == (5, 3, 2, 4)
    # 8 query tokens of the image count as prompt tokens, so every row has more than 8.
    assert md["prompt_tokens"] > 3 * 8


def test_vision_chat_reads_openai_image_url_parts(tmp_path, blip2_dir):
    data = images()

    def line(custom_id: str, url: str, text: str = "what shape?") -> dict:
        return {
            "custom_id": custom_id,
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": "tiny-blip2",
                "max_tokens": MAX_TOKENS,
                "temperature": 0,
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "image_url", "image_url": {"url": url}},
                            {"type": "text", "text": text},
                        ],
                    }
                ],
            },
        }

    data_uri = "data:image/png;base64," + base64.b64encode(data[0]).decode()
    write_jsonl(
        tmp_path / "in" / "b0.jsonl",
        [
            line("a", data_uri),
            line("b", "data:image/png;base64," + base64.b64encode(data[2]).decode()),
            line("loopback", "http://127.0.0.1/latest/meta-data/"),
            line("nourl", ""),
        ],
    )
    pipeline = inference_assets(
        name="chat_captions",
        model=blip2_dir,
        task="vision_chat",
        input=InputSpec(uri=str(tmp_path / "in" / "{partition_key}.jsonl"), format="openai_batch"),
        output_root=str(tmp_path / "out"),
        output_format="openai_batch",
        partitions_def=dg.StaticPartitionsDefinition(["b0"]),
        engine={"dtype": "float32", "max_model_len": 128},
        max_error_rate=1.0,
    )
    with dg.instance_for_test() as instance:
        result = materialize_partitions(
            pipeline, ["b0"], resource=cpu_resource(), instance=instance
        )
        assert result.success
    files = read_openai_batch_files(OutputSpec(**pipeline.spec["output"]), "b0")
    outputs = [json.loads(x) for x in files.output.decode().splitlines()]
    errors = [json.loads(x) for x in files.errors.decode().splitlines()]
    by_id = {o["custom_id"]: o for o in outputs}
    assert set(by_id) == {"a", "b"}
    for custom_id in ("a", "b"):
        body = by_id[custom_id]["response"]["body"]
        assert body["object"] == "chat.completion"
        assert 1 <= body["usage"]["completion_tokens"] <= MAX_TOKENS
        assert body["usage"]["prompt_tokens"] > 8  # the image's 8 query tokens and the text
    assert {e["custom_id"]: e["error"]["code"] for e in errors} == {
        "loopback": "image_url_refused",
        "nourl": "no_image",
    }
