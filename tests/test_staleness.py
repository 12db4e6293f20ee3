"""What Dagster's staleness says of inference partitions: the output asset's code version is
the output-shaping part of the spec, the input asset's data versions are the shards'
versions, so a shard rewritten or a spec changed shows which partitions are out of date, and
`recompute_stale()` asks for exactly those.

No engine runs here: the partitions are committed by hand as a worker leaves them, so each
Dagster run below reuses them (the control plane launches no worker) and records its
materializations with their code version and input provenance, as a run that computed them
would.
"""

from __future__ import annotations

from pathlib import Path

import dagster as dg
import pytest
from dagster._core.definitions.data_version import StaleStatus
from dagster._core.definitions.observe import observe
from dagster._utils.test.data_versions import get_stale_status_resolver
from support import commit_by_hand, materialize_partitions, partition_metadata, write_parquet

from dagster_gpuinfer import GpuInferenceResource, InferenceSpec, InputSpec, inference_assets
from dagster_gpuinfer.asset_factory import recompute_stale

KEYS = ["p0", "p1"]


def _write_shard(root: Path, key: str, rows: int) -> None:
    write_parquet(
        root / "in" / f"{key}.parquet",
        {"id": [f"{key}-{i}" for i in range(rows)], "text": [f"{key} {i}" for i in range(rows)]},
    )


def _pipeline(root: Path, **changes):
    settings = {
        "name": "emb",
        "model": str(root / "model"),
        "task": "embed",
        "input": InputSpec(uri=str(root / "in" / "{partition_key}.parquet")),
        "output_root": str(root / "out"),
        "partitions_def": dg.StaticPartitionsDefinition(KEYS),
        "automation_condition": recompute_stale(),
        **changes,
    }
    return inference_assets(**settings)


def _commit_as_a_worker_would(pipeline, key: str) -> None:
    """A partition committed from its shard and model files as they are now (no rows out:
    the checks count files, and this test is about versions)."""
    commit_by_hand(InferenceSpec.model_validate(pipeline.spec), key)


@pytest.fixture
def committed(tmp_path, instance):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    for key in KEYS:
        _write_shard(tmp_path, key, 3)
    pipeline = _pipeline(tmp_path)
    resource = GpuInferenceResource()
    observe([pipeline.input_asset], instance=instance, resources={"gpu": resource})
    for key in KEYS:
        _commit_as_a_worker_would(pipeline, key)
    result = materialize_partitions(pipeline, KEYS, resource=resource, instance=instance)
    assert result.success
    return tmp_path, pipeline, resource


def _statuses(instance, pipeline) -> dict[str, StaleStatus]:
    resolver = get_stale_status_resolver(instance, pipeline.assets)
    return {key: resolver.get_status(pipeline.output_asset.key, key) for key in KEYS}


def test_observing_the_input_records_each_shards_version_as_its_data_version(committed, instance):
    root, pipeline, _ = committed
    resolver = get_stale_status_resolver(instance, pipeline.assets)
    for key in KEYS:
        version = resolver.get_current_data_version(pipeline.input_asset.key, key)
        metadata = partition_metadata(instance, pipeline.output_asset.key, key)
        assert version.value == metadata["input_version"]  # the one the manifest recorded
        assert metadata["computed_in_this_run"] is False  # reused: no worker ran
    assert _statuses(instance, pipeline) == {"p0": StaleStatus.FRESH, "p1": StaleStatus.FRESH}


def test_a_rewritten_shard_marks_its_partition_stale_and_recompute_stale_asks_for_it_alone(
    committed, instance
):
    root, pipeline, resource = committed
    defs = dg.Definitions(assets=pipeline.assets, resources={"gpu": resource})
    before = dg.evaluate_automation_conditions(defs=defs, instance=instance)
    assert before.total_requested == 0

    _write_shard(root, "p1", 2)
    observe([pipeline.input_asset], instance=instance, resources={"gpu": resource})

    resolver = get_stale_status_resolver(instance, pipeline.assets)
    assert _statuses(instance, pipeline) == {"p0": StaleStatus.FRESH, "p1": StaleStatus.STALE}
    (cause,) = resolver.get_stale_causes(pipeline.output_asset.key, "p1")
    assert cause.dependency is not None and cause.dependency.partition_key == "p1"
    assert "new dependency data version" in cause.reason
    after = dg.evaluate_automation_conditions(defs=defs, instance=instance, cursor=before.cursor)
    requested = after.get_requested_partitions(pipeline.output_asset.key)
    assert requested == {"p1"}


@pytest.mark.parametrize(
    ("change", "stale"),
    [
        ({"model": "/models/another"}, True),
        ({"engine": {"dtype": "float16"}}, True),
        ({"limits": {"max_prompt_chars": 1000}}, True),
        ({"input": "text column"}, True),
        ({"chat template": "{{ messages[0].content }}"}, True),
        ({"chunk_size": 7}, False),
        ({"replicas": 2, "tensor_parallel_size": 2, "max_requests_in_flight": 9}, False),
        ({"engine": {"max_num_seqs": 4, "gpu_memory_utilization": 0.5}}, False),
    ],
)
def test_a_spec_change_marks_partitions_stale_only_when_it_changes_outputs(
    committed, instance, change, stale
):
    root, pipeline, _ = committed
    if change.get("input") == "text column":
        uri = str(root / "in" / "{partition_key}.parquet")
        change = {"input": InputSpec(uri=uri, text_column="t")}
    if "chat template" in change:  # it lives in the model folder, beside the weights
        config = root / "model" / "tokenizer_config.json"
        config.write_text(f'{{"chat_template": "{change.pop("chat template")}"}}')
    changed = _pipeline(root, **change)
    expected = StaleStatus.STALE if stale else StaleStatus.FRESH
    assert _statuses(instance, changed) == {key: expected for key in KEYS}


def test_code_version_covers_sampling_and_the_chat_template_but_not_scheduling():
    base = {
        "model": "org/llm",
        "task": "chat",
        "input": {"uri": "in/{partition_key}.jsonl"},
        "output": {"root": "out", "asset_name": "a"},
    }

    def version(**fields) -> str:
        return InferenceSpec.model_validate({**base, **fields}).code_version()

    assert version() != version(sampling={"temperature": 0.3})
    assert version() != version(sampling={"seed": 1})
    assert version() != version(task="generate")
    assert version() == version(chunk_size=3, replicas=2, group_prefixes=False)
    assert version() == version(output={"root": "s3://elsewhere", "asset_name": "a"})
    assert version() != version(output={"root": "out", "asset_name": "a", "format": "openai_batch"})
