"""The routing table: which batch pipeline serves a batch, by the lines' `model` and the
batch's `endpoint`.

The operator writes it once (a YAML file, or a Python object named `module:attribute`); the
API service reads it to validate batches and the code location reads the same table to build
one batch pipeline per route, so the two cannot disagree about what a model name means.

Examples:
    A YAML routing table::

        routes:
          - model: minilm
            endpoint: /v1/embeddings
            pipeline: batch_minilm_embeddings
            model_path: /models/all-MiniLM-L6-v2
            engine: {dtype: float32}
            chunk_size: 64
            sink: {kind: pgvector, url_env: EMBEDDINGS_DB_URL, table: batch_embeddings}
          - model: llama-8b
            endpoint: /v1/chat/completions
            pipeline: batch_llama_chat
            model_path: /models/llama-8b
            lora_adapters:          # lines naming these run on them, one engine for all
              support-v2: /models/adapters/support-v2
              legal: s3://adapters/legal/
            sink: {kind: delta, uri: "s3://lake/llama_chat"}   # completed batches, too
"""

from __future__ import annotations

import importlib
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from dagster_gpuinfer.image_options import ImageOptions
from dagster_gpuinfer.sinks import DeltaSink, PgVectorSink, sink_layout, sink_settings
from dagster_gpuinfer.task_table import ENDPOINTS, TASKS, TaskFacts, tasks_serving

ROUTES_ENV = "GPUINFER_BATCH_ROUTES"
_NO_TASK = TaskFacts("", "pooling", {})  # a task name the table lacks serves no endpoint
_PIPELINE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class Route(BaseModel):
    """One model name on one endpoint, served by one batch pipeline."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(min_length=1, description="The `model` that request lines name.")
    endpoint: str = Field(description="The batch endpoint, e.g. /v1/embeddings.")
    pipeline: str = Field(description="Name of the batch pipeline (its output asset).")
    model_path: str = Field(description="The model folder (or hub id) vLLM loads.")
    engine: dict[str, Any] = Field(default_factory=dict, description="vLLM engine arguments.")
    sampling: dict[str, Any] = Field(
        default_factory=dict, description="Default sampling parameters (generate, chat)."
    )
    chunk_size: int = Field(64, ge=1, description="Rows per chunk: the unit of progress.")
    task: str = Field(
        "",
        description="The task serving the endpoint, where more than one does (`vision_chat` "
        "on /v1/chat/completions: chat lines whose content parts carry `image_url`); "
        "default: the endpoint's own task.",
    )
    images: ImageOptions | None = Field(
        None, description="Image tasks: the URL allow-list and the pixel and byte limits."
    )
    lora_adapters: dict[str, str] = Field(
        default_factory=dict,
        description="LoRA adapters of the model, by the name request lines give as their "
        "`model` (a folder in the model cache or an s3:// prefix): this route serves lines "
        "naming the base model or any of them, in one batch and on one engine.",
    )
    sink: PgVectorSink | DeltaSink | None = Field(
        None,
        description="Where each completed batch's results also go, replaced whole under the "
        "batch id when the service finalizes it: a pipeline's sink settings (`kind: "
        "pgvector` with `url_env` and `table`, or `kind: delta` with `uri`). Embeddings and "
        "chat/completions routes.",
    )
    launch: Literal["run", "pool"] | None = Field(
        None,
        description="How this route's batch runs reach a worker: `pool` sends each batch to "
        "the model's engine pool (warm engines shared by every tenant's batches of this "
        "model: one engine build for many small batches); `run` starts a worker per batch. "
        "Unset: the deployment's choice (`batch_pipelines(launch=...)`, default `run`).",
    )

    row_reuse: Literal["auto", "sampled", "off"] = Field(
        "auto",
        description="Row reuse, as a pipeline's `row_reuse`: a line whose request (as "
        "rendered, with its parameters; not its custom_id) the batch's earlier output holds is "
        "copied from it, identical lines of a batch are computed once. auto: where the output "
        "is a function of the request (embeddings, score, greedy or seeded generation).",
    )
    row_reuse_scope: Literal["partition", "pipeline"] = Field(
        "partition",
        description="Where a line's request is looked up: `partition` (the batch's own "
        "earlier output) or `pipeline` (every completed batch of this route: a batch "
        "repeating earlier lines computes only the new ones). `pipeline` shares results "
        "across tenants (only for identical requests, but a tenant may tell from a batch's "
        "speed that another sent a line): set it where the tenants trust each other.",
    )

    @field_validator("endpoint")
    @classmethod
    def _known_endpoint(cls, endpoint: str) -> str:
        if endpoint not in ENDPOINTS:
            raise ValueError(
                f"route endpoint {endpoint!r} is not served by the worker; use one of "
                f"{sorted(ENDPOINTS)}"
            )
        return endpoint

    @field_validator("pipeline")
    @classmethod
    def _asset_name(cls, pipeline: str) -> str:
        if not _PIPELINE_NAME.match(pipeline):
            raise ValueError(
                f"route pipeline {pipeline!r} is not a valid Dagster asset name (letters, "
                "digits and underscores, not starting with a digit)"
            )
        return pipeline

    @field_validator("sink", mode="before")
    @classmethod
    def _sink_of_its_kind(cls, sink: Any) -> Any:
        return None if sink is None else sink_settings(sink)

    @model_validator(mode="before")
    @classmethod
    def _default_task(cls, data: Any) -> Any:
        if isinstance(data, Mapping) and not data.get("task") and data.get("endpoint"):
            own = ENDPOINTS.get(data["endpoint"])
            return {**data, "task": own[0]} if own else data
        return data

    @model_validator(mode="after")
    def _task_serves_endpoint(self) -> Route:
        serving = tasks_serving(self.endpoint)
        if self.endpoint not in TASKS.get(self.task, _NO_TASK).endpoints:
            raise ValueError(
                f"route {self.model!r}: task {self.task!r} does not serve {self.endpoint}; "
                f"the tasks there: {serving}"
            )
        if self.images is not None and not TASKS[self.task].images:
            raise ValueError(
                f"route {self.model!r}: `images` is for image tasks; {self.task!r} reads no "
                "images (set task: vision_chat for chat lines with image_url parts)"
            )
        if self.sink is not None:
            try:
                sink_layout(self.task)
            except ValueError as exc:
                raise ValueError(f"route {self.model!r}: sink: {exc}") from None
        return self

    @property
    def served_models(self) -> tuple[str, ...]:
        """The names lines may give as their `model` here: the base model's, its adapters'."""
        return (self.model, *self.lora_adapters)

    @property
    def partitions_name(self) -> str:
        """The dynamic partitions definition of this pipeline: one partition per batch."""
        return f"{self.pipeline}_batches"

    @property
    def job_name(self) -> str:
        return f"{self.pipeline}_job"


class RoutingTable(BaseModel):
    """All routes; `(model, endpoint)` and pipeline names are unique."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    routes: list[Route] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique(self) -> RoutingTable:
        seen: set[tuple[str, str]] = set()
        pipelines: set[str] = set()
        for route in self.routes:
            for model in route.served_models:  # a base model or one of its adapters
                if (model, route.endpoint) in seen:
                    raise ValueError(
                        f"the routing table lists model {model!r} on {route.endpoint} twice "
                        "(as a route's model or one of its lora_adapters)"
                    )
                seen.add((model, route.endpoint))
            if route.pipeline in pipelines:
                raise ValueError(f"the routing table names pipeline {route.pipeline!r} twice")
            pipelines.add(route.pipeline)
        return self

    def route_for(self, model: str, endpoint: str) -> Route | None:
        """The route serving `model` on `endpoint`: the route of that base model, or the
        route whose `lora_adapters` name it."""
        for route in self.routes:
            if model in route.served_models and route.endpoint == endpoint:
                return route
        return None

    def models_on(self, endpoint: str) -> list[str]:
        """Every name lines may give as `model` on `endpoint` (adapters included)."""
        return sorted(m for r in self.routes if r.endpoint == endpoint for m in r.served_models)

    def check_sink_variables(self) -> None:
        """Raise ValueError naming each pgvector sink whose URL variable (`url_env`) is not
        set in this process, which writes the routes' sinks."""
        unset = sorted(
            {
                f"{route.sink.url_env} (route {route.model!r})"
                for route in self.routes
                if isinstance(route.sink, PgVectorSink) and not os.environ.get(route.sink.url_env)
            }
        )
        if unset:
            raise ValueError(
                f"the routing table's pgvector sinks read their database URLs from variables "
                f"not set in the batch API service's environment: {', '.join(unset)}; set "
                "them (in Kubernetes: a Secret as an env var of the batch API Deployment)"
            )

    def by_pipeline(self, pipeline: str) -> Route | None:
        return next((route for route in self.routes if route.pipeline == pipeline), None)


def routing_table(routes: RoutingTable | Sequence[Route | Mapping[str, Any]]) -> RoutingTable:
    if isinstance(routes, RoutingTable):
        return routes
    return RoutingTable(routes=[Route.model_validate(route) for route in routes])


def load_routing_table(source: str | None = None) -> RoutingTable:
    """The routing table from a YAML/JSON file path or a `module:attribute` reference.

    Args:
        source: A path, or `package.module:NAME` naming a `RoutingTable` or a list of routes;
            default: the `GPUINFER_BATCH_ROUTES` environment variable.

    Raises:
        ValueError: no source is given, or it does not hold a valid routing table.
    """
    source = source or os.environ.get(ROUTES_ENV)
    if not source:
        raise ValueError(
            f"no batch routing table: set {ROUTES_ENV} to a YAML file or to "
            "`module:attribute` (e.g. assets.batch_pipelines:ROUTES), or pass --routes"
        )
    if ":" in source and not Path(source).exists():
        module_name, _, attribute = source.partition(":")
        value = getattr(importlib.import_module(module_name), attribute)
        return routing_table(value)
    import yaml

    try:
        raw = yaml.safe_load(Path(source).read_text())
    except OSError as exc:
        raise ValueError(f"cannot read the batch routing table {source}: {exc}") from None
    if isinstance(raw, list):
        raw = {"routes": raw}
    return RoutingTable.model_validate(raw)
