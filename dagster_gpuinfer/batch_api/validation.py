"""Checks a batch input file before anything is queued, as OpenAI does in `validating`.

A file that fails becomes a `failed` batch whose `errors.data` names each bad line
(`{code, line, message, param}`, lines counted from 1). A file that passes goes to the
worker, which keeps its row-level contract for whatever a line's body holds.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from dagster_gpuinfer.batch_api.routing import Route, RoutingTable

# OpenAI's limits: 50,000 requests and 200 MB per batch input file.
DEFAULT_MAX_REQUESTS = 50_000
DEFAULT_MAX_BYTES = 200 * 1024 * 1024
# errors.data is for a person to read: the first ones tell what to fix.
MAX_REPORTED_ERRORS = 100


@dataclass
class ValidatedInput:
    """The outcome: the route and line count when `errors` is empty."""

    total: int = 0
    model: str | None = None
    route: Route | None = None
    errors: list[dict[str, Any]] = field(default_factory=list)

    def error(self, code: str, message: str, *, line: int | None = None, param: str | None = None):
        if len(self.errors) < MAX_REPORTED_ERRORS:
            self.errors.append({"code": code, "line": line, "message": message, "param": param})


def validate_batch_input(
    lines: Iterable[bytes],
    *,
    size: int,
    endpoint: str,
    routes: RoutingTable,
    max_requests: int = DEFAULT_MAX_REQUESTS,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> ValidatedInput:
    """Check every line of a batch input file against the batch's endpoint and the routes.

    Args:
        lines: The file's lines, as read (`FileBytes.lines` streams them): one at a time is
            all that is held.
        size: The file's size in bytes.

    Checks: the file's size and line count; each line is a JSON object with a non-empty
    string `custom_id` (unique in the file), `method` POST, a `url` equal to the batch's
    `endpoint`, and an object `body` naming a `model` the routing table serves on that
    endpoint; all lines name models of one route (one batch runs on one pipeline): one
    model, or a base model and its LoRA adapters (`Route.lora_adapters`).
    """
    result = ValidatedInput()
    if not routes.models_on(endpoint):
        served = sorted({route.endpoint for route in routes.routes})
        result.error(
            "invalid_endpoint",
            f"endpoint {endpoint!r} is not served here; use one of {served}",
            param="endpoint",
        )
        return result
    if size > max_bytes:
        result.error(
            "file_too_large",
            f"the input file has {size} bytes, more than the limit of {max_bytes}; "
            "split it into several batches",
        )
        return result
    seen: set[str] = set()
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        result.total += 1
        if result.total > max_requests:
            result.error(
                "too_many_requests",
                f"the input file has more than {max_requests} requests (line {number}); "
                "split it into several batches",
                line=number,
            )
            return result
        _check_line(raw, number, endpoint, routes, seen, result)
    if result.total == 0:
        result.error("empty_file", "the input file holds no request lines")
    if not result.errors and result.model is not None:
        result.route = routes.route_for(result.model, endpoint)
        if result.route is not None:  # the batch's model: its route's base model
            result.model = result.route.model
    return result


def _check_line(
    raw: bytes,
    number: int,
    endpoint: str,
    routes: RoutingTable,
    seen: set[str],
    result: ValidatedInput,
) -> None:
    try:
        line = json.loads(raw)
    except ValueError as exc:
        result.error("invalid_json_line", f"line {number} is not valid JSON: {exc}", line=number)
        return
    except RecursionError:
        result.error(
            "invalid_json_line",
            f"line {number} is nested too deeply to parse (thousands of levels of arrays or "
            "objects); flatten that request",
            line=number,
        )
        return
    if not isinstance(line, dict):
        result.error("invalid_json_line", f"line {number} is not a JSON object", line=number)
        return
    custom_id = line.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        result.error(
            "missing_required_parameter",
            f"line {number} has no custom_id (a non-empty string)",
            line=number,
            param="custom_id",
        )
    elif custom_id in seen:
        result.error(
            "duplicate_custom_id",
            f"line {number}: custom_id {custom_id!r} is used by an earlier line; every "
            "request needs its own",
            line=number,
            param="custom_id",
        )
    else:
        seen.add(custom_id)
    if line.get("method", "POST") != "POST":
        result.error(
            "invalid_method", f"line {number}: method must be POST", line=number, param="method"
        )
    if line.get("url") != endpoint:
        result.error(
            "mismatched_endpoint",
            f"line {number}: url {line.get('url')!r} does not match the batch's endpoint "
            f"{endpoint!r}",
            line=number,
            param="url",
        )
    body = line.get("body")
    if not isinstance(body, dict):
        result.error(
            "invalid_request", f"line {number}: body must be an object", line=number, param="body"
        )
        return
    _check_model(body.get("model"), number, endpoint, routes, result)


def _check_model(
    model: Any, number: int, endpoint: str, routes: RoutingTable, result: ValidatedInput
) -> None:
    if not isinstance(model, str) or routes.route_for(model, endpoint) is None:
        result.error(
            "model_not_found",
            f"line {number}: model {model!r} is not served on {endpoint}; models there: "
            f"{routes.models_on(endpoint)}",
            line=number,
            param="body.model",
        )
    elif result.model is None:
        result.model = model
    elif routes.route_for(model, endpoint) != routes.route_for(result.model, endpoint):
        result.error(
            "mismatched_model",
            f"line {number}: model {model!r} differs from {result.model!r} of the first line; "
            "a batch runs on one model (with its LoRA adapters)",
            line=number,
            param="body.model",
        )
