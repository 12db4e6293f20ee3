"""The task table: every task is one entry (`task_table.TASKS` + `worker.tasks.WORKER_TASKS`,
and the bench's workloads in `bench.task_workloads.WORKLOADS`) and no module outside them
chooses among tasks by name, in the package or in bench/."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import get_args

import pyarrow as pa
import pytest

from dagster_gpuinfer.task_table import ENDPOINTS, TASKS, Task, task_facts
from dagster_gpuinfer.worker.tasks.pooling import PoolingResult, ScorePairs
from dagster_gpuinfer.worker.tasks.table import WORKER_TASKS, WorkerTask, worker_task

ROOT = Path(__file__).resolve().parents[1]
SEARCHED = (ROOT / "dagster_gpuinfer", ROOT / "bench")
TABLE_MODULES = {
    ROOT / "dagster_gpuinfer" / "task_table.py",
    ROOT / "dagster_gpuinfer" / "worker" / "tasks" / "table.py",
    ROOT / "bench" / "task_workloads.py",
}
EQUALITY = (ast.Eq, ast.NotEq, ast.In, ast.NotIn)


def _names_a_task(node: ast.expr) -> bool:
    """`task`, `engine_task`, `spec.task`, `args.task`, `self.task`: a value naming a task."""
    name = node.id if isinstance(node, ast.Name) else getattr(node, "attr", None)
    return isinstance(name, str) and "task" in name.lower()


def _literals(node: ast.expr) -> list[str] | None:
    """The strings of a string literal or of a tuple/list/set of them, else None."""
    elements = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
    if elements and all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in elements):
        return [e.value for e in elements]  # type: ignore[attr-defined]
    return None


def task_branches(source: str) -> list[tuple[int, str]]:
    """`(line, what)` of each choice among tasks by name in `source`: a comparison of a task
    value with string literals (`task == "embed"`, `args.task in ("generate", "longtail")`),
    any comparison with a task's name (`"chat" != kind`), a `match` on a task value, or a
    dict literal keyed by two or more task names (`{"chat": ..., "embed": ...}`)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare) and all(isinstance(op, EQUALITY) for op in node.ops):
            operands = [node.left, *node.comparators]
            strings = [s for o in operands if (lits := _literals(o)) for s in lits]
            if strings and (any(map(_names_a_task, operands)) or set(strings) & set(TASKS)):
                found.append((node.lineno, "comparison"))
        elif isinstance(node, ast.Match) and _names_a_task(node.subject):
            found.append((node.lineno, "match"))
        elif isinstance(node, ast.Dict):
            keys = {k.value for k in node.keys if isinstance(k, ast.Constant)}
            if len(keys & set(TASKS)) >= 2:
                found.append((node.lineno, "dict keyed by task names"))
    return sorted(found)


def test_no_module_outside_the_task_tables_branches_on_the_task_name():
    found = []
    for path in sorted(p for folder in SEARCHED for p in folder.rglob("*.py")):
        if path in TABLE_MODULES:
            continue
        source = path.read_text()
        lines = source.splitlines()
        for number, what in task_branches(source):
            where = f"{path.relative_to(ROOT)}:{number}"
            found.append(f"{where}: {what}: {lines[number - 1].strip()}")
    assert not found, "branches on the task outside the task tables:\n" + "\n".join(found)


@pytest.mark.parametrize(
    "line",
    [
        'if spec.task == "embed": pass',
        'if self.task in ("score", "classify"): pass',
        'x = 1 if args.task != "longtail" else 2',
        'if engine_task not in ["chat"]: pass',
        'if "chat" == kind: pass',
        'if kind in {"generate", "image_embed"}: pass',
        'URLS = {"chat": "/v1/chat/completions", "embed": "/v1/embeddings"}',
        'match task:\n    case "embed": pass',
    ],
)
def test_the_branch_finder_catches_the_shapes_it_forbids(line):
    assert task_branches(line), line


@pytest.mark.parametrize(
    "line",
    [
        "if task_facts(spec.task).pooling: pass",
        'spec = InferenceSpec(model=m, task="embed")',
        'if workload(name).sampled_lengths and fmt == "parquet": pass',
        "if task == other_task: pass",
        'FIELDS = {"embed": 1}',
    ],
)
def test_the_branch_finder_leaves_facts_and_task_values_alone(line):
    assert not task_branches(line), line


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


def test_every_bench_workload_runs_a_task_of_the_table_as_its_facts_say():
    from bench.context import SMOKE
    from bench.task_workloads import WORKLOADS, counted_tokens, workload

    assert {"embed", "generate", "longtail", "image_embed"} <= set(WORKLOADS)
    for name, entry in WORKLOADS.items():
        assert entry.facts is TASKS[entry.task], name
        if entry.facts.images:  # its rows are the images section's shard
            with pytest.raises(ValueError, match="no text rows"):
                entry.rows(SMOKE)
            continue
        texts, _engine, sampling = entry.rows(SMOKE)
        assert texts, name
        # A pooling workload gets no sampling parameters; a sampling one always has them.
        assert (sampling is None) == entry.facts.pooling, name
    assert counted_tokens("embed") == workload("embed").counted_tokens == "prompt_tokens"
    assert workload("longtail").counted_tokens == "generated_tokens"
    assert workload("longtail").sampled_lengths and not workload("generate").sampled_lengths
    assert workload("longtail").chunk_size(SMOKE) == SMOKE.longtail_chunk_sizes[0]
    with pytest.raises(ValueError, match="unknown bench workload 'rank'; the workloads are embed"):
        workload("rank")
    with pytest.raises(ValueError, match="unknown task 'rank'"):
        counted_tokens("rank")
