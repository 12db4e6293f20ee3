"""Every request as its sender wrote it, end to end through Dagster with the real vLLM engine:
per-request parameters, structured outputs, OpenAI Batch fidelity, score and classify.

Each module fixture is one real Dagster run (one worker, one engine start); the tests read
what it left: committed files, the manifest, the asset check results.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import dagster as dg
import numpy as np
import pytest
from pydantic import BaseModel, Field
from support import cpu_resource, materialize_partitions, write_jsonl, write_parquet

from dagster_gpuinfer import InputSpec, OutputSpec, SamplingParams, inference_assets, read_partition
from dagster_gpuinfer.storage import filesystem_for, partition_dir, read_manifest
from dagster_gpuinfer.worker.tasks.openai_batch import (
    BatchOutputLine,
    ChatCompletion,
    EmbeddingList,
)

pytestmark = pytest.mark.engine

REPO_ROOT = Path(__file__).resolve().parent.parent

# Whitespace inside JSON is an engine setting in vLLM (the per-request flag is ignored).
COMPACT_JSON = {
    "structured_outputs_config": {"backend": "xgrammar", "disable_any_whitespace": True}
}

TOPIC_SCHEMA = {
    "type": "object",
    "properties": {
        # A pattern, not maxLength: xgrammar 0.2.8 lets raw control characters into
        # maxLength strings (invalid JSON, which the output check flags).
        "topic": {"type": "string", "pattern": "^[a-z ]{0,12}$"},
        "score": {"type": "integer", "minimum": 0, "maximum": 10},
    },
    "required": ["topic", "score"],
    "additionalProperties": False,
}


@pytest.fixture(scope="session")
def structured_llama_dir() -> str:
    from assets.models import make_tiny_llama_bpe
    from assets.paths import structured_model_dir

    return make_tiny_llama_bpe(structured_model_dir())


def committed_lines(root: Path, asset: str, key: str) -> tuple[list[dict], list[dict], dict]:
    """Output lines, errors.jsonl lines and the manifest of one openai_batch partition."""
    output = OutputSpec(root=str(root / "out"), asset_name=asset, format="openai_batch")
    fs, path = filesystem_for(partition_dir(output, key))
    manifest = read_manifest(fs, path)
    assert manifest is not None
    lines = []
    for part in manifest.parts:
        lines += [json.loads(x) for x in Path(path, part.name).read_text().splitlines() if x]
    assert manifest.openai_errors is not None
    errors = [
        json.loads(x) for x in Path(path, manifest.openai_errors.name).read_text().splitlines() if x
    ]
    return lines, errors, manifest


def check_results(result: dg.ExecuteInProcessResult) -> dict[str, dg.AssetCheckEvaluation]:
    return {e.check_name: e for e in result.get_asset_check_evaluations()}


# --------------------------------------------------------------------------- chat lines

MESSAGES = [{"role": "user", "content": "Describe a river in a few words."}]


def chat_line(custom_id: str, **body) -> dict:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "tiny", "messages": MESSAGES, **body},
    }


CHAT_LINES = [
    chat_line("short", max_tokens=2, ignore_eos=True),
    chat_line("long", max_tokens=12, ignore_eos=True),
    chat_line("default", ignore_eos=True),
    chat_line("hot-1", temperature=1.0, seed=11, max_tokens=10, ignore_eos=True),
    chat_line("hot-2", temperature=1.0, seed=22, max_tokens=10, ignore_eos=True),
    chat_line("three", n=3, temperature=1.0, seed=5, max_tokens=4, ignore_eos=True),
    chat_line("logprobs", logprobs=True, top_logprobs=3, max_tokens=4, ignore_eos=True),
    chat_line(
        "schema",
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "topic", "schema": TOPIC_SCHEMA},
        },
        max_tokens=100,
    ),
    chat_line("cut-json", response_format={"type": "json_object"}, max_tokens=3),
    chat_line("legacy", guided_json=TOPIC_SCHEMA),
    chat_line("tools", tools=[{"type": "function", "function": {"name": "f"}}]),
    chat_line("cold", temperature=-0.5),
    chat_line("too-many-logprobs", logprobs=True, top_logprobs=50),
    b"{not json",
]


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory, structured_llama_dir):
    root = tmp_path_factory.mktemp("chat_lines")
    write_jsonl(root / "in" / "b0.jsonl", CHAT_LINES)
    pipeline = inference_assets(
        name="chat_lines",
        model=structured_llama_dir,
        task="chat",
        input=InputSpec(uri=str(root / "in" / "{partition_key}.jsonl"), format="openai_batch"),
        output_root=str(root / "out"),
        output_format="openai_batch",
        partitions_def=dg.StaticPartitionsDefinition(["b0"]),
        engine={"max_model_len": 256, "extra": COMPACT_JSON},
        sampling={"max_tokens": 6},
        chunk_size=5,
        max_error_rate=0.5,
    )
    with dg.instance_for_test() as instance:
        result = materialize_partitions(
            pipeline, ["b0"], resource=cpu_resource(), instance=instance
        )
        lines, errors, manifest = committed_lines(root, "chat_lines", "b0")
        yield {
            "result": result,
            "lines": {line["custom_id"]: line for line in lines},
            "errors": errors,
            "manifest": manifest,
            "model": structured_llama_dir,
        }


def choices(line: dict) -> list[dict]:
    return line["response"]["body"]["choices"]


def test_per_line_max_tokens_bounds_each_rows_generated_tokens(chat_run):
    usage = {
        cid: line["response"]["body"]["usage"]["completion_tokens"]
        for cid, line in chat_run["lines"].items()
    }
    # ignore_eos makes every row run to its own bound: the line's, else the pipeline's 6.
    assert usage["short"] == 2
    assert usage["long"] == 12
    assert usage["default"] == 6


def test_every_custom_id_is_answered_exactly_once_by_output_or_errors_jsonl(chat_run):
    answered = [*chat_run["lines"], *(e["custom_id"] for e in chat_run["errors"])]
    expected = [line["custom_id"] for line in CHAT_LINES if isinstance(line, dict)]
    assert sorted(a for a in answered if a is not None) == sorted(expected)
    assert len(answered) == len(CHAT_LINES)  # the unparseable line answered with custom_id null
    for raw in chat_run["errors"]:
        line = BatchOutputLine.model_validate(raw)
        assert line.response is None and line.error is not None
    for raw in chat_run["lines"].values():
        line = BatchOutputLine.model_validate(raw)
        # An output line answers; its error is set only when the output fails its check.
        assert line.response is not None
        assert (line.error is None) or line.error.code == "invalid_output"
    for line in chat_run["lines"].values():
        ChatCompletion.model_validate(line["response"]["body"])
    manifest = chat_run["manifest"]
    assert manifest.rows_in == len(CHAT_LINES)
    assert manifest.rows_out + manifest.rows_errored == manifest.rows_in
    assert check_results(chat_run["result"])["rows_balanced"].passed


def test_unsupported_and_rejected_parameters_quarantine_exactly_their_rows(chat_run):
    errors = {e["custom_id"]: e["error"] for e in chat_run["errors"]}
    assert errors["legacy"]["code"] == "unsupported_parameter"
    assert "'guided_json'" in errors["legacy"]["message"]
    assert errors["tools"]["code"] == "unsupported_parameter"
    assert "'tools'" in errors["tools"]["message"]
    assert errors["cold"]["code"] == "invalid_parameter"
    assert "'temperature'" in errors["cold"]["message"]
    assert errors["too-many-logprobs"]["code"] == "invalid_parameter"
    assert "'logprobs'" in errors["too-many-logprobs"]["message"]
    assert errors[None]["code"] == "invalid_json"
    assert set(errors) == {"legacy", "tools", "cold", "too-many-logprobs", None}


def test_n_gives_n_choices_and_logprobs_come_in_openais_shape(chat_run):
    three = choices(chat_run["lines"]["three"])
    assert [c["index"] for c in three] == [0, 1, 2]
    assert all(c["finish_reason"] == "length" for c in three)
    assert chat_run["lines"]["three"]["response"]["body"]["usage"]["completion_tokens"] == 12
    (choice,) = choices(chat_run["lines"]["logprobs"])
    content = choice["logprobs"]["content"]
    assert len(content) == 4
    for token in content:
        assert token["logprob"] <= 0 and bytes(token["bytes"]) == token["token"].encode()
        assert len(token["top_logprobs"]) == 3
        assert token["top_logprobs"][0]["logprob"] >= token["logprob"]
    assert "".join(t["token"] for t in content) == choice["message"]["content"]
    assert "logprobs" not in choices(chat_run["lines"]["short"])[0]


def test_structured_outputs_per_request_validate_or_are_flagged(chat_run):
    text = choices(chat_run["lines"]["schema"])[0]["message"]["content"]
    value = json.loads(text)
    assert set(value) == {"topic", "score"} and 0 <= value["score"] <= 10
    # json_object cut at 3 tokens cannot be a whole object: flagged, counted, checked.
    assert chat_run["manifest"].rows_invalid_output == 1
    # ... and visible on its own output line, beside the response.
    flagged = [cid for cid, line in chat_run["lines"].items() if line["error"] is not None]
    assert len(flagged) == 1
    assert chat_run["lines"][flagged[0]]["error"]["code"] == "invalid_output"
    check = check_results(chat_run["result"])["valid_structured_output"]
    assert not check.passed
    assert check.metadata["rows_invalid_output"].value == 1


def test_per_line_temperature_and_seed_match_raw_vllm(chat_run, tmp_path):
    """The same prompts and parameters through raw vLLM give the same texts."""
    script = textwrap.dedent(
        f"""
        import json, sys
        if __name__ == "__main__":
            from vllm import LLM, SamplingParams
            from dagster_gpuinfer.worker.loop.cpu_dtype import resolve_cpu_dtype
            model = {chat_run["model"]!r}
            kwargs = dict(max_model_len=256, gpu_memory_utilization=0.2, enforce_eager=True,
                          seed=0)
            llm = LLM(model=model, **resolve_cpu_dtype(kwargs, model))  # the worker's dtype
            messages = {MESSAGES!r}
            prompt = llm.get_tokenizer().apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True)
            params = [SamplingParams(temperature=1.0, seed=s, max_tokens=10, ignore_eos=True)
                      for s in (11, 22)]
            out = llm.generate([prompt, prompt], params, use_tqdm=False)
            json.dump([o.outputs[0].text for o in out], open(sys.argv[1], "w"))
            llm.llm_engine.engine_core.shutdown()
        """
    )
    (tmp_path / "raw.py").write_text(script)
    done = subprocess.run(
        [sys.executable, str(tmp_path / "raw.py"), str(tmp_path / "raw.json")],
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    raw = json.loads((tmp_path / "raw.json").read_text())
    ours = [choices(chat_run["lines"][cid])[0]["message"]["content"] for cid in ("hot-1", "hot-2")]
    assert ours == raw
    assert ours[0] != ours[1]


# --------------------------------------------------------------------------- structured


class Topic(BaseModel):
    topic: str = Field(pattern=r"^[a-z ]{0,12}$")
    score: int = Field(ge=0, le=10)


@pytest.fixture(scope="module")
def extraction_run(tmp_path_factory, structured_llama_dir):
    root = tmp_path_factory.mktemp("extract")
    texts = [f"Note {i}: the river rose {i} cm after rain." for i in range(12)]
    params = [None] * 12
    params[3] = json.dumps({"max_tokens": 90, "temperature": 0.9, "seed": 3})
    params[5] = json.dumps({"stream": True})  # streaming is not a batch thing: quarantined
    write_parquet(
        root / "in" / "n0.parquet",
        {"id": [f"n{i}" for i in range(12)], "text": texts, "params": params},
    )
    pipeline = inference_assets(
        name="extract",
        model=structured_llama_dir,
        task="generate",
        input=InputSpec(uri=str(root / "in" / "{partition_key}.parquet"), params_column="params"),
        output_root=str(root / "out"),
        partitions_def=dg.StaticPartitionsDefinition(["n0"]),
        engine={"max_model_len": 256, "extra": COMPACT_JSON},
        sampling=SamplingParams(max_tokens=100, structured_outputs={"json": Topic}),
        chunk_size=8,
    )
    with dg.instance_for_test() as instance:
        result = materialize_partitions(
            pipeline, ["n0"], resource=cpu_resource(), instance=instance
        )
        output = OutputSpec(root=str(root / "out"), asset_name="extract")
        yield {"result": result, "table": read_partition(output, "n0"), "output": output}


@pytest.mark.slow  # a pipeline-wide schema; per-request ones: chat_run (make test)
def test_every_output_of_a_json_schema_pipeline_parses_and_validates(extraction_run):
    table = extraction_run["table"]
    assert table.num_rows == 11  # row 5 asked for streaming: quarantined
    for text, flag in zip(
        table.column("text").to_pylist(), table.column("output_valid").to_pylist(), strict=True
    ):
        Topic.model_validate_json(text)
        assert flag is True
    check = check_results(extraction_run["result"])["valid_structured_output"]
    assert check.passed and check.metadata["rows_invalid_output"].value == 0


@pytest.mark.slow  # per-row params from a column; from lines: chat_run (make test)
def test_params_column_overrides_the_pipeline_defaults_for_its_row(extraction_run):
    table = extraction_run["table"].to_pylist()
    by_id = {row["id"]: row for row in table}
    assert "n5" not in by_id
    assert by_id["n3"]["generated_tokens"] <= 90
    assert by_id["n3"]["choices"][0]["output_valid"] is True


# --------------------------------------------------------------------------- embeddings


@pytest.fixture(scope="module")
def embedding_lines_run(tmp_path_factory, minilm_dir):
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("embed_lines")
    token_ids = AutoTokenizer.from_pretrained(minilm_dir)("Glaciers carve valleys.")["input_ids"]

    def line(custom_id, value, **body):
        return {
            "custom_id": custom_id,
            "method": "POST",
            "url": "/v1/embeddings",
            "body": {"model": "minilm", "input": value, **body},
        }

    write_jsonl(
        root / "in" / "e0.jsonl",
        [
            line("one", "Glaciers carve valleys."),
            line("many", ["Glaciers carve valleys.", "Jazz is improvised.", "Bread needs time."]),
            line("tokens", token_ids),
            line("token-lists", [token_ids, token_ids[:4]]),
            line("base64", "x", encoding_format="base64"),
            line("mixed", ["ok", 3]),
        ],
    )
    pipeline = inference_assets(
        name="embed_lines",
        model=minilm_dir,
        task="embed",
        input=InputSpec(uri=str(root / "in" / "{partition_key}.jsonl"), format="openai_batch"),
        output_root=str(root / "out"),
        output_format="openai_batch",
        partitions_def=dg.StaticPartitionsDefinition(["e0"]),
        engine={"dtype": "float32"},
        max_error_rate=0.5,
    )
    with dg.instance_for_test() as instance:
        result = materialize_partitions(
            pipeline, ["e0"], resource=cpu_resource(), instance=instance
        )
        lines, errors, _ = committed_lines(root, "embed_lines", "e0")
        yield {"result": result, "lines": {x["custom_id"]: x for x in lines}, "errors": errors}


def test_list_inputs_to_embeddings_give_one_vector_per_element(embedding_lines_run):
    bodies = {
        cid: EmbeddingList.model_validate(line["response"]["body"])
        for cid, line in embedding_lines_run["lines"].items()
    }
    assert [d.index for d in bodies["many"].data] == [0, 1, 2]
    assert len(bodies["token-lists"].data) == 2
    one = np.asarray(bodies["one"].data[0].embedding)
    assert np.allclose(np.asarray(bodies["many"].data[0].embedding), one, atol=1e-5)
    assert np.allclose(np.asarray(bodies["tokens"].data[0].embedding), one, atol=1e-5)
    assert np.allclose(np.asarray(bodies["token-lists"].data[0].embedding), one, atol=1e-5)
    assert not np.allclose(np.asarray(bodies["many"].data[1].embedding), one, atol=1e-2)
    assert bodies["many"].usage.prompt_tokens > bodies["one"].usage.prompt_tokens
    errors = {e["custom_id"]: e["error"]["code"] for e in embedding_lines_run["errors"]}
    assert errors == {"base64": "invalid_parameter", "mixed": "wrong_type"}


# --------------------------------------------------------------------------- score / classify

QUERIES = ["what carves valleys?", "how is bread made?", "who plays jazz?"]
DOCUMENTS = [
    "Glaciers carve valleys over thousands of years.",
    "Sourdough needs a starter.",
    "Jazz musicians improvise over chords.",
    "Solar panels make electricity.",
]
# vLLM's scores against transformers on the same weights: float32 on both sides, different
# kernels; seen here within 1e-5, held to 1e-3.
TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def cross_encoder_dir_fixture():
    from assets.models import make_minilm_classifier
    from assets.paths import cross_encoder_dir

    return make_minilm_classifier(cross_encoder_dir(), num_labels=1)


@pytest.fixture(scope="module")
def classifier_dir_fixture():
    from assets.models import make_minilm_classifier
    from assets.paths import classifier_dir

    return make_minilm_classifier(classifier_dir(), num_labels=3)


@pytest.fixture(scope="module")
def score_run(tmp_path_factory, cross_encoder_dir_fixture):
    root = tmp_path_factory.mktemp("score")
    pairs = [(q, d) for q in QUERIES for d in DOCUMENTS]
    write_parquet(
        root / "in" / "pairs.parquet",
        {
            "id": [f"pair-{i}" for i in range(len(pairs))],
            "query": [q for q, _ in pairs],
            "document": [d for _, d in pairs],
        },
    )
    write_jsonl(
        root / "in" / "lines.jsonl",
        [
            {
                "custom_id": "rr",
                "method": "POST",
                "url": "/v1/rerank",
                "body": {"model": "x", "query": QUERIES[0], "documents": DOCUMENTS, "top_n": 2},
            },
            {
                "custom_id": "sc",
                "method": "POST",
                "url": "/v1/score",
                "body": {"model": "x", "text_1": QUERIES[1], "text_2": DOCUMENTS[:2]},
            },
            {
                "custom_id": "bad",
                "method": "POST",
                "url": "/v1/score",
                "body": {"model": "x", "text_1": ["a", "b"], "text_2": ["c", "d", "e"]},
            },
        ],
    )
    columns = inference_assets(
        name="pair_scores",
        model=cross_encoder_dir_fixture,
        task="score",
        input=InputSpec(
            uri=str(root / "in" / "{partition_key}.parquet"),
            text_column="query",
            text_pair_column="document",
        ),
        output_root=str(root / "out"),
        partitions_def=dg.StaticPartitionsDefinition(["pairs"]),
        engine={"dtype": "float32"},
    )
    lines = inference_assets(
        name="rerank_lines",
        model=cross_encoder_dir_fixture,
        task="score",
        input=InputSpec(uri=str(root / "in" / "{partition_key}.jsonl"), format="openai_batch"),
        output_root=str(root / "out"),
        output_format="openai_batch",
        partitions_def=dg.StaticPartitionsDefinition(["lines"]),
        engine={"dtype": "float32"},
        max_error_rate=0.5,
    )
    with dg.instance_for_test() as instance:
        first = materialize_partitions(
            columns, ["pairs"], resource=cpu_resource(), instance=instance
        )
        second = materialize_partitions(
            lines, ["lines"], resource=cpu_resource(), instance=instance
        )
        out_lines, errors, _ = committed_lines(root, "rerank_lines", "lines")
        yield {
            "results": (first, second),
            "pairs": pairs,
            "table": read_partition(
                OutputSpec(root=str(root / "out"), asset_name="pair_scores"), "pairs"
            ),
            "lines": {x["custom_id"]: x for x in out_lines},
            "errors": errors,
        }


def transformers_scores(model_dir: str, firsts: list[str], seconds: list[str] | None) -> np.ndarray:
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    with torch.no_grad():
        batch = tokenizer(firsts, seconds, padding=True, return_tensors="pt")
        logits = model(**batch).logits
    if logits.shape[-1] == 1:
        return torch.sigmoid(logits[:, 0]).numpy()
    return torch.softmax(logits, dim=-1).numpy()


def test_scores_match_transformers_on_the_same_cross_encoder(score_run, cross_encoder_dir_fixture):
    assert all(r.success for r in score_run["results"])
    table = score_run["table"].to_pylist()
    by_id = {row["id"]: row["score"] for row in table}
    ours = np.asarray([by_id[f"pair-{i}"] for i in range(len(score_run["pairs"]))])
    queries, documents = zip(*score_run["pairs"], strict=True)
    reference = transformers_scores(cross_encoder_dir_fixture, list(queries), list(documents))
    assert np.abs(ours - reference).max() < TOLERANCE
    assert ours.std() > 0.01  # the seeded head separates pairs: the comparison means something


def test_rerank_and_score_lines_answer_in_vllms_shapes(score_run, cross_encoder_dir_fixture):
    rerank = score_run["lines"]["rr"]["response"]["body"]
    reference = transformers_scores(cross_encoder_dir_fixture, [QUERIES[0]] * 4, DOCUMENTS)
    best = list(np.argsort(-reference)[:2])
    assert [r["index"] for r in rerank["results"]] == best
    assert rerank["results"][0]["document"]["text"] == DOCUMENTS[best[0]]
    assert abs(rerank["results"][0]["relevance_score"] - reference[best[0]]) < TOLERANCE
    score = score_run["lines"]["sc"]["response"]["body"]
    assert [d["index"] for d in score["data"]] == [0, 1]
    assert [e["custom_id"] for e in score_run["errors"]] == ["bad"]
    assert "3 documents" in score_run["errors"][0]["error"]["message"]


@pytest.fixture(scope="module")
def classify_run(tmp_path_factory, classifier_dir_fixture):
    root = tmp_path_factory.mktemp("classify")
    texts = [
        "I love this product.",
        "Terrible service, never again.",
        "It arrived on Tuesday.",
        "Absolutely wonderful staff!",
        "The box was damaged.",
    ]
    write_jsonl(root / "in" / "t0.jsonl", [{"id": f"t{i}", "text": t} for i, t in enumerate(texts)])
    pipeline = inference_assets(
        name="labels",
        model=classifier_dir_fixture,
        task="classify",
        input=InputSpec(uri=str(root / "in" / "{partition_key}.jsonl")),
        output_root=str(root / "out"),
        partitions_def=dg.StaticPartitionsDefinition(["t0"]),
        engine={"dtype": "float32"},
    )
    with dg.instance_for_test() as instance:
        result = materialize_partitions(
            pipeline, ["t0"], resource=cpu_resource(), instance=instance
        )
        yield {
            "result": result,
            "texts": texts,
            "table": read_partition(OutputSpec(root=str(root / "out"), asset_name="labels"), "t0"),
        }


def test_classify_matches_transformers_with_label_names(classify_run, classifier_dir_fixture):
    assert classify_run["result"].success
    rows = {row["id"]: row for row in classify_run["table"].to_pylist()}
    ours = np.asarray([rows[f"t{i}"]["probs"] for i in range(len(classify_run["texts"]))])
    reference = transformers_scores(classifier_dir_fixture, classify_run["texts"], None)
    assert np.abs(ours - reference).max() < TOLERANCE
    names = ["negative", "neutral", "positive"]
    assert [rows[f"t{i}"]["label"] for i in range(len(ours))] == [
        names[int(k)] for k in reference.argmax(axis=1)
    ]
