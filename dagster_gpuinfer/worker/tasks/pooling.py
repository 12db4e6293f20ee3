"""Tasks `score` and `classify` on vLLM's pooling runner.

`score`: each row holds one or more (query, document) pairs, from two columns
(`input.text_column`, `input.text_pair_column`) or an OpenAI Batch `/v1/score` or
`/v1/rerank` line. All pairs of a chunk go to one `LLM.score(queries, documents)` call (a
cross-encoder, `num_labels == 1`); each row gets its pairs' scores back in input order.
`classify`: each row's text goes through `LLM.classify`; the row gets the probabilities of
every label and the most likely label's name (from the model's `id2label`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class ScorePairs:
    """The pairs of one score row: `queries[i]` with `documents[i]`; `rerank` rows answer
    with their documents ordered by score."""

    queries: list[str]
    documents: list[str]
    rerank: bool = False


@dataclass
class PoolingResult:
    """Scores (one list per row) or class probabilities (one list per row)."""

    scores: list[list[float]] | None = None
    probs: list[list[float]] | None = None
    labels: list[str] | None = None
    prompt_tokens: list[int] = field(default_factory=list)
    generated_tokens: list[int] = field(default_factory=list)
    seconds: float = 0.0


def parse_score_payload(payload: Any) -> tuple[ScorePairs | None, str | None]:
    """A score row's pairs, or why it has none.

    Accepts a `(query, document)` pair from two columns, an OpenAI/vLLM score body
    (`text_1`/`text_2`, `queries`/`documents`, `data_1`/`data_2`: 1->1, 1->N or N->N), and a
    rerank body (`query`, `documents`).
    """
    if isinstance(payload, tuple):
        query, document = payload
        if not _text(query) or not _text(document):
            return None, "the query or the document is null, empty or not a string"
        return ScorePairs([query], [document]), None
    if not isinstance(payload, dict):
        return None, f"expected a score request body, got {type(payload).__name__}"
    if "query" in payload:
        first, second, rerank = payload.get("query"), payload.get("documents"), True
        if not _text(first):
            return None, "'query' must be a non-empty string"
    else:
        for a, b in (("text_1", "text_2"), ("queries", "documents"), ("data_1", "data_2")):
            if a in payload:
                first, second, rerank = payload.get(a), payload.get(b), False
                break
        else:
            return None, "the body has no text_1/text_2 (score) or query/documents (rerank)"
    firsts = first if isinstance(first, list) else [first]
    seconds = second if isinstance(second, list) else [second]
    if not firsts or not seconds or not all(_text(t) for t in [*firsts, *seconds]):
        return None, "every query and document must be a non-empty string"
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    if len(firsts) != len(seconds):
        return None, (
            f"{len(firsts)} queries and {len(seconds)} documents: pair 1 with N, or N with N"
        )
    return ScorePairs(firsts, seconds, rerank=rerank), None


def _text(value: Any) -> bool:
    return isinstance(value, str) and bool(value.strip())


def run_score(llm: Any, pairs: list[ScorePairs], prompt_tokens: list[int]) -> PoolingResult:
    """Score every pair of the chunk in one `LLM.score` call; scores grouped by row."""
    started = time.perf_counter()
    queries = [q for row in pairs for q in row.queries]
    documents = [d for row in pairs for d in row.documents]
    flat: list[float] = []
    if queries:
        outputs = llm.score(queries, documents, use_tqdm=False)
        flat = [float(o.outputs.score) for o in outputs]
    scores, start = [], 0
    for row in pairs:
        scores.append(flat[start : start + len(row.queries)])
        start += len(row.queries)
    return PoolingResult(
        scores=scores,
        prompt_tokens=prompt_tokens,
        generated_tokens=[0] * len(pairs),
        seconds=time.perf_counter() - started,
    )


def run_classify(llm: Any, token_ids: list[list[int]], id2label: dict[int, str]) -> PoolingResult:
    """Classify pre-tokenized rows in one `LLM.classify` call."""
    started = time.perf_counter()
    probs: list[list[float]] = []
    if token_ids:
        outputs = llm.classify([{"prompt_token_ids": ids} for ids in token_ids], use_tqdm=False)
        probs = [[float(p) for p in o.outputs.probs] for o in outputs]
    labels = [id2label.get(int(np.argmax(p)), str(int(np.argmax(p)))) for p in probs]
    return PoolingResult(
        probs=probs,
        labels=labels,
        prompt_tokens=[len(ids) for ids in token_ids],
        generated_tokens=[0] * len(token_ids),
        seconds=time.perf_counter() - started,
    )


def model_labels(llm: Any) -> dict[int, str]:
    """The model's label names by index (`id2label` of its Hugging Face config)."""
    config = llm.llm_engine.model_config.hf_config
    return {int(k): str(v) for k, v in (getattr(config, "id2label", None) or {}).items()}
