"""The reference batch API routing table and its batch pipelines.

`ROUTES` is what `python -m dagster_gpuinfer.batch_api serve --routes
assets.batch_pipelines:ROUTES` validates batches against (`make dev` starts it so), and
`batch_api` the pipelines and sensor this code location serves them with: the same table on
both sides. Model names are what request lines put in `body.model`.
"""

from __future__ import annotations

from assets.paths import cross_encoder_dir, embedding_model_dir, generation_model_dir
from dagster_gpuinfer.batch_api.pipelines import batch_pipelines
from dagster_gpuinfer.batch_api.routing import RoutingTable

ROUTES = RoutingTable(
    routes=[
        {
            "model": "all-MiniLM-L6-v2",
            "endpoint": "/v1/embeddings",
            "pipeline": "batch_embeddings",
            "model_path": embedding_model_dir(),
            "engine": {"dtype": "float32"},
            "chunk_size": 64,
        },
        {
            "model": "tiny-llama",
            "endpoint": "/v1/chat/completions",
            "pipeline": "batch_chat",
            "model_path": generation_model_dir(),
            "engine": {"max_model_len": 256},
            "sampling": {"temperature": 0.0, "max_tokens": 32},
            "chunk_size": 32,
        },
        {
            "model": "minilm-cross-encoder",
            "endpoint": "/v1/rerank",
            "pipeline": "batch_rerank",
            "model_path": cross_encoder_dir(),
            "engine": {"dtype": "float32"},
            "chunk_size": 32,
        },
    ]
)

batch_api = batch_pipelines(ROUTES)
