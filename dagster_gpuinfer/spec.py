"""The job spec: the one contract between the control plane and the worker.

`InferenceSpec` is built and validated in the Dagster code location, serialised into Dagster
Pipes extras, and validated again by the worker. This module imports only pydantic,
packaging and the standard library, so both sides can import it: no dagster, no torch, no
vllm.

Engine and sampling fields keep vLLM's own names (`tensor_parallel_size`, `max_model_len`,
`gpu_memory_utilization`, `max_num_seqs`, `temperature`, `top_p`, `max_tokens`, ...), so a
user who knows vLLM recognises every one.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from enum import StrEnum
from typing import Any, ClassVar, Literal

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from dagster_gpuinfer.image_options import ImageOptions
from dagster_gpuinfer.secrets import find_secrets_in_options, secret_in_options_message
from dagster_gpuinfer.task_table import Task, task_facts

InputFormat = Literal["parquet", "jsonl", "openai_batch", "delta"]
OutputFormat = Literal["parquet", "openai_batch"]


class RowReuse(StrEnum):
    """`row_reuse`: which rows are copied from earlier outputs (an enum: Dagster run
    config takes enums, not literals)."""

    auto = "auto"
    sampled = "sampled"
    off = "off"


class RowReuseScope(StrEnum):
    """`row_reuse_scope`: where a row's key is looked up: the partition's own earlier
    output, or every committed partition of the pipeline's output."""

    partition = "partition"
    pipeline = "pipeline"


PARTITION_KEY_PLACEHOLDER = "{partition_key}"

# A large file split into several partitions: `<file key>@rows=<start>-<end>` (Parquet rows,
# or JSONL lines) or `<file key>@bytes=<start>-<end>` (JSONL bytes; a line belongs to the
# range holding its first byte). Ranges are half-open: `@rows=0-1000` is rows 0..999.
RANGE_KEY_PATTERN = re.compile(r"^(?P<file>.+)@(?P<unit>rows|bytes)=(?P<start>\d+)-(?P<end>\d+)$")


# vLLM load formats (vllm.model_executor.model_loader.LoadFormats, vLLM 0.32) that read
# only safetensors (or make no weights at all): no pickle is ever unpickled. The others
# ("auto" and "hf" fall back to *.bin, "pt", "npcache", ...) may run torch.load on a file
# from the model source, so a spec must opt in with `allow_pickle_weights=True`.
SAFE_LOAD_FORMATS = frozenset(
    {"safetensors", "fastsafetensors", "runai_streamer", "mistral", "dummy"}
)


# `max_loras` when a pipeline lists adapters and leaves it unset: one slot per adapter up to
# this many (vLLM preallocates each slot's weights at `max_lora_rank`).
MAX_AUTO_LORAS = 8
# An adapter's name: what rows and OpenAI lines name it by (`model`), so OpenAI-like
# (`ft:base:org:name`, `acme/support-v2`), and never a path or blank.
ADAPTER_NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@/+-]{0,127}$")


def unsafe_partition_key_reason(partition_key: str) -> str | None:
    """Why a partition key cannot name a file under an input root, or None when it can.

    A key becomes part of a path (`{partition_key}` in the input uri): `..` segments, a
    leading `/` or `\\` or a NUL byte would let it point outside the input root.
    """
    if not partition_key:
        return "it is empty"
    if "\x00" in partition_key:
        return "it holds a NUL byte"
    if partition_key.startswith(("/", "\\")):
        return "it starts with a path separator, which would make it an absolute path"
    if ".." in partition_key.replace("\\", "/").split("/"):
        return "it has a '..' path segment, which would leave the input root"
    return None


def _refuse_secrets(options: dict[str, Any], where: str) -> dict[str, Any]:
    for path in find_secrets_in_options(options, where):
        raise ValueError(secret_in_options_message(path))
    return options


class _Strict(BaseModel):
    # A refused value is never echoed by pydantic's message (`input_value=...`): it may be
    # a credential, and these messages reach Pipes, Dagster's event log and stderr.
    # `secrets.validation_problems` says what is wrong, with the value where it is safe.
    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)


class EngineArgs(_Strict):
    """Arguments of the vLLM engine (`vllm.LLM(...)`), under vLLM's names.

    Fields not listed here can be passed through `extra`, which goes to `vllm.LLM` as is.
    """

    dtype: str = Field("auto", description="vLLM `dtype`: auto, float32, float16, bfloat16.")
    max_model_len: int | None = Field(
        None, gt=0, description="vLLM `max_model_len`; longer prompts are quarantined."
    )
    gpu_memory_utilization: float = Field(
        0.9,
        gt=0,
        le=1,
        description=(
            "vLLM `gpu_memory_utilization`. On the CPU backend it is the fraction of CPU "
            "memory (NUMA node 0) reserved for the KV cache."
        ),
    )
    max_num_seqs: int | None = Field(None, gt=0, description="vLLM `max_num_seqs`.")
    max_num_batched_tokens: int | None = Field(
        None, gt=0, description="vLLM `max_num_batched_tokens`."
    )
    enforce_eager: bool = Field(False, description="vLLM `enforce_eager`: skip graph capture.")
    enable_prefix_caching: bool | None = Field(None, description="vLLM `enable_prefix_caching`.")
    seed: int = Field(0, description="vLLM engine `seed`.")
    trust_remote_code: bool = Field(False, description="vLLM `trust_remote_code`.")
    enable_lora: bool | None = Field(
        None,
        description="vLLM `enable_lora`: serve LoRA adapters on this engine. Set by itself when "
        "the pipeline lists `lora_adapters`.",
    )
    max_loras: int | None = Field(
        None,
        gt=0,
        description="vLLM `max_loras`: adapters one engine batch may mix. Default with "
        f"`lora_adapters`: their number, at most {MAX_AUTO_LORAS}.",
    )
    max_lora_rank: int | None = Field(
        None,
        gt=0,
        description="vLLM `max_lora_rank`: the largest adapter rank the engine takes (vLLM's "
        "default 16); an adapter of a higher rank is refused before the engine loads.",
    )
    load_format: str = Field(
        "safetensors",
        description="vLLM `load_format`. safetensors by default: weights never come from a "
        f"pickle. {sorted(SAFE_LOAD_FORMATS)} are safe; any other (auto, pt, npcache, ...) may "
        "unpickle *.bin files and needs allow_pickle_weights=True.",
    )
    allow_pickle_weights: bool = Field(
        False,
        description="Let load_format read pickle (*.bin, *.pt) weights. Only for a model "
        "source you trust as code: unpickling runs whatever the file holds.",
    )
    extra: dict[str, Any] = Field(
        default_factory=dict,
        description="Other `vllm.LLM` keyword arguments, passed as is. Never credentials "
        "(hf_token, api_key, ...): those are refused; give them to the worker by Secret.",
    )

    # Fields a run's launchpad config may not change: weights that run code, and anything
    # passed to vLLM unchecked. The pipeline's code (or YAML) sets them, not a run.
    NOT_PER_RUN: ClassVar[frozenset[str]] = frozenset(
        {"trust_remote_code", "allow_pickle_weights", "load_format", "extra"}
    )

    # Fields that do not change results: excluded from the spec hash. The speed and memory
    # knobs so that stepping them down after an out-of-memory error keeps committed chunks
    # valid; the load format because the same weights load either way.
    PERFORMANCE_ONLY: ClassVar[frozenset[str]] = frozenset(
        {
            "gpu_memory_utilization",
            "max_num_seqs",
            "max_num_batched_tokens",
            "enforce_eager",
            "load_format",
            "allow_pickle_weights",
            "max_loras",
        }
    )

    @field_validator("extra")
    @classmethod
    def _no_secrets_or_load_format_in_extra(cls, extra: dict[str, Any]) -> dict[str, Any]:
        if "load_format" in extra:
            raise ValueError(
                "engine.extra['load_format'] is set; use engine.load_format (pickle formats "
                "also need engine.allow_pickle_weights=True)"
            )
        return _refuse_secrets(extra, "engine.extra")

    @model_validator(mode="after")
    def _pickle_only_when_allowed(self) -> EngineArgs:
        load_format = self.load_format.lower()
        if load_format not in SAFE_LOAD_FORMATS and not self.allow_pickle_weights:
            raise ValueError(
                f"engine.load_format={self.load_format!r} may load pickle weights (*.bin, "
                "*.pt), and unpickling a file runs the code in it. Convert the model to "
                "safetensors (the default load_format), or set engine.allow_pickle_weights=True "
                "if you trust the model source as you trust code"
            )
        return self

    def to_vllm_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for `vllm.LLM`, without the unset ones."""
        kwargs = self.model_dump(exclude={"extra", "allow_pickle_weights"}, exclude_none=True)
        kwargs.update(self.extra)
        return kwargs


class StructuredOutputs(_Strict):
    """vLLM `StructuredOutputsParams`: constrain every output to a JSON schema, a regex or a
    choice of strings (exactly one of them).

    `json` takes a JSON schema (a dict or its JSON text) or a pydantic model class, whose
    `model_json_schema()` is used; `json_object=True` asks for any JSON object. JSON is
    compact by default (the worker sets vLLM's `disable_any_whitespace`, an engine setting);
    to allow whitespace set
    `EngineArgs(extra={"structured_outputs_config": {"disable_any_whitespace": False}})`.
    """

    json_schema: dict[str, Any] | None = Field(
        None,
        alias="json",
        description="A JSON schema (or pydantic model class) every output must satisfy.",
    )
    regex: str | None = Field(None, description="A regular expression every output must match.")
    choice: list[str] | None = Field(None, description="The output must be one of these strings.")
    json_object: bool | None = Field(None, description="The output must be a JSON object.")

    model_config = ConfigDict(
        extra="forbid", frozen=True, populate_by_name=True, hide_input_in_errors=True
    )

    @field_validator("json_schema", mode="before")
    @classmethod
    def _schema_from_model(cls, value: Any) -> Any:
        if isinstance(value, type) and issubclass(value, BaseModel):
            return value.model_json_schema()
        if isinstance(value, str):
            try:
                return json.loads(value)
            except ValueError as exc:
                raise ValueError(f"structured_outputs.json is not valid JSON text: {exc}") from None
        return value

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputs:
        chosen = [
            name
            for name, value in (
                ("json", self.json_schema),
                ("regex", self.regex),
                ("choice", self.choice),
                ("json_object", self.json_object),
            )
            if value not in (None, False)
        ]
        if len(chosen) != 1:
            raise ValueError(
                "structured_outputs takes exactly one of json, regex, choice, json_object; "
                f"got {chosen or 'none'}"
            )
        return self

    def to_vllm_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of `vllm.sampling_params.StructuredOutputsParams`."""
        return self.model_dump(by_alias=True, exclude_none=True)


class SamplingParams(_Strict):
    """vLLM `SamplingParams` for `generate` and `chat`, under vLLM's names.

    These are the pipeline's defaults: a row's own parameters (an OpenAI Batch line's body,
    or the `input.params_column` of a Parquet/JSONL row) override them for that row.
    """

    temperature: float = Field(0.0, ge=0, description="0 is greedy decoding.")
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int | None = Field(None, description="vLLM `top_k`; None or -1 disables it.")
    max_tokens: int = Field(64, gt=0, description="Maximum generated tokens per row.")
    min_tokens: int = Field(0, ge=0)
    seed: int | None = Field(None, description="Per-request sampling seed.")
    stop: list[str] = Field(default_factory=list)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    n: int = Field(1, ge=1, description="Completions per row; all land in the row's `choices`.")
    logprobs: int | None = Field(
        None, ge=0, description="Log probabilities of the top `logprobs` tokens per position."
    )
    structured_outputs: StructuredOutputs | None = Field(
        None, description="Constrain outputs to a JSON schema, regex or choice (vLLM's)."
    )
    extra: dict[str, Any] = Field(
        default_factory=dict, description="Other `vllm.SamplingParams` fields, passed as is."
    )

    # Not settable in a run's launchpad config: nested or passed to vLLM unchecked.
    NOT_PER_RUN: ClassVar[frozenset[str]] = frozenset({"structured_outputs", "extra"})

    @field_validator("extra")
    @classmethod
    def _no_secrets_in_extra(cls, extra: dict[str, Any]) -> dict[str, Any]:
        return _refuse_secrets(extra, "sampling.extra")

    def to_vllm_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of `vllm.SamplingParams`; `structured_outputs` stays a dict of
        `StructuredOutputsParams` keyword arguments (the worker builds the object)."""
        kwargs = self.model_dump(exclude={"extra", "structured_outputs"}, exclude_none=True)
        if not kwargs["stop"]:
            kwargs.pop("stop")
        if self.structured_outputs is not None:
            kwargs["structured_outputs"] = self.structured_outputs.to_vllm_kwargs()
        kwargs.update(self.extra)
        return kwargs


class StorageOptions(_Strict):
    """Where object storage lives. Credentials never travel here: the worker takes them from
    the environment (the standard AWS chain or a mounted secret)."""

    endpoint_url: str | None = Field(None, description="S3-compatible endpoint, e.g. MinIO.")
    region: str | None = Field(None, description="S3 region.")
    allow_http: bool = Field(False, description="Allow plain-http endpoints (tests, MinIO).")


class ShardRange(_Strict):
    """The part of a file one partition covers: rows or bytes `[start, end)`."""

    unit: Literal["rows", "bytes"]
    start: int = Field(ge=0)
    end: int = Field(gt=0)

    @model_validator(mode="after")
    def _not_empty(self) -> ShardRange:
        if self.end <= self.start:
            raise ValueError(
                f"range {self.unit}={self.start}-{self.end} is empty; end must exceed start"
            )
        return self

    def suffix(self) -> str:
        return f"@{self.unit}={self.start}-{self.end}"


def split_partition_key(partition_key: str) -> tuple[str, ShardRange | None]:
    """`big@rows=0-1000` -> (`big`, rows [0, 1000)); a key without a range -> (key, None)."""
    match = RANGE_KEY_PATTERN.match(partition_key)
    if match is None:
        return partition_key, None
    start, end = int(match["start"]), int(match["end"])
    if end <= start:  # not a range this package writes: part of a file's name
        return partition_key, None
    unit = "rows" if match["unit"] == "rows" else "bytes"
    return match["file"], ShardRange(unit=unit, start=start, end=end)


def range_partition_key(file_key: str, unit: Literal["rows", "bytes"], start: int, end: int) -> str:
    """The partition key of part `[start, end)` of the file whose key is `file_key`."""
    return file_key + ShardRange(unit=unit, start=start, end=end).suffix()


class InputSpec(_Strict):
    """Where a shard's rows come from and which columns carry what.

    `uri` is a template with `{partition_key}`: one file per partition (shard), or one part
    of a large file when the key ends in a range (`big@rows=0-100000`, `big@bytes=0-67108864`).
    With `format="delta"` it is a Delta Lake table's root instead, and a partition is the
    table's rows whose `partition_column` holds the key (or a row range of them:
    `2026-12-01@rows=0-50000`).
    """

    uri: str = Field(
        description="Shard location template, e.g. `s3://bucket/docs/{partition_key}.parquet`; "
        "for `format: delta`, the table's root (`s3://lake/docs`)."
    )
    format: InputFormat | None = Field(
        None,
        description="parquet, jsonl, openai_batch or delta (a table scan); inferred from the "
        "suffix if unset (never delta).",
    )
    partition_column: str | None = Field(
        None,
        description="For `format: delta`: the table's partition column whose values are the "
        "partition keys.",
    )
    id_column: str | None = Field(
        "id",
        description=(
            "Column holding the row id. None: the id is `<partition_key>:<row number>`. "
            "OpenAI batch input always uses `custom_id`."
        ),
    )
    text_column: str = Field(
        "text", description="Text column for `embed`, `generate`, `classify`; the query of `score`."
    )
    text_pair_column: str = Field(
        "text_pair", description="For `score`: the column of the document paired with the query."
    )
    messages_column: str = Field("messages", description="OpenAI-style messages for `chat`.")
    params_column: str | None = Field(
        None,
        description=(
            "Optional column of per-row parameters (an object, or its JSON text, with OpenAI / "
            "vLLM sampling names: max_tokens, temperature, seed, n, response_format, ...). "
            "OpenAI batch input always takes them from each line's `body`."
        ),
    )
    adapter_column: str | None = Field(
        None,
        description="Column naming each row's LoRA adapter (one of the pipeline's "
        "`lora_adapters`); null, empty or the base model's name: the base model. Without it, "
        "a row's `model` parameter (an OpenAI line's `model`) names it.",
    )
    image_column: str = Field(
        "image",
        description="For image tasks: the column of images (encoded bytes, a bytes/path "
        "struct, a URI, or a list of them); a row whose image is null is a text row.",
    )
    images: ImageOptions = Field(
        default_factory=ImageOptions,
        description="Image inputs: allowed URL hosts and local roots, pixel/byte/side limits, "
        "images per request, decoding threads.",
    )

    @model_validator(mode="after")
    def _has_placeholder(self) -> InputSpec:
        if self.format == "delta":
            if PARTITION_KEY_PLACEHOLDER in self.uri:
                raise ValueError(
                    f"input.uri {self.uri!r} of a Delta table is its root, with no "
                    f"{PARTITION_KEY_PLACEHOLDER}: the key is a value of input.partition_column"
                )
            if not self.partition_column:
                raise ValueError(
                    "input.format='delta' needs input.partition_column: the table's partition "
                    "column whose values are the partition keys"
                )
            return self
        if self.partition_column is not None:
            raise ValueError("input.partition_column is for input.format='delta' only")
        if PARTITION_KEY_PLACEHOLDER not in self.uri:
            raise ValueError(
                f"input.uri {self.uri!r} has no {PARTITION_KEY_PLACEHOLDER} placeholder; each "
                "partition reads its own shard, e.g. 'data/docs/{partition_key}.parquet'"
            )
        return self

    def is_table(self) -> bool:
        """A table scan (Delta Lake): a partition is rows of the table, not a file."""
        return self.format == "delta"

    def resolved_format(self) -> InputFormat:
        if self.format is not None:
            return self.format
        uri = self.uri.lower()
        if uri.endswith(".parquet"):
            return "parquet"
        if uri.endswith((".jsonl", ".json", ".ndjson")):
            return "jsonl"
        raise ValueError(
            f"cannot infer the input format of {self.uri!r} from its suffix; set "
            "input.format to parquet, jsonl or openai_batch"
        )

    def shard_uri(self, partition_key: str) -> str:
        """The file a partition reads (a Delta table: its root); a range suffix in the key is
        not part of the name."""
        file_key, _ = split_partition_key(partition_key)
        return self.uri.replace(PARTITION_KEY_PLACEHOLDER, file_key)

    def shard_range(self, partition_key: str) -> ShardRange | None:
        """The rows or bytes of the file the partition covers; None for the whole file."""
        return split_partition_key(partition_key)[1]


class OutputSpec(_Strict):
    """Where results go: `<root>/<asset_name>/<partition>/`."""

    root: str = Field(description="Output root: a local directory or `s3://bucket/prefix`.")
    asset_name: str = Field(description="Folder under the root, usually the asset's name.")
    format: OutputFormat = Field(
        "parquet", description="parquet, or openai_batch for OpenAI Batch API output JSONL."
    )


class RowLimits(_Strict):
    """Bounds on one row, checked before the row costs anything (parsing it whole,
    tokenizing it, generating for it): a row past one is quarantined with the limit named.

    The defaults hold a worker's memory to about a chunk of ordinary rows whatever a line
    asks for; a pipeline that needs more sets its own (`InferenceSpec.limits`).
    """

    max_line_bytes: int = Field(
        8 << 20,
        ge=1,
        description="Bytes of one JSONL / OpenAI batch line, read before it is parsed "
        "(quarantined as `line_too_long`).",
    )
    max_prompt_chars: int = Field(
        1_000_000,
        ge=1,
        description="Characters of one prompt (a chat's message contents together), counted "
        "before tokenizing (quarantined as `prompt_too_long`).",
    )
    max_json_depth: int = Field(
        64,
        ge=2,
        description="Nesting depth of a line's JSON and of a row's parameters (quarantined as "
        "`too_deep`).",
    )
    max_n: int = Field(
        16, ge=1, description="Most completions one row may ask for (`n`, vLLM takes 16,384)."
    )
    max_n_logprobs: int = Field(
        320,
        ge=0,
        description="Most `n` x `top_logprobs` (alternatives listed per generated position, "
        "over all of a row's completions).",
    )


class InferenceSpec(_Strict):
    """Everything one worker needs to turn input shards into committed outputs.

    Examples:
        >>> spec = InferenceSpec(
        ...     model="/models/all-MiniLM-L6-v2",
        ...     task="embed",
        ...     input=InputSpec(uri="data/docs/{partition_key}.parquet"),
        ...     output=OutputSpec(root="out", asset_name="doc_embeddings"),
        ...     partition_keys=["shard-000"],
        ... )
    """

    model: str = Field(description="Model directory (local or in the model cache) or hub id.")
    task: Task = Field(
        description="embed (pooling models), generate, chat, score (pairs), classify, "
        "image_embed (image or text rows), vision_generate (image + prompt) or vision_chat "
        "(messages with image_url parts)."
    )
    engine: EngineArgs = Field(default_factory=EngineArgs)
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    input: InputSpec
    output: OutputSpec
    storage: StorageOptions = Field(default_factory=StorageOptions)
    partition_keys: list[str] = Field(
        default_factory=list,
        description="The partitions (shards) of this run. Pipes passes no partition range, "
        "so the control plane lists them here.",
    )
    tensor_parallel_size: int = Field(1, ge=1, description="GPUs per vLLM engine (replica).")
    replicas: int = Field(1, ge=1, description="Data-parallel vLLM engines in this worker.")
    pipeline_parallel_size: int = Field(
        1, ge=1, description="vLLM `pipeline_parallel_size`: pipeline stages per engine."
    )
    nodes: int = Field(
        1,
        ge=1,
        description="Pods (nodes) one engine spans: vLLM's `nnodes`. Above 1 the engine's "
        "tensor_parallel_size x pipeline_parallel_size ranks are split evenly across a group "
        "of pods (a leader running the worker, followers running vLLM headless), created "
        "and admitted as one gang (k8s.group).",
    )
    chunk_size: int = Field(
        512, ge=1, description="Rows per chunk: the unit of writing, commit and resume."
    )
    max_requests_in_flight: int | None = Field(
        None,
        ge=1,
        description="Requests each engine holds in flight, across chunk and shard boundaries "
        "(for experts). Default: 2 x the engine's `max_num_seqs`.",
    )
    group_prefixes: bool = Field(
        True,
        description="Submit generation requests grouped by shared prompt prefix across the "
        "read-ahead where that brings whole KV blocks of shared prefix together (feeds "
        "vLLM's prefix cache; else input order); outputs stay keyed by row.",
    )
    limits: RowLimits = Field(
        default_factory=RowLimits,
        description="Bounds on one row (line bytes, prompt characters, JSON depth, `n`, "
        "`n` x `top_logprobs`); a row past one is quarantined.",
    )
    served_model_name: str | None = Field(
        None,
        description="The model name OpenAI batch output lines report in their body's "
        "`model` (vLLM's `served_model_name`): the batch API sets the name the requests "
        "named. Default: `model`. Part of the spec hash when set.",
    )
    lora_adapters: dict[str, str] = Field(
        default_factory=dict,
        description="LoRA adapters one engine serves beside the base model, by name: a local "
        "folder (in a pod: under the model cache) or an `s3://` prefix, fetched to the "
        "worker's adapter cache before use. Rows name theirs (`input.adapter_column`, or "
        "an OpenAI line's `model`); others run the base model. Sets engine.enable_lora. "
        "Part of the spec hash when set.",
    )
    vllm_version: str | None = Field(
        None,
        description="Pin the engine: a vLLM version ('0.32.0') or a PEP 440 specifier "
        "('>=0.32,<0.33'). A worker whose vLLM does not match refuses before loading weights. "
        "Part of the spec hash and code version when set.",
    )
    row_reuse: RowReuse = Field(
        RowReuse.auto,
        description="Row-level reuse: a row whose reuse key (model and its files' version, "
        "output-shaping settings, the request as rendered, its parameters and seed) is "
        "already in the partition's earlier output is copied from it, and identical requests "
        "of a run are computed once. auto: rows whose output is a function of their key "
        "(embed, score, classify, greedy or seeded sampling); sampled: unseeded sampling "
        "rows too (a new sample is then never drawn for them); off: every row is computed. "
        "Part of the spec hash and code version when not auto.",
    )
    row_reuse_scope: RowReuseScope = Field(
        RowReuseScope.partition,
        description="Where row reuse looks a row's key up. partition: the partition's own "
        "earlier output (when its shard changed). pipeline: also every other committed "
        "partition of this pipeline's output (a row repeated across daily snapshots or "
        "shards is computed once); the run reads those partitions' key columns once, "
        "about 100 bytes a row. Never part of the spec hash: a copied row equals a "
        "computed one.",
    )

    # Fields that are not a pipeline's own settings: the models the pipeline passes whole,
    # where its output goes (named by the pipeline, placed by the resource) and the run's
    # partitions. Every other field is a pipeline setting (`pipeline_fields`).
    NOT_PIPELINE_SETTINGS: ClassVar[frozenset[str]] = frozenset(
        {
            "model",
            "task",
            "engine",
            "sampling",
            "input",
            "output",
            "storage",
            "partition_keys",
            "limits",  # a nested model like engine/sampling: `inference_assets(limits=...)`
        }
    )

    # Pipeline settings a run's launchpad config may not change: the adapters' files, like
    # the model's, are the pipeline's (its code or YAML), not a run's.
    NOT_PER_RUN: ClassVar[frozenset[str]] = frozenset({"lora_adapters"})

    # Fields that change how the work is scheduled but not its results: left out of the
    # spec hash, so a retry with other settings resumes committed work.
    SCHEDULING_ONLY: ClassVar[frozenset[str]] = frozenset(
        {
            "partition_keys",
            "tensor_parallel_size",
            "replicas",
            "pipeline_parallel_size",
            "nodes",
            "storage",
            "max_requests_in_flight",
            "group_prefixes",
        }
    )

    @field_validator("vllm_version")
    @classmethod
    def _valid_vllm_version(cls, pin: str | None) -> str | None:
        if pin is not None:
            vllm_specifier(pin)
        return pin

    @field_validator("lora_adapters")
    @classmethod
    def _valid_adapters(cls, adapters: dict[str, str]) -> dict[str, str]:
        for name, path in adapters.items():
            if not ADAPTER_NAME_PATTERN.match(name):
                raise ValueError(
                    f"lora_adapters name {name!r} is refused: an adapter name is 1-128 letters, "
                    "digits and . _ : @ / + - (starting with a letter or digit), as rows and "
                    "OpenAI lines name it"
                )
            if not (path.startswith("s3://") or _looks_local(path)):
                raise ValueError(
                    f"lora_adapters[{name!r}] = {path!r} is neither a local folder (absolute, "
                    "./ or ~) nor an s3:// prefix; copy the adapter into the model cache or S3"
                )
        return adapters

    @field_validator("partition_keys")
    @classmethod
    def _valid_partition_keys(cls, keys: list[str]) -> list[str]:
        for key in keys:
            reason = unsafe_partition_key_reason(key)
            if reason is not None:
                raise ValueError(
                    f"partition key {key!r} is refused: {reason}. Partition keys name files "
                    "under the input root; rename the input (or the partition) to a relative "
                    "name without '..' segments"
                )
        if len(set(keys)) != len(keys):
            raise ValueError("partition_keys lists a partition more than once")
        return keys

    @model_validator(mode="after")
    def _check_task_columns(self) -> InferenceSpec:
        input_format = self.input.resolved_format()
        for key in self.partition_keys:
            shard_range = self.input.shard_range(key)
            in_bytes = shard_range is not None and shard_range.unit == "bytes"
            if in_bytes and input_format in ("parquet", "delta"):
                raise ValueError(
                    f"partition {key!r} asks for a byte range of a Parquet file or table; they "
                    "split by rows (`@rows=<start>-<end>`), byte ranges are for JSONL"
                )
        self._check_nodes()
        self._check_adapters()
        if task_facts(self.task).pooling and self.sampling != SamplingParams():
            raise ValueError(f"sampling parameters are set but task {self.task!r} does not sample")
        if self.sampling.n > self.limits.max_n:
            raise ValueError(
                f"sampling.n={self.sampling.n} is more than limits.max_n={self.limits.max_n}; "
                "lower n or raise limits.max_n"
            )
        fan_out = self.sampling.n * (self.sampling.logprobs or 0)
        if fan_out > self.limits.max_n_logprobs:
            raise ValueError(
                f"sampling.n x sampling.logprobs = {fan_out} is more than "
                f"limits.max_n_logprobs={self.limits.max_n_logprobs}; lower them or raise "
                "limits.max_n_logprobs"
            )
        return self

    def _check_nodes(self) -> None:
        """An engine across pods: its ranks split evenly, one engine per group of pods."""
        if self.nodes == 1:
            return
        ranks = self.tensor_parallel_size * self.pipeline_parallel_size
        if ranks % self.nodes != 0:
            raise ValueError(
                f"nodes={self.nodes} must divide tensor_parallel_size={self.tensor_parallel_size}"
                f" x pipeline_parallel_size={self.pipeline_parallel_size} = {ranks} ranks, so "
                "every pod holds the same number of GPUs; e.g. tensor_parallel_size=8, "
                "pipeline_parallel_size=2, nodes=2 for two 8-GPU nodes"
            )
        if self.replicas != 1:
            raise ValueError(
                f"replicas={self.replicas} with nodes={self.nodes}: an engine spanning several "
                "pods is one replica (one group of pods). Set replicas=1 and get data "
                "parallelism from more runs (a backfill with multi_run), one group each"
            )
        if "distributed_executor_backend" in self.engine.extra:
            raise ValueError(
                "engine.extra['distributed_executor_backend'] is set with nodes > 1; a group "
                "of pods runs vLLM's multiprocessing backend ('mp'), leave it unset"
            )

    def _check_adapters(self) -> None:
        """Adapters on a generating task, named apart from the base model; an adapter column
        only with adapters to name."""
        if self.input.adapter_column and not self.lora_adapters:
            raise ValueError(
                f"input.adapter_column={self.input.adapter_column!r} is set but the pipeline "
                "lists no lora_adapters for its rows to name; list them or unset the column"
            )
        if not self.lora_adapters:
            return
        if not task_facts(self.task).samples:
            raise ValueError(
                f"lora_adapters are listed but task {self.task!r} does not generate; adapters "
                "are served for generating tasks (generate, chat and the vision ones)"
            )
        clash = sorted({self.model, self.served_model} & set(self.lora_adapters))
        if clash:
            raise ValueError(
                f"lora_adapters name {clash[0]!r} is the base model's own name; rows naming it "
                "run the base model, so give the adapter another name"
            )
        if self.engine.enable_lora is False:
            raise ValueError(
                "lora_adapters are listed but engine.enable_lora is False; leave it unset "
                "(set by itself) or True"
            )

    def lora_engine_kwargs(self) -> dict[str, Any]:
        """vLLM's LoRA arguments for the listed adapters: `enable_lora`, and `max_loras`
        (one slot per adapter, at most `MAX_AUTO_LORAS`) where the engine leaves them unset;
        nothing when no adapters are listed (the engine's own settings stand)."""
        if not self.lora_adapters:
            return {}
        kwargs: dict[str, Any] = {"enable_lora": True}
        if self.engine.max_loras is None:
            kwargs["max_loras"] = min(len(self.lora_adapters), MAX_AUTO_LORAS)
        return kwargs

    def ranks_per_node(self) -> int:
        """Engine ranks (GPUs) in each pod of the engine's group."""
        return self.tensor_parallel_size * self.pipeline_parallel_size // self.nodes

    def spec_hash(self) -> str:
        """A hash of what decides the results; committed outputs are valid only for it.

        Leaves out the partition keys, parallelism and the performance-only engine knobs, so a
        retry with fewer sequences or another replica count resumes committed work.
        """
        blob = json.dumps(self._results_payload(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def code_version(self) -> str:
        """The inference asset's Dagster `code_version`: what the spec hash covers, less what
        decides how results are committed but not what they are (`chunk_size`, where the
        output goes). A change to the model, task, prompt columns or template, engine
        arguments that shape outputs, sampling or row limits changes it, and Dagster marks
        every partition materialized before as stale; `chunk_size`, replicas, parallelism,
        in-flight requests and speed or memory knobs do not.
        """
        payload = self._results_payload()
        payload.pop("chunk_size", None)
        payload["output"] = {"format": payload["output"]["format"]}
        blob = json.dumps(payload, sort_keys=True, separators=(",", ":"))
        return "spec-" + hashlib.sha256(blob.encode()).hexdigest()[:16]

    def _results_payload(self) -> dict[str, Any]:
        """The spec's fields that decide committed results, as JSON-ready values."""
        payload = self.model_dump(mode="json", exclude=set(self.SCHEDULING_ONLY))
        if self.limits == RowLimits():  # the defaults: hashes of earlier specs stay valid
            payload.pop("limits")
        if self.vllm_version is None:  # unpinned: likewise
            payload.pop("vllm_version")
        if self.served_model_name is None:  # named by its model: likewise
            payload.pop("served_model_name")
        if not self.lora_adapters:  # no adapters: likewise
            payload.pop("lora_adapters")
        else:  # a local folder by its normalized path, as the model
            payload["lora_adapters"] = {
                name: os.path.normpath(path) if _looks_local(path) else path
                for name, path in self.lora_adapters.items()
            }
        if self.input.adapter_column is None:
            payload["input"].pop("adapter_column")
        for name in ("enable_lora", "max_lora_rank"):  # unset: likewise
            if payload["engine"].get(name) is None:
                payload["engine"].pop(name)
        if self.row_reuse == "auto":  # the default: likewise
            payload.pop("row_reuse")
        payload.pop("row_reuse_scope")  # where rows are found, not what they are
        # image fields and the table's partition column at their defaults: likewise
        for name in ("image_column", "images", "partition_column"):
            if getattr(self.input, name) == InputSpec.model_fields[name].get_default(
                call_default_factory=True
            ):
                payload["input"].pop(name)
        for name in EngineArgs.PERFORMANCE_ONLY:
            payload["engine"].pop(name, None)
        payload["model"] = os.path.normpath(self.model) if _looks_local(self.model) else self.model
        return payload

    def reuse_scope(self) -> str:
        """The part of every row's reuse key that the spec decides: what the spec hash
        covers, less where rows come from and go to (`input.uri`, the output's root and
        asset), how they are committed (`chunk_size`) and the reuse setting itself. Two
        partitions, or two runs, whose scopes are equal compute equal outputs for equal
        requests (with equal model files: `SourceVersion.model`, added per row)."""
        payload = self._results_payload()
        for name in ("chunk_size", "row_reuse", "partition_keys"):
            payload.pop(name, None)
        payload["input"].pop("uri", None)
        payload["output"] = {"format": payload["output"]["format"]}
        blob = json.dumps(payload, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:32]

    @property
    def served_model(self) -> str:
        """The model name OpenAI output lines report: `served_model_name`, else `model`."""
        return self.served_model_name or self.model

    def model_is_local_path(self) -> bool:
        return _looks_local(self.model)


def vllm_specifier(pin: str) -> SpecifierSet:
    """`vllm_version` as a specifier set: a bare version means exactly it.

    Raises:
        ValueError: `pin` is neither a version nor a PEP 440 specifier.
    """
    text = pin.strip()
    try:
        Version(text)
        text = f"=={text}"
    except InvalidVersion:
        pass
    try:
        return SpecifierSet(text)
    except InvalidSpecifier:
        raise ValueError(
            f"vllm_version {pin!r} is neither a version ('0.32.0') nor a PEP 440 specifier "
            "('>=0.32,<0.33')"
        ) from None


def _looks_local(model: str) -> bool:
    """A model given as an absolute, `./`, `../` or `~` path is a local directory; anything
    else may be a hub id such as `sentence-transformers/all-MiniLM-L6-v2`."""
    return model.startswith(("/", "./", "../", "~", "file://")) or os.path.isdir(model)


# --------------------------------------------------------------------------- one source
# The asset factory's keywords, the YAML component's attributes and the launchpad run config
# are derived from the spec models here, so a field added to a model is settable in all three.


def pipeline_fields(spec_model: type[InferenceSpec] = InferenceSpec) -> dict[str, Any]:
    """The spec's top-level pipeline settings by name (`tensor_parallel_size`, `replicas`,
    `chunk_size`, `max_requests_in_flight`, `group_prefixes`, ...): pydantic `FieldInfo`s,
    every field of `spec_model` but `NOT_PIPELINE_SETTINGS`."""
    return {
        name: info
        for name, info in spec_model.model_fields.items()
        if name not in spec_model.NOT_PIPELINE_SETTINGS
    }


def run_config_fields(
    spec_model: type[InferenceSpec] = InferenceSpec,
) -> dict[str, tuple[str | None, str, Any]]:
    """What a run may override, by run-config name: (section, field, FieldInfo), where the
    section is None (a pipeline setting), `engine` or `sampling`.

    Engine and sampling fields keep their own names (`max_num_seqs`, `temperature`); a name
    two of them share (`seed`) is prefixed by its section (`engine_seed`, `sampling_seed`).
    Fields in a model's `NOT_PER_RUN` are left out.
    """
    pipeline = {
        name: info
        for name, info in pipeline_fields(spec_model).items()
        if name not in getattr(spec_model, "NOT_PER_RUN", frozenset())
    }
    sections: list[tuple[str | None, dict[str, Any]]] = [(None, pipeline)]
    for section in ("engine", "sampling"):
        model = spec_model.model_fields[section].annotation
        assert isinstance(model, type) and issubclass(model, BaseModel)
        locked = getattr(model, "NOT_PER_RUN", frozenset())
        sections.append((section, {n: f for n, f in model.model_fields.items() if n not in locked}))
    counts: dict[str, int] = {}
    for _, fields in sections:
        for name in fields:
            counts[name] = counts.get(name, 0) + 1
    derived: dict[str, tuple[str | None, str, Any]] = {}
    for section, fields in sections:
        for name, info in fields.items():
            run_name = f"{section}_{name}" if counts[name] > 1 and section else name
            derived[run_name] = (section, name, info)
    return derived
