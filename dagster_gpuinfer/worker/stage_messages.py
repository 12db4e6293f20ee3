"""What the worker's stages hand each other, in one module: the run (`run/`) and the engine
loop (`loop/`) meet here, so neither imports the other's insides.

- `WorkChunk`: a chunk of a shard, read and id-screened by the run's coordinator, for any
  engine of the run; `ChunkCommitted`: an engine wrote a chunk and its marker.
- `ChunkResult`: an engine's output for the rows of one chunk; `RequestRejected`: the engine
  refused one request (that row is quarantined).
- The replica messages (`ReplicaMessage`): what a replica process tells the run's parent.
- `POLL_SECONDS`: how long a thread that waits on a queue or a condition waits before it
  looks again for a stop or a death; the one poll interval of the worker.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from dagster_gpuinfer.storage import ChunkMarker, SourceVersion
from dagster_gpuinfer.task_table import task_facts
from dagster_gpuinfer.worker.errors import ShardError, SpecError, WorkerError
from dagster_gpuinfer.worker.rows.readers import RawChunk
from dagster_gpuinfer.worker.tasks.completions import choices_of

POLL_SECONDS = 0.2
USER_ERRORS: dict[str, type[WorkerError]] = {"ShardError": ShardError, "SpecError": SpecError}


@dataclass
class WorkChunk:
    """One chunk of a shard, for any engine of the run (picklable: it crosses processes)."""

    partition_key: str
    attempt: str  # names this run's files of the partition (see `chunk_part_name`)
    chunk: RawChunk  # ids screened in shard order (`screen_ids`)
    source: SourceVersion  # the shard and model versions its marker records
    job: str | None = None  # a chunk-range lease's job: its marker records it (`ChunkMarker.job`)


@dataclass
class ChunkCommitted:
    """An engine wrote a chunk and its marker (picklable: it crosses processes)."""

    partition_key: str
    marker: ChunkMarker
    replica: int


class RequestRejected(Exception):
    """The engine refused one request at `submit` (a value its transport cannot carry): that
    row is quarantined and the others go on. Not raised when the engine itself has died."""


@dataclass
class ChunkResult:
    """Engine output for the rows of one chunk, in input order."""

    embeddings: np.ndarray | None = None  # (rows, dim) float32, for embed
    texts: list[str] | None = None
    finish_reasons: list[str | None] | None = None
    prompt_tokens: list[int] | None = None
    generated_tokens: list[int] | None = None
    cached_tokens: list[int] | None = None  # prompt tokens served from vLLM's prefix cache
    choices: list[list[dict[str, Any]]] | None = None  # every choice of each row (n >= 1)
    seconds: float = 0.0

    @classmethod
    def from_outputs(
        cls,
        task: str,
        outputs: Sequence[Any],
        seconds: float = 0.0,
        requests: Sequence[Any] | None = None,
    ) -> ChunkResult:
        """The columns of a chunk from vLLM's finished outputs, in input order.

        Args:
            task: The spec's task: pooling tasks give embeddings, the others choices.
            outputs: `RequestOutput` per row for generate and chat; `PoolingRequestOutput`
                per prompt for embed (a row whose input is a list has several, see
                `ValidChunk.spans`).
            seconds: Inference time of the chunk.
            requests: Each row's `request_params.RowRequest` (its `top_logprobs`); None: no
                row asked for logprobs.
        """
        if task_facts(task).pooling:
            if outputs:
                embeddings = np.stack(
                    [np.asarray(o.outputs.data, dtype=np.float32) for o in outputs]
                )
            else:
                embeddings = np.zeros((0, 0), np.float32)
            prompt_tokens = [len(o.prompt_token_ids or ()) for o in outputs]
            return cls(
                embeddings=embeddings,
                prompt_tokens=prompt_tokens,
                generated_tokens=[0] * len(outputs),
                seconds=seconds,
            )
        top = [r.top_logprobs for r in requests] if requests else [None] * len(outputs)
        choices = [choices_of(o, k) for o, k in zip(outputs, top, strict=True)]
        return cls(
            texts=[c[0]["text"] for c in choices],
            finish_reasons=[c[0]["finish_reason"] for c in choices],
            prompt_tokens=[len(o.prompt_token_ids or ()) for o in outputs],
            generated_tokens=[sum(choice["generated_tokens"] for choice in c) for c in choices],
            cached_tokens=[o.num_cached_tokens or 0 for o in outputs],
            choices=choices,
            seconds=seconds,
        )


@dataclass(frozen=True)
class ReplicaLoaded:
    """A replica's engine is built: its load time and its window of requests in flight."""

    replica: int
    load_seconds: float
    window: int


@dataclass(frozen=True)
class ReplicaChunk:
    """A replica wrote and marked a chunk (its marker carries the chunk's times)."""

    replica: int
    committed: ChunkCommitted


@dataclass(frozen=True)
class ReplicaFinished:
    """A replica served its last chunk and shut its engine down."""

    replica: int
    shutdown_seconds: float


@dataclass(frozen=True)
class ReplicaUserError:
    """A replica met a `WorkerError` (a bad shard or spec): raised again in the parent."""

    replica: int
    error_class: str
    message: str
    partition_key: str | None

    def error(self) -> WorkerError:
        return USER_ERRORS.get(self.error_class, WorkerError)(
            self.message, partition_key=self.partition_key
        )


@dataclass(frozen=True)
class ReplicaCrashed:
    """A replica died of anything else; `traceback` is its formatted traceback;
    `engine_died` when that was its engine's death (vLLM's `EngineDeadError`)."""

    replica: int
    traceback: str
    engine_died: bool = False


ReplicaMessage = ReplicaLoaded | ReplicaChunk | ReplicaFinished | ReplicaUserError | ReplicaCrashed
