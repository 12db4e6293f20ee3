"""Placement of data-parallel replicas: a pure function of replicas, TP size and devices."""

from __future__ import annotations

import pytest

from dagster_gpuinfer.worker.errors import SpecError
from dagster_gpuinfer.worker.run.job import plan_replica_env


def test_gpu_replicas_get_disjoint_slices_of_tensor_parallel_size():
    envs = plan_replica_env(
        replicas=2,
        tensor_parallel_size=4,
        device="cuda",
        gpu_ids=[str(i) for i in range(8)],
        cpu_ids=[0],
    )
    assert envs == [{"CUDA_VISIBLE_DEVICES": "0,1,2,3"}, {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}]


def test_gpu_slices_follow_an_existing_cuda_visible_devices():
    envs = plan_replica_env(
        replicas=2, tensor_parallel_size=1, device="cuda", gpu_ids=["5", "7"], cpu_ids=[0]
    )
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["5", "7"]


def test_too_few_gpus_is_an_actionable_error():
    with pytest.raises(SpecError, match="needs 4 GPUs but this worker sees 2"):
        plan_replica_env(
            replicas=2, tensor_parallel_size=2, device="cuda", gpu_ids=["0", "1"], cpu_ids=[0]
        )


def test_cpu_replicas_split_the_cores():
    envs = plan_replica_env(
        replicas=2, tensor_parallel_size=1, device="cpu", gpu_ids=[], cpu_ids=[0, 1, 2, 3]
    )
    assert envs == [{"VLLM_CPU_OMP_THREADS_BIND": "0-1"}, {"VLLM_CPU_OMP_THREADS_BIND": "2-3"}]


def test_cpu_tensor_parallel_ranks_are_separated_by_a_bar():
    envs = plan_replica_env(
        replicas=1, tensor_parallel_size=2, device="cpu", gpu_ids=[], cpu_ids=[0, 1, 2, 3]
    )
    assert envs == [{"VLLM_CPU_OMP_THREADS_BIND": "0-1|2-3"}]


def test_more_cpu_replicas_than_cores_share_cores_round_robin():
    envs = plan_replica_env(
        replicas=3, tensor_parallel_size=1, device="cpu", gpu_ids=[], cpu_ids=[0, 1]
    )
    assert [e["VLLM_CPU_OMP_THREADS_BIND"] for e in envs] == ["0", "1", "0"]


def test_gpu_replicas_get_tensor_times_pipeline_parallel_gpus():
    envs = plan_replica_env(
        replicas=2,
        tensor_parallel_size=2,
        pipeline_parallel_size=2,
        device="cuda",
        gpu_ids=[str(i) for i in range(8)],
        cpu_ids=[0],
    )
    assert envs == [{"CUDA_VISIBLE_DEVICES": "0,1,2,3"}, {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}]


def test_too_few_gpus_for_pipeline_stages_names_the_pipeline_size():
    with pytest.raises(SpecError, match="pipeline_parallel_size=2 needs 8 GPUs but this worker"):
        plan_replica_env(
            replicas=2,
            tensor_parallel_size=2,
            pipeline_parallel_size=2,
            device="cuda",
            gpu_ids=[str(i) for i in range(4)],
            cpu_ids=[0],
        )


def test_cpu_replicas_bind_one_core_range_per_tensor_and_pipeline_rank():
    envs = plan_replica_env(
        replicas=2,
        tensor_parallel_size=1,
        pipeline_parallel_size=2,
        device="cpu",
        gpu_ids=[],
        cpu_ids=list(range(8)),
    )
    assert envs == [
        {"VLLM_CPU_OMP_THREADS_BIND": "0-1|2-3"},
        {"VLLM_CPU_OMP_THREADS_BIND": "4-5|6-7"},
    ]
