"""Row-level reuse (`worker/loop/reuse.py`) on the fake engine of `test_engine_loop`: rows
whose reuse key is in the partition's earlier output are copied, identical requests of a
run are computed once, unseeded sampling is computed unless asked; and the key itself, on
random inputs. Shards, part files, markers and commits are real (local storage).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_engine_loop import FakeEngine, _serve

from dagster_gpuinfer import InferenceSpec, read_partition
from dagster_gpuinfer.storage import SourceVersion
from dagster_gpuinfer.worker.loop.reuse import (
    REUSE_KEY_COLUMN,
    RowKeys,
    RowReuse,
    pipeline_outputs,
)
from dagster_gpuinfer.worker.rows.validate import ValidChunk
from dagster_gpuinfer.worker.tasks.params import RowRequest
from dagster_gpuinfer.worker.tasks.pooling import ScorePairs

CHUNK = 4


def _spec(root: Path, out: str = "out", **fields) -> InferenceSpec:
    return InferenceSpec.model_validate(
        {
            "model": "/m",
            "task": "embed",
            "input": {"uri": str(root / "in" / "{partition_key}.parquet")},
            "output": {"root": str(root / out), "asset_name": "emb"},
            "chunk_size": CHUNK,
            "partition_keys": ["s0"],
            **fields,
        }
    )


def _write(root: Path, rows: list[tuple[str, int]], key: str = "s0") -> None:
    """The shard `key`: (id, number) rows; the fake engine's embedding of a row is
    [number, prompt length]."""
    (root / "in").mkdir(parents=True, exist_ok=True)
    table = pa.table({"id": [i for i, _ in rows], "text": [f"row {n}" for _, n in rows]})
    pq.write_table(table, root / "in" / f"{key}.parquet")


def _numbers(table: pa.Table) -> list[int]:
    return [int(v[0]) for v in table.column("embedding").to_pylist()]


def test_a_re_run_computes_only_appended_and_edited_rows_and_equals_a_full_recompute(tmp_path):
    rows = [(f"r{i}", 1000 + i) for i in range(10)]
    _write(tmp_path, rows)
    spec = _spec(tmp_path)
    first, done, error = _serve(spec, FakeEngine())
    assert error is None and done and first[0][0].rows_reused == 0

    rows[3] = ("r3", 2003)  # one row edited
    rows += [(f"r{i}", 1000 + i) for i in range(10, 13)]  # three appended
    _write(tmp_path, rows)
    engine = FakeEngine()
    again, done, error = _serve(spec, engine)
    assert error is None and done
    assert sorted(engine.submitted) == [1010, 1011, 1012, 2003]
    ((manifest, computed),) = again
    assert computed
    assert (manifest.rows_out, manifest.rows_reused, manifest.rows_deduplicated) == (13, 9, 0)
    table = read_partition(spec.output, "s0")
    assert table.column("id").to_pylist() == [i for i, _ in rows]
    assert _numbers(table) == [n for _, n in rows]

    full = _spec(tmp_path, out="full")
    _, done, error = _serve(full, FakeEngine())
    assert error is None and done
    assert read_partition(full.output, "s0").equals(table)  # keys and outputs alike


def test_identical_requests_of_a_run_are_computed_once_across_chunks(tmp_path):
    numbers = [7, 8, 7, 9, 8, 7, 10, 7, 9]  # chunks of 4: twins within and across chunks
    _write(tmp_path, [(f"r{i}", n) for i, n in enumerate(numbers)])
    spec = _spec(tmp_path)
    engine = FakeEngine(window=2)
    manifests, done, error = _serve(spec, engine)
    assert error is None and done
    assert sorted(engine.submitted) == [7, 8, 9, 10]
    ((manifest, _),) = manifests
    assert (manifest.rows_out, manifest.rows_reused, manifest.rows_deduplicated) == (9, 0, 5)
    table = read_partition(spec.output, "s0")
    assert table.column("id").to_pylist() == [f"r{i}" for i in range(len(numbers))]
    assert _numbers(table) == numbers
    keys = table.column(REUSE_KEY_COLUMN).to_pylist()
    assert keys[0] == keys[2] == keys[5] and keys[0] != keys[1] and None not in keys


def test_row_reuse_off_computes_every_row_but_still_keys_them(tmp_path):
    rows = [(f"r{i}", 1 + i % 2) for i in range(6)]
    _write(tmp_path, rows)
    spec = _spec(tmp_path, row_reuse="off")
    assert spec.spec_hash() != _spec(tmp_path).spec_hash()  # not the default: hashed
    engine = FakeEngine()
    _, done, error = _serve(spec, engine)
    assert error is None and done and len(engine.submitted) == 6
    _write(tmp_path, [*rows, ("r6", 1)])
    engine = FakeEngine()
    again, done, error = _serve(spec, engine)
    assert error is None and done and len(engine.submitted) == 7
    assert again[0][0].rows_reused == again[0][0].rows_deduplicated == 0
    assert None not in read_partition(spec.output, "s0").column(REUSE_KEY_COLUMN).to_pylist()


def test_the_default_keeps_the_spec_hash_of_specs_written_before_row_reuse(tmp_path):
    spec = _spec(tmp_path)
    payload = spec._results_payload()
    assert "row_reuse" not in payload and "row_reuse" in spec.model_dump()
    assert _spec(tmp_path, row_reuse="auto").spec_hash() == spec.spec_hash()


def _in(spec: InferenceSpec, key: str, **fields) -> InferenceSpec:
    return InferenceSpec.model_validate({**spec.model_dump(), "partition_keys": [key], **fields})


def test_pipeline_scope_copies_rows_other_partitions_computed_and_partition_scope_not(tmp_path):
    """Daily snapshots that repeat rows: with `row_reuse_scope="pipeline"` a new partition
    computes only the rows no committed partition of the pipeline holds; by default (the
    partition's own output only) it computes them all. Outputs equal either way."""
    _write(tmp_path, [(f"a{i}", 100 + i) for i in range(8)], "s0")
    _write(tmp_path, [(f"b{i}", 104 + i) for i in range(8)], "s1")  # 4 of s0's, 4 new
    spec = _spec(tmp_path)
    _, done, error = _serve(_in(spec, "s0"), FakeEngine())
    assert error is None and done

    default = FakeEngine()
    _, done, error = _serve(_in(spec, "s1"), default)
    assert error is None and done and len(default.submitted) == 8
    by_partition = read_partition(spec.output, "s1")

    wide = _spec(tmp_path, out="wide", row_reuse_scope="pipeline")
    assert wide.spec_hash() == _spec(tmp_path, out="wide").spec_hash()  # not in the hash
    _, done, error = _serve(_in(wide, "s0"), FakeEngine())
    assert error is None and done
    engine = FakeEngine()
    ((manifest, _),), done, error = _serve(_in(wide, "s1"), engine)
    assert error is None and done
    assert sorted(engine.submitted) == [108, 109, 110, 111]
    assert (manifest.rows_out, manifest.rows_reused, manifest.rows_deduplicated) == (8, 4, 0)
    table = read_partition(wide.output, "s1")
    assert table.column("id").to_pylist() == [f"b{i}" for i in range(8)]
    assert table.equals(by_partition)  # ids, outputs and keys as computed in full


def test_pipeline_scope_computes_rows_whose_other_partition_was_replaced(tmp_path):
    """A part file of another partition that a commit replaced after the index was read is
    not copied from: those rows are computed, the chunk is not failed."""
    _write(tmp_path, [(f"a{i}", 100 + i) for i in range(4)], "s0")
    _write(tmp_path, [(f"b{i}", 100 + i) for i in range(4)], "s1")
    spec = _spec(tmp_path, row_reuse_scope="pipeline")
    _serve(_in(spec, "s0"), FakeEngine())
    tokens = [ord(c) for c in "row 100"]  # the fake tokenizer's: one token a character
    valid = ValidChunk(index=0, rows=[0], ids=["b0"], token_ids=[tokens], spans=[1])
    found = RowReuse(_in(spec, "s1")).plan("s1", SourceVersion(input="v1"), valid)
    assert found.compute == [] and found.sources[0][0] == "reuse" and found.pinned

    reuse = RowReuse(_in(spec, "s1"))
    reuse._pipeline = pipeline_outputs(spec)
    for path in {ref.path for ref in reuse._pipeline.values()}:
        Path(path).unlink()
    plan = reuse.plan("s1", SourceVersion(input="v1"), valid)
    assert plan.compute == [0] and not plan.pinned


# --------------------------------------------------------------------------- sampling


def _generation_spec(tmp_path: Path, **sampling) -> InferenceSpec:
    spec = _spec(tmp_path).model_dump()
    spec.update(task="generate", sampling=sampling)
    return InferenceSpec.model_validate(spec)


def _request(spec: InferenceSpec, params: dict) -> RowRequest:
    from dagster_gpuinfer.worker.rows.request_params import RequestBuilder

    builder = RequestBuilder(task="generate", defaults=spec.sampling.to_vllm_kwargs())
    return builder.build(params)


def test_unseeded_sampling_is_computed_unless_the_pipeline_asks(tmp_path):
    sampled = _generation_spec(tmp_path, temperature=0.8)
    prompt = [[5, 6, 7]]
    unseeded = _request(sampled, {})
    assert not unseeded.deterministic
    assert RowKeys(sampled).key(None, prompt, unseeded) is None
    assert RowKeys(sampled).key(None, prompt, None) is None  # the pipeline's defaults
    seeded = _request(sampled, {"seed": 3})
    assert seeded.deterministic and RowKeys(sampled).key(None, prompt, seeded) is not None
    greedy_spec = _generation_spec(tmp_path, temperature=0.0)
    greedy = _request(greedy_spec, {})
    assert RowKeys(greedy_spec).key(None, prompt, greedy) is not None
    asked = InferenceSpec.model_validate({**sampled.model_dump(), "row_reuse": "sampled"})
    assert RowKeys(asked).key(None, prompt, unseeded) is not None
    # Seeds and other values are in the key: another seed, another output.
    other_seed = _request(sampled, {"seed": 4})
    keys = RowKeys(sampled)
    assert keys.key(None, prompt, seeded) != keys.key(None, prompt, other_seed)


def test_unseeded_rows_of_a_partition_go_to_the_engine_even_beside_an_earlier_output(tmp_path):
    spec = _generation_spec(tmp_path, temperature=0.8)
    reuse = RowReuse(spec)
    request = _request(spec, {})
    seeded = _request(spec, {"seed": 1})
    valid = ValidChunk(
        index=0,
        rows=[0, 1, 2],
        ids=["a", "b", "c"],
        token_ids=[[1, 2], [1, 2], [1, 2]],
        requests=[request, seeded, seeded],
        spans=[1, 1, 1],
    )
    plan = reuse.plan("s0", SourceVersion(input="v1"), valid)
    assert [kind for kind, _ in plan.sources] == ["compute", "compute", "dup"]
    assert plan.compute == [0, 1] and plan.keys[0] is None


# --------------------------------------------------------------------------- the key

PROMPTS = st.lists(st.lists(st.integers(0, 50_000), min_size=1, max_size=8), min_size=1, max_size=3)
TEXT = st.text(max_size=12)


@settings(max_examples=200, deadline=None)
@given(
    prompts=PROMPTS,
    params=st.one_of(st.none(), TEXT),
    model=st.one_of(st.none(), TEXT),
    adapter=st.one_of(st.none(), TEXT),
    images=st.one_of(st.none(), st.lists(st.text("0123456789abcdef,", max_size=8), max_size=3)),
    change=st.sampled_from(["prompt", "params", "model", "adapter", "seed_top", "split", "image"]),
)
def test_equal_requests_have_equal_keys_and_any_change_another(
    tmp_path_factory, prompts, params, model, adapter, images, change
):
    keys = RowKeys(_spec(Path("/k")))
    request = RowRequest(reuse_params=params)
    same = RowRequest(reuse_params=params)
    key = keys.key(model, prompts, request, adapter=adapter, images=images)
    assert key is not None
    same_images = None if images is None else list(images)
    assert key == keys.key(
        model, [list(p) for p in prompts], same, adapter=adapter, images=same_images
    )
    other_prompts, other_request, other_model, other_adapter = prompts, request, model, adapter
    other_images = images
    if change == "prompt":
        other_prompts = [*prompts[:-1], [*prompts[-1], 1]]
    elif change == "params":
        other_request = RowRequest(reuse_params=(params or "") + "x")
    elif change == "model":
        other_model = (model or "") + "x"
    elif change == "adapter":
        other_adapter = (adapter or "") + "x"
    elif change == "seed_top":
        other_request = dataclasses.replace(request, top_logprobs=2)
    elif change == "image":  # another image's bytes (or one more) under any reference
        other_images = [*(images or [""])[:-1], (images or [""])[-1] + "f"]
    else:  # the same tokens split into other prompts
        flat = [t for p in prompts for t in p]
        other_prompts = [flat] if len(prompts) > 1 else [flat[:1], flat[1:]]
    other = keys.key(
        other_model, other_prompts, other_request, adapter=other_adapter, images=other_images
    )
    assert key != other


def _image_spec(tmp_path: Path) -> InferenceSpec:
    return InferenceSpec.model_validate({**_spec(tmp_path).model_dump(), "task": "image_embed"})


def test_image_rows_are_keyed_by_their_images_bytes_not_their_references(tmp_path):
    """An image row's key holds its images' digests (`DecodedImage.digest`, of the bytes):
    the same path with other bytes is another key; without digests no key (computed)."""
    from assets.images import draw_shape, encode
    from dagster_gpuinfer.image_options import ImageOptions
    from dagster_gpuinfer.worker.tasks.images import decode_image

    one = decode_image(encode(draw_shape("circle", "red", (40, 30)), "PNG"), ImageOptions())
    two = decode_image(encode(draw_shape("square", "red", (40, 30)), "PNG"), ImageOptions())
    again = decode_image(encode(draw_shape("circle", "red", (40, 30)), "PNG"), ImageOptions())
    assert one.digest == again.digest != two.digest
    keys = RowKeys(_image_spec(tmp_path))

    def chunk(digests):
        return ValidChunk(
            index=0,
            rows=[0, 1],
            ids=["a", "b"],
            token_ids=[[5, 6], [5, 6]],
            spans=[1, 1],
            images=[["img/a.png"], ["img/b.png"]],
            image_digests=digests,
        )

    first = keys.chunk_keys(chunk([one.digest, one.digest]), "m")
    edited = keys.chunk_keys(chunk([one.digest, two.digest]), "m")
    assert first[0] == first[1] == edited[0] != edited[1] and None not in first
    assert keys.chunk_keys(chunk([]), "m") == [None, None]


def test_every_output_row_carries_its_input_digest_and_what_it_covers(tmp_path):
    """The digest the backfill estimate compares a changed shard with: of the row's text
    (not its id), named in the part file's schema metadata; copied rows get their own."""
    from dagster_gpuinfer.storage.digests import digest_columns_of, row_digest

    rows = [(f"r{i}", 100 + i) for i in range(6)]
    _write(tmp_path, rows)
    spec = _spec(tmp_path)
    _serve(spec, FakeEngine())
    _write(tmp_path, [("renamed", 100), *rows[1:], ("r6", 106)])
    _serve(spec, FakeEngine())
    table = read_partition(spec.output, "s0")
    assert table.column("input_digest").to_pylist() == [
        row_digest([f"row {n}"]) for n in [100, 101, 102, 103, 104, 105, 106]
    ]
    part = next((tmp_path / "out").rglob("part-*.parquet"))
    assert digest_columns_of(pq.read_schema(part).metadata) == ["text"]


@pytest.mark.parametrize(
    "field",
    [
        {"model": "/other"},
        {"engine": {"dtype": "float16"}},
        {"engine": {"max_model_len": 99}},
        {"input": {"uri": "x/{partition_key}.parquet", "text_column": "body"}},
    ],
)
def test_a_change_to_an_output_shaping_setting_changes_every_key(tmp_path, field):
    base = _spec(tmp_path)
    changed = InferenceSpec.model_validate({**base.model_dump(), **field})
    assert RowKeys(base).key(None, [[1]], None) != RowKeys(changed).key(None, [[1]], None)


def test_where_rows_come_from_and_go_to_does_not_change_the_keys(tmp_path):
    base = _spec(tmp_path)
    moved = InferenceSpec.model_validate(
        {
            **base.model_dump(),
            "input": {"uri": "elsewhere/{partition_key}.parquet"},
            "output": {"root": "/elsewhere", "asset_name": "other"},
            "chunk_size": 99,
            "partition_keys": ["zz"],
            "engine": {"max_num_seqs": 8, "gpu_memory_utilization": 0.3},
            "replicas": 2,
        }
    )
    assert RowKeys(base).key("m", [[1]], None) == RowKeys(moved).key("m", [[1]], None)


def test_score_pairs_are_keyed_by_their_texts(tmp_path):
    spec = InferenceSpec.model_validate(
        {
            **_spec(tmp_path).model_dump(),
            "task": "score",
            "input": {"uri": "x/{partition_key}.jsonl"},
        }
    )
    keys = RowKeys(spec)
    one = keys.key(None, [], None, pairs=ScorePairs(["q"], ["d1"]))
    assert one == keys.key(None, [], None, pairs=ScorePairs(["q"], ["d1"]))
    assert one != keys.key(None, [], None, pairs=ScorePairs(["q"], ["d2"]))
    assert one != keys.key(None, [], None, pairs=ScorePairs(["q"], ["d1"], rerank=True))


def test_a_re_run_that_dies_mid_window_resumes_and_commits_each_row_once(tmp_path):
    import threading

    rows = [(f"r{i}", 1000 + i) for i in range(10)]
    _write(tmp_path, rows)
    spec = _spec(tmp_path)
    _, done, error = _serve(spec, FakeEngine())
    assert error is None and done
    rows[3] = ("r3", 2003)
    rows += [(f"r{i}", 1000 + i) for i in range(10, 13)]
    _write(tmp_path, rows)

    committed = threading.Event()
    failing = FakeEngine(window=1, steps_per_request=2, fail_at_step=5, before_failing=committed)
    manifests, done, error = _serve(spec, failing, after_commit=committed)
    assert error is not None and manifests == [] and not done
    retry = FakeEngine()
    manifests, done, error = _serve(spec, retry)
    assert error is None and done
    assert set(retry.submitted) <= {1010, 1011, 1012, 2003}
    ((manifest, _),) = manifests
    assert manifest.rows_out == 13 and manifest.rows_resumed > 0
    table = read_partition(spec.output, "s0")
    assert table.column("id").to_pylist() == [i for i, _ in rows]  # each once, in order
    assert _numbers(table) == [n for _, n in rows]


def test_chunks_mostly_copied_never_leave_the_loop_waiting_for_a_window(tmp_path):
    """A window (16 requests) larger than the rows to compute in all the chunks the run may
    have outstanding (6 chunks of 4, one row of each to compute): the loop submits what it
    has instead of waiting for rows that cannot come (it used to wait for ever)."""
    import threading

    rows = [(f"r{i}", 1000 + i) for i in range(40)]
    _write(tmp_path, rows)
    spec = _spec(tmp_path)
    _, done, error = _serve(spec, FakeEngine(window=16))
    assert error is None and done
    for i in range(1, 40, CHUNK):  # one row edited in each chunk: every chunk outstanding
        rows[i] = (f"r{i}", 2000 + i)
    _write(tmp_path, rows)
    engine = FakeEngine(window=16)
    outcome: list = []
    runner = threading.Thread(target=lambda: outcome.append(_serve(spec, engine)), daemon=True)
    runner.start()
    runner.join(60)
    assert not runner.is_alive(), "the loop waited for a window of rows that never came"
    ((manifests, done, error),) = outcome
    assert error is None and done
    assert sorted(engine.submitted) == [2000 + i for i in range(1, 40, CHUNK)]
    assert manifests[0][0].rows_reused == 30
    assert _numbers(read_partition(spec.output, "s0")) == [n for _, n in rows]


def test_a_rows_adapter_and_its_version_are_in_its_key(tmp_path):
    """Rows naming a LoRA adapter are keyed by its name and files' version: new files for
    one adapter recompute its rows only; a name the source does not list gets no key."""
    spec = _generation_spec(tmp_path, temperature=0.0)
    keys = RowKeys(spec)
    base, support, legal = (
        dataclasses.replace(_request(spec, {}), adapter=name) for name in (None, "support", "legal")
    )
    chunk = ValidChunk(
        index=0,
        rows=[0, 1, 2],
        ids=["a", "b", "c"],
        token_ids=[[5, 6], [5, 6], [5, 6]],
        requests=[base, support, legal],
    )
    before = keys.chunk_keys(chunk, "m", "legal=v1;support=v1")
    assert len(set(before)) == 3 and None not in before  # same prompt, three models
    after = keys.chunk_keys(chunk, "m", "legal=v1;support=v2")
    assert after[0] == before[0] and after[2] == before[2] and after[1] != before[1]
    assert keys.chunk_keys(chunk, "m", "legal=v1")[1] is None  # unknown: computed


# --------------------------------------------------------------------------- the estimate


def _estimate(spec: InferenceSpec):
    from dagster_gpuinfer.estimate import estimate_backfill

    return estimate_backfill(spec, ["s0"], asset="emb", partitions_per_run=1)


def test_the_estimate_counts_the_rows_a_re_run_will_compute(tmp_path):
    """A committed shard gains 3 rows and has 1 edited and 1 renamed (same text): the
    estimate reads the shard and the earlier output's digests and counts 4 of 13 rows to
    compute (a renamed Parquet row is the same input); the run then computes exactly those."""
    rows = [(f"r{i}", 1000 + i) for i in range(10)]
    _write(tmp_path, rows)
    spec = _spec(tmp_path)
    _serve(spec, FakeEngine())
    rows[3] = ("r3", 2003)
    rows[5] = ("renamed", 1005)
    rows += [(f"r{i}", 1000 + i) for i in range(10, 13)]
    _write(tmp_path, rows)
    estimate = _estimate(spec)
    assert (estimate.partitions_reusable, estimate.partitions_reuse_counted) == (1, 1)
    assert (estimate.reuse_rows_to_compute, estimate.reuse_rows) == (4, 13)
    assert estimate.pending_work == 4
    assert "4 of 13 rows are new or changed" in estimate.summary()
    engine = FakeEngine()
    _serve(spec, engine)
    assert sorted(engine.submitted) == [1010, 1011, 1012, 2003]

    # Under another reuse scope (another model) the keys all change: counted in full.
    other = InferenceSpec.model_validate({**spec.model_dump(), "model": "/other"})
    _write(tmp_path, rows[:-1])
    estimate = _estimate(other)
    assert estimate.partitions_reuse_counted == 0 and estimate.pending_work == 12
    assert "1 counted in full" in estimate.summary()


def test_the_estimate_counts_changed_jsonl_lines(tmp_path, monkeypatch):
    """JSONL lines by their bytes: one edited and one appended of 9 (its share of the
    file's bytes is the work counted)."""
    import json

    def write(lines: list[tuple[str, int]]) -> None:
        (tmp_path / "in").mkdir(exist_ok=True)
        text = "".join(json.dumps({"id": i, "text": f"row {n}"}) + "\n" for i, n in lines)
        (tmp_path / "in" / "s0.jsonl").write_text(text)

    lines = [(f"r{i}", 100 + i) for i in range(8)]
    write(lines)
    uri = str(tmp_path / "in" / "{partition_key}.jsonl")
    spec = InferenceSpec.model_validate({**_spec(tmp_path).model_dump(), "input": {"uri": uri}})
    _serve(spec, FakeEngine())
    write([*lines[:6], ("r6", 206), ("r7", 107), ("r8", 108)])
    estimate = _estimate(spec)
    assert (estimate.reuse_rows_to_compute, estimate.reuse_rows) == (2, 9)
    size = (tmp_path / "in" / "s0.jsonl").stat().st_size
    assert estimate.pending_work == pytest.approx(size * 2 / 9)
    import dagster_gpuinfer.estimate as estimate_module

    monkeypatch.setattr(estimate_module, "MAX_REUSE_READ_BYTES", size - 1)  # over budget
    over = _estimate(spec)
    assert over.partitions_reuse_counted == 0 and over.pending_work == size


def test_a_chunk_whose_every_row_is_quarantined_commits(tmp_path):
    """No row of the second chunk reaches the engine or a copy: its part holds no rows
    (the assembly took an empty index list as nulls and failed the worker)."""
    (tmp_path / "in").mkdir()
    texts = ["row 1", "row 2", "row 3", "row 4", None, None, None, None]
    table = pa.table({"id": [f"r{i}" for i in range(8)], "text": pa.array(texts, pa.string())})
    pq.write_table(table, tmp_path / "in" / "s0.parquet")
    spec = _spec(tmp_path)
    ((manifest, _),), done, error = _serve(spec, FakeEngine())
    assert error is None and done
    assert (manifest.rows_out, manifest.rows_errored) == (4, 4)
