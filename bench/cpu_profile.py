"""Where a process tree's CPU goes: per-process CPU time from /proc, per-thread stacks from
py-spy, each sample put in one named bucket.

Two instruments, each for what it sees:

- `ProcSampler` reads `utime + stime` of every process under a root pid from `/proc` a few
  times a second (native threads included: vLLM's OpenMP threads, Arrow's, the tokenizer's),
  and the machine's busy/idle time from `/proc/stat`. Any time window's CPU seconds per
  process come from that series.
- py-spy (`py-spy record --subprocesses --threads --format raw`) samples the Python stack of
  each running thread; `classify_stack` puts each stack in a bucket by process, thread name and
  the frames in it (read, prepare, write, commit, the engine loop, vLLM's output processing,
  the engine core's forward pass and scheduler, ...). py-spy counts a thread as active when it
  is not blocked, so on a loaded machine its seconds are a thread's runnable time (running or
  waiting for a core), not CPU time, and it does not see native-only threads: compare its
  buckets with each other, and take CPU seconds from the /proc rows.

`python -m bench.profile_run` drives both around a platform run and a raw vLLM run.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")

# Process kinds, by command line (py-spy's `process PID:"cmdline"` frames, /proc cmdline).
ENGINE_CORE = "engine core"
WORKER = "worker"
RUN_PROCESS = "Dagster run process"
RAW_CLIENT = "raw vLLM client"
PROFILER = "py-spy"
OTHER = "other"


def process_kind(cmdline: str, *, root_pid: int | None = None, pid: int | None = None) -> str:
    """What a process of the profiled tree is, from its command line."""
    if pid is not None and pid == root_pid:
        return RUN_PROCESS
    if "py-spy" in cmdline:
        return PROFILER
    if "multiprocessing.spawn" in cmdline or "multiprocessing-fork" in cmdline:
        return ENGINE_CORE  # vLLM's EngineCore (and its spawned helpers)
    if "VLLM::EngineCore" in cmdline:
        return ENGINE_CORE
    if "dagster_gpuinfer.worker" in cmdline:
        return WORKER
    if "bench.server" in cmdline:
        return RAW_CLIENT
    if "bench.profile_run" in cmdline or "bench.cpu_profile" in cmdline:
        return RUN_PROCESS
    return OTHER


# Frames that name a bucket inside the worker (matched against the whole stack).
_WORKER_FRAMES = (
    ("engine shutdown", ("InferenceEngine.shutdown (",)),
    ("commit (manifest, markers)", ("commit_chunks (", "RunCoordinator._settle (")),
    ("write (Parquet part files)", ("write_chunk (",)),
    ("render (vLLM input processing: image processor)", ("render_images (",)),
    ("prepare (validate, tokenize)", ("RowValidator.validate (",)),
    ("read (shard reader)", ("RunCoordinator._feed (", "ShardReader.")),
    ("vLLM output processing (detokenize)", ("InferenceEngine.step (",)),
    # A run's single engine and a pool lease (`run_partition`) run `EngineLoop.run`; a
    # replica process runs it through `serve_chunks`.
    ("engine loop (submit, bookkeeping)", ("EngineLoop.run (", "serve_chunks (")),
)
_ENGINE_FRAMES = (
    ("engine core: model forward", ("execute_model (", "sample_tokens (")),
    ("engine core: scheduler", ("schedule (", "update_from_output (")),
    ("engine core: load", ("load_model (", "initialize_from_config (", "compile_or_warm_up")),
)


def classify_stack(kind: str, thread: str, frames: str) -> str:
    """The bucket of one py-spy sample: its process kind, thread name and frames."""
    importing = "_find_and_load" in frames
    if kind == WORKER:
        if "InferenceEngine.__init__ (" in frames:
            return "worker: engine build: " + ("imports" if importing else "LLM(...)")
        for bucket, needles in _WORKER_FRAMES:
            if any(n in frames for n in needles):
                return f"worker: {bucket}"
        if thread.startswith("gpuinfer-image"):
            return "worker: image decode (the decoder's pool)"
        if "gpuinfer-telemetry" in thread or "metrics" in frames:
            return "worker: telemetry, metrics"
        if "_find_and_load" in frames:
            return "worker: imports"
        return "worker: other (start, Pipes, threads waiting)"
    if kind == ENGINE_CORE:
        for bucket, needles in _ENGINE_FRAMES:
            if any(n in frames for n in needles):
                return bucket
        return "engine core: other (IPC, busy loop)"
    if kind == RAW_CLIENT:
        if "VllmBackend.__init__ (" in frames:
            return "raw client: engine build: " + ("imports" if importing else "LLM(...)")
        if "_run_engine (" in frames or "LLM.generate (" in frames or "LLM.embed (" in frames:
            return "raw client: LLM.generate loop, output processing"
        return "raw client: other"
    if kind == RUN_PROCESS:
        if "ProcSampler" in frames:
            return "bench: /proc sampler"
        return "Dagster run process"
    return f"{kind}"


_RECORD = re.compile(r"^(process .*?) (\d+)$", re.S | re.M)
_PROCESS = re.compile(r'process (\d+):"(.*?)"(?=;|$)', re.S)
_THREAD = re.compile(r"thread \((0x[0-9a-fA-F]+|\d+)\)(?:: ([^;]*))?")


def parse_pyspy_raw(text: str, *, root_pid: int | None = None) -> dict[str, int]:
    """Samples per bucket from py-spy's raw output (`--subprocesses --threads --format raw`).

    Each record is `process P:"cmd";[process C:"cmd";]thread (T): name;frame;... COUNT`; the
    innermost process is the one sampled (command lines may hold newlines)."""
    counts: dict[str, int] = defaultdict(int)
    for match in _RECORD.finditer(text):
        stack, count = match.group(1), int(match.group(2))
        processes = list(_PROCESS.finditer(stack))
        if not processes:
            continue
        inner = processes[-1]
        rest = stack[inner.end() :]
        thread_match = _THREAD.search(rest)
        thread = (thread_match.group(2) or "") if thread_match else ""
        kind = process_kind(inner.group(2), root_pid=root_pid, pid=int(inner.group(1)))
        counts[classify_stack(kind, thread, rest)] += count
    return dict(counts)


@dataclass
class ProcSample:
    t: float
    cpu: dict[int, float]  # pid -> cumulative CPU seconds
    machine_busy: float
    machine_total: float


@dataclass
class ProcSampler:
    """CPU seconds of every process under `root_pid`, sampled every `interval` seconds."""

    root_pid: int
    interval: float = 0.5
    samples: list[ProcSample] = field(default_factory=list)
    cmdlines: dict[int, str] = field(default_factory=dict)
    own_cpu: float = 0.0  # the sampler thread's own CPU seconds (inside the root process)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> ProcSampler:
        self.sample()
        self._thread = threading.Thread(target=self._loop, name="bench-proc-sampler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.sample()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()
        self.own_cpu = time.thread_time()

    def sample(self) -> None:
        parents: dict[int, int] = {}
        cpu: dict[int, float] = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2 :].split()
            pid = int(entry)
            parents[pid] = int(fields[1])
            cpu[pid] = (int(fields[11]) + int(fields[12])) / CLOCK_TICKS
        tree = {self.root_pid}
        changed = True
        while changed:
            changed = False
            for pid, parent in parents.items():
                if parent in tree and pid not in tree:
                    tree.add(pid)
                    changed = True
        for pid in tree:
            if pid not in self.cmdlines:
                try:
                    raw = Path(f"/proc/{pid}/cmdline").read_bytes()
                    comm = Path(f"/proc/{pid}/comm").read_text().strip()
                except OSError:
                    continue
                self.cmdlines[pid] = raw.replace(b"\0", b" ").decode(errors="replace") + (
                    f" [{comm}]"
                )
        busy, total = machine_cpu()
        self.samples.append(
            ProcSample(time.time(), {p: cpu[p] for p in tree if p in cpu}, busy, total)
        )

    def cpu_by_kind(self, start: float, end: float) -> dict[str, float]:
        """CPU seconds per process kind between two wall-clock times (interpolated)."""
        by_kind: dict[str, float] = defaultdict(float)
        for pid, cmdline in self.cmdlines.items():
            kind = process_kind(cmdline, root_pid=self.root_pid, pid=pid)
            by_kind[kind] += self.cpu_of(pid, start, end)
        return dict(by_kind)

    def cpu_of(self, pid: int, start: float, end: float) -> float:
        """CPU seconds of one process between two wall-clock times (interpolated)."""
        return max(_at(self.samples, end, pid) - _at(self.samples, start, pid), 0.0)

    def machine_busy(self, start: float, end: float) -> float:
        """CPU seconds the whole machine was busy between two times (every process)."""
        return _machine_at(self.samples, end) - _machine_at(self.samples, start)


def _interpolate(samples: list[ProcSample], t: float, value) -> float:
    before = [s for s in samples if s.t <= t]
    after = [s for s in samples if s.t >= t]
    if not before:
        return value(after[0]) if after else 0.0
    if not after:
        return value(before[-1])
    a, b = before[-1], after[0]
    if b.t == a.t:
        return value(a)
    return value(a) + (value(b) - value(a)) * (t - a.t) / (b.t - a.t)


def _at(samples: list[ProcSample], t: float, pid: int) -> float:
    """A process's cumulative CPU at time t: 0 before it is first seen, its last value after
    it is gone (the CPU of its last interval is lost)."""
    seen = [s for s in samples if pid in s.cpu]
    if not seen or t <= seen[0].t:
        return 0.0 if not seen or t < seen[0].t else seen[0].cpu[pid]
    return _interpolate(seen, t, lambda s: s.cpu[pid])


def _machine_at(samples: list[ProcSample], t: float) -> float:
    return _interpolate(samples, t, lambda s: s.machine_busy)


def stat_ticks(stat: str = "/proc/stat") -> list[int] | None:
    """The machine's CPU ticks since boot from the first line of /proc/stat: user nice system
    idle iowait irq softirq steal (guest time is inside user); None where it cannot be read."""
    try:
        with open(stat, encoding="ascii") as handle:
            first = handle.readline().split()
    except OSError:
        return None
    if len(first) < 9 or first[0] != "cpu":
        return None
    return [int(value) for value in first[1:9]]


def machine_cpu() -> tuple[float, float]:
    """(busy, total) CPU seconds of the machine since boot, from /proc/stat."""
    ticks = stat_ticks()
    if ticks is None:
        raise OSError("/proc/stat has no aggregate cpu line to read")
    idle = ticks[3] + ticks[4]
    total = sum(ticks)
    return (total - idle) / CLOCK_TICKS, total / CLOCK_TICKS


class CpuSteal:
    """The share of this machine's CPU time the hypervisor gave to other guests (the steal
    column of /proc/stat) between `start` and `share`: on a virtual machine our cores are not
    all ours all the time. It marks turns the host took CPU from; it does not size a slowdown
    (a neighbour on a sibling hyperthread, shared caches or memory bandwidth slow us without
    any steal). None where /proc/stat cannot be read (not Linux).

        meter = CpuSteal().start(); run(); meter.share()  # e.g. 0.04
    """

    def __init__(self, stat: str = "/proc/stat") -> None:
        self.stat = stat
        self._begin: list[int] | None = None

    def start(self) -> CpuSteal:
        self._begin = stat_ticks(self.stat)
        return self

    def share(self) -> float | None:
        end, begin = stat_ticks(self.stat), self._begin
        if begin is None or end is None or sum(end) <= sum(begin):
            return None
        return (end[7] - begin[7]) / (sum(end) - sum(begin))


class PySpy:
    """`py-spy record` of a process and its children, written in raw (collapsed) form."""

    def __init__(self, pid: int, out: Path, *, rate: int = 20) -> None:
        exe = shutil.which("py-spy") or str(Path(os.sys.executable).with_name("py-spy"))
        if not Path(exe).exists():
            raise RuntimeError(
                "py-spy is not installed: `pip install -c requirements/lock-cpu.txt "
                "py-spy==0.4.3` (the `bench` extra has it)"
            )
        self.out = out
        self.rate = rate
        self.process = subprocess.Popen(
            [
                exe,
                "record",
                "--pid",
                str(pid),
                "--subprocesses",
                "--threads",
                "--nonblocking",
                "--format",
                "raw",
                "--rate",
                str(rate),
                "--output",
                str(out),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )

    def stop(self) -> str:
        """Stop recording (py-spy writes its file on SIGINT) and return the raw text."""
        self.process.send_signal(signal.SIGINT)
        try:
            _, err = self.process.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            _, err = self.process.communicate()
        if not self.out.exists():
            raise RuntimeError(f"py-spy wrote no profile: {err.decode(errors='replace')[-500:]}")
        return self.out.read_text(errors="replace")
