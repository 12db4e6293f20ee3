"""The job spec: validated in the control plane with messages that name the field."""

from __future__ import annotations

import dagster as dg
import pytest

from dagster_gpuinfer import InferenceSpec, InvalidInferenceSpec, inference_assets
from dagster_gpuinfer.resource import validate_spec

BASE = {
    "model": "/models/minilm",
    "task": "embed",
    "input": {"uri": "/data/{partition_key}.parquet"},
    "output": {"root": "/out", "asset_name": "emb"},
}


def test_unknown_task_is_rejected_naming_the_field():
    with pytest.raises(InvalidInferenceSpec) as info:
        validate_spec({**BASE, "task": "summarize"}, where="asset 'emb'")
    message = str(info.value)
    assert "task" in message and "summarize" in message and "asset 'emb'" in message


def test_factory_rejects_an_invalid_spec_at_definition_time():
    with pytest.raises(InvalidInferenceSpec, match=r"engine\.gpu_memory_utilization"):
        inference_assets(
            name="emb",
            model="/models/minilm",
            task="embed",
            input={"uri": "/data/{partition_key}.parquet"},
            output_root="/out",
            partitions_def=dg.StaticPartitionsDefinition(["a"]),
            engine={"gpu_memory_utilization": 1.5},
        )


def test_input_uri_without_partition_placeholder_is_rejected():
    with pytest.raises(InvalidInferenceSpec, match=r"input\.uri.*\{partition_key\}"):
        validate_spec({**BASE, "input": {"uri": "/data/all.parquet"}}, where="asset 'emb'")


def test_unknown_engine_field_is_rejected_not_silently_dropped():
    with pytest.raises(InvalidInferenceSpec, match=r"engine\.tensor_paralel_size"):
        validate_spec({**BASE, "engine": {"tensor_paralel_size": 2}}, where="asset 'emb'")


def test_sampling_parameters_on_an_embedding_task_are_rejected():
    with pytest.raises(InvalidInferenceSpec, match="does not sample"):
        validate_spec({**BASE, "sampling": {"max_tokens": 5}}, where="asset 'emb'")


def test_spec_hash_ignores_performance_knobs_and_parallelism():
    spec = InferenceSpec.model_validate(BASE)
    tuned = InferenceSpec.model_validate(
        {
            **BASE,
            "engine": {"gpu_memory_utilization": 0.5, "max_num_seqs": 8, "enforce_eager": True},
            "replicas": 4,
            "tensor_parallel_size": 2,
            "partition_keys": ["a", "b"],
        }
    )
    assert spec.spec_hash() == tuned.spec_hash()


@pytest.mark.parametrize(
    "change",
    [
        {"model": "/models/other"},
        {"engine": {"dtype": "float16"}},
        {"engine": {"max_model_len": 128}},
        {"chunk_size": 7},
        {"input": {"uri": "/data/{partition_key}.parquet", "text_column": "body"}},
    ],
)
def test_spec_hash_changes_with_what_decides_results(change):
    assert (
        InferenceSpec.model_validate(BASE).spec_hash()
        != InferenceSpec.model_validate({**BASE, **change}).spec_hash()
    )


def test_sampling_change_changes_the_hash_of_a_generation_spec():
    generate = {**BASE, "task": "generate"}
    a = InferenceSpec.model_validate({**generate, "sampling": {"max_tokens": 8}})
    b = InferenceSpec.model_validate({**generate, "sampling": {"max_tokens": 9}})
    assert a.spec_hash() != b.spec_hash()


def test_spec_survives_the_pipes_round_trip():
    spec = InferenceSpec.model_validate({**BASE, "partition_keys": ["x/y", "ünï"]})
    assert InferenceSpec.model_validate_json(spec.model_dump_json()) == spec


def test_engine_args_keep_vllm_names():
    spec = InferenceSpec.model_validate(
        {**BASE, "engine": {"max_model_len": 64, "extra": {"swap_space": 1}}}
    )
    kwargs = spec.engine.to_vllm_kwargs()
    assert kwargs["max_model_len"] == 64
    assert kwargs["swap_space"] == 1
    assert "extra" not in kwargs and "max_num_seqs" not in kwargs
