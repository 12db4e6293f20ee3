"""One engine across two pods, end to end: vLLM CPU tensor parallel 2 over two network
namespaces, launched by the k8s launcher as a pod group and run by the pod executor.

The launcher builds the group (`k8s.group`: headless Service, leader worker pod, follower
pod running `worker/follower.py`); `PodExecutor` (tests/pod_executor.py) runs each pod's
container for real in its own network namespace with its own pod IP, resolves the Service
to the leader through the pods' /etc/hosts, and the leader's Pipes messages come back
through `PipesK8sClient`. Outputs go to an S3 server on the pod network's gateway.

The model is the tiny Llama's shape (2 layers, hidden 128, head_dim 64, 2 heads: one per
rank) with an untied output projection scaled by 50, so the greedy argmax is never a
near-tie. Measured here: with `make_tiny_llama` (logits a few hundredths apart) 3 rows in 64
differed between TP=1 and TP=2 at the first token; with every weight drawn wide
(`initializer_range=0.5`) the network amplified the noise and 17 rows in 48 diverged after a
few tokens. All-reduce adds float32 partial sums in another order than one matmul does.

Both cases are `slow` (`make test-cluster` and `make test-all` run them): the TP=2 run alone
took minutes here (two engine processes on two shared cores, leader load ~100 s), past the
~90 s `make test` can give a case. The group's builder and lifecycle are in `make test`
(test_k8s_group.py, test_k8s_group_launch.py, test_follower.py: no engine).
"""

from __future__ import annotations

import io
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import dagster as dg
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pod_executor import PodExecutor, executor_resource, s3_on_pod_network

from dagster_gpuinfer import InputSpec, Manifest, inference_assets
from dagster_gpuinfer.k8s.group import ROLE_LABEL, GroupConfig
from resources.k8s import k8s_launcher_config

IMAGE = "registry.example.com/gpuinfer-worker:0.1.0"
NAMESPACE = "gpuinfer"
MODEL = "peaked-llama"
PARTITIONS = dg.StaticPartitionsDefinition(["p0", "p1"])
ROWS = 48
LM_HEAD_SCALE = 50.0


def make_peaked_llama(dst: Path) -> str:
    """The tiny Llama's shape with its output projection scaled up (no greedy near-ties)."""
    if (dst / "config.json").exists():
        return str(dst)
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from assets.models import minilm_path

    tokenizer = AutoTokenizer.from_pretrained(minilm_path())
    tokenizer.eos_token = tokenizer.sep_token
    config = LlamaConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=512,
        bos_token_id=tokenizer.cls_token_id,
        eos_token_id=tokenizer.sep_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    torch.manual_seed(7)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # wide logits from a calm network: argmax gaps >> float32 noise
        model.lm_head.weight.mul_(LM_HEAD_SCALE)
    model.save_pretrained(dst, safe_serialization=True)
    tokenizer.save_pretrained(dst)
    return str(dst)


@dataclass
class Cluster:
    executor: PodExecutor
    endpoint: str
    client: Any
    bucket: str
    model_cache: str

    def read(self, key: str) -> bytes:
        return self.client.get_object(Bucket=self.bucket, Key=key)["Body"].read()

    def resource(self, **group: Any) -> Any:
        config = k8s_launcher_config(
            {
                "GPUINFER_WORKER_IMAGE": IMAGE,
                "GPUINFER_NAMESPACE": NAMESPACE,
                "GPUINFER_MODEL_CACHE_HOST_PATH": self.model_cache,
                "GPUINFER_WORKER_CPU": "1",
                "GPUINFER_WORKER_MEMORY": "8Gi",
                "GPUINFER_SHM_SIZE": "1Gi",
                "GPUINFER_POD_PENDING_TIMEOUT": "120",
            }
        )
        placement = config.placement.model_copy(update={"gpu_resource_name": None})
        config = config.model_copy(update={"placement": placement, "poll_interval": 1.0})
        group.setdefault(
            "node_env",
            [{"VLLM_CPU_OMP_THREADS_BIND": "0"}, {"VLLM_CPU_OMP_THREADS_BIND": "1"}],
        )
        group.setdefault("follower_probe_interval", 2.0)
        return executor_resource(
            self.executor,
            k8s=config,
            k8s_group=GroupConfig(**group),
            s3_endpoint_url=self.endpoint,
            s3_region="us-east-1",
            s3_allow_http=True,
            engine_overrides={"gpu_memory_utilization": 0.2, "enforce_eager": True},
            env={"VLLM_LOGGING_LEVEL": "WARNING"},
        )


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[Cluster]:
    cache = tmp_path_factory.mktemp("model-cache")
    make_peaked_llama(cache / MODEL)
    for path in [cache, *cache.rglob("*")]:  # the pods run as UID 1000; pytest dirs are 0700
        path.chmod(0o755 if path.is_dir() else 0o644)
    bucket = "gpuinfer-multinode"
    with s3_on_pod_network(bucket) as (executor, endpoint, client):
        for key in PARTITIONS.get_partition_keys():
            table = pa.table(
                {
                    "id": [f"{key}-{i}" for i in range(ROWS)],
                    "text": [f"row {i} of {key}: tell me about {i * 7}" for i in range(ROWS)],
                }
            )
            sink = io.BytesIO()
            pq.write_table(table, sink)
            client.put_object(Bucket=bucket, Key=f"in/{key}.parquet", Body=sink.getvalue())
        yield Cluster(executor, endpoint, client, bucket, str(cache))


def pipeline(cluster: Cluster, name: str, max_tokens: int = 12, **parallel: Any) -> Any:
    return inference_assets(
        name=name,
        model=f"/models/{MODEL}",
        task="generate",
        input=InputSpec(uri=f"s3://{cluster.bucket}/in/{{partition_key}}.parquet"),
        output_root=f"s3://{cluster.bucket}/out",
        partitions_def=PARTITIONS,
        sampling={"max_tokens": max_tokens},
        chunk_size=8,
        retry_policy=dg.RetryPolicy(max_retries=1),
        **parallel,
    )


def run(cluster: Cluster, pipe: Any, keys: list[str], resource: Any) -> dg.ExecuteInProcessResult:
    return dg.materialize(
        pipe.assets,
        selection=[pipe.output_asset.key],
        instance=dg.DagsterInstance.ephemeral(),
        resources={"gpu": resource},
        tags={
            "dagster/asset_partition_range_start": keys[0],
            "dagster/asset_partition_range_end": keys[-1],
        },
        raise_on_error=False,
    )


def outputs(cluster: Cluster, asset: str, key: str) -> tuple[Manifest, dict[str, str]]:
    prefix = f"out/{asset}/{key}/"
    manifest = Manifest.model_validate_json(cluster.read(prefix + "_SUCCESS"))
    texts: dict[str, str] = {}
    ids: list[str] = []
    for part in manifest.parts:
        table = pq.read_table(io.BytesIO(cluster.read(prefix + part.name)))
        ids += table.column("id").to_pylist()
        texts.update(
            zip(table.column("id").to_pylist(), table.column("text").to_pylist(), strict=True)
        )
    assert len(ids) == len(set(ids)), "a row was written twice"
    return manifest, texts


def no_pods_left(cluster: Cluster, timeout: float = 20.0) -> bool:
    """Every pod of the run is gone (the leader's delete is asynchronous, as on a cluster)."""
    deadline = time.monotonic() + timeout
    while cluster.executor.pods and time.monotonic() < deadline:
        time.sleep(0.5)
    return not cluster.executor.pods


def roles(cluster: Cluster) -> list[str]:
    return [
        p.manifest["metadata"]["labels"].get(ROLE_LABEL, "single") for p in cluster.executor.created
    ]


@pytest.mark.engine
@pytest.mark.slow  # three engine starts, two of them across pods: minutes on 2 cores
@pytest.mark.xfail(
    strict=True,
    reason="OPEN: the group commits all 48 rows through the executor, but greedy TP=2 across "
    "pods equalled TP=1 on 42/48 rows (lm_head x50), 31/48 (wide weights); rows diverge late "
    "in the sequence. Needs a model/dtype where float32 all-reduce order cannot flip argmax",
)
def test_tp2_across_two_pods_commits_what_tp1_commits(cluster):
    tp2 = pipeline(cluster, "gen_tp2", tensor_parallel_size=2, nodes=2)
    result = run(cluster, tp2, ["p0"], cluster.resource())
    assert result.success, [e.message for e in result.all_events if e.is_step_failure]
    assert roles(cluster)[-2:] == ["follower", "leader"]
    follower, leader = cluster.executor.created[-2:]
    assert follower.ip != leader.ip and follower.netns != leader.netns
    assert no_pods_left(cluster), f"pods outlived the run: {list(cluster.executor.pods)}"

    tp1 = pipeline(cluster, "gen_tp1")
    assert run(cluster, tp1, ["p0"], cluster.resource()).success
    manifest2, texts2 = outputs(cluster, "gen_tp2", "p0")
    manifest1, texts1 = outputs(cluster, "gen_tp1", "p0")
    assert manifest2.rows_in == manifest2.rows_out == ROWS
    assert len(texts2) == ROWS and texts2 == texts1


@pytest.mark.engine
@pytest.mark.slow
@pytest.mark.xfail(
    strict=True,
    reason="OPEN: in its one run the kill trigger (a Pipes message line in a pod log) never "
    "matched, so the follower was not killed; the fast-failure path is covered on the fake "
    "cluster (test_k8s_group_launch.py). Needs a trigger the executor's logs carry",
)
def test_killed_follower_fails_the_group_fast_and_the_retry_commits_exactly_once(cluster):
    # Long outputs, so p1 is still generating when p0's commit is reported.
    tp2 = pipeline(cluster, "gen_kill", max_tokens=160, tensor_parallel_size=2, nodes=2)
    before = len(cluster.executor.created)
    killed: dict[str, Any] = {}

    def kill_follower_mid_run() -> None:
        # The leader's first committed partition: the engine runs across both pods.
        cluster.executor.wait_for_log(None, r"report_custom_message", 900)
        follower = next(
            p
            for p in cluster.executor.created[before:]
            if p.manifest["metadata"]["labels"].get(ROLE_LABEL) == "follower"
        )
        killed["name"] = follower.manifest["metadata"]["name"]
        killed["at"] = time.time()
        cluster.executor.oom_kill(killed["name"])

    killer = threading.Thread(target=kill_follower_mid_run, daemon=True)
    killer.start()
    result = run(cluster, tp2, ["p0", "p1"], cluster.resource())
    killer.join(timeout=5)
    assert "name" in killed, "the follower was never killed"
    retried = [e for e in result.all_events if e.event_type_value == "STEP_UP_FOR_RETRY"]
    assert retried, "the lost follower did not fail the attempt"
    assert retried[0].timestamp - killed["at"] < 120, "the group did not fail within 2 minutes"
    assert "follower pod" in str(retried[0].event_specific_data)
    assert result.success, [e.message for e in result.all_events if e.is_step_failure]
    for key in ("p0", "p1"):  # every row once: outputs() refuses a duplicate id
        manifest, texts = outputs(cluster, "gen_kill", key)
        assert manifest.rows_in == manifest.rows_out == ROWS and len(texts) == ROWS
    assert no_pods_left(cluster), f"pods outlived the run: {list(cluster.executor.pods)}"
