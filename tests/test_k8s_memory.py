"""The out-of-memory step-down (`dagster_gpuinfer.k8s.memory`) and the shared memory markers."""

from __future__ import annotations

import pytest

from dagster_gpuinfer.k8s.memory import step_down_memory
from dagster_gpuinfer.out_of_memory import memory_problem
from dagster_gpuinfer.spec import InferenceSpec


def test_step_down_halves_batches_and_keeps_the_spec_hash():
    spec = InferenceSpec.model_validate(
        {
            "model": "/models/m",
            "task": "embed",
            "input": {"uri": "in/{partition_key}.parquet"},
            "output": {"root": "out", "asset_name": "a"},
            "engine": {"max_num_seqs": 64, "gpu_memory_utilization": 0.3},
        }
    )
    stepped, change = step_down_memory(spec)
    assert (stepped.engine.max_num_seqs, stepped.engine.gpu_memory_utilization) == (32, 0.24)
    assert change == {
        "max_num_seqs": {"from": 64, "to": 32},
        "gpu_memory_utilization": {"from": 0.3, "to": 0.24},
    }
    assert stepped.spec_hash() == spec.spec_hash()


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate", "gpu_out_of_memory"),
        (
            "ValueError: No available memory for the cache blocks. Try increasing",
            "gpu_out_of_memory",
        ),
        (
            (
                "The model's max seq len (32768) is larger than the maximum number of tokens "
                "that can be stored in KV cache (8192)"
            ),
            "kv_cache_too_small",
        ),
        ("KeyError: 'text'", None),
        # Not every message that names the KV cache is about memory.
        ("Failed to promote local KV cache specs to one unified type.", None),
    ],
)
def test_memory_problem_reads_vllm_and_torch_messages(text, problem):
    assert memory_problem(text) == problem
