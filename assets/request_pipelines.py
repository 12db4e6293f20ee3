"""Two reference pipelines beyond embedding and plain completion.

- `ticket_fields`: structured extraction. Every support ticket becomes a JSON object that
  validates against `TicketFields` (vLLM's structured outputs constrain decoding; each output
  is checked again after generation, and the `valid_structured_output` check reports the share
  that fails). The local model is a random-weight test Llama, so the fields are nonsense, but
  every output is JSON of the declared shape: swap in a real instruct model for real fields.
- `passage_rerank`: reranking. Each input line is an OpenAI Batch `/v1/rerank` request (a
  query and its candidate passages) scored by a cross-encoder; the output is OpenAI Batch
  JSONL (passages best first, with scores) and `errors.jsonl` answers the lines that failed.

`python -m assets.prepare` writes their inputs and models (`make demo` does it).
"""

from __future__ import annotations

from typing import Literal

import dagster as dg
from pydantic import BaseModel, Field

from assets.paths import cross_encoder_dir, input_root, output_root, structured_model_dir
from dagster_gpuinfer import EngineArgs, InputSpec, SamplingParams, inference_assets

TICKET_SHARDS = dg.StaticPartitionsDefinition([f"tickets-{i:03d}" for i in range(2)])
RERANK_SHARDS = dg.StaticPartitionsDefinition([f"queries-{i:03d}" for i in range(2)])


class TicketFields(BaseModel):
    """What the extraction pipeline pulls out of each ticket."""

    product: Literal["app", "website", "billing", "hardware"]
    urgency: int = Field(ge=1, le=5, description="1 (whenever) to 5 (now)")
    # A pattern rather than max_length: xgrammar (vLLM's default structured-output backend)
    # lets raw control characters into max_length strings, which is not valid JSON.
    summary: str = Field(pattern=r"^[A-Za-z0-9 ,.'-]{0,40}$")


# vLLM's JSON whitespace switch is an engine setting: compact JSON, and a weak model cannot
# pad an object with whitespace until it runs out of tokens.
COMPACT_JSON = {
    "structured_outputs_config": {"backend": "xgrammar", "disable_any_whitespace": True}
}

ticket_fields = inference_assets(
    name="ticket_fields",
    model=structured_model_dir(),
    task="generate",
    input=InputSpec(
        uri=f"{input_root()}/ticket_texts/{{partition_key}}.parquet",
        id_column="ticket_id",
        text_column="prompt",
    ),
    input_asset_key="ticket_texts",
    output_root=output_root(),
    partitions_def=TICKET_SHARDS,
    engine=EngineArgs(max_model_len=512, extra=COMPACT_JSON),
    sampling=SamplingParams(max_tokens=120, structured_outputs={"json": TicketFields}),
    chunk_size=64,
    group_name="structured",
    description="Structured extraction: each ticket as JSON validating against TicketFields",
)

passage_rerank = inference_assets(
    name="passage_rerank",
    model=cross_encoder_dir(),
    task="score",
    input=InputSpec(uri=f"{input_root()}/rerank/{{partition_key}}.jsonl", format="openai_batch"),
    input_asset_key="rerank_requests",
    output_root=output_root(),
    output_format="openai_batch",
    partitions_def=RERANK_SHARDS,
    engine=EngineArgs(dtype="float32"),
    chunk_size=64,
    group_name="reranking",
    description="OpenAI Batch /v1/rerank lines scored by a MiniLM cross-encoder",
)

extract_tickets_job = dg.define_asset_job(
    "extract_ticket_fields",
    selection=[ticket_fields.output_asset.key],
    partitions_def=TICKET_SHARDS,
)
rerank_job = dg.define_asset_job(
    "rerank_passages", selection=[passage_rerank.output_asset.key], partitions_def=RERANK_SHARDS
)
