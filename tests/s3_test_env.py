"""Credentials of the loopback S3 server (moto) the tests start: one module that both
`conftest.py` and test modules import (a test module cannot import `conftest` by name: the
suite has two, tests/ and tests/k8s/)."""

S3_TEST_ENV = {
    "AWS_ACCESS_KEY_ID": "gpuinfer-test-key",
    "AWS_SECRET_ACCESS_KEY": "gpuinfer-test-secret",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_REGION": "us-east-1",
    # No instance-metadata lookups: credentials come from the environment above.
    "AWS_EC2_METADATA_DISABLED": "true",
}
