"""The bench's task table: the workloads the throughput section, `bench.stream_probe` and
`bench.profile_run` run, one entry each, keyed by the name those commands take.

An entry names the package's task it runs (`dagster_gpuinfer.task_table`); what follows from
the task is that task's `TaskFacts`, never its name: whether it samples (sampling parameters,
generated tokens) or pools (`pooling`: no sampling, its rate counts prompt tokens), whether
its rows carry images (`images`). What the bench chose for the workload is the entry's own:
its model, its rows with their engine arguments and sampling, its chunk size, and whether
output lengths are sampled (`sampled_lengths`, the long tail: row i sampled with seed i,
rates in generated tokens).

Adding a task or a workload to the bench: one entry in `WORKLOADS` (and, for a task the
package lacks, its entries in the package's task table first). Modules that get a bare task
name (the contestants in `bench.backends`, the platform pipeline, the report) ask
`task_facts(name)`, as the package's own modules do.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING

from dagster_gpuinfer.task_table import TaskFacts, task_facts

if TYPE_CHECKING:
    from bench.context import Sizes
    from dagster_gpuinfer.spec import EngineArgs, SamplingParams

    Rows = tuple[list[str], EngineArgs, SamplingParams | None]


def counted_tokens(task: str) -> str:
    """The token count a rate of `task` counts: `prompt_tokens` where it pools (an encoder
    generates none), `generated_tokens` where it samples."""
    return "prompt_tokens" if task_facts(task).pooling else "generated_tokens"


def sampling_kwargs(task: str, sampling: SamplingParams | None) -> dict | None:
    """`sampling` as vLLM's `SamplingParams` kwargs where `task` samples, else None (a
    pooling task takes none)."""
    return sampling.to_vllm_kwargs() if sampling is not None and task_facts(task).samples else None


# --------------------------------------------------------------------------- models


def _minilm(work: Path) -> str:
    from assets.models import minilm_path

    return minilm_path()


def _tiny_llama(work: Path) -> str:
    from assets.models import make_tiny_llama

    return make_tiny_llama(work / "models" / "tiny-llama")


def _tiny_clip(work: Path) -> str:
    from assets.models import make_tiny_clip

    return make_tiny_clip(work / "models" / "tiny-clip")


# --------------------------------------------------------------------------- rows


def _embed_rows(sizes: Sizes) -> Rows:
    """MiniLM over the reference corpus's documents, float32 (the worker's CPU default)."""
    from bench.context import KV_CACHE_BYTES
    from bench.workloads import embed_texts
    from dagster_gpuinfer.spec import EngineArgs

    engine = EngineArgs(dtype="float32", extra={"kv_cache_memory_bytes": KV_CACHE_BYTES})
    return embed_texts(sizes.embed_rows), engine, None


def _generate_rows(sizes: Sizes) -> Rows:
    """Short instructions, greedy, `sizes.max_tokens` tokens each."""
    from bench.context import KV_CACHE_BYTES
    from bench.workloads import generate_texts
    from dagster_gpuinfer.spec import EngineArgs, SamplingParams

    engine = EngineArgs(max_model_len=256, extra={"kv_cache_memory_bytes": KV_CACHE_BYTES})
    sampling = SamplingParams(temperature=0.0, max_tokens=sizes.max_tokens)
    return generate_texts(sizes.generate_rows), engine, sampling


def _longtail_rows(sizes: Sizes) -> Rows:
    """The long-tailed section's rows (`bench.longtail.longtail_workload`)."""
    from bench.longtail import longtail_workload

    return longtail_workload(sizes)


def _no_text_rows(sizes: Sizes) -> Rows:
    raise ValueError(
        "an image workload has no text rows: its shard is the images section's "
        "(bench.images.write_image_shard)"
    )


def _chunk_size(sizes: Sizes) -> int:
    return sizes.chunk_size


def _middle_longtail_chunk(sizes: Sizes) -> int:
    return sizes.longtail_chunk_sizes[len(sizes.longtail_chunk_sizes) // 2]


# --------------------------------------------------------------------------- the table


@dataclass(frozen=True)
class Workload:
    """One bench workload: the task it runs and what the bench chose for it."""

    name: str  # what `--tasks`, `bench.stream_probe` and `bench.profile_run` take
    task: str  # the package's task (`dagster_gpuinfer.task_table.TASKS`)
    model_name: str  # as the report names the model
    model: Callable[[Path], str]  # the model's path, made or found under a work folder
    rows: Callable[[Sizes], Rows]  # texts, engine arguments, sampling (None: pooling)
    chunk_size: Callable[[Sizes], int] = _chunk_size
    sampled_lengths: bool = False  # lengths sampled: rows seeded, rates in generated tokens

    @property
    def facts(self) -> TaskFacts:
        return task_facts(self.task)

    @property
    def counted_tokens(self) -> str:
        """The token count its rates count (`counted_tokens`)."""
        return counted_tokens(self.task)


def _table(*entries: Workload) -> Mapping[str, Workload]:
    return MappingProxyType({entry.name: entry for entry in entries})


WORKLOADS: Mapping[str, Workload] = _table(
    Workload("embed", "embed", "all-MiniLM-L6-v2", _minilm, _embed_rows),
    Workload("generate", "generate", "tiny Llama (2 layers, random)", _tiny_llama, _generate_rows),
    Workload(
        "longtail",
        "generate",
        "tiny Llama (2 layers, random)",
        _tiny_llama,
        _longtail_rows,
        chunk_size=_middle_longtail_chunk,
        sampled_lengths=True,
    ),
    Workload("image_embed", "image_embed", "tiny CLIP (random)", _tiny_clip, _no_text_rows),
)


def workload(name: str) -> Workload:
    """The workload `name`.

    Raises:
        ValueError: `name` is not in `WORKLOADS`.
    """
    try:
        return WORKLOADS[name]
    except KeyError:
        raise ValueError(
            f"unknown bench workload {name!r}; the workloads are {', '.join(WORKLOADS)}"
        ) from None
