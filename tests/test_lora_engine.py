"""LoRA adapters on the real vLLM CPU engine (its punica CPU path), against `peft`.

Two random adapters over the tiny Llama are made here with `peft` (`init_lora_weights=False`,
so they change what the model says). One engine serves them all in one run: each row runs on
the adapter it names and gives the greedy text `peft` + transformers gives for that adapter,
and rows naming none give the base model's. In `make test`: a Parquet shard whose adapter
column names them (and one unknown, quarantined). `slow`: an OpenAI batch through the batch
API (service, daemon, engine) whose lines name both adapters and the base model.
"""

from __future__ import annotations

import json
from pathlib import Path

import dagster as dg
import pyarrow.parquet as pq
import pytest
from support import cpu_resource, materialize_partitions, partition_metadata, write_parquet

from dagster_gpuinfer import InputSpec, OutputSpec, inference_assets, read_errors, read_partition

pytestmark = pytest.mark.engine

PROMPTS = [
    "The river floods every spring",
    "Compilers translate source code",
    "A good sourdough needs patience",
    "Glaciers carve valleys slowly",
]
MAX_TOKENS = 8
# Each adapter: its seed, rank and target modules (two different ones).
ADAPTERS = {
    "terse": (1, 8, ["q_proj", "v_proj", "o_proj", "down_proj"]),
    "chatty": (2, 4, ["k_proj", "up_proj", "gate_proj"]),
}


def make_adapter(base: str, dst: Path, seed: int, rank: int, targets: list[str]) -> str:
    """A random LoRA adapter over `base`, saved as `peft` saves one."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(
        r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False
    )
    get_peft_model(model, config).save_pretrained(dst)
    return str(dst)


def reference_texts(base: str, adapters: dict[str, str]) -> dict[str | None, list[str]]:
    """Greedy texts of every prompt by `peft` + transformers: per adapter name, and the
    base model's under None."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base)

    def greedy(model) -> list[str]:
        texts = []
        for prompt in PROMPTS:
            ids = torch.tensor([tokenizer(prompt)["input_ids"]])
            with torch.no_grad():
                out = model.generate(
                    input_ids=ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=MAX_TOKENS,
                    do_sample=False,
                )
            texts.append(tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True))
        return texts

    texts: dict[str | None, list[str]] = {}
    base_model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    texts[None] = greedy(base_model)
    for name, folder in adapters.items():
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        texts[name] = greedy(PeftModel.from_pretrained(model, folder).eval())
    return texts


def same_text(ours: str, theirs: str) -> bool:
    """Equal up to where whitespace falls: vLLM's incremental detokenizer and
    `tokenizer.decode` of the WordPiece vocabulary join word pieces alike but may differ
    in the leading space."""
    return ours.split() == theirs.split()


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, tiny_llama_dir):
    root = tmp_path_factory.mktemp("lora")
    folders = {
        name: make_adapter(tiny_llama_dir, root / name, seed, rank, targets)
        for name, (seed, rank, targets) in ADAPTERS.items()
    }
    references = reference_texts(tiny_llama_dir, folders)
    # The three models answer differently, so a row answered by another one shows.
    for name in ADAPTERS:
        assert references[name] != references[None]
    assert references["terse"] != references["chatty"]
    return {"root": root, "folders": folders, "references": references}


def test_rows_run_on_the_adapter_they_name_in_one_engine(adapters, tiny_llama_dir, tmp_path):
    names = [None, "terse", "chatty"]
    rows = [(f"{name or 'base'}-{i}", p, name) for i, p in enumerate(PROMPTS) for name in names]
    rows.append(("typo-0", PROMPTS[0], "terse-v2"))
    write_parquet(
        tmp_path / "in" / "p.parquet",
        {
            "id": [r[0] for r in rows],
            "prompt": [r[1] for r in rows],
            "adapter": [r[2] for r in rows],
        },
    )
    pipeline = inference_assets(
        name="lora_gen",
        model=tiny_llama_dir,
        task="generate",
        input=InputSpec(
            uri=str(tmp_path / "in" / "{partition_key}.parquet"),
            text_column="prompt",
            adapter_column="adapter",
        ),
        output_root=str(tmp_path / "out"),
        partitions_def=dg.StaticPartitionsDefinition(["p"]),
        engine={"max_model_len": 256, "dtype": "float32"},
        sampling={"temperature": 0.0, "max_tokens": MAX_TOKENS},
        lora_adapters=adapters["folders"],
        chunk_size=5,  # chunks mix the adapters, and so do the engine's batches
    )
    load_log = tmp_path / "loads.log"
    with dg.instance_for_test() as instance:
        result = materialize_partitions(
            pipeline, ["p"], resource=cpu_resource(load_log), instance=instance
        )
        assert result.success
        metadata = partition_metadata(instance, pipeline.output_asset.key, "p")
    assert len(load_log.read_text().splitlines()) == 1  # one engine served all three models

    output = OutputSpec(**pipeline.spec["output"])
    table = read_partition(output, "p")
    answered = {
        row["id"]: (row["adapter"], row["text"])
        for row in table.select(["id", "adapter", "text"]).to_pylist()
    }
    references = adapters["references"]
    for i in range(len(PROMPTS)):
        for name in names:
            adapter, text = answered[f"{name or 'base'}-{i}"]
            assert adapter == name
            assert same_text(text, references[name][i]), (name, i, text, references[name][i])

    [error] = read_errors(output, "p").to_pylist()
    assert (error["id"], error["error_type"]) == ("typo-0", "unknown_adapter")
    assert "'terse-v2'" in error["message"] and "chatty, terse" in error["message"]
    lineage = metadata["lora_adapters"]
    assert set(lineage) == set(ADAPTERS)
    assert all(entry["version"].startswith("files:") for entry in lineage.values())
    assert pq.read_schema(next((tmp_path / "out").rglob("part-*.parquet"))).field("adapter")


@pytest.mark.slow
def test_an_openai_batch_naming_two_adapters_and_the_base_answers_each_by_its_model(
    adapters, tiny_llama_dir, minilm_dir, tmp_path
):
    from batch_api_support import client
    from test_batch_api_engine import Stack, poll

    from dagster_gpuinfer.batch_api.store import BatchStore

    stack = Stack(tmp_path, minilm_dir)
    adapter_lines = "".join(
        f"      {name}: {folder}\n" for name, folder in adapters["folders"].items()
    )
    (tmp_path / "routes.yaml").write_text(
        "routes:\n"
        "  - model: tiny-llama\n"
        "    endpoint: /v1/completions\n"
        "    pipeline: batch_lora\n"
        f"    model_path: {tiny_llama_dir}\n"
        "    engine: {max_model_len: 256, dtype: float32}\n"
        f"    sampling: {{temperature: 0.0, max_tokens: {MAX_TOKENS}}}\n"
        "    lora_adapters:\n" + adapter_lines
    )
    instance = stack.instance()  # the instance's storages, made once before both start
    instance.get_runs(limit=1)
    instance.all_instigator_state()
    instance.dispose()
    store = BatchStore(stack.store_url)
    key = store.create_key("acme").token
    store.close()
    stack.key = key
    models = ["tiny-llama", "terse", "chatty"]
    lines = [
        json.dumps(
            {
                "custom_id": f"{model}-{i}",
                "method": "POST",
                "url": "/v1/completions",
                "body": {"model": model, "prompt": prompt},
            }
        )
        for i, prompt in enumerate(PROMPTS)
        for model in models
    ]
    try:
        stack.start_daemon()
        stack.start_api()
        sdk = client(stack.base_url, key)
        uploaded = sdk.files.create(file=("in.jsonl", "\n".join(lines).encode()), purpose="batch")
        batch = sdk.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h"
        )
        assert batch.status == "in_progress", batch
        done = poll(stack, batch.id, lambda b: b.status not in ("in_progress", "finalizing"))
        assert done.status == "completed", f"{done}\n{stack.logs()}"
        output = sdk.files.content(done.output_file_id).read()
    finally:
        stack.close()
    references = adapters["references"]
    answered = {}
    for line in output.splitlines():
        record = json.loads(line)
        body = record["response"]["body"]
        answered[record["custom_id"]] = (body["model"], body["choices"][0]["text"])
    assert len(answered) == len(lines)
    for i in range(len(PROMPTS)):
        for model in models:
            named, text = answered[f"{model}-{i}"]
            assert named == model
            reference = references[None if model == "tiny-llama" else model][i]
            assert same_text(text, reference), (model, i, text, reference)
