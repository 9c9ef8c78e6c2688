"""Interval attention: the compressed and sliding-window branches, where query t sees a contiguous run of keys
[lo(t), hi(t)) (NSA_SPEC; nsa_triton.py describes the kernels' layout of the work): the per-query intervals,
the forward kernel (which also writes the gated sum of the three branches) and the dK/dV kernel.
"""

from __future__ import annotations

import torch

from .nsa_layout import NSAParams
from .nsa_triton_common import _LOG2E, _cdiv, _launch_shapes, _running_extreme
from .nsa_triton_launch import _OVERRIDES, _dkdv_launch, _rows_per_program


try:  # the module must import where triton is missing (CPU-only installs, macOS)
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - exercised only without triton
    triton = tl = None


if triton is not None:
    from .nsa_triton_common import _bwd_rows, _dkdv_update, _gated_sum, _softmax_init, _softmax_tile, _tile_rows

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
    def _interval_kv(K, V, kv_base, k0, k_end, lo, hi,
                     HKV: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr):
        """Key tile [k0, k0 + BLOCK_N): K, V (BLOCK_N, D) and which rows see which keys (MASKED; otherwise every
        key is in range and seen by every row, and vis is a constant)."""
        kk = k0 + tl.arange(0, BLOCK_N)
        kv_off = kv_base + kk.to(tl.int64)[:, None] * (HKV * D) + tl.arange(0, D)[None, :]
        if MASKED:
            k_ok = kk < k_end
            k = tl.load(K + kv_off, mask=k_ok[:, None], other=0.0)
            v = tl.load(V + kv_off, mask=k_ok[:, None], other=0.0)
            vis = (kk[None, :] >= lo[:, None]) & (kk[None, :] < hi[:, None])
        else:
            k = tl.load(K + kv_off)
            v = tl.load(V + kv_off)
            vis = True
        return k, v, vis

    @triton.jit
    def _interval_fwd_range(q, K, V, kv_base, lo, hi, k_from, k_to, k_end, sm_scale2, m_i, l_i, acc,
                            HKV: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr):
        """Online softmax over the key tiles from k_from to k_to (masked or not, see _interval_tiles)."""
        for k0 in range(k_from, k_to, BLOCK_N):
            k, v, vis = _interval_kv(K, V, kv_base, k0, k_end, lo, hi, HKV, D, BLOCK_N, MASKED)
            s = tl.dot(q, tl.trans(k)) * sm_scale2
            if MASKED:
                s = tl.where(vis, s, float("-inf"))
            m_i, l_i, acc = _softmax_tile(s, v, m_i, l_i, acc)
        return m_i, l_i, acc

    @triton.jit
    def _interval_fwd_kernel(
        Q, K, V, LO, HI, O, LSE, OC, OS, GATE, OUT,
        Tq, Nk, sm_scale2,
        H: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
        QPB: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, COMBINE: tl.constexpr,
    ):
        pid_q = tl.program_id(0)
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
                                            acc, HKV, D, BLOCK_N, True)
        m_i, l_i, acc = _interval_fwd_range(q, K, V, kv_base, lo, hi, full_lo, full_hi, k_end, sm_scale2, m_i, l_i,
                                            acc, HKV, D, BLOCK_N, False)
        m_i, l_i, acc = _interval_fwd_range(q, K, V, kv_base, lo, hi, full_hi, k_end, k_end, sm_scale2, m_i, l_i,
                                            acc, HKV, D, BLOCK_N, True)
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
    def _dkdv_query_tiles(Q, DO, GATE, LSE, DELTA, LO, HI, b, g, q_from, q_to, q_end, Tq, kk, k, v, sm_scale2, dk, dv,
                          H: tl.constexpr, G: tl.constexpr, D: tl.constexpr, QPB: tl.constexpr,
                          BLOCK_M: tl.constexpr, BR: tl.constexpr, MASKED: tl.constexpr):
        """A key tile's dK/dV over the query tiles q_from, q_from + QPB, ... below q_to. MASKED: rows at or past
        q_end and keys outside a row's [lo, hi) are masked. Otherwise each tile lies inside the queries that see
        every key of the key tile (_wholly_visible_queries): no interval loads, no mask; the rows past QPB * G
        (a G that does not divide BLOCK_M) hold q = do = 0 and add nothing."""
        r = tl.arange(0, BLOCK_M)
        hh = r % G
        d = tl.arange(0, D)
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
            row = (b * Tq + qi) * H + g * G + hh
            q, do, lse, delta = _bwd_rows(Q, DO, GATE, LSE, DELTA, row, row_ok, d, D, BR)
            if MASKED:
                vis_t = row_ok[None, :] & (kk[:, None] >= lo[None, :]) & (kk[:, None] < hi[None, :])
            else:
                vis_t = True
            dk, dv = _dkdv_update(q, do, lse, delta, k, v, vis_t, sm_scale2, dk, dv)
        return dk, dv

    @triton.jit
    def _interval_bwd_dkdv_kernel(
        Q, K, V, LO, HI, QA, QB, IA, IB, DO, GATE, LSE, DELTA, DK, DV,
        Tq, Nk, n_ktiles, sm_scale2, scale,
        H: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
        QPB: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, N_SPLIT: tl.constexpr, BR: tl.constexpr,
        INTERIOR: tl.constexpr,
    ):
        # N_SPLIT > 1: program (tile, split) handles one slice of the tile's query range and writes an
        # fp32 partial to DK/DV[split] (summed afterwards in a fixed order: deterministic).
        pid_k = tl.program_id(0)
        pid_bg = tl.program_id(1)
        pid_s = tl.program_id(2)
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
        if INTERIOR:
            # the query tiles wholly inside [IA, IB) (every row sees every key of this tile) run unmasked, between
            # the masked ones before and after: three loops without a branch in their bodies, so each is
            # software-pipelined (a branch between masked and unmasked tiles in one loop stopped that)
            ia = tl.load(IA + b * n_ktiles + pid_k)
            ib = tl.minimum(tl.load(IB + b * n_ktiles + pid_k), q_end)
            n_tiles = tl.cdiv(tl.maximum(q_end - q_begin, 0), QPB)
            first = tl.minimum(tl.cdiv(tl.maximum(ia - q_begin, 0), QPB), n_tiles)
            last = tl.maximum(tl.minimum(tl.maximum(ib - q_begin, 0) // QPB, n_tiles), first)
            dk, dv = _dkdv_query_tiles(Q, DO, GATE, LSE, DELTA, LO, HI, b, g, q_begin, q_begin + first * QPB, q_end,
                                       Tq, kk, k, v, sm_scale2, dk, dv, H, G, D, QPB, BLOCK_M, BR, True)
            dk, dv = _dkdv_query_tiles(Q, DO, GATE, LSE, DELTA, LO, HI, b, g, q_begin + first * QPB,
                                       q_begin + last * QPB, q_end, Tq, kk, k, v, sm_scale2, dk, dv, H, G, D, QPB,
                                       BLOCK_M, BR, False)
            q_begin += last * QPB
        # the masked tiles after the run (INTERIOR), or every tile, even those inside all rows' intervals: one
        # loop with no branch in it
        dk, dv = _dkdv_query_tiles(Q, DO, GATE, LSE, DELTA, LO, HI, b, g, q_begin, q_end, q_end, Tq, kk, k, v,
                                   sm_scale2, dk, dv, H, G, D, QPB, BLOCK_M, BR, True)
        split_off = pid_s.to(tl.int64) * (tl.num_programs(1) // HKV) * Nk * HKV * D
        tl.store(DK + split_off + kv_off, (dk * scale).to(DK.dtype.element_ty), mask=k_ok[:, None])
        tl.store(DV + split_off + kv_off, dv.to(DV.dtype.element_ty), mask=k_ok[:, None])


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


# ----------------------------------------------------------------------------------------------
# Host-side launchers (static shapes, no host synchronization)
# ----------------------------------------------------------------------------------------------

def _layout(cmp_end, doc_pos, num_queries, num_win, params: NSAParams):
    """Per-query metadata in key coordinates, (B, Tq) int32 each: compressed [c_lo, c_hi) and window [w_lo, w_hi)
    (_layout_kernel). cmp_end (B, Nc) int64, ascending then -1; doc_pos (B, Tk) int64 with the queries its last
    Tq positions; the window keys the last num_win."""
    batch, num_keys = doc_pos.shape
    num_slots = cmp_end.shape[1]
    # rows read with their own strides (compressed_token_ends returns a slice of a wider buffer); elements in order
    cmp_end, doc_pos = (x if x.stride(-1) == 1 else x.contiguous() for x in (cmp_end, doc_pos))
    c_lo, c_hi, w_lo, w_hi = torch.empty(4, batch, num_queries, device=doc_pos.device, dtype=torch.int32)
    block = 128
    _layout_kernel[(_cdiv(max(num_queries, 1), block), batch)](
        cmp_end, doc_pos, c_lo, c_hi, w_lo, w_hi, num_queries, num_keys, num_slots, cmp_end.stride(0),
        doc_pos.stride(0), num_keys - num_win, params.window_size, BLOCK=block,
        STEPS=max(1, (num_slots + 1).bit_length()), num_warps=4,
    )
    return c_lo, c_hi, w_lo, w_hi


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
        COMBINE=combine is not None, num_warps=4 if head_dim <= 64 else 8,
    )
    return (o, lse, out) if combine is not None else (o, lse)


def _interval_query_ranges(intervals, block_n: int):
    """The dK/dV kernel's query ranges for each branch's key tiles [c0, c0 + block_n), every branch at once.
    intervals: [(lo, hi (B, Tq) int32, num_keys)], one per branch (the queries' key intervals [lo, hi),
    nondecreasing over valid queries; padding has lo = hi = 0). Returns per branch (qa, qb, ia, ib), each
    (B, n_ktiles) int32, n_ktiles = ceil(num_keys / block_n):

    - [qa, qb): the queries that can see the tile, hi(t) > c0 and lo(t) < c1 (c1 = min(c0 + block_n,
      num_keys)): from the first whose running max of hi passes c0 to the last whose running max of lo (empty
      intervals counted as 0) is below c1;
    - [ia, ib): a run of queries each of which sees all of the tile (lo(t) <= c0, hi(t) >= c0 + block_n), for
      the unmasked loop: from the first whose running max of hi reaches the tile's end to the last whose running
      max of lo is at or before its start, cut before the first query with an empty interval at or after ia
      (padding, inside a row or after its last token), so every query in it is valid. A partial last tile gets
      no run (c0 + block_n is past every hi).

    One running max over all the stacked rows (the next empty query as a running max of its negated reverse) and
    one searchsorted over all the stacked key tiles (right-sided searches as left-sided ones of v + 1): done
    branch by branch with torch's cummax/cummin and searchsorted this took about 120 small torch ops per f+b,
    0.8 ms of torch kernels and GPU time spent waiting for the host (bench/KERNELS.md)."""
    batch, num_q = intervals[0][0].shape
    device = intervals[0][0].device
    neutral = torch.iinfo(torch.int64).min
    pad = torch.full((batch, 1), neutral, device=device, dtype=torch.int64)
    index = torch.arange(num_q + 1, device=device).expand(batch, -1)
    his, los, lo_seens, negated_empty = [], [], [], []
    for lo, hi, _ in intervals:
        lo, hi = lo.long(), hi.long()
        his.append(torch.cat([hi, pad], -1))
        los.append(torch.cat([lo, pad], -1))
        lo_seens.append(torch.cat([torch.where(hi > lo, lo, 0), pad], -1))
        # next_empty[t]: the first query at or after t whose interval is empty (num_q: none, the extra column)
        empty = torch.cat([hi <= lo, torch.ones_like(hi[:, :1], dtype=torch.bool)], -1)
        negated_empty.append(-torch.where(empty, index, num_q).flip(-1))
    k = len(intervals)
    scanned = _running_extreme(torch.cat(his + lo_seens + los + negated_empty), largest=True)  # (4kB, Tq + 1)
    scanned = scanned.view(4, k, batch, num_q + 1)
    hi_m, lo_seen_m, lo_m = scanned[0, ..., :num_q], scanned[1, ..., :num_q], scanned[2, ..., :num_q]  # (k, B, Tq)
    next_empty = (-scanned[3]).flip(-1)  # (k, B, Tq + 1)
    n_tiles = [_cdiv(max(num_keys, 1), block_n) for _, _, num_keys in intervals]
    n_max = max(n_tiles)
    c0 = torch.arange(n_max, device=device) * block_n  # (n_max,)
    c1 = torch.stack([(c0 + block_n).clamp(max=num_keys) for _, _, num_keys in intervals])  # (k, n_max)
    sequences = torch.stack([hi_m, lo_seen_m, hi_m, lo_m])  # (4, k, B, Tq): qa, qb, ia, ib searches
    values = torch.stack([(c0 + 1).expand(k, -1), c1, (c0 + block_n).expand(k, -1), (c0 + 1).expand(k, -1)])
    found = torch.searchsorted(sequences.reshape(4 * k * batch, num_q),
                               values[:, :, None, :].expand(4, k, batch, n_max).reshape(4 * k * batch, n_max))
    qa, qb, ia, ib = found.view(4, k, batch, n_max)
    ib = torch.minimum(torch.maximum(ib, ia), next_empty.gather(-1, ia))
    as32 = lambda x, i: x[i, :, :n_tiles[i]].to(torch.int32).contiguous()  # noqa: E731
    return [(as32(qa, i), as32(qb, i), as32(ia, i), as32(ib, i)) for i in range(k)]


_DKDV_KEY_TILE = 64  # keys per program of the compressed/window dK/dV (BLOCK_N)


def _dkdv_unmasked_interior() -> bool:
    """Whether the compressed/window dK/dV runs its unmasked interior loop: on unless launch_overrides says
    otherwise (the 2026-11-25 sweep, bench/KERNELS.md). Any false value turns it off, the sweeps' 0 included."""
    forced = _OVERRIDES.dkdv_unmasked_interior
    return True if forced is None else bool(forced)


def _interval_bwd_dkdv(q, k, v, lo, hi, ranges, do, gates, branch, lse, delta, scale):
    """dK, dV of an interval branch; ranges: its (qa, qb, ia, ib) from _interval_query_ranges (block_n 64)."""
    batch, num_q, num_heads, head_dim, num_keys, num_kv, group = _launch_shapes(q, k)
    block_m, qpb, dkdv_opts = _dkdv_launch(group, head_dim, q.device)
    block_n = _DKDV_KEY_TILE
    n_ktiles = _cdiv(max(num_keys, 1), block_n)
    qa, qb, ia, ib = ranges
    interior = _dkdv_unmasked_interior()
    if not interior:
        ia, ib = qa, qb
    # Long query ranges per key tile (the compressed branch: a compressed key is seen by the rest of
    # its document) with few key tiles: split the range so the GPU is filled.
    n_split = 1
    programs = n_ktiles * batch * num_kv
    if programs < 1024 and num_q > 4 * block_n:
        n_split = max(1, min(64, 1024 // max(1, programs), num_q // (8 * qpb)))
    n_split = _OVERRIDES.dkdv_split or n_split
    if n_split == 1:
        dk = torch.empty_like(k)
        dv = torch.empty_like(v)
    else:
        dk = torch.empty((n_split,) + tuple(k.shape), device=k.device, dtype=torch.float32)
        dv = torch.empty_like(dk)
    _interval_bwd_dkdv_kernel[(n_ktiles, batch * num_kv, n_split)](
        q, k, v, lo, hi, qa, qb, ia, ib, do, gates, lse, delta, dk, dv, num_q, num_keys, n_ktiles, scale * _LOG2E,
        scale, H=num_heads, HKV=num_kv, G=group, D=head_dim, QPB=qpb, BLOCK_M=block_m, BLOCK_N=block_n,
        N_SPLIT=n_split, BR=branch, INTERIOR=interior, **dkdv_opts,
    )
    if n_split > 1:
        dk, dv = dk.sum(0).to(k.dtype), dv.sum(0).to(v.dtype)
    return dk, dv
