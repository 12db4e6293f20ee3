"""Row reuse across OpenAI batches, end to end through the batch API's pipelines
(`batch_pipelines` from a routing table), Dagster and vLLM's CPU engine (tiny Llama).

A route whose pipeline says `row_reuse_scope: pipeline` runs batch b1, then batch b2 whose
lines repeat three of b1's greedy requests (under other custom_ids), repeat b1's one
unseeded sampling request, and add two new requests, one of them twice. b2 computes only
the new requests and the sampled one (unseeded sampling is never copied), copies the three
repeated ones, computes the twin once; its partition metadata says so. Its output file, as
the service serves it (`FileBytes.batch_results`), is OpenAI Batch lines only and answers
the deterministic lines exactly as a second route computing b2 in full does.
"""

from __future__ import annotations

import json

import dagster as dg
import pytest
from support import cpu_resource, materialize_partitions, partition_metadata

from dagster_gpuinfer.batch_api.files import FileBytes
from dagster_gpuinfer.batch_api.pipelines import batch_pipelines

pytestmark = pytest.mark.engine

OPENAI_KEYS = {"id", "custom_id", "response", "error"}
KV_CACHE_BYTES = 64 << 20


def _line(custom_id: str, model: str, content: str, **body) -> dict:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": model,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": 6,
            **body,
        },
    }


def _batch(model: str, which: str) -> list[dict]:
    sampled = {"temperature": 1.0}  # unseeded: drawn anew every time
    if which == "b1":
        lines = [_line(f"a{i}", model, f"Describe river number {i}.") for i in range(4)]
        return [*lines, _line("s0", model, "Say one word.", **sampled)]
    return [
        _line("x0", model, "Describe river number 0."),
        _line("x1", model, "Describe river number 1."),
        _line("x2", model, "Describe river number 2."),
        _line("s1", model, "Say one word.", **sampled),
        _line("n0", model, "Describe a mountain."),
        _line("n1", model, "Describe a quiet lake."),
        _line("n2", model, "Describe a mountain."),  # n0's request again
    ]


def _route(model: str, pipeline: str, path: str, scope: str) -> dict:
    return {
        "model": model,
        "endpoint": "/v1/chat/completions",
        "pipeline": pipeline,
        "model_path": path,
        "engine": {"max_model_len": 256, "extra": {"kv_cache_memory_bytes": KV_CACHE_BYTES}},
        "sampling": {"temperature": 0.0},
        "chunk_size": 4,
        "row_reuse_scope": scope,
    }


@pytest.fixture(scope="module")
def batch_runs(tmp_path_factory, tiny_llama_dir):
    root = tmp_path_factory.mktemp("batch-reuse")
    files = FileBytes(str(root / "files"))
    routes = [
        _route("tiny", "batch_reuse", tiny_llama_dir, "pipeline"),
        _route("tiny-full", "batch_full", tiny_llama_dir, "partition"),
    ]
    pipelines = batch_pipelines(routes, files_root=files.root).pipelines
    runs: dict[str, dict] = {}
    with dg.instance_for_test() as instance:
        for pipeline, model, batch in (
            ("batch_reuse", "tiny", "b1"),
            ("batch_reuse", "tiny", "b2"),
            ("batch_full", "tiny-full", "b2"),
        ):
            batch_id = f"{pipeline}-{batch}"
            lines = _batch(model, batch)
            uri = files.input_template.replace("{partition_key}", batch_id)
            files.write(uri, "".join(json.dumps(line) + "\n" for line in lines).encode())
            instance.add_dynamic_partitions(f"{pipeline}_batches", [batch_id])
            assets = pipelines[pipeline]
            result = materialize_partitions(
                assets, [batch_id], resource=cpu_resource(), instance=instance
            )
            assert result.success
            results = files.batch_results(pipeline, batch_id)
            runs[f"{pipeline}/{batch}"] = {
                "metadata": partition_metadata(instance, assets.output_asset.key, batch_id),
                "files": results,
                "lines": [json.loads(x) for x in results.output.splitlines()],
            }
    return runs


def _counts(run: dict) -> tuple[int, int, int, int]:
    meta = run["metadata"]
    return meta["rows_out"], meta["rows_computed"], meta["rows_reused"], meta["rows_deduplicated"]


def _texts(run: dict) -> dict[str, str]:
    return {
        line["custom_id"]: line["response"]["body"]["choices"][0]["message"]["content"]
        for line in run["lines"]
    }


def test_a_second_batch_computes_only_the_requests_no_batch_answered(batch_runs):
    assert _counts(batch_runs["batch_reuse/b1"]) == (5, 5, 0, 0)
    # x0..x2 copied from b1; s1 (unseeded) and n0, n1 computed; n2 is n0's twin.
    assert _counts(batch_runs["batch_reuse/b2"]) == (7, 3, 3, 1)
    assert _counts(batch_runs["batch_full/b2"]) == (7, 6, 0, 1)


def test_the_reused_batchs_output_is_openai_lines_equal_to_a_full_recompute(batch_runs):
    reused, full = batch_runs["batch_reuse/b2"], batch_runs["batch_full/b2"]
    assert reused["files"].committed and reused["files"].errors == b""
    assert all(set(line) == OPENAI_KEYS for line in reused["lines"])
    assert b"reuse_key" not in reused["files"].output
    ids = ["x0", "x1", "x2", "s1", "n0", "n1", "n2"]
    assert [line["custom_id"] for line in reused["lines"]] == ids
    assert {line["response"]["body"]["model"] for line in reused["lines"]} == {"tiny"}
    texts, expected = _texts(reused), _texts(full)
    deterministic = [i for i in ids if i != "s1"]
    assert [texts[i] for i in deterministic] == [expected[i] for i in deterministic]
    assert texts["n0"] == texts["n2"]
    first = _texts(batch_runs["batch_reuse/b1"])
    assert [texts[f"x{i}"] for i in range(3)] == [first[f"a{i}"] for i in range(3)]
    assert len({line["id"] for line in reused["lines"]}) == len(ids)  # each its own id
