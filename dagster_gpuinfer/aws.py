"""Bridges to dagster-aws: use the S3 settings of a `dagster_aws.s3.S3Resource` for workers.

The job spec never carries credentials, and neither does the resource's config: a credential
travels as the *name* of an environment variable (`dg.EnvVar`), which the worker reads from
its own environment when it starts. The control plane never resolves it. In a pod, reference
a Kubernetes Secret instead (`K8sLauncherConfig.secrets.env_from`, `secrets.env`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import dagster as dg

if TYPE_CHECKING:
    from dagster_aws.s3 import S3Resource

# S3Resource field -> the AWS SDK environment variable every AWS client reads.
_CREDENTIAL_ENV = {
    "aws_access_key_id": "AWS_ACCESS_KEY_ID",
    "aws_secret_access_key": "AWS_SECRET_ACCESS_KEY",
    "aws_session_token": "AWS_SESSION_TOKEN",
}
# Fields that are no secret: a literal value may travel as plain environment.
_PLAIN_ENV = {"profile_name": "AWS_PROFILE"}


def _configured(s3: S3Resource, field: str) -> Any:
    """The value the resource was configured with, unresolved: a `dg.EnvVar` stays one
    (reading the attribute would resolve it, or raise outside a run)."""
    return s3.__dict__.get(field)


def gpu_settings_from_s3_resource(s3: S3Resource) -> dict[str, Any]:
    """`GpuInferenceResource` fields that point workers at the S3 an `S3Resource` uses.

    Returns:
        `s3_endpoint_url`, `s3_region`, `s3_allow_http` (a `dg.EnvVar` endpoint or region
        stays one, for Dagster to resolve at run time), `env` (the profile, if any) and
        `env_references`: for each credential configured as `dg.EnvVar("NAME")`, the AWS
        variable the worker gets and the name it is copied from in the worker's environment.

    Raises:
        ValueError: a credential is a literal string: it would end up in the resource's
            config (and the UI). Configure it with `dg.EnvVar`, or leave it unset for the
            standard AWS chain (instance role, IRSA, a Kubernetes Secret).

    Examples:
        >>> s3 = S3Resource(
        ...     endpoint_url="http://127.0.0.1:9000",
        ...     aws_access_key_id=dg.EnvVar("MINIO_KEY"),
        ...     aws_secret_access_key=dg.EnvVar("MINIO_SECRET"),
        ... )
        >>> gpu = GpuInferenceResource(launcher="local", **gpu_settings_from_s3_resource(s3))
    """
    references: dict[str, str] = {}
    for field, variable in _CREDENTIAL_ENV.items():
        value = _configured(s3, field)
        if value is None or value == "":
            continue
        if not isinstance(value, dg.EnvVar):
            raise ValueError(
                f"S3Resource.{field} is a literal value; gpu_settings_from_s3_resource passes "
                "credentials to workers only by reference. Configure it as "
                f"{field}=dg.EnvVar('NAME') (the worker reads NAME from its environment as "
                f"{variable}), or leave it unset and let the worker use the standard AWS chain "
                "(instance role, IRSA, or a Kubernetes Secret via k8s.secrets.env_from)"
            )
        references[variable] = value.env_var_name
    env: dict[str, str] = {}
    for field, variable in _PLAIN_ENV.items():
        value = _configured(s3, field)
        if isinstance(value, dg.EnvVar):
            references[variable] = value.env_var_name
        elif value:
            env[variable] = str(value)
    endpoint = _configured(s3, "endpoint_url")
    region = _configured(s3, "region_name")
    return {
        "s3_endpoint_url": endpoint or None,
        "s3_region": region or None,
        "s3_allow_http": bool(
            endpoint and not isinstance(endpoint, dg.EnvVar) and endpoint.startswith("http://")
        ),
        "env": env,
        "env_references": references,
    }
