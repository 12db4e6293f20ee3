"""The model's image resize run ahead in the decoder's pool changes no pixel the model gets.

`worker/tasks/image_fit.py` hands the decoder the resize of the model's own Hugging Face image
processor; the processor then runs on the resized image. Its output must equal, bit for bit,
the processor's output on the image as decoded, for any size (down and up, any aspect ratio);
and a processor whose output could depend on the original size gets no fit at all.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from dagster_gpuinfer.image_options import ImageOptions
from dagster_gpuinfer.worker.tasks.image_fit import image_fit_for, model_image_fit
from dagster_gpuinfer.worker.tasks.images import ImageDecoder

transformers = pytest.importorskip("transformers")
from transformers.models.blip.image_processing_pil_blip import BlipImageProcessorPil  # noqa: E402
from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil  # noqa: E402


@pytest.fixture(scope="module")
def clip_processor(tmp_path_factory):
    """The tiny CLIP's own image processor, as vLLM loads it (shortest edge, center crop)."""
    from transformers import AutoImageProcessor

    from assets.models import make_tiny_clip

    model = make_tiny_clip(tmp_path_factory.mktemp("models") / "tiny-clip")
    return AutoImageProcessor.from_pretrained(model)


def pixels(processor, image: Image.Image) -> np.ndarray:
    return processor(images=[image], return_tensors="np")["pixel_values"]


def random_image(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")


SIZES = st.tuples(st.integers(1, 900), st.integers(1, 900), st.integers(0, 2**16))


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(size=SIZES)
def test_fitted_images_give_the_processors_exact_pixels(clip_processor, size) -> None:
    width, height, seed = size
    image = random_image(width, height, seed)
    fit = image_fit_for(clip_processor)
    assert fit is not None
    fitted = fit(image)
    assert min(fitted.size) == clip_processor.size.shortest_edge
    assert np.array_equal(pixels(clip_processor, fitted), pixels(clip_processor, image))


@settings(max_examples=15, deadline=None)
@given(size=SIZES)
def test_a_fixed_size_processor_fits_to_its_height_and_width(size) -> None:
    width, height, seed = size
    processor = BlipImageProcessorPil(size={"height": 48, "width": 40})
    image = random_image(width, height, seed)
    fitted = image_fit_for(processor)(image)
    assert fitted.size == (40, 48)
    assert np.array_equal(pixels(processor, fitted), pixels(processor, image))


class _Tiling(CLIPImageProcessorPil):
    """A processor with a step of its own (as any-resolution tiling processors have)."""

    def _preprocess(self, images, **kwargs):
        return super()._preprocess(images, **kwargs)


@pytest.mark.parametrize(
    "processor",
    [
        pytest.param(CLIPImageProcessorPil(do_resize=False), id="no-resize"),
        pytest.param(
            CLIPImageProcessorPil(size={"shortest_edge": 64, "longest_edge": 96}),
            id="longest-edge",
        ),
        pytest.param(CLIPImageProcessorPil(do_center_crop=False), id="output-size-varies"),
        pytest.param(_Tiling(), id="own-preprocess-step"),
        pytest.param(object(), id="not-a-transformers-processor"),
    ],
)
def test_processors_whose_output_could_depend_on_the_original_get_no_fit(processor) -> None:
    assert image_fit_for(processor) is None


def _llm(processor, mm_processor_kwargs=None):
    """vLLM's objects on the path `model_image_fit` reads, around one HF processor."""
    info = SimpleNamespace(get_hf_processor=lambda: SimpleNamespace(image_processor=processor))
    renderer = SimpleNamespace(get_mm_processor=lambda: SimpleNamespace(info=info))
    model_config = SimpleNamespace(mm_processor_kwargs=mm_processor_kwargs)
    return SimpleNamespace(llm_engine=SimpleNamespace(renderer=renderer, model_config=model_config))


def test_the_engines_processor_is_fitted_unless_the_user_passed_processor_arguments(
    clip_processor,
) -> None:
    assert model_image_fit(_llm(clip_processor)) is not None
    assert model_image_fit(_llm(clip_processor, {"size": {"shortest_edge": 32}})) is None


def test_the_decoder_hands_on_images_at_the_models_size(clip_processor, tmp_path: Path) -> None:
    path = tmp_path / "big.png"
    random_image(640, 480, 1).save(path)
    decoder = ImageDecoder(
        ImageOptions(local_roots=[str(tmp_path)]), fit=image_fit_for(clip_processor)
    )
    try:
        (decoded,) = decoder.load_all([str(path)])
    finally:
        decoder.close()
    assert decoded.original_size == (640, 480)
    assert decoded.image.size == (85, 64)  # shortest edge 64, transformers' rounding
