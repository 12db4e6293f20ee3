"""Engine pools: warm engines shared across runs, fed from one durable queue of leases.

This package holds the foundation both sides import (no dagster, torch or vllm):

- `pool_key(spec)`: which pool a spec runs on (keys.py).
"""

from __future__ import annotations

from dagster_gpuinfer.pools.keys import pool_identity as pool_identity
from dagster_gpuinfer.pools.keys import pool_key as pool_key
