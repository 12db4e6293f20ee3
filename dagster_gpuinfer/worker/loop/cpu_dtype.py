"""`dtype: auto` on vLLM's CPU build, on an x86 CPU without native bfloat16.

Under `auto`, vLLM's CPU platform loads a float32 checkpoint in bfloat16 (float16 for a
pooling model). An x86 CPU without AVX512_BF16 or AMX has no instructions for either and
emulates them: on the 2-core AVX2 EPYC that CI runs on, greedy generation with the tiny
Llama ran 4.5x slower in bfloat16 than in float32 (19.6 vs 88.1 rows/s, the same 12,645
tokens; `bench/README.md`). On such a CPU the worker loads a float32 checkpoint as float32,
which takes no more memory than the checkpoint itself, and logs it. A bfloat16 or float16
checkpoint is left as vLLM loads it (float32 would double its memory), an explicit `dtype`
always wins, and a GPU build is never touched.
"""

from __future__ import annotations

import json
import logging
import os
import platform
from typing import Any

log = logging.getLogger("dagster_gpuinfer.worker")


def vllm_on_cpu() -> bool:
    """vLLM runs on its CPU platform (the CPU build)."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def native_bf16() -> bool:
    """The CPU computes in bfloat16 natively (AVX512_BF16 or AMX; what vLLM's CPU build
    checks), or is not x86, where this module does not judge."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return True
    import torch

    amx = getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    return bool(torch.cpu._is_avx512_bf16_supported() or amx())


def checkpoint_dtype(model: str) -> str | None:
    """The dtype a local checkpoint's config.json names (`dtype`, or `torch_dtype` in older
    configs), or None (a hub id, no config, or none named)."""
    path = os.path.join(os.path.expanduser(model.removeprefix("file://")), "config.json")
    try:
        with open(path, encoding="utf-8") as handle:
            config = json.load(handle)
    except (OSError, ValueError):
        return None
    named = config.get("dtype") or config.get("torch_dtype") if isinstance(config, dict) else None
    return named if isinstance(named, str) else None


def resolve_cpu_dtype(
    kwargs: dict[str, Any],
    model: str,
    *,
    on_cpu: bool | None = None,
    native: bool | None = None,
) -> dict[str, Any]:
    """`kwargs` with `dtype="float32"` where vLLM's CPU build would emulate the half
    precision it picks for a float32 checkpoint; otherwise `kwargs` as given.

    Args:
        on_cpu: vLLM runs on its CPU platform (default: asks vLLM).
        native: the CPU has native bfloat16 (default: `native_bf16()`).
    """
    if kwargs.get("dtype", "auto") != "auto" or checkpoint_dtype(model) != "float32":
        return kwargs
    if on_cpu is None:
        on_cpu = vllm_on_cpu()
    if not on_cpu or (native_bf16() if native is None else native):
        return kwargs
    log.info(
        "dtype auto -> float32 for %s: a float32 checkpoint, and this CPU has no native "
        "bfloat16 (AVX512_BF16/AMX), which vLLM would emulate; set engine dtype to override",
        model,
    )
    return {**kwargs, "dtype": "float32"}
