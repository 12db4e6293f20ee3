"""Asset checks on every partition a run touches, computed from the committed files.

The checks do not trust the worker's word: `rows_balanced` re-counts the rows of every part
file and of `errors.parquet` (Parquet footers, JSONL lines) against the manifest.
"""

from __future__ import annotations

from collections import Counter

import dagster as dg

from dagster_gpuinfer.resource import InferenceRunResult
from dagster_gpuinfer.storage import filesystem_for, partition_dir, verify_manifest

ROWS_BALANCED = "rows_balanced"
ERROR_RATE = "error_rate"


def check_results(
    result: InferenceRunResult, *, max_error_rate: float
) -> list[dg.AssetCheckResult]:
    assert result.spec is not None
    spec = result.spec
    problems: dict[str, list[str]] = {}
    over_threshold: dict[str, float] = {}
    error_types: Counter[str] = Counter()
    for key, manifest in sorted(result.manifests.items()):
        fs, path = filesystem_for(partition_dir(spec.output, key), spec.storage)
        found = verify_manifest(fs, path, manifest)
        if found:
            problems[key] = found
        rate = manifest.rows_errored / manifest.rows_in if manifest.rows_in else 0.0
        if rate > max_error_rate:
            over_threshold[key] = round(rate, 4)
        error_types.update(manifest.error_types)
    top = dict(error_types.most_common(5))
    return [
        dg.AssetCheckResult(
            check_name=ROWS_BALANCED,
            passed=not problems,
            metadata={
                "partitions_checked": len(result.manifests),
                "problems": dg.MetadataValue.json(problems),
            },
            description=None if not problems else f"{len(problems)} partition(s) do not balance",
        ),
        dg.AssetCheckResult(
            check_name=ERROR_RATE,
            passed=not over_threshold,
            metadata={
                "max_error_rate": max_error_rate,
                "partitions_over_threshold": dg.MetadataValue.json(over_threshold),
                "top_error_types": dg.MetadataValue.json(top),
            },
            description=None
            if not over_threshold
            else f"error rate above {max_error_rate:.0%} in {sorted(over_threshold)}; top "
            f"error types: {top}",
        ),
    ]
