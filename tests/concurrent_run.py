"""One Dagster run of the racing-runs test, as its own process (two runs = two processes).

`python tests/concurrent_run.py ROOT MODEL` materializes partition p0 of the test pipeline
on a fresh test instance; exit status 0 when the run succeeded.
"""

from __future__ import annotations

import sys
from pathlib import Path

import dagster as dg

sys.path.insert(0, str(Path(__file__).resolve().parent))

from support import cpu_resource, gen_pipeline, materialize_partitions  # noqa: E402


def main(root: str, model: str) -> int:
    pipeline = gen_pipeline(Path(root), model, chunk_size=20, retries=0)
    with dg.instance_for_test() as instance:
        result = materialize_partitions(
            pipeline, ["p0"], resource=cpu_resource(), instance=instance, raise_on_error=False
        )
    return 0 if result.success else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
