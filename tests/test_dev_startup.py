"""`make dev` (deploy/local/dev.sh) on a new instance: the UI and the batch API come up
together every time, or the script says the API could not start and starts nothing else.

Started together on an empty DAGSTER_HOME, both used to create the SQLite storage at once;
the loser died (`table alembic_version already exists`) and a database could keep two
alembic heads for good. The script runs the real `dagster dev` and the real API here.
"""

from __future__ import annotations

import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from batch_api_support import free_port

REPO = Path(__file__).resolve().parent.parent


def _start(home: Path, api_port: int, ui_port: int, log: Path) -> subprocess.Popen:
    env = {
        **os.environ,
        "DAGSTER_HOME": str(home),
        "PY": sys.executable,
        "DAGSTER": str(Path(sys.executable).parent / "dagster"),
        "GPUINFER_API_PORT": str(api_port),
        "DAGSTER_UI_PORT": str(ui_port),
        "GPUINFER_API_WAIT_SECONDS": "180",
    }
    return subprocess.Popen(
        ["bash", "deploy/local/dev.sh"],
        cwd=REPO,
        env=env,
        stdout=open(log, "wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,  # dagster dev's code server and daemon share its group
    )


def _answers(url: str) -> bool:
    try:
        urllib.request.urlopen(url, timeout=2)
        return True
    except OSError:
        return False


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)


def _bring_up(tmp_path: Path, round_: int) -> None:
    home = tmp_path / f"home-{round_}"  # empty: the script copies dagster.yaml in
    api_port, ui_port = free_port(), free_port()
    log = tmp_path / f"dev-{round_}.log"
    process = _start(home, api_port, ui_port, log)
    try:
        deadline = time.monotonic() + 300
        api = ui = False
        while time.monotonic() < deadline and not (api and ui):
            assert process.poll() is None, log.read_text()[-3000:]
            api = api or _answers(f"http://127.0.0.1:{api_port}/openapi.json")
            ui = ui or _answers(f"http://127.0.0.1:{ui_port}/server_info")
            time.sleep(0.5)
        assert api and ui, f"api up: {api}, ui up: {ui}\n{log.read_text()[-3000:]}"
    finally:
        _stop(process)
    for database in home.rglob("*.db"):
        with sqlite3.connect(database) as connection:
            heads = connection.execute("select count(*) from alembic_version").fetchone()[0]
        assert heads == 1, f"{database} has {heads} alembic heads"


@pytest.mark.engine  # not an engine, but as heavy: dagster dev's code server and daemon
def test_the_ui_and_the_batch_api_come_up_together_on_a_new_instance(tmp_path):
    _bring_up(tmp_path, 0)


@pytest.mark.slow
@pytest.mark.engine
def test_the_ui_and_the_batch_api_come_up_together_every_time(tmp_path):
    for round_ in range(1, 4):
        _bring_up(tmp_path, round_)


def test_make_dev_stops_and_says_so_when_the_batch_api_cannot_start(tmp_path):
    api_port, ui_port = free_port(), free_port()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", api_port))
        taken.listen()
        log = tmp_path / "dev.log"
        process = _start(tmp_path / "home", api_port, ui_port, log)
        try:
            status = process.wait(180)
        finally:
            _stop(process)
    output = log.read_text()
    assert status == 1, output[-3000:]
    assert "the batch API exited" in output and "dagster dev was not started" in output
    assert not _answers(f"http://127.0.0.1:{ui_port}/server_info")
