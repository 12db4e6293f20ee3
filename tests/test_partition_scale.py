"""bench/partition_scale.py (`python -m bench.control_plane --scale 10000,100000`) at a tiny
size: every step runs and checks what it measured (keys listed, statuses, the sensor's new
partitions), and the project's share of a step is found in a profile. No timing asserted."""

from __future__ import annotations

import cProfile

from bench.partition_scale import measure_scale, ours_seconds, scan_pairs


def test_every_scale_step_runs_and_checks_its_counts_at_a_tiny_size(tmp_path):
    rows = measure_scale([150], work_dir=tmp_path)
    steps = [row["step"] for row in rows]
    assert len(steps) == 8 and steps[0] == "register 150 dynamic partitions"
    assert any(row.get("runs_planned") == 38 for row in rows)  # ceil(150 / 4)
    sensor = next(row for row in rows if row["step"].startswith("sensor evaluation"))
    assert sensor["ours_seconds_profiled"] > 0  # the arrival scan is the project's code
    mutation = next(row for row in rows if "GraphQL mutation" in row["step"])
    assert mutation["ours_seconds_profiled"] < mutation["seconds_profiled"]


def test_paired_scan_lists_every_file_at_each_size(tmp_path):
    rows = scan_pairs([20, 60], rounds=2, work_dir=tmp_path)
    assert [(r["round"], r["partitions"]) for r in rows] == [(0, 20), (0, 60), (1, 20), (1, 60)]


def test_the_project_share_excludes_the_dagster_calls_it_makes():
    from dagster_gpuinfer.arrivals import registered_file_keys

    profile = cProfile.Profile()
    profile.enable()
    registered_file_keys([f"k{i}@rows=0-10" for i in range(2000)])
    profile.disable()
    assert ours_seconds(profile) > 0
    empty = cProfile.Profile()
    empty.enable()
    sorted(range(1000))
    empty.disable()
    assert ours_seconds(empty) == 0


def test_paired_sensor_evaluations_find_the_new_files_at_each_size(tmp_path):
    from bench.partition_scale import sensor_pairs

    rows = sensor_pairs([30, 90], rounds=1, work_dir=tmp_path)
    assert [r["partitions"] for r in rows] == [30, 90]
