"""LoRA adapters without an engine: the spec's rules, the row's adapter and its error, the
engine arguments and pool key, the batch API's routes, the adapters' versions (local and
S3) and their lineage metadata. The real engine runs them in tests/test_lora_engine.py."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pytest
from pydantic import ValidationError
from support import commit_by_hand, write_parquet
from transformers import AutoTokenizer

from dagster_gpuinfer.batch_api.routing import routing_table
from dagster_gpuinfer.batch_api.validation import validate_batch_input
from dagster_gpuinfer.metadata import adapter_metadata
from dagster_gpuinfer.pools.keys import pool_key
from dagster_gpuinfer.spec import EngineArgs, InferenceSpec, InputSpec, OutputSpec
from dagster_gpuinfer.storage import adapter_versions, committed_manifest, model_version
from dagster_gpuinfer.worker.errors import SpecError
from dagster_gpuinfer.worker.loop.adapters import check_local_adapters, ready_adapters
from dagster_gpuinfer.worker.loop.engine import engine_kwargs
from dagster_gpuinfer.worker.rows.readers import ShardReader
from dagster_gpuinfer.worker.rows.request_params import AdapterNames, RequestBuilder
from dagster_gpuinfer.worker.rows.validate import RowValidator, screen_ids


def write_adapter(folder: Path, rank: int = 8) -> str:
    """A PEFT adapter folder as `save_pretrained` writes one (its weights' bytes do not
    matter here: nothing loads them)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": rank, "target_modules": ["q_proj"]})
    )
    (folder / "adapter_model.safetensors").write_bytes(b"weights " * 16)
    return str(folder)


def gen_spec(tmp_path: Path, *, adapters=None, task="generate", **fields) -> InferenceSpec:
    """A spec over a base model folder under `tmp_path` (made here) listing `adapters`."""
    (tmp_path / "base").mkdir(exist_ok=True)
    (tmp_path / "base" / "config.json").write_text("{}")
    input_fields = {"uri": str(tmp_path / "in" / "{partition_key}.parquet")}
    input_fields.update(fields.pop("input", {}))
    return InferenceSpec(
        model=str(tmp_path / "base"),
        task=task,
        input=InputSpec(**input_fields),
        output=OutputSpec(root=str(tmp_path / "out"), asset_name="gen"),
        lora_adapters=adapters or {},
        **fields,
    )


# --------------------------------------------------------------------------- the spec


@pytest.mark.parametrize(
    ("adapters", "fields", "refused"),
    [
        ({"support": "/models/a"}, {"task": "embed"}, "does not generate"),
        ({"bad name!": "/models/a"}, {}, "adapter name"),
        ({"support": "org/adapter-on-the-hub"}, {}, "neither a local folder"),
        ({}, {"input": {"adapter_column": "adapter"}}, "lists no lora_adapters"),
        ({"support": "/models/a"}, {"engine": EngineArgs(enable_lora=False)}, "enable_lora"),
        ({"tiny": "/models/a"}, {"served_model_name": "tiny"}, "base model's own name"),
    ],
)
def test_spec_refuses_adapters_it_cannot_serve(tmp_path, adapters, fields, refused):
    with pytest.raises(ValidationError, match=refused):
        gen_spec(tmp_path, adapters=adapters, **fields)


def test_adapters_enter_the_spec_hash_only_when_listed(tmp_path):
    plain = gen_spec(tmp_path)
    # Unset LoRA engine arguments and no adapter column leave earlier hashes as they were.
    assert plain.spec_hash() == gen_spec(tmp_path, engine=EngineArgs(max_loras=4)).spec_hash()
    payload = plain._results_payload()
    assert "lora_adapters" not in payload and "adapter_column" not in payload["input"]
    assert not {"enable_lora", "max_loras", "max_lora_rank"} & set(payload["engine"])
    one = gen_spec(tmp_path, adapters={"a": "/models/a"})
    assert one.spec_hash() == gen_spec(tmp_path, adapters={"a": "/models/./a/"}).spec_hash()
    other_path = gen_spec(tmp_path, adapters={"a": "/models/a2"})
    assert len({plain.spec_hash(), one.spec_hash(), other_path.spec_hash()}) == 3
    assert one.code_version() != plain.code_version()


def test_listed_adapters_turn_lora_on_and_share_a_pool_with_the_same_engine(tmp_path):
    two = gen_spec(tmp_path, adapters={"a": "/m/a", "b": "/m/b"})
    other_two = gen_spec(tmp_path, adapters={"c": "/m/c", "d": "s3://bucket/d/"})
    kwargs = engine_kwargs(two)
    assert (kwargs["enable_lora"], kwargs["max_loras"]) == (True, 2)
    assert "enable_lora" not in engine_kwargs(gen_spec(tmp_path))
    # The adapter list is not the engine: two pipelines of two adapters share a pool...
    assert pool_key(two) == pool_key(other_two)
    # ...an engine without LoRA is another pool, and an explicit max_loras is kept.
    assert pool_key(two) != pool_key(gen_spec(tmp_path))
    pinned = gen_spec(tmp_path, adapters={"a": "/m/a"}, engine=EngineArgs(max_loras=2))
    assert engine_kwargs(pinned)["max_loras"] == 2 and pool_key(pinned) == pool_key(two)


# --------------------------------------------------------------------------- the row


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir):
    return AutoTokenizer.from_pretrained(tiny_llama_dir)


def validated(tokenizer, spec: InferenceSpec, key: str = "p"):
    """The shard's first chunk as the worker reads, screens and validates it."""
    reader = ShardReader(spec, key)
    reader.preflight()
    raw = screen_ids(next(reader.chunks(64)), set())
    builder = RequestBuilder(task="generate", defaults={}, adapters=AdapterNames.of(spec))
    validator = RowValidator(
        task="generate", tokenizer=tokenizer, max_model_len=64, requests=builder
    )
    return validator.validate(raw)


def test_each_row_names_its_adapter_by_column_and_an_unknown_one_is_its_error(tmp_path, tokenizer):
    spec = gen_spec(
        tmp_path,
        adapters={"support": "/m/support", "legal": "/m/legal"},
        input={"text_column": "prompt", "adapter_column": "adapter"},
    )
    write_parquet(
        tmp_path / "in" / "p.parquet",
        {
            "id": ["base", "support", "legal", "named-base", "typo", "empty"],
            "prompt": ["hello there"] * 6,
            "adapter": [None, "support", "legal", str(tmp_path / "base"), "suport", ""],
        },
    )
    out = validated(tokenizer, spec)
    chosen = {
        row_id: request.adapter for row_id, request in zip(out.ids, out.requests, strict=True)
    }
    assert chosen == {
        "base": None,
        "support": "support",
        "legal": "legal",
        "named-base": None,
        "empty": None,
    }
    [error] = out.errors
    assert (error.id, error.error_type) == ("typo", "unknown_adapter")
    assert "'suport'" in error.message and "legal, support" in error.message
    assert "'adapter'" in error.message  # the column that named it


def test_an_openai_line_names_its_adapter_by_model(tmp_path, tokenizer):
    spec = gen_spec(
        tmp_path,
        adapters={"support": "/m/support"},
        served_model_name="tiny",
        input={"uri": str(tmp_path / "{partition_key}.jsonl"), "format": "openai_batch"},
    )
    lines = [
        {"custom_id": cid, "url": "/v1/completions", "body": {"model": model, "prompt": "hi"}}
        for cid, model in (("a", "tiny"), ("b", "support"), ("c", "gpt-4o"))
    ]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = validated(tokenizer, spec)
    assert [(i, r.adapter) for i, r in zip(out.ids, out.requests, strict=True)] == [
        ("a", None),
        ("b", "support"),
    ]
    [error] = out.errors
    assert error.error_type == "unknown_adapter" and "'gpt-4o' ('model')" in error.message


def test_without_adapters_a_rows_model_stays_neutral():
    request = RequestBuilder(task="generate", defaults={}).build({"model": "anything"})
    assert request.adapter is None


# --------------------------------------------------------------------------- versions


def test_adapter_versions_follow_the_files_and_a_changed_adapter_recomputes(tmp_path):
    folder = Path(write_adapter(tmp_path / "adapters" / "support"))
    spec = gen_spec(tmp_path, adapters={"support": str(folder)})
    write_parquet(tmp_path / "in" / "p.parquet", {"id": ["a"], "text": ["hi"]})
    first = adapter_versions(spec)
    assert first is not None and first.startswith("support=files:2:")
    manifest = commit_by_hand(spec, "p", [pa.table({"id": ["a"], "text": ["x"]})])
    assert manifest.source.adapters == first
    assert committed_manifest(spec, "p", model=model_version(spec)) is not None
    (folder / "adapter_model.safetensors").write_bytes(b"new weights " * 16)
    assert adapter_versions(spec) != first
    assert committed_manifest(spec, "p", model=model_version(spec)) is None
    metadata = adapter_metadata(spec, manifest).get("lora_adapters")
    assert metadata.value == {"support": {"path": str(folder), "version": first.split("=", 1)[1]}}


def test_local_adapters_are_checked_before_the_engine_loads(tmp_path):
    ok = write_adapter(tmp_path / "ok", rank=8)
    high = write_adapter(tmp_path / "high", rank=64)
    check_local_adapters(gen_spec(tmp_path, adapters={"ok": ok}))
    with pytest.raises(SpecError, match="rank 64, more than engine.max_lora_rank=16"):
        check_local_adapters(gen_spec(tmp_path, adapters={"high": high}))
    check_local_adapters(
        gen_spec(tmp_path, adapters={"high": high}, engine=EngineArgs(max_lora_rank=64))
    )
    with pytest.raises(SpecError, match="no adapter_config.json"):
        check_local_adapters(gen_spec(tmp_path, adapters={"empty": str(tmp_path)}))


def test_an_s3_adapter_is_fetched_once_per_version(tmp_path, s3_server, monkeypatch):
    from dagster_gpuinfer.spec import StorageOptions

    monkeypatch.setenv("GPUINFER_ADAPTER_CACHE", str(tmp_path / "cache"))
    bucket = s3_server.new_bucket("adapters")
    config = json.dumps({"peft_type": "LORA", "r": 4}).encode()
    for key, body in (("legal/adapter_config.json", config), ("legal/w.bin", b"one")):
        s3_server.client.put_object(Bucket=bucket, Key=key, Body=body)
    storage = StorageOptions(endpoint_url=s3_server.endpoint_url, allow_http=True)
    spec = gen_spec(tmp_path, adapters={"legal": f"s3://{bucket}/legal/"}, storage=storage)
    first = ready_adapters(spec)["legal"]
    assert Path(first.folder, "w.bin").read_bytes() == b"one"
    assert first.version.startswith("s3:2:")
    assert ready_adapters(spec)["legal"] == first  # cached: same folder, same version
    s3_server.client.put_object(Bucket=bucket, Key="legal/w.bin", Body=b"two")
    second = ready_adapters(spec)["legal"]
    assert second.version != first.version and second.folder != first.folder
    assert Path(second.folder, "w.bin").read_bytes() == b"two"


# --------------------------------------------------------------------------- batch API


def routes():
    return routing_table(
        [
            {
                "model": "tiny",
                "endpoint": "/v1/completions",
                "pipeline": "batch_tiny",
                "model_path": "/models/tiny",
                "lora_adapters": {"support": "/models/support", "legal": "/models/legal"},
            },
            {
                "model": "other",
                "endpoint": "/v1/completions",
                "pipeline": "batch_other",
                "model_path": "/models/other",
            },
        ]
    )


def batch_lines(*models: str) -> list[bytes]:
    return [
        json.dumps(
            {
                "custom_id": f"r{i}",
                "method": "POST",
                "url": "/v1/completions",
                "body": {"model": model, "prompt": "hi"},
            }
        ).encode()
        for i, model in enumerate(models)
    ]


def test_a_route_serves_lines_naming_its_base_model_or_its_adapters():
    table = routes()
    lines = batch_lines("support", "tiny", "legal")
    checked = validate_batch_input(lines, size=100, endpoint="/v1/completions", routes=table)
    assert checked.errors == []
    assert (checked.route.pipeline, checked.model) == ("batch_tiny", "tiny")
    assert "legal" in table.models_on("/v1/completions")
    mixed = batch_lines("support", "other")
    refused = validate_batch_input(mixed, size=100, endpoint="/v1/completions", routes=table)
    assert [e["code"] for e in refused.errors] == ["mismatched_model"]


def test_an_adapter_name_is_served_by_one_route_only():
    with pytest.raises(ValidationError, match="'other' on /v1/completions twice"):
        routing_table(
            [
                *routes().routes,
                {
                    "model": "third",
                    "endpoint": "/v1/completions",
                    "pipeline": "batch_third",
                    "model_path": "/models/third",
                    "lora_adapters": {"other": "/models/x"},
                },
            ]
        )


def test_a_pod_refuses_a_local_adapter_outside_its_model_cache(tmp_path):
    from dagster_gpuinfer.k8s.config import ModelCache, PodSpecError
    from dagster_gpuinfer.k8s.validation import check_model_location

    cache = ModelCache(pvc="model-cache")
    spec = gen_spec(tmp_path, adapters={"ok": "/models/adapters/ok", "s3": "s3://b/a/"})
    check_model_location(spec.model_copy(update={"model": "/models/base"}), cache)
    outside = gen_spec(tmp_path, adapters={"home": "/home/alice/adapter"})
    with pytest.raises(PodSpecError, match=r"lora_adapters\['home'\]='/models/<name>'"):
        check_model_location(outside.model_copy(update={"model": "/models/base"}), cache)
