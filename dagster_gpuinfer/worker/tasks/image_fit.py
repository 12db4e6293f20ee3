"""The model's own image resize, run in the decoder's pool ahead of the engine, when it is exact.

vLLM's input processing of an image prompt (the render stage, one thread) runs the model's
Hugging Face image processor on the decoded image. For the common processors (CLIP, SigLIP,
BLIP-2, ...: resize, center crop, rescale, normalize) the resize of a large photo is most of
that work, and the processor converts the full-size image to arrays and back around it. Here
the resize runs where the image is decoded, in the decoder's thread pool, with the processor's
own target size and resampling filter; the processor then finds the image at its size, and
Pillow's `resize` to the size an image already has is a copy. The pixels the model gets are
the same, bit for bit (`tests/test_image_fit.py` holds it on random sizes).

It is used only where it is exact: a processor of transformers' Pillow backend whose
preprocessing is the backend's own chain (no subclass step of its own, such as tiling or
any-resolution grids), that resizes to a shortest edge or to a fixed height x width, whose
output has one fixed size (a center crop, or a fixed resize), with no `mm_processor_kwargs`
that could change any of it. Anything else gets None, and the processor does all of its
work as before. On the tiny CLIP's mixed sizes (48x48 to 1024x768), one thread: the processor
on decoded images 316-338 images/s; the resize here plus the processor on resized images
583-717 images/s, the processor alone on them 2,354-4,452 images/s.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np
from PIL import Image

log = logging.getLogger("dagster_gpuinfer.worker")

ImageFit = Callable[[Image.Image], Image.Image]


def model_image_fit(llm: Any) -> ImageFit | None:
    """The resize of the image processor vLLM runs for `llm`'s model, when exact; else None."""
    model_config = llm.llm_engine.model_config
    if getattr(model_config, "mm_processor_kwargs", None):
        return None  # the user's processor arguments may change sizes: leave it all to vLLM
    try:
        info = llm.llm_engine.renderer.get_mm_processor().info
        processor = getattr(info.get_hf_processor(), "image_processor", None)
    except Exception as exc:  # no multimodal processor here: nothing to fit to
        log.debug("no image processor to fit images to: %s", exc)
        return None
    return image_fit_for(processor)


def image_fit_for(processor: Any) -> ImageFit | None:
    """The resize step of `processor` (a transformers image processor) as a function of a
    decoded RGB image, when running it ahead changes no pixel of the processor's output."""
    try:
        from transformers.image_processing_backends import PilBackend
    except ImportError:  # a transformers without the Pillow backend: nothing is fitted
        return None
    if not isinstance(processor, PilBackend):
        return None
    kind = type(processor)
    if kind._preprocess is not PilBackend._preprocess or kind.resize is not PilBackend.resize:
        return None  # a processor with steps of its own may read the original size
    size, crop = processor.size, processor.crop_size
    if not processor.do_resize or size is None:
        return None
    fixed_resize = bool(size.height and size.width) and not size.shortest_edge
    shortest_edge = bool(size.shortest_edge) and not (size.longest_edge or size.height)
    fixed_output = fixed_resize or (
        bool(processor.do_center_crop) and crop is not None and bool(crop.height and crop.width)
    )
    padded = getattr(processor, "do_pad", None)
    if not fixed_output or not (fixed_resize or shortest_edge) or padded:
        return None
    resample = processor.resample if processor.resample is not None else Image.BILINEAR
    if fixed_resize:
        target = (int(size.width), int(size.height))
        return lambda image: _resized(image, target, resample)
    edge = int(size.shortest_edge)
    return lambda image: _resized(image, _shortest_edge_size(image, edge), resample)


def _shortest_edge_size(image: Image.Image, edge: int) -> tuple[int, int]:
    """(width, height) the processor resizes `image` to: transformers' own arithmetic."""
    from transformers.image_transforms import get_resize_output_image_size
    from transformers.image_utils import ChannelDimension

    width, height = image.size
    shape_only = np.broadcast_to(np.uint8(0), (1, height, width))
    new_height, new_width = get_resize_output_image_size(
        shape_only, size=edge, default_to_square=False, input_data_format=ChannelDimension.FIRST
    )
    return int(new_width), int(new_height)


def _resized(image: Image.Image, size: tuple[int, int], resample: Any) -> Image.Image:
    return image if image.size == size else image.resize(size, resample=resample)
