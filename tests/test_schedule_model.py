"""bench/schedule_model.py: the list-scheduling model behind the selected and compressed dK/dV's program order
(bench/KERNELS.md, "2026-11-27 H100")."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import schedule_model as sm  # noqa: E402


def test_makespan_is_list_scheduling():
    # two slots: 3 and 1 start at 0, 1 ends first and takes the 2 (ends at 3), then the 4 starts at 3 on it
    assert sm.makespan([3, 1, 2, 4], 2) == 7
    assert sm.makespan([4, 3, 2, 1], 2) == 5  # heaviest first
    assert sm.makespan([1] * 6, 3) == 2


def test_pair_counts_hold_every_querys_selection():
    counts = sm.selected_pair_counts(1000, np.random.default_rng(0))
    assert counts.sum() == sum(min(sm.N_SEL, q // sm.BLOCK + 1) for q in range(1000))
    assert counts[0] == 1000  # block 0 is forced for every query


def test_draws_without_replacement_follow_successive_weighted_picks():
    """schedule_model's Gumbel-top-k draw has the law of picking one index at a time with probability weight /
    remaining weight: weights 1, 2, 7 give first picks 0.1 / 0.2 / 0.7, and pairs {0, 1} with probability
    0.1 * 2/9 + 0.2 * 1/8 = 0.0472, {0, 2} 0.1 * 7/9 + 0.7 * 1/3 = 0.311, {1, 2} 0.2 * 7/8 + 0.7 * 2/3 = 0.642."""
    weight = np.array([1.0, 2.0, 7.0])
    rng = np.random.default_rng(0)
    single = sm.draw_without_replacement(rng, np.log(weight), 200_000, 1)
    assert np.allclose(np.bincount(single.ravel(), minlength=3) / 200_000, [0.1, 0.2, 0.7], atol=0.005)
    pairs = np.sort(sm.draw_without_replacement(rng, np.log(weight), 200_000, 2), axis=1)
    assert (pairs[:, 0] != pairs[:, 1]).all()  # distinct
    share = {pair: ((pairs[:, 0] == pair[0]) & (pairs[:, 1] == pair[1])).mean() for pair in ((0, 1), (0, 2), (1, 2))}
    expected = {(0, 1): 0.1 * 2 / 9 + 0.2 / 8, (0, 2): 0.1 * 7 / 9 + 0.7 / 3, (1, 2): 0.2 * 7 / 8 + 0.7 * 2 / 3}
    assert all(abs(share[p] - expected[p]) < 0.005 for p in expected), (share, expected)


def test_the_default_orders_are_near_balanced_where_the_old_ones_were_not():
    """At 8k (125M layout) the old selected dK/dV order left block 0 of the last rows to the end (about 1.9x the
    balanced time), the default is within 10%; the compressed dK/dV likewise (old about 1.3x)."""
    rng = lambda: np.random.default_rng(0)  # noqa: E731
    old = sm.selected_dkdv(8192, 2, 10, 264, rng(), "old")
    new = sm.selected_dkdv(8192, 2, 10, 264, rng(), "pieces")
    assert old > 1.5 and new < 1.1, (old, new)
    assert sm.compressed_dkdv(8192, 2, 10, 264, old=True) > 1.2
    assert sm.compressed_dkdv(8192, 2, 10, 264, old=False) < 1.05


def test_query_tiles_launched_heaviest_first_end_nearer_the_balanced_time():
    """A query tile's work grows along the row, so tile i on program i (as timed until 2026-11-27) ends each launch
    on the longest tiles; the default's reversed order (_query_tile_id) is nearer the balanced time for each kernel
    at 8k and 64k, and the model's tile cost grows with the union of random picks."""
    assert sm.tile_union(100, 10) == 2  # two blocks visible: both chosen
    assert sm.tile_union(8191, 10) > sm.tile_union(4095, 10) > sm.N_SEL
    for kernel in sm.QUERY_TILE_KERNELS:
        for seq_len in (8192, 65536):
            old = sm.query_tiles(seq_len, 6, 2, kernel, 264, light_first=True)
            new = sm.query_tiles(seq_len, 6, 2, kernel, 264, light_first=False)
            assert new < old, (kernel, seq_len, old, new)
    assert sm.query_tiles(8192, 6, 2, "fused dQ", 264, light_first=True) > 1.03


def test_topn_model_counts_the_kernels_insertion_steps():
    """bench/topn_model.py: a query whose 16 blocks fill one chunk takes 16 insertion steps into its empty list, none
    with the first chunk placed whole (the kernel's _topn_chunk_update since 2026-11-27); over a long row the
    placement saves exactly the first chunk's steps, and later chunks' steps fall as the list's worst entry rises."""
    import topn_model as tm

    one_chunk = np.array([16 * tm.BLOCK - 1])
    assert tm.tile_steps(one_chunk, np.random.default_rng(0), first_placed=False) == (1, 16)
    assert tm.tile_steps(one_chunk, np.random.default_rng(0), first_placed=True) == (1, 0)
    row = np.arange(8) + 64 * tm.BLOCK  # 8 queries past 64 blocks: 5 chunks
    chunks, steps = tm.tile_steps(row, np.random.default_rng(1), first_placed=False)
    _, placed = tm.tile_steps(row, np.random.default_rng(1), first_placed=True)
    assert chunks == 5 and steps - placed == 16
    assert placed < 16 * (chunks - 1)  # fewer than a full list per later chunk


def test_topn_model_merges_the_chunks_where_more_than_insert_max_blocks_enter():
    """bench/topn_model.py with the kernel's TOPN_INSERT_MAX rule: a chunk whose most-entering query takes more than
    insert_max blocks is one merge and no steps; the others keep their steps. Insert-max 0 merges every chunk with an
    entering block (after the first, placed whole), no limit merges none, and the steps a limit removes are those of
    its merged chunks (the same draws: more than insert_max each)."""
    import topn_model as tm

    row = np.arange(8) + 64 * tm.BLOCK  # 5 chunks, the first placed whole
    _, insert_all, merges_none = tm.tile_work(row, np.random.default_rng(1), True)
    assert merges_none == 0 and insert_all > 0
    _, steps0, merges0 = tm.tile_work(row, np.random.default_rng(1), True, insert_max=0)
    assert steps0 == 0 and merges0 == 4  # every later chunk has a block entering some list (random priorities)
    for k in (1, 2, 3):
        _, steps, merges = tm.tile_work(row, np.random.default_rng(1), True, insert_max=k)
        assert 0 < merges < 4 and steps <= k * (4 - merges), (k, steps, merges)
        assert insert_all - steps >= (k + 1) * merges, (k, insert_all, steps, merges)
    from modeling_nsa.nsa_triton_launch import TOPN_INSERT_MAX, _topn_insert_max

    assert _topn_insert_max() == TOPN_INSERT_MAX == 2  # the rule the model and bench/KERNELS.md's table count


def test_concentrated_picks_pieces_balance_where_fixed_splits_did_not():
    """Correlated queries concentrate their picks on a few blocks per row, so at 64k more blocks pass 4,096 pairs
    than a fixed 64 splits x 16 slots held (27e2931's scheme, timed at 8.3 ms where ~2.5 is balanced: the model
    says about 3x); pieces of one size for every heavy block (_sel_heavy_pieces) bring it under 2x. Concentrated
    picks also make the heaviest blocks after block 0 heavier than uniform ones do."""
    rng = lambda: np.random.default_rng(0)  # noqa: E731
    uniform, concentrated = (sm.selected_pair_counts(8192, rng(), picks) for picks in ("uniform", "concentrated"))
    assert uniform.sum() == concentrated.sum() and concentrated[1:].max() > 1.5 * uniform[1:].max()
    fixed = sm.selected_dkdv(65536, 2, 10, 264, rng(), "fixed", "concentrated")
    pieces = sm.selected_dkdv(65536, 2, 10, 264, rng(), "pieces", "concentrated")
    assert fixed > 2.5 and pieces < 2.0, (fixed, pieces)
