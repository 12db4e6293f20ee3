"""The rows every contestant gets: written once per benchmark run, identical for all.

Embedding rows are the reference corpus's documents (`assets.prepare.make_document`);
generation rows are short instructions; the prefix workload gives each row one of a few
long few-shot headers followed by its own question, shuffled, as a batch job of templated
prompts looks.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from assets.prepare import DETAILS, TOPICS, VERBS, make_document


def embed_texts(rows: int, *, seed: int = 7) -> list[str]:
    rng = random.Random(seed)
    return [make_document(rng, i) for i in range(rows)]


def generate_texts(rows: int, *, seed: int = 11) -> list[str]:
    rng = random.Random(seed)
    return [
        f"Write one sentence about {rng.choice(TOPICS)} {rng.choice(DETAILS)}." for _ in range(rows)
    ]


def prefix_texts(rows: int, *, headers: int, header_examples: int, seed: int = 13) -> list[str]:
    """Rows that share one of `headers` long few-shot headers, in shuffled order."""
    rng = random.Random(seed)
    heads = []
    for h in range(headers):
        examples = []
        for e in range(header_examples):
            topic, verb, detail = rng.choice(TOPICS), rng.choice(VERBS), rng.choice(DETAILS)
            examples.append(
                f"Example {e + 1}. Question: what does note {h}-{e} do? "
                f"Answer: it {verb} {topic} {detail}."
            )
        heads.append(f"You are assistant number {h}. Answer in one line.\n" + "\n".join(examples))
    texts = []
    for i in range(rows):
        head = heads[rng.randrange(headers)]
        texts.append(f"{head}\nQuestion: what does note {i} about {rng.choice(TOPICS)} do? Answer:")
    return texts


def write_shard(
    path: Path, texts: list[str], *, id_prefix: str, params: list[str] | None = None
) -> Path:
    """One input shard as Parquet with `id` and `text` columns, and a `params` column of
    per-row parameters (JSON objects) when `params` is given."""
    path.parent.mkdir(parents=True, exist_ok=True)
    columns = {"id": [f"{id_prefix}-{i:07d}" for i in range(len(texts))], "text": texts}
    if params is not None:
        columns["params"] = params
    table = pa.table(columns)
    tmp = path.with_suffix(".tmp")
    pq.write_table(table, tmp)
    tmp.rename(path)
    return path


def write_large_shard(path: Path, rows: int, *, batch_rows: int = 100_000) -> Path:
    """A shard of `rows` short rows, written batch by batch so this process stays small."""
    path.parent.mkdir(parents=True, exist_ok=True)
    schema = pa.schema([("id", pa.string()), ("text", pa.string())])
    tmp = path.with_suffix(".tmp")
    rng = random.Random(17)
    with pq.ParquetWriter(tmp, schema) as writer:
        for start in range(0, rows, batch_rows):
            n = min(batch_rows, rows - start)
            ids = [f"m-{start + i:08d}" for i in range(n)]
            texts = [f"{rng.choice(VERBS)} {rng.choice(TOPICS)} {start + i}" for i in range(n)]
            writer.write_table(pa.table({"id": ids, "text": texts}, schema=schema))
    tmp.rename(path)
    return path


def describe(texts: list[str]) -> str:
    chars = sum(len(t) for t in texts) / max(len(texts), 1)
    return json.dumps({"rows": len(texts), "mean_chars": round(chars, 1)})
