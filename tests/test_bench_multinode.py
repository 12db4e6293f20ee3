"""bench/multinode.py's comparison of the two runs' outputs (no engine, no namespaces)."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq

from bench.multinode import _texts


def test_texts_reads_the_committed_parts_and_not_the_error_files(tmp_path):
    partition = tmp_path / "out-2" / "gen" / "p0"
    partition.mkdir(parents=True)
    pq.write_table(
        pa.table({"id": ["r0", "r1"], "text": ["a", "b"]}), partition / "part-h-0-x.parquet"
    )
    pq.write_table(pa.table({"id": ["r2"], "text": ["c"]}), partition / "part-h-1-x.parquet")
    pq.write_table(  # quarantined rows: other columns, never outputs
        pa.table({"id": ["r3"], "error_type": ["bad"]}), partition / "errors-h-x.parquet"
    )
    assert _texts(tmp_path, 2) == {"r0": "a", "r1": "b", "r2": "c"}
    assert _texts(tmp_path, 1) == {}
