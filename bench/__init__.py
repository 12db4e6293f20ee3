"""The dagster-gpuinfer benchmark suite: `python -m bench` (or `make bench`).

Every benchmark runs its contestants in one process tree, on the same rows and model,
interleaved round by round, several rounds; the report gives medians, spreads and, as the
headline, the ratio of each contestant to its reference measured within the same round.
"""
