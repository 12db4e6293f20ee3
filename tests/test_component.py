"""The InferencePipelineComponent: pipelines declared in YAML, loaded by Dagster's component
machinery, registered with `dg` through the package's entry point."""

from __future__ import annotations

import importlib
import re
import sys
import tomllib
from pathlib import Path

import dagster as dg
import pydantic
import pytest
from dagster.components.core.package_entry import (
    DG_PLUGIN_ENTRY_POINT_GROUP,
    discover_entry_point_package_objects,
)

from dagster_gpuinfer import GpuInferenceResource, InferenceSpec, InputSpec, inference_assets
from dagster_gpuinfer.components import InferencePipelineComponent
from dagster_gpuinfer.image_options import ImageOptions

REPO_ROOT = Path(__file__).resolve().parent.parent

TICKETS_YAML = """
name: tickets
model: /models/minilm
task: embed
input:
  uri: s3://support/in/{partition_key}.jsonl
  id_column: ticket_id
  text_column: body
output_root: s3://support/out
partitioning:
  type: dynamic
arrival_sensor:
  glob: "2026-*/*.jsonl"
  launch: backfill
  split_min_bytes: 1000000
engine:
  dtype: float16
  max_model_len: 512
tensor_parallel_size: 2
replicas: 2
max_partitions_per_run: 8
pool: gpus
group_name: support
"""


def build(yaml_text: str, resources: dict | None = None) -> dg.Definitions:
    """The component's definitions, as a code location with a `gpu` resource has them."""
    return dg.component_defs(
        component=InferencePipelineComponent.resolve_from_yaml(yaml_text),
        resources={"gpu": GpuInferenceResource()} if resources is None else resources,
    )


def test_reference_code_location_declares_ticket_embeddings_in_yaml():
    from assets.definitions import defs
    from assets.models import minilm_path

    asset = defs.resolve_assets_def("ticket_embeddings")
    assert isinstance(asset.partitions_def, dg.DynamicPartitionsDefinition)
    assert asset.partitions_def.name == "ticket_files"
    assert asset.backfill_policy == dg.BackfillPolicy.multi_run(max_partitions_per_run=4)
    assert asset.metadata_by_key[asset.key]["model"] == minilm_path()  # a template var
    sensor = defs.resolve_sensor_def("ticket_embeddings_arrivals")
    assert sensor.default_status == dg.DefaultSensorStatus.RUNNING
    graph = defs.resolve_asset_graph()
    assert dg.AssetKey("ticket_embeddings_input") in graph.get(asset.key).parent_keys
    assert (
        graph.get(dg.AssetKey("ticket_embeddings_input"))
        .metadata["uri_template"]
        .endswith("/tickets/{partition_key}.jsonl")
    )


def test_yaml_pipeline_builds_what_the_python_factory_builds():
    defs = build(TICKETS_YAML)
    asset = defs.resolve_assets_def("tickets")
    python = inference_assets(
        name="tickets",
        model="/models/minilm",
        task="embed",
        input=InputSpec(
            uri="s3://support/in/{partition_key}.jsonl", id_column="ticket_id", text_column="body"
        ),
        output_root="s3://support/out",
        partitions_def=dg.DynamicPartitionsDefinition(name="tickets"),
        engine={"dtype": "float16", "max_model_len": 512},
        tensor_parallel_size=2,
        replicas=2,
    )
    component = InferencePipelineComponent.resolve_from_yaml(TICKETS_YAML)
    assert InferenceSpec.model_validate(component.build_pipeline().spec) == (
        InferenceSpec.model_validate(python.spec)
    )
    assert asset.backfill_policy == dg.BackfillPolicy.multi_run(max_partitions_per_run=8)
    assert asset.op.pool == "gpus"
    assert asset.group_names_by_key[asset.key] == "support"
    assert {c.name for c in asset.check_specs} == {"rows_balanced", "error_rate"}
    [sensor] = defs.sensors
    assert sensor.name == "tickets_arrivals"
    assert sensor.default_status == dg.DefaultSensorStatus.STOPPED


def test_a_yaml_image_pipeline_builds_what_the_python_factory_builds():
    """Image columns and the image URL policy are plain `input` fields in YAML; a mistyped
    image limit is named with its path."""
    image_yaml = """
name: product_photos
model: /models/siglip
task: image_embed
input:
  uri: s3://catalog/photos/{partition_key}.parquet
  image_column: photo
  images:
    allowed_url_hosts: [cdn.example.com]
    max_image_pixels: 20000000
    max_side: 512
output_root: s3://catalog/embeddings
partitioning: {type: static, keys: [a, b]}
"""
    component = InferencePipelineComponent.resolve_from_yaml(image_yaml)
    python = inference_assets(
        name="product_photos",
        model="/models/siglip",
        task="image_embed",
        input=InputSpec(
            uri="s3://catalog/photos/{partition_key}.parquet",
            image_column="photo",
            images=ImageOptions(
                allowed_url_hosts=("cdn.example.com",), max_image_pixels=20_000_000, max_side=512
            ),
        ),
        output_root="s3://catalog/embeddings",
        partitions_def=dg.StaticPartitionsDefinition(["a", "b"]),
    )
    spec = InferenceSpec.model_validate(component.build_pipeline().spec)
    assert spec == InferenceSpec.model_validate(python.spec)
    assert spec.input.images.allowed_url_hosts == ("cdn.example.com",)
    assert build(image_yaml).resolve_assets_def("product_photos").partitions_def is not None
    with pytest.raises(dg.DagsterInvalidDefinitionError, match=r"input.images.max_pixels"):
        build(image_yaml.replace("max_image_pixels", "max_pixels"))


def test_daily_yaml_pipeline_comes_with_a_schedule_for_the_previous_day():
    defs = build("""
name: daily_docs
model: /models/minilm
task: embed
input: {uri: "/data/daily/{partition_key}.jsonl"}
output_root: /data/out
partitioning: {type: daily, start_date: "2026-11-01", schedule_hour: 3}
""")
    [schedule] = defs.schedules
    assert schedule.cron_schedule == "0 3 * * *"
    asset = defs.resolve_assets_def("daily_docs")
    assert isinstance(asset.partitions_def, dg.DailyPartitionsDefinition)


def test_a_pipeline_own_resource_is_bound_under_its_own_key():
    defs = build(
        TICKETS_YAML.replace(
            "group_name: support",
            """group_name: support
resource:
  launcher: local
  engine_overrides: {gpu_memory_utilization: 0.5}""",
        ),
        resources={},
    )
    asset = defs.resolve_assets_def("tickets")
    assert "gpuinfer_tickets" in asset.required_resource_keys
    assert "gpu" not in asset.required_resource_keys
    assert defs.resources["gpuinfer_tickets"].engine_overrides == {"gpu_memory_utilization": 0.5}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            ("type: dynamic", "type: static\n  keys: [a]"),
            "arrival_sensor registers partitions.*not 'static'",
        ),
        (("{partition_key}.jsonl", "all.jsonl"), "input.uri.*no {partition_key} placeholder"),
        (("dtype: float16", "dtype: float16\n  max_num_seqs: -1"), "engine.max_num_seqs"),
        (
            ("group_name: support", "group_name: support\nresource: {launcher: slurm}"),
            "`resource` is not a valid GpuInferenceResource",
        ),
    ],
)
def test_yaml_mistakes_are_reported_with_the_attribute_and_the_component(change, message):
    old, new = change
    assert old in TICKETS_YAML
    with pytest.raises(dg.DagsterInvalidDefinitionError, match=message) as raised:
        build(TICKETS_YAML.replace(old, new))
    assert "InferencePipelineComponent 'tickets'" in str(raised.value)


@pytest.mark.parametrize(
    ("change", "attribute", "problem"),
    [
        (
            ("max_partitions_per_run: 8", "max_partitions_per_run: 0"),
            "max_partitions_per_run",
            "greater than or equal to 1",
        ),
        (("replicas: 2", "replicas: -1"), "replicas", "greater than or equal to 1"),
        (
            ("pool: gpus", "pool: gpus\nmax_error_rate: 1.5"),
            "max_error_rate",
            "less than or equal to 1",
        ),
        (
            ("split_min_bytes: 1000000", "split_min_bytes: 0"),
            "arrival_sensor.split_min_bytes",  # pydantic puts the model's name in between
            "greater than or equal to 1",
        ),
    ],
)
def test_out_of_range_attributes_are_named_with_their_yaml_line(
    tmp_path, monkeypatch, change, attribute, problem
):
    """Loaded from a defs folder as `dg` loads it: the error names the component's file, and
    the attribute with its line in that file."""
    old, new = change
    assert old in TICKETS_YAML
    attributes = "".join(f"  {line}\n" for line in TICKETS_YAML.replace(old, new).splitlines())
    module = f"yaml_mistake_{attribute.replace('.', '_')}"  # fresh modules for each case
    package = tmp_path / module / "defs" / "tickets"
    package.mkdir(parents=True)
    for folder in (package.parent.parent, package.parent):
        (folder / "__init__.py").write_text("")
    (package / "defs.yaml").write_text(
        "type: dagster_gpuinfer.components.InferencePipelineComponent\nattributes:\n" + attributes
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    tree = dg.ComponentTree.from_module(
        defs_module=importlib.import_module(f"{module}.defs"), project_root=tmp_path
    )
    with pytest.raises(Exception, match="tickets") as raised:
        tree.build_defs()
    cause = raised.value.__cause__
    assert isinstance(cause, pydantic.ValidationError)
    path = r"\.(\w+Model\.)?".join(map(re.escape, attribute.split(".")))
    assert re.search(rf"attributes\.{path}\S* at \S*defs\.yaml:\d+", str(cause)), str(cause)
    assert problem in str(cause)


def test_entry_point_in_pyproject_registers_the_component_with_dg(tmp_path, monkeypatch):
    """Install-time metadata is what `dg` reads; this writes the entry points that
    pyproject.toml declares into a dist-info and runs dg's own discovery over it."""
    pyproject = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    entry_points = pyproject["project"]["entry-points"][DG_PLUGIN_ENTRY_POINT_GROUP]
    assert entry_points == {"dagster_gpuinfer": "dagster_gpuinfer.components"}
    dist_info = tmp_path / "gpuinfer_entry_point_probe-0.0.0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: gpuinfer-entry-point-probe\nVersion: 0.0.0\n"
    )
    (dist_info / "entry_points.txt").write_text(
        f"[{DG_PLUGIN_ENTRY_POINT_GROUP}]\n"
        + "".join(f"{name} = {value}\n" for name, value in entry_points.items())
    )
    monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])
    found = discover_entry_point_package_objects()
    registered = {(key.namespace, key.name): obj for key, obj in found.items()}
    assert registered[("dagster_gpuinfer.components", "InferencePipelineComponent")] is (
        InferencePipelineComponent
    )


def test_a_yaml_pipeline_chooses_pool_launch_without_changing_its_spec():
    pooled = build(TICKETS_YAML + "launch: pool\n").resolve_assets_def("tickets")
    per_run = build(TICKETS_YAML).resolve_assets_def("tickets")
    assert pooled.metadata_by_key[pooled.key]["gpuinfer/launch"] == "pool"
    assert per_run.metadata_by_key[per_run.key]["gpuinfer/launch"] == "run"
    assert pooled.code_versions_by_key == per_run.code_versions_by_key
