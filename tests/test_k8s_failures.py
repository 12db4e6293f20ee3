"""The failure table (`dagster_gpuinfer.k8s.failures`) on plain objects, without a cluster.

The rows that need a pod's whole life (pending, pulling, evicted, crashed) are driven end to
end in `test_k8s_client.py`; here are the pure helpers and the table's own rules.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import get_args

from k8s_fakes import IMAGE, pipes_line

from dagster_gpuinfer.k8s.failures import (
    FAILURE_TABLE,
    FailureKind,
    classify_pod_failure,
    last_error_lines,
)


def terminated_pod(
    *, exit_code: int, reason: str = "Error", message: str | None = None
) -> SimpleNamespace:
    """A pod whose one container terminated, as the API reports it (only the fields read)."""
    terminated = SimpleNamespace(exit_code=exit_code, reason=reason, message=message)
    state = SimpleNamespace(waiting=None, running=None, terminated=terminated)
    status = SimpleNamespace(
        phase="Failed",
        reason=None,
        message=None,
        conditions=[],
        container_statuses=[SimpleNamespace(name="worker", state=state, last_state=None)],
    )
    return SimpleNamespace(
        status=status, metadata=SimpleNamespace(namespace="team-a", deletion_timestamp=None)
    )


def test_classification_without_a_pod_is_deletion():
    failure = classify_pod_failure(pod=None, pod_name="p", image=IMAGE)
    assert (failure.kind, failure.retryable) == ("deleted", True)


def test_last_error_lines_keeps_the_last_traceback_and_drops_pipes_messages():
    log = "\n".join(
        [
            pipes_line("opened", {}),
            "Traceback (most recent call last):",
            "ValueError: old",
            "INFO retrying",
            "Traceback (most recent call last):",
            '  File "x.py", line 1',
            "KeyError: 'text'",
            pipes_line("closed", {}),
        ]
    )
    assert (
        last_error_lines(log)
        == "Traceback (most recent call last):\n  File \"x.py\", line 1\nKeyError: 'text'"
    )


def test_the_table_ends_with_a_row_that_matches_anything():
    kinds = {row.kind for row in FAILURE_TABLE}
    assert kinds <= set(get_args(FailureKind))
    assert FAILURE_TABLE[-1].kind == "unknown" and FAILURE_TABLE[-1].matches(None)  # type: ignore[arg-type]


def test_rows_match_in_order_the_oom_kill_wins_over_the_crash():
    failure = classify_pod_failure(
        pod=terminated_pod(exit_code=137, reason="OOMKilled"), pod_name="p", image=IMAGE
    )
    assert (failure.kind, failure.retryable) == ("out_of_memory", True)
    assert failure.detail["memory"] == "container_oom_killed"


def test_the_kv_cache_message_of_the_installed_vllm_is_not_stepped_down():
    log = (
        "ValueError: To serve at least one request with the model's max seq len (32768), "
        "(4.0 GiB KV cache is needed, which is larger than the available KV cache memory "
        "(1.2 GiB). Try increasing `gpu_memory_utilization` or decreasing `max_model_len`"
    )
    failure = classify_pod_failure(
        pod=terminated_pod(exit_code=1), pod_name="p", image=IMAGE, log_text=log
    )
    assert (failure.kind, failure.retryable) == ("kv_cache_too_small", False)
    assert "max_model_len" in failure.message and "larger than the available" in failure.message


def test_a_plain_crash_names_the_signal_and_shows_the_log_tail():
    failure = classify_pod_failure(
        pod=terminated_pod(exit_code=137), pod_name="p", image=IMAGE, log_text="KeyError: 'x'"
    )
    assert (failure.kind, failure.retryable) == ("worker_crash", True)
    assert "exited with code 137 (SIGKILL)" in failure.message
    assert failure.message.endswith("KeyError: 'x'")


def test_a_container_that_cannot_start_is_not_retried():
    pod = terminated_pod(
        exit_code=128,
        reason="StartError",
        message='exec: "python3": executable file not found in $PATH',
    )
    failure = classify_pod_failure(pod=pod, pod_name="p", image=IMAGE)
    assert (failure.kind, failure.retryable) == ("container_start", False)
    assert '"python3": executable file not found' in failure.message
    assert IMAGE in failure.message and "k8s.command" in failure.message
