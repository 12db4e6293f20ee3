"""Row-level reuse: each output row's reuse key, the rows of a partition's earlier output
that a run copies instead of computing, and identical requests of a run computed once.

A row's key (`RowKeys.key`) is a digest of what determines its output: the spec's scope
(`InferenceSpec.reuse_scope`: the model as named with its revision, the task, the
output-shaping engine arguments, the pipeline's sampling defaults and templates), the local
model folder's version (`SourceVersion.model`), an adapter name (empty: the base model),
the request as validated (its token ids, or a score row's pairs), and the row's own
parameters including its seed (`RowRequest.reuse_params`), and an image row's images by
a digest of their encoded bytes (`DecodedImage.digest`: an image edited under the same URL
or path gets a new key). Rows whose output is not a function of that (unseeded sampling)
get no key, unless the pipeline asks (`row_reuse="sampled"`).

Every Parquet output row carries its key in the `reuse_key` column; an `openai_batch`
output's rows carry theirs in the Parquet file written beside each JSONL part
(`ChunkMarker.reuse_part`: the part's rows as the Parquet output would hold them, so the
JSONL a user downloads stays OpenAI's format), and reuse reads those. When a partition is
computed again (its shard changed: rows appended or edited) the loop reads the key column of
its earlier committed output (`PreviousOutputs`: the manifest still in place until the new
commit) and plans each chunk (`RowReuse.plan`): a row whose key is there is copied from the
earlier part file; a row whose key an earlier chunk of this run computes is copied from that
chunk (`dedup`: the chunk waits until that one is written); only the other rows go to the
engine. The chunk's part file holds all its rows, reused or computed, in input order
(`RowReuse.assemble`), and commits through the same marker: exactly-once and resume do not
change. Memory: the earlier output's keys (about 100 bytes a row) and a few part files.

With `row_reuse_scope="pipeline"` the keys of every committed partition of the pipeline's
output are indexed too (`pipeline_outputs`, once per loop, at most `MAX_PIPELINE_KEYS`): a
row found there is copied from that partition's part file, read when its chunk is planned.
"""

from __future__ import annotations

import hashlib
import logging
import posixpath
import struct
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from dagster_gpuinfer.spec import InferenceSpec
from dagster_gpuinfer.storage import (
    ChunkMarker,
    PartitionOutput,
    SourceVersion,
    filesystem_for,
    partition_dir,
    read_manifest,
)
from dagster_gpuinfer.storage.digests import INPUT_DIGEST_COLUMN, REUSE_KEY_COLUMN
from dagster_gpuinfer.task_table import task_facts
from dagster_gpuinfer.worker.errors import RowError
from dagster_gpuinfer.worker.rows.validate import ValidChunk
from dagster_gpuinfer.worker.tasks.params import RowRequest

log = logging.getLogger("dagster_gpuinfer.worker")

# Part of every key: bump it when an output schema or what a row's output holds changes,
# so rows written before are never copied into the new shape.
KEY_VERSION = b"gpuinfer-row-1"
# Keys of this run's computed rows kept for dedup, at most (about 100 bytes each).
MAX_RUN_KEYS = 1_000_000
# Keys of the pipeline's committed partitions indexed, at most (`row_reuse_scope="pipeline"`).
MAX_PIPELINE_KEYS = 1_000_000
# Earlier part files kept decoded while chunks copy rows from them.
PART_CACHE = 4


@dataclass(frozen=True)
class RowRef:
    """One row of a written Parquet part file."""

    path: str
    row: int


class RowKeys:
    """Computes reuse keys for one spec (see the module's docstring)."""

    def __init__(self, spec: InferenceSpec) -> None:
        self.scope = spec.reuse_scope().encode()
        facts = task_facts(spec.task)
        # Parquet rows carry their keys; openai_batch rows in their reuse files.
        self.keyed = spec.output.format in ("parquet", "openai_batch")
        self.images = facts.images
        self.sampled = spec.row_reuse == "sampled"
        sampling = spec.sampling
        self.default_deterministic = (
            facts.pooling or sampling.temperature == 0 or sampling.seed is not None
        )

    def key(
        self,
        model: str | None,
        prompts: list[Any],
        request: RowRequest | None,
        pairs: Any = None,
        adapter: str | None = None,
        images: list[str] | None = None,
    ) -> str | None:
        """The key of one row (`prompts`: its token id lists; `pairs`: a score row's;
        `images`: an image row's, each prompt's images' digests), or None when its output
        is not a function of it (an image row without its images' digests)."""
        request = request or RowRequest()
        built = request.reuse_params is not None
        deterministic = request.deterministic if built else self.default_deterministic
        if not self.keyed or not (deterministic or self.sampled):
            return None
        if self.images and images is None:
            return None
        digest = hashlib.blake2b(KEY_VERSION, digest_size=16)
        for part in (
            self.scope,
            (model or "").encode(),
            (adapter or "").encode(),
            (request.reuse_params or "").encode(),
            repr((request.top_n, request.return_documents, request.top_logprobs)).encode(),
        ):
            digest.update(struct.pack("<Q", len(part)) + part)
        for prompt in prompts:
            data = np.asarray(prompt, dtype=np.int64).tobytes()
            digest.update(struct.pack("<Q", len(data)) + data)
        if pairs is not None:
            text = repr((list(pairs.queries), list(pairs.documents), bool(pairs.rerank)))
            digest.update(text.encode())
        for prompt_images in images or ():
            data = f"image:{prompt_images}".encode()
            digest.update(struct.pack("<Q", len(data)) + data)
        return digest.hexdigest()

    def chunk_keys(
        self, valid: ValidChunk, model: str | None, adapters: str | None = None
    ) -> list[str | None]:
        """The key of each valid row of a chunk; a row whose key cannot be made (whatever
        goes wrong) gets None and is computed: reuse never fails a row. A row naming a LoRA
        adapter is keyed by the adapter's name and version (`adapters`: the source's
        `name=version;...`), so new adapter files recompute only that adapter's rows."""
        versions = dict(pair.split("=", 1) for pair in (adapters or "").split(";") if pair)
        spans = valid.spans or [1] * len(valid.ids)
        keys: list[str | None] = []
        start = 0
        for i, span in enumerate(spans):
            try:
                request = valid.requests[i] if valid.requests else None
                name = request.adapter if request is not None else None
                keys.append(
                    self.key(
                        model,
                        valid.token_ids[start : start + span],
                        request,
                        pairs=valid.pairs[i] if valid.pairs else None,
                        adapter=f"{name}={versions[name]}" if name else None,
                        images=valid.image_digests[start : start + span]
                        if len(valid.image_digests) == len(valid.token_ids)
                        else None,
                    )
                )
            except Exception as exc:  # the row boundary: no key, the row is computed
                log.debug("row %s: no reuse key (%s)", valid.ids[i], exc)
                keys.append(None)
            start += span
        return keys


def previous_outputs(
    spec: InferenceSpec, partition_key: str, source: SourceVersion
) -> dict[str, RowRef]:
    """The keyed rows of the partition's earlier committed output (key -> row), or none:
    no manifest, one of this very source (committed: nothing to compute), or parts written
    before rows carried keys (an `openai_batch` partition committed without reuse files).
    Only the key column is read. A part that cannot be read makes the earlier output count
    for nothing (the rows are computed)."""
    fs, path = filesystem_for(partition_dir(spec.output, partition_key), spec.storage)
    try:
        manifest = read_manifest(fs, path)
    except Exception as exc:
        log.warning("partition %s: earlier manifest unreadable, no reuse (%s)", partition_key, exc)
        return {}
    if manifest is None or manifest.source == source:
        return {}
    index: dict[str, RowRef] = {}
    try:
        if not _index_parts(fs, path, manifest, index, limit=None):
            return {}
    except OSError as exc:  # pulled by a concurrent commit: compute everything
        log.warning("partition %s: earlier output unreadable, no reuse (%s)", partition_key, exc)
        return {}
    return index


def _index_parts(
    fs: pafs.FileSystem, path: str, manifest: Any, index: dict[str, RowRef], limit: int | None
) -> bool:
    """Adds the keyed rows of a committed partition (its folder `path`) to `index`, first
    found kept, from its Parquet parts or an `openai_batch` output's reuse files
    (`Manifest.keyed_parts`); False when a part is not Parquet or `limit` keys are reached."""
    for part in manifest.keyed_parts():
        if not part.name.endswith(".parquet"):
            return False
        part_path = posixpath.join(path, part.name)
        with fs.open_input_file(part_path) as handle:
            parquet = pq.ParquetFile(handle)
            if REUSE_KEY_COLUMN not in parquet.schema_arrow.names:
                continue
            keys = parquet.read(columns=[REUSE_KEY_COLUMN]).column(0).to_pylist()
        for row, key in enumerate(keys):
            if key is not None:
                index.setdefault(key, RowRef(part_path, row))
        if limit is not None and len(index) >= limit:
            return False
    return True


def pipeline_outputs(spec: InferenceSpec, limit: int = MAX_PIPELINE_KEYS) -> dict[str, RowRef]:
    """The keyed rows of every committed partition of the pipeline's output (key -> row;
    `row_reuse_scope="pipeline"`): the partition folders under the output's asset folder,
    each manifest's parts' key columns. A partition that cannot be read is left out (its
    rows are computed, as without it); at `limit` keys the rest are left out, with a
    warning."""
    asset_uri = partition_dir(spec.output, "x").rsplit("/", 1)[0]
    fs, root = filesystem_for(asset_uri, spec.storage)
    index: dict[str, RowRef] = {}
    infos = fs.get_file_info(pafs.FileSelector(root, allow_not_found=True))
    for info in sorted(infos, key=lambda i: i.path):
        if info.type != pafs.FileType.Directory:
            continue
        try:
            manifest = read_manifest(fs, info.path)
            if manifest is not None:
                _index_parts(fs, info.path, manifest, index, limit)
        except Exception as exc:  # one partition: its rows are computed
            log.warning("pipeline reuse: %s left out (%s)", info.path, exc)
        if len(index) >= limit:
            log.warning(
                "pipeline reuse: %d keys indexed, the limit; later partitions left out", limit
            )
            break
    log.info("pipeline reuse: %d keyed rows of committed partitions", len(index))
    return index


@dataclass(eq=False)
class ChunkPlan:
    """Where each valid row of a chunk gets its output: ("compute", None), ("reuse",
    RowRef: the earlier output), ("run", RowRef: a part this run wrote) or ("dup", (plan,
    position): a row an earlier chunk of this run computes, not written yet)."""

    full: ValidChunk
    keys: list[str | None]
    sources: list[tuple[str, Any]]
    compute: list[int] = field(default_factory=list)
    waits_on: list[ChunkPlan] = field(default_factory=list)
    queued: bool = False  # handed to the writer (chunks waiting on it may follow)
    # Part files of other partitions this chunk copies rows from, read when it was planned
    # (a run committing that partition may replace them before this chunk is written).
    pinned: dict[str, pa.Table] = field(default_factory=dict)
    table: pa.Table | None = None  # once written: the chunk's rows, and each position's row
    row_of: dict[int, int] = field(default_factory=dict)


class RowReuse:
    """One engine loop's reuse: plans chunks (prepare thread), assembles and records them
    (writer thread). Earlier outputs are looked up per partition; dedup spans the loop."""

    def __init__(self, spec: InferenceSpec) -> None:
        self.spec = spec
        self.keys = RowKeys(spec)
        self.enabled = self.keys.keyed and spec.row_reuse != "off"
        self._previous: OrderedDict[tuple[str, SourceVersion], dict[str, RowRef]] = OrderedDict()
        self._lock = threading.Lock()
        self._pending: dict[str, tuple[ChunkPlan, int]] = {}
        self._written: dict[str, RowRef] = {}
        self._parts: OrderedDict[str, pa.Table] = OrderedDict()
        self._pipeline: dict[str, RowRef] | None = None  # row_reuse_scope="pipeline"
        self.fs: pafs.FileSystem = filesystem_for(spec.output.root, spec.storage)[0]

    def _earlier(self, partition_key: str, source: SourceVersion) -> dict[str, RowRef]:
        place = (partition_key, source)
        if place not in self._previous:
            self._previous[place] = previous_outputs(self.spec, partition_key, source)
            while len(self._previous) > 2:
                self._previous.popitem(last=False)
        return self._previous[place]

    def _elsewhere(self, keys: list[str | None], plan: ChunkPlan) -> dict[str, RowRef]:
        """`row_reuse_scope="pipeline"`: the chunk's keys found in the pipeline's other
        committed partitions (indexed once per loop), their part files read into the plan
        now; a part that cannot be read leaves its rows to compute."""
        if self.spec.row_reuse_scope != "pipeline":
            return {}
        if self._pipeline is None:
            self._pipeline = pipeline_outputs(self.spec)
        found: dict[str, RowRef] = {}
        for key in keys:
            ref = self._pipeline.get(key) if key is not None else None
            if ref is None:
                continue
            if ref.path not in plan.pinned:
                try:
                    with self.fs.open_input_file(ref.path) as handle:
                        plan.pinned[ref.path] = pq.read_table(handle)
                except OSError as exc:  # replaced by a commit since: compute those rows
                    log.info("pipeline reuse: %s gone (%s)", ref.path, exc)
                    self._pipeline = {k: r for k, r in self._pipeline.items() if r.path != ref.path}
                    continue
            found[key] = ref
        return found

    def plan(self, partition_key: str, source: SourceVersion, valid: ValidChunk) -> ChunkPlan:
        """Each valid row's source (see `ChunkPlan`); the rows to compute are `compute`."""
        keys = self.keys.chunk_keys(valid, source.model, source.adapters) if self.keys.keyed else []
        keys = keys or [None] * len(valid.ids)
        plan = ChunkPlan(full=valid, keys=keys, sources=[])
        earlier = self._earlier(partition_key, source) if self.enabled else {}
        elsewhere = (
            self._elsewhere([k for k in keys if k not in earlier], plan) if self.enabled else {}
        )
        with self._lock:
            for position, key in enumerate(keys):
                found = self._source_of(key, earlier, elsewhere) if self.enabled else None
                if found is None:
                    plan.sources.append(("compute", None))
                    plan.compute.append(position)
                    if key is not None and self.enabled:
                        self._pending[key] = (plan, position)
                    continue
                plan.sources.append(found)
                twin = found[1][0] if found[0] == "dup" else plan
                if twin is not plan and all(twin is not w for w in plan.waits_on):
                    plan.waits_on.append(twin)
        return plan

    def _source_of(
        self, key: str | None, earlier: dict[str, RowRef], elsewhere: dict[str, RowRef]
    ) -> tuple[str, Any] | None:
        if key is None:
            return None
        if key in earlier:
            return ("reuse", earlier[key])
        if key in self._written:
            return ("run", self._written[key])
        if key in self._pending:
            return ("dup", self._pending[key])
        if key in elsewhere:
            return ("reuse", elsewhere[key])
        return None

    def _part(self, path: str) -> pa.Table:
        table = self._parts.get(path)
        if table is None:
            with self.fs.open_input_file(path) as handle:
                table = pq.read_table(handle)
            self._parts[path] = table
            while len(self._parts) > PART_CACHE:
                self._parts.popitem(last=False)
        self._parts.move_to_end(path)
        return table

    def assemble(
        self, plan: ChunkPlan, computed: ValidChunk, table: pa.Table | None, source: str
    ) -> tuple[ValidChunk, pa.Table, int, int]:
        """The chunk's output in input order: computed rows (`computed`, the rows the
        engine took, and their `table`) and copied ones, each with its key; returns the
        rows kept (`ValidChunk`: ids and errors), the table, rows reused, rows deduplicated.
        A row whose twin the engine refused is refused too."""
        full = plan.full
        kept = ValidChunk(
            index=full.index,
            errors=list(full.errors) + list(computed.errors),
            image_count=full.image_count,
            image_bytes=full.image_bytes,
        )  # with each kept row's request and pairs: OpenAI rerank bodies name documents
        computed_row = {row_id: i for i, row_id in enumerate(computed.ids)}
        picks: list[tuple[pa.Table, int]] = []
        keys: list[str | None] = []
        counts = {"reuse": 0, "run": 0, "dup": 0}
        local: dict[int, tuple[pa.Table, int]] = {}
        for position, (kind, ref) in enumerate(plan.sources):
            if kind == "dup" and ref[0] is plan:  # its twin is an earlier row of this chunk
                pick = local.get(ref[1])
            else:
                pick = self._pick(kind, ref, full.ids[position], table, computed_row, plan)
            if pick is None:
                if kind == "dup":
                    kept.errors.append(_twin_refused(full, position, source))
                continue
            counts[kind] = counts.get(kind, 0) + 1
            local[position] = pick
            picks.append(pick)
            keys.append(plan.keys[position])
            plan.row_of[position] = len(kept.ids)
            kept.rows.append(full.rows[position])
            kept.ids.append(full.ids[position])
            for name in ("requests", "pairs"):
                if getattr(full, name):
                    getattr(kept, name).append(getattr(full, name)[position])
        plan.table = _gather(picks, table, kept.ids, keys)
        plan.pinned = {}
        return kept, plan.table, counts["reuse"], counts["run"] + counts["dup"]

    def _pick(
        self,
        kind: str,
        ref: Any,
        row_id: str,
        table: pa.Table | None,
        computed_row: dict[str, int],
        plan: ChunkPlan,
    ) -> tuple[pa.Table, int] | None:
        if kind == "compute":
            row = computed_row.get(row_id)
            return None if row is None or table is None else (table, row)
        if kind == "dup":
            twin, position = ref
            row = twin.row_of.get(position)
            return None if row is None or twin.table is None else (twin.table, row)
        pinned = plan.pinned.get(ref.path)
        return (pinned if pinned is not None else self._part(ref.path)), ref.row

    def written(self, plan: ChunkPlan, where: PartitionOutput, marker: ChunkMarker) -> None:
        """The chunk is written: its keyed rows serve later chunks of the run from its part
        file (up to `MAX_RUN_KEYS`), no longer from memory."""
        if not self.enabled:
            return
        keyed = marker.reuse_part if self.spec.output.format == "openai_batch" else marker.part
        part = posixpath.join(where.path, keyed.name) if keyed else None
        with self._lock:
            for position, key in enumerate(plan.keys):
                if key is None:
                    continue
                if self._pending.get(key, (None, 0))[0] is plan:
                    del self._pending[key]
                row = plan.row_of.get(position)
                if part is not None and row is not None and len(self._written) < MAX_RUN_KEYS:
                    self._written.setdefault(key, RowRef(part, row))


def _gather(
    picks: list[tuple[pa.Table, int]],
    computed: pa.Table | None,
    ids: list[str],
    keys: list[str | None],
) -> pa.Table:
    """One table of the picked rows in order, in the computed rows' schema (or the copied
    rows' when none was computed), the ids of this chunk's rows and their keys."""
    tables: dict[int, tuple[pa.Table, list[int]]] = {}
    order: list[tuple[int, int]] = []
    for table, row in picks:
        rows = tables.setdefault(id(table), (table, []))[1]
        order.append((id(table), len(rows)))
        rows.append(row)
    if computed is not None and computed.num_rows:
        schema = computed.schema
    elif tables:
        first = next(iter(tables.values()))[0]
        schema = first.drop_columns(
            [c for c in (REUSE_KEY_COLUMN, INPUT_DIGEST_COLUMN) if c in first.column_names]
        ).schema
    else:
        schema = computed.schema if computed is not None else pa.schema([("id", pa.string())])
    pieces, offsets, start = [], {}, 0
    for name, (table, rows) in tables.items():
        pieces.append(table.select(schema.names).take(rows).cast(schema))
        offsets[name] = start
        start += len(rows)
    joined = pa.concat_tables(pieces) if pieces else schema.empty_table()
    joined = joined.take(pa.array([offsets[name] + k for name, k in order], pa.int64()))
    joined = joined.set_column(
        schema.get_field_index("id"), schema.field("id"), pa.array(ids, pa.string())
    )
    return joined.append_column(REUSE_KEY_COLUMN, pa.array(keys, pa.string()))


def _twin_refused(full: ValidChunk, position: int, source: str) -> RowError:
    row, row_id = full.rows[position], full.ids[position]
    return RowError.quarantined(
        row_id,
        source,
        row,
        "rejected_by_engine",
        f"{source} row {row} (id {row_id}): an identical request of this run was refused by "
        "the engine",
    )
