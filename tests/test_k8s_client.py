"""The Kubernetes client (`dagster_gpuinfer.k8s.client`) against the fake cluster.

The fake API, clock and workers are in `k8s_fakes.py`; everything above the API boundary is
real (see there). Each test drives one row of the failure table in
`dagster_gpuinfer/k8s/failures.py` end to end: the step's outcome, its retries, the pods
created and deleted, and what the user reads.
"""

from __future__ import annotations

import json
import math

import dagster as dg
import kubernetes
import pytest
from dagster._serdes import serialize_value
from dagster_pipes import DAGSTER_PIPES_CONTEXT_ENV_VAR
from k8s_fakes import (
    CUDA_OOM,
    IMAGE,
    PENDING_TIMEOUT,
    POLL,
    FakeKubernetes,
    PodScript,
    _error_text,
    committing_worker,
    crashing_worker,
    failure_metadata,
    failures,
    fake_cluster_resource,
    launcher_config,
    materialize,
    pipeline,
    pipes_line,
    pod_spec_of,
    step_failure_message,
)

from dagster_gpuinfer.k8s.config import SecretEnvRef, SecretRefs

# --------------------------------------------------------------------------- success path


def test_partition_materializes_through_pipes_k8s_client_and_pod_is_deleted(tmp_path):
    cluster = FakeKubernetes(PodScript(pulling_for=30, worker=committing_worker()))

    result = materialize(tmp_path, cluster)

    assert result.success
    assert [pod.name for pod in cluster.created] == cluster.deleted, "every pod is deleted"
    pod = cluster.created[0]
    labels = pod.manifest["metadata"]["labels"]
    assert labels["dagster/run-id"] == result.run_id
    assert labels["gpuinfer.dagster.io/partition"] == "shard-0"
    assert labels["kueue.x-k8s.io/queue-name"] == "gpu-inference"
    env_names = [e["name"] for e in pod.manifest["spec"]["containers"][0]["env"]]
    assert DAGSTER_PIPES_CONTEXT_ENV_VAR in env_names, "Pipes context injected by PipesK8sClient"
    assert pod_spec_of(pod).partition_keys == ["shard-0"]
    materializations = result.asset_materializations_for_node("doc_embeddings")
    assert [m.partition for m in materializations] == ["shard-0"]
    assert materializations[0].metadata["rows_out"].value == 3
    checks = {c.check_name: c.passed for c in result.get_asset_check_evaluations()}
    assert checks == {"rows_balanced": True, "error_rate": True}


def test_fatal_worker_message_fails_without_retry(tmp_path):
    def fatal_worker(env: dict[str, str]) -> list[str]:
        payload = {
            "type": "fatal",
            "error_type": "bad_shard",
            "partition_key": "shard-0",
            "message": "shard in/shard-0.parquet does not exist",
        }
        return [
            pipes_line("opened", {"extras": {}}),
            pipes_line("report_custom_message", {"payload": payload}),
            pipes_line("closed", {}),
        ]

    cluster = FakeKubernetes(PodScript(worker=fatal_worker), PodScript(worker=fatal_worker))

    result = materialize(tmp_path, cluster)

    assert not result.success
    assert len(cluster.created) == 1, "a bad shard is not retried"
    assert "shard in/shard-0.parquet does not exist" in step_failure_message(result)


def test_a_pod_whose_worker_refuses_its_spec_exits_78_and_fails_without_retry(tmp_path):
    """The worker exits 78 after its `fatal` message (a refused spec): the pod is Failed,
    and the step fails once, not retried, with the worker's own reason."""

    def refusing_worker(env: dict[str, str]) -> list[str]:
        return [
            pipes_line("opened", {"extras": {}}),
            "2026-12-04 23:00:00,000 ERROR model directory '/models/nope' does not exist",
            pipes_line("closed", {}),
        ]

    cluster = FakeKubernetes(
        PodScript(worker=refusing_worker, exit_code=78),
        PodScript(worker=refusing_worker, exit_code=78),
    )

    result = materialize(tmp_path, cluster)

    assert not result.success
    assert len(cluster.created) == 1, "a refused spec is not retried"
    message = step_failure_message(result)
    assert "refused its job spec" in message and "Not retried" in message
    assert "model directory '/models/nope' does not exist" in message


# --------------------------------------------------------------------------- pending and queueing


def test_pending_pod_past_timeout_fails_retryable_and_is_deleted(tmp_path):
    cluster = FakeKubernetes(
        PodScript(unschedulable_for=math.inf), PodScript(unschedulable_for=math.inf)
    )

    result = materialize(tmp_path, cluster)

    assert not result.success
    assert len(cluster.created) == 2, "retryable: the retry policy launched a second pod"
    assert cluster.deleted == [pod.name for pod in cluster.created]
    message = step_failure_message(result)
    assert "Insufficient nvidia.com/gpu" in message, "the scheduler's reason is in the failure"
    assert "pod_pending_timeout" in message
    assert failure_metadata(result)["pod_failure"] == "unschedulable"
    per_pod = cluster.clock.now / 2
    assert PENDING_TIMEOUT < per_pod <= PENDING_TIMEOUT + 3 * POLL, (
        "failed at the timeout, not later"
    )


def test_pod_waiting_for_kueue_admission_is_not_failed_by_pending_timeout(tmp_path):
    cluster = FakeKubernetes(
        PodScript(queued_for=10 * PENDING_TIMEOUT, unschedulable_for=60, worker=committing_worker())
    )

    result = materialize(tmp_path, cluster)

    assert result.success
    assert len(cluster.created) == 1
    assert cluster.clock.now > 10 * PENDING_TIMEOUT


def test_kueue_queue_timeout_fails_retryable(tmp_path):
    cluster = FakeKubernetes(PodScript(queued_for=math.inf), PodScript(queued_for=math.inf))
    resource = fake_cluster_resource(cluster, k8s=launcher_config(queue_timeout=600.0))

    result = materialize(tmp_path, cluster, resource=resource)

    assert len(cluster.created) == 2
    assert failure_metadata(result)["pod_failure"] == "queue_timeout"
    assert "gpu-inference" in step_failure_message(result)
    assert cluster.deleted == [pod.name for pod in cluster.created]


def test_slow_image_pull_within_timeout_is_not_a_failure(tmp_path):
    cluster = FakeKubernetes(
        PodScript(unschedulable_for=100, pulling_for=150, worker=committing_worker())
    )

    assert materialize(tmp_path, cluster).success


# ------------------------------------------------------------------------- image and config errors


@pytest.mark.parametrize("reason", ["ErrImagePull", "ImagePullBackOff", "InvalidImageName"])
def test_image_pull_failure_fails_fast_without_retry_and_names_the_image(tmp_path, reason):
    script = PodScript(pulling_for=20, waiting_reason=reason, waiting_message="manifest unknown")
    cluster = FakeKubernetes(script, PodScript(worker=committing_worker()))

    result = materialize(tmp_path, cluster)

    assert not result.success
    assert len(cluster.created) == 1, "not retried"
    assert cluster.deleted == [cluster.created[0].name]
    message = step_failure_message(result)
    assert IMAGE in message and reason in message
    assert failure_metadata(result)["pod_failure"] == "image_pull"
    assert cluster.clock.now <= 20 + 2 * POLL, "fails at the first sight of the pull error"


def test_missing_secret_fails_not_retried_naming_the_secret(tmp_path):
    script = PodScript(
        waiting_reason="CreateContainerConfigError", waiting_message='secret "hf-token" not found'
    )
    cluster = FakeKubernetes(script, PodScript(worker=committing_worker()))

    result = materialize(tmp_path, cluster)

    assert len(cluster.created) == 1
    assert 'secret "hf-token" not found' in step_failure_message(result)
    assert failure_metadata(result)["pod_failure"] == "config_error"


def test_api_forbidden_is_not_retried_and_points_at_rbac(tmp_path):
    cluster = FakeKubernetes()
    cluster.create_error = kubernetes.client.ApiException(status=403, reason="Forbidden")
    cluster.create_error.body = json.dumps(
        {
            "message": 'pods is forbidden: User "system:serviceaccount:dagster:default" '
            'cannot create resource "pods"'
        }
    )

    result = materialize(tmp_path, cluster)

    message = step_failure_message(result)
    assert "deploy/rbac.yaml" in message and "cannot create resource" in message
    assert failure_metadata(result)["retryable"] is False


# --------------------------------------------------------------------------- out of memory


def test_oom_killed_worker_is_relaunched_once_with_smaller_batches_recorded_in_metadata(tmp_path):
    cluster = FakeKubernetes(
        PodScript(
            worker=crashing_worker("INFO loading weights"),
            exit_code=137,
            terminated_reason="OOMKilled",
        ),
        PodScript(worker=committing_worker()),
    )

    result = materialize(tmp_path, cluster, retry_policy=None)

    assert result.success
    first, second = (pod_spec_of(pod) for pod in cluster.created)
    assert (first.engine.max_num_seqs, second.engine.max_num_seqs) == (None, 128)
    assert (first.engine.gpu_memory_utilization, second.engine.gpu_memory_utilization) == (0.9, 0.8)
    assert first.spec_hash() == second.spec_hash(), "committed chunks stay valid"
    assert cluster.created[1].manifest["metadata"]["labels"]["gpuinfer.dagster.io/launch"] == "1"
    assert cluster.deleted == [pod.name for pod in cluster.created]
    metadata = result.asset_materializations_for_node("doc_embeddings")[0].metadata
    step_down = metadata["memory_step_down"].value
    assert step_down["max_num_seqs"] == {"from": None, "to": 128}
    assert step_down["gpu_memory_utilization"] == {"from": 0.9, "to": 0.8}
    assert "OOMKilled" in step_down["first_failure"]
    assert metadata["engine_args"].value["max_num_seqs"] == 128, "metadata shows what ran"


def test_cuda_out_of_memory_at_engine_start_is_stepped_down(tmp_path):
    cluster = FakeKubernetes(
        PodScript(worker=crashing_worker(*CUDA_OOM), exit_code=1),
        PodScript(worker=committing_worker()),
    )

    result = materialize(tmp_path, cluster, retry_policy=None)

    assert result.success
    assert len(cluster.created) == 2


def test_out_of_memory_twice_fails_with_a_hint_and_is_not_retried(tmp_path):
    oom = PodScript(worker=crashing_worker(), exit_code=137, terminated_reason="OOMKilled")
    cluster = FakeKubernetes(
        oom,
        PodScript(worker=crashing_worker(*CUDA_OOM), exit_code=1),
        PodScript(worker=committing_worker()),
    )

    result = materialize(tmp_path, cluster, retry_policy=dg.RetryPolicy(max_retries=2))

    assert not result.success
    assert len(cluster.created) == 2, "one step-down, then no more launches"
    message = step_failure_message(result)
    for hint in (
        "max_num_seqs",
        "gpu_memory_utilization",
        "k8s.memory_limit",
        "tensor_parallel_size",
    ):
        assert hint in message


def test_an_engine_death_after_an_oom_step_down_is_retried_not_called_out_of_memory(tmp_path):
    """Found by the chaos backfill (bench/chaos, seed 1): OOMKilled, the step-down pod's
    engine SIGKILLed (the worker exits 75 with its own engine-death line). That line said
    "out of memory" in its hint, so the launcher read the dead engine as a second
    out-of-memory and failed the step for good; 25 partitions went uncommitted."""
    from dagster_gpuinfer.worker.lifecycle import EXIT_ENGINE_DIED, engine_death_text

    death = engine_death_text(
        "the vLLM engine process VLLM::EngineCore (pid 23429) of model '/models/m' is gone"
    )
    cluster = FakeKubernetes(
        PodScript(worker=crashing_worker(), exit_code=137, terminated_reason="OOMKilled"),
        PodScript(worker=crashing_worker("ERROR " + death), exit_code=EXIT_ENGINE_DIED),
        PodScript(worker=committing_worker()),
    )

    result = materialize(tmp_path, cluster, retry_policy=dg.RetryPolicy(max_retries=2))

    assert result.success, step_failure_message(result)
    assert len(cluster.created) == 3, "step-down relaunch, then a retry after the dead engine"
    first_failure = _error_text(failures(result)[0].error)
    assert "out of memory twice" not in first_failure
    assert "exited with code 75" in first_failure, first_failure


def test_kv_cache_too_small_is_not_stepped_down(tmp_path):
    too_small = (
        "ValueError: The model's max seq len (32768) is larger than the maximum number of tokens "
        "that can be stored in KV cache (20000). Try increasing `gpu_memory_utilization` or "
        "decreasing `max_model_len` when initializing the engine."
    )
    cluster = FakeKubernetes(
        PodScript(worker=crashing_worker(too_small), exit_code=1),
        PodScript(worker=committing_worker()),
    )

    result = materialize(tmp_path, cluster)

    assert len(cluster.created) == 1
    assert "max_model_len" in step_failure_message(result)
    assert failure_metadata(result)["pod_failure"] == "kv_cache_too_small"


# --------------------------------------------------------------------------- disruptions


def test_evicted_pod_is_retried_and_the_retry_resumes_from_committed_work(tmp_path):
    evicted = PodScript(
        worker=committing_worker(commit=1),
        exit_code=137,
        pod_reason="Evicted",
        pod_message="The node was low on resource: memory. Threshold quantity: 100Mi.",
    )
    cluster = FakeKubernetes(evicted, PodScript(worker=committing_worker()))

    result = materialize(tmp_path, cluster, partitions=("shard-0", "shard-1"))

    assert result.success
    first_failure = _error_text(failures(result)[0].error)
    assert "Evicted" in first_failure and "resumes from the committed chunks" in first_failure
    assert pod_spec_of(cluster.created[0]).partition_keys == ["shard-0", "shard-1"]
    assert pod_spec_of(cluster.created[1]).partition_keys == ["shard-1"], "shard-0 was committed"
    assert sorted(
        m.partition for m in result.asset_materializations_for_node("doc_embeddings")
    ) == ["shard-0", "shard-1"]


@pytest.mark.parametrize(
    ("script", "words"),
    [
        (PodScript(exit_code=143, disruption="PreemptionByScheduler"), "PreemptionByScheduler"),
        (PodScript(exit_code=137, disruption="DeletionByTaintManager"), "DeletionByTaintManager"),
        (
            PodScript(exit_code=137, pod_reason="NodeLost", pod_message="node gpu-node-1 is lost"),
            "NodeLost",
        ),
        (PodScript(exit_code=137, pod_reason="DeadlineExceeded"), "activeDeadlineSeconds"),
    ],
    ids=["preempted", "node-not-ready", "node-lost", "deadline"],
)
def test_preempted_or_lost_pod_fails_retryable(tmp_path, script, words):
    script.worker = crashing_worker()
    cluster = FakeKubernetes(script, PodScript(worker=committing_worker()))

    result = materialize(tmp_path, cluster)

    assert result.success, "the retry policy ran the step again"
    assert len(cluster.created) == 2
    assert words in _error_text(failures(result)[0].error)


def test_pod_deleted_from_outside_while_running_fails_promptly(tmp_path):
    cluster = FakeKubernetes(
        PodScript(worker=crashing_worker("INFO chunk 3 of 40"), vanish_after_logs=True)
    )

    result = materialize(tmp_path, cluster, retry_policy=None)

    assert not result.success
    assert "deleted from outside" in step_failure_message(result)
    assert failure_metadata(result)["retryable"] is True
    assert cluster.polls_after_vanish <= 4, "noticed within two polls, not after a timeout"
    assert cluster.clock.now - cluster.vanished_at <= 2 * POLL


def test_a_preempted_pod_gone_before_the_next_poll_is_reported_as_preempted(tmp_path):
    """Found by the chaos backfill (bench/chaos): a preempted pod carries DisruptionTarget
    through its grace period, then the API server removes it; the launcher, polling, finds it
    gone. The failure names the preemption, not "deleted from outside or node lost"."""
    cluster = FakeKubernetes(
        PodScript(
            worker=crashing_worker("INFO chunk 3 of 40"),
            vanish_after_logs=True,
            disruption="PreemptionByScheduler",
        )
    )

    result = materialize(tmp_path, cluster, retry_policy=None)

    message = step_failure_message(result)
    assert "stopped by the cluster (PreemptionByScheduler)" in message, message
    assert "deleted from outside" not in message
    assert failure_metadata(result)["retryable"] is True


def test_worker_nonzero_exit_puts_its_last_error_lines_in_the_failure(tmp_path):
    traceback = [
        "Traceback (most recent call last):",
        '  File "/app/dagster_gpuinfer/worker/shard.py", line 88, in process_shard',
        "RuntimeError: replica 1 failed: NCCL error in: "
        "../csrc/distributed/c10d/ProcessGroupNCCL.cpp:1970",
    ]
    cluster = FakeKubernetes(PodScript(worker=crashing_worker(*traceback), exit_code=1))

    result = materialize(tmp_path, cluster, retry_policy=None)

    message = step_failure_message(result)
    assert "exited with code 1" in message
    assert "RuntimeError: replica 1 failed: NCCL error" in message
    assert "__dagster_pipes_version" not in message, "protocol lines are not error lines"
    assert failure_metadata(result)["pod_failure"] == "worker_crash"


def test_run_cancellation_deletes_the_pod(tmp_path):
    cluster = FakeKubernetes(
        PodScript(worker=crashing_worker("INFO chunk 1 of 40"), interrupt_after_logs=True),
        PodScript(worker=committing_worker()),
    )

    result = materialize(tmp_path, cluster, retry_policy=None)

    assert not result.success
    assert len(cluster.created) == 1
    assert cluster.deleted == [cluster.created[0].name]
    assert cluster.pods == {}


# --------------------------------------------------------------------------- secrets and pools


PLANTED = "planted-s3cr3t-value-7f3a9c"


def test_planted_secret_is_never_in_pod_bodies_dagster_logs_or_metadata(tmp_path, monkeypatch):
    # The control plane's own environment holds the secret too: nothing may forward it.
    monkeypatch.setenv("HF_TOKEN", PLANTED)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", PLANTED)
    secrets = {"hf-token": {"token": PLANTED}, "s3-creds": {"AWS_SECRET_ACCESS_KEY": PLANTED}}
    seen_by_worker: list[str] = []

    def worker(env: dict[str, str]) -> list[str]:
        seen_by_worker.extend([env["HF_TOKEN"], env["AWS_SECRET_ACCESS_KEY"]])
        return committing_worker()(env)

    config = launcher_config(
        secrets=SecretRefs(
            env=[SecretEnvRef(env_name="HF_TOKEN", secret_name="hf-token", key="token")],
            env_from=["s3-creds"],
        ),
    )
    cluster = FakeKubernetes(
        PodScript(worker=worker),
        PodScript(worker=crashing_worker("RuntimeError: boom"), exit_code=1),
        secrets=secrets,
    )
    instance = dg.DagsterInstance.ephemeral()
    pipe = pipeline(tmp_path, retry_policy=None)
    runs = [
        dg.materialize(
            [pipe.output_asset],
            partition_key=key,
            instance=instance,
            raise_on_error=False,
            resources={"gpu": fake_cluster_resource(cluster, k8s=config)},
        )
        for key in ("shard-0", "shard-1")
    ]

    assert runs[0].success and not runs[1].success
    assert seen_by_worker == [PLANTED, PLANTED], "the worker does get the secret, from the cluster"
    pod_env = cluster.created[0].manifest["spec"]["containers"][0]["env"]
    assert {
        "name": "HF_TOKEN",
        "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token", "optional": False}},
    } in pod_env
    for pod in cluster.created:
        assert PLANTED not in json.dumps(pod.manifest)
    for run in runs:
        for record in instance.all_logs(run.run_id):
            assert PLANTED not in serialize_value(record)
    for materialization in runs[0].asset_materializations_for_node("doc_embeddings"):
        assert PLANTED not in serialize_value(materialization)


def test_plain_env_with_a_credential_name_is_refused_before_any_pod(tmp_path):
    cluster = FakeKubernetes()
    resource = fake_cluster_resource(cluster, k8s=launcher_config(env={"HF_TOKEN": "hf_abc"}))

    result = materialize(tmp_path, cluster, resource=resource)

    assert cluster.created == []
    message = step_failure_message(result)
    assert "HF_TOKEN" in message and "secrets.env" in message


def test_step_outside_the_gpu_pool_is_logged_as_uncapped(tmp_path):
    def log_messages(pool: str | None) -> list[str]:
        cluster = FakeKubernetes(PodScript(worker=committing_worker()))
        instance = dg.DagsterInstance.ephemeral()
        pipe = pipeline(tmp_path / str(pool), pool=pool)
        result = dg.materialize(
            [pipe.output_asset],
            partition_key="shard-0",
            instance=instance,
            resources={"gpu": fake_cluster_resource(cluster, k8s=launcher_config(pool="gpu-h100"))},
        )
        assert result.success
        assert (
            cluster.created[0].manifest["metadata"]["labels"]["gpuinfer.dagster.io/pool"]
            == "gpu-h100"
        )
        return [entry.user_message for entry in instance.all_logs(result.run_id)]

    assert any("not capped" in message for message in log_messages(None))
    assert not any("not capped" in message for message in log_messages("gpu-h100"))


def test_launcher_k8s_without_pod_configuration_fails_with_what_to_set(tmp_path):
    cluster = FakeKubernetes()
    resource = fake_cluster_resource(cluster, k8s=None)

    result = materialize(tmp_path, cluster, resource=resource)

    assert "K8sLauncherConfig(image=" in step_failure_message(result)
    assert cluster.created == []


def test_production_client_loads_the_named_kubeconfig_and_context(tmp_path, monkeypatch):
    from dagster_gpuinfer.k8s.client import production_kubernetes_client

    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    kubeconfig = tmp_path / "kubeconfig.yaml"
    kubeconfig.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [
                    {"name": c, "cluster": {"server": f"https://{c}.example:6443"}}
                    for c in ("dev", "gpu")
                ],
                "users": [{"name": "u", "user": {"token": "t"}}],
                "contexts": [
                    {"name": c, "context": {"cluster": c, "user": "u"}} for c in ("dev", "gpu")
                ],
                "current-context": "dev",
            }
        )
    )
    config = launcher_config(kubeconfig_file=str(kubeconfig), kube_context="gpu")

    client = production_kubernetes_client(config)

    assert client.core_api.api_client.configuration.host == "https://gpu.example:6443"
