"""The benchmark suite keeps working: `python -m bench --smoke` runs each section on tiny
sizes and writes its report (the headline sections in `make test`, the others in the slow
case). Nothing here looks at a timing: the numbers of a smoke run
mean nothing, only that each contestant ran and each section produced its table."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent


# `make test` runs the sections the README's headline comes from and the cheap ones, the
# throughput section on embeddings (generation's engine path runs in the long-tail section);
# the others (each section its engine starts) and throughput on generation run in the slow
# case, `make test-all`.
HEADLINE_SECTIONS = "throughput,longtail,prefix,control-plane"
OTHER_SECTIONS = "replicas,amortization,memory,images"
POOLS_SECTION = "pools"  # engine pools: its own case, in `make test`
# Row reuse on its own (three engine starts), in `make test`'s engine tests.
INCREMENTAL_SECTION = "incremental"


def run_smoke(tmp_path: Path, only: str, tasks: str = "embed,generate") -> tuple[dict, Path]:
    """`python -m bench --smoke --only <only> --tasks <tasks>`: its results.json (asserted
    error-free) and its results folder."""
    results = tmp_path / "results"
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONPATH": os.pathsep.join(
            p for p in [str(REPO_ROOT), os.environ.get("PYTHONPATH", "")] if p
        ),
    }
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench",
            "--smoke",
            "--only",
            only,
            "--tasks",
            tasks,
            "--results",
            str(results),
            "--work",
            str(tmp_path / "work"),
            "--no-ray",
        ],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=2400,
    )
    report_json = results / "results.json"
    data = json.loads(report_json.read_text()) if report_json.exists() else {}
    # A failed section names itself and its traceback first; the log tail comes after.
    assert done.returncode == 0 and data.get("errors") == {}, (
        "\n\n".join(f"section {k} failed:\n{v}" for k, v in data.get("errors", {}).items())
        + "\n--- log tail ---\n"
        + done.stdout[-3000:]
        + done.stderr[-3000:]
    )
    return data, results


@pytest.mark.engine
def test_bench_smoke_runs_the_headline_sections_and_writes_the_report(tmp_path: Path) -> None:
    data, results = run_smoke(tmp_path, HEADLINE_SECTIONS, tasks="embed")
    assert_throughput_ran(data, "embed", rows=24)
    # The platform and the raw engine were given the very same engine arguments.
    assert data["throughput"]["embed"]["engine_kwargs"]["runner"] == "pooling"

    prefix = data["prefix_cache"]
    assert set(prefix["orders"]) == {"grouped", "input order", "raw input order"}
    assert prefix["same_outputs_both_orders"] is True

    longtail = data["longtail"]
    assert {"raw-vllm", "run-batch"} <= set(longtail["contestants"])
    for chunk_size in data["sizes"]["longtail_chunk_sizes"]:
        assert f"platform c{chunk_size}/raw-vllm" in longtail["ratios"]
    assert 1 <= longtail["lengths"]["min"] <= longtail["lengths"]["max"] <= longtail["max_tokens"]
    # Row i is sampled with seed i everywhere: the platform (from its params column) and raw
    # vLLM (per-request params), fresh or warm, generate the same tokens every round.
    tokens = {name: c["tokens"] for name, c in longtail["contestants"].items()}
    same_prompts = [n for n in tokens if n.startswith("platform") or n.startswith("raw-vllm")]
    assert len({t for n in same_prompts for t in tokens[n]}) == 1, tokens
    assert set(longtail["worker_split_summary"]) == {"start", "load", "inference", "shutdown"}
    # Every turn says what share of the CPU the host gave its other guests (/proc/stat).
    for name, contestant in longtail["contestants"].items():
        assert len(contestant["cpu_steal"]) == data["rounds"], name
        assert all(0 <= share <= 1 for share in contestant["cpu_steal"]), name

    control = data["control_plane"]
    measured = control["values"]
    assert measured["runs planned"] == -(-control["sizes"]["backfill"] // 4)
    assert measured["partitions requested by that tick"] == control["sizes"]["files"]
    assert measured["partitions registered"] == control["sizes"]["files"]

    report = (results / "RESULTS.md").read_text()
    assert "## Headline" in report and "## Long-tailed generation" in report
    assert "CPU stolen by the hypervisor" in report
    assert "## Control plane" in report and "runs planned" in report
    for plot in ("throughput.png", "prefix_cache.png"):
        assert (results / plot).stat().st_size > 0


def assert_throughput_ran(data: dict, task: str, *, rows: int) -> None:
    """Each contestant of the throughput section ran `task`, raw vLLM on a fresh engine and
    again warm, and the paired engine-build ratio is there."""
    res = data["throughput"][task]
    assert {"platform", "raw-vllm", "raw-vllm warm", "transformers"} <= set(res["contestants"])
    assert res["rows"] == rows
    assert {"platform/raw-vllm", "raw-vllm warm/raw-vllm"} <= set(res["ratios"])
    assert res["ratios"]["platform engine build/raw-vllm"]["seconds"]["n"] == data["rounds"]


@pytest.mark.engine
@pytest.mark.slow
def test_bench_smoke_runs_the_other_sections(tmp_path: Path) -> None:
    data, results = run_smoke(tmp_path, OTHER_SECTIONS + ",throughput", tasks="generate")
    assert_throughput_ran(data, "generate", rows=12)
    replicas = data["replicas"]
    assert set(replicas["settings"]) == {"1", "2"}
    assert all(run["model_loads"] == run["replicas"] for run in replicas["runs"])

    settings = data["amortization"]["settings"]
    assert [s["model_loads"] for s in settings] == [s["runs"] for s in settings]
    assert settings[0]["runs"] == data["amortization"]["partitions"]

    memory = data["memory"]["settings"][0]
    assert memory["rows"] == data["sizes"]["memory_rows"]
    assert memory["samples"], "the RSS sampler saw the worker"
    assert (results / "memory.png").stat().st_size > 0

    images = data["images"]
    assert {"platform", "raw", "transformers"} <= set(images["images_per_s"])
    assert images["decode"]["images_per_s"]["median"] > 0

    report = (results / "RESULTS.md").read_text()
    assert (
        "## Model-load amortization" in report and "## One partition, one engine or two" in report
    )
    assert (results / "amortization.png").stat().st_size > 0


@pytest.mark.engine
def test_bench_smoke_runs_the_pools_section(tmp_path: Path) -> None:
    """Engine pools against per-run launch on tiny sizes: every part ran, the pool kept its
    engine warm across runs, the killed worker lost no row, the pool emptied itself."""
    data, results = run_smoke(tmp_path, POOLS_SECTION)
    pools = data["pools"]
    assert pools["errors"] == {}
    arrivals = pools["arrivals"]
    assert arrivals["pool_runs"]["rows"] == arrivals["rows"]
    assert arrivals["one_run_per_run_launch"]["rows"] == arrivals["rows"]
    # One engine build for all the pool's runs: the first cold, every later one warm.
    assert arrivals["pool_runs"]["engine_builds"] == 1
    assert arrivals["pool_runs"]["warm_engine"] == [False] + [True] * (arrivals["partitions"] - 1)
    # Each side's one build is reported (the ratio without builds stands on them).
    builds = arrivals["engine_build_seconds"]
    assert builds["one_run"] > 0 and builds["pool"] > 0, builds
    assert arrivals["ratio_without_builds"] is not None
    skew = pools["skew"]
    expected_rows = skew["big_rows"] + skew["small_rows"] * (skew["partitions"] - 1)
    assert [s["launch"] for s in skew["settings"]] == ["pool"]  # per-run: the full run's
    for setting in skew["settings"]:
        assert setting["rows"] == expected_rows, setting
        assert setting["work_seconds"] > 0 and setting["span_seconds"] > 0, setting
    assert "skipped" in pools["batches"]  # a daemon and a run per batch: the full run's
    kill = pools["kill"]
    assert kill["partitions_committed"] == kill["partitions"]
    assert (kill["rows_lost"], kill["rows_duplicated"], kill["rows_unexpected"]) == (0, 0, 0)
    assert kill["rows_out"] == kill["rows_in"]
    assert kill["killed_partition_leases"] >= 2 and kill["expired_leases"] >= 1
    assert kill["victim_process_gone"] and kill["finished_by_another_worker"]
    zero = pools["scale_to_zero"]
    assert zero["pool_workers_listed"] == 0 and zero["processes_left"] == [], zero
    assert zero["worker_ids_seen"], "the watch saw the pool's workers"
    report = (results / "RESULTS.md").read_text()
    assert "## Engine pools" in report and "one run / pool runs" in report


def test_bench_smoke_incremental_re_run_computes_only_the_changed_rows(tmp_path: Path) -> None:
    data, results = run_smoke(tmp_path, INCREMENTAL_SECTION, tasks="embed")
    inc = data["incremental"]
    assert inc["rows"] == data["sizes"]["incremental_rows"]
    for r in inc["rounds"]:
        assert r["first"]["rows_computed"] == inc["rows"]
        changed = r["edited"] + r["appended"]
        assert r["rerun"]["rows_computed"] == changed
        assert r["rerun"]["rows_reused"] == inc["rows"] - r["edited"]
        assert r["full"]["rows_computed"] == r["full"]["rows_out"] == inc["rows"] + r["appended"]
        assert r["outputs"]["same_ids"] and r["outputs"]["max_abs_difference"] < 1e-4
    assert "## Incremental re-run (row reuse)" in (results / "RESULTS.md").read_text()


def test_every_section_is_in_one_smoke_case() -> None:
    """Each section the bench has is smoke-run by one of the two cases above."""
    from bench.__main__ import SECTIONS

    covered = set(HEADLINE_SECTIONS.split(",")) | set(OTHER_SECTIONS.split(",")) | {POOLS_SECTION}
    covered.add(INCREMENTAL_SECTION)
    assert covered == set(SECTIONS) - {"knobs"}  # knobs: engine settings, by hand


# The row order the benchmark measures (bench/backends.py): a pure
# function, no engine started.


def test_prefix_order_groups_rows_sharing_a_prefix_and_is_a_permutation() -> None:
    from bench.backends import prefix_order

    header_a, header_b = [1, 2, 3, 4], [9, 8, 7, 6]
    rows = [header_a + [5], header_b + [1], header_a + [2], header_b + [3], header_a + [9]]
    order = prefix_order(rows)
    assert sorted(order) == list(range(len(rows)))
    heads = [tuple(rows[i][:4]) for i in order]
    assert heads == sorted(heads)  # each header's rows are contiguous
    assert order[:3] == [2, 0, 4]
