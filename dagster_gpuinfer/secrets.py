"""What looks like a credential: the one rule the spec, the pod builder and the AWS bridge share.

Secrets travel only as references (a Kubernetes Secret key, an environment variable's name),
never as values in a spec, a resource's plain config, a pod's plain `env`, asset metadata or
the Pipes context. This module names the shapes that give a value away, so each of those
places can refuse it with a message that says where the value belongs instead.

Standard library only: the control plane and the worker both import it.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Any
from urllib.parse import urlsplit

ENV_REFERENCES_VARIABLE = "GPUINFER_ENV_REFERENCES"
"""Carries `GpuInferenceResource.env_references` (variable names, never values) to a local
worker, which copies the values from its own environment (dagster_gpuinfer.worker)."""

# Environment variable names that usually hold credentials (matched anywhere, any case):
# *TOKEN*, *SECRET*, *PASSWORD*, *PASSWD*, *_PASS* (DB_PASS, SMTP_PASSPHRASE), *CREDENTIAL*,
# *PRIVATE_KEY*, *API_KEY*, *ACCESS_KEY*, *SESSION_KEY*, and any name ending in _KEY
# (OPENAI_KEY, AWS_SECRET_KEY). TOKENIZER is not a token: the Hugging Face libraries'
# TOKENIZERS_PARALLELISM, which every worker sets, holds no credential.
SECRET_ENV_NAME = re.compile(
    r"(TOKEN(?!IZER)|SECRET|PASSWORD|PASSWD|_PASS|CREDENTIAL|PRIVATE_KEY|API_KEY|ACCESS_KEY"
    r"|SESSION_KEY|_KEY$|^KEY$)",
    re.IGNORECASE,
)

# Option names (keys of an `extra` mapping, vLLM keyword arguments) that hold credentials.
# Narrower than the environment rule, because vLLM has many honest option names with
# "token" in them (max_tokens, stop_token_ids, tokenizer): here a name is secret when a
# secret word ends it (hf_token, api_key, password) or one of the unambiguous words appears
# anywhere (secret, password, passwd, credential).
SECRET_OPTION_NAME = re.compile(
    r"(secret|password|passwd|credential|(^|[_.-])pass($|[_.-])|(^|[_.-])token$"
    r"|(^|[_.-])auth$|([_.-]|^)key$|apikey)",
    re.IGNORECASE,
)


def is_secret_env_name(name: str) -> bool:
    """Whether an environment variable called `name` usually holds a credential."""
    return bool(SECRET_ENV_NAME.search(name))


def is_secret_option_name(name: str) -> bool:
    """Whether an option (an `extra` key) called `name` usually holds a credential."""
    return bool(SECRET_OPTION_NAME.search(name))


def url_with_credentials(value: str) -> bool:
    """Whether `value` is a URL carrying a password (`scheme://user:password@host/...`)."""
    if "://" not in value or "@" not in value:
        return False
    try:
        parts = urlsplit(value.strip())
    except ValueError:
        return False
    return parts.password is not None or (bool(parts.username) and "@" in parts.netloc)


def find_secrets_in_options(options: Mapping[str, Any], where: str) -> Iterator[str]:
    """Paths (`where['a']['b']`) of the keys and values in `options` that look like secrets:
    a secret-looking key anywhere in the nesting, or a URL with credentials as a value."""

    def walk(node: Any, path: str) -> Iterator[str]:
        if isinstance(node, Mapping):
            for key, value in node.items():
                child = f"{path}[{key!r}]"
                if isinstance(key, str) and is_secret_option_name(key):
                    yield child
                else:
                    yield from walk(value, child)
        elif isinstance(node, (list, tuple)):
            for index, value in enumerate(node):
                yield from walk(value, f"{path}[{index}]")
        elif isinstance(node, str) and url_with_credentials(node):
            yield path

    yield from walk(options, where)


def secret_in_options_message(path: str) -> str:
    """Why a secret-looking entry of an `extra` mapping is refused, and what to do instead."""
    return (
        f"{path} looks like a credential; the spec travels in the Pipes context, the pod's "
        "annotations and asset metadata, so a value here is readable by anyone who can read "
        "those. Keep it out of the spec: put it in a Kubernetes Secret and give it to the "
        "worker as an environment variable with k8s.secrets.env=[SecretEnvRef(env_name="
        "'HF_TOKEN', secret_name=..., key=...)] (locally: set it in the worker's "
        "environment); vLLM and the Hugging Face libraries read HF_TOKEN from there"
    )
