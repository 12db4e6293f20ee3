"""Image embeddings: images/s through the platform, raw `LLM.embed`, and a transformers loop.

`python -m bench --only images` (`--smoke` for tiny sizes). One Parquet shard of drawn
shapes in mixed sizes and formats (48x48 to 1024x768; PNG, JPEG, WebP), the tiny random
CLIP (`assets.models.make_tiny_clip`), and:

- decode: `worker/images.ImageDecoder` alone over the shard's encoded images (the pool the
  worker's read-ahead uses), images/s and encoded MB/s, overall and per size;
- raw: `LLM.embed([{"prompt": "", "multi_modal_data": {"image": img}}])` over the same
  images decoded beforehand (decoding not timed), with the platform's engine arguments, on an
  engine built for the round in a process of its own (`bench.server.run_fresh`), as the
  platform's worker builds one for its run; `raw warm` is a second call on that engine;
- transformers: `CLIPProcessor` + `CLIPModel.get_image_features`, batches of 64, same images;
- platform: a Dagster run of an `image_embed` pipeline over the shard: images/s over the
  partition's wall time in the worker (reading, decoding and vLLM's image processing in the
  read-ahead, inference, writing, commit), the span the other sections time. Not over its
  chunks' inference spans (`inference_seconds`): those start at a chunk's first request, so
  they leave out the read-ahead's work before it (the first chunk's decoding and rendering).

Each round runs raw (built for the round), transformers (its own process, loaded once) and
the platform. The ratio platform/raw says what the platform costs; decode/raw says
whether decoding or the engine bounds a run.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

from bench.context import KV_CACHE_BYTES, BenchContext
from bench.server import ContestantProcess, FreshEachRound
from bench.stats import paired_ratios, summarize

log = logging.getLogger("bench")

IMAGE_ENGINE_KWARGS = {
    "runner": "pooling",
    "dtype": "float32",
    "gpu_memory_utilization": 0.2,
    "enforce_eager": True,
    "kv_cache_memory_bytes": KV_CACHE_BYTES,
    "max_model_len": 77,
    # No cache of processed images: rounds embed the same images, a real collection does not.
    "mm_processor_cache_gb": 0,
}


def write_image_shard(path: Path, rows: int) -> dict[str, int]:
    """A shard of `rows` drawn images (all image rows); returns images per size."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from assets.images import shape_rows

    data = shape_rows(rows, seed=5)
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.table(
        {
            "id": [row_id for row_id, _, _ in data],
            "image": pa.array([image for _, _, image in data], pa.binary()),
        }
    )
    pq.write_table(table, path)
    return {"rows": rows, "bytes": sum(len(image) for _, _, image in data)}


def decoded_images(shard: str) -> list[Any]:
    """The shard's images decoded by the worker's decoder (raises on a bad one)."""
    import pyarrow.parquet as pq

    from dagster_gpuinfer.image_options import ImageOptions
    from dagster_gpuinfer.worker.tasks.images import ImageDecoder

    refs = pq.read_table(shard, columns=["image"]).column("image").to_pylist()
    decoder = ImageDecoder(ImageOptions())
    try:
        results = decoder.load_all(refs)
    finally:
        decoder.close()
    return [result.image for result in results]


def measure_decode(shard: str, rounds: int) -> dict[str, Any]:
    """Decode rate alone: images/s and encoded MB/s, overall and per original size."""
    import pyarrow.parquet as pq

    from dagster_gpuinfer.image_options import ImageOptions
    from dagster_gpuinfer.worker.tasks.images import DecodedImage, ImageDecoder

    refs = pq.read_table(shard, columns=["image"]).column("image").to_pylist()
    decoder = ImageDecoder(ImageOptions())
    rates, per_size = [], {}
    try:
        for _ in range(rounds):
            started = time.perf_counter()
            results = decoder.load_all(refs)
            rates.append(len(refs) / (time.perf_counter() - started))
        assert all(isinstance(r, DecodedImage) for r in results)
        by_size: dict[tuple[int, int], list[bytes]] = {}
        for ref, result in zip(refs, results, strict=True):
            by_size.setdefault(result.original_size, []).append(ref)
        for size, group in sorted(by_size.items()):
            started = time.perf_counter()
            decoder.load_all(group)
            seconds = time.perf_counter() - started
            per_size[f"{size[0]}x{size[1]}"] = round(len(group) / seconds, 1)
    finally:
        decoder.close()
    encoded = sum(len(ref) for ref in refs)
    median = summarize(rates).median
    return {
        "images_per_s": summarize(rates).__dict__,
        "encoded_mb_per_s": round(median * encoded / len(refs) / 1e6, 2),
        "images_per_s_by_size": per_size,
        "threads": os.cpu_count(),
    }


class ImageVllmBackend:
    """Raw vLLM `LLM.embed` over a shard's images, decoded before the clock starts."""

    def __init__(self, *, model: str, engine_kwargs: dict[str, Any]) -> None:
        started = time.perf_counter()  # vLLM's import + LLM(...): the worker's span
        from vllm import LLM

        imported = time.perf_counter()
        self.llm = LLM(model=model, **engine_kwargs)
        self.info = {
            "engine_seconds": time.perf_counter() - started,
            "import_seconds": imported - started,
            "pid": os.getpid(),
        }

    def run(self, shard: str) -> dict[str, Any]:
        images = decoded_images(shard)
        prompts = [{"prompt": "", "multi_modal_data": {"image": image}} for image in images]
        started = time.perf_counter()
        outputs = self.llm.embed(prompts, use_tqdm=False)
        return {"seconds": time.perf_counter() - started, "rows": len(outputs)}

    def close(self) -> None:
        engine_core = getattr(self.llm.llm_engine, "engine_core", None)
        if engine_core is not None:
            engine_core.shutdown()


class ImageTransformersBackend:
    """`CLIPProcessor` + `CLIPModel.get_image_features` in batches, the plain loop."""

    def __init__(self, *, model: str, batch_size: int = 64) -> None:
        import torch
        from transformers import CLIPModel, CLIPProcessor

        started = time.perf_counter()
        self.torch = torch
        self.processor = CLIPProcessor.from_pretrained(model)
        self.model = CLIPModel.from_pretrained(model, dtype=torch.float32).eval()
        self.batch_size = batch_size
        self.info = {"engine_seconds": time.perf_counter() - started, "pid": os.getpid()}

    def run(self, shard: str) -> dict[str, Any]:
        images = decoded_images(shard)
        started = time.perf_counter()
        with self.torch.inference_mode():
            for i in range(0, len(images), self.batch_size):
                batch = self.processor(images=images[i : i + self.batch_size], return_tensors="pt")
                self.model.get_image_features(**batch)
        return {"seconds": time.perf_counter() - started, "rows": len(images)}

    def close(self) -> None:
        pass


def run_images(ctx: BenchContext) -> dict[str, Any]:
    from assets.models import make_tiny_clip

    rows = 64 if ctx.smoke else 960
    rounds = 1 if ctx.smoke else ctx.sizes.rounds
    model = make_tiny_clip(ctx.work_dir / "models" / "tiny-clip")
    root = ctx.fresh_dir("images")
    shard = root / "inputs" / "shard-0.parquet"
    written = write_image_shard(shard, rows)
    result: dict[str, Any] = {"rows": rows, "encoded_bytes": written["bytes"], "model": model}
    result["decode"] = measure_decode(str(shard), rounds)
    log.info("images: decode %s images/s", result["decode"]["images_per_s"]["median"])
    platform = _platform_pipeline(model, root)
    raw = FreshEachRound(
        "images-raw",
        "bench.images:ImageVllmBackend",
        {"model": model, "engine_kwargs": _raw_engine_kwargs(platform)},
        env=ctx.engine_env(),
        log_dir=ctx.log_dir,
    )
    contestants = {
        "transformers": ContestantProcess(
            "images-hf",
            "bench.images:ImageTransformersBackend",
            {"model": model},
            env=ctx.engine_env(),
            log_dir=ctx.log_dir,
        ),
    }
    rates: dict[str, list[float]] = {"platform": [], "raw": [], "raw warm": [], "transformers": []}
    try:
        for round_index in range(rounds):
            fresh = raw.run(round_index, str(shard))
            rates["raw"].append(fresh.first["rows"] / fresh.first["seconds"])
            rates["raw warm"].append(fresh.warm["rows"] / fresh.warm["seconds"])
            for name, contestant in contestants.items():
                out = contestant.call("run", str(shard))
                rates[name].append(out["rows"] / out["seconds"])
            if platform is not None:
                platform.clear_outputs()
                timing = platform.run(platform.keys)
                rates["platform"].append(timing.rows / timing.partition_seconds["shard-0"])
            log.info(
                "images round %d: %s",
                round_index,
                {name: round(values[-1], 1) for name, values in rates.items() if values},
            )
    finally:
        for contestant in contestants.values():
            contestant.close()
    result["images_per_s"] = {name: summarize(v).__dict__ for name, v in rates.items() if v}
    result["ratios"] = {
        "raw/transformers": paired_ratios(rates["raw"], rates["transformers"]).__dict__
    }
    if rates["platform"]:
        for raw in ("raw", "raw warm"):
            result["ratios"][f"platform/{raw}"] = paired_ratios(
                rates["platform"], rates[raw]
            ).__dict__
    result["ratios"]["raw warm/raw"] = paired_ratios(rates["raw warm"], rates["raw"]).__dict__
    decode_median = result["decode"]["images_per_s"]["median"]
    raw_median = summarize(rates["raw"]).median
    result["bound_by"] = "decode" if decode_median < raw_median else "engine"
    result["load_average"] = round(os.getloadavg()[0], 2)
    return result


def _platform_pipeline(model: str, root: Path) -> Any:
    """The `image_embed` pipeline over the shard (None before the task exists)."""
    from bench.platform_run import PlatformPipeline, local_resource
    from dagster_gpuinfer.spec import EngineArgs

    try:
        return PlatformPipeline(
            name="bench_image_embeddings",
            model=model,
            task="image_embed",
            input_uri=str(root / "inputs" / "{partition_key}.parquet"),
            root=root,
            keys=["shard-0"],
            resource=local_resource(),
            engine=EngineArgs(
                dtype="float32",
                max_model_len=77,
                gpu_memory_utilization=0.2,
                enforce_eager=True,
                extra={"kv_cache_memory_bytes": KV_CACHE_BYTES, "mm_processor_cache_gb": 0},
            ),
        )
    except ValueError as exc:
        log.warning("images: no platform contestant (%s)", exc)
        return None


def _raw_engine_kwargs(platform: Any) -> dict[str, Any]:
    """The platform's engine arguments when it runs, else the bench's own."""
    if platform is None:
        return dict(IMAGE_ENGINE_KWARGS)
    from bench.platform_run import raw_engine_kwargs

    return raw_engine_kwargs(platform.worker_spec())  # vLLM's stats on, as in the worker
