"""`python -m bench.batch_load` in small: two real API processes over a fresh database of
the test PostgreSQL server, a few clients for a few seconds. It checks the load run works
and holds its invariants (no 5xx, nothing lost or duplicated, every batch final, every
output matching its input); it asserts no timing."""

from __future__ import annotations

import json

from support import postgres_server_url

from bench.batch_load import LoadConfig, percentile, run


def test_a_short_load_run_on_two_replicas_loses_nothing_and_ends_every_batch(tmp_path):
    server = postgres_server_url()
    config = LoadConfig(
        clients=6,
        seconds=4,
        tenants=3,
        postgres_url=server,
        results=tmp_path / "results",
        work=tmp_path / "work",
    )
    results = run(config, "smoke")
    totals = results["totals"]
    assert results["replicas_alive_at_end"] == [True, True]
    assert totals["server_errors_5xx"] == 0 and results["server_tracebacks"] == 0
    assert totals["transport_errors"] == {}
    assert totals["batches_created"] > 0 and totals["batches_listed"] == totals["batches_created"]
    for name in ("batches_lost", "batches_duplicated", "batches_unknown", "batches_not_final"):
        assert totals[name] == 0, name
    for name in ("files_lost", "files_duplicated", "files_unknown", "output_files_lost"):
        assert totals[name] == 0, name
    assert totals["outputs_wrong"] == 0
    assert results["endpoints"]["POST /batches"]["requests"] >= totals["batches_created"]
    written = json.loads((tmp_path / "results" / "results.json").read_text())
    assert written["totals"] == totals
    assert "| POST /files |" in (tmp_path / "results" / "RESULTS.md").read_text()


def test_percentile_is_the_nearest_rank():
    values = [float(v) for v in range(1, 101)]
    assert (percentile(values, 0.5), percentile(values, 0.99)) == (50.0, 99.0)
    assert percentile([3.0], 0.99) == 3.0
