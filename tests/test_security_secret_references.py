"""Secrets stay references: `extra` refuses secret-looking keys, the env-name rule covers
*_PASS*, *_KEY, *TOKEN* and credentials in URLs, `gpu_settings_from_s3_resource` passes
`dg.EnvVar` names that the worker resolves itself.

Security findings of issue 12 (split from test_security.py by theme)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import dagster as dg
import pytest
from dagster_aws.s3 import S3Resource
from security_support import worker_spec

from dagster_gpuinfer import GpuInferenceResource
from dagster_gpuinfer.aws import gpu_settings_from_s3_resource
from dagster_gpuinfer.k8s.config import K8sLauncherConfig, PodSpecError
from dagster_gpuinfer.k8s.names import RunIdentity
from dagster_gpuinfer.k8s.pod import build_worker_pod
from dagster_gpuinfer.resource import InvalidInferenceSpec, validate_spec
from dagster_gpuinfer.secrets import (
    ENV_REFERENCES_VARIABLE,
    is_secret_env_name,
    is_secret_option_name,
    url_with_credentials,
)
from dagster_gpuinfer.spec import EngineArgs, SamplingParams

# --------------------------------------------------------------------------- secrets


@pytest.mark.parametrize(
    "name",
    ["DB_PASS", "DB_PASSWORD", "SMTP_PASSPHRASE", "OPENAI_KEY", "AWS_SECRET_KEY", "HF_TOKEN",
     "GITHUB_TOKEN_FILE", "MY_API_KEY", "CREDENTIALS_JSON", "TOKENIZER_HUB_TOKEN"],
)  # fmt: skip
def test_secret_env_names_are_refused_in_plain_env(name):
    assert is_secret_env_name(name)
    with pytest.raises(PodSpecError, match=rf"{name}.*SecretEnvRef"):
        build_worker_pod(
            worker_spec(),
            K8sLauncherConfig(image="w:1", env={name: "x"}),
            RunIdentity(run_id="r", asset_key="a"),
        )


@pytest.mark.parametrize(
    "name",
    ["HF_HUB_OFFLINE", "VLLM_LOGGING_LEVEL", "KEYBOARD", "PASSAGE_LIMIT", "TOKENIZERS_PARALLELISM"],
)
def test_honest_env_names_pass(name):
    assert not is_secret_env_name(name)
    pod = build_worker_pod(
        worker_spec(),
        K8sLauncherConfig(image="w:1", env={name: "false"}),
        RunIdentity(run_id="r", asset_key="a"),
    )
    entries = pod["spec"]["containers"][0]["env"]
    assert [item["value"] for item in entries if item["name"] == name] == ["false"]


def test_credentials_in_url_values_are_refused():
    assert url_with_credentials("postgresql://dagster:hunter2@db:5432/dagster")
    assert url_with_credentials("https://ghp_abc@github.com/x.git")
    assert not url_with_credentials("https://s3.us-east-1.amazonaws.com/bucket")
    assert not url_with_credentials("user@example.com")
    with pytest.raises(PodSpecError, match="DATABASE_URL.*credentials.*SecretEnvRef"):
        build_worker_pod(
            worker_spec(),
            K8sLauncherConfig(image="w:1", env={"DATABASE_URL": "postgres://u:p@db/x"}),
            RunIdentity(run_id="r", asset_key="a"),
        )


@pytest.mark.parametrize(
    "extra",
    [
        {"hf_token": "hf_abc"},
        {"api_key": "sk-1"},
        {"hf_overrides": {"access_token": "x"}},
        {"model_loader_extra_config": {"url": "s3://AKIA:secret@bucket/x"}},
        {"password": "x"},
    ],
)
def test_secret_looking_keys_in_engine_extra_are_refused_pointing_at_secret_env_ref(extra):
    with pytest.raises(ValueError, match="looks like a credential.*SecretEnvRef"):
        EngineArgs(extra=extra)
    with pytest.raises(InvalidInferenceSpec, match="SecretEnvRef"):
        validate_spec({**worker_spec().model_dump(), "engine": {"extra": extra}}, where="test")


def test_secret_looking_keys_in_sampling_extra_are_refused():
    with pytest.raises(ValueError, match=r"sampling.extra\['auth_token'\].*SecretEnvRef"):
        SamplingParams(extra={"auth_token": "x"})


@pytest.mark.parametrize(
    "key", ["stop_token_ids", "max_tokens", "tokenizer_mode", "skip_special_tokens",
            "allowed_token_ids", "kv_cache_dtype", "hf_overrides", "logit_bias"],
)  # fmt: skip
def test_vllm_option_names_with_token_in_them_pass(key):
    assert not is_secret_option_name(key)
    EngineArgs(extra={key: 1})


def test_a_secret_in_engine_overrides_fails_the_step_before_any_worker():
    gpu = GpuInferenceResource(engine_overrides={"extra": {"hf_token": "hf_abc"}})
    with pytest.raises(InvalidInferenceSpec, match="hf_token.*SecretEnvRef"):
        gpu.prepare_spec(worker_spec())


def test_s3_credentials_travel_as_env_var_names_and_the_worker_resolves_them(monkeypatch):
    s3 = S3Resource(
        endpoint_url="http://127.0.0.1:9000",
        region_name="us-east-1",
        aws_access_key_id=dg.EnvVar("MINIO_KEY"),
        aws_secret_access_key=dg.EnvVar("MINIO_SECRET"),
    )
    # No variable is set: nothing is resolved in the control plane.
    monkeypatch.delenv("MINIO_KEY", raising=False)
    settings = gpu_settings_from_s3_resource(s3)
    assert settings["env_references"] == {
        "AWS_ACCESS_KEY_ID": "MINIO_KEY",
        "AWS_SECRET_ACCESS_KEY": "MINIO_SECRET",
    }
    assert settings["env"] == {} and settings["s3_allow_http"] is True
    gpu = GpuInferenceResource(**settings)

    # What the local launcher hands the worker process: names only.
    from dagster_gpuinfer.resource import env_references_variable

    handed = env_references_variable(gpu.env_references)
    assert json.loads(handed[ENV_REFERENCES_VARIABLE]) == settings["env_references"]

    # The worker resolves them from its own environment, in its own process.
    worker_env = {**os.environ, **handed, "MINIO_KEY": "AKIA-LOCAL", "MINIO_SECRET": "s3cr3t"}
    worker_env.pop("AWS_SECRET_ACCESS_KEY", None)
    probe = (
        "import os\n"
        "from dagster_gpuinfer.worker.run.env_references import apply_env_references\n"
        "apply_env_references()\n"
        "print(os.environ['AWS_ACCESS_KEY_ID'], os.environ['AWS_SECRET_ACCESS_KEY'])\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], env=worker_env, capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == ["AKIA-LOCAL", "s3cr3t"]

    # A missing variable is named, and no value is printed.
    missing = {k: v for k, v in worker_env.items() if k != "MINIO_SECRET"}
    failed = subprocess.run(
        [sys.executable, "-c", probe], env=missing, capture_output=True, text=True, check=False
    )
    assert failed.returncode != 0 and "MINIO_SECRET" in failed.stderr
    assert "AKIA-LOCAL" not in failed.stderr


def test_literal_s3_credentials_are_refused_with_the_fix():
    s3 = S3Resource(aws_access_key_id="AKIA", aws_secret_access_key="literal")
    with pytest.raises(ValueError, match=r"aws_access_key_id.*dg.EnvVar"):
        gpu_settings_from_s3_resource(s3)


def test_env_references_cannot_reach_a_pod():
    gpu = GpuInferenceResource(
        launcher="k8s",
        k8s=K8sLauncherConfig(image="w:1"),
        env_references={"AWS_SECRET_ACCESS_KEY": "MINIO_SECRET"},
    )
    context = dg.build_asset_context()
    with pytest.raises(dg.Failure, match="Kubernetes Secret"):
        gpu._launch(context=context, spec=worker_spec())
