"""Shared fixtures: real models, real Dagster instances, helpers to write shards and run.

Tests marked `engine` start the real vLLM CPU engine (about 25 s a start on 2 cores); they
share runs through module-scoped fixtures so the suite stays within its time budget.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import dagster as dg
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def minilm_dir() -> str:
    from assets.models import minilm_path

    return minilm_path()


@pytest.fixture(scope="session")
def tiny_llama_dir() -> str:
    from assets.models import make_tiny_llama
    from assets.paths import generation_model_dir

    return make_tiny_llama(generation_model_dir())


@pytest.fixture
def instance() -> Iterator[dg.DagsterInstance]:
    with dg.instance_for_test() as test_instance:
        yield test_instance
