"""The backward's dQ: one kernel per query tile for all three branches (dQ in registers, written once), which
also writes the gate gradients and the per-branch deltas the dK/dV kernels read.
"""

from __future__ import annotations

import torch

from .nsa_layout import NSAParams
from .nsa_triton_common import _FP_FUSION, _LOG2E, _FloatDq, _cdiv, _launch_shapes
from .nsa_triton_launch import (_OVERRIDES, _dq_launch, _kv_offsets_fit_int32, _query_tiles_light_first,
                                _sel_dq_reduce_rows, _sel_fwd_opts, _sel_rows_per_program, _sel_sub_tile)
from .nsa_triton_selected import _tile_block_union


try:  # the module must import where triton is missing (CPU-only installs, macOS)
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - exercised only without triton
    triton = tl = None


if triton is not None:
    from .nsa_triton_common import _dq_load, _dq_store, _load_lse, _query_tile_id, _tile_rows
    from .nsa_triton_interval import _interval_kv, _interval_tiles
    from .nsa_triton_selected import _sel_block, _sel_chosen, _sel_sub_rows, _sel_visible

    # ------------------------------------------------------------------------------------------
    # Backward dQ: one kernel for the three branches
    # ------------------------------------------------------------------------------------------

    @triton.jit
    def _dq_update(q, do, lse, delta, k, v, vis, sm_scale2, dq, MASKED: tl.constexpr):
        """A key tile's share of the query tile's dQ (unscaled): the flash-attention backward with the
        probabilities recomputed from the saved log-sum-exp (the dQ side of _dkdv_update); vis is ignored
        unless MASKED."""
        s = tl.dot(q, tl.trans(k)) * sm_scale2
        p = tl.exp2(s - lse[:, None])
        if MASKED:
            p = tl.where(vis, p, 0.0)
        ds = p * (tl.dot(do, tl.trans(v)) - delta[:, None])
        return dq + tl.dot(ds.to(k.dtype), k)

    @triton.jit
    def _interval_dq_range(q, do, lse, delta, K, V, kv_base, lo, hi, k_from, k_to, k_end, sm_scale2, dq,
                           HKV: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
                           KV32: tl.constexpr):
        for k0 in range(k_from, k_to, BLOCK_N):
            k, v, vis = _interval_kv(K, V, kv_base, k0, k_end, lo, hi, HKV, D, BLOCK_N, MASKED, KV32)
            dq = _dq_update(q, do, lse, delta, k, v, vis, sm_scale2, dq, MASKED)
        return dq

    @triton.jit
    def _interval_dq(q, do, lse, delta, K, V, kv_base, lo, hi, row_ok, Nk, sm_scale2,
                     HKV: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, KV32: tl.constexpr):
        """dQ (unscaled) of one interval branch for the tile's rows: keys [lo, hi) of K/V per row; the middle
        tiles unmasked (see _interval_tiles; rows outside the tile hold q = do = delta = 0 and add nothing)."""
        hi = tl.where(row_ok, hi, lo)
        k_begin, k_end, full_lo, full_hi = _interval_tiles(lo, hi, row_ok, Nk, BLOCK_N)
        dq = tl.zeros(q.shape, tl.float32)
        dq = _interval_dq_range(q, do, lse, delta, K, V, kv_base, lo, hi, k_begin, full_lo, k_end, sm_scale2, dq,
                                HKV, D, BLOCK_N, True, KV32)
        dq = _interval_dq_range(q, do, lse, delta, K, V, kv_base, lo, hi, full_lo, full_hi, k_end, sm_scale2, dq,
                                HKV, D, BLOCK_N, False, KV32)
        return _interval_dq_range(q, do, lse, delta, K, V, kv_base, lo, hi, full_hi, k_end, k_end, sm_scale2, dq,
                                  HKV, D, BLOCK_N, True, KV32)

    @triton.jit
    def _branch_prep(DOUT, O, GATE, DG, DELTA, LSE, LSE_G, row, row_ok, d, R, D: tl.constexpr, BR: tl.constexpr):
        """One branch's per-row values for the tile's rows. Stores the gate gradient dgate = dout . o and, for the
        dK/dV kernels (_bwd_rows), the gate folded into the log-sum-exp: lse_g = lse - log2 g (+inf where g = 0)
        and delta = dout . o in fp32. Returns, for this kernel's dQ, round(g dout), its delta rowsum(round(g dout)
        * o) and the log-sum-exp (0 where no key was visible)."""
        off = row[:, None] * D + d[None, :]
        dout = tl.load(DOUT + off, mask=row_ok[:, None], other=0.0)
        o = tl.load(O + off, mask=row_ok[:, None], other=0.0).to(tl.float32)
        gt = tl.load(GATE + row * 3 + BR, mask=row_ok, other=1.0).to(tl.float32)  # (1: no log2(0) off the rows)
        lse = _load_lse(LSE, row, row_ok)
        dgate = tl.sum(dout.to(tl.float32) * o, 1)
        tl.store(DG + row * 3 + BR, dgate.to(DG.dtype.element_ty), mask=row_ok)
        tl.store(DELTA + BR * R + row, dgate, mask=row_ok)
        tl.store(LSE_G + BR * R + row, lse - tl.log2(gt), mask=row_ok)
        do = (dout.to(tl.float32) * gt[:, None]).to(DOUT.dtype.element_ty)
        return do, tl.sum(do.to(tl.float32) * o, 1), lse

    @triton.jit
    def _sel_dq_sub_rows(Q, DOUT, OS, GATE, DG, DELTA, LSE_G, LSE_S, pid_q, pid_bg, Tq, q_off, R, r0,
                         H: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, QPB: tl.constexpr,
                         SUB_M: tl.constexpr):
        """A sub-tile's rows for the selected branch's dQ: q, round(g dout), log-sum-exp, delta (the dK/dV kernels'
        values and the gate gradient also stored: _branch_prep), query positions and each row's query within the
        tile (_sel_sub_rows)."""
        q, row, row_ok, t_abs, q_in_tile = _sel_sub_rows(Q, pid_q, pid_bg, Tq, q_off, r0, H, HKV, G, D, QPB, SUB_M)
        do, delta, lse = _branch_prep(DOUT, OS, GATE, DG, DELTA, LSE_S, LSE_G, row, row_ok, tl.arange(0, D), R, D, 1)
        return q, do, lse, delta, t_abs, q_in_tile

    @triton.jit
    def _sel_dq_sub(a, k, v, q, do, lse, delta, t_abs, chosen, sm_scale2, dq, WHOLE: tl.constexpr,
                    CAUSAL: tl.constexpr = True):
        """A union block's share of one sub-tile's dQ: skipped unless one of its rows' queries chose it (WHOLE:
        the whole tile, no test; CAUSAL=False: a block every row's query is past; as in _sel_fwd_sub)."""
        if WHOLE:
            if CAUSAL:
                vis = _sel_visible(a, t_abs, chosen, k.shape[0])
            else:
                vis = chosen[:, None]
            dq = _dq_update(q, do, lse, delta, k, v, vis, sm_scale2, dq, True)
        elif tl.max(chosen.to(tl.int32), 0) > 0:
            vis = _sel_visible(a, t_abs, chosen, k.shape[0])
            dq = _dq_update(q, do, lse, delta, k, v, vis, sm_scale2, dq, True)
        return dq

    @triton.jit
    def _sel_dq_walk(Q, DOUT, OS, GATE, DG, DELTA, LSE_G, LSE_S, KS, VS, UENT, UHI, UCNT, UPAST, pid_q, pid_bg, b, g,
                     Tq, Tk, q_off, n_tiles, R, sm_scale2, dq,
                     H: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, LB: tl.constexpr,
                     N_SEL: tl.constexpr, QPB: tl.constexpr, WORDS: tl.constexpr, SUB_M: tl.constexpr,
                     SUBS: tl.constexpr, KV32: tl.constexpr):
        """The selected branch's dQ (unscaled) of one query tile added to dq (BLOCK_M, D): the tile's distinct blocks
        (see _tile_block_union), math per sub-tile; also the branch's delta and gate gradient."""
        q0, do0, lse0, dl0, t0, c0 = _sel_dq_sub_rows(Q, DOUT, OS, GATE, DG, DELTA, LSE_G, LSE_S, pid_q, pid_bg, Tq,
                                                      q_off, R, 0, H, HKV, G, D, QPB, SUB_M)
        if SUBS == 1:
            # one sub-tile is the tile's rows: the selected blocks add to the interval branches' dQ in place, so
            # no second fp32 (BLOCK_M, D) accumulator stays live through the union walk
            dq0 = dq
        else:
            dq0 = tl.zeros([SUB_M, D], tl.float32)
        if SUBS >= 2:
            q1, do1, lse1, dl1, t1, c1 = _sel_dq_sub_rows(Q, DOUT, OS, GATE, DG, DELTA, LSE_G, LSE_S, pid_q, pid_bg, Tq,
                                                          q_off, R, SUB_M, H, HKV, G, D, QPB, SUB_M)
            dq1 = tl.zeros([SUB_M, D], tl.float32)
        if SUBS >= 4:
            q2, do2, lse2, dl2, t2, c2 = _sel_dq_sub_rows(Q, DOUT, OS, GATE, DG, DELTA, LSE_G, LSE_S, pid_q, pid_bg, Tq,
                                                          q_off, R, 2 * SUB_M, H, HKV, G, D, QPB, SUB_M)
            dq2 = tl.zeros([SUB_M, D], tl.float32)
            q3, do3, lse3, dl3, t3, c3 = _sel_dq_sub_rows(Q, DOUT, OS, GATE, DG, DELTA, LSE_G, LSE_S, pid_q, pid_bg, Tq,
                                                          q_off, R, 3 * SUB_M, H, HKV, G, D, QPB, SUB_M)
            dq3 = tl.zeros([SUB_M, D], tl.float32)
        tile = pid_bg.to(tl.int64) * n_tiles + pid_q
        entries = tile * (QPB * N_SEL)  # the tile's first union entry
        kv_base = b * Tk * HKV * D + g * D
        n_union = tl.load(UCNT + tile)
        u_from = 0
        if SUBS == 1:  # the blocks every row's query is past, without the causal mask (_sel_fwd_kernel)
            u_from = tl.load(UPAST + tile)
            for u in range(u_from):
                a, k, v, word = _sel_block(KS, VS, UENT, entries + u, kv_base, Tk, HKV, D, LB, KV32)
                chosen = _sel_chosen(UHI, entries + u, word, c0, WORDS)
                dq0 = _sel_dq_sub(a, k, v, q0, do0, lse0, dl0, t0, chosen, sm_scale2, dq0, True, False)
        for u in range(u_from, n_union):
            a, k, v, word = _sel_block(KS, VS, UENT, entries + u, kv_base, Tk, HKV, D, LB, KV32)
            chosen = _sel_chosen(UHI, entries + u, word, c0, WORDS)
            dq0 = _sel_dq_sub(a, k, v, q0, do0, lse0, dl0, t0, chosen, sm_scale2, dq0, SUBS == 1)
            if SUBS >= 2:
                chosen = _sel_chosen(UHI, entries + u, word, c1, WORDS)
                dq1 = _sel_dq_sub(a, k, v, q1, do1, lse1, dl1, t1, chosen, sm_scale2, dq1, False)
            if SUBS >= 4:
                chosen = _sel_chosen(UHI, entries + u, word, c2, WORDS)
                dq2 = _sel_dq_sub(a, k, v, q2, do2, lse2, dl2, t2, chosen, sm_scale2, dq2, False)
                chosen = _sel_chosen(UHI, entries + u, word, c3, WORDS)
                dq3 = _sel_dq_sub(a, k, v, q3, do3, lse3, dl3, t3, chosen, sm_scale2, dq3, False)
        if SUBS == 1:
            dq = dq0
        if SUBS == 2:
            dq += _rows_cat(dq0, dq1)
        if SUBS == 4:
            dq += _rows_cat(_rows_cat(dq0, dq1), _rows_cat(dq2, dq3))
        return dq

    @triton.jit
    def _dq_tile(Tq, H: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, QPB: tl.constexpr, BLOCK_M: tl.constexpr,
                 LIGHT_FIRST: tl.constexpr):
        """This program's query tile for the dQ launches: (tile, batch x kv group, batch, kv group, each row's query,
        each row's flat (B*T*H) row, row mask)."""
        pid_q = _query_tile_id(LIGHT_FIRST)
        pid_bg = tl.program_id(1)
        b = (pid_bg // HKV).to(tl.int64)
        g = pid_bg % HKV
        r, qi, row_ok = _tile_rows(pid_q, Tq, 0, G, QPB, BLOCK_M)
        return pid_q, pid_bg, b, g, qi, (b * Tq + qi) * H + g * G + r % G, row_ok

    @triton.jit
    def _rows_cat(x, y):
        """(M, D), (M, D) -> (2M, D): the rows of x, then those of y."""
        M: tl.constexpr = x.shape[0]
        D: tl.constexpr = x.shape[1]
        return tl.reshape(tl.permute(tl.join(x, y), (2, 0, 1)), (2 * M, D))

    @triton.jit
    def _bwd_dq_kernel(
        Q, DOUT, GATE, DG, DELTA, LSE_G, DQ, DQ_HI,
        KC, VC, C_LO, C_HI, LSE_C, OC,
        KS, VS, UENT, UHI, UCNT, UPAST, LSE_S, OS,
        KW, VW, W_LO, W_HI, LSE_W, OW,
        Tq, Tk, Nc, Tw, q_off, n_tiles, R, sm_scale2, scale,
        H: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
        LB: tl.constexpr, N_SEL: tl.constexpr, QPB: tl.constexpr, WORDS: tl.constexpr, BLOCK_M: tl.constexpr,
        SUB_M: tl.constexpr, BLOCK_N: tl.constexpr, SEL_DQ: tl.constexpr, LIGHT_FIRST: tl.constexpr,
        KV32: tl.constexpr, ADD_DQ: tl.constexpr, DQ_HALF: tl.constexpr, DQ_OVER_OUTPUTS: tl.constexpr,
    ):
        """dQ of all three branches for one query tile, accumulated in registers in a fixed branch order
        (compressed, window, selected) and written once in q's dtype; also the gate gradients and the
        per-branch deltas. The branch output gradient g_i * dout is formed here (never materialized). The
        selected branch runs in sub-tiles as in _sel_fwd_kernel, joined back into the tile's rows. Without SEL_DQ,
        dQ in fp32 (DQ, DQ_HI, DQ_HALF: _dq_store); DQ_OVER_OUTPUTS: over the storage of OC and OW, whose rows
        this tile read first."""
        SUBS: tl.constexpr = BLOCK_M // SUB_M
        pid_q, pid_bg, b, g, qi, row, row_ok = _dq_tile(Tq, H, HKV, G, QPB, BLOCK_M, LIGHT_FIRST)
        d = tl.arange(0, D)
        q = tl.load(Q + row[:, None] * D + d[None, :], mask=row_ok[:, None], other=0.0)
        # compressed branch
        do, delta, lse = _branch_prep(DOUT, OC, GATE, DG, DELTA, LSE_C, LSE_G, row, row_ok, d, R, D, 0)
        lo = tl.load(C_LO + b * Tq + qi, mask=row_ok, other=0)
        hi = tl.load(C_HI + b * Tq + qi, mask=row_ok, other=0)
        dq = _interval_dq(q, do, lse, delta, KC, VC, b * Nc * HKV * D + g * D, lo, hi, row_ok, Nc, sm_scale2,
                          HKV, D, BLOCK_N, KV32)
        # window branch
        do, delta, lse = _branch_prep(DOUT, OW, GATE, DG, DELTA, LSE_W, LSE_G, row, row_ok, d, R, D, 2)
        lo = tl.load(W_LO + b * Tq + qi, mask=row_ok, other=0)
        hi = tl.load(W_HI + b * Tq + qi, mask=row_ok, other=0)
        dq += _interval_dq(q, do, lse, delta, KW, VW, b * Tw * HKV * D + g * D, lo, hi, row_ok, Tw, sm_scale2,
                           HKV, D, BLOCK_N, KV32)
        # selected branch (_sel_dq_walk); without SEL_DQ only its delta and gate gradient: the selected dK/dV
        # kernel adds its dQ (sel_dq_in_dkdv), or, under ADD_DQ, _sel_dq_kernel has stored it in DQ already
        if SEL_DQ:
            dq = _sel_dq_walk(Q, DOUT, OS, GATE, DG, DELTA, LSE_G, LSE_S, KS, VS, UENT, UHI, UCNT, UPAST, pid_q, pid_bg,
                              b, g, Tq, Tk, q_off, n_tiles, R, sm_scale2, dq, H, HKV, G, D, LB, N_SEL, QPB, WORDS,
                              SUB_M, SUBS, KV32)
        elif not ADD_DQ:
            _branch_prep(DOUT, OS, GATE, DG, DELTA, LSE_S, LSE_G, row, row_ok, d, R, D, 1)
        dq = dq * scale
        if ADD_DQ:  # the selected share _sel_dq_kernel stored, in q's dtype
            dq += tl.load(DQ + row[:, None] * D + d[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
        if DQ_OVER_OUTPUTS:  # DQ lies over OC's and OW's rows: every thread's loads of them come first
            tl.debug_barrier()
        _dq_store(DQ, DQ_HI, row, d, D, DQ_HALF, dq.to(DQ.dtype.element_ty), row_ok)

    @triton.jit
    def _sel_dq_kernel(
        Q, DOUT, GATE, DG, DELTA, LSE_G, DQ, KS, VS, UENT, UHI, UCNT, UPAST, LSE_S, OS,
        Tq, Tk, q_off, n_tiles, R, sm_scale2, scale,
        H: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, LB: tl.constexpr,
        N_SEL: tl.constexpr, QPB: tl.constexpr, WORDS: tl.constexpr, BLOCK_M: tl.constexpr, SUB_M: tl.constexpr,
        LIGHT_FIRST: tl.constexpr, KV32: tl.constexpr,
    ):
        """The selected branch's dQ alone (launch_overrides(sel_dq_split=True)), in the selected forward's query
        tiles: stored in q's dtype, to which the fused kernel (SEL_DQ=False, ADD_DQ) then adds the interval branches'
        share. Also the selected branch's delta and gate gradient."""
        SUBS: tl.constexpr = BLOCK_M // SUB_M
        pid_q, pid_bg, b, g, qi, row, row_ok = _dq_tile(Tq, H, HKV, G, QPB, BLOCK_M, LIGHT_FIRST)
        d = tl.arange(0, D)
        dq = _sel_dq_walk(Q, DOUT, OS, GATE, DG, DELTA, LSE_G, LSE_S, KS, VS, UENT, UHI, UCNT, UPAST, pid_q, pid_bg,
                          b, g, Tq, Tk, q_off, n_tiles, R, sm_scale2, tl.zeros([BLOCK_M, D], tl.float32), H, HKV,
                          G, D, LB, N_SEL, QPB, WORDS, SUB_M, SUBS, KV32)
        tl.store(DQ + row[:, None] * D + d[None, :], (dq * scale).to(DQ.dtype.element_ty), mask=row_ok[:, None])

    # ------------------------------------------------------------------------------------------
    # The selected dQ from per-pair partials (the block-outer pair dQ's, sel_dq_pairs)
    # ------------------------------------------------------------------------------------------

    @triton.jit(do_not_specialize=["c0"])
    def _sel_dq_reduce_kernel(DQP, IDX, DQ_IN, DQ_IN_HI, DQ_OUT, DQ_OUT_HI, Tq, c0, chunk_q,
                              H: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
                              N_SEL: tl.constexpr, QPB: tl.constexpr, BLOCK_M: tl.constexpr,
                              IN_HALF: tl.constexpr, OUT_HALF: tl.constexpr):
        """DQ_OUT = DQ_IN (fp32: the interval branches' dQ) + the sum over a query's slots, in slot order, of the
        selected branch's partials DQP, for the chunk_q queries from c0: ((B*Hkv x chunk_q + query - c0) x n' +
        slot, G, D), stored by the pair-dQ kernel (nsa_triton_selected._sel_dq_pairs_kernel); the
        slots whose block is unused (idx -1) were never written and are skipped. Rows: QPB queries x the G heads
        of one KV group (as the other query tiles). IN_HALF < D: DQ_IN lies over DQ_IN and DQ_IN_HI (_dq_load), and
        so DQ_OUT with OUT_HALF (the pair-dQ kernel's in-place sum: a program reads, then writes, its own rows)."""
        pid_q = tl.program_id(0)
        pid_bg = tl.program_id(1)
        b = (pid_bg // HKV).to(tl.int64)
        g = pid_bg % HKV
        r, local, row_ok = _tile_rows(pid_q, tl.minimum(chunk_q, Tq - c0), 0, G, QPB, BLOCK_M)  # query - c0
        qi = c0 + local
        hh = r % G
        d = tl.arange(0, D)
        row = (b * Tq + qi) * H + g * G + hh
        acc = _dq_load(DQ_IN, DQ_IN_HI, row, d, D, IN_HALF, row_ok)  # (rows, D) fp32
        flat = (pid_bg.to(tl.int64) * Tq + qi) * N_SEL  # (rows,) the query's first slot in idx
        part_flat = (pid_bg.to(tl.int64) * chunk_q + local) * N_SEL  # ... in DQP
        for s in range(N_SEL):
            used = row_ok & (tl.load(IDX + flat + s, mask=row_ok, other=-1) >= 0)
            part = tl.load(DQP + ((part_flat + s) * G + hh)[:, None] * D + d[None, :], mask=used[:, None],
                           other=0.0)
            acc += part.to(tl.float32)
        _dq_store(DQ_OUT, DQ_OUT_HI, row, d, D, OUT_HALF, acc.to(DQ_OUT.dtype.element_ty), row_ok)


# ----------------------------------------------------------------------------------------------
# Host-side launchers (static shapes, no host synchronization)
# ----------------------------------------------------------------------------------------------

def _bwd_dq(q, dout, gates, cmp, slc, win, idx, doc_pos, params: NSAParams, scale, sel_dq: bool = True,
            dq_over_outputs: bool = False):
    """dQ (B, Tq, H, D), the gate gradients (B, Tq, H, 3) and, per branch, the deltas and gated log-sum-exps the dK/dV
    kernels read (each (3, B, Tq, H) fp32: _branch_prep) in one launch,
    query tiles as the selected attention's. cmp, win: each interval branch's (keys, values, lo, hi, lse,
    output); slc: the selected branch's (keys, values, lse, output), idx its blocks. The block union (sort
    temporaries) comes before dQ is allocated, which lowers the backward's peak memory. sel_dq=False: the
    selected branch's dQ is left out (a pair-wise kernel adds it) and dQ is returned in fp32 for that, as a
    _FloatDq: laid over the storage of the interval branches' outputs cmp[-1] and win[-1] with dq_over_outputs
    (their rows are read by this launch's program that then writes dQ's same rows; the caller owns that they are
    dead after it: nsa_triton._nsa_bwd_reusing_op), else a buffer of its own."""
    k_cmp, k_slc, k_win = cmp[0], slc[0], win[0]
    batch, num_q, num_heads, head_dim, num_keys, num_kv, group = _launch_shapes(q, k_slc)
    n_sel = idx.shape[-1]
    kv32 = _kv_offsets_fit_int32(max(num_keys, k_cmp.shape[1], k_win.shape[1]), num_kv, head_dim)
    split = sel_dq and bool(_OVERRIDES.sel_dq_split)
    if split:  # the selected share first, in its own tiles, then the interval branches' added to it
        dq = _sel_dq_split(q, dout, gates, slc, idx, doc_pos, params, scale, kv32)
        sel_dq = False
    block_m, qpb, dq_opts = _dq_launch(group, head_dim, n_sel, q.device, sel_dq)
    if sel_dq:
        entries, high_bits, counts, n_past = _tile_block_union(idx, doc_pos, qpb, params.sel_block_size)
    else:  # not read (SEL_DQ=False)
        entries = high_bits = idx
        counts = n_past = idx.new_zeros(batch, num_kv, 0)
    if not split:
        if sel_dq:
            dq = torch.empty_like(q)
        else:
            dq = _FloatDq.over(cmp[-1], win[-1]) if dq_over_outputs else _FloatDq.new(q)
        dgates = torch.empty_like(gates)
        delta, lse_g = _branch_rows(q)
    else:
        dq, dgates, delta, lse_g = dq
    dq_lo, dq_hi, dq_half = dq if isinstance(dq, _FloatDq) else (dq, dq, head_dim)
    _bwd_dq_kernel[(_cdiv(num_q, qpb), batch * num_kv)](
        q, dout, gates, dgates, delta, lse_g, dq_lo, dq_hi, *cmp, k_slc, slc[1], entries, high_bits, counts, n_past,
        *slc[2:], *win,
        num_q, num_keys, k_cmp.shape[1], k_win.shape[1], num_keys - num_q, counts.shape[-1], batch * num_q * num_heads,
        scale * _LOG2E, scale,
        H=num_heads, HKV=num_kv, G=group, D=head_dim, LB=params.sel_block_size, N_SEL=n_sel,
        QPB=qpb, WORDS=high_bits.shape[-1] + 1 if sel_dq else 1, BLOCK_M=block_m,
        SUB_M=_sel_sub_tile(block_m, head_dim, q.device, dq=True),
        BLOCK_N=64, SEL_DQ=sel_dq, LIGHT_FIRST=_query_tiles_light_first(), KV32=kv32, ADD_DQ=split,
        DQ_HALF=dq_half, DQ_OVER_OUTPUTS=sel_dq is False and dq_over_outputs, **dq_opts, **_FP_FUSION,
    )
    return dq, dgates, delta, lse_g


def _branch_rows(q):
    """The per-branch (3, B, Tq, H) fp32 deltas and gated log-sum-exps _branch_prep writes for the dK/dV kernels."""
    batch, num_q, num_heads, _ = q.shape
    return tuple(torch.empty(3, batch, num_q, num_heads, device=q.device, dtype=torch.float32) for _ in range(2))


def _sel_dq_split(q, dout, gates, slc, idx, doc_pos, params: NSAParams, scale, kv32: bool):
    """launch_overrides(sel_dq_split=True): the selected branch's dQ in a launch of its own, in the selected forward's
    query tiles and launch options (_sel_dq_kernel), before the fused kernel adds the interval branches' share. The
    fused dQ's 128-row tile fits one program per SM; this 64-row one two (bench/KERNELS.md,
    "Next GPU session"). Returns (dQ in q's dtype holding the selected share, the gate gradients, the deltas and the
    gated log-sum-exps, the selected branch's filled in)."""
    k_slc = slc[0]
    batch, num_q, num_heads, head_dim, num_keys, num_kv, group = _launch_shapes(q, k_slc)
    n_sel = idx.shape[-1]
    block_m, qpb = _sel_rows_per_program(group, head_dim)
    entries, high_bits, counts, n_past = _tile_block_union(idx, doc_pos, qpb, params.sel_block_size)
    dq = torch.empty_like(q)
    dgates = torch.empty_like(gates)
    delta, lse_g = _branch_rows(q)
    # the forward's warps and stages, not its register cap: under 128 registers this kernel's dot loops spill (14-18
    # instructions per block on sm_90, tests/triton_aot.py)
    opts = {name: value for name, value in _sel_fwd_opts(head_dim, q.device).items() if name != "maxnreg"}
    _sel_dq_kernel[(_cdiv(num_q, qpb), batch * num_kv)](
        q, dout, gates, dgates, delta, lse_g, dq, k_slc, slc[1], entries, high_bits, counts, n_past, *slc[2:],
        num_q, num_keys, num_keys - num_q, counts.shape[-1], batch * num_q * num_heads, scale * _LOG2E, scale,
        H=num_heads, HKV=num_kv, G=group, D=head_dim, LB=params.sel_block_size, N_SEL=n_sel, QPB=qpb,
        WORDS=high_bits.shape[-1] + 1, BLOCK_M=block_m, SUB_M=_sel_sub_tile(block_m, head_dim, q.device),
        LIGHT_FIRST=_query_tiles_light_first(), KV32=kv32, **opts, **_FP_FUSION,
    )
    return dq, dgates, delta, lse_g


def _sel_dq_reduce_chunk(partials, idx, dq_intervals: _FloatDq, dq: _FloatDq, c0: int, chunk_q: int):
    """dq[:, c0 : c0 + chunk_q] = the interval branches' fp32 dQ there plus the chunk's selected partials
    ((B*Hkv x chunk_q x n' x G, D) rows, the pair-dQ kernel's for one chunk of queries), summed in slot order."""
    batch, num_kv, num_q, n_sel = idx.shape
    head_dim = partials.shape[-1]
    group = dq_intervals.lo.shape[0] // (batch * num_q * num_kv)
    block_m, qpb = _sel_dq_reduce_rows(group)
    _sel_dq_reduce_kernel[(_cdiv(min(chunk_q, num_q - c0), qpb), batch * num_kv)](
        partials, idx, dq_intervals.lo, dq_intervals.hi, dq.lo, dq.hi, num_q, c0, chunk_q, H=group * num_kv,
        HKV=num_kv, G=group, D=head_dim, N_SEL=n_sel, QPB=qpb, BLOCK_M=block_m, IN_HALF=dq_intervals.half,
        OUT_HALF=dq.half, num_warps=4, **_FP_FUSION,
    )
