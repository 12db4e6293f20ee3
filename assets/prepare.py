"""Set up the reference pipelines' inputs and models: `python -m assets.prepare`.

Idempotent: files that exist are kept, so a second run takes no time.
"""

from __future__ import annotations

import json
import random

import pyarrow as pa
import pyarrow.parquet as pq

from assets.models import make_tiny_llama
from assets.paths import data_dir, generation_model_dir

TOPICS = [
    "solar power",
    "river ecology",
    "distributed databases",
    "medieval trade",
    "protein folding",
    "jazz history",
    "urban cycling",
    "volcanoes",
    "tax policy",
    "deep sea fish",
    "compilers",
    "bread baking",
    "glaciers",
    "chess openings",
    "supply chains",
    "bird migration",
]
VERBS = ["explains", "questions", "summarises", "compares", "criticises", "celebrates"]
DETAILS = [
    "with field measurements from three seasons",
    "for readers who are new to the subject",
    "using a worked example and a short glossary",
    "and lists the open problems that remain",
    "through interviews with practitioners",
    "with a focus on costs and trade-offs",
]


def make_document(rng: random.Random, doc_id: int) -> str:
    topic = rng.choice(TOPICS)
    sentences = [
        f"This note {rng.choice(VERBS)} {topic} {rng.choice(DETAILS)}.",
        f"It was written as document {doc_id} of the demo corpus.",
    ]
    if rng.random() < 0.5:
        sentences.append(f"A second part {rng.choice(VERBS)} {rng.choice(TOPICS)}.")
    return " ".join(sentences)


def write_doc_shards(shards: int = 4, rows_per_shard: int = 500, seed: int = 7) -> list[str]:
    out = data_dir() / "inputs" / "docs"
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    written = []
    for shard in range(shards):
        path = out / f"docs-{shard:03d}.parquet"
        ids = [f"doc-{shard:03d}-{i:05d}" for i in range(rows_per_shard)]
        texts = [make_document(rng, shard * rows_per_shard + i) for i in range(rows_per_shard)]
        if path.exists():
            continue
        table = pa.table({"doc_id": ids, "text": texts})
        pq.write_table(table, path.with_suffix(".tmp"))
        path.with_suffix(".tmp").rename(path)
        written.append(str(path))
    return written


def write_prompt_shards(shards: int = 4, rows_per_shard: int = 200, seed: int = 11) -> list[str]:
    out = data_dir() / "inputs" / "prompts"
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    written = []
    for shard in range(shards):
        path = out / f"prompts-{shard:03d}.jsonl"
        lines = [
            json.dumps(
                {
                    "id": f"prompt-{shard:03d}-{i:05d}",
                    "prompt": f"Write one sentence about {rng.choice(TOPICS)} "
                    f"{rng.choice(DETAILS)}.",
                }
            )
            for i in range(rows_per_shard)
        ]
        if path.exists():
            continue
        path.with_suffix(".tmp").write_text("\n".join(lines) + "\n")
        path.with_suffix(".tmp").rename(path)
        written.append(str(path))
    return written


def main() -> None:
    docs = write_doc_shards()
    prompts = write_prompt_shards()
    model = make_tiny_llama(generation_model_dir())
    print(
        f"inputs: {len(docs)} doc shards and {len(prompts)} prompt shards written under "
        f"{data_dir() / 'inputs'} (existing ones kept)"
    )
    print(f"models: generation model at {model}")


if __name__ == "__main__":
    main()
