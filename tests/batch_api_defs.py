"""The code location the batch API engine tests run under a real `dagster-daemon`: the batch
pipelines of the routing table in `GPUINFER_BATCH_ROUTES`, files under
`GPUINFER_BATCH_FILES_ROOT`, batches from the store at `GPUINFER_BATCH_STORE_URL`, and the
local launcher configured for vLLM's CPU build."""

import dagster as dg

from dagster_gpuinfer import GpuInferenceResource
from dagster_gpuinfer.batch_api.pipelines import batch_pipelines
from dagster_gpuinfer.batch_api.routing import load_routing_table

batch_api = batch_pipelines(load_routing_table(), minimum_interval_seconds=1)

defs = dg.Definitions.merge(
    batch_api.defs,
    dg.Definitions(
        resources={
            "gpu": GpuInferenceResource(
                launcher="local",
                engine_overrides={"gpu_memory_utilization": 0.2, "enforce_eager": True},
                env={
                    "HF_HUB_OFFLINE": "1",
                    "TOKENIZERS_PARALLELISM": "false",
                    "VLLM_LOGGING_LEVEL": "WARNING",
                },
            )
        },
        executor=dg.in_process_executor,
    ),
)
