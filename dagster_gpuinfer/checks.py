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
# Generation only: the share of output rows that fail their structured-output constraint.
VALID_OUTPUT = "valid_structured_output"


def check_results(
    result: InferenceRunResult,
    *,
    max_error_rate: float,
    max_invalid_output_rate: float | None = None,
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
    extra = []
    if max_invalid_output_rate is not None:
        extra.append(invalid_output_check(result, max_invalid_output_rate))
    return [
        *extra,
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


def invalid_output_check(result: InferenceRunResult, max_rate: float) -> dg.AssetCheckResult:
    """The share of output rows whose text fails its structured-output constraint (JSON
    schema, regex, choice), per partition and over the run, from the manifests."""
    shares: dict[str, float] = {}
    invalid = rows_out = 0
    for key, manifest in sorted(result.manifests.items()):
        invalid += manifest.rows_invalid_output
        rows_out += manifest.rows_out
        if manifest.rows_out:
            shares[key] = round(manifest.rows_invalid_output / manifest.rows_out, 4)
    over = {key: share for key, share in shares.items() if share > max_rate}
    share = invalid / rows_out if rows_out else 0.0
    return dg.AssetCheckResult(
        check_name=VALID_OUTPUT,
        passed=not over,
        metadata={
            "rows_invalid_output": invalid,
            "invalid_output_share": round(share, 4),
            "max_invalid_output_rate": max_rate,
            "invalid_share_by_partition": dg.MetadataValue.json(shares),
        },
        description=None
        if not over
        else f"{invalid} of {rows_out} outputs ({share:.1%}) fail their structured-output "
        f"constraint; above {max_rate:.0%} in {sorted(over)} (see output_error in the rows)",
    )
