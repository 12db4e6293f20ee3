"""A refused secret is never echoed: not by pydantic (`input_value=`), not in a Pipes
message, not in a log line, not in a step failure. The deny-list covers credential names
(authorization, cookie, bearer, passphrase, private_key*) and token-shaped values."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from pydantic import ValidationError

from dagster_gpuinfer import GpuInferenceResource, InferenceSpec
from dagster_gpuinfer.resource import InvalidInferenceSpec, validate_spec
from dagster_gpuinfer.secrets import (
    find_secrets_in_options,
    is_secret_option_name,
    looks_like_token,
)

# Made-up values of real credential shapes (none is a live credential).
TOKENS = {
    "openai": "sk-proj-Zq8wXv3Rt6Yu9Io0Pa1Sd2Fg",
    "aws": "AKIAZ7QW3ER5TY6UI8OP",
    "hf": "hf_QwErTyUiOpAsDfGhJkLzXcVbNm",
    "github": "ghp_0123456789abcdefABCDEF0123456789ab",
}
SECRET = TOKENS["hf"]


def spec_dict(**overrides) -> dict:
    spec = {
        "model": "/models/m",
        "task": "generate",
        "input": {"uri": "/in/{partition_key}.jsonl"},
        "output": {"root": "/out", "asset_name": "a"},
        "partition_keys": ["p"],
    }
    spec.update(overrides)
    return spec


@pytest.mark.parametrize(
    "name",
    ["authorization", "Authorization", "session_cookie", "cookie", "bearer", "bearer_token",
     "ssh_passphrase", "private_key_pem", "private_key", "tls.private-key", "PrivateKey"],
)  # fmt: skip
def test_credential_names_are_on_the_deny_list(name):
    assert is_secret_option_name(name)


@pytest.mark.parametrize("name", ["max_tokens", "tokenizer", "logit_bias", "seed", "keyword"])
def test_honest_names_are_not(name):
    assert not is_secret_option_name(name)


@pytest.mark.parametrize("value", [*TOKENS.values(), "Bearer abcdefghijklmnop.qrs"])
def test_token_shaped_values_are_refused_under_any_key(value):
    assert looks_like_token(value)
    assert list(find_secrets_in_options({"hf_overrides": {"note": [value]}}, "engine.extra"))
    with pytest.raises(ValidationError) as caught:
        InferenceSpec.model_validate(spec_dict(engine={"extra": {"hf_overrides": {"x": value}}}))
    assert value not in str(caught.value)


@pytest.mark.parametrize("value", ["skip-special", "hf_hub", "AKIA", "sk-short", "bearer"])
def test_values_that_merely_start_alike_pass(value):
    assert not looks_like_token(value)


@pytest.mark.parametrize(
    "spec",
    [
        spec_dict(engine={"extra": {"hf_token": SECRET}}),
        spec_dict(engine={"extra": {"authorization": f"Bearer {SECRET}"}}),
        spec_dict(sampling={"extra": {"cookie": SECRET}}),
        spec_dict(engine={"extra": {"private_key_pem": SECRET}}),
        spec_dict(sampling={"max_tokens": SECRET}),  # a type error holding a token
        spec_dict(model={"token": SECRET}),
        spec_dict(storage={"endpoint_url": 5, "region": SECRET, "bogus": SECRET}),
    ],
)
def test_a_refused_spec_never_echoes_the_secret(spec, tmp_path):
    # pydantic's own message
    with pytest.raises(ValidationError) as caught:
        InferenceSpec.model_validate(spec)
    assert SECRET not in str(caught.value) and SECRET not in repr(caught.value)
    # the control plane's message (a Dagster step failure)
    with pytest.raises(InvalidInferenceSpec) as refused:
        validate_spec(spec, where="asset a")
    assert SECRET not in str(refused.value)
    # the worker: every message it prints (the Pipes messages, as JSON lines) and every log
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    done = subprocess.run(
        [sys.executable, "-m", "dagster_gpuinfer.worker", "--spec", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    messages = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [m["type"] for m in messages] == ["fatal"], done.stdout + done.stderr
    assert "does not validate" in messages[0]["message"]
    assert SECRET not in done.stdout and SECRET not in done.stderr


def test_a_secret_in_engine_overrides_is_not_echoed_by_the_step_failure():
    gpu = GpuInferenceResource(engine_overrides={"extra": {"passphrase": SECRET}})
    spec = InferenceSpec.model_validate(spec_dict())
    with pytest.raises(InvalidInferenceSpec) as refused:
        gpu.prepare_spec(spec)
    assert "passphrase" in str(refused.value) and SECRET not in str(refused.value)


def test_safe_values_are_still_shown_to_help():
    with pytest.raises(InvalidInferenceSpec, match=r"task: .*\(got 'summarize'\)"):
        validate_spec(spec_dict(task="summarize"), where="asset a")
