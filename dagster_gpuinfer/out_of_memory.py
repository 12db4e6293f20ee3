"""What vLLM and torch say when memory runs out: one list for the worker and the control plane.

The worker uses it to tell an engine that could not start for lack of memory (transient:
the control plane may step the memory knobs down and relaunch) from a spec error; the
Kubernetes launcher uses it to classify a failed pod from the tail of its log. Standard
library only, so both sides import it.
"""

from __future__ import annotations

from typing import Literal

OUT_OF_MEMORY_MARKERS = (
    "cuda out of memory",
    "torch.outofmemoryerror",
    "outofmemoryerror",
    "out of memory",
    "no available memory for the cache blocks",
    "insufficient memory",
    "not enough memory",
)
"""Lowercase substrings of vLLM and torch messages for memory that ran out, at engine start
or during a batch."""

KV_CACHE_TOO_SMALL_MARKERS = (
    # vLLM before 0.10: the KV cache holds fewer tokens than one max_model_len sequence.
    "larger than the maximum number of tokens that can be stored in kv cache",
    # vLLM 0.10 and later: "... GiB KV cache is needed, which is larger than the available
    # KV cache memory (... GiB)".
    "larger than the available kv cache memory",
)
"""Lowercase substrings of vLLM's message for a KV cache smaller than one sequence of
`max_model_len` tokens. Less memory cannot fix this, so it is never stepped down."""

MemoryProblem = Literal["gpu_out_of_memory", "kv_cache_too_small"]


def memory_problem(text: str) -> MemoryProblem | None:
    """What `text` (an exception message or a log tail) says about memory, if anything.

    Examples:
        >>> memory_problem("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2 GiB")
        'gpu_out_of_memory'
        >>> memory_problem("KeyError: 'text'") is None
        True
    """
    lowered = text.lower()
    if any(marker in lowered for marker in KV_CACHE_TOO_SMALL_MARKERS):
        return "kv_cache_too_small"
    if any(marker in lowered for marker in OUT_OF_MEMORY_MARKERS):
        return "gpu_out_of_memory"
    return None
