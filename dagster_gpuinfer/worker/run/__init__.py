"""The run: a worker job (`job`: preflight, one engine or replicas placed on GPUs, and
`PartitionServer`, which serves partitions on an engine already built, for a run and for a
pool worker alike), the run's coordinator (`coordinator`: reads shards, hands out chunks,
commits partitions), the engine version check (`engine_version`), credentials by reference
(`env_references`) and the worker's messages as dicts (`reporting`). The
coordinator and the loop meet only through `worker.stage_messages`.
"""
