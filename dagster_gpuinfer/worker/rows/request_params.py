"""Per-request parameters: a row's own parameters become that row's vLLM `SamplingParams`.

An OpenAI Batch line's `body` (minus its input field) and the `input.params_column` of a
Parquet/JSONL row go through the same rules:

- A key the platform honours (the task's `request_keys`, `worker.tasks`) overrides the
  pipeline's default (`InferenceSpec.sampling`) for that row only; keys a row leaves out
  keep the default.
- A key it does not honour (`tools`, `stream: true`, a legacy `guided_json`, a typo) quarantines
  the row as `unsupported_parameter`, naming the key: nothing is silently dropped (vLLM issue
  #53975 was a `guided_json` accepted and ignored).
- A value of the wrong type, or one vLLM rejects (`temperature: -1`, `logprobs: 500`, a JSON
  schema the grammar backend cannot compile), quarantines the row as `invalid_parameter`,
  naming the key and vLLM's reason. vLLM's own `SamplingParams` constructor and `verify()`
  against the running engine's configuration decide, so what passes here is what the engine
  accepts.

Before vLLM sees a row's values they are bounded: integers within 64 bits and floats finite
(what msgspec carries to the engine process; past that `add_request` raised `OverflowError`),
`n` and `n` x `top_logprobs` within the pipeline's `limits`, and a structured-output
pattern compilable by the output check's linear-time engine (`structured.pattern_problem`).
Anything else that goes wrong while mapping one row is that row's `invalid_parameter`.

A row names its LoRA adapter by the pipeline's `input.adapter_column`, else by its `model`
parameter (an OpenAI line's `model`); a name that is neither one of the pipeline's adapters
nor the base model's quarantines the row as `unknown_adapter`, naming the known ones
(`AdapterNames`). Without adapters `model` is neutral, as before.

OpenAI names map to vLLM's: `max_completion_tokens` -> `max_tokens`; chat `logprobs: true` +
`top_logprobs: k` -> `logprobs=k`; `response_format` `json_schema` / `json_object` ->
`structured_outputs` json / json_object; `logit_bias` keys (token ids as strings) -> ints.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Any

from dagster_gpuinfer.spec import RowLimits, StructuredOutputs
from dagster_gpuinfer.worker.errors import cap_message
from dagster_gpuinfer.worker.tasks.params import (
    NEUTRAL_KEYS,
    SEED_REFUSED,
    GenerationParams,
    ParameterError,
    ResponseFormat,
    RowRequest,
    typed_params,
)
from dagster_gpuinfer.worker.tasks.structured import pattern_problem
from dagster_gpuinfer.worker.tasks.table import worker_task

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


@dataclass(frozen=True)
class AdapterNames:
    """The names a row may give its adapter: the pipeline's LoRA adapters, or the base
    model (by its served name or its path; None or empty too) for none.

    Args:
        adapters: `InferenceSpec.lora_adapters`' names.
        base: The base model's names (`served_model`, `model`).
        column: `input.adapter_column` (the key named in a row's error), or None: `model`.
    """

    adapters: tuple[str, ...] = ()
    base: tuple[str, ...] = ()
    column: str | None = None

    @classmethod
    def of(cls, spec: Any) -> AdapterNames:
        return cls(
            adapters=tuple(spec.lora_adapters),
            base=tuple(dict.fromkeys((spec.served_model, spec.model))),
            column=spec.input.adapter_column,
        )

    def resolve(self, name: Any) -> str | None:
        """The adapter a row's name means; None: the base model.

        Raises:
            ParameterError: `unknown_adapter` (naming the known ones) or a name that is not
                a string (`invalid_parameter`).
        """
        key = self.column or "model"
        if name is None or name == "" or name in self.base:
            return None
        if not isinstance(name, str):
            raise ParameterError(
                "invalid_parameter",
                key,
                f"{key!r} must name an adapter as a string, got {type(name).__name__}",
            )
        if name in self.adapters:
            return name
        raise ParameterError(
            "unknown_adapter",
            key,
            f"adapter {cap_message(name, 130)!r} ({key!r}) is not served by this pipeline; "
            f"its adapters: {', '.join(sorted(self.adapters))}; or the base model "
            f"{self.base[0]!r} (or none) for no adapter",
        )


class RequestBuilder:
    """Builds each row's `RowRequest` from the pipeline's defaults and the row's params.

    Args:
        task: the pipeline's task.
        defaults: `InferenceSpec.sampling.to_vllm_kwargs()`.
        verify: called with each row's `vllm.SamplingParams` (a copy) to check it against the
            running engine (`SamplingParams.verify`); raises ValueError on a rejected value.
        refuse_seeds: the engine would die on a seeded request (`cpu_seeds.seeds_unsafe`):
            a row's `seed` is its `unsupported_parameter`.
        adapters: the pipeline's LoRA adapters (`AdapterNames.of(spec)`); None or empty:
            every row runs the base model and `model` is neutral.
    """

    def __init__(
        self,
        *,
        task: str,
        defaults: dict[str, Any],
        verify: Any = None,
        limits: RowLimits | None = None,
        refuse_seeds: bool = False,
        adapters: AdapterNames | None = None,
    ) -> None:
        self.task = task
        self.adapters = adapters if adapters is not None and adapters.adapters else None
        self.worker_task = worker_task(task)
        self.defaults = dict(defaults)
        self.verify = verify
        self.limits = limits or RowLimits()
        self.refuse_seeds = refuse_seeds
        default_structured = self.defaults.get("structured_outputs")
        self.default_constraint = (
            StructuredOutputs.model_validate(default_structured) if default_structured else None
        )
        self._default_request: RowRequest | None = None

    def build(self, params: dict[str, Any] | None, *, adapter: Any = None) -> RowRequest:
        """The row's request.

        Args:
            params: The row's parameters (None: none).
            adapter: The row's `input.adapter_column` value, when the pipeline sets one.

        Raises:
            ParameterError: naming the first unsupported key or rejected value, or an
                unknown adapter; whatever else goes wrong mapping the row is its
                `invalid_parameter` too.
        """
        try:
            request = self._build(params)
            if self.adapters is None:
                return request
            named = adapter if self.adapters.column else (params or {}).get("model")
            chosen = self.adapters.resolve(named)
            return dataclasses.replace(request, adapter=chosen) if chosen else request
        except ParameterError:
            raise
        except Exception as exc:  # the row boundary: one row's values never fail the run
            keys = ", ".join(sorted(str(k) for k in (params or {}))[:10]) or "params"
            raise ParameterError(
                "invalid_parameter",
                keys,
                f"the parameters ({keys}) could not be mapped: {type(exc).__name__}: "
                f"{cap_message(str(exc), 300)}",
            ) from None

    def _build(self, params: dict[str, Any] | None) -> RowRequest:
        # A null value is the default (as in OpenAI's API; and a Parquet struct column gives
        # every row every field, null where the row sets none).
        params = {
            k: v for k, v in (params or {}).items() if k not in NEUTRAL_KEYS and v is not None
        }
        allowed = self.worker_task.request_keys
        for key in params:
            if key not in allowed:
                hint = (
                    f"; supported here: {', '.join(sorted(allowed | NEUTRAL_KEYS))}"
                    if allowed
                    else f"; task {self.task!r} takes no per-request parameters"
                )
                raise ParameterError(
                    "unsupported_parameter",
                    key,
                    f"parameter {key!r} is not supported{hint}",
                )
        if self.refuse_seeds and params.get("seed") is not None:
            raise ParameterError(
                "unsupported_parameter", "seed", f"parameter 'seed' is refused here: {SEED_REFUSED}"
            )
        return self.worker_task.request(self, params)

    def generation_request(self, params: dict[str, Any]) -> RowRequest:
        """A generating row's request: the pipeline's sampling defaults, the row's keys over
        them (the default request is built once and shared)."""
        if not params and self._default_request is not None:
            return self._default_request
        for key, value in params.items():
            _check_numbers(key, value)
        request = self._generation_request(typed_params(GenerationParams, params), set(params))
        if not params:
            self._default_request = request
        return request

    def _generation_request(self, typed: GenerationParams, given: set[str]) -> RowRequest:
        kwargs = dict(self.defaults)
        kwargs.pop("structured_outputs", None)
        constraint = self.default_constraint
        overrides = _vllm_overrides(typed)
        kwargs.update(overrides)
        self._check_fan_out(int(kwargs.get("n") or 1), kwargs.get("logprobs"), given)
        if typed.structured_outputs is not None:
            constraint = typed.structured_outputs
        if typed.response_format is not None:
            if "structured_outputs" in given:
                raise ParameterError(
                    "invalid_parameter",
                    "response_format",
                    "set either 'response_format' or 'structured_outputs', not both",
                )
            constraint = _constraint_of(typed.response_format, default=constraint)
        if constraint is not None:
            _check_patterns(constraint, given)
        reuse_params = _reuse_params(kwargs, constraint)
        # vLLM judges the rest (imported only now: the bounds above need no vLLM).
        from vllm import SamplingParams as VllmSamplingParams
        from vllm.exceptions import VLLMError
        from vllm.sampling_params import StructuredOutputsParams

        rejected = (ValueError, TypeError, VLLMError)
        if constraint is not None:
            try:
                kwargs["structured_outputs"] = StructuredOutputsParams(
                    **constraint.to_vllm_kwargs()
                )
            except rejected as exc:
                raise _rejected(exc, given) from None
        try:
            sampling = VllmSamplingParams(**kwargs)
        except rejected as exc:
            raise _rejected(exc, given) from None
        if self.verify is not None:
            try:
                self.verify(_for_verify(sampling))
            except (*rejected, RuntimeError) as exc:
                raise _rejected(exc, given) from None
        logprobs_k = kwargs.get("logprobs")
        return RowRequest(
            sampling=sampling,
            top_logprobs=logprobs_k if logprobs_k is not None else None,
            constraint=constraint,
            reuse_params=reuse_params,
            deterministic=sampling.temperature == 0 or sampling.seed is not None,
        )

    def _check_fan_out(self, n: int, logprobs: int | None, given: set[str]) -> None:
        """`n` and `n` x `top_logprobs` within the pipeline's limits."""
        limits = self.limits
        if n > limits.max_n:
            raise ParameterError(
                "invalid_parameter",
                "n",
                f"parameter 'n' is {n}, more than the {limits.max_n} completions a row may "
                "ask for here (limits.max_n)",
            )
        fan_out = n * (logprobs or 0)
        if fan_out > limits.max_n_logprobs:
            key = "top_logprobs" if "top_logprobs" in given else "logprobs"
            raise ParameterError(
                "invalid_parameter",
                key,
                f"n x {key} is {n} x {logprobs} = {fan_out}, more than the "
                f"{limits.max_n_logprobs} allowed here (limits.max_n_logprobs)",
            )


def _vllm_overrides(typed: GenerationParams) -> dict[str, Any]:
    """A row's generation keys under vLLM's names (structured outputs apart)."""
    overrides = typed.model_dump(
        exclude_none=True, exclude={"response_format", "structured_outputs"}
    )
    overrides.pop("stream", None)
    if "max_completion_tokens" in overrides:
        overrides["max_tokens"] = overrides.pop("max_completion_tokens")
    if "logit_bias" in overrides:
        try:
            overrides["logit_bias"] = {int(k): v for k, v in overrides["logit_bias"].items()}
        except ValueError:
            raise ParameterError(
                "invalid_parameter",
                "logit_bias",
                "parameter 'logit_bias' must map token ids (integers as strings) to biases",
            ) from None
    top_logprobs = overrides.pop("top_logprobs", None)
    if "logprobs" in overrides:
        logprobs = overrides.pop("logprobs")
        if isinstance(logprobs, bool):  # chat: logprobs true + top_logprobs k
            if logprobs:
                overrides["logprobs"] = top_logprobs or 0
        else:  # completions: logprobs k
            overrides["logprobs"] = logprobs
    elif top_logprobs is not None:
        raise ParameterError(
            "invalid_parameter",
            "top_logprobs",
            "parameter 'top_logprobs' needs 'logprobs': true",
        )
    return overrides


def _check_patterns(constraint: StructuredOutputs, given: set[str]) -> None:
    """Refuse a constraint holding a pattern the output check cannot compile."""
    refused = pattern_problem(constraint)
    if refused is None:
        return
    key = next(
        (k for k in ("response_format", "structured_outputs") if k in given),
        "structured_outputs",
    )
    raise ParameterError(
        "invalid_parameter",
        key,
        f"parameter {key!r} holds the pattern {cap_message(refused[0], 200)!r}, "
        f"which the output check cannot compile: {refused[1]}",
    )


def _check_numbers(key: str, value: Any) -> None:
    """Integers within 64 bits, floats finite, anywhere in a parameter's value (iterative:
    a deeply nested value is bounded by the reader's depth limit, not by recursion)."""
    stack = [value]
    while stack:
        node = stack.pop()
        if isinstance(node, bool) or node is None or isinstance(node, str):
            continue
        if isinstance(node, int):
            if not INT64_MIN <= node <= INT64_MAX:
                raise ParameterError(
                    "invalid_parameter",
                    key,
                    f"parameter {key!r} holds an integer of {node.bit_length()} bits; values "
                    "must fit in a signed 64-bit integer",
                )
        elif isinstance(node, float):
            if not math.isfinite(node):
                raise ParameterError(
                    "invalid_parameter",
                    key,
                    f"parameter {key!r} holds {node}; numbers must be finite",
                )
        elif isinstance(node, dict):
            stack.extend(node.keys())
            stack.extend(node.values())
        elif isinstance(node, (list, tuple)):
            stack.extend(node)


def _constraint_of(
    response_format: ResponseFormat, *, default: StructuredOutputs | None
) -> StructuredOutputs | None:
    if response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return StructuredOutputs(json_object=True)
    if response_format.json_schema is None:
        raise ParameterError(
            "invalid_parameter",
            "response_format",
            "parameter 'response_format' of type json_schema needs a 'json_schema' object with "
            "a 'schema'",
        )
    return StructuredOutputs.model_validate({"json": response_format.json_schema.json_schema})


def _for_verify(sampling: Any) -> Any:
    """A copy of `sampling` that `SamplingParams.verify` may change without touching the
    row's: verify reassigns top-level fields (`prompt_logprob_token_ids`) and sets
    `structured_outputs._backend`, so a shallow copy with its own `structured_outputs` will
    do. `SamplingParams.clone()` deep-copies every list instead and runs `__post_init__`
    again: with the long-tail bench's 517 `stop_token_ids` that was 0.25 ms of the 0.33 ms a
    row took to validate (cProfile of `RowValidator.validate` over 2,048 rows)."""
    import copy

    copied = copy.copy(sampling)
    if sampling.structured_outputs is not None:
        copied.structured_outputs = copy.copy(sampling.structured_outputs)
    return copied


def _rejected(exc: Exception, given: set[str]) -> ParameterError:
    """vLLM's rejection as an `invalid_parameter` naming the key (vLLM's `parameter` when it
    says, else the row's key its message names, else the row's keys)."""
    message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    message = cap_message(message, 500)
    key = getattr(exc, "parameter", None)
    if not key:
        named = [k for k in sorted(given, key=len, reverse=True) if k in message]
        key = named[0] if named else (", ".join(sorted(given)) or "sampling")
    if key == "structured_outputs" and "response_format" in given:
        key = "response_format"
    return ParameterError(
        "invalid_parameter", key, f"parameter {key!r} was rejected by vLLM: {message}"
    )


def _reuse_params(kwargs: dict[str, Any], constraint: StructuredOutputs | None) -> str:
    """A generating row's sampling parameters (the pipeline's defaults with the row's
    overrides) and its output constraint as canonical JSON: the part of its reuse key its
    parameters decide. Values JSON cannot hold are keyed by their `repr`."""
    values = {k: v for k, v in kwargs.items() if k != "structured_outputs"}
    values["constraint"] = constraint.model_dump(mode="json") if constraint is not None else None
    return json.dumps(values, sort_keys=True, separators=(",", ":"), default=repr)
