"""Row validation: every parsed row is either tokenized for the engine or quarantined.

Tokenizing here, once, with the engine's own tokenizer serves two ends: prompts longer than
the engine can take are quarantined (with their token count) instead of failing the whole
batch inside vLLM, and the engine receives token ids (`TokensPrompt`) so it does not
tokenize a second time.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from dagster_gpuinfer.worker.errors import RowError
from dagster_gpuinfer.worker.readers import RawChunk

CHAT_ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})


@dataclass
class ValidChunk:
    """The rows of a chunk that go to the engine, and the ones quarantined."""

    index: int
    rows: list[int] = field(default_factory=list)
    ids: list[str] = field(default_factory=list)
    token_ids: list[list[int]] = field(default_factory=list)
    errors: list[RowError] = field(default_factory=list)
    # Per-row vLLM params (`SamplingParams` / `PoolingParams`), in step with `ids`; empty:
    # every row takes the spec's.
    params: list[Any] = field(default_factory=list)


class RowValidator:
    """Validates and tokenizes the rows of a shard, chunk by chunk.

    Args:
        task: embed, generate or chat.
        tokenizer: the engine's (Hugging Face) tokenizer.
        max_model_len: the engine's context length.
        seen_ids: ids already taken in this shard (from committed chunks on resume); the
            first occurrence of an id wins, later ones are quarantined.
        check_ids: False when the chunks were already screened by `screen_ids` (the
            streaming worker screens ids where the shard is read, in shard order, so that
            engines serving chunks of one shard in any order agree on the first occurrence).
    """

    def __init__(
        self,
        *,
        task: str,
        tokenizer: Any,
        max_model_len: int,
        seen_ids: set[str] | None = None,
        check_ids: bool = True,
    ) -> None:
        self.task = task
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.seen_ids: set[str] = seen_ids if seen_ids is not None else set()
        self.check_ids = check_ids
        # Generation needs room for at least one new token.
        self.max_prompt_tokens = max_model_len if task == "embed" else max_model_len - 1

    def validate(self, chunk: RawChunk) -> ValidChunk:
        out = ValidChunk(index=chunk.index, errors=list(chunk.errors))
        if self.check_ids:
            for error in chunk.errors:
                if error.id is not None:
                    self.seen_ids.add(error.id)
        candidates: list[tuple[int, str, Any]] = []
        for row, row_id, payload in chunk.rows:
            error = self._check_row(chunk.source, row, row_id, payload)
            if error is not None:
                out.errors.append(error)
                continue
            assert row_id is not None
            if self.check_ids:
                self.seen_ids.add(row_id)
            candidates.append((row, row_id, payload))
        if not candidates:
            return out
        prompts, render_errors = self._render(chunk.source, candidates)
        out.errors.extend(render_errors)
        kept = [c for c in candidates if c[0] in prompts]
        token_lists = self._tokenize([prompts[row] for row, _, _ in kept])
        for (row, row_id, _), token_ids in zip(kept, token_lists, strict=True):
            if len(token_ids) > self.max_prompt_tokens:
                out.errors.append(
                    RowError(
                        row_id,
                        chunk.source,
                        row,
                        "prompt_too_long",
                        f"{chunk.source} row {row} (id {row_id}): {len(token_ids)} prompt "
                        f"tokens, more than the {self.max_prompt_tokens} this engine takes "
                        f"(max_model_len={self.max_model_len}); shorten the input or raise "
                        "engine.max_model_len; the row was quarantined",
                        prompt_tokens=len(token_ids),
                    )
                )
                continue
            out.rows.append(row)
            out.ids.append(row_id)
            out.token_ids.append(token_ids)
        return out

    def _check_row(
        self, source: str, row: int, row_id: str | None, payload: Any
    ) -> RowError | None:
        where = f"{source} row {row}"
        if self.check_ids:
            error = id_error(source, row, row_id, self.seen_ids)
            if error is not None:
                return error
        if self.task == "chat":
            return None  # checked while rendering the chat template
        if payload is None or (isinstance(payload, str) and not payload.strip()):
            return RowError(
                row_id,
                source,
                row,
                "empty_input",
                f"{where} (id {row_id}): the text is null or empty; the row was quarantined",
            )
        if not isinstance(payload, str):
            return RowError(
                row_id,
                source,
                row,
                "wrong_type",
                f"{where} (id {row_id}): expected a string, got {type(payload).__name__}; the "
                "row was quarantined",
            )
        return None

    def _render(
        self, source: str, candidates: list[tuple[int, str, Any]]
    ) -> tuple[dict[int, str], list[RowError]]:
        """The prompt text of each row; chat rows go through the model's chat template."""
        if self.task != "chat":
            return {row: payload for row, _, payload in candidates}, []
        prompts: dict[int, str] = {}
        errors: list[RowError] = []
        for row, row_id, payload in candidates:
            messages, problem = parse_messages(payload)
            if problem is None:
                try:
                    prompts[row] = self.tokenizer.apply_chat_template(
                        messages, tokenize=False, add_generation_prompt=True
                    )
                    continue
                except Exception as exc:  # the template rejected it; quarantine the row
                    problem = f"the model's chat template rejected it ({exc})"
            errors.append(
                RowError(
                    row_id,
                    source,
                    row,
                    "invalid_messages",
                    f"{source} row {row} (id {row_id}): messages are not a valid chat: "
                    f"{problem}; the row was quarantined",
                )
            )
        return prompts, errors

    def _tokenize(self, prompts: list[str]) -> list[list[int]]:
        if not prompts:
            return []
        # Chat templates already hold the special tokens, so add none (as vLLM's chat does).
        add_special = self.task != "chat"
        encoded = self.tokenizer(prompts, add_special_tokens=add_special)
        return [list(ids) for ids in encoded["input_ids"]]


def id_error(source: str, row: int, row_id: str | None, seen_ids: set[str]) -> RowError | None:
    """The reason a row's id cannot be used (missing, or taken earlier in the shard), or None."""
    where = f"{source} row {row}"
    if row_id is None or row_id == "":
        return RowError(
            None,
            source,
            row,
            "missing_id",
            f"{where}: the id is null or empty; every row needs an id; the row was quarantined",
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
        index=chunk.index, source=chunk.source, rows=rows, errors=errors, rows_in=chunk.rows_in
    )


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
