"""One source for pipeline configuration: the asset factory's keywords, the YAML component's
attributes and the launchpad run config all come from the spec models, so a setting added
to the spec is settable in all three. These tests walk the spec and fail when they drift."""

from __future__ import annotations

import enum
import typing
from typing import Any, get_args

import dagster as dg
import pytest
from pydantic import Field

import dagster_gpuinfer.asset_factory as asset_factory
import dagster_gpuinfer.resource as resource
from dagster_gpuinfer import InferenceSpec, inference_assets
from dagster_gpuinfer.asset_factory import InferenceRunConfig, run_config_model
from dagster_gpuinfer.components import InferencePipelineComponent
from dagster_gpuinfer.components.inference_pipeline import _PipelineAttributes, settings_model
from dagster_gpuinfer.spec import (
    EngineArgs,
    SamplingParams,
    Task,
    pipeline_fields,
    run_config_fields,
)

BASE_YAML = """
name: docs
model: /models/minilm
task: generate
input:
  uri: data/{partition_key}.jsonl
output_root: out
partitioning:
  type: static
  keys: [a, b]
"""


def _other_value(info: Any) -> Any:
    """A valid value for a spec field that differs from its default."""
    default = info.default
    kinds = {a for a in get_args(info.annotation) if a is not type(None)} or {info.annotation}
    if bool in kinds:
        return not default
    if int in kinds:
        return 7 if default in (None, 7) else default + 1
    if float in kinds:
        return 0.5 if default != 0.5 else 0.25
    if str in kinds and default is None:  # vllm_version: a version (YAML reads it as text)
        return "0.32.0"
    if info.annotation == dict[str, str]:  # lora_adapters: a name and its folder
        return {"support": "/models/adapters/support"}
    enums = [k for k in kinds if isinstance(k, type) and issubclass(k, enum.Enum)]
    if enums:  # row_reuse: another member, by value (YAML and run config give text)
        return next(m.value for m in enums[0] if m != default)
    raise AssertionError(f"no test value for {info.annotation}: teach _other_value the type")


def _factory(**settings: Any) -> dict[str, Any]:
    return inference_assets(
        name="docs",
        model="/models/minilm",
        task="generate",
        input={"uri": "data/{partition_key}.jsonl"},
        output_root="out",
        partitions_def=dg.StaticPartitionsDefinition(["a", "b"]),
        **settings,
    ).spec


# Settings whose other value is valid only beside another setting (the spec checks them
# together): nodes=2 splits tensor_parallel_size x pipeline_parallel_size ranks over 2 pods.
COMPANIONS: dict[str, dict[str, Any]] = {"nodes": {"tensor_parallel_size": 2}}


def _yaml_lines(settings: dict[str, Any]) -> str:
    return "".join(
        f"{key}: {str(value).lower() if isinstance(value, bool) else value}\n"
        for key, value in settings.items()
    )


@pytest.mark.parametrize("name", sorted(pipeline_fields()))
def test_every_pipeline_setting_is_settable_in_factory_yaml_and_run_config(name):
    value = _other_value(pipeline_fields()[name])
    companions = COMPANIONS.get(name, {})
    assert _factory(**companions, **{name: value})[name] == value

    yaml_text = BASE_YAML + _yaml_lines({**companions, name: value})
    component = InferencePipelineComponent.resolve_from_yaml(yaml_text)
    assert component.build_pipeline().spec[name] == value

    raw = _factory(**companions)
    if name in InferenceSpec.NOT_PER_RUN:  # the pipeline's, not a run's (lora_adapters)
        assert name not in InferenceRunConfig.model_fields
        return
    assert InferenceRunConfig(**{name: value}).apply(raw)[name] == value


@pytest.mark.parametrize(
    ("section", "model"), [("engine", EngineArgs), ("sampling", SamplingParams)]
)
def test_every_engine_and_sampling_field_is_a_run_setting_unless_locked(section, model):
    derived = {(s, field) for s, field, _ in run_config_fields().values()}
    for field in model.model_fields:
        assert ((section, field) in derived) == (field not in model.NOT_PER_RUN), field
    # YAML and the factory take the whole model (as a mapping) and validate it as the spec.
    assert _factory(**{section: {}})[section] == {}


def test_a_run_overrides_engine_and_sampling_fields_in_their_sections():
    raw = _factory(engine={"dtype": "float32"}, sampling={"max_tokens": 8})
    config = InferenceRunConfig(max_num_seqs=4, max_tokens=16, engine_seed=3, sampling_seed=5)
    spec = config.apply(raw)
    assert spec["engine"] == {"dtype": "float32", "max_num_seqs": 4, "seed": 3}
    assert spec["sampling"] == {"max_tokens": 16, "seed": 5}
    assert raw["engine"] == {"dtype": "float32"}  # the pipeline's own spec is not changed
    InferenceSpec.model_validate(spec)


def test_a_run_cannot_turn_on_code_or_pickle_loading():
    for locked in ("trust_remote_code", "allow_pickle_weights", "load_format", "extra"):
        assert locked not in InferenceRunConfig.model_fields
        assert f"engine_{locked}" not in InferenceRunConfig.model_fields


def test_a_field_added_to_the_spec_shows_up_in_factory_component_and_run_config(monkeypatch):
    class EngineWithKnob(EngineArgs):
        kv_offload_gib: float | None = Field(None, description="A new engine knob.")

    class SpecWithSettings(InferenceSpec):
        engine: EngineWithKnob = Field(default_factory=EngineWithKnob)
        prefetch_shards: int = Field(1, ge=1, description="A new pipeline setting.")

    component = settings_model(_PipelineAttributes, SpecWithSettings)
    assert component.model_fields["prefetch_shards"].description == "A new pipeline setting."
    with pytest.raises(ValueError, match="prefetch_shards"):  # the spec's own bound
        component.model_validate(
            {**_component_attributes(), "prefetch_shards": 0}, context={"resolving": True}
        )

    config = run_config_model(SpecWithSettings)
    assert {"prefetch_shards", "kv_offload_gib"} <= set(config.model_fields)
    spec = config(prefetch_shards=3, kv_offload_gib=2.0).apply({"engine": {}, "sampling": {}})
    assert spec["prefetch_shards"] == 3 and spec["engine"] == {"kv_offload_gib": 2.0}

    # The factory takes it without a new keyword: `**spec_fields` is checked against the spec.
    monkeypatch.setattr(asset_factory, "pipeline_fields", lambda: pipeline_fields(SpecWithSettings))
    monkeypatch.setattr(resource, "InferenceSpec", SpecWithSettings)
    assert _factory(prefetch_shards=2)["prefetch_shards"] == 2


def _component_attributes() -> dict[str, Any]:
    return {
        "name": "docs",
        "model": "/m",
        "task": "embed",
        "input": {"uri": "{partition_key}.jsonl"},
        "output_root": "out",
        "partitioning": {"type": "static", "keys": ["a"]},
    }


def test_an_unknown_setting_names_the_ones_the_spec_has():
    with pytest.raises(TypeError, match=r"unknown settings \['replica_count'\].*'replicas'"):
        _factory(replica_count=2)


def test_task_lists_name_every_task():
    tasks = get_args(Task)
    assert len(tasks) == 8
    assert InferencePipelineComponent.model_fields["task"].annotation == Task
    texts = {
        "InferenceSpec.task": InferenceSpec.model_fields["task"].description,
        "inference_assets": inference_assets.__doc__,
        "validate_spec": resource.validate_spec.__doc__,
    }
    for where, text in texts.items():
        missing = [task for task in tasks if task not in (text or "")]
        assert not missing, f"{where} does not name {missing}"
    assert typing.get_type_hints(inference_assets)["task"] == Task
