"""What the Triton op keeps in memory at its fwd+bwd peak (CPU allocation accounting, bench/memory_cpu.py).

The step runs the op's host code with no-op kernels; every shape is static, so the tensors alive at the
peak are those a GPU run allocates. The query-sized ones must be exactly: the gated output, the three
saved branch outputs and dQ, all in the input dtype. Zero gradients materialized for the saved-only
outputs (three more) or an fp32 dQ accumulator of its own would show here (the pair-wise dQ modes lay theirs over
the saved interval outputs); so would a heavy-block partial buffer
sized by the worst case instead of its cap.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

try:
    import triton  # noqa: F401

    HAS_TRITON = True
except Exception:
    HAS_TRITON = False


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_peak_holds_only_output_branch_outputs_and_dq():
    import memory_cpu

    # enough key tiles that the window dK/dV needs no split partials (those are capped in absolute size:
    # at most 1024 programs' fp32 tiles, 32 MiB at d64, which dominates only at small B*T)
    batch, seq_len, heads, head_dim = 8, 4096, 12, 64
    mode = memory_cpu.step_peak(batch, seq_len, heads, 2, head_dim)
    q_shape = (batch, seq_len, heads, head_dim)
    q_bytes = batch * seq_len * heads * head_dim * 2
    query_sized = [row for row in mode.at_peak if row[2] >= q_bytes]
    assert len(query_sized) == 5, query_sized
    assert all(shape == q_shape and dtype == torch.bfloat16 for shape, dtype, _ in query_sized), query_sized
    # everything else together stays below two query-sized tensors at this shape
    rest = sum(nbytes for _, _, nbytes in mode.at_peak) - 5 * q_bytes
    assert rest < 2 * q_bytes, (rest / q_bytes, sorted(mode.at_peak, key=lambda r: -r[2])[:8])


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_block_outer_forward_keeps_the_peak():
    """The block-outer selected forward (sel_fwd_pairs) keeps the op's peak where it is: its partials (at most twice
    q's size per chunk) live in the forward, below the backward's peak."""
    import memory_cpu
    from memory_cpu import tri

    batch, seq_len, heads, head_dim = 2, 4096, 12, 64
    default = memory_cpu.step_peak(batch, seq_len, heads, 2, head_dim).peak
    with tri.launch_overrides(sel_fwd_pairs=True):
        assert memory_cpu.step_peak(batch, seq_len, heads, 2, head_dim).peak == default


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("settings", [dict(sel_dq_in_dkdv=True), dict(sel_fwd_pairs=True, sel_dq_in_dkdv=True),
                                      dict(sel_dq_pairs=True), dict(sel_fwd_pairs=True, sel_dq_pairs=True)],
                         ids=["atomic", "pairs_all", "pair_dq_kernel", "block_outer"])
def test_pairwise_dq_keeps_its_fp32_dq_over_the_interval_outputs(settings):
    """The pair-wise selected dQ modes need the interval branches' dQ in fp32 while the selected shares are added
    to it (B*T*H*D floats: 192 MiB at 64k tokens x 12 heads, which took the peak from 596 to 779 MiB, above dense
    SDPA's 615). The backward lays it over the saved o_cmp and o_win (nsa_triton._nsa_bwd_reusing_op): no fp32
    buffer of that size is alive at the peak, which stays at or below the default's (the pair-dQ kernel adds at
    most one chunk of partials, q's size)."""
    import memory_cpu
    from memory_cpu import tri

    batch, seq_len, heads, head_dim = 2, 4096, 12, 64
    q_bytes = batch * seq_len * heads * head_dim * 2
    default = memory_cpu.step_peak(batch, seq_len, heads, 2, head_dim).peak
    with tri.launch_overrides(**settings):
        mode = memory_cpu.step_peak(batch, seq_len, heads, 2, head_dim)
    fp32_dq = [row for row in mode.at_peak if row[1] == torch.float32 and row[2] >= 2 * q_bytes]
    assert not fp32_dq, sorted(mode.at_peak, key=lambda r: -r[2])[:8]
    extra = q_bytes if settings.get("sel_dq_pairs") else 0
    assert mode.peak <= default + extra, (default / q_bytes, mode.peak / q_bytes)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("qpb", [10, 4], ids=["125M-G6", "fla-G16"])
@pytest.mark.parametrize("picks", ["uniform", "concentrated"])
def test_selected_dkdv_heavy_pieces_fit_fixed_partials_and_cover_every_split_block(qpb, picks):
    """The selected dK/dV's heavy blocks (_sel_heavy_split's defaults: the 256 heaviest above 1,024 pairs, pieces
    of at least 32 tiles, 1,024 fp32 partials: 16 MiB each for dK and dV at head_dim 64 whatever the length): every
    block given a slot (_sel_heavy_slots) fits the partials (_sel_heavy_pieces' bound),
    its pieces are whole tiles but its last and cover its pairs exactly, and pieces stay at the smallest size
    unless the split blocks' pairs need larger ones. Pair counts per block as a row's at 8k-256k (every query's
    block 0, uniform or concentrated picks: correlated queries' many heavy blocks, which a fixed count of slots
    left unsplit at 64k on 2026-11-27)."""
    from modeling_nsa.nsa_triton_selected import _sel_heavy_pieces, _sel_heavy_slots, _sel_heavy_split

    gen = torch.Generator().manual_seed(0)
    heavy_min, min_piece, max_pieces, max_slots = _sel_heavy_split(qpb)
    assert (heavy_min, max_pieces, max_slots) == (1024, 1024, 256) and min_piece == 32 * qpb
    for rows, num_q in ((8, 8192), (2, 32768), (1, 65536), (1, 262144)):
        n_blocks = num_q // 64
        weights = torch.ones(n_blocks) if picks == "uniform" else 1.0 / torch.arange(1, n_blocks + 1) ** 1.2
        cnt = torch.zeros(rows, n_blocks, dtype=torch.int64)
        for r in range(rows):
            chosen = torch.multinomial(weights, num_q * 13, replacement=True, generator=gen)
            cnt[r] = torch.bincount(chosen, minlength=n_blocks).clamp(max=num_q)
        cnt[:, 0] = num_q  # every query's forced block 0
        cnt = cnt.flatten()
        heavy = cnt > heavy_min
        n_slots = max(1, min(cnt.numel(), max_slots, int(cnt.sum()) // (heavy_min + 1)))
        hpos, _ = _sel_heavy_slots(cnt, heavy, n_slots)
        pair_off = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(cnt, 0)])
        pieces, piece_start = _sel_heavy_pieces(cnt, pair_off, hpos, qpb, min_piece, max_pieces, wide=False)
        assert pieces.dtype == torch.int32 and pieces.shape == (max_pieces, 3)
        block, first, end = pieces.long().unbind(1)
        used = hpos < cnt.numel()
        n_pieces = int(piece_start[-1])
        assert n_pieces <= max_pieces, (num_q, picks, n_pieces)
        assert int(used.sum()) == min(n_slots, int(heavy.sum()))  # every slot holds a heavy block while any is left
        span = int((end - first)[:n_pieces].max())  # the launch's piece size: every piece but a block's last
        assert span % qpb == 0 and span >= min_piece
        for h in range(n_slots):
            mine = slice(int(piece_start[h]), int(piece_start[h + 1]))
            if not used[h]:
                assert mine.start == mine.stop
                continue
            f = int(hpos[h])
            assert (block[mine] == f).all() and int(first[mine][0]) == int(pair_off[f])
            assert (first[mine][1:] == end[mine][:-1]).all() and int(end[mine][-1]) == int(pair_off[f + 1])
            assert ((end[mine] - first[mine])[:-1] == span).all()  # whole tiles but the last
        assert (block[n_pieces:] == cnt.numel()).all()  # past the last piece: no block
        # pieces grow past the smallest only where the split blocks' pairs need it
        split_pairs = int(cnt[hpos[used]].sum())
        assert span == min_piece or split_pairs > (max_pieces - n_slots) * (span - qpb), (span, split_pairs)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("settings", [{}, dict(sel_dq_in_dkdv=True)], ids=["union_dq", "atomic_dq"])
def test_second_backward_after_the_outputs_were_reused_is_refused(settings):
    """A graph backpropagated twice (retain_graph=True): the default dQ reads the saved outputs both times; after a
    pair-wise dQ's backward has overwritten o_cmp and o_win with its fp32 dQ, the second backward raises, naming
    the override, instead of computing gradients from the overwritten outputs. (Host code only: no-op kernels.)"""
    import memory_cpu
    from memory_cpu import tri
    from triton_aot import with_kernels_replaced
    from triton_helpers import DEFAULT, make_inputs

    t, cmp_end, doc_pos, params = make_inputs(1, 256, 4, 2, 64, DEFAULT, torch.bfloat16, "cpu", "single")
    leaves = {n: x.requires_grad_(True) for n, x in t.items()}
    outcome = {}

    def twice():
        with tri.launch_overrides(**settings):
            out = tri.nsa_attention_triton(leaves["q"], leaves["k_cmp"], leaves["v_cmp"], cmp_end, leaves["k_slc"],
                                           leaves["v_slc"], leaves["k_win"], leaves["v_win"], leaves["gates"],
                                           doc_pos, params)
            out.float().sum().backward(retain_graph=True)
            try:
                out.float().sum().backward()
                outcome["second"] = "ran"
            except RuntimeError as exc:
                outcome["second"] = str(exc)

    with_kernels_replaced(twice, lambda name, fn: memory_cpu._NoKernel())
    if settings:
        assert "second backward" in outcome["second"] and "sel_dq_in_dkdv" in outcome["second"], outcome
    else:
        assert outcome["second"] == "ran", outcome
