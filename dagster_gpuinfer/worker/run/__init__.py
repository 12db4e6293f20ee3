"""The run: a worker job (`job`: preflight, one engine or replicas placed on GPUs), the run's
coordinator (`coordinator`: reads shards, hands out chunks, commits partitions), the engine
version check (`engine_version`) and credentials by reference (`env_references`). The
coordinator and the loop meet only through `worker.stage_messages`.
"""
