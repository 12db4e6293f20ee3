"""Image pipelines: image embeddings and image captions, over drawn-shape shards.

- `image_embeddings` (`image_embed`): a CLIP-style dual encoder embeds each row's image, or,
  where the image is null, its caption text, into one 128-dimension space (a tiny random
  CLIP here: swap in a real CLIP/SigLIP folder for real embeddings). Each partition reports
  its images and image bytes/s beside rows and tokens.
- `image_captions` (`vision_generate`): a vision-language model answers a prompt about each
  image (a tiny random BLIP-2 here, so the captions are nonsense tokens; it shows the path
  runs: LLaVA-style models need torchvision, which vLLM's CPU build cannot have here).

`python -m assets.prepare` (`make demo`) draws the shards (`inputs/images/`) and builds both
models offline.
"""

from __future__ import annotations

import dagster as dg

from assets.paths import image_model_dir, input_root, output_root, vision_language_model_dir
from dagster_gpuinfer import EngineArgs, InputSpec, SamplingParams, inference_assets
from dagster_gpuinfer.image_options import ImageOptions

IMAGE_SHARDS = dg.StaticPartitionsDefinition([f"images-{i:03d}" for i in range(3)])
IMAGE_INPUT = f"{input_root()}/images/{{partition_key}}.parquet"


def _image_input(*, text_column: str) -> InputSpec:
    """The image shards, with `text_column` beside the image. The models see 64x64: larger
    images are fitted to 256 in the read-ahead, so memory holds small images and the
    processor's resize has little left to do."""
    return InputSpec(
        uri=IMAGE_INPUT,
        image_column="image",
        text_column=text_column,
        images=ImageOptions(max_side=256),
    )


image_embeddings = inference_assets(
    name="image_embeddings",
    model=image_model_dir(),
    task="image_embed",
    input=_image_input(text_column="text"),
    input_asset_key="image_shards",
    output_root=output_root(),
    partitions_def=IMAGE_SHARDS,
    engine=EngineArgs(dtype="float32", max_model_len=77),
    chunk_size=64,
    group_name="images",
    description="Image (and caption) embeddings of drawn shapes by a tiny random CLIP: "
    "image rows and text rows in one space",
)

image_captions = inference_assets(
    name="image_captions",
    model=vision_language_model_dir(),
    task="vision_generate",
    input=_image_input(text_column="caption"),  # the prompt: its caption as a question
    input_asset_key="image_shards",
    output_root=output_root(),
    partitions_def=IMAGE_SHARDS,
    engine=EngineArgs(dtype="float32", max_model_len=128),
    sampling=SamplingParams(temperature=0.0, max_tokens=16),
    chunk_size=64,
    max_error_rate=0.3,  # the caption-only rows (one in five) carry no image
    group_name="images",
    description="Greedy answers of a tiny random BLIP-2 about each image",
)

embed_images_job = dg.define_asset_job(
    "embed_images", selection=[image_embeddings.output_asset.key], partitions_def=IMAGE_SHARDS
)
caption_images_job = dg.define_asset_job(
    "caption_images", selection=[image_captions.output_asset.key], partitions_def=IMAGE_SHARDS
)
