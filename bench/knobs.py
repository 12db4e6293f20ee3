"""Why vLLM's CPU engine trailed a plain transformers loop on embeddings, knob by knob.

Raw engines on the same embedding rows, interleaved: vLLM's CPU defaults (executor "mp",
`VLLM_CPU_OMP_THREADS_BIND=auto`: the model gets all cores but one, pinned), every core
pinned, the model inside the engine-core process (`distributed_executor_backend="uni"`, one
process fewer) with all cores but one, a larger `max_num_batched_tokens`, bfloat16 (the AMX
path of recent Xeons; changes the numbers slightly), and the transformers loop in float32
and bfloat16. Not part of the default run (`--only
knobs`): each variant is one more engine start.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from bench.context import KV_CACHE_BYTES, BenchContext
from bench.server import ContestantProcess
from bench.stats import paired_ratios, rotations, summarize
from bench.workloads import embed_texts

log = logging.getLogger("bench")


def run_knobs(ctx: BenchContext) -> dict[str, Any]:
    sizes = ctx.sizes
    model = ctx.embed_model()
    texts = embed_texts(sizes.embed_rows)
    cores = len(os.sched_getaffinity(0))
    base = {
        "runner": "pooling",
        "dtype": "float32",
        "gpu_memory_utilization": 0.2,
        "enforce_eager": True,
        "kv_cache_memory_bytes": KV_CACHE_BYTES,
    }
    uni = {**base, "distributed_executor_backend": "uni"}
    spare = {"OMP_NUM_THREADS": str(max(1, cores - 1))}
    variants: dict[str, tuple[str, dict[str, Any], dict[str, str]]] = {
        "vLLM defaults (mp, auto bind: cores-1)": ("vllm", base, {}),
        "mp, all cores bound": ("vllm", base, {"VLLM_CPU_OMP_THREADS_BIND": f"0-{cores - 1}"}),
        "uni executor, cores-1 threads": ("vllm", uni, spare),
        "max_num_batched_tokens 16384": ("vllm", {**base, "max_num_batched_tokens": 16384}, {}),
        "bfloat16": ("vllm", {**base, "dtype": "bfloat16"}, {}),
        "transformers float32": ("hf", {"dtype": "float32"}, {}),
        "transformers bfloat16": ("hf", {"dtype": "bfloat16"}, {}),
    }
    env_base = ctx.engine_env()
    contestants: dict[str, ContestantProcess] = {}
    loads: dict[str, float] = {}
    try:
        for index, (name, (kind, kwargs, env)) in enumerate(variants.items()):
            log.info("knobs: starting %s", name)
            if kind == "vllm":
                backend, init = (
                    "bench.backends:VllmBackend",
                    dict(model=model, task="embed", engine_kwargs=kwargs),
                )
            else:
                backend, init = (
                    "bench.backends:TransformersBackend",
                    dict(model=model, task="embed", batch_size=64, **kwargs),
                )
            contestants[name] = ContestantProcess(
                f"knobs-{index}", backend, init, env={**env_base, **env}, log_dir=ctx.log_dir
            )
            loads[name] = contestants[name].info["engine_seconds"]
        rates: dict[str, list[float]] = {name: [] for name in variants}
        for round_index, order in enumerate(rotations(list(variants), sizes.rounds)):
            for name in order:
                out = contestants[name].call("run", texts)
                rates[name].append(out["rows"] / out["seconds"])
                log.info("knobs round %d %-48s %7.1f rows/s", round_index, name, rates[name][-1])
    finally:
        for contestant in contestants.values():
            contestant.close()
    reference = "transformers float32"
    return {
        "rows": len(texts),
        "cores": cores,
        "variants": {
            name: {
                "rows_per_s": rates[name],
                "rows_per_s_summary": summarize(rates[name]).__dict__,
                "over_transformers_fp32": paired_ratios(rates[name], rates[reference]).__dict__,
                "engine_seconds": loads[name],
            }
            for name in variants
        },
    }
