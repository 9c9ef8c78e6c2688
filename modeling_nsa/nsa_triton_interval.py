"""Interval attention: the compressed and sliding-window branches, where query t sees a contiguous run of keys
[lo(t), hi(t)) (NSA_SPEC; nsa_triton.py describes the kernels' layout of the work): the per-query intervals,
the forward kernel (which also writes the gated sum of the three branches) and the dK/dV kernel.
"""

from __future__ import annotations

import torch

from .nsa_layout import NSAParams
from .nsa_triton_common import _FP_FUSION, _LOG2E, _cdiv, _launch_shapes, _next_pow2
from .nsa_triton_launch import (_OVERRIDES, _dkdv_launch, _kv_offsets_fit_int32, _query_tiles_light_first,
                                _rows_fit_int32, _rows_per_program)


try:  # the module must import where triton is missing (CPU-only installs, macOS)
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - exercised only without triton
    triton = tl = None


if triton is not None:
    from .nsa_triton_common import (_bwd_rows, _dkdv_update, _dv_unscaled, _gated_sum, _head_rows, _kv_offsets,
                                     _max_combine, _query_tile_id, _softmax_init, _softmax_tile, _tile_rows)

    # ------------------------------------------------------------------------------------------
    # Interval attention (compressed + window branches)
    # ------------------------------------------------------------------------------------------

    @triton.jit
    def _interval_tiles(lo, hi, row_ok, Nk, BLOCK_N: tl.constexpr):
        """Key range of a query tile's interval branch: (k_begin, k_end) covers every row's [lo, hi), and the
        BLOCK_N tiles from k_begin that lie in [full_lo, full_hi) are inside every valid row's interval, so
        they need no mask (the window's and the compressed branch's middle tiles). A valid row with an empty
        interval (hi <= lo) empties that middle."""
        hi = tl.where(row_ok, hi, lo)
        k_begin = tl.min(tl.where(hi > lo, lo, Nk), axis=0)
        k_end = tl.max(hi, axis=0)
        lo_max = tl.max(tl.where(row_ok, lo, 0), axis=0)  # [lo_max, hi_min): keys every valid row sees
        hi_min = tl.min(tl.where(row_ok, hi, Nk), axis=0)
        n_tiles = tl.cdiv(tl.maximum(k_end - k_begin, 0), BLOCK_N)
        first = tl.minimum(tl.cdiv(tl.maximum(lo_max - k_begin, 0), BLOCK_N), n_tiles)
        last = tl.maximum(tl.minimum(tl.maximum(hi_min - k_begin, 0) // BLOCK_N, n_tiles), first)
        return k_begin, k_end, k_begin + first * BLOCK_N, k_begin + last * BLOCK_N

    @triton.jit
    def _in_interval(key, lo, hi):
        """lo <= key < hi (broadcast int32 tensors, key - lo and hi - lo within int32: keys and bounds are in
        [0, Nk], a window's hi may be a little below 0) as one unsigned compare, key - lo < hi - lo (clamped at 0):
        the two signed compares compiled to two selects per score, about 40 of a masked step's ~500 SASS
        instructions (tests/triton_aot.py --sass-loops)."""
        return (key - lo).to(tl.uint32) < tl.maximum(hi - lo, 0).to(tl.uint32)

    @triton.jit
    def _interval_kv(K, V, kv_base, k0, k_end, lo, hi,
                     HKV: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
                     KV32: tl.constexpr):
        """Key tile [k0, k0 + BLOCK_N): K, V (BLOCK_N, D) and which rows see which keys (MASKED; otherwise every
        key is in range and seen by every row, and vis is a constant)."""
        kk = k0 + tl.arange(0, BLOCK_N)
        kv_off = _kv_offsets(kk, HKV, D, KV32)
        K = K + kv_base  # (the row's K and V: int64 once, the keys' offsets within the row int32 where they fit)
        V = V + kv_base
        if MASKED:
            k_ok = kk < k_end
            k = tl.load(K + kv_off, mask=k_ok[:, None], other=0.0)
            v = tl.load(V + kv_off, mask=k_ok[:, None], other=0.0)
            # (rows, BLOCK_N) on the key's offset in the tile, a constant per column (no key index per block)
            vis = _in_interval(tl.arange(0, BLOCK_N)[None, :], (lo - k0)[:, None], (hi - k0)[:, None])
        else:
            k = tl.load(K + kv_off)
            v = tl.load(V + kv_off)
            vis = True
        return k, v, vis

    @triton.jit
    def _interval_fwd_range(q, K, V, kv_base, lo, hi, k_from, k_to, k_end, sm_scale2, m_i, l_i, acc,
                            HKV: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
                            KV32: tl.constexpr):
        """Online softmax over the key tiles from k_from to k_to (masked or not, see _interval_tiles)."""
        for k0 in range(k_from, k_to, BLOCK_N):
            k, v, vis = _interval_kv(K, V, kv_base, k0, k_end, lo, hi, HKV, D, BLOCK_N, MASKED, KV32)
            s = tl.dot(q, tl.trans(k))
            if MASKED:
                s = tl.where(vis, s, float("-inf"))
            m_i, l_i, acc = _softmax_tile(s, sm_scale2, v, m_i, l_i, acc)
        return m_i, l_i, acc

    @triton.jit
    def _interval_fwd_kernel(
        Q, K, V, LO, HI, O, LSE, OC, OS, GATE, OUT,
        Tq, Nk, sm_scale2,
        H: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
        QPB: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, COMBINE: tl.constexpr,
        LIGHT_FIRST: tl.constexpr, KV32: tl.constexpr,
    ):
        pid_q = _query_tile_id(LIGHT_FIRST)
        pid_bg = tl.program_id(1)
        b = (pid_bg // HKV).to(tl.int64)
        g = pid_bg % HKV
        r, qi, row_ok = _tile_rows(pid_q, Tq, 0, G, QPB, BLOCK_M)
        hh = r % G
        lo = tl.load(LO + b * Tq + qi, mask=row_ok, other=0)
        hi = tl.load(HI + b * Tq + qi, mask=row_ok, other=0)
        hi = tl.where(row_ok, hi, lo)
        k_begin, k_end, full_lo, full_hi = _interval_tiles(lo, hi, row_ok, Nk, BLOCK_N)
        d = tl.arange(0, D)
        row = (b * Tq + qi) * H + g * G + hh
        q = tl.load(Q + row[:, None] * D + d[None, :], mask=row_ok[:, None], other=0.0)
        kv_base = b * Nk * HKV * D + g * D
        m_i, l_i, acc = _softmax_init(BLOCK_M, D)
        # boundary tiles masked, the middle ones not (rows outside the tile hold q = 0 and are not stored)
        m_i, l_i, acc = _interval_fwd_range(q, K, V, kv_base, lo, hi, k_begin, full_lo, k_end, sm_scale2, m_i, l_i,
                                            acc, HKV, D, BLOCK_N, True, KV32)
        m_i, l_i, acc = _interval_fwd_range(q, K, V, kv_base, lo, hi, full_lo, full_hi, k_end, sm_scale2, m_i, l_i,
                                            acc, HKV, D, BLOCK_N, False, KV32)
        m_i, l_i, acc = _interval_fwd_range(q, K, V, kv_base, lo, hi, full_hi, k_end, k_end, sm_scale2, m_i, l_i,
                                            acc, HKV, D, BLOCK_N, True, KV32)
        has = l_i > 0
        out = acc / tl.where(has, l_i, 1.0)[:, None]
        out_ptr = row[:, None] * D + d[None, :]
        tl.store(O + out_ptr, out.to(O.dtype.element_ty), mask=row_ok[:, None])
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("inf"))
        tl.store(LSE + row, lse, mask=row_ok)
        if COMBINE:  # o = g_cmp o_cmp + g_slc o_slc + g_win o_win (fp32), the branch outputs as stored
            o_c = tl.load(OC + out_ptr, mask=row_ok[:, None], other=0.0).to(tl.float32)
            o_s = tl.load(OS + out_ptr, mask=row_ok[:, None], other=0.0).to(tl.float32)
            res = _gated_sum(GATE, row, row_ok, o_c, o_s, out.to(O.dtype.element_ty).to(tl.float32))
            tl.store(OUT + out_ptr, res.to(OUT.dtype.element_ty), mask=row_ok[:, None])

    @triton.jit
    def _dkdv_query_tiles(Q, DO, LSE_G, DELTA, LO, HI, b, g, q_from, q_to, q_end, Tq, kk, k, v, sm_scale2, dk, dv,
                          H: tl.constexpr, G: tl.constexpr, D: tl.constexpr, QPB: tl.constexpr,
                          BLOCK_M: tl.constexpr, MASKED: tl.constexpr, ROW32: tl.constexpr):
        """A key tile's dK/dV over the query tiles q_from, q_from + QPB, ... below q_to. MASKED: rows at or past
        q_end and keys outside a row's [lo, hi) are masked. Otherwise each tile lies inside the queries that see
        every key of the key tile (_wholly_visible_queries): no interval loads, no mask; the rows past QPB * G
        (a G that does not divide BLOCK_M) hold q = do = 0 and add nothing."""
        r = tl.arange(0, BLOCK_M)
        hh = r % G
        d = tl.arange(0, D)
        # The loop only where it runs: without the if, the path that runs no tile joins the loop's exit where the
        # loop's last dK dot is still in flight (its wait comes after the join), with dk and dv set by moves on
        # that path, and ptxas 12.8 (triton 3.6, the H100's) then waits on every tensor-core instruction of the
        # kernel (C7515, "non wgmma instructions defining accumulator registers"): 48 waits where 12 do at the
        # 125M layout (bench/KERNELS.md, "2026-11-28, second CPU session")
        if q_to > q_from:
            for q0 in range(q_from, q_to, QPB):
                qi = q0 + r // G
                if MASKED:
                    row_ok = (r < QPB * G) & (qi < q_end)
                else:
                    row_ok = r < QPB * G
                qi = tl.where(row_ok, qi, 0)
                if MASKED:
                    lo = tl.load(LO + b * Tq + qi, mask=row_ok, other=0)
                    hi = tl.load(HI + b * Tq + qi, mask=row_ok, other=0)
                base, row = _head_rows(b, g, qi, hh, Tq, H, G, ROW32)
                q, do, lse, delta = _bwd_rows(Q + base * D, DO + base * D, LSE_G + base, DELTA + base, row, row_ok,
                                              d, D)
                if MASKED:  # (rows off the tile loaded lo = hi = 0: an empty interval, so no row_ok term)
                    vis_t = _in_interval(kk[:, None], lo[None, :], hi[None, :])
                else:
                    vis_t = True
                dk, dv = _dkdv_update(q, do, lse, delta, k, v, vis_t, sm_scale2, dk, dv)
        return dk, dv

    @triton.jit
    def _interval_bwd_dkdv_kernel(
        Q, K, V, LO, HI, QA, QB, IA, IB, DO, LSE_G, DELTA, DK, DV,
        Tq, Nk, n_ktiles, sm_scale2, scale,
        H: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
        QPB: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, N_SPLIT: tl.constexpr,
        TILES_FAST: tl.constexpr, ROW32: tl.constexpr,
    ):
        # N_SPLIT > 1: program (tile, split) handles one slice of the tile's query range and writes an
        # fp32 partial to DK/DV[split] (summed afterwards in a fixed order: deterministic).
        # Grid: TILES_FAST (key tile x batch*kv head x split), the order where adjacent programs share their
        # queries (the window branch: every tile costs the same); else (batch*kv head x split x key tile), the
        # first key tiles, which the most queries see (the compressed branch), of every row and split first.
        if TILES_FAST:
            pid_k = tl.program_id(0)
            pid_bg = tl.program_id(1)
            pid_s = tl.program_id(2)
            n_bg = tl.num_programs(1)
        else:
            pid_bg = tl.program_id(0)
            pid_s = tl.program_id(1)
            pid_k = tl.program_id(2)
            n_bg = tl.num_programs(0)
        b = (pid_bg // HKV).to(tl.int64)
        g = pid_bg % HKV
        kk = pid_k * BLOCK_N + tl.arange(0, BLOCK_N)
        k_ok = kk < Nk
        d = tl.arange(0, D)
        kv_off = b * Nk * HKV * D + g * D + kk.to(tl.int64)[:, None] * (HKV * D) + d[None, :]
        k = tl.load(K + kv_off, mask=k_ok[:, None], other=0.0)
        v = tl.load(V + kv_off, mask=k_ok[:, None], other=0.0)
        q_begin = tl.load(QA + b * n_ktiles + pid_k)
        q_end = tl.load(QB + b * n_ktiles + pid_k)
        if N_SPLIT > 1:
            span = tl.cdiv(tl.cdiv(q_end - q_begin, N_SPLIT), QPB) * QPB
            q_begin = q_begin + pid_s * span
            q_end = tl.minimum(q_end, q_begin + span)
        dk = tl.zeros([BLOCK_N, D], tl.float32)
        dv = tl.zeros([BLOCK_N, D], tl.float32)
        # The query tiles wholly inside [IA, IB) (every row sees every key of this tile) run unmasked, between the
        # masked ones before and after: three loops without a branch in their bodies, so each is software-pipelined
        # (a branch between masked and unmasked tiles in one loop stopped that). Masking every tile instead took
        # the kernel 2.7x as long at 64k (the 2026-11-25 H100 sweep, bench/KERNELS.md).
        ia = tl.load(IA + b * n_ktiles + pid_k)
        ib = tl.minimum(tl.load(IB + b * n_ktiles + pid_k), q_end)
        n_tiles = tl.cdiv(tl.maximum(q_end - q_begin, 0), QPB)
        first = tl.minimum(tl.cdiv(tl.maximum(ia - q_begin, 0), QPB), n_tiles)
        last = tl.maximum(tl.minimum(tl.maximum(ib - q_begin, 0) // QPB, n_tiles), first)
        dk, dv = _dkdv_query_tiles(Q, DO, LSE_G, DELTA, LO, HI, b, g, q_begin, q_begin + first * QPB, q_end,
                                   Tq, kk, k, v, sm_scale2, dk, dv, H, G, D, QPB, BLOCK_M, True, ROW32)
        dk, dv = _dkdv_query_tiles(Q, DO, LSE_G, DELTA, LO, HI, b, g, q_begin + first * QPB,
                                   q_begin + last * QPB, q_end, Tq, kk, k, v, sm_scale2, dk, dv, H, G, D, QPB,
                                   BLOCK_M, False, ROW32)
        # the masked tiles after the run
        dk, dv = _dkdv_query_tiles(Q, DO, LSE_G, DELTA, LO, HI, b, g, q_begin + last * QPB, q_end, q_end, Tq, kk, k,
                                   v, sm_scale2, dk, dv, H, G, D, QPB, BLOCK_M, True, ROW32)
        split_off = pid_s.to(tl.int64) * (n_bg // HKV) * Nk * HKV * D
        tl.store(DK + split_off + kv_off, (dk * scale).to(DK.dtype.element_ty), mask=k_ok[:, None])
        tl.store(DV + split_off + kv_off, _dv_unscaled(dv, DO).to(DV.dtype.element_ty), mask=k_ok[:, None])


    # ------------------------------------------------------------------------------------------
    # Per-query intervals: one kernel (it replaced about 25 small torch ops, run in the forward and again in the
    # backward)
    # ------------------------------------------------------------------------------------------

    @triton.jit
    def _count_below(ENDS, n, value, STEPS: tl.constexpr):
        """Per lane, how many of ENDS[0:n] are below value: ENDS ascending, then -1 (unused slots, read as past
        every key). A lower-bound binary search, STEPS >= ceil(log2(n + 1)) halvings."""
        lo = tl.zeros_like(value)
        hi = tl.zeros_like(value) + n
        for _ in tl.static_range(STEPS):
            open_ = lo < hi
            mid = (lo + hi) // 2
            end = tl.load(ENDS + mid, mask=open_, other=-1)
            below = open_ & (end >= 0) & (end < value)
            lo = tl.where(below, mid + 1, lo)
            hi = tl.where(open_ & ~below, mid, hi)
        return lo

    @triton.jit
    def _layout_kernel(CMP_END, DOCPOS, C_LO, C_HI, W_LO, W_HI, Tq, Tk, Nc, end_stride, pos_stride, w_off, window,
                       BLOCK: tl.constexpr, STEPS: tl.constexpr):
        """Query t's compressed slots [c_lo, c_hi) (its document's tokens whose last key is at or before t) and
        window keys [w_lo, w_hi) (the last `window` keys of its document up to t, in the window tensor's
        coordinates: its keys are the last Tk - w_off of doc_pos's); 0, 0 for padding. The queries are the last
        Tq of doc_pos's Tk positions."""
        b = tl.program_id(1).to(tl.int64)
        t = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = t < Tq
        t_abs = (Tk - Tq + t).to(tl.int64)
        pos = tl.load(DOCPOS + b * pos_stride + t_abs, mask=ok, other=-1)
        valid = pos >= 0
        start = t_abs - pos  # the document's first key
        c_lo = _count_below(CMP_END + b * end_stride, Nc, start, STEPS)  # tokens ending before the document
        c_hi = tl.maximum(_count_below(CMP_END + b * end_stride, Nc, t_abs + 1, STEPS), c_lo)  # ... at or before t
        w_lo = tl.maximum(tl.maximum(start, t_abs - window + 1) - w_off, 0)
        w_hi = t_abs + 1 - w_off
        row = b * Tq + t
        tl.store(C_LO + row, tl.where(valid, c_lo, 0).to(tl.int32), mask=ok)
        tl.store(C_HI + row, tl.where(valid, c_hi, 0).to(tl.int32), mask=ok)
        tl.store(W_LO + row, tl.where(valid, w_lo, 0).to(tl.int32), mask=ok)
        tl.store(W_HI + row, tl.where(valid, w_hi, 0).to(tl.int32), mask=ok)

    # ------------------------------------------------------------------------------------------
    # The dK/dV kernel's query ranges per key tile (both interval branches at once)
    # ------------------------------------------------------------------------------------------

    @triton.jit
    def _range_scan_kernel(INTERVALS, SCAN, TOTALS, Tq, n_chunks, CHUNK: tl.constexpr):
        """One chunk of CHUNK queries of one row and branch (grid: branch, row, chunk). INTERVALS (4, B, Tq) int32
        holds each branch's [lo, hi) (branch br: rows 2 br and 2 br + 1; padding 0, 0). Writes the chunk's own
        inclusive scans to SCAN (branches, 4, B, Tq): the running max of hi, of lo over non-empty intervals (0 for
        empty ones), of lo, and the running count of empty intervals; and their chunk totals to TOTALS
        (branches, 4, B, n_chunks). _range_search_kernel brings in the earlier chunks through the totals."""
        br = tl.program_id(0)
        b = tl.program_id(1)
        c = tl.program_id(2)
        batch = tl.num_programs(1)
        t = c * CHUNK + tl.arange(0, CHUNK)
        ok = t < Tq
        plane = batch.to(tl.int64) * Tq  # elements per (branch, quantity) plane
        row = b.to(tl.int64) * Tq + t
        lo = tl.load(INTERVALS + (2 * br) * plane + row, mask=ok, other=0)
        hi = tl.load(INTERVALS + (2 * br + 1) * plane + row, mask=ok, other=0)
        empty = ((hi <= lo) & ok).to(tl.int32)
        hi_max = tl.associative_scan(hi, 0, _max_combine)
        seen_max = tl.associative_scan(tl.where(hi > lo, lo, 0), 0, _max_combine)
        lo_max = tl.associative_scan(lo, 0, _max_combine)
        empties = tl.cumsum(empty, 0)
        out = SCAN + (4 * br) * plane + row
        tl.store(out, hi_max, mask=ok)
        tl.store(out + plane, seen_max, mask=ok)
        tl.store(out + 2 * plane, lo_max, mask=ok)
        tl.store(out + 3 * plane, empties, mask=ok)
        tot_plane = batch.to(tl.int64) * n_chunks
        tot = TOTALS + (4 * br) * tot_plane + b * n_chunks + c
        tl.store(tot, tl.max(hi_max, 0))
        tl.store(tot + tot_plane, tl.max(seen_max, 0))
        tl.store(tot + 2 * tot_plane, tl.max(lo_max, 0))
        tl.store(tot + 3 * tot_plane, tl.sum(empty, 0))

    @triton.jit
    def _first_reaching(scan_row, chunk_totals, value, Tq, n_chunks, IS_COUNT: tl.constexpr, CHUNK: tl.constexpr,
                        NCH_PAD: tl.constexpr, STEPS: tl.constexpr):
        """The first query t (Tq if none) whose running value reaches `value` (TB,): running max (IS_COUNT false)
        or running count of one quantity, whose chunk-local inclusive scans start at scan_row and whose per-chunk
        totals are chunk_totals (NCH_PAD,). The first chunk whose inclusive total reaches the value holds t; every
        earlier chunk stays below it, so inside that chunk the running max reaches it where the local one does,
        and the running count where the local count reaches value minus the earlier chunks' count; a binary
        search over the chunk's queries finds it."""
        ch = tl.arange(0, NCH_PAD)
        real = ch < n_chunks
        if IS_COUNT:
            inclusive = tl.cumsum(chunk_totals, 0)
        else:
            inclusive = tl.associative_scan(chunk_totals, 0, _max_combine)
        inclusive = tl.where(real, inclusive, 2147483647)  # (NCH_PAD,) nondecreasing; past the chunks: reached
        chunk = tl.sum((inclusive[None, :] < value[:, None]).to(tl.int32), 1)  # (TB,) the chunk holding t
        threshold = value
        if IS_COUNT:
            threshold = value - tl.sum(tl.where(ch[None, :] < chunk[:, None], chunk_totals[None, :], 0), 1)
        start = chunk * CHUNK
        stop = tl.minimum(start + CHUNK, Tq)
        # bisect [start, stop) for the first local value reaching the threshold; unrolled, so the searches of one
        # tile (independent but for the last) interleave their dependent loads
        for _ in tl.static_range(STEPS):
            mid = (start + stop) // 2
            active = start < stop
            reached = tl.load(scan_row + mid, mask=active, other=0) >= threshold
            stop = tl.where(active & reached, mid, stop)
            start = tl.where(active & ~reached, mid + 1, start)
        return tl.where(chunk < n_chunks, start, Tq)

    @triton.jit
    def _range_search_kernel(SCAN, TOTALS, OUT, Tq, n_chunks, keys_cmp, keys_win, tiles_cmp, tiles_win,
                             BLOCK_N: tl.constexpr, TB: tl.constexpr, CHUNK: tl.constexpr, NCH_PAD: tl.constexpr,
                             STEPS: tl.constexpr):
        """(qa, qb, ia, ib) of TB key tiles [c0, c0 + BLOCK_N) of one row and branch (grid: branch, row, tile
        block), by their definitions in _interval_query_ranges, from _range_scan_kernel's scans. OUT: branch 0's
        (4, B, tiles_cmp) then branch 1's (4, B, tiles_win), int32."""
        br = tl.program_id(0)
        b = tl.program_id(1)
        batch = tl.num_programs(1)
        num_keys = tl.where(br == 0, keys_cmp, keys_win)
        n_tiles = tl.where(br == 0, tiles_cmp, tiles_win)
        j = tl.program_id(2) * TB + tl.arange(0, TB)
        c0 = j * BLOCK_N
        c1 = tl.minimum(c0 + BLOCK_N, num_keys)
        plane = batch.to(tl.int64) * Tq
        rows = SCAN + (4 * br) * plane + b.to(tl.int64) * Tq  # this row's running max of hi (then 3 more planes)
        tot_plane = batch.to(tl.int64) * n_chunks
        ch = tl.arange(0, NCH_PAD)
        tot = TOTALS + (4 * br) * tot_plane + b * n_chunks + ch
        real = ch < n_chunks
        hi_tot = tl.load(tot, mask=real, other=0)
        seen_tot = tl.load(tot + tot_plane, mask=real, other=0)
        lo_tot = tl.load(tot + 2 * tot_plane, mask=real, other=0)
        empty_tot = tl.load(tot + 3 * tot_plane, mask=real, other=0)
        qa = _first_reaching(rows, hi_tot, c0 + 1, Tq, n_chunks, False, CHUNK, NCH_PAD, STEPS)
        qb = _first_reaching(rows + plane, seen_tot, c1, Tq, n_chunks, False, CHUNK, NCH_PAD, STEPS)
        ia = _first_reaching(rows, hi_tot, c0 + BLOCK_N, Tq, n_chunks, False, CHUNK, NCH_PAD, STEPS)
        ib = _first_reaching(rows + 2 * plane, lo_tot, c0 + 1, Tq, n_chunks, False, CHUNK, NCH_PAD, STEPS)
        # the run ends before the first empty interval at or after ia: the first query whose running count of
        # empty intervals passes the count before ia (the count at ia - 1: its chunk's total before it, plus the
        # chunk's own count)
        before = ia - 1
        before_chunk = before // CHUNK
        empties_before = tl.load(rows + 3 * plane + before, mask=before >= 0, other=0) + tl.sum(
            tl.where(ch[None, :] < before_chunk[:, None], empty_tot[None, :], 0), 1)
        empties_before = tl.where(before >= 0, empties_before, 0)
        next_empty = _first_reaching(rows + 3 * plane, empty_tot, empties_before + 1, Tq, n_chunks, True, CHUNK,
                                     NCH_PAD, STEPS)
        ib = tl.minimum(tl.maximum(ib, ia), next_empty)
        base = OUT + tl.where(br == 0, 0, 4 * batch * tiles_cmp).to(tl.int64) + b * n_tiles + j
        stride = batch * n_tiles
        ok = j < n_tiles
        tl.store(base, qa, mask=ok)
        tl.store(base + stride, qb, mask=ok)
        tl.store(base + 2 * stride, ia, mask=ok)
        tl.store(base + 3 * stride, ib, mask=ok)


# ----------------------------------------------------------------------------------------------
# Host-side launchers (static shapes, no host synchronization)
# ----------------------------------------------------------------------------------------------

def _layout(cmp_end, doc_pos, num_queries, num_win, params: NSAParams):
    """Per-query metadata in key coordinates, (4, B, Tq) int32: compressed [c_lo, c_hi) and window [w_lo, w_hi)
    (_layout_kernel; `c_lo, c_hi, w_lo, w_hi = _layout(...)` unpacks it). cmp_end (B, Nc) int64, ascending then
    -1; doc_pos (B, Tk) int64 with the queries its last Tq positions; the window keys the last num_win."""
    batch, num_keys = doc_pos.shape
    num_slots = cmp_end.shape[1]
    # rows read with their own strides (compressed_token_ends returns a slice of a wider buffer); elements in order
    cmp_end, doc_pos = (x if x.stride(-1) == 1 else x.contiguous() for x in (cmp_end, doc_pos))
    intervals = torch.empty(4, batch, num_queries, device=doc_pos.device, dtype=torch.int32)
    c_lo, c_hi, w_lo, w_hi = intervals
    block = 128
    _layout_kernel[(_cdiv(max(num_queries, 1), block), batch)](
        cmp_end, doc_pos, c_lo, c_hi, w_lo, w_hi, num_queries, num_keys, num_slots, cmp_end.stride(0),
        doc_pos.stride(0), num_keys - num_win, params.window_size, BLOCK=block,
        STEPS=max(1, (num_slots + 1).bit_length()), num_warps=4, **_FP_FUSION,
    )
    return intervals


def _interval_fwd(q, k, v, lo, hi, scale, combine=None):
    """combine=(o_cmp, o_slc, gates): also write the gated sum of the three branches (returned third)."""
    batch, num_q, num_heads, head_dim, num_keys, num_kv, group = _launch_shapes(q, k)
    o = torch.empty_like(q)
    lse = torch.empty(batch, num_q, num_heads, device=q.device, dtype=torch.float32)
    out = torch.empty_like(q) if combine is not None else o
    o_c, o_s, gates = combine if combine is not None else (o, o, lse)
    block_m, qpb = _rows_per_program(group, head_dim)
    grid = (_cdiv(num_q, qpb), batch * num_kv)
    _interval_fwd_kernel[grid](
        q, k, v, lo, hi, o, lse, o_c, o_s, gates, out, num_q, num_keys, scale * _LOG2E,
        H=num_heads, HKV=num_kv, G=group, D=head_dim, QPB=qpb, BLOCK_M=block_m, BLOCK_N=64,
        COMBINE=combine is not None, LIGHT_FIRST=_query_tiles_light_first(),
        KV32=_kv_offsets_fit_int32(num_keys, num_kv, head_dim), num_warps=4 if head_dim <= 64 else 8, **_FP_FUSION,
    )
    return (o, lse, out) if combine is not None else (o, lse)


def _interval_query_ranges(intervals: torch.Tensor, num_keys: tuple[int, int], block_n: int):
    """The dK/dV kernel's query ranges for each interval branch's key tiles [c0, c0 + block_n), both branches at
    once. intervals: _layout's (4, B, Tq) int32 (compressed lo, hi, window lo, hi: the queries' key intervals
    [lo, hi), nondecreasing over valid queries; padding has lo = hi = 0); num_keys: the compressed and window key
    counts. Returns per branch (qa, qb, ia, ib), each (B, n_ktiles) int32, n_ktiles = ceil(num_keys / block_n):

    - [qa, qb): the queries that can see the tile, hi(t) > c0 and lo(t) < c1 (c1 = min(c0 + block_n,
      num_keys)): from the first whose running max of hi passes c0 to the last whose running max of lo (empty
      intervals counted as 0) is below c1;
    - [ia, ib): a run of queries each of which sees all of the tile (lo(t) <= c0, hi(t) >= c0 + block_n), for
      the unmasked loop: from the first whose running max of hi reaches the tile's end to the last whose running
      max of lo is at or before its start, cut before the first query with an empty interval at or after ia
      (padding, inside a row or after its last token), so every query in it is valid. A partial last tile gets
      no run (c0 + block_n is past every hi).

    Two launches: chunk-local scans (_range_scan_kernel), then per key tile a search of the chunk totals and a
    binary search inside one chunk (_range_search_kernel). As torch ops (running max/min scans and searchsorted)
    this took about 100 small launches per backward, 0.8 ms of torch kernels plus the GPU's waits for the host at
    every length (bench/KERNELS.md, 2026-11-26)."""
    _, batch, num_q = intervals.shape
    device = intervals.device
    intervals = intervals if intervals.is_contiguous() else intervals.contiguous()
    # chunks of 1,024 to 4,096 queries (one program scans a chunk in registers), at most 64 per row up to 256k
    # queries; the search compares each of its tiles' values with every chunk total, so it takes fewer tiles per
    # program where a row has more chunks
    chunk = _OVERRIDES.range_chunk or min(4096, max(1024, _next_pow2(_cdiv(max(num_q, 1), 64))))
    n_chunks = _cdiv(max(num_q, 1), chunk)
    n_chunks_pad = _next_pow2(n_chunks)
    n_tiles = [_cdiv(max(keys, 1), block_n) for keys in num_keys]
    scan = torch.empty(2, 4, batch, num_q, device=device, dtype=torch.int32)
    totals = torch.empty(2, 4, batch, n_chunks, device=device, dtype=torch.int32)
    out = torch.empty(4 * batch * sum(n_tiles), device=device, dtype=torch.int32)
    _range_scan_kernel[(2, batch, n_chunks)](intervals, scan, totals, num_q, n_chunks, CHUNK=chunk,
                                             num_warps=4 if chunk <= 2048 else 8, **_FP_FUSION)
    tiles_per_program = max(8, min(64, 4096 // n_chunks_pad))  # (tiles x chunk totals) compares per search
    _range_search_kernel[(2, batch, _cdiv(max(n_tiles), tiles_per_program))](
        scan, totals, out, num_q, n_chunks, num_keys[0], num_keys[1], n_tiles[0], n_tiles[1], BLOCK_N=block_n,
        TB=tiles_per_program, CHUNK=chunk, NCH_PAD=n_chunks_pad, STEPS=chunk.bit_length(), num_warps=4, **_FP_FUSION,
    )
    cmp, win = out.split([4 * batch * n_tiles[0], 4 * batch * n_tiles[1]])
    return [tuple(cmp.view(4, batch, n_tiles[0])), tuple(win.view(4, batch, n_tiles[1]))]


_DKDV_KEY_TILE = 64  # keys per program of the compressed/window dK/dV (BLOCK_N)


def _dkdv_query_splits(programs: int, num_q: int, qpb: int) -> int:
    """Splits of each key tile's query range in the compressed/window dK/dV: long query ranges per key tile (the
    compressed branch: a compressed key is seen by the rest of its document) with few key tiles (`programs` =
    key tiles x batch x kv heads) are split so the GPU holds about 1,024 programs, at most 64 splits and at least
    8 query tiles of qpb queries each. Plain Python: bench/schedule_model.py models the launch with it."""
    if programs < 1024 and num_q > 4 * _DKDV_KEY_TILE:
        return max(1, min(64, 1024 // max(1, programs), num_q // (8 * qpb)))
    return 1


def _interval_bwd_dkdv(q, k, v, lo, hi, ranges, do, lse_g, delta, scale):
    """dK, dV of an interval branch; ranges: its (qa, qb, ia, ib) from _interval_query_ranges (block_n 64); lse_g,
    delta: the branch's gated log-sum-exp and delta (B, Tq, H) from the dQ kernel (_bwd_rows)."""
    batch, num_q, num_heads, head_dim, num_keys, num_kv, group = _launch_shapes(q, k)
    block_m, qpb, dkdv_opts = _dkdv_launch(group, head_dim, q.device)
    block_n = _DKDV_KEY_TILE
    n_ktiles = _cdiv(max(num_keys, 1), block_n)
    qa, qb, ia, ib = ranges
    n_split = _OVERRIDES.dkdv_split or _dkdv_query_splits(n_ktiles * batch * num_kv, num_q, qpb)
    if n_split == 1:
        dk = torch.empty_like(k)
        dv = torch.empty_like(v)
    else:
        dk = torch.empty((n_split,) + tuple(k.shape), device=k.device, dtype=torch.float32)
        dv = torch.empty_like(dk)
    # Split query ranges (the compressed branch: key tile t is seen by the queries after it, so the first tiles
    # cost the most) start heaviest first, every row's and split's first tiles before any last one: in the order
    # (key tile fastest) the last row's first tiles started last, 1.1-1.3x the balanced time in a list-scheduling
    # model (bench/KERNELS.md, "2026-11-27 H100"). Unsplit (the window branch: every tile costs the same), key tile
    # fastest, so neighbouring programs share their queries in L2; also past 65,535 key tiles (a grid's last axis).
    tiles_fast = n_split == 1 or n_ktiles > 65535 or bool(_OVERRIDES.dkdv_key_tiles_fast)
    grid = (n_ktiles, batch * num_kv, n_split) if tiles_fast else (batch * num_kv, n_split, n_ktiles)
    _interval_bwd_dkdv_kernel[grid](
        q, k, v, lo, hi, qa, qb, ia, ib, do, lse_g, delta, dk, dv, num_q, num_keys, n_ktiles, scale * _LOG2E,
        scale, H=num_heads, HKV=num_kv, G=group, D=head_dim, QPB=qpb, BLOCK_M=block_m, BLOCK_N=block_n,
        N_SPLIT=n_split, TILES_FAST=tiles_fast,
        ROW32=_rows_fit_int32(num_q, num_heads, head_dim), **dkdv_opts, **_FP_FUSION,
    )
    if n_split > 1:
        dk, dv = dk.sum(0).to(k.dtype), dv.sum(0).to(v.dtype)
    return dk, dv
