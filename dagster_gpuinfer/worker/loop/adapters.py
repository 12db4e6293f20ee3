"""LoRA adapters made ready for the engine: local folders checked, `s3://` prefixes fetched
into the worker's adapter cache, and one `vllm.lora.request.LoRARequest` per adapter.

A pipeline lists its adapters by name (`InferenceSpec.lora_adapters`); each row names its
own (`RowRequest.adapter`) and the engine adds it with that adapter's `LoRARequest`. vLLM
caches a loaded adapter by its integer id, so `AdapterIds` gives each (name, folder,
version) its own id for the life of the engine: a pool worker's next job with the same
adapter reuses the loaded one, new files under the same name get a new id (never the old
weights).

vLLM's CPU build applies the last LoRA slot to the rows of a batch that name no adapter:
its PyTorch punica ops (`vllm/lora/ops/torch_ops/lora_ops.py`, `bgmv_shrink` /
`bgmv_expand`, vLLM 0.32) index the stacked weights with each token's slot, and a token
without an adapter has slot -1, which Python reads as the last one. Seen here: in a batch
mixing base rows with two adapters, every base row answered as the adapter in the last
slot (GPU kernels skip -1). So on the CPU build a base row runs on `zeroed_adapter`, a
copy of a listed adapter with every `lora_B` weight zero: its delta is exactly zero, and
no token has slot -1. It takes one more slot (`resolve_cpu_lora`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import posixpath
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any

import pyarrow.fs as pafs

from dagster_gpuinfer.spec import InferenceSpec, StorageOptions
from dagster_gpuinfer.storage.files import filesystem_for
from dagster_gpuinfer.storage.versions import adapter_version
from dagster_gpuinfer.worker.errors import SpecError

log = logging.getLogger("dagster_gpuinfer.worker")

# Where `s3://` adapters are fetched to (a folder per prefix and version).
ADAPTER_CACHE_ENV = "GPUINFER_ADAPTER_CACHE"
ADAPTER_CONFIG = "adapter_config.json"
# vLLM's default `max_lora_rank` (vllm.config.lora.LoRAConfig).
VLLM_DEFAULT_MAX_LORA_RANK = 16


@dataclass(frozen=True)
class ReadyAdapter:
    """One adapter on this machine: its name, local folder and version (lineage)."""

    name: str
    folder: str
    version: str


def adapter_cache_root() -> str:
    """`GPUINFER_ADAPTER_CACHE`, else `<temp dir>/gpuinfer-adapters`."""
    return os.environ.get(ADAPTER_CACHE_ENV) or os.path.join(
        tempfile.gettempdir(), "gpuinfer-adapters"
    )


def check_local_adapters(spec: InferenceSpec) -> None:
    """Every local adapter folder holds an `adapter_config.json` whose rank the engine takes
    (`s3://` ones are checked once fetched, by `ready_adapters`).

    Raises:
        SpecError: a folder is missing, is not a PEFT adapter, or its rank is too high.
    """
    for name, path in spec.lora_adapters.items():
        if not path.startswith("s3://"):
            _check_adapter_folder(spec, name, os.path.expanduser(path.removeprefix("file://")))


def ready_adapters(spec: InferenceSpec) -> dict[str, ReadyAdapter]:
    """Each listed adapter as a local folder: a local one checked, an `s3://` one fetched
    into the adapter cache (once per prefix and version) and checked.

    Raises:
        SpecError: an adapter is missing, unreadable, not a PEFT adapter or of too high a
            rank; retrying will not help.
    """
    ready = {}
    for name, path in spec.lora_adapters.items():
        try:
            version = adapter_version(spec, name)
        except FileNotFoundError as exc:
            raise SpecError(
                f"LoRA adapter {name!r} ({path}) is not there: {exc}. Point "
                f"lora_adapters[{name!r}] at a PEFT adapter folder (adapter_config.json and "
                "weights) or an s3:// prefix holding one"
            ) from None
        if path.startswith("s3://"):
            folder = fetch_s3_adapter(path, version, spec.storage)
        else:
            folder = os.path.expanduser(path.removeprefix("file://"))
        _check_adapter_folder(spec, name, folder)
        ready[name] = ReadyAdapter(name=name, folder=folder, version=version)
    return ready


def fetch_s3_adapter(uri: str, version: str, storage: StorageOptions) -> str:
    """The adapter under the `s3://` prefix `uri`, copied into the adapter cache: a folder
    named by the prefix and its version, written under a temporary name and renamed into
    place, so a half-fetched copy is never used and a changed prefix gets a new folder."""
    key = hashlib.sha256(f"{uri}\0{version}".encode()).hexdigest()[:16]
    folder = os.path.join(adapter_cache_root(), key)
    if os.path.isdir(folder):
        return folder
    os.makedirs(adapter_cache_root(), exist_ok=True)
    fs, prefix = filesystem_for(uri, storage)
    prefix = prefix.rstrip("/")
    staging = tempfile.mkdtemp(prefix=f".tmp-{key}-", dir=adapter_cache_root())
    try:
        found = fs.get_file_info(pafs.FileSelector(prefix, recursive=True))
        for info in found:
            if info.type != pafs.FileType.File:
                continue
            relative = info.path[len(prefix) :].lstrip("/")
            target = os.path.join(staging, *relative.split("/"))
            os.makedirs(os.path.dirname(target), exist_ok=True)
            with fs.open_input_stream(info.path) as source, open(target, "wb") as sink:
                shutil.copyfileobj(source, sink, 1 << 20)
        os.replace(staging, folder)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        if os.path.isdir(folder):  # another worker fetched it first
            return folder
        raise
    log.info("fetched LoRA adapter %s into %s", uri, folder)
    return folder


def _check_adapter_folder(spec: InferenceSpec, name: str, folder: str) -> None:
    config_path = os.path.join(folder, ADAPTER_CONFIG)
    if not os.path.isfile(config_path):
        raise SpecError(
            f"LoRA adapter {name!r} folder {folder!r} has no {ADAPTER_CONFIG}, so it is not a "
            "PEFT adapter vLLM can load. Point lora_adapters at the folder `save_pretrained` "
            "wrote"
        )
    try:
        with open(config_path) as handle:
            rank = int(json.load(handle).get("r") or 0)
    except (OSError, ValueError, TypeError) as exc:
        raise SpecError(f"LoRA adapter {name!r}: {config_path} cannot be read ({exc})") from None
    limit = spec.engine.max_lora_rank or VLLM_DEFAULT_MAX_LORA_RANK
    if rank > limit:
        raise SpecError(
            f"LoRA adapter {name!r} has rank {rank}, more than engine.max_lora_rank={limit}; "
            f"set engine.max_lora_rank to at least {rank}"
        )


# The zero adapter's name in the engine: never a row's (not a valid adapter name).
BASE_ADAPTER = "<base>"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def resolve_cpu_lora(kwargs: dict[str, Any], *, on_cpu: bool | None = None) -> dict[str, Any]:
    """`kwargs` with one more `max_loras` on vLLM's CPU build when LoRA is on: the slot of
    the zero adapter base rows run on there (see the module's docstring)."""
    if not kwargs.get("enable_lora"):
        return kwargs
    if on_cpu is None:
        from dagster_gpuinfer.worker.loop.cpu_dtype import vllm_on_cpu

        on_cpu = vllm_on_cpu()
    if not on_cpu:
        return kwargs
    return {**kwargs, "max_loras": int(kwargs.get("max_loras") or 1) + 1}


def zeroed_adapter(source: ReadyAdapter) -> ReadyAdapter:
    """`source` with every `lora_B` weight zero (its delta to the base model is exactly
    zero), written once into the adapter cache: what base rows run on, on the CPU build.

    Raises:
        SpecError: `source` keeps its weights in another format than safetensors.
    """
    weights = os.path.join(source.folder, ADAPTER_WEIGHTS)
    if not os.path.isfile(weights):
        raise SpecError(
            f"LoRA adapter {source.name!r} has no {ADAPTER_WEIGHTS}; on vLLM's CPU build base "
            "rows run on a zeroed copy of an adapter, which needs safetensors weights. Save "
            "the adapter with safe_serialization (peft's default)"
        )
    key = hashlib.sha256(f"zero\0{source.folder}\0{source.version}".encode()).hexdigest()[:16]
    folder = os.path.join(adapter_cache_root(), f"zero-{key}")
    if not os.path.isdir(folder):
        from safetensors.torch import load_file, save_file

        os.makedirs(adapter_cache_root(), exist_ok=True)
        staging = tempfile.mkdtemp(prefix=f".tmp-zero-{key}-", dir=adapter_cache_root())
        tensors = load_file(weights)
        for name, tensor in tensors.items():
            if "lora_B" in name or "lora_embedding_B" in name:
                tensor.zero_()
        save_file(tensors, os.path.join(staging, ADAPTER_WEIGHTS))
        shutil.copy(os.path.join(source.folder, ADAPTER_CONFIG), staging)
        try:
            os.replace(staging, folder)
        except OSError:  # another worker wrote it first
            shutil.rmtree(staging, ignore_errors=True)
    return ReadyAdapter(name=BASE_ADAPTER, folder=folder, version=f"zero:{source.version}")


class AdapterIds:
    """The engine's `LoRARequest`s: one integer id per (name, folder, version), for the
    life of the engine (vLLM caches a loaded adapter by its id)."""

    def __init__(self) -> None:
        self._ids: dict[tuple[str, str, str], int] = {}

    def requests(self, adapters: dict[str, ReadyAdapter]) -> dict[str, Any]:
        """A `LoRARequest` per adapter name."""
        from vllm.lora.request import LoRARequest

        made = {}
        for name, adapter in adapters.items():
            key = (name, posixpath.normpath(adapter.folder), adapter.version)
            lora_id = self._ids.setdefault(key, len(self._ids) + 1)
            made[name] = LoRARequest(name, lora_id, adapter.folder)
        return made
