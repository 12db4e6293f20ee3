"""The image tasks' own steps: which rows carry images, decoding them ahead of the engine,
and the prompts that carry them to vLLM.

- `image_embed` (a CLIP/SigLIP-style dual encoder on vLLM's pooling runner): a row whose
  image (`input.image_column`) is set embeds the image; a row whose image is null embeds its
  text (`input.text_column`); both land in the model's one embedding space. A row with both
  is refused (these models embed one or the other per request: split it into two rows).
- `vision_generate` (a vision-language model on the generate runner): each row's image (or
  list of images) and its prompt text; sampled like `generate`.
- `vision_chat`: OpenAI chat messages whose `content` parts carry `image_url`s; the parts
  become the template's image placeholders, the URLs are read under the same URL policy.

They are entries of the task table (`worker/tasks/table.py`: `ImageEmbedTask`,
`VisionGenerateTask`, `VisionChatTask`); the validator calls `image_candidate` for each row,
then `admit_image_rows` for the chunk: the chunk's images are read and decoded together in
the decoder's pool, in the worker's read-ahead thread, and a row whose image fails gets its
own quarantine record (`worker/tasks/images.py` names each fate). `vllm_prompt` builds the request
the engine takes: token ids plus `multi_modal_data`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

from dagster_gpuinfer.worker.errors import RowError
from dagster_gpuinfer.worker.tasks.images import ImageFault, chat_image_parts
from dagster_gpuinfer.worker.tasks.params import RowRequest
from dagster_gpuinfer.worker.tasks.stages import CandidateOrProblem, RowValidation

if TYPE_CHECKING:  # the rooms above: types only (`stages`)
    from dagster_gpuinfer.worker.rows.validate import ValidChunk
    from dagster_gpuinfer.worker.rows.validate import _Candidate as Candidate

# A task's reading of a row's payload: (prompt text, image references, problem).
PayloadReader = Callable[[Any], "tuple[str | None, list[Any], tuple[str, str]]"]


def image_candidate(
    validator: RowValidation,
    read_payload: PayloadReader,
    row: int,
    row_id: str,
    payload: Any,
    request: RowRequest,
) -> CandidateOrProblem:
    """The row as a candidate (its prompt text and image references, from the task's
    `read_payload`), or (None, (error type, message))."""
    prompt, refs, problem = read_payload(payload)
    if prompt is None:
        return None, problem
    return validator.image_row_candidate(row, row_id, request, prompt, refs), ("", "")


def embed_payload(payload: Any) -> tuple[str | None, list[Any], tuple[str, str]]:
    """image_embed: `(image, text)`; an image row (prompt "") or a text row, not both."""
    image, text = payload if isinstance(payload, tuple) else (payload, None)
    refs = _refs(image)
    has_text = isinstance(text, str) and bool(text.strip())
    if refs and has_text:
        return (
            None,
            [],
            (
                "image_and_text",
                "the row has both an image and a text; an image-embedding model embeds one "
                "per request: put the text in a row of its own",
            ),
        )
    if refs:
        return "", refs, ("", "")
    if has_text:
        return text, [], ("", "")
    if text is not None and not isinstance(text, str):
        return None, [], ("wrong_type", f"the text is a {type(text).__name__}")
    return None, [], ("no_image", "the row has neither an image nor a text")


def vision_payload(payload: Any) -> tuple[str | None, list[Any], tuple[str, str]]:
    """vision_generate: `(image or images, prompt)`; the image is required."""
    image, text = payload if isinstance(payload, tuple) else (payload, None)
    refs = _refs(image)
    if not refs:
        return None, [], ("no_image", "the row has no image (null or empty)")
    if text is not None and not isinstance(text, str):
        return None, [], ("wrong_type", f"the prompt is a {type(text).__name__}, not a string")
    return text or "", refs, ("", "")


def _refs(image: Any) -> list[Any]:
    """The image references of a row's image value (one, a list, or none)."""
    if image is None:
        return []
    if isinstance(image, list | tuple):
        return [ref for ref in image if ref is not None]
    if isinstance(image, str | bytes | bytearray) and len(image) == 0:
        return []
    return [image]


def chat_payload(payload: Any) -> tuple[str | None, list[Any], tuple[str, str]]:
    """vision_chat: the messages (their JSON, image parts as placeholders) and their URLs."""
    if isinstance(payload, str):
        try:
            payload = json.loads(payload)
        except ValueError:
            return None, [], ("invalid_messages", "messages are not valid JSON")
    if not isinstance(payload, list) or not payload:
        return None, [], ("invalid_messages", "expected a non-empty list of messages")
    try:
        messages, urls = chat_image_parts(payload)
    except ImageFault as fault:
        return None, [], (fault.error_type, fault.message)
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        parts_ok = isinstance(content, list) and all(
            isinstance(p, dict)
            and (
                p.get("type") == "image"
                or (p.get("type") == "text" and isinstance(p.get("text"), str))
            )
            for p in content
        )
        if not isinstance(message, dict) or not (isinstance(content, str) or parts_ok):
            return (
                None,
                [],
                (
                    "invalid_messages",
                    f"message {i}: content must be a string or a list of text / image_url parts",
                ),
            )
    return json.dumps(messages), urls, ("", "")


def admit_image_rows(
    validator: RowValidation,
    source: str,
    candidates: list[Candidate],
    out: ValidChunk,
    *,
    render: bool = False,
) -> None:
    """Read and decode every candidate's images together (in the validator's pool; the
    rows whose images fail are quarantined, each with its own fate), render vision_chat
    rows through the chat template, then tokenize and admit the rest into `out` (each
    prompt beside its images)."""
    with_images = [(c, c.images) for c in candidates if c.images]
    out.image_count += sum(len(images) for _, images in with_images)
    loaded = validator.image_decoder().load_groups(
        [images for _, images in with_images], validator.shard_uri
    )
    failed: set[int] = set()
    for (candidate, _), result in zip(with_images, loaded, strict=True):
        if isinstance(result, ImageFault):
            failed.add(id(candidate))
            out.errors.append(_row_error(source, candidate, result.error_type, result.message))
            continue
        out.image_bytes += sum(image.encoded_bytes for image in result)
        candidate.images = [image.image for image in result]
        candidate.image_digests = [image.digest for image in result]
    kept = [c for c in candidates if id(c) not in failed]
    if render:  # vision_chat: the messages through the chat template
        rendered = []
        for candidate in kept:
            try:
                messages_json = cast(str, candidate.prompts[0])  # a chat row's JSON text
                candidate.prompts = [render_chat(validator.tokenizer, messages_json)]
                rendered.append(candidate)
            except Exception as exc:  # the template rejected it; quarantine the row
                problem = f"the model's chat template rejected it ({exc})"
                out.errors.append(_row_error(source, candidate, "invalid_messages", problem))
        kept = rendered
    validator.tokenize_candidates(source, kept, out)


def _row_error(source: str, candidate: Candidate, error_type: str, message: str) -> RowError:
    return RowError.quarantined(
        candidate.row_id,
        source,
        candidate.row,
        error_type,
        f"{source} row {candidate.row} (id {candidate.row_id}): {message}",
    )


def render_chat(tokenizer: Any, messages_json: str) -> str:
    """A vision_chat row's messages through the model's chat template (image parts are
    `{"type": "image"}` placeholders the template renders)."""
    return tokenizer.apply_chat_template(
        json.loads(messages_json), tokenize=False, add_generation_prompt=True
    )


def vllm_prompt(token_ids: list[int], images: list[Any] | None) -> dict[str, Any]:
    """The prompt vLLM's engine takes: token ids, plus the decoded images when there are."""
    prompt: dict[str, Any] = {"prompt_token_ids": token_ids}
    if images:
        prompt["multi_modal_data"] = {"image": images[0] if len(images) == 1 else images}
    return prompt
