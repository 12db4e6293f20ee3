"""The package's import graph: no cycle, and every import runs down the layers.

Read from the source with `ast` (no module is imported), every import counted, those inside
functions too: an import deferred into a function still ties two modules together (the
request builder and the task table were a cycle held by one). Only imports under
`if TYPE_CHECKING:` are left out, since they never run.

Layers, top first: the control plane (everything not named below), the shared modules both
sides import (`SHARED`), the worker (`dagster_gpuinfer/worker/`). The worker's rooms are
ordered too (`WORKER_ROOMS`): a room imports only rooms below it, or modules of its own.
Beside `test_import_boundaries.py`, which checks what a fresh interpreter loads.
"""

from __future__ import annotations

import ast
from pathlib import Path

import dagster_gpuinfer

PACKAGE = Path(dagster_gpuinfer.__file__).parent
ROOT = "dagster_gpuinfer"

# What both the control plane and the worker import; they import neither.
SHARED = (
    "spec",
    "storage",
    "messages",
    "task_table",
    "image_options",
    "secrets",
    "out_of_memory",
    "pools",  # the lease queue: the control plane submits, the pool worker leases
)

# The worker's rooms, lowest first: each may import its own modules and those of rooms before it.
WORKER_ROOMS = (
    ("worker", "worker.errors", "worker.lifecycle", "worker.metrics", "worker.telemetry"),
    ("worker.tasks",),
    ("worker.rows",),
    ("worker.stage_messages",),
    ("worker.commit",),
    ("worker.loop",),
    ("worker.run",),
    ("worker.pool",),
    ("worker.__main__", "worker.follower"),
)

# The control plane names the worker's entry points (the module `python -m` runs); that is
# all it takes from the worker.
WORKER_ENTRY_POINTS = ("worker", "worker.follower")


def _module_name(path: Path) -> str:
    parts = [ROOT, *path.relative_to(PACKAGE).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for path in PACKAGE.rglob("*.py")}


def _type_checking_only(tree: ast.Module) -> set[ast.AST]:
    skipped: set[ast.AST] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(n for child in node.body for n in ast.walk(child))
    return skipped


def _imports(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that `module` imports (a name imported from a package that is
    a module of its own counts as that module)."""
    tree = ast.parse(path.read_text())
    skipped = _type_checking_only(tree)
    found: set[str] = set()
    for node in ast.walk(tree):
        if node in skipped:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module.split(".")
                if path.name != "__init__.py":
                    package = package[:-1]
                package = package[: len(package) - node.level + 1]
                base = ".".join([*package, base] if base else package)
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    return {name for name in found if name in modules and name != module}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _under(module: str, prefix: str) -> bool:
    full = f"{ROOT}.{prefix}"
    return module == full or module.startswith(full + ".")


def _layer(module: str) -> str:
    if _under(module, "worker"):
        return "worker"
    if any(_under(module, shared) for shared in SHARED):
        return "shared"
    return "control plane"


def _room(module: str) -> int:
    ranks = [
        (len(prefix), rank)
        for rank, room in enumerate(WORKER_ROOMS)
        for prefix in room
        if _under(module, prefix) and (prefix != "worker" or module == f"{ROOT}.worker")
    ]
    assert ranks, f"{module} is in no room of WORKER_ROOMS: add it to one"
    return max(ranks)[1]


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `graph`, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                return [*path[path.index(target) :], target]
            if target not in state and (found := visit(target)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_package_has_no_import_cycle():
    cycle = _cycle(_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or ())


def test_shared_modules_import_neither_the_control_plane_nor_the_worker():
    upward = sorted(
        f"{source} imports {target}"
        for source, targets in _graph().items()
        if _layer(source) == "shared"
        for target in targets
        if _layer(target) != "shared"
    )
    assert not upward, upward


def test_the_worker_imports_no_control_plane_module():
    upward = sorted(
        f"{source} imports {target}"
        for source, targets in _graph().items()
        if _layer(source) == "worker"
        for target in targets
        if _layer(target) == "control plane"
    )
    assert not upward, upward


def test_the_control_plane_takes_only_the_entry_points_from_the_worker():
    entry_points = {f"{ROOT}.{name}" for name in WORKER_ENTRY_POINTS}
    reaching_in = sorted(
        f"{source} imports {target}"
        for source, targets in _graph().items()
        if _layer(source) == "control plane"
        for target in targets
        if _layer(target) == "worker" and target not in entry_points
    )
    assert not reaching_in, reaching_in


def test_each_worker_room_imports_only_rooms_below_it():
    upward = sorted(
        f"{source} imports {target}"
        for source, targets in _graph().items()
        if _layer(source) == "worker"
        for target in targets
        if _layer(target) == "worker" and _room(target) > _room(source)
    )
    assert not upward, upward


def test_the_coordinator_does_not_import_the_engine_loop():
    imports = _graph()[f"{ROOT}.worker.run.coordinator"]
    assert not any(_under(target, "worker.loop") for target in imports), sorted(imports)


def test_the_graph_sees_an_import_inside_a_function(tmp_path):
    """The check would miss the cycle it was written for if it read module-level imports
    only."""
    source = tmp_path / "module.py"
    source.write_text("def f():\n    from dagster_gpuinfer.worker.tasks.table import worker_task\n")
    modules = _modules()
    found = _imports(f"{ROOT}.worker.rows.example", source, modules)
    assert found == {f"{ROOT}.worker.tasks.table"}
