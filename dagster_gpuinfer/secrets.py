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
    r"(secret|password|passwd|passphrase|credential|authorization|cookie|bearer"
    r"|private[_.-]?key|(^|[_.-])pass($|[_.-])|(^|[_.-])token$"
    r"|(^|[_.-])auth$|([_.-]|^)key$|apikey)",
    re.IGNORECASE,
)

# Values shaped like a credential, whatever their key is called: OpenAI / Anthropic keys
# (sk-...), AWS access key ids (AKIA..., ASIA...), Hugging Face tokens (hf_...), GitHub
# tokens (ghp_..., github_pat_...), Slack tokens (xox?-...), bearer headers, PEM private keys.
TOKEN_SHAPED = re.compile(
    r"(\bsk-[A-Za-z0-9_-]{16,}|\b(AKIA|ASIA)[0-9A-Z]{16}\b|\bhf_[A-Za-z0-9]{16,}"
    r"|\bgh[pousr]_[A-Za-z0-9]{20,}|\bgithub_pat_[A-Za-z0-9_]{20,}|\bxox[abposr]-[A-Za-z0-9-]{10,}"
    r"|\bbearer\s+[A-Za-z0-9._~+/-]{12,}|-----BEGIN [A-Z ]*PRIVATE KEY-----)",
    re.IGNORECASE,
)


def is_secret_env_name(name: str) -> bool:
    """Whether an environment variable called `name` usually holds a credential."""
    return bool(SECRET_ENV_NAME.search(name))


def is_secret_option_name(name: str) -> bool:
    """Whether an option (an `extra` key) called `name` usually holds a credential."""
    return bool(SECRET_OPTION_NAME.search(name))


def looks_like_token(value: str) -> bool:
    """Whether `value` holds something shaped like a credential (see `TOKEN_SHAPED`)."""
    return bool(TOKEN_SHAPED.search(value))


def holds_secret(value: Any) -> bool:
    """Whether `value`, or anything nested in it, looks like a credential: a secret-looking
    key, a token-shaped string, or a URL with a password (iterative: any depth)."""
    stack = [value]
    while stack:
        node = stack.pop()
        if isinstance(node, str):
            if looks_like_token(node) or url_with_credentials(node):
                return True
        elif isinstance(node, Mapping):
            for key, child in node.items():
                if isinstance(key, str) and is_secret_option_name(key):
                    return True
                stack.append(child)
        elif isinstance(node, (list, tuple, set)):
            stack.extend(node)
    return False


def validation_problems(exc: Any, *, limit: int = 20) -> list[str]:
    """`location: message (got value)` for each error of a pydantic `ValidationError`; the
    value only when it is a short scalar that holds no secret and its location names none,
    so a refused credential is never echoed (into Pipes, the event log, stderr)."""
    problems = []
    for error in exc.errors(include_input=True, include_url=False)[:limit]:
        location = ".".join(str(part) for part in error["loc"]) or "spec"
        problem = f"{location}: {error['msg']}"
        value = error.get("input")
        secret_place = any(
            isinstance(part, str) and (is_secret_option_name(part) or part in ("extra", "env"))
            for part in error["loc"]
        )
        shown = (
            error.get("type") != "missing"
            and "input" in error
            and not secret_place
            and isinstance(value, (str, int, float, bool))
            and len(repr(value)) <= 200
            and not holds_secret(value)
        )
        if shown:
            problem += f" (got {value!r})"
        problems.append(problem)
    return problems


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
    a secret-looking key anywhere in the nesting, or a value that is a URL with credentials
    or shaped like a token (`sk-...`, `AKIA...`, `hf_...`)."""

    stack: list[tuple[Any, str]] = [(options, where)]
    while stack:  # iterative: a deeply nested option cannot exhaust the stack
        node, path = stack.pop()
        if isinstance(node, Mapping):
            for key, value in reversed(list(node.items())):
                child = f"{path}[{key!r}]"
                if isinstance(key, str) and is_secret_option_name(key):
                    yield child
                else:
                    stack.append((value, child))
        elif isinstance(node, (list, tuple)):
            stack.extend(
                (value, f"{path}[{index}]") for index, value in reversed(list(enumerate(node)))
            )
        elif isinstance(node, str) and (url_with_credentials(node) or looks_like_token(node)):
            yield path


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
