"""Row validation with the real tokenizers of the test models (no engine needed)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from dagster_gpuinfer.worker.rows.readers import RawChunk
from dagster_gpuinfer.worker.rows.validate import RowValidator, fast_backend, parse_messages


@pytest.fixture(scope="module")
def chat_tokenizer(tiny_llama_dir):
    return AutoTokenizer.from_pretrained(tiny_llama_dir)


@pytest.fixture(scope="module")
def tokenizers(chat_tokenizer, minilm_dir):
    return [chat_tokenizer, AutoTokenizer.from_pretrained(minilm_dir)]


def chunk(rows, index=0):
    return RawChunk(index=index, source="s.jsonl", rows=rows, rows_in=len(rows))


def test_bad_rows_are_quarantined_with_their_reason(chat_tokenizer):
    validator = RowValidator(task="generate", tokenizer=chat_tokenizer, max_model_len=16)
    out = screened_and_validated(
        validator,
        chunk(
            [
                (0, "a", "a fine prompt"),
                (1, "b", ""),
                (2, "c", None),
                (3, "a", "same id again"),
                (4, None, "no id"),
                (5, "d", "word " * 40),
                (6, "e", 42),
            ]
        ),
    )
    assert out.ids == ["a"]
    reasons = {e.row: e.error_type for e in out.errors}
    assert reasons == {
        1: "empty_input",
        2: "empty_input",
        3: "duplicate_id",
        4: "missing_id",
        5: "prompt_too_long",
        6: "wrong_type",
    }
    too_long = next(e for e in out.errors if e.row == 5)
    assert too_long.prompt_tokens and too_long.prompt_tokens > 16
    assert "max_model_len=16" in too_long.message


def screened_and_validated(validator, raw, seen=None):
    """A chunk as the worker takes it: ids screened in shard order, then validated."""
    from dagster_gpuinfer.worker.rows.validate import screen_ids

    return validator.validate(screen_ids(raw, set() if seen is None else seen))


def test_duplicate_ids_are_caught_across_chunks_and_from_resumed_state(chat_tokenizer):
    validator = RowValidator(task="generate", tokenizer=chat_tokenizer, max_model_len=64)
    seen = {"old"}  # committed before a resume
    first = screened_and_validated(validator, chunk([(0, "x", "one"), (1, "old", "two")]), seen)
    second = screened_and_validated(validator, chunk([(2, "x", "three")], index=1), seen)
    assert first.ids == ["x"] and [e.error_type for e in first.errors] == ["duplicate_id"]
    assert second.ids == [] and second.errors[0].error_type == "duplicate_id"


def test_tokens_match_the_tokenizer_with_special_tokens(chat_tokenizer):
    validator = RowValidator(task="generate", tokenizer=chat_tokenizer, max_model_len=64)
    out = validator.validate(chunk([(0, "a", "hello world")]))
    assert out.token_ids == [chat_tokenizer("hello world")["input_ids"]]


def test_chat_rows_render_the_model_template(chat_tokenizer):
    validator = RowValidator(task="chat", tokenizer=chat_tokenizer, max_model_len=64)
    messages = [{"role": "user", "content": "hi there"}]
    out = validator.validate(
        chunk([(0, "a", messages), (1, "b", '[{"role": "user", "content": "x"}]')])
    )
    rendered = chat_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert out.ids == ["a", "b"]
    assert out.token_ids[0] == chat_tokenizer(rendered, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize(
    "value, problem",
    [
        ("not json", "not valid JSON"),
        ([], "non-empty list"),
        ([{"role": "wizard", "content": "x"}], "role 'wizard'"),
        ([{"role": "user", "content": 3}], "content must be a string"),
        (["hi"], "not an object"),
    ],
)
def test_invalid_messages_are_named(value, problem):
    messages, found = parse_messages(value)
    assert messages == [] and problem in found


def test_invalid_chat_rows_are_quarantined(chat_tokenizer):
    validator = RowValidator(task="chat", tokenizer=chat_tokenizer, max_model_len=64)
    out = validator.validate(chunk([(0, "a", [{"role": "wizard", "content": "x"}])]))
    assert out.ids == [] and out.errors[0].error_type == "invalid_messages"


def test_ids_screened_in_shard_order_keep_the_first_occurrence_across_chunks(chat_tokenizer):
    # The streaming worker screens ids where the shard is read, in shard order; engines then
    # validate chunks in any order without tracking ids, and still agree on which row wins.
    from dagster_gpuinfer.worker.rows.validate import screen_ids

    seen: set[str] = set()
    first = screen_ids(chunk([(0, "a", "x"), (1, "b", "y"), (2, "a", "again")]), seen)
    second = screen_ids(chunk([(3, "b", "later"), (4, None, "no id"), (5, "c", "z")], 1), seen)
    assert [r[1] for r in first.rows] == ["a", "b"] and [r[1] for r in second.rows] == ["c"]
    assert [(e.row, e.error_type) for e in first.errors] == [(2, "duplicate_id")]
    assert [(e.row, e.error_type) for e in second.errors] == [
        (3, "duplicate_id"),
        (4, "missing_id"),
    ]
    assert (first.rows_in, second.rows_in) == (3, 3)
    engine_side = RowValidator(task="generate", tokenizer=chat_tokenizer, max_model_len=16)
    validated = [engine_side.validate(c) for c in (second, first)]  # any order
    assert [v.ids for v in validated] == [["c"], ["a", "b"]]


@given(st.lists(st.text(max_size=60), min_size=1, max_size=8), st.booleans())
@settings(max_examples=150, deadline=None)
def test_prompts_tokenize_to_the_ids_the_tokenizer_call_gives(tokenizers, prompts, special):
    """The prepare thread calls a fast tokenizer's backend directly (`fast_backend`); the
    ids are those of `tokenizer(prompts)`, for each test model's tokenizer. (The tiny
    Llama's tokenizer.json sets truncation: its first call goes through the tokenizer,
    which turns that off, as every such call does; later ones use the backend.)"""
    for tokenizer in tokenizers:
        task = "generate" if special else "chat"  # chat prompts get no special tokens
        validator = RowValidator(task=task, tokenizer=tokenizer, max_model_len=64)
        first = validator._tokenize(prompts)
        assert fast_backend(tokenizer) is not None
        expected = [
            list(ids) for ids in tokenizer(prompts, add_special_tokens=special)["input_ids"]
        ]
        assert first == expected
        assert validator._tokenize(prompts) == expected


def test_a_tokenizer_with_truncation_set_is_called_as_before(chat_tokenizer):
    backend = chat_tokenizer.backend_tokenizer
    backend.enable_truncation(max_length=3)
    try:
        assert fast_backend(chat_tokenizer) is None
        validator = RowValidator(task="generate", tokenizer=chat_tokenizer, max_model_len=64)
        ids = validator._tokenize(["a river runs through the old stone town"])
        assert ids == [chat_tokenizer("a river runs through the old stone town")["input_ids"]]
    finally:
        backend.no_truncation()
