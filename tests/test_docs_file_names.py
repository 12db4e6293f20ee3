"""The output files the README and docs/ name are the ones the worker writes.

Issue 40: the docs named the error file `errors.jsonl` where the worker writes
`errors-<spec hash>-<attempt>.jsonl`. Every part or errors file name in README.md and docs/
must be a name the storage layer makes (`storage.layout`), with its variable parts written
as `<spec hash>`, `<chunk>` and `<attempt>`.
"""

from __future__ import annotations

import re
from pathlib import Path

from dagster_gpuinfer.storage.layout import chunk_part_name, error_file_names

REPO = Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FILE_NAME = re.compile(r"\b(?:part|errors)(?:-(?:<[^>]+>|\w+))*\.(?:parquet|jsonl)\b")


def written_names() -> set[str]:
    """The names the worker writes, as the docs write them (placeholders for the parts that
    vary), from the storage layer's own functions."""
    placeholders = {"SPECHASH": "<spec hash>", "00042": "<chunk>", "ATTEMPT": "<attempt>"}

    def shown(name: str) -> str:
        for value, placeholder in placeholders.items():
            name = name.replace(value, placeholder)
        return name

    names = {shown(name) for name in error_file_names("SPECHASH", "ATTEMPT")}
    for suffix in (".parquet", ".jsonl"):
        names.add(shown(chunk_part_name("SPECHASH", 42, "ATTEMPT", suffix)))
    return names


def test_the_docs_name_output_files_as_the_worker_writes_them():
    written = written_names()
    wrong = [
        f"{doc.relative_to(REPO)}:{number}: {name}"
        for doc in DOCS
        for number, line in enumerate(doc.read_text().splitlines(), 1)
        for name in FILE_NAME.findall(line)
        if name not in written
    ]
    assert not wrong, f"names the worker does not write (it writes {sorted(written)}): {wrong}"
