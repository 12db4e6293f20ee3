"""Set up the reference pipelines' inputs and models: `python -m assets.prepare`.

Idempotent: files that exist are kept, so a second run takes no time.
"""

from __future__ import annotations

import json
import random
from datetime import UTC, date, datetime, timedelta
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from assets.daily import DAILY_START, write_daily_notes
from assets.images import shape_rows
from assets.models import (
    make_minilm_classifier,
    make_tiny_blip2,
    make_tiny_clip,
    make_tiny_llama,
    make_tiny_llama_bpe,
)
from assets.paths import (
    cross_encoder_dir,
    data_dir,
    generation_model_dir,
    image_model_dir,
    structured_model_dir,
    vision_language_model_dir,
)

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


def _write_atomic(path: Path, content: pa.Table | list[str]) -> str:
    """Write a Parquet table or JSONL lines to a temporary sibling, then rename it to `path`,
    so a half-written input shard is never listed by a sensor or read by a run."""
    tmp = path.with_suffix(".tmp")
    if isinstance(content, pa.Table):
        pq.write_table(content, tmp)
    else:
        tmp.write_text("\n".join(content) + "\n")
    tmp.rename(path)
    return str(path)


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
        written.append(_write_atomic(path, table))
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
        written.append(_write_atomic(path, lines))
    return written


PRODUCTS = ["the app", "the website", "my invoice", "the router", "the checkout page"]
PROBLEMS = [
    "crashes when I open it",
    "charges me twice",
    "is very slow since Monday",
    "shows an empty page",
    "will not connect",
    "lost my saved settings",
]


def write_ticket_shards(shards: int = 2, rows_per_shard: int = 24, seed: int = 5) -> list[str]:
    """Support tickets for the structured extraction pipeline (`ticket_fields`)."""
    out = data_dir() / "inputs" / "ticket_texts"
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    written = []
    for shard in range(shards):
        path = out / f"tickets-{shard:03d}.parquet"
        tickets = [
            f"{rng.choice(PRODUCTS).capitalize()} {rng.choice(PROBLEMS)}. "
            f"{rng.choice(['Please help.', 'This is urgent!', 'No rush.'])}"
            for _ in range(rows_per_shard)
        ]
        if path.exists():
            continue
        prompts = [
            "Extract product, urgency (1-5) and a short summary as JSON.\nTicket: " + t
            for t in tickets
        ]
        table = pa.table(
            {
                "ticket_id": [f"ticket-{shard:03d}-{i:04d}" for i in range(rows_per_shard)],
                "prompt": prompts,
            }
        )
        written.append(_write_atomic(path, table))
    return written


def write_rerank_shards(shards: int = 2, queries_per_shard: int = 12, seed: int = 13) -> list[str]:
    """OpenAI Batch `/v1/rerank` lines (a query, 5 candidate passages) for `passage_rerank`."""
    out = data_dir() / "inputs" / "rerank"
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    written = []
    for shard in range(shards):
        path = out / f"queries-{shard:03d}.jsonl"
        lines = []
        for i in range(queries_per_shard):
            topic = rng.choice(TOPICS)
            passages = [make_document(rng, shard * 1000 + i * 10 + j) for j in range(4)]
            passages.insert(rng.randrange(5), f"A short introduction to {topic} for beginners.")
            lines.append(
                json.dumps(
                    {
                        "custom_id": f"q-{shard:03d}-{i:04d}",
                        "method": "POST",
                        "url": "/v1/rerank",
                        "body": {
                            "model": "minilm-cross-encoder",
                            "query": f"What is {topic}?",
                            "documents": passages,
                            "top_n": 3,
                        },
                    }
                )
            )
        if path.exists():
            continue
        written.append(_write_atomic(path, lines))
    return written


IMAGE_SHARDS = 3
IMAGE_ROWS_PER_SHARD = 120


def write_image_shards(
    shards: int = IMAGE_SHARDS, rows_per_shard: int = IMAGE_ROWS_PER_SHARD, seed: int = 17
) -> list[str]:
    """Parquet shards of drawn shapes (PNG, JPEG and WebP, 48x48 to 1024x768) for
    `image_embeddings`: each row is an image (`image`: encoded bytes, `text` null) or, one
    row in five, a caption alone (`image` null, `text` "a red circle"), so image and text
    rows of one partition land in one embedding space."""
    out = data_dir() / "inputs" / "images"
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for shard in range(shards):
        path = out / f"images-{shard:03d}.parquet"
        if path.exists():
            continue
        rows = shape_rows(rows_per_shard, seed=seed + shard)
        captions_only = [i % 5 == 4 for i in range(len(rows))]
        table = pa.table(
            {
                "id": [row_id for row_id, _, _ in rows],
                "image": pa.array(
                    [
                        None if c else data
                        for c, (_, _, data) in zip(captions_only, rows, strict=True)
                    ],
                    pa.binary(),
                ),
                "text": pa.array(
                    [
                        caption if c else None
                        for c, (_, caption, _) in zip(captions_only, rows, strict=True)
                    ],
                    pa.string(),
                ),
                "caption": [caption for _, caption, _ in rows],
            }
        )
        written.append(_write_atomic(path, table))
    return written


def daily_note_days(today: date | None = None) -> list[str]:
    """Every day of `daily_note_embeddings` from its start to today (UTC), so every partition
    the UI offers, including today's once it ends, has its input file."""
    today = today or datetime.now(UTC).date()
    first = date.fromisoformat(DAILY_START)
    return [(first + timedelta(days=d)).isoformat() for d in range((today - first).days + 1)]


def main() -> None:
    docs = write_doc_shards()
    prompts = write_prompt_shards()
    tickets = write_ticket_shards()
    rerank = write_rerank_shards()
    days = daily_note_days()
    daily = write_daily_notes(days)
    model = make_tiny_llama(generation_model_dir())
    structured = make_tiny_llama_bpe(structured_model_dir())
    cross_encoder = make_minilm_classifier(cross_encoder_dir(), num_labels=1)
    images = write_image_shards()
    clip = make_tiny_clip(image_model_dir())
    blip2 = make_tiny_blip2(vision_language_model_dir())
    print(
        f"inputs under {data_dir() / 'inputs'} (existing ones kept): {len(docs)} doc shards, "
        f"{len(prompts)} prompt shards, {len(tickets)} ticket shards, {len(rerank)} rerank "
        f"shards, {len(images)} image shards, {len(daily)} new daily note files "
        f"({days[0]} to {days[-1]})"
    )
    print(f"models: {model}, {structured}, {cross_encoder}, {clip}, {blip2}")


if __name__ == "__main__":
    main()
