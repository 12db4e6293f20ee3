"""End to end through Dagster with the real vLLM CPU engine and real model weights.

Each module fixture is one (or a few) real Dagster runs; the tests below read what they left:
materialization events in the instance, committed files on disk, the model-load log.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import dagster as dg
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from support import (
    cpu_resource,
    materialize_partitions,
    model_loads,
    partition_metadata,
    write_jsonl,
    write_parquet,
)

from dagster_gpuinfer import InputSpec, OutputSpec, inference_assets, read_errors, read_partition
from dagster_gpuinfer.storage import MANIFEST_NAME, filesystem_for, partition_dir, read_manifest

pytestmark = pytest.mark.engine

SENTENCES = [
    "The river floods every spring after the snow melts.",
    "Compilers translate source code into machine instructions.",
    "A good sourdough needs a lively starter and patience.",
    "Glaciers carve valleys over thousands of years.",
    "Distributed databases trade consistency for availability.",
    "Migratory birds navigate using the earth's magnetic field.",
    "Jazz musicians improvise over chord progressions.",
    "Solar panels convert sunlight into electricity.",
]


def output_of(pipeline) -> OutputSpec:
    return OutputSpec(**pipeline.spec["output"])


# --------------------------------------------------------------------------- embeddings


@pytest.fixture(scope="module")
def embed_run(tmp_path_factory, minilm_dir):
    root = tmp_path_factory.mktemp("embed")
    keys = ["p0", "p1", "p2"]
    for n, key in enumerate(keys):
        ids = [f"{key}-{i}" for i in range(40)]
        texts = [f"{SENTENCES[(i + n) % len(SENTENCES)]} (note {i})" for i in range(40)]
        write_parquet(root / "in" / f"{key}.parquet", {"doc_id": ids, "text": texts})
    pipeline = inference_assets(
        name="emb",
        model=minilm_dir,
        task="embed",
        input=InputSpec(uri=str(root / "in" / "{partition_key}.parquet"), id_column="doc_id"),
        output_root=str(root / "out"),
        partitions_def=dg.StaticPartitionsDefinition(keys),
        engine={"dtype": "float32"},
        chunk_size=16,
    )
    load_log = root / "loads.log"
    with dg.instance_for_test() as instance:
        result = materialize_partitions(
            pipeline, keys, resource=cpu_resource(load_log), instance=instance
        )
        loads_after_first = model_loads(load_log)
        rerun = materialize_partitions(
            pipeline, keys, resource=cpu_resource(load_log), instance=instance
        )
        yield {
            "root": root,
            "keys": keys,
            "pipeline": pipeline,
            "result": result,
            "rerun": rerun,
            "instance": instance,
            "loads_after_first": loads_after_first,
            "loads_after_rerun": model_loads(load_log),
        }


def test_one_run_materializes_every_partition_with_one_model_load(embed_run):
    assert embed_run["result"].success
    instance = embed_run["instance"]
    key = embed_run["pipeline"].output_asset.key
    assert instance.get_materialized_partitions(key) == set(embed_run["keys"])
    assert embed_run["loads_after_first"] == 1


def test_embedding_outputs_are_fixed_size_float32_keyed_by_input_id(embed_run):
    table = read_partition(output_of(embed_run["pipeline"]), "p1")
    assert table.num_rows == 40
    field_type = table.schema.field("embedding").type
    assert pa.types.is_fixed_size_list(field_type) and field_type.list_size == 384
    assert field_type.value_type == pa.float32()
    assert sorted(table.column("id").to_pylist()) == sorted(f"p1-{i}" for i in range(40))


def test_embeddings_match_transformers_mean_pooling_reference(embed_run, minilm_dir):
    import torch
    from transformers import AutoModel, AutoTokenizer

    table = read_partition(output_of(embed_run["pipeline"]), "p0")
    by_id = dict(
        zip(table.column("id").to_pylist(), table.column("embedding").to_pylist(), strict=True)
    )
    source = pq.read_table(embed_run["root"] / "in" / "p0.parquet")
    ids, texts = source.column("doc_id").to_pylist(), source.column("text").to_pylist()
    tokenizer = AutoTokenizer.from_pretrained(minilm_dir)
    model = AutoModel.from_pretrained(minilm_dir).eval()
    with torch.no_grad():
        batch = tokenizer(texts, padding=True, truncation=True, return_tensors="pt")
        hidden = model(**batch).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).float()
        pooled = (hidden * mask).sum(1) / mask.sum(1)
        reference = torch.nn.functional.normalize(pooled, dim=1).numpy()
    ours = np.asarray([by_id[i] for i in ids], dtype=np.float32)
    cosine = (ours * reference).sum(1) / (
        np.linalg.norm(ours, axis=1) * np.linalg.norm(reference, axis=1)
    )
    assert cosine.min() > 0.999, f"lowest cosine {cosine.min():.5f} at row {cosine.argmin()}"


def test_partition_metadata_reports_rows_tokens_speed_and_load(embed_run):
    md = partition_metadata(embed_run["instance"], embed_run["pipeline"].output_asset.key, "p2")
    assert (md["rows_in"], md["rows_out"], md["rows_errored"]) == (40, 40, 0)
    assert md["prompt_tokens"] > 40 and md["generated_tokens"] == 0
    assert md["rows_per_second"] > 0 and md["tokens_per_second"] > 0
    assert md["model_load_seconds"] > 0 and md["wall_seconds"] > 0
    assert md["engine_args"]["dtype"] == "float32"
    assert md["output_path"].endswith("/emb/p2")
    # Chunk intervals counted once, within the partition's wall time.
    assert 0 < md["inference_seconds"] <= md["active_seconds"] <= md["wall_seconds"]
    # Rates over its share of the (one) engine's time, spent while the partition ran.
    assert 0 < md["engine_seconds"] <= md["wall_seconds"]
    assert md["rows_per_second"] == pytest.approx(40 / md["engine_seconds"], rel=0.01)
    # What a figure means is in the asset's description, once; embed takes no sampling.
    assert "rates_over" not in md and "sampling_params" not in md
    description = embed_run["pipeline"].output_asset.descriptions_by_key[
        embed_run["pipeline"].output_asset.key
    ]
    assert "share of its engine's time" in description
    # The partition's own figures come first, the run's (`run_*`) after them all.
    names = list(md)
    first_run = min(i for i, name in enumerate(names) if name.startswith("run_"))
    assert names[0] == "rows_in" and "rows_per_second" in names[:first_run]
    assert all(
        name.startswith("run_") or name in ("model", "tensor_parallel_size")
        for name in names[first_run:]
    )
    # Pooling: saturation counts the requests queued for the next step; KV cache is n/a.
    assert md["kv_cache_usage_p95"] == "n/a"


def test_row_count_checks_pass_on_every_partition(embed_run):
    evaluations = embed_run["result"].get_asset_check_evaluations()
    assert {e.check_name: e.passed for e in evaluations} == {
        "rows_balanced": True,
        "error_rate": True,
    }
    balanced = next(e for e in evaluations if e.check_name == "rows_balanced")
    assert balanced.metadata["partitions_checked"].value == 3


def test_run_metadata_splits_the_worker_time(embed_run):
    result = embed_run["result"]
    materialization = next(
        e.event_specific_data.materialization
        for e in result.all_events
        if e.event_type_value == "ASSET_MATERIALIZATION"
        and "run_model_loads" in e.event_specific_data.materialization.metadata
    )
    md = {k: v.value for k, v in materialization.metadata.items()}
    for name in (
        "run_start_seconds",
        "run_load_seconds",
        "run_inference_seconds",
        "run_shutdown_seconds",
    ):
        assert md[name] > 0, name
    # The parts are parts of the worker's own wall time.
    parts = md["run_load_seconds"] + md["run_inference_seconds"] + md["run_shutdown_seconds"]
    assert parts <= md["run_wall_seconds"]
    # The run's own rate: every row it computed over its inference span.
    rows = sum(
        e.event_specific_data.materialization.metadata["rows_in"].value
        for e in result.all_events
        if e.event_type_value == "ASSET_MATERIALIZATION"
        and "run_model_loads" in e.event_specific_data.materialization.metadata
    )
    assert md["run_rows_per_second"] == round(rows / md["run_inference_seconds"], 2)


def test_rerun_reuses_committed_partitions_without_loading_the_model(embed_run):
    assert embed_run["rerun"].success
    assert embed_run["loads_after_rerun"] == embed_run["loads_after_first"]
    md = partition_metadata(embed_run["instance"], embed_run["pipeline"].output_asset.key, "p0")
    assert md["computed_in_this_run"] is False and md["rows_out"] == 40


# --------------------------------------------------------------------------- generation


PROMPTS = [
    f"Tell me about {topic}." for topic in ("rivers", "compilers", "bread", "glaciers", "jazz")
]


@pytest.fixture(scope="module")
def generate_runs(tmp_path_factory, tiny_llama_dir):
    root = tmp_path_factory.mktemp("generate")
    for key in ("g0", "g1"):
        # The same prompt under two ids must get the same greedy answer.
        records = [{"id": f"{key}-{i}", "prompt": PROMPTS[i % len(PROMPTS)]} for i in range(12)]
        write_jsonl(root / "in" / f"{key}.jsonl", records)
    write_jsonl(
        root / "in" / "bad.jsonl",
        [
            {"id": "ok-1", "prompt": "A fine prompt."},
            b"{this is not json",
            b'{"id": "utf", "prompt": "\xff\xfe"}',
            {"id": "empty", "prompt": ""},
            {"id": "null", "prompt": None},
            {"id": "long", "prompt": "word " * 400},
            {"id": "ok-1", "prompt": "duplicate id"},
            {"id": "ok-2", "prompt": "Another fine prompt."},
        ],
    )
    # A wider shard, for two replicas to share: the same prompts under other ids.
    records = [{"id": f"w-{i}", "prompt": PROMPTS[i % len(PROMPTS)]} for i in range(120)]
    write_jsonl(root / "in" / "w.jsonl", records)
    partitions = dg.StaticPartitionsDefinition(["bad", "g0", "g1", "w"])

    def pipeline(out: str, replicas: int, chunk_size: int = 5, **kwargs):
        return inference_assets(
            name="gen",
            model=tiny_llama_dir,
            task="generate",
            input=InputSpec(uri=str(root / "in" / "{partition_key}.jsonl"), text_column="prompt"),
            output_root=str(root / out),
            partitions_def=partitions,
            engine={"max_model_len": 256, "seed": 0},
            sampling={"temperature": 0.0, "max_tokens": 16},
            replicas=replicas,
            chunk_size=chunk_size,
            **kwargs,
        )

    # Two replicas with small chunks and a small window, so that both engines hold few rows
    # and must share the chunks of the one wide shard. Row reuse off: the wide shard repeats
    # g0's prompts, and the engines (not copies of g0's rows) must compute it.
    one = pipeline("out1", 1)
    two = pipeline("out2", 2, chunk_size=4, max_requests_in_flight=4, row_reuse="off")
    logs = {name: root / f"{name}.log" for name in ("one", "two", "changed")}
    with dg.instance_for_test() as instance:
        result_one = materialize_partitions(
            one, ["bad", "g0", "g1"], resource=cpu_resource(logs["one"]), instance=instance
        )
        result_two = materialize_partitions(
            two, ["g0", "w"], resource=cpu_resource(logs["two"]), instance=instance
        )
        parts_before = sorted(os.listdir(partition_dir(output_of(one), "g0")))
        texts_before_change = {key: texts_by_id(one, key) for key in ("g0", "g1")}
        changed = materialize_partitions(
            one,
            ["g0", "g0"],
            resource=cpu_resource(logs["changed"]),
            instance=instance,
            run_config={"ops": {"gen": {"config": {"max_tokens": 4}}}},
        )
        yield {
            "root": root,
            "one": one,
            "two": two,
            "instance": instance,
            "result_one": result_one,
            "result_two": result_two,
            "changed": changed,
            "loads": {k: model_loads(v) for k, v in logs.items()},
            "parts_before": parts_before,
            "texts_one": texts_before_change,
        }


def texts_by_id(pipeline, key):
    table = read_partition(output_of(pipeline), key)
    return dict(zip(table.column("id").to_pylist(), table.column("text").to_pylist(), strict=True))


def test_greedy_generation_is_identical_across_runs_replicas_and_chunk_sizes(generate_runs):
    assert generate_runs["result_one"].success and generate_runs["result_two"].success
    # g0 and g1 in run one: one engine, chunks of 5; g0 in run two: two engines, chunks of 4,
    # 4 requests in flight. Streaming does not change what a row gets.
    one = generate_runs["texts_one"]["g0"]
    two = texts_by_id(generate_runs["two"], "g0")
    assert len(one) == 12 and one == two
    assert all(text for text in one.values())
    g0 = generate_runs["texts_one"]["g0"]
    assert g0["g0-0"] == g0["g0-5"]  # same prompt, same answer
    assert len(generate_runs["texts_one"]["g1"]) == 12


def test_streamed_chunks_commit_one_part_per_chunk_in_input_order(generate_runs):
    output = output_of(generate_runs["two"])
    fs, path = filesystem_for(partition_dir(output, "w"))
    manifest = read_manifest(fs, path)
    # 120 rows in chunks of 4: 30 parts, one per chunk, each holding its chunk's rows in
    # input order, whichever engine wrote it and whenever its slowest row finished.
    assert [p.name.split("-")[2] for p in manifest.parts] == [f"{i:05d}" for i in range(30)]
    table = read_partition(output, "w")
    assert table.column("id").to_pylist() == [f"w-{i}" for i in range(120)]


def test_two_replicas_share_one_shard_chunk_by_chunk_exactly_once(generate_runs):
    assert generate_runs["loads"]["one"] == 1
    assert generate_runs["loads"]["two"] == 2
    output = output_of(generate_runs["two"])
    fs, path = filesystem_for(partition_dir(output, "w"))
    manifest = read_manifest(fs, path)
    assert manifest.worker["replicas"] == [0, 1], "both engines must serve the wide shard"
    assert (manifest.rows_in, manifest.rows_out, manifest.rows_errored) == (120, 120, 0)
    table = read_partition(output, "w")
    ids = table.column("id").to_pylist()
    assert len(ids) == len(set(ids)) == 120
    # Same prompt, same greedy answer as the single engine gave in run one.
    by_prompt = {
        PROMPTS[i % len(PROMPTS)]: text
        for i, text in enumerate(generate_runs["texts_one"]["g0"][f"g0-{i}"] for i in range(12))
    }
    texts = dict(zip(ids, table.column("text").to_pylist(), strict=True))
    assert all(texts[f"w-{i}"] == by_prompt[PROMPTS[i % len(PROMPTS)]] for i in range(120))
    md = partition_metadata(generate_runs["instance"], generate_runs["two"].output_asset.key, "w")
    assert md["computed_in_this_run"] is True
    # The replicas wrote the chunks: their write time reached the parent in the markers
    # (it read 0 when it was counted in the process that committed the partition).
    assert md["commit_seconds"] > 0
    assert 0 < md["inference_seconds"] <= md["wall_seconds"]


def test_bad_rows_are_quarantined_and_the_shard_still_commits(generate_runs):
    output = output_of(generate_runs["one"])
    assert sorted(texts_by_id(generate_runs["one"], "bad")) == ["ok-1", "ok-2"]
    errors = read_errors(output, "bad").to_pylist()
    by_type = {}
    for error in errors:
        by_type.setdefault(error["error_type"], []).append(error)
    assert sorted(by_type) == [
        "duplicate_id",
        "empty_input",
        "invalid_json",
        "invalid_utf8",
        "prompt_too_long",
    ]
    assert len(by_type["empty_input"]) == 2
    assert by_type["prompt_too_long"][0]["id"] == "long"
    assert by_type["prompt_too_long"][0]["prompt_tokens"] > 256
    assert by_type["duplicate_id"][0]["row"] == 6
    md = partition_metadata(generate_runs["instance"], generate_runs["one"].output_asset.key, "bad")
    assert (md["rows_in"], md["rows_out"], md["rows_errored"]) == (8, 2, 6)


def test_error_rate_check_fails_with_the_top_error_types(generate_runs):
    checks = {e.check_name: e for e in generate_runs["result_one"].get_asset_check_evaluations()}
    assert checks["rows_balanced"].passed
    assert not checks["error_rate"].passed
    assert checks["error_rate"].metadata["partitions_over_threshold"].value == {"bad": 0.75}
    assert "empty_input" in checks["error_rate"].metadata["top_error_types"].value


def test_generation_metadata_counts_generated_tokens(generate_runs):
    md = partition_metadata(generate_runs["instance"], generate_runs["two"].output_asset.key, "g0")
    assert md["generated_tokens"] > 0 and md["generated_tokens"] <= 12 * 16
    assert md["tokens_per_second"] > 0
    # g0's latest materialization is the changed run's: its run config set max_tokens=4,
    # and the metadata shows the parameters that run used, unset ones (seed) left out.
    assert md["sampling_params"]["max_tokens"] == 4 and "seed" not in md["sampling_params"]


def test_changed_sampling_recomputes_and_replaces_the_old_outputs(generate_runs):
    assert generate_runs["changed"].success
    assert generate_runs["loads"]["changed"] == 1
    output = output_of(generate_runs["one"])
    fs, path = filesystem_for(partition_dir(output, "g0"))
    manifest = read_manifest(fs, path)
    table = read_partition(output, "g0")
    assert max(table.column("generated_tokens").to_pylist()) <= 4
    after = sorted(os.listdir(path))
    old_parts = [p for p in generate_runs["parts_before"] if p.startswith("part-")]
    assert old_parts and not set(old_parts) & set(after)
    assert all(p.startswith(f"part-{manifest.spec_hash}") for p in after if p.startswith("part-"))


# --------------------------------------------------------------------------- chat, OpenAI batch


@pytest.fixture(scope="module")
def chat_batch_run(tmp_path_factory, tiny_llama_dir):
    root = tmp_path_factory.mktemp("chat")

    def request(custom_id, messages, url="/v1/chat/completions"):
        return {
            "custom_id": custom_id,
            "method": "POST",
            "url": url,
            "body": {"model": "tiny", "messages": messages},
        }

    write_jsonl(
        root / "in" / "batch-1.jsonl",
        [
            request(
                "req-1",
                [
                    {"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "Name a river."},
                ],
            ),
            request("req-2", [{"role": "user", "content": "Name a mountain."}]),
            request("req-3", [{"role": "robot", "content": "beep"}]),
            request("req-4", "not a list"),
            request("req-5", [{"role": "user", "content": "x"}], url="/v1/embeddings"),
        ],
    )
    pipeline = inference_assets(
        name="chat",
        model=tiny_llama_dir,
        task="chat",
        input=InputSpec(uri=str(root / "in" / "{partition_key}.jsonl"), format="openai_batch"),
        output_root=str(root / "out"),
        output_format="openai_batch",
        partitions_def=dg.StaticPartitionsDefinition(["batch-1"]),
        engine={"max_model_len": 256},
        sampling={"max_tokens": 8},
        max_error_rate=1.0,
    )
    with dg.instance_for_test() as instance:
        result = materialize_partitions(
            pipeline, ["batch-1"], resource=cpu_resource(), instance=instance
        )
        yield {"root": root, "pipeline": pipeline, "result": result}


@pytest.mark.slow  # OpenAI chat lines in make test: test_requests_engine's chat_run
def test_chat_batch_answers_in_openai_batch_output_format(chat_batch_run):
    assert chat_batch_run["result"].success
    out_dir = Path(partition_dir(output_of(chat_batch_run["pipeline"]), "batch-1"))
    parts = sorted(out_dir.glob("part-*.jsonl"))
    lines = [json.loads(line) for part in parts for line in part.read_text().splitlines()]
    assert [line["custom_id"] for line in lines] == ["req-1", "req-2"]
    for line in lines:
        assert line["id"].startswith("batch_req_") and line["error"] is None
        body = line["response"]["body"]
        assert line["response"]["status_code"] == 200
        assert body["object"] == "chat.completion"
        assert body["choices"][0]["message"]["role"] == "assistant"
        assert body["choices"][0]["message"]["content"]
        assert 0 < body["usage"]["completion_tokens"] <= 8
    assert (out_dir / MANIFEST_NAME).exists()


@pytest.mark.slow  # OpenAI chat lines in make test: test_requests_engine's chat_run
def test_invalid_chats_and_wrong_endpoints_are_quarantined(chat_batch_run):
    errors = read_errors(output_of(chat_batch_run["pipeline"]), "batch-1").to_pylist()
    assert {(e["id"], e["error_type"]) for e in errors} == {
        ("req-3", "invalid_messages"),
        ("req-4", "invalid_messages"),
        ("req-5", "unsupported_url"),
    }
