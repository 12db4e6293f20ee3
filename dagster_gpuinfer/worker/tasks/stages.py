"""What a task calls back in the stages above it, as Protocols.

The task table (`table.py`) sits below the reader, the validator, the request builder and
the engine (rooms `rows/` and `loop/`), which look a task up and call it; the task calls
them back through these surfaces without importing them (`tests/test_import_graph.py`):

- `RequestReader`: the shard reader's OpenAI Batch line parsers (`readers.ShardReader`);
- `RowValidation`: the validator's generic steps (`validate.RowValidator`);
- `RequestBuilding`: the request builder's generation request (`request_params.RequestBuilder`);
- `TaskEngine`: what a task reads of a built engine (`engine.InferenceEngine`).

The data those stages hand a task (a row's candidate, a chunk's `ValidChunk`, the engine's
`ChunkResult`) are their own classes, named here for type checkers only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, TypeAlias

from dagster_gpuinfer.worker.errors import RowError
from dagster_gpuinfer.worker.tasks.params import RowRequest
from dagster_gpuinfer.worker.tasks.pooling import ScorePairs

if TYPE_CHECKING:  # the rooms above: types only, never imported at run time
    from dagster_gpuinfer.worker.rows.validate import ValidChunk
    from dagster_gpuinfer.worker.rows.validate import _Candidate as Candidate
    from dagster_gpuinfer.worker.tasks.images import ImageDecoder

# An OpenAI Batch line as a row: (row, id, payload, parameters), or why it cannot be one.
OpenAIRequest: TypeAlias = "tuple[int, str, Any, dict[str, Any]] | RowError"
# A candidate row, or (error type, message) when its input has the wrong shape.
CandidateOrProblem: TypeAlias = "tuple[Candidate | None, tuple[str, str]]"


class RequestReader(Protocol):
    """The shard reader's parsers of an OpenAI Batch line's body."""

    def body_field_request(
        self, row: int, row_id: str, body: Any, body_field: str
    ) -> OpenAIRequest: ...

    def score_request(self, row: int, row_id: str, url: str, body: Any) -> OpenAIRequest: ...


class RowValidation(Protocol):
    """The validator's generic steps a task chooses among (and the image tasks' decoder)."""

    tokenizer: Any
    shard_uri: str | None

    def text_candidate(
        self,
        row: int,
        row_id: str,
        payload: Any,
        request: RowRequest,
        *,
        token_ids: bool,
        lists: bool,
        expected: str,
    ) -> CandidateOrProblem: ...

    def whole_candidate(
        self, row: int, row_id: str, payload: Any, request: RowRequest
    ) -> Candidate: ...

    def pairs_candidate(
        self, row: int, row_id: str, request: RowRequest, pairs: ScorePairs
    ) -> Candidate: ...

    def image_row_candidate(
        self, row: int, row_id: str, request: RowRequest, prompt: str, refs: list[Any]
    ) -> Candidate: ...

    def render_chats(
        self, source: str, candidates: list[Candidate], errors: list[RowError]
    ) -> list[Candidate]: ...

    def text_chars(self, candidate: Candidate) -> list[int]: ...

    def chat_chars(self, candidate: Candidate) -> list[int]: ...

    def tokenize_candidates(
        self, source: str, candidates: list[Candidate], out: ValidChunk
    ) -> None: ...

    def tokenize_pairs_rowwise(
        self, source: str, candidates: list[Candidate], out: ValidChunk
    ) -> None: ...

    def image_decoder(self) -> ImageDecoder: ...


class RequestBuilding(Protocol):
    """The request builder's step for a generating row."""

    def build(self, params: dict[str, Any] | None, *, adapter: Any = None) -> RowRequest: ...

    def generation_request(self, params: dict[str, Any]) -> RowRequest: ...


class TaskEngine(Protocol):
    """What a task reads of a built engine: its request builder (a generating task's
    default `SamplingParams`) and the `vllm.LLM` (score/classify's whole-chunk calls)."""

    @property
    def requests(self) -> RequestBuilding: ...

    @property
    def llm(self) -> Any: ...
