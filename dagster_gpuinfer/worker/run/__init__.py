"""The run: a worker job (`job`: preflight, one engine or replicas placed on GPUs, and
`run_partition`, the public entry that computes one partition on an engine already built:
a run, a pool worker and bench/ all serve through it or its `serve_partitions`), the run's
coordinator (`coordinator`: reads shards, hands out chunks, commits partitions), the engine
version check (`engine_version`), credentials by reference (`env_references`) and the
worker's messages as dicts (`reporting`). The coordinator and the loop meet only through
`worker.stage_messages`.
"""
