"""The streaming loop's order of submission (worker/loop/engine_loop.py `prefix_order`): rows sorted
by prompt when that brings whole KV blocks of shared prefix together, else input order."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from dagster_gpuinfer.worker.loop.engine_loop import _shared_blocks, prefix_order


def tokens(row):
    return row[1]


def test_rows_sharing_whole_blocks_are_brought_together():
    header_a, header_b = list(range(100, 132)), list(range(200, 232))  # two blocks of 16
    rows = [(i, (header_a if i % 2 else header_b) + [i]) for i in range(6)]
    ordered = prefix_order(rows, tokens, 16)
    assert [i for i, _ in ordered] == [1, 3, 5, 0, 2, 4]
    assert _shared_blocks(ordered, tokens, 16) == 8 > _shared_blocks(rows, tokens, 16)


def test_prompts_sharing_less_than_a_block_keep_their_input_order():
    # Short prompts (as the long-tail bench's ~16 tokens against the CPU build's 128-token
    # blocks): sorting would only permute them.
    rows = [(i, [1, 2, 3, (7 * i) % 5, i]) for i in range(8)]
    assert prefix_order(rows, tokens, 128) == rows
    assert prefix_order(rows, tokens, 2) != rows  # with 2-token blocks [1, 2] is shared


def test_rows_already_grouped_keep_their_order():
    header = list(range(64))
    rows = [(i, header + [50 - i]) for i in range(5)]  # grouped already, not sorted
    assert prefix_order(rows, tokens, 16) == rows


@given(
    st.lists(st.lists(st.integers(0, 3), max_size=12), max_size=30),
    st.integers(1, 4),
)
def test_prefix_order_is_a_permutation_that_never_shares_fewer_blocks(prompts, block_size):
    rows = list(enumerate(prompts))
    ordered = prefix_order(rows, tokens, block_size)
    assert sorted(ordered) == sorted(rows)
    assert _shared_blocks(ordered, tokens, block_size) >= _shared_blocks(rows, tokens, block_size)
    if ordered != rows:
        assert ordered == sorted(rows, key=tokens)
