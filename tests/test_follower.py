"""`worker/follower.py`: a follower joins its leader or fails fast, and ends with the leader.

The supervision is tested with real processes and a real listening socket standing in for
the leader's master port; the TP=2 engine across pods is in test_k8s_multinode_e2e.py.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from dagster_gpuinfer.worker.follower import (
    EXIT_CANNOT_JOIN,
    engine_cli_args,
    headless_command,
    parse_args,
    run_follower,
    stop_process_group,
    wait_for_leader,
    watch,
)


def listening() -> socket.socket:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    return server


def test_engine_args_become_vllm_serve_flags():
    flags = engine_cli_args(
        {
            "dtype": "auto",
            "enforce_eager": True,
            "enable_prefix_caching": False,
            "max_num_seqs": None,
            "runner": "pooling",
            "compilation_config": {"level": 0},
            "tensor_parallel_size": 8,  # the follower's own flag, not repeated
            "distributed_executor_backend": "mp",  # the leader's
        }
    )
    assert flags == [
        "--compilation-config",
        '{"level":0}',
        "--dtype",
        "auto",
        "--no-enable-prefix-caching",
        "--enforce-eager",
        "--runner",
        "pooling",
    ]


def test_headless_command_names_the_rank_and_the_leader():
    args = parse_args(
        ["--model", "/models/m", "--tensor-parallel-size", "2", "--nnodes", "2"]
        + ["--node-rank", "1", "--master-addr", "leader.ns.svc", "--master-port", "29511"]
    )
    command = headless_command(args)
    assert command[3:6] == ["serve", "/models/m", "--headless"]
    joined = " ".join(command)
    assert "--node-rank 1" in joined and "--master-addr leader.ns.svc" in joined
    assert "--master-port 29511" in joined and "--nnodes 2" in joined


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--node-rank", "0", "--master-addr", "x"], "rank 0 is the leader"),
        (["--node-rank", "2", "--master-addr", "x"], "not a follower rank"),
        (["--node-rank", "1"], "--master-addr"),
    ],
)
def test_bad_arguments_say_what_to_pass(argv, message, capsys, monkeypatch):
    monkeypatch.delenv("GPUINFER_MASTER_ADDR", raising=False)
    with pytest.raises(SystemExit):
        parse_args(["--model", "m", "--tensor-parallel-size", "2", "--nnodes", "2", *argv])
    assert message in capsys.readouterr().err


def test_follower_that_cannot_reach_its_leader_fails_fast(capsys):
    free = listening()
    port = free.getsockname()[1]
    free.close()  # nothing listens there now
    args = parse_args(
        ["--model", "m", "--tensor-parallel-size", "2", "--nnodes", "2", "--node-rank", "1"]
        + ["--master-addr", "127.0.0.1", "--master-port", str(port), "--join-timeout", "1"]
    )
    started = time.monotonic()
    assert run_follower(args) == EXIT_CANNOT_JOIN
    assert time.monotonic() - started < 10
    assert f"127.0.0.1:{port} did not accept connections" in capsys.readouterr().err


def test_leader_is_joined_once_its_port_opens():
    probes = iter([False, False, True])
    assert wait_for_leader(
        "h", 1, timeout=60, interval=0, probe=lambda h, p: next(probes), sleep=lambda s: None
    )


def test_follower_stops_vllm_when_the_leader_port_closes():
    leader = listening()
    host, port = leader.getsockname()
    # vLLM's headless server stands in as a process group that never exits by itself.
    process = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, sys, time; "
            "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
            "time.sleep(600)",
        ],
        start_new_session=True,
    )
    try:
        outcomes = []

        def probe(h: str, p: int) -> bool:
            if len(outcomes) == 3:
                leader.close()  # the leader finished
            outcomes.append(1)
            with socket.socket() as s:
                s.settimeout(1)
                return s.connect_ex((h, p)) == 0

        started = time.monotonic()
        outcome = watch(process, host, port, interval=0.05, failures=3, probe=probe)
        assert outcome == ("leader_gone", None)
        stop_process_group(process, grace=5)
        assert process.poll() is not None
        assert time.monotonic() - started < 10
    finally:
        if process.poll() is None:
            process.kill()


def test_follower_exits_with_vllm_when_vllm_exits_first():
    leader = listening()
    host, port = leader.getsockname()
    process = subprocess.Popen([sys.executable, "-c", "raise SystemExit(7)"])
    try:
        assert watch(process, host, port, interval=0.05, failures=3) == ("exited", 7)
    finally:
        leader.close()


def test_vllm_server_dies_when_the_follower_is_killed(tmp_path):
    script = tmp_path / "follower.py"
    script.write_text(
        "import subprocess, sys, time\n"
        "from dagster_gpuinfer.worker.follower import _die_with_parent\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'],"
        " start_new_session=True, preexec_fn=_die_with_parent)\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    follower = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    child = int(follower.stdout.readline())
    follower.kill()
    follower.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{child}/stat") as handle:
                if handle.read().split()[2] == "Z":
                    break
        except FileNotFoundError:
            break
        time.sleep(0.1)
    else:
        os.kill(child, 9)
        raise AssertionError("the vLLM server outlived its follower")
