"""Bridges to dagster-aws: use the S3 settings of a `dagster_aws.s3.S3Resource` for workers.

The job spec never carries credentials. With the local launcher, the worker process gets
them in its environment (the standard AWS variables, which pyarrow's S3 client reads); in
a pod, reference a Kubernetes Secret instead (`envFrom`), never a literal value.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dagster_aws.s3 import S3Resource

# S3Resource field -> the AWS SDK environment variable every AWS client reads.
_CREDENTIAL_ENV = {
    "aws_access_key_id": "AWS_ACCESS_KEY_ID",
    "aws_secret_access_key": "AWS_SECRET_ACCESS_KEY",
    "aws_session_token": "AWS_SESSION_TOKEN",
    "profile_name": "AWS_PROFILE",
    "region_name": "AWS_DEFAULT_REGION",
}


def gpu_settings_from_s3_resource(s3: S3Resource) -> dict[str, Any]:
    """`GpuInferenceResource` fields that point local workers at the S3 an `S3Resource` uses.

    Returns:
        `s3_endpoint_url`, `s3_region`, `s3_allow_http` and `env` (the resource's explicit
        credentials or profile as AWS environment variables, for the worker subprocess).

    Examples:
        >>> s3 = S3Resource(endpoint_url="http://127.0.0.1:9000", region_name="us-east-1")
        >>> gpu = GpuInferenceResource(launcher="local", **gpu_settings_from_s3_resource(s3))
    """
    endpoint = s3.endpoint_url
    env = {
        variable: str(getattr(s3, field))
        for field, variable in _CREDENTIAL_ENV.items()
        if getattr(s3, field, None)
    }
    return {
        "s3_endpoint_url": endpoint,
        "s3_region": s3.region_name,
        "s3_allow_http": bool(endpoint and endpoint.startswith("http://")),
        "env": env,
    }
