"""Where the reference pipelines keep their data: `GPUINFER_DATA_DIR`, default `<repo>/.data`."""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def data_dir() -> Path:
    return Path(os.environ.get("GPUINFER_DATA_DIR", REPO_ROOT / ".data")).resolve()


def input_root() -> str:
    return os.environ.get("GPUINFER_INPUT_ROOT", str(data_dir() / "inputs"))


def output_root() -> str:
    return os.environ.get("GPUINFER_OUTPUT_ROOT", str(data_dir() / "outputs"))


def generation_model_dir() -> str:
    return os.environ.get("GPUINFER_GENERATE_MODEL", str(data_dir() / "models" / "tiny-llama"))


def embedding_model_dir() -> str:
    from assets.models import minilm_path

    return os.environ.get("GPUINFER_EMBED_MODEL") or minilm_path()


def structured_model_dir() -> str:
    """The tiny Llama with a byte-level tokenizer, for structured outputs."""
    return os.environ.get(
        "GPUINFER_STRUCTURED_MODEL", str(data_dir() / "models" / "tiny-llama-bpe")
    )


def cross_encoder_dir() -> str:
    """MiniLM with a seeded 1-label head: a cross-encoder for `score`."""
    default = data_dir() / "models" / "minilm-cross-encoder"
    return os.environ.get("GPUINFER_SCORE_MODEL", str(default))


def classifier_dir() -> str:
    """MiniLM with a seeded 3-label head (negative / neutral / positive) for `classify`."""
    default = data_dir() / "models" / "minilm-classifier"
    return os.environ.get("GPUINFER_CLASSIFY_MODEL", str(default))


def image_model_dir() -> str:
    """The tiny random CLIP (image and text towers) for `image_embeddings`."""
    default = data_dir() / "models" / "tiny-clip"
    return os.environ.get("GPUINFER_IMAGE_MODEL", str(default))


def vision_language_model_dir() -> str:
    """The tiny random BLIP-2, the generation VLM that runs on vLLM's CPU build here."""
    default = data_dir() / "models" / "tiny-blip2"
    return os.environ.get("GPUINFER_VLM_MODEL", str(default))
