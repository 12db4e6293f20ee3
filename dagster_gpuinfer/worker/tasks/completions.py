"""A vLLM `RequestOutput` as the row's choices: text, finish reason, tokens, logprobs.

One output row holds every choice of its request (`n > 1` gives `n`). Logprobs are kept in
one shape, OpenAI's chat shape (`[{token, logprob, bytes, top_logprobs: [...]}]` per
generated token), from which the OpenAI Batch writer also derives the completions shape.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa

TOP_LOGPROB_TYPE = pa.struct(
    [
        pa.field("token", pa.string()),
        pa.field("logprob", pa.float64()),
        pa.field("bytes", pa.list_(pa.int32())),
    ]
)
TOKEN_LOGPROB_TYPE = pa.struct(
    [
        pa.field("token", pa.string()),
        pa.field("logprob", pa.float64()),
        pa.field("bytes", pa.list_(pa.int32())),
        pa.field("top_logprobs", pa.list_(TOP_LOGPROB_TYPE)),
    ]
)
CHOICE_TYPE = pa.struct(
    [
        pa.field("index", pa.int32()),
        pa.field("text", pa.string()),
        pa.field("finish_reason", pa.string()),
        pa.field("generated_tokens", pa.int32()),
        pa.field("logprobs", pa.list_(TOKEN_LOGPROB_TYPE)),
        pa.field("output_valid", pa.bool_()),
        pa.field("output_error", pa.string()),
    ]
)


def choices_of(output: Any, top_logprobs: int | None) -> list[dict[str, Any]]:
    """The choices of one `vllm.RequestOutput`, in index order, as plain records."""
    choices = []
    for index, completion in enumerate(sorted(output.outputs, key=lambda c: c.index)):
        logprobs = None
        if top_logprobs is not None and completion.logprobs is not None:
            logprobs = [
                _token_logprob(token_id, position, top_logprobs)
                for token_id, position in zip(
                    completion.token_ids, completion.logprobs, strict=False
                )
            ]
        choices.append(
            {
                "index": index,
                "text": completion.text,
                "finish_reason": completion.finish_reason,
                "generated_tokens": len(completion.token_ids),
                "logprobs": logprobs,
                "output_valid": None,
                "output_error": None,
            }
        )
    return choices


def _token_logprob(token_id: int, position: dict[int, Any], top: int) -> dict[str, Any]:
    """One generated token in OpenAI's shape; `top_logprobs` holds the `top` most likely."""
    chosen = position[token_id]
    ranked = sorted(position.items(), key=lambda item: item[1].rank or 0)
    alternatives = [
        _entry(logprob) for _, logprob in ranked if logprob.rank is not None and logprob.rank <= top
    ]
    return {**_entry(chosen), "top_logprobs": alternatives[:top]}


def _entry(logprob: Any) -> dict[str, Any]:
    token = logprob.decoded_token or ""
    return {"token": token, "logprob": float(logprob.logprob), "bytes": list(token.encode())}


def completion_logprobs(logprobs: list[dict[str, Any]]) -> dict[str, Any]:
    """Chat-shaped logprobs in the legacy completions shape (`tokens`, `token_logprobs`,
    `top_logprobs` as token -> logprob maps, `text_offset`)."""
    offsets, offset = [], 0
    for item in logprobs:
        offsets.append(offset)
        offset += len(item["token"])
    return {
        "tokens": [item["token"] for item in logprobs],
        "token_logprobs": [item["logprob"] for item in logprobs],
        "top_logprobs": [
            {alt["token"]: alt["logprob"] for alt in item["top_logprobs"]} for item in logprobs
        ],
        "text_offset": offsets,
    }
