"""Where the batch API and the batch pipelines find their store, files and routes: one set
of environment variables read by both processes (the API service and the code location).

- `GPUINFER_BATCH_STORE_URL`: SQLAlchemy URL of the metadata store; default SQLite in
  `$DAGSTER_HOME/gpuinfer_batch_api.sqlite` (or `.data/` without DAGSTER_HOME). In
  deployment, the Dagster instance's PostgreSQL.
- `GPUINFER_BATCH_FILES_ROOT`: file bytes and batch outputs, local or `s3://bucket/prefix`;
  default `.data/batch_api` under the working directory.
- `GPUINFER_BATCH_ROUTES`: the routing table (routing.py).
- `GPUINFER_BATCH_WEBHOOKS`: a YAML file of webhook endpoints per tenant (webhooks.py); each
  names the environment variable holding its secret, never the secret.
- `GPUINFER_BATCH_LIMITS`: a YAML file of per-tenant rate limits and quotas (limits.py);
  without it every tenant gets the defaults there.
- `GPUINFER_S3_ENDPOINT`, `GPUINFER_S3_REGION`: an S3-compatible endpoint, as the resources.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel

from dagster_gpuinfer.spec import StorageOptions

Settings = TypeVar("Settings", bound=BaseModel)

STORE_URL_ENV = "GPUINFER_BATCH_STORE_URL"
FILES_ROOT_ENV = "GPUINFER_BATCH_FILES_ROOT"


def store_url() -> str:
    if os.environ.get(STORE_URL_ENV):
        return os.environ[STORE_URL_ENV]
    home = os.environ.get("DAGSTER_HOME")
    folder = Path(home) if home else Path.cwd() / ".data"
    folder.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{folder / 'gpuinfer_batch_api.sqlite'}"


def files_root() -> str:
    return os.environ.get(FILES_ROOT_ENV) or str(Path.cwd() / ".data" / "batch_api")


def storage_options() -> StorageOptions:
    endpoint = os.environ.get("GPUINFER_S3_ENDPOINT") or None
    return StorageOptions(
        endpoint_url=endpoint,
        region=os.environ.get("GPUINFER_S3_REGION") or None,
        allow_http=bool(endpoint and endpoint.startswith("http://")),
    )


def load_settings_file(
    model: type[Settings], source: str | os.PathLike | None, env: str, what: str
) -> Settings:
    """`model` read from the YAML (or JSON) file `source`, else the file `$env` names;
    `model()`, its defaults, without either.

    Raises:
        ValueError: the file does not hold valid settings; the message starts with `what`
            and the file, and names the field.
    """
    import yaml

    path = source or os.environ.get(env)
    if not path:
        return model()
    data = yaml.safe_load(Path(path).read_text()) or {}
    try:
        return model.model_validate(data)
    except ValueError as exc:
        raise ValueError(f"{what} {path}: {exc}") from None
