"""Row validation: every parsed row is either tokenized for the engine or quarantined.

Every check of one row runs behind one guard (`RowValidator.validate`): whatever goes wrong
for a row (its parameters, its shape, its chat template, its tokenizing) quarantines that row
with a reason, never the chunk. Prompts longer than `limits.max_prompt_chars` characters are
quarantined before the tokenizer sees them, so a 10 MB prompt never costs gigabytes.

Tokenizing here, once, with the engine's own tokenizer serves two ends: prompts longer than
the engine can take are quarantined (with their token count) instead of failing the whole
batch inside vLLM, and the engine receives token ids (`TokensPrompt`) so it does not
tokenize a second time.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dagster_gpuinfer.image_options import ImageOptions
from dagster_gpuinfer.spec import RowLimits, StorageOptions
from dagster_gpuinfer.worker.errors import RowError, cap_message, lone_surrogate_in
from dagster_gpuinfer.worker.rows.readers import RawChunk, json_depth_exceeds
from dagster_gpuinfer.worker.rows.request_params import RequestBuilder
from dagster_gpuinfer.worker.tasks.params import ParameterError, RowRequest, parse_params_value
from dagster_gpuinfer.worker.tasks.pooling import ScorePairs
from dagster_gpuinfer.worker.tasks.table import worker_task

if TYPE_CHECKING:
    from dagster_gpuinfer.worker.tasks.images import ImageDecoder

CHAT_ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})


@dataclass
class ValidChunk:
    """The rows of a chunk that go to the engine, and the ones quarantined.

    `token_ids` holds one prompt per row, except for embeddings whose input is a list (an
    OpenAI line's `input: [...]`): `spans[i]` prompts then belong to row i, consecutively.
    `requests[i]` is row i's own request (per-row `SamplingParams`, logprobs, structured
    output constraint). `pairs[i]` are the (query, document) pairs of score row i.
    """

    index: int
    rows: list[int] = field(default_factory=list)
    ids: list[str] = field(default_factory=list)
    token_ids: list[list[int]] = field(default_factory=list)
    errors: list[RowError] = field(default_factory=list)
    requests: list[RowRequest] = field(default_factory=list)
    spans: list[int] = field(default_factory=list)
    pairs: list[ScorePairs] = field(default_factory=list)
    pair_tokens: list[int] = field(default_factory=list)
    # Image tasks: each prompt's decoded images (beside `token_ids`), the images and encoded
    # bytes the chunk's rows carried (quarantined rows' included).
    images: list[list[Any]] = field(default_factory=list)
    # Beside `images`: a digest of each prompt's images' bytes (its rows' reuse keys).
    image_digests: list[str] = field(default_factory=list)
    image_count: int = 0
    image_bytes: int = 0

    def subset(self, keep: list[int]) -> ValidChunk:
        """The rows at positions `keep` (in that order) with their prompts, requests, pairs
        and images, and no errors: the rows of a chunk that go to the engine when the
        others are reused (`worker/loop/reuse.py`)."""
        spans = self.spans or [1] * len(self.ids)
        starts = [0]
        for span in spans:
            starts.append(starts[-1] + span)
        part = ValidChunk(index=self.index)
        for i in keep:
            part.rows.append(self.rows[i])
            part.ids.append(self.ids[i])
            for name in ("requests", "spans", "pairs", "pair_tokens"):
                values = getattr(self, name)
                if values:
                    getattr(part, name).append(values[i])
            positions = range(starts[i], starts[i + 1])
            if self.token_ids:
                part.token_ids.extend(self.token_ids[p] for p in positions)
            if self.images:
                part.images.extend(self.images[p] for p in positions)
            if self.image_digests:
                part.image_digests.extend(self.image_digests[p] for p in positions)
        return part

    def without_prompts(
        self, failed: dict[int, str], outputs: list[Any], source: str
    ) -> tuple[ValidChunk, list[Any]]:
        """This chunk and its outputs without the rows any of whose prompts (positions in
        `token_ids`) failed at submit; those rows join the errors with the reason given."""
        spans = self.spans or [1] * len(self.ids)
        kept = ValidChunk(
            index=self.index,
            errors=list(self.errors),
            image_count=self.image_count,
            image_bytes=self.image_bytes,
        )
        kept_outputs: list[Any] = []
        start = 0
        for i, span in enumerate(spans):
            positions = range(start, start + span)
            start += span
            reason = next((failed[p] for p in positions if p in failed), None)
            if reason is not None:
                kept.errors.append(
                    RowError.quarantined(
                        self.ids[i],
                        source,
                        self.rows[i],
                        "rejected_by_engine",
                        f"{source} row {self.rows[i]} (id {self.ids[i]}): {reason}",
                    )
                )
                continue
            kept.rows.append(self.rows[i])
            kept.ids.append(self.ids[i])
            if self.requests:
                kept.requests.append(self.requests[i])
            if self.spans:
                kept.spans.append(span)
            kept.token_ids.extend(self.token_ids[p] for p in positions)
            if self.images:
                kept.images.extend(self.images[p] for p in positions)
            if self.image_digests:
                kept.image_digests.extend(self.image_digests[p] for p in positions)
            kept_outputs.extend(outputs[p] for p in positions)
        return kept, kept_outputs


@dataclass
class _Candidate:
    row: int
    row_id: str
    request: RowRequest
    prompts: list[str | list[int]]  # text to tokenize, or token ids already
    pairs: ScorePairs | None = None
    images: list[Any] | None = None  # image tasks: references, then decoded images
    image_digests: list[str] | None = None  # their encoded bytes' digests, once decoded


class RowValidator:
    """Validates and tokenizes the rows of a shard, chunk by chunk.

    Ids are not checked here: the worker screens them with `screen_ids` where the shard is
    read, in shard order, so that engines serving chunks of one shard in any order agree on
    the first occurrence of an id.

    Args:
        task: embed, generate, chat, score or classify.
        tokenizer: the engine's (Hugging Face) tokenizer.
        max_model_len: the engine's context length.
        requests: builds each row's request from its parameters (see `request_params`);
            without one, rows run the engine's defaults and a row with parameters is checked
            against an empty set of defaults.
        limits: the pipeline's `RowLimits` (prompt characters, parameter depth).
        images: image tasks: the pipeline's `ImageOptions` (URL policy, limits, threads).
        storage: image tasks: the storage options `s3://` images are read with.
        image_fit: image tasks: the model's image resize, run in the decoder's pool
            (`InferenceEngine.image_fit`); None: images stay at their decoded size.
    """

    def __init__(
        self,
        *,
        task: str,
        tokenizer: Any,
        max_model_len: int,
        requests: RequestBuilder | None = None,
        limits: RowLimits | None = None,
        images: ImageOptions | None = None,
        storage: StorageOptions | None = None,
        image_fit: Any = None,
    ) -> None:
        self.task = worker_task(task)
        self.image_fit = image_fit
        self.image_options = images or ImageOptions()
        self.storage = storage
        self._decoder: ImageDecoder | None = None
        self.shard_uri: str | None = None  # the shard of the chunk being validated
        self.limits = limits or (requests.limits if requests is not None else RowLimits())
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.requests = requests
        # Generation needs room for at least one new token.
        self.max_prompt_tokens = max_model_len if self.task.facts.pooling else max_model_len - 1

    def image_decoder(self) -> ImageDecoder:
        """Image tasks: the pool that reads and decodes images (made at first use)."""
        if self._decoder is None:
            from dagster_gpuinfer.worker.tasks.images import ImageDecoder

            self._decoder = ImageDecoder(self.image_options, self.storage, fit=self.image_fit)
        return self._decoder

    def close(self) -> None:
        """Image tasks: stop the decoder's pool and join its threads (made again if used)."""
        if self._decoder is not None:
            self._decoder.close(wait=True)
            self._decoder = None

    def image_row_candidate(
        self, row: int, row_id: str, request: RowRequest, prompt: str, refs: list[Any]
    ) -> _Candidate:
        """An image task's row: its prompt text and its image references."""
        return _Candidate(row, row_id, request, [prompt], images=refs)

    def validate(self, chunk: RawChunk) -> ValidChunk:
        out = ValidChunk(index=chunk.index, errors=list(chunk.errors))
        self.shard_uri = chunk.shard_uri
        candidates: list[_Candidate] = []
        for row, row_id, payload in chunk.rows:
            try:
                candidate = self._admit(chunk, row, row_id, payload, out.errors)
            except Exception as exc:  # the row boundary: one row never fails the chunk
                out.errors.append(unexpected_row_error(chunk.source, row, row_id, exc))
                continue
            if candidate is not None:
                candidates.append(candidate)
        if not candidates:
            return out
        candidates = self.task.prepare(self, chunk.source, candidates, out.errors)
        self.task.admit(self, chunk.source, candidates, out)
        return out

    def _admit(
        self, chunk: RawChunk, row: int, row_id: str | None, payload: Any, errors: list[RowError]
    ) -> _Candidate | None:
        """The row as a candidate for the engine, or None with its reason added to `errors`."""
        error = self._check_row(chunk.source, row, row_id, payload)
        if error is not None:
            errors.append(error)
            return None
        assert row_id is not None  # screened by `screen_ids`
        where = f"{chunk.source} row {row} (id {row_id})"
        try:
            request = self._request(chunk.params.get(row), chunk.adapters.get(row))
        except ParameterError as exc:
            errors.append(
                RowError.quarantined(
                    row_id,
                    chunk.source,
                    row,
                    exc.error_type,
                    f"{where}: {exc}",
                )
            )
            return None
        candidate, problem = self.task.candidate(self, row, row_id, payload, request)
        if candidate is not None:
            problem = self._length_problem(candidate)
            if problem is not None:
                candidate = None
        if candidate is None:
            error_type, message = problem
            errors.append(
                RowError.quarantined(
                    row_id,
                    chunk.source,
                    row,
                    error_type,
                    f"{where}: {message}",
                )
            )
        return candidate

    def tokenize_candidates(
        self, source: str, candidates: list[_Candidate], out: ValidChunk
    ) -> None:
        """Tokenize the candidates' text prompts (one batch; row by row when a row breaks the
        batch) and admit the ones that fit the engine."""
        texts = [p for c in candidates for p in c.prompts if isinstance(p, str)]
        try:
            encoded = iter(self._tokenize(texts))
        except Exception:
            encoded_rows = []
            kept = []
            for candidate in candidates:
                try:
                    encoded_rows.extend(
                        self._tokenize([p for p in candidate.prompts if isinstance(p, str)])
                    )
                    kept.append(candidate)
                except Exception as exc:
                    out.errors.append(
                        unexpected_row_error(source, candidate.row, candidate.row_id, exc)
                    )
            candidates, encoded = kept, iter(encoded_rows)
        for candidate in candidates:
            token_lists = [
                next(encoded) if isinstance(p, str) else list(p) for p in candidate.prompts
            ]
            longest = max(token_lists, key=len)
            if len(longest) > self.max_prompt_tokens:
                element = f" (input {token_lists.index(longest)})" if len(token_lists) > 1 else ""
                out.errors.append(
                    RowError.quarantined(
                        candidate.row_id,
                        source,
                        candidate.row,
                        "prompt_too_long",
                        f"{source} row {candidate.row} (id {candidate.row_id}){element}: "
                        f"{len(longest)} prompt tokens, more than the {self.max_prompt_tokens} "
                        f"this engine takes (max_model_len={self.max_model_len}); shorten the "
                        "input or raise engine.max_model_len",
                        prompt_tokens=len(longest),
                    )
                )
                continue
            out.rows.append(candidate.row)
            out.ids.append(candidate.row_id)
            out.requests.append(candidate.request)
            out.spans.append(len(token_lists))
            out.token_ids.extend(token_lists)
            if self.task.facts.images:
                out.images.extend([candidate.images or []] * len(token_lists))
                digests = ",".join(candidate.image_digests or [])
                out.image_digests.extend([digests] * len(token_lists))

    def _length_problem(self, candidate: _Candidate) -> tuple[str, str] | None:
        """`prompt_too_long` when a prompt (a chat: its contents together; a score row: a
        pair) has more characters than `limits.max_prompt_chars`, before any tokenizing."""
        limit = self.limits.max_prompt_chars
        longest = max(self.task.prompt_chars(self, candidate), default=0)
        if longest <= limit:
            return None
        return "prompt_too_long", (
            f"{longest} characters, more than limits.max_prompt_chars={limit} (checked before "
            "tokenizing); shorten the input or raise the pipeline's limits.max_prompt_chars"
        )

    def text_chars(self, candidate: _Candidate) -> list[int]:
        """Characters of each text prompt of the row (a score row: of each pair)."""
        if candidate.pairs is not None:
            return [
                len(q) + len(d)
                for q, d in zip(candidate.pairs.queries, candidate.pairs.documents, strict=True)
            ]
        return [len(p) for p in candidate.prompts if isinstance(p, str)]

    def chat_chars(self, candidate: _Candidate) -> list[int]:
        """A chat's message contents together."""
        return [_chat_chars(candidate.prompts[0])]

    def _request(self, params: Any, adapter: Any = None) -> RowRequest:
        """The row's request from its parameters and its adapter column's value."""
        if params is None and self.requests is None:
            return RowRequest()
        if self.requests is None:
            self.requests = RequestBuilder(task=self.task.name, defaults={}, limits=self.limits)
        try:
            values = parse_params_value(params)
        except RecursionError:
            values = None
        if values is None or json_depth_exceeds(values, self.limits.max_json_depth):
            raise ParameterError(
                "too_deep",
                "params",
                f"the parameters nest deeper than limits.max_json_depth="
                f"{self.limits.max_json_depth} levels",
            )
        return self.requests.build(values, adapter=adapter)

    def _check_row(
        self, source: str, row: int, row_id: str | None, payload: Any
    ) -> RowError | None:
        where = f"{source} row {row}"
        if not self.task.checks_empty_text:
            return None  # checked later (a chat's template, a score row's pairs)
        if payload is None or (isinstance(payload, (str, list)) and not _has_content(payload)):
            return RowError.quarantined(
                row_id,
                source,
                row,
                "empty_input",
                f"{where} (id {row_id}): the text is null or empty",
            )
        return None

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
    ) -> tuple[_Candidate | None, tuple[str, str]]:
        """The row's prompts, or (error type, message) when its input has the wrong shape:
        a string; token ids when `token_ids`; a list of either when `lists`."""
        if isinstance(payload, str):
            return _Candidate(row, row_id, request, [payload]), ("", "")
        if token_ids and _is_token_ids(payload):
            return self._checked_tokens(row, row_id, request, [payload])
        if lists and isinstance(payload, list):
            if all(isinstance(p, str) for p in payload):
                if not all(p.strip() for p in payload):
                    return None, ("empty_input", "an input of the list is empty")
                return _Candidate(row, row_id, request, list(payload)), ("", "")
            if all(_is_token_ids(p) for p in payload):
                return self._checked_tokens(row, row_id, request, list(payload))
        return None, ("wrong_type", f"expected {expected}, got {_describe(payload)}")

    def whole_candidate(
        self, row: int, row_id: str, payload: Any, request: RowRequest
    ) -> _Candidate:
        """The payload as the row's one prompt, checked later (a chat's messages)."""
        return _Candidate(row, row_id, request, [payload])

    def pairs_candidate(
        self, row: int, row_id: str, request: RowRequest, pairs: ScorePairs
    ) -> _Candidate:
        """A score row: its (query, document) pairs."""
        return _Candidate(row, row_id, request, [], pairs=pairs)

    def _checked_tokens(
        self, row: int, row_id: str, request: RowRequest, prompts: list[list[int]]
    ) -> tuple[_Candidate | None, tuple[str, str]]:
        vocab = len(self.tokenizer)
        for prompt in prompts:
            bad = [t for t in prompt if t < 0 or t >= vocab]
            if bad:
                return None, (
                    "wrong_type",
                    f"token ids {bad[:5]} are outside the model's vocabulary (0..{vocab - 1})",
                )
        return _Candidate(row, row_id, request, [list(p) for p in prompts]), ("", "")

    def render_chats(
        self, source: str, candidates: list[_Candidate], errors: list[RowError]
    ) -> list[_Candidate]:
        """Chat rows through the model's chat template; the rows that render."""
        kept: list[_Candidate] = []
        for candidate in candidates:
            messages, problem = parse_messages(candidate.prompts[0])
            if problem is None:
                try:
                    candidate.prompts = [
                        self.tokenizer.apply_chat_template(
                            messages, tokenize=False, add_generation_prompt=True
                        )
                    ]
                    kept.append(candidate)
                    continue
                except Exception as exc:  # the template rejected it; quarantine the row
                    problem = f"the model's chat template rejected it ({exc})"
            errors.append(
                RowError.quarantined(
                    candidate.row_id,
                    source,
                    candidate.row,
                    "invalid_messages",
                    f"{source} row {candidate.row} (id {candidate.row_id}): messages are not a "
                    f"valid chat: {problem}",
                )
            )
        return kept

    def tokenize_pairs_rowwise(
        self, source: str, candidates: list[_Candidate], out: ValidChunk
    ) -> None:
        """Score rows: the pairs of the chunk in one batch; when a pair breaks it, each row
        alone, the bad one out."""
        try:
            self._tokenize_pairs(source, candidates, out)
        except Exception:
            for candidate in candidates:
                try:
                    self._tokenize_pairs(source, [candidate], out)
                except Exception as exc:
                    out.errors.append(
                        unexpected_row_error(source, candidate.row, candidate.row_id, exc)
                    )

    def _tokenize_pairs(self, source: str, candidates: list[_Candidate], out: ValidChunk) -> None:
        """Score rows: count each pair's tokens as the cross-encoder will see them."""
        queries = [q for c in candidates for q in c.pairs.queries]  # type: ignore[union-attr]
        documents = [d for c in candidates for d in c.pairs.documents]  # type: ignore[union-attr]
        lengths = iter(len(ids) for ids in self.tokenizer(queries, documents)["input_ids"])
        for candidate in candidates:
            assert candidate.pairs is not None
            counts = [next(lengths) for _ in candidate.pairs.queries]
            if max(counts) > self.max_prompt_tokens:
                out.errors.append(
                    RowError.quarantined(
                        candidate.row_id,
                        source,
                        candidate.row,
                        "prompt_too_long",
                        f"{source} row {candidate.row} (id {candidate.row_id}): a pair of "
                        f"{max(counts)} tokens, more than the {self.max_prompt_tokens} this "
                        f"engine takes (max_model_len={self.max_model_len})",
                        prompt_tokens=max(counts),
                    )
                )
                continue
            out.rows.append(candidate.row)
            out.ids.append(candidate.row_id)
            out.requests.append(candidate.request)
            out.pairs.append(candidate.pairs)
            out.pair_tokens.append(sum(counts))
            out.spans.append(len(counts))

    def _tokenize(self, prompts: list[str]) -> list[list[int]]:
        if not prompts:
            return []
        # Chat templates already hold the special tokens, so add none (as vLLM's chat does).
        add_special = self.task.add_special_tokens
        backend = fast_backend(self.tokenizer)
        if backend is not None:
            return [e.ids for e in backend.encode_batch(prompts, add_special_tokens=add_special)]
        encoded = self.tokenizer(prompts, add_special_tokens=add_special)
        return [list(ids) for ids in encoded["input_ids"]]


def fast_backend(tokenizer: Any) -> Any:
    """The `tokenizers.Tokenizer` behind a Hugging Face fast tokenizer when calling it
    directly gives what `tokenizer(prompts)["input_ids"]` gives (no truncation or padding
    set on it), else None.

    `PreTrainedTokenizerFast.__call__` runs that same `encode_batch` and then builds a
    Python dict per row (attention mask, token type ids, offsets): 338 of the 390 ms that
    2,048 short prompts took (cProfile of `RowValidator.validate`, the tiny Llama's
    tokenizer), in the prepare thread that shares the CPU with the engine and, at a chunk's
    start, is what the engine waits for. The ids are the same (tests/test_validate.py
    checks them on random text)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not hasattr(backend, "encode_batch"):
        return None
    if getattr(backend, "truncation", None) is not None:
        return None
    if getattr(backend, "padding", None) is not None:
        return None
    return backend


def id_error(source: str, row: int, row_id: str | None, seen_ids: set[str]) -> RowError | None:
    """The reason a row's id cannot be used (missing, or taken earlier in the shard), or None."""
    where = f"{source} row {row}"
    if row_id is None or row_id == "":
        return RowError.quarantined(
            None,
            source,
            row,
            "missing_id",
            f"{where}: the id is null or empty; every row needs an id",
        )
    if row_id in seen_ids:
        return RowError(
            row_id,
            source,
            row,
            "duplicate_id",
            f"{where}: id {row_id!r} already appeared earlier in this shard; the first "
            "row was kept and this one quarantined",
        )
    return None


def screen_ids(chunk: RawChunk, seen_ids: set[str]) -> RawChunk:
    """The chunk with rows whose id is missing or already taken in the shard moved to its
    errors; `seen_ids` (the shard's ids so far) gains this chunk's ids. Chunks must be
    screened in shard order, so that the first occurrence of an id is the one kept."""
    for error in chunk.errors:
        if error.id is not None:
            seen_ids.add(error.id)
    rows = []
    errors = list(chunk.errors)
    for row, row_id, payload in chunk.rows:
        error = id_error(chunk.source, row, row_id, seen_ids)
        if error is not None:
            errors.append(error)
            continue
        assert row_id is not None
        seen_ids.add(row_id)
        rows.append((row, row_id, payload))
    return RawChunk(
        index=chunk.index,
        source=chunk.source,
        rows=rows,
        errors=errors,
        rows_in=chunk.rows_in,
        params=chunk.params,
        adapters=chunk.adapters,
        shard_uri=chunk.shard_uri,
        digests=chunk.digests,
        digest_columns=chunk.digest_columns,
    )


def unexpected_row_error(source: str, row: int, row_id: str | None, exc: BaseException) -> RowError:
    """A row that broke a check in a way no rule foresaw: quarantined, with what broke."""
    return RowError.quarantined(
        row_id,
        source,
        row,
        "unprocessable_row",
        f"{source} row {row} (id {row_id}): could not be processed ({type(exc).__name__}: "
        f"{cap_message(str(exc), 300)})",
    )


def _chat_chars(value: Any) -> int:
    """Characters of a chat's message contents (a messages value or its JSON text)."""
    if isinstance(value, str):
        return len(value)
    if not isinstance(value, list):
        return 0
    total = 0
    for message in value:
        if isinstance(message, dict) and isinstance(message.get("content"), str):
            total += len(message["content"])
    return total


def _has_content(payload: str | list[Any]) -> bool:
    if isinstance(payload, str):
        return bool(payload.strip())
    return bool(payload)


def _is_token_ids(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    )


def _describe(value: Any) -> str:
    if isinstance(value, list):
        kinds = sorted({type(v).__name__ for v in value})
        return f"a list of {', '.join(kinds) or 'nothing'}"
    return type(value).__name__


def parse_messages(value: Any) -> tuple[list[dict[str, Any]], str | None]:
    """Check an OpenAI-style `messages` value (a list or its JSON text).

    Returns:
        The messages and None, or an empty list and what is wrong with them.
    """
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return [], "not valid JSON"
        if lone_surrogate_in(value):
            return [], "the JSON escapes half of a UTF-16 surrogate pair, which is not Unicode text"
    if not isinstance(value, list) or not value:
        return [], "expected a non-empty list of {role, content} objects"
    messages: list[dict[str, Any]] = []
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            return [], f"message {i} is not an object"
        role, content = message.get("role"), message.get("content")
        if role not in CHAT_ROLES:
            return [], f"message {i} has role {role!r}; expected one of {sorted(CHAT_ROLES)}"
        if not isinstance(content, str):
            return [], f"message {i} content must be a string, got {type(content).__name__}"
        messages.append({"role": role, "content": content})
    return messages, None
