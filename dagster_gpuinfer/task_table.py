"""The task table, control-plane half: what each task (embed, generate, chat, score,
classify) is, in facts both sides may read.

This module imports only the standard library, so the Dagster code location, the job spec
and the worker all import it. The worker's half (`dagster_gpuinfer.worker.tasks.table`) holds each
task's behaviour (payload checks, request parameters, engine call, output rows, OpenAI
body) and finds its facts here by name.

A `TaskFacts` entry says:

- `name`: the spec's `task` value.
- `runner`: vLLM's runner (`"pooling"` or `"generate"`): `LLM(runner=...)`.
- `endpoints`: the OpenAI Batch API urls this task serves, each with the body field that
  carries the input (`{"/v1/embeddings": "input"}`).
- `streams`: True when rows go through the engine one request at a time
  (`InferenceEngine.submit` / `step`); False when a whole chunk is one offline call
  (`LLM.score`, `LLM.classify`).
- `groups_prefixes`: whether `group_prefixes` orders this task's rows by shared prompt prefix
  (vLLM's prefix cache serves them; an encoder gains nothing).
- `pooling` (derived): the task runs on the pooling runner, so it takes no sampling
  parameters and its requests produce no tokens; `samples` is its opposite.

Adding a task: one `TaskFacts` entry in `TASKS` (and its name in `Task`, checked at import),
plus one `WorkerTask` entry in `dagster_gpuinfer.worker.tasks.table.WORKER_TASKS`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal, get_args

Task = Literal[
    "embed",
    "generate",
    "chat",
    "score",
    "classify",
    "image_embed",
    "vision_generate",
    "vision_chat",
]
Runner = Literal["pooling", "generate"]


@dataclass(frozen=True)
class TaskFacts:
    """What the control plane and the engine set-up need to know of one task."""

    name: str
    runner: Runner
    endpoints: Mapping[str, str]
    streams: bool = True
    groups_prefixes: bool = False
    images: bool = False  # rows carry images (worker/tasks/image.py)
    embeds: bool = False  # outputs are vectors, the `embedding` column (sinks store them)

    @property
    def pooling(self) -> bool:
        """Served by vLLM's pooling runner: no sampling, no generated tokens."""
        return self.runner == "pooling"

    @property
    def samples(self) -> bool:
        """Takes sampling parameters (`SamplingParams`) and generates tokens."""
        return not self.pooling


def _facts(*entries: TaskFacts) -> Mapping[str, TaskFacts]:
    return MappingProxyType({entry.name: entry for entry in entries})


SCORE_URLS = ("/v1/score", "/score")
RERANK_URLS = ("/v1/rerank", "/rerank", "/v2/rerank")

TASKS: Mapping[str, TaskFacts] = _facts(
    TaskFacts("embed", "pooling", {"/v1/embeddings": "input"}, embeds=True),
    TaskFacts("generate", "generate", {"/v1/completions": "prompt"}, groups_prefixes=True),
    TaskFacts("chat", "generate", {"/v1/chat/completions": "messages"}, groups_prefixes=True),
    TaskFacts(
        "score",
        "pooling",
        {**dict.fromkeys(SCORE_URLS, "text_1"), **dict.fromkeys(RERANK_URLS, "query")},
        streams=False,
    ),
    TaskFacts("classify", "pooling", {}, streams=False),
    # Image tasks: a row's image is decoded in the read-ahead and sent as multi_modal_data.
    TaskFacts("image_embed", "pooling", {}, images=True, embeds=True),
    TaskFacts("vision_generate", "generate", {}, images=True),
    # Chat lines whose content parts carry image_url; /v1/chat/completions stays chat's in
    # ENDPOINTS (the first task listing a url owns it there).
    TaskFacts("vision_chat", "generate", {"/v1/chat/completions": "messages"}, images=True),
)

if set(get_args(Task)) != set(TASKS):  # pragma: no cover - a table edited by half
    raise RuntimeError(f"task_table.Task {get_args(Task)} and TASKS {tuple(TASKS)} differ")

# Which endpoint serves which task, and which body field carries the input.
ENDPOINTS: Mapping[str, tuple[str, str]] = MappingProxyType(
    {
        url: (facts.name, field)
        for facts in reversed(TASKS.values())
        for url, field in facts.endpoints.items()
    }
)


def tasks_serving(url: str) -> list[str]:
    """The tasks that serve the batch endpoint `url` (a route picks one; ENDPOINTS names the
    default)."""
    return [name for name, facts in TASKS.items() if url in facts.endpoints]


def task_facts(name: str) -> TaskFacts:
    """The facts of task `name`.

    Raises:
        ValueError: `name` is not a task of the table.
    """
    try:
        return TASKS[name]
    except KeyError:
        raise ValueError(f"unknown task {name!r}; the tasks are {', '.join(TASKS)}") from None
