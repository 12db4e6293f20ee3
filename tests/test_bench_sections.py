"""A bench run of some sections (`--only`) keeps every other section's latest results, and
the sections it runs keep theirs until it finishes them, each named as earlier results."""

from __future__ import annotations

import json
from pathlib import Path

from bench.__main__ import (
    UNFINISHED,
    _keep_earlier_sections,
    _section_done,
    _throughput_done,
)


def _earlier(path: Path) -> None:
    path.write_text(
        json.dumps(
            {
                "smoke": False,
                "command": "python -m bench --rounds 3",
                "started": "2026-12-01T03:00:00",
                "notes": ["memory: from `python -m bench --only memory` of 2026-11-30T10:00:00"],
                "throughput": {"embed": {"rows": 1}, "generate": {"rows": 2}},
                "longtail": {"rows": 3},
                "memory": {"rows": 4},
            }
        )
    )


def test_a_section_stopped_before_it_finishes_keeps_its_earlier_results_named_so(tmp_path):
    path = tmp_path / "results.json"
    _earlier(path)
    results: dict = {"smoke": False, "notes": []}
    _keep_earlier_sections(results, path, {"throughput", "longtail"})
    assert results["longtail"] == {"rows": 3} and results["memory"] == {"rows": 4}
    notes = {note.split(":")[0]: note for note in results["notes"]}
    assert UNFINISHED in notes["longtail"] and "2026-12-01T03:00:00" in notes["longtail"]
    assert notes["memory"].endswith("of 2026-11-30T10:00:00")  # its own origin, carried
    assert UNFINISHED not in notes["memory"]
    # The run is stopped here: what it saves still holds longtail, marked as earlier.
    results["longtail"] = {"rows": 30}
    _section_done(results, "longtail")
    assert not [n for n in results["notes"] if n.startswith("longtail")]
    assert [n for n in results["notes"] if n.startswith("memory")]


def test_throughput_names_the_tasks_this_run_left_at_their_earlier_results(tmp_path):
    path = tmp_path / "results.json"
    _earlier(path)
    results: dict = {"smoke": False, "notes": []}
    _keep_earlier_sections(results, path, {"throughput"})
    results["throughput"]["embed"] = {"rows": 10}
    _throughput_done(results, {"embed"})
    [note] = [n for n in results["notes"] if n.startswith("throughput")]
    assert note.endswith("(its task(s) generate)")
    assert results["throughput"] == {"embed": {"rows": 10}, "generate": {"rows": 2}}
    results["throughput"]["generate"] = {"rows": 20}
    _throughput_done(results, {"embed", "generate"})
    assert not [n for n in results["notes"] if n.startswith("throughput")]


def test_a_smoke_run_never_mixes_with_measured_results(tmp_path):
    path = tmp_path / "results.json"
    _earlier(path)
    results: dict = {"smoke": True, "notes": []}
    _keep_earlier_sections(results, path, {"longtail"})
    assert "longtail" not in results and results["notes"] == []


def test_the_machine_line_names_the_cpu_and_its_bfloat16(tmp_path):
    """Rates compare only on one CPU: the report names the model and whether it computes in
    bfloat16 natively (which sets the worker's dtype for a float32 checkpoint)."""
    from bench.context import cpu_description

    def described(flags: str) -> str:
        info = tmp_path / "cpuinfo"
        block = f"processor\t: {{n}}\nmodel name\t: Example CPU @ 2.80GHz\nflags\t\t: {flags}\n\n"
        info.write_text(block.format(n=0) + block.format(n=1))
        return cpu_description(str(info))

    assert described("fpu avx2 avx512f avx512_bf16 amx_tile") == (
        "Example CPU @ 2.80GHz, AVX-512, native bfloat16"
    )
    assert described("fpu avx2 avx512f avx512_vnni") == (
        "Example CPU @ 2.80GHz, AVX-512, no native bfloat16"
    )
    assert described("fpu avx2") == "Example CPU @ 2.80GHz, AVX2, no native bfloat16"
    assert cpu_description(str(tmp_path / "absent")) == ""


def test_cpu_steal_is_the_stolen_share_of_all_cpu_time_between_two_reads(tmp_path):
    """A virtual machine's slow turn is told apart from a slow contestant by the steal column
    of /proc/stat: the share of the CPU time that passed which the host gave other guests."""
    from bench.cpu_profile import CpuSteal
    from bench.report import _steal

    stat = tmp_path / "stat"

    def write(user: int, idle: int, steal: int) -> None:
        # user nice system idle iowait irq softirq steal guest guest_nice, then per-CPU lines
        stat.write_text(
            f"cpu  {user} 0 10 {idle} 0 0 0 {steal} 0 0\ncpu0 {user} 0 10 {idle} 0 0 0 {steal}\n"
        )

    write(user=1000, idle=500, steal=100)
    meter = CpuSteal(str(stat)).start()
    write(user=1150, idle=530, steal=120)  # 200 ticks passed, 20 of them stolen
    assert meter.share() == 0.1
    assert CpuSteal(str(stat)).start().share() is None  # no time passed
    assert CpuSteal(str(tmp_path / "absent")).start().share() is None
    stat.write_text("intr 1 2 3\n")
    assert CpuSteal(str(stat)).start().share() is None  # not a stat file
    assert _steal([0.011, None, 0.14]) == "1% 14%"
    assert _steal(None) == "n/a" and _steal([None]) == "n/a"


def test_the_incremental_shard_gains_ten_percent_and_edits_one_percent_in_place() -> None:
    from bench.incremental import changed_texts
    from bench.workloads import embed_texts

    texts = embed_texts(10_000, seed=29)  # the section's size
    new, edited, appended = changed_texts(texts, seed=0)  # round 0
    assert (edited, appended, len(new)) == (100, 1000, 11_000)
    assert sum(a != b for a, b in zip(texts, new, strict=False)) == 100
    assert len(set(new)) == len(new)  # no appended or edited text repeats an earlier one
