"""The task table: every task is one entry (`task_table.TASKS` + `worker.tasks.WORKER_TASKS`)
and no module outside it chooses among tasks by name."""

from __future__ import annotations

import re
from pathlib import Path
from typing import get_args

import pyarrow as pa
import pytest

from dagster_gpuinfer.task_table import ENDPOINTS, TASKS, Task, task_facts
from dagster_gpuinfer.worker.tasks.pooling import PoolingResult, ScorePairs
from dagster_gpuinfer.worker.tasks.table import WORKER_TASKS, WorkerTask, worker_task

PACKAGE = Path(__file__).resolve().parents[1] / "dagster_gpuinfer"
TABLE_MODULES = {PACKAGE / "task_table.py", PACKAGE / "worker" / "tasks.py"}
# A choice among tasks by name: `task == "embed"`, `spec.task in ("score", ...)`,
# `task != ...`, `task not in ...`, or the old set of pooling task names.
TASK_BRANCH = re.compile(r"task\s*(==|!=|in\s*[(\[{]|not\s+in\b)|POOLING_TASKS")


def test_no_module_outside_the_task_table_branches_on_the_task_name():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path in TABLE_MODULES:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if TASK_BRANCH.search(line.split("#", 1)[0]):
                found.append(f"{path.relative_to(PACKAGE.parent)}:{number}: {line.strip()}")
    assert not found, "branches on the task outside the task table:\n" + "\n".join(found)


def test_the_branch_pattern_catches_the_shapes_it_forbids():
    for line in (
        'if spec.task == "embed":',
        'if self.task in ("score", "classify"):',
        'elif task != "chat":',
        "if task not in POOLING_TASKS:",
    ):
        assert TASK_BRANCH.search(line), line
    assert not TASK_BRANCH.search("if task_facts(spec.task).pooling:")


def test_every_task_has_its_facts_and_its_worker_entry():
    assert set(get_args(Task)) == set(TASKS) == set(WORKER_TASKS)
    for name, entry in WORKER_TASKS.items():
        assert entry.name == name
        assert entry.facts is TASKS[name]
        # Each entry writes its own rows and answers its own OpenAI body.
        assert type(entry).output_table is not WorkerTask.output_table, name
        assert type(entry).response_body is not WorkerTask.response_body, name
        if not entry.facts.streams:
            assert type(entry).run_chunk is not WorkerTask.run_chunk, name


def test_facts_say_what_each_task_is():
    assert [n for n, f in TASKS.items() if f.pooling] == [
        "embed",
        "score",
        "classify",
        "image_embed",
    ]
    assert [n for n, f in TASKS.items() if f.samples] == [
        "generate",
        "chat",
        "vision_generate",
        "vision_chat",
    ]
    assert [n for n, f in TASKS.items() if f.images] == [
        "image_embed",
        "vision_generate",
        "vision_chat",
    ]
    assert [n for n, f in TASKS.items() if not f.streams] == ["score", "classify"]
    assert [n for n, f in TASKS.items() if f.groups_prefixes] == ["generate", "chat"]
    assert ENDPOINTS["/v1/rerank"] == ("score", "query")
    assert ENDPOINTS["/v1/chat/completions"] == ("chat", "messages")
    assert {task for task, _ in ENDPOINTS.values()} == {"embed", "generate", "chat", "score"}


def test_an_unknown_task_names_the_tasks_there_are():
    with pytest.raises(ValueError, match="unknown task 'rank'; the tasks are embed, generate"):
        task_facts("rank")
    with pytest.raises(ValueError, match="unknown task 'rank'"):
        worker_task("rank")


class _Valid:
    def __init__(self, ids, pairs=(), requests=()):
        self.ids, self.pairs, self.requests = list(ids), list(pairs), list(requests)


def test_score_and_classify_rows_come_out_in_their_own_schemas():
    valid = _Valid(["a", "b"], pairs=[ScorePairs(["q"], ["d"]), ScorePairs(["q"] * 2, ["x", "y"])])
    scores = PoolingResult(scores=[[0.5], [0.1, 0.9]], prompt_tokens=[3, 6])
    table = worker_task("score").output_table(None, valid, scores)
    assert table.column("score").to_pylist() == [0.5, None]
    assert table.column("endpoint").to_pylist() == ["score", "score"]
    probs = PoolingResult(probs=[[0.25, 0.75]], labels=["positive"], prompt_tokens=[4])
    table = worker_task("classify").output_table(None, _Valid(["c"]), probs)
    assert table.schema.field("probs").type == pa.list_(pa.float32())
    body = worker_task("classify").response_body("m", "r1", 7, table.to_pylist()[0], None, 0)
    assert body["data"] == [
        {"index": 0, "label": "positive", "probs": [0.25, 0.75], "num_classes": 2}
    ]
