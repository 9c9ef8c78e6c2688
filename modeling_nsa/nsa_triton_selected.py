"""Selected attention: the forward over each query tile's union of chosen blocks and the dK/dV over an inverted
(block -> queries) index, with the load-skew split of heavily chosen blocks.
"""

from __future__ import annotations

import torch

from .nsa_layout import NSAParams
from .nsa_triton_common import _FP_FUSION, _LOG2E, _FloatDq, _cdiv, _launch_shapes, _next_pow2
from .nsa_triton_launch import (_OVERRIDES, _dkdv_launch, _kv_offsets_fit_int32, _query_tiles_light_first,
                                _rows_fit_int32, _sel_dkdv_chunk_tiles, _sel_fwd_opts, _sel_fwd_pair_queries,
                                _sel_fwd_pairs_launch, _sel_rows_per_program, _sel_sub_tile)


try:  # the module must import where triton is missing (CPU-only installs, macOS)
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - exercised only without triton
    triton = tl = None


if triton is not None:
    from .nsa_triton_common import (_bwd_rows, _dkdv_update, _dkdv_update_ds, _dq_add, _dv_unscaled, _head_rows,
                                     _kv_offsets, _max_combine, _min_combine, _query_tile_id, _softmax_init,
                                     _softmax_tile, _tile_rows)

    # ------------------------------------------------------------------------------------------
    # Selected attention
    # ------------------------------------------------------------------------------------------

    # Query tiles: a program packs BLOCK_M rows = QPB consecutive queries x the G heads of one KV group
    # and walks the union of the tile's selected blocks (consecutive queries share the forced blocks and
    # much of the top-n). A block is named by its absolute first key a = doc_start + j * l' (a block
    # start lies inside its document, so equal a means same document). The launcher lists each tile's
    # distinct blocks (_tile_block_union: sorted, deduplicated, static shapes) and, beside each, which of the
    # tile's queries chose it (a bit per query); each row attends block a iff its query's bit is set (keys
    # s <= t). A row reads its bit with a shift: the walk's step does no per-row search of the row's n' choices,
    # and the choices stay out of registers. Each union entry is one int64, a << 32 | the first 32 queries' bits,
    # so where a tile holds at most 32 queries (G >= 2 in the forward, G >= 4 in the 128-row dQ) a step loads one
    # scalar: two scalar loads a step kept the compiler from overlapping the loads of the block-past loop with its
    # math at the 125M layout (tests/triton_aot.py). Larger tiles read their other words from a second tensor (not
    # measured). Key indices are int32 (Tk < 2**31 - l').
    # Sub-tiles: the tile's rows are split in SUBS sub-tiles of SUB_M rows (1, 2 or 4, each with its own
    # softmax state); a union block is loaded once for the tile, and a sub-tile does its math only if one
    # of its rows' queries chose the block. The tile shares the block loads of many queries while the
    # math stays near what each query chose (bench/selection_tiles.py counts both). On sm_90 at head_dim 64
    # the tile is one sub-tile (_sel_sub_tile: a 16-row wgmma costs about a 64-row one), as it is for the
    # forward at head_dim 128.

    @triton.jit
    def _sel_sub_rows(Q, pid_q, pid_bg, Tq, q_off, r0,
                      H: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, QPB: tl.constexpr,
                      SUB_M: tl.constexpr):
        """A sub-tile's q (SUB_M, D), row indices (into (B*T*H) rows), row mask, query positions (int32) and each
        row's query within the tile (its bit in the union's masks; padding queries chose no block, so no bit)."""
        b = (pid_bg // HKV).to(tl.int64)
        g = pid_bg % HKV
        r, qi, row_ok = _tile_rows(pid_q, Tq, r0, G, QPB, SUB_M)
        t_abs = q_off + qi
        row = (b * Tq + qi) * H + g * G + r % G
        d = tl.arange(0, D)
        q = tl.load(Q + row[:, None] * D + d[None, :], mask=row_ok[:, None], other=0.0)
        return q, row, row_ok, t_abs, r // G

    @triton.jit
    def _sel_block(K, V, UENT, entry, kv_base, Tk, HKV: tl.constexpr, D: tl.constexpr, LB: tl.constexpr,
                   KV32: tl.constexpr):
        """The union entry's block: its first key a (int32), K, V (LB, D), and the bits of the tile's first 32
        queries (int32; the others' come from _sel_chosen). KV32: the keys' offsets within the row's K/V fit int32
        (_kv_offsets_fit_int32)."""
        packed = tl.load(UENT + entry)  # first key << 32 | query bits 0-31
        a = (packed >> 32).to(tl.int32)
        kk = a + tl.arange(0, LB)
        k_ld = kk < Tk
        kv_off = _kv_offsets(kk, HKV, D, KV32)
        k = tl.load(K + kv_base + kv_off, mask=k_ld[:, None], other=0.0)
        v = tl.load(V + kv_base + kv_off, mask=k_ld[:, None], other=0.0)
        return a, k, v, packed.to(tl.int32)

    @triton.jit
    def _sel_chosen(UHI, entry, word0, q_in_tile, WORDS: tl.constexpr):
        """(rows,) whether each row's query (q_in_tile, its index in the tile) chose the union entry's block: bit
        q % 32 of word q // 32, word 0 from the entry, words 1 .. WORDS-1 from UHI (tiles of over 32 queries).
        Rows past the tile's QPB x G hold no query (row_ok False: not loaded, not stored); whatever bit they read
        costs only their discarded math."""
        word = word0
        for w in tl.static_range(1, WORDS):
            word = tl.where(q_in_tile // 32 == w, tl.load(UHI + entry * (WORDS - 1) + (w - 1)), word)
        return ((word >> (q_in_tile % 32)) & 1) != 0

    @triton.jit
    def _sel_visible(a, t_abs, chosen, LB: tl.constexpr):
        """(rows, LB) which of block a's keys each row sees: those at or before its query if it chose the block,
        none otherwise. One compare per score, of the key's offset in the block (loop-invariant) with a per-row
        bound: key a + c is visible iff c <= t - a (int32: an int64 compare costs two instructions, and a
        compare with the key indices a + c would recompute them every block)."""
        return tl.arange(0, LB)[None, :] <= tl.where(chosen, t_abs - a, -1)[:, None]

    @triton.jit
    def _sel_fwd_sub(a, k, v, q, t_abs, chosen, sm_scale2, m_i, l_i, acc, WHOLE: tl.constexpr,
                     CAUSAL: tl.constexpr = True):
        """The block for one sub-tile: skipped unless one of its rows' queries chose it. WHOLE: the sub-tile is
        the whole tile, whose union holds only blocks its queries chose, so no test (and no branch in the
        loop, which lets the compiler pipeline the block loads). CAUSAL=False (WHOLE only): the block ends at
        or before every row's query, so only the rows that did not choose it are masked."""
        if WHOLE:
            if CAUSAL:
                vis = _sel_visible(a, t_abs, chosen, k.shape[0])
            else:
                vis = chosen[:, None]
            s = tl.where(vis, tl.dot(q, tl.trans(k)), float("-inf"))
            m_i, l_i, acc = _softmax_tile(s, sm_scale2, v, m_i, l_i, acc)
        elif tl.max(chosen.to(tl.int32), 0) > 0:
            vis = _sel_visible(a, t_abs, chosen, k.shape[0])
            s = tl.where(vis, tl.dot(q, tl.trans(k)), float("-inf"))
            m_i, l_i, acc = _softmax_tile(s, sm_scale2, v, m_i, l_i, acc)
        return m_i, l_i, acc

    @triton.jit
    def _sel_fwd_store(O, LSE, row, row_ok, m_i, l_i, acc, D: tl.constexpr):
        has = l_i > 0
        out = acc / tl.where(has, l_i, 1.0)[:, None]
        d = tl.arange(0, D)
        tl.store(O + row[:, None] * D + d[None, :], out.to(O.dtype.element_ty), mask=row_ok[:, None])
        tl.store(LSE + row, tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("inf")), mask=row_ok)

    @triton.jit
    def _sel_fwd_kernel(
        Q, K, V, UENT, UHI, UCNT, UPAST, O, LSE,
        Tq, Tk, q_off, n_tiles, sm_scale2,
        H: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
        LB: tl.constexpr, N_SEL: tl.constexpr, QPB: tl.constexpr, WORDS: tl.constexpr, BLOCK_M: tl.constexpr,
        SUB_M: tl.constexpr, LIGHT_FIRST: tl.constexpr, KV32: tl.constexpr,
    ):
        SUBS: tl.constexpr = BLOCK_M // SUB_M
        pid_q = _query_tile_id(LIGHT_FIRST)
        pid_bg = tl.program_id(1)
        tile = pid_bg.to(tl.int64) * n_tiles + pid_q
        entries = tile * (QPB * N_SEL)  # the tile's first union entry
        kv_base = (pid_bg // HKV).to(tl.int64) * Tk * HKV * D + (pid_bg % HKV) * D
        q0, row0, ok0, t0, c0 = _sel_sub_rows(Q, pid_q, pid_bg, Tq, q_off, 0, H, HKV, G, D, QPB, SUB_M)
        m0, l0, acc0 = _softmax_init(SUB_M, D)
        if SUBS >= 2:
            q1, row1, ok1, t1, c1 = _sel_sub_rows(Q, pid_q, pid_bg, Tq, q_off, SUB_M,
                                                  H, HKV, G, D, QPB, SUB_M)
            m1, l1, acc1 = _softmax_init(SUB_M, D)
        if SUBS >= 4:
            q2, row2, ok2, t2, c2 = _sel_sub_rows(Q, pid_q, pid_bg, Tq, q_off, 2 * SUB_M,
                                                  H, HKV, G, D, QPB, SUB_M)
            m2, l2, acc2 = _softmax_init(SUB_M, D)
            q3, row3, ok3, t3, c3 = _sel_sub_rows(Q, pid_q, pid_bg, Tq, q_off, 3 * SUB_M,
                                                  H, HKV, G, D, QPB, SUB_M)
            m3, l3, acc3 = _softmax_init(SUB_M, D)
        n_union = tl.load(UCNT + tile)
        u_from = 0
        if SUBS == 1:  # the blocks every row's query is past: no causal mask (one loop each: both pipelined)
            u_from = tl.load(UPAST + tile)
            for u in range(u_from):
                a, k, v, word = _sel_block(K, V, UENT, entries + u, kv_base, Tk, HKV, D, LB, KV32)
                chosen = _sel_chosen(UHI, entries + u, word, c0, WORDS)
                m0, l0, acc0 = _sel_fwd_sub(a, k, v, q0, t0, chosen, sm_scale2, m0, l0, acc0, True, False)
        for u in range(u_from, n_union):
            a, k, v, word = _sel_block(K, V, UENT, entries + u, kv_base, Tk, HKV, D, LB, KV32)
            chosen = _sel_chosen(UHI, entries + u, word, c0, WORDS)
            m0, l0, acc0 = _sel_fwd_sub(a, k, v, q0, t0, chosen, sm_scale2, m0, l0, acc0, SUBS == 1)
            if SUBS >= 2:
                chosen = _sel_chosen(UHI, entries + u, word, c1, WORDS)
                m1, l1, acc1 = _sel_fwd_sub(a, k, v, q1, t1, chosen, sm_scale2, m1, l1, acc1, False)
            if SUBS >= 4:
                chosen = _sel_chosen(UHI, entries + u, word, c2, WORDS)
                m2, l2, acc2 = _sel_fwd_sub(a, k, v, q2, t2, chosen, sm_scale2, m2, l2, acc2, False)
                chosen = _sel_chosen(UHI, entries + u, word, c3, WORDS)
                m3, l3, acc3 = _sel_fwd_sub(a, k, v, q3, t3, chosen, sm_scale2, m3, l3, acc3, False)
        _sel_fwd_store(O, LSE, row0, ok0, m0, l0, acc0, D)
        if SUBS >= 2:
            _sel_fwd_store(O, LSE, row1, ok1, m1, l1, acc1, D)
        if SUBS >= 4:
            _sel_fwd_store(O, LSE, row2, ok2, m2, l2, acc2, D)
            _sel_fwd_store(O, LSE, row3, ok3, m3, l3, acc3, D)

    @triton.jit
    def _sel_block_keys(DOCPOS, b, a, Tk, LB: tl.constexpr):
        """The LB keys of the selection block whose first key is a, and which of them are its keys: the same
        document as key a (a block may be cut by the document's end or the sequence's). Returns (kk, k_ok)."""
        kk = a + tl.arange(0, LB)
        a_start = a - tl.load(DOCPOS + b * Tk + a)
        k_pos = tl.load(DOCPOS + b * Tk + kk, mask=kk < Tk, other=-1)
        return kk, (kk < Tk) & (k_pos >= 0) & (kk - k_pos == a_start)

    @triton.jit
    def _sel_pair_tile(Q, DO, LSE_G, DELTA, DQ, DQ_HI, b, g, Tq, q_off, kk, k_ok, k, v, sm_scale2, scale, dk, dv,
                       qi, row_ok, r, hh, d, H: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
                       DQ_PAIRS: tl.constexpr, MASKED: tl.constexpr, ROW32: tl.constexpr, DQ_HALF: tl.constexpr):
        """One pair tile: rows r (query qi x head hh) of block keys kk added to dK, dV (and with DQ_PAIRS the
        rows' dQ shares, added atomically at their rows of the fp32 dQ: DQ, DQ_HI, DQ_HALF, _dq_add)."""
        base, row = _head_rows(b, g, qi, hh, Tq, H, G, ROW32)
        q, do, lse, delta = _bwd_rows(Q + base * D, DO + base * D, LSE_G + base, DELTA + base, row, row_ok, d, D)
        if MASKED:  # one compare per pair: keys off the block moved past every query, rows off the tile before key 0
            vis_t = tl.where(k_ok, kk, 2147483647)[:, None] <= tl.where(row_ok, q_off + qi, -1)[None, :]
        else:
            vis_t = True
        if DQ_PAIRS:
            dk, dv, ds_t = _dkdv_update_ds(q, do, lse, delta, k, v, vis_t, sm_scale2, dk, dv)
            dq = tl.dot(tl.trans(ds_t), k) * scale  # (rows, D)
            # (the batch and head-group offset on the bases: row stays int32 under ROW32)
            _dq_add(DQ + base * DQ_HALF, DQ_HI + base * DQ_HALF, row, d, D, DQ_HALF, dq, row_ok)
        else:
            dk, dv = _dkdv_update(q, do, lse, delta, k, v, vis_t, sm_scale2, dk, dv)
        return dk, dv

    @triton.jit
    def _sel_pair_tiles(Q, PAIR_Q, DO, LSE_G, DELTA, DQ, DQ_HI, b, g, p_from, p_to, p_end, Tq, q_off, kk,
                        k_ok, k, v, sm_scale2, scale, dk, dv, H: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
                        QPB: tl.constexpr, BLOCK_M: tl.constexpr, DQ_PAIRS: tl.constexpr,
                        MASKED: tl.constexpr, CH: tl.constexpr, ROW32: tl.constexpr, DQ_HALF: tl.constexpr):
        """A block's dK/dV over its pair tiles p_from, p_from + QPB, ... below p_to (rows packed as query x head;
        rows past QPB * G or at pairs past p_end are not loaded). MASKED: keys outside the block and keys after a
        row's query are masked. Otherwise each query lies at or past the block's last key, so every row sees every
        key: no mask (rows not loaded hold q = do = 0, lse = delta = 0, and add nothing).
        CH > 0: the tiles run in chunks of CH; a chunk's query indices (CH x QPB pairs) are loaded once and each
        tile takes its rows from them in registers (tl.gather), so the tile loop's loads of q, dO, lse and delta
        depend on no load inside the loop and Triton software-pipelines them ahead of the dots. CH = 0: each tile
        loads its own indices; the next tile's loads then wait on that load, which the pipeliner does not hoist:
        every copy is waited for at the top of each tile (async_wait num = 0 in the TTGIR), and that loop ran at
        about 0.6x the window dK/dV's speed per tile (bench/KERNELS.md; _sel_dkdv_chunk_tiles says where each runs).
        DQ_PAIRS: the pair's dQ share (scale dS K) added to the fp32 DQ (B*T*H, D) with atomics."""
        r = tl.arange(0, BLOCK_M)
        hh = r % G
        d = tl.arange(0, D)
        if CH == 0:  # each tile loads its own query indices
            for p0 in range(p_from, p_to, QPB):
                pi = p0 + r // G
                row_ok = (r < QPB * G) & (pi < p_end)
                qi = tl.load(PAIR_Q + pi, mask=row_ok, other=0)
                dk, dv = _sel_pair_tile(Q, DO, LSE_G, DELTA, DQ, DQ_HI, b, g, Tq, q_off, kk, k_ok, k, v, sm_scale2,
                                        scale, dk, dv, qi, row_ok, r, hh, d, H, G, D, DQ_PAIRS, MASKED, ROW32,
                                        DQ_HALF)
        else:
            CHQ: tl.constexpr = triton.next_power_of_2(CH * QPB)  # the chunk's index list (<= 256 by the launcher)
            c = tl.arange(0, CHQ)
            for c0 in range(p_from, p_to, CH * QPB):  # a chunk of up to CH tiles
                c_ok = (c < CH * QPB) & (c0 + c < p_end)
                chunk_q = tl.load(PAIR_Q + c0 + c, mask=c_ok, other=0)  # (CHQ,) the chunk's queries
                n_tiles = tl.minimum(CH, tl.cdiv(p_to - c0, QPB))
                for j in range(n_tiles.to(tl.int32)):
                    local = j * QPB + r // G  # (BLOCK_M,) int32: each row's pair within the chunk
                    row_ok = (r < QPB * G) & (local < p_end - c0)
                    local = tl.where(r < QPB * G, local, 0)
                    qi = tl.gather(chunk_q, local, 0)
                    dk, dv = _sel_pair_tile(Q, DO, LSE_G, DELTA, DQ, DQ_HI, b, g, Tq, q_off, kk, k_ok, k, v,
                                            sm_scale2, scale, dk, dv, qi, row_ok, r, hh, d, H, G, D, DQ_PAIRS,
                                            MASKED, ROW32, DQ_HALF)
        return dk, dv

    @triton.jit
    def _sel_block_dkdv(Q, K, V, PAIR_Q, DOCPOS, DO, LSE_G, DELTA, DQ, DQ_HI, a, pid_bg, p_begin, p_end,
                        Tq, Tk, q_off, sm_scale2, scale,
                        H: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, LB: tl.constexpr,
                        QPB: tl.constexpr, BLOCK_M: tl.constexpr, DQ_PAIRS: tl.constexpr,
                        CH: tl.constexpr, ROW32: tl.constexpr, DQ_HALF: tl.constexpr):
        """dK (unscaled), dV of the selection block whose first key is a, over its (query, block) pairs
        [p_begin, p_end) (rows packed as query x head). DQ_PAIRS: also each pair's dQ share (a query's n blocks
        are met in n programs), added to an fp32 dQ with atomics. A block's pairs come in increasing query order,
        and only its first ones (at most LB - 1: queries inside the block) see part of its keys: their tiles run
        masked, the tiles after them without masks (_sel_pair_tiles). Returns (dk, dv, kv_off, k_ok)."""
        b = (pid_bg // HKV).to(tl.int64)
        g = pid_bg % HKV
        kk, k_ok = _sel_block_keys(DOCPOS, b, a, Tk, LB)
        d = tl.arange(0, D)
        kv_off = b * Tk * HKV * D + g * D + kk.to(tl.int64)[:, None] * (HKV * D) + d[None, :]
        k = tl.load(K + kv_off, mask=k_ok[:, None], other=0.0)
        v = tl.load(V + kv_off, mask=k_ok[:, None], other=0.0)
        dk = tl.zeros([LB, D], tl.float32)
        dv = tl.zeros([LB, D], tl.float32)
        # the pairs whose query comes before the block's last key: the first ones (a query inside it); masking
        # every tile instead took the kernel 11-13% longer at 64k (the 2026-11-25 H100 sweep, bench/KERNELS.md)
        first = p_begin + tl.arange(0, LB)
        first_q = tl.load(PAIR_Q + first, mask=first < p_end, other=0)
        n_partial = tl.sum(((first < p_end) & (q_off + first_q < a + LB - 1)).to(tl.int32), 0)
        p_seen_whole = tl.minimum(p_begin + tl.cdiv(n_partial, QPB) * QPB, p_end)  # the tiles from here
        dk, dv = _sel_pair_tiles(Q, PAIR_Q, DO, LSE_G, DELTA, DQ, DQ_HI, b, g, p_begin, p_seen_whole, p_end,
                                 Tq, q_off, kk, k_ok, k, v, sm_scale2, scale, dk, dv, H, G, D, QPB, BLOCK_M,
                                 DQ_PAIRS, True, CH, ROW32, DQ_HALF)
        dk, dv = _sel_pair_tiles(Q, PAIR_Q, DO, LSE_G, DELTA, DQ, DQ_HI, b, g, p_seen_whole, p_end, p_end,
                                 Tq, q_off, kk, k_ok, k, v, sm_scale2, scale, dk, dv, H, G, D, QPB, BLOCK_M,
                                 DQ_PAIRS, False, CH, ROW32, DQ_HALF)
        return dk, _dv_unscaled(dv, DO), kv_off, k_ok

    @triton.jit
    def _sel_bwd_dkdv_kernel(
        Q, K, V, PAIR_OFF, PAIR_Q, SLOT_RANK, PIECES, DOCPOS, DO, LSE_G, DELTA, DK, DV, PDK, PDV, DQ, DQ_HI,
        Tq, Tk, q_off, sm_scale2, scale, heavy_min, n_flat, n_heavy,
        H: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
        LB: tl.constexpr, QPB: tl.constexpr, BLOCK_M: tl.constexpr,
        HEAVY_PASS: tl.constexpr, DQ_PAIRS: tl.constexpr,
        CH: tl.constexpr, RANGES_FAST: tl.constexpr, ROW32: tl.constexpr, DQ_HALF: tl.constexpr,
    ):
        # A program's work is its block's pair count, which ranges from a few to every query of the row (block 0
        # is forced for all of them, and top-n favours early blocks), so the order programs start in decides
        # how long the GPU waits for the last (bench/KERNELS.md, "2026-11-27 H100": the heaviest started last
        # and the kernel took 1.2-2.9x its balanced time).
        # Heavy pass, launched first (grid: one program per partial piece; PIECES[piece] = (block, first pair, end
        # pair), heaviest block first): a block with more than heavy_min pairs and a slot (SLOT_RANK <= n_heavy:
        # _sel_heavy_slots) is cut into pieces of one size (_sel_heavy_pieces), each writing an fp32 partial that
        # _sel_dkdv_reduce_kernel sums in piece order (deterministic, no atomics). Main pass (grid: batch*kv head x
        # key range of LB keys, the row fastest, so every row's first ranges, which hold most pairs, start before
        # any row's last; RANGES_FAST: the key range fastest, the order timed until 2026-11-27): the blocks starting
        # in the range that have pairs, found with one vector load of their pair counts; usually one per range
        # (more where short documents start blocks close together); heavy blocks past the n_heavy slots stay here
        # (slower, still exact).
        d = tl.arange(0, D)
        if HEAVY_PASS:
            piece = tl.program_id(0).to(tl.int64)
            f = tl.load(PIECES + piece * 3)  # flat (batch * kv head, block start); n_flat past the last piece
            if f < n_flat:
                a = f % Tk
                pid_bg = f // Tk
                p_begin = tl.load(PIECES + piece * 3 + 1)
                p_end = tl.load(PIECES + piece * 3 + 2)
                dk, dv, kv_off, k_ok = _sel_block_dkdv(Q, K, V, PAIR_Q, DOCPOS, DO, LSE_G, DELTA, DQ,
                                                       DQ_HI, a, pid_bg, p_begin, p_end, Tq, Tk, q_off, sm_scale2,
                                                       scale, H, HKV, G, D, LB, QPB, BLOCK_M, DQ_PAIRS,
                                                       CH, ROW32, DQ_HALF)
                # (the program id read again, not kept live through the tile loop: at 255 registers on the 125M
                # layout one more live value spills inside it)
                p_off = (tl.program_id(0).to(tl.int64) * LB + tl.arange(0, LB).to(tl.int64))[:, None] * D + d[None, :]
                tl.store(PDK + p_off, dk * scale)
                tl.store(PDV + p_off, dv)
        else:
            if RANGES_FAST:
                pid_bg = tl.program_id(1)
                key_range = tl.program_id(0)
            else:
                pid_bg = tl.program_id(0)
                key_range = tl.program_id(1)
            aa = key_range * LB + tl.arange(0, LB)  # candidate block starts in this key range
            a_ok = aa < Tk
            off = pid_bg.to(tl.int64) * Tk + aa
            beg = tl.load(PAIR_OFF + off, mask=a_ok, other=0)
            cnt = tl.load(PAIR_OFF + off + 1, mask=a_ok, other=0) - beg
            mine = (cnt > 0) & ((cnt <= heavy_min) | (tl.load(SLOT_RANK + off, mask=a_ok, other=0) > n_heavy))
            rank = tl.cumsum(mine.to(tl.int32), 0) - 1
            for i in range(tl.sum(mine.to(tl.int32), 0)):
                hit = mine & (rank == i)
                a = tl.sum(tl.where(hit, aa, 0), 0)
                p_begin = tl.sum(tl.where(hit, beg, 0), 0)
                p_end = p_begin + tl.sum(tl.where(hit, cnt, 0), 0)
                dk, dv, kv_off, k_ok = _sel_block_dkdv(Q, K, V, PAIR_Q, DOCPOS, DO, LSE_G, DELTA, DQ,
                                                       DQ_HI, a, pid_bg, p_begin, p_end, Tq, Tk, q_off, sm_scale2,
                                                       scale, H, HKV, G, D, LB, QPB, BLOCK_M, DQ_PAIRS,
                                                       CH, ROW32, DQ_HALF)
                tl.store(DK + kv_off, (dk * scale).to(DK.dtype.element_ty), mask=k_ok[:, None])
                tl.store(DV + kv_off, dv.to(DV.dtype.element_ty), mask=k_ok[:, None])

    @triton.jit
    def _sel_dkdv_reduce_kernel(
        PDK, PDV, HPOS, PIECE_START, DOCPOS, DK, DV, Tk, n_flat,
        HKV: tl.constexpr, D: tl.constexpr, LB: tl.constexpr,
    ):
        h = tl.program_id(0).to(tl.int64)
        f = tl.load(HPOS + h)  # flat (batch * kv head, block start) of the h-th heavy block
        if f < n_flat:
            first_piece = tl.load(PIECE_START + h)
            end_piece = tl.load(PIECE_START + h + 1)
            pid_bg = f // Tk
            a = f % Tk
            b = pid_bg // HKV
            g = pid_bg % HKV
            kk, k_ok = _sel_block_keys(DOCPOS, b, a, Tk, LB)
            d = tl.arange(0, D)
            kv_off = b * Tk * HKV * D + g * D + kk[:, None] * (HKV * D) + d[None, :]
            # one fp32 tile live at a time (dK, then dV), summed in piece order: deterministic
            for which in tl.static_range(2):
                acc = tl.zeros([LB, D], tl.float32)
                for piece in range(first_piece, end_piece):  # (int64 bounds: an int64 index)
                    p_off = (piece * LB + tl.arange(0, LB).to(tl.int64))[:, None] * D + d[None, :]
                    if which == 0:
                        acc += tl.load(PDK + p_off)
                    else:
                        acc += tl.load(PDV + p_off)
                if which == 0:
                    tl.store(DK + kv_off, acc.to(DK.dtype.element_ty), mask=k_ok[:, None])
                else:
                    tl.store(DV + kv_off, acc.to(DV.dtype.element_ty), mask=k_ok[:, None])


    # ------------------------------------------------------------------------------------------
    # Selected attention, block-outer forward (launch_overrides(sel_fwd_pairs=True))
    # ------------------------------------------------------------------------------------------

    # The union walk above does, per 64-row query tile, the math of every block any of its queries chose and loads
    # each such block once per tile: at 8k tokens with random queries 81 blocks per tile where a query chose 16,
    # 17 GB of K/V loads per step from L2 (bench/kernel_floors.py, scheduled work). The block-outer schedule
    # (FSA's, arXiv 2508.18224) meets each (query, block) pair once: a pair tile packs up to QPB queries that chose
    # one block x their G heads, loads the block once for all of them, and writes each row's partial softmax
    # (the block's normalized output and base-2 log-sum-exp) to the row's (query, slot); a combine kernel merges
    # a query's n' partials. Its extra traffic is the partials (written once, read once), so it pays where tiles
    # share few blocks (random queries) and not where neighbouring queries choose alike (bench/KERNELS.md).
    # Queries are cut in chunks whose partials fit a fixed budget (_sel_fwd_pair_queries), so the op's peak memory
    # does not grow with n'.

    @triton.jit
    def _pair_walk_start(CHUNK_OFF, chunk, PAIRS: tl.constexpr):
        """A pair program's run of the chunk's sorted pairs: [p, p_end), at most PAIRS."""
        p_hi = tl.load(CHUNK_OFF + chunk + 1)
        p = tl.load(CHUNK_OFF + chunk) + tl.program_id(0).to(tl.int64) * PAIRS
        return p, tl.minimum(p + PAIRS, p_hi)

    # A pair tile's (first entry, pair count, sort key) packed in one int64 (entry << 53 | (count - 1) << 47 | key), so
    # one reduction hands the tile loop all three: entries < 1,024 (PAIRS <= 512 by the launcher), counts <= 64
    # (QPB), keys < 2^47 (chunks x batch x KV heads x Tk: _sel_pair_index)
    _PAIR_KEY_BITS = tl.constexpr(47)
    _PAIR_KEY_MASK = tl.constexpr(2**47 - 1)
    _PAIR_COUNT_MASK = tl.constexpr(63)  # count - 1 in the 6 bits above the key
    _PAIR_FIRST_SHIFT = tl.constexpr(53)  # 47 + 6: the first entry above the count

    @triton.jit
    def _pair_run(SKEY, ORDER, p, p_end, QPB: tl.constexpr, PAIRS: tl.constexpr):
        """A pair program's run [p, p_end) of sorted pairs, loaded once into registers, cut into pair tiles: up to QPB
        consecutive pairs of one block, a tile at every QPB-th pair of each block's run within the program (a run is
        cut by the program's start and end too). Returns (the pairs' flat indices in idx (PAIRS,), the tiles packed
        (first entry, count, key; _PAIR_KEY_BITS) at [t] for t < the count, ascending, the tile count). Every load
        of the tile loop then takes its address from registers, so Triton software-pipelines the loop; a walk that
        loaded each tile's pairs in the loop (a while loop, as timed on 2026-11-27) waited for every load at every
        tile."""
        e = tl.arange(0, PAIRS)
        ok = p + e < p_end
        key = tl.load(SKEY + p + e, mask=ok, other=-1).to(tl.int64)  # (-1: no pair; every pair's key is >= 0)
        order = tl.load(ORDER + p + e, mask=ok, other=0)
        starts = (e == 0) | (key != tl.gather(key, tl.maximum(e - 1, 0), 0))  # a block's first pair in the run
        run_start = tl.associative_scan(tl.where(starts, e, 0), 0, _max_combine)
        next_start = tl.gather(starts, tl.minimum(e + 1, PAIRS - 1), 0) & (e + 1 < PAIRS)
        run_end = tl.associative_scan(tl.where(next_start, e + 1, PAIRS), 0, _min_combine, reverse=True)
        n_valid = tl.minimum(p_end - p, PAIRS).to(tl.int32)
        count = tl.minimum(tl.minimum(run_end, n_valid) - e, QPB)  # pairs in the tile starting at e
        tile_start = ok & ((e - run_start) % QPB == 0)
        packed = (e.to(tl.int64) << _PAIR_FIRST_SHIFT) | ((count - 1).to(tl.int64) << _PAIR_KEY_BITS) | key
        tiles = tl.sort(tl.where(tile_start, packed, tl.full([PAIRS], 2**62, tl.int64) + e), 0)
        return order, tiles, tl.sum(tile_start.to(tl.int32), 0)

    @triton.jit
    def _pair_tile(order, tiles, t, K, V, chunk, n_bg, Tq, Tk,
                   H: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, LB: tl.constexpr,
                   N_SEL: tl.constexpr, QPB: tl.constexpr, BLOCK_M: tl.constexpr, PAIRS: tl.constexpr):
        """Pair tile t of a program's run (_pair_run): its block's keys kk, k_ok (inside the sequence) and K, V (loaded
        for every tile: the loads' addresses come from registers, and a tile's block is an L2 read), and per row
        (query x head) whether it is a pair's, its row of q (B*Tq*H rows), its query and slot. Which keys a row
        sees (_pair_visible) and its partial row (_pair_partial_rows) are left to the kernels, next to their use:
        computed here, before the loads, they stayed live across the dQ's dots and spilled on sm_86. The key's
        fields: (chunk x n_bg + batch x KV head) x Tk + block first key."""
        packed = tl.sum(tl.where(tl.arange(0, PAIRS) == t, tiles, 0), 0)  # (one reduction: the tile's three fields)
        first = (packed >> _PAIR_FIRST_SHIFT).to(tl.int32)
        count = ((packed >> _PAIR_KEY_BITS) & _PAIR_COUNT_MASK).to(tl.int32) + 1
        key_t = packed & _PAIR_KEY_MASK
        r = tl.arange(0, BLOCK_M)
        row_ok = (r < QPB * G) & (r // G < count)
        seg = key_t // Tk  # chunk x n_bg + batch x KV head
        bg = (seg - chunk * n_bg).to(tl.int64)
        b = bg // HKV
        g = bg % HKV
        # The block's keys: every query that chose it lies in its document, at or after its first key, so the keys
        # a row sees at or before its query are the document's (no document test, as the union walk's _sel_block)
        kk = (key_t - seg * Tk).to(tl.int32) + tl.arange(0, LB)
        k_ok = kk < Tk
        kv_off = b * Tk * HKV * D + g * D + kk.to(tl.int64)[:, None] * (HKV * D) + tl.arange(0, D)[None, :]
        k = tl.load(K + kv_off, mask=k_ok[:, None], other=0.0)
        v = tl.load(V + kv_off, mask=k_ok[:, None], other=0.0)
        # (BLOCK_M,) each row's pair as its flat index in idx: ((b x Hkv + kv) x Tq + query) x n' + slot
        f = tl.gather(order, tl.where(row_ok, first + r // G, first), 0)
        qi = tl.where(row_ok, f // N_SEL - bg * Tq, 0)  # (no division by the runtime Tq)
        row = (b * Tq + qi) * H + g * G + r % G
        return kk, k_ok, k, v, bg, row_ok, row, qi, f % N_SEL

    @triton.jit
    def _pair_visible(row_ok, qi, kk, k_ok, q_off):
        """(BLOCK_M, LB): the block's keys each row of a pair tile sees (its own, at or before its query)."""
        return row_ok[:, None] & k_ok[None, :] & (kk[None, :] <= (q_off + qi).to(tl.int32)[:, None])

    @triton.jit
    def _pair_partial_rows(bg, qi, slot, c0, chunk_q, G: tl.constexpr, N_SEL: tl.constexpr, BLOCK_M: tl.constexpr):
        """A pair tile's rows' partial rows: ((bg x chunk_q + query - c0) x n' + slot) x G + head."""
        return ((bg * chunk_q + qi - c0) * N_SEL + slot) * G + tl.arange(0, BLOCK_M) % G

    @triton.jit(do_not_specialize=["chunk", "c0"])
    def _sel_fwd_pairs_kernel(
        Q, K, V, SKEY, ORDER, CHUNK_OFF, OPART, LPART,
        chunk, c0, chunk_q, n_bg, Tq, Tk, q_off, sm_scale2,
        H: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, LB: tl.constexpr,
        N_SEL: tl.constexpr, QPB: tl.constexpr, BLOCK_M: tl.constexpr, PAIRS: tl.constexpr,
    ):
        """One program: the chunk's sorted pairs [p, p + PAIRS) in pair tiles (_pair_run). Each row's partial
        softmax at partial row ((bg x chunk_q + query - c0) x n' + slot) x G + head: the output normalized over the
        block's visible keys, and their base-2 log-sum-exp."""
        p, p_end = _pair_walk_start(CHUNK_OFF, chunk, PAIRS)
        order, tiles, n_tiles = _pair_run(SKEY, ORDER, p, p_end, QPB, PAIRS)
        d = tl.arange(0, D)
        for t in range(n_tiles):
            kk, k_ok, k, v, bg, row_ok, row, qi, slot = _pair_tile(
                order, tiles, t, K, V, chunk, n_bg, Tq, Tk, H, HKV, G, D, LB, N_SEL, QPB, BLOCK_M,
                PAIRS)
            q = tl.load(Q + row[:, None] * D + d[None, :], mask=row_ok[:, None], other=0.0)
            vis = _pair_visible(row_ok, qi, kk, k_ok, q_off)
            s = tl.where(vis, tl.dot(q, tl.trans(k)), float("-inf"))
            m = tl.max(s, 1) * sm_scale2  # (the scale inside the exponent: as _softmax_tile)
            m_safe = tl.where(m == float("-inf"), 0.0, m)
            prob = tl.exp2(s * sm_scale2 - m_safe[:, None])
            l_sum = tl.sum(prob, 1)
            out = tl.dot(prob.to(v.dtype), v) / tl.where(l_sum > 0, l_sum, 1.0)[:, None]
            prow = _pair_partial_rows(bg, qi, slot, c0, chunk_q, G, N_SEL, BLOCK_M)
            tl.store(OPART + prow[:, None] * D + d[None, :], out.to(OPART.dtype.element_ty), mask=row_ok[:, None])
            # -inf where no key of the block is visible (the combine then gives it no weight; a block the top-n
            # lists always has one, its first key being at or before the query)
            tl.store(LPART + prow, tl.where(l_sum > 0, m_safe + tl.log2(tl.where(l_sum > 0, l_sum, 1.0)),
                                            float("-inf")), mask=row_ok)

    @triton.jit(do_not_specialize=["chunk", "c0"])
    def _sel_dq_pairs_kernel(
        Q, K, V, DO, LSE_G, DELTA, SKEY, ORDER, CHUNK_OFF, DQPART,
        chunk, c0, chunk_q, n_bg, Tq, Tk, q_off, sm_scale2, scale,
        H: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, LB: tl.constexpr,
        N_SEL: tl.constexpr, QPB: tl.constexpr, BLOCK_M: tl.constexpr, PAIRS: tl.constexpr,
    ):
        """The selected branch's dQ pair by pair (launch_overrides(sel_dq_pairs=True)), walked as the block-outer
        forward's: per row, the block's share scale dS K with g P recomputed from the branch's gated log-sum-exp and
        dS = g P (dout V^T - delta) (_bwd_rows), stored at the same partial rows as the forward's (three dots, no
        accumulator across tiles: the selected dK/dV keeps its own kernel)."""
        p, p_end = _pair_walk_start(CHUNK_OFF, chunk, PAIRS)
        order, tiles, n_tiles = _pair_run(SKEY, ORDER, p, p_end, QPB, PAIRS)
        d = tl.arange(0, D)
        for t in range(n_tiles):
            kk, k_ok, k, v, bg, row_ok, row, qi, slot = _pair_tile(
                order, tiles, t, K, V, chunk, n_bg, Tq, Tk, H, HKV, G, D, LB, N_SEL, QPB, BLOCK_M,
                PAIRS)
            q, do, lse, delta = _bwd_rows(Q, DO, LSE_G, DELTA, row, row_ok, d, D)
            vis = _pair_visible(row_ok, qi, kk, k_ok, q_off)
            s = tl.dot(q, tl.trans(k)) * sm_scale2
            prob = tl.where(vis, tl.exp2(s - lse[:, None]), 0.0)
            dp = tl.dot(do, tl.trans(v))
            ds = prob * (dp - delta[:, None])
            dq = tl.dot(ds.to(k.dtype), k) * scale
            prow = _pair_partial_rows(bg, qi, slot, c0, chunk_q, G, N_SEL, BLOCK_M)
            tl.store(DQPART + prow[:, None] * D + d[None, :], dq.to(DQPART.dtype.element_ty), mask=row_ok[:, None])

    @triton.jit(do_not_specialize=["c0"])
    def _sel_fwd_pairs_combine_kernel(
        IDX, OPART, LPART, O, LSE, c0, chunk_q, Tq,
        H: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, N_SEL: tl.constexpr,
        N_PAD: tl.constexpr, QPB: tl.constexpr, BLOCK_M: tl.constexpr,
    ):
        """A query tile's rows (QPB queries of the chunk x G heads): the softmax over all its chosen blocks from
        their partials, o = sum_s 2^(lse_s - lse) o_s with lse = log2 sum_s 2^lse_s, over the slots idx uses
        (the others' partials were never written); no slot: o = 0, lse = +inf (as _sel_fwd_store)."""
        pid_bg = tl.program_id(1).to(tl.int64)
        b = pid_bg // HKV
        g = pid_bg % HKV
        r = tl.arange(0, BLOCK_M)
        local = tl.program_id(0) * QPB + r // G  # query within the chunk
        hh = r % G
        qi = c0 + local
        row_ok = (r < QPB * G) & (local < chunk_q) & (qi < Tq)
        slot = tl.arange(0, N_PAD)
        j = tl.load(IDX + (pid_bg * Tq + qi)[:, None] * N_SEL + slot[None, :],
                    mask=row_ok[:, None] & (slot < N_SEL)[None, :], other=-1)
        used = j >= 0  # (BLOCK_M, N_PAD)
        prow = ((pid_bg * chunk_q + local)[:, None] * N_SEL + slot[None, :]) * G + hh[:, None]
        lse_s = tl.load(LPART + prow, mask=used, other=float("-inf"))
        m = tl.max(lse_s, 1)
        has = m > float("-inf")
        m_safe = tl.where(has, m, 0.0)
        w = tl.exp2(lse_s - m_safe[:, None])  # 0 at unused slots
        total = tl.sum(w, 1)
        w = w / tl.where(has, total, 1.0)[:, None]
        d = tl.arange(0, D)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        for s in range(N_SEL):  # (a loop, not unrolled: unrolled, the slots' loads spilled)
            at_s = slot[None, :] == s
            w_s = tl.sum(tl.where(at_s, w, 0.0), 1)
            ok_s = tl.sum((at_s & used).to(tl.int32), 1) > 0
            row_s = tl.sum(tl.where(at_s, prow, 0), 1)
            o_s = tl.load(OPART + row_s[:, None] * D + d[None, :], mask=ok_s[:, None], other=0.0)
            acc += w_s[:, None] * o_s.to(tl.float32)
        row = (b * Tq + qi) * H + g * G + hh
        tl.store(O + row[:, None] * D + d[None, :], acc.to(O.dtype.element_ty), mask=row_ok[:, None])
        tl.store(LSE + row, tl.where(has, m_safe + tl.log2(tl.where(has, total, 1.0)), float("inf")), mask=row_ok)


    # ------------------------------------------------------------------------------------------
    # Tile unions: one program per (query tile, batch x KV group) lists the tile's distinct blocks
    # ------------------------------------------------------------------------------------------

    @triton.jit
    def _sel_pair_key_kernel(IDX, DOCPOS, KEY, Tq, Tk, q_off, chunk_q, n_bg, sentinel, total,
                             HKV: tl.constexpr, N_SEL: tl.constexpr, LB: tl.constexpr, BLOCK: tl.constexpr):
        """The sort key of each (query, block) pair of idx (B, Hkv, Tq, n'), flat: (query chunk, batch x KV head,
        the block's absolute first key) as ((chunk * n_bg + bg) * Tk + doc_start + j * l'); `sentinel` (above every
        key) for unused slots. The key's dtype is KEY's (int32 where every key fits)."""
        f = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = f < total
        j = tl.load(IDX + f, mask=ok, other=-1).to(tl.int64)
        t = (f // N_SEL) % Tq
        bg = f // N_SEL // Tq  # b * HKV + kv
        b = bg // HKV
        start = q_off + t - tl.load(DOCPOS + b * Tk + q_off + t, mask=ok, other=0)  # the document's first key
        key = ((t // chunk_q) * n_bg + bg) * Tk + start + j * LB
        tl.store(KEY + f, tl.where(j >= 0, key, sentinel).to(KEY.dtype.element_ty), mask=ok)

    @triton.jit
    def _sel_pair_offsets_kernel(SKEY, ORDER, PAIR_Q, PAIR_OFF, n_pairs, n_offsets, Tq, steps,
                                 N_SEL: tl.constexpr, BLOCK: tl.constexpr):
        """After the sort: each sorted pair's query (PAIR_Q, int32, from its flat index in idx) and, for each key
        value v in [0, n_offsets), the first sorted pair whose key is v or above (PAIR_OFF, int32 below 2**31 pairs,
        else int64: a binary search of the sorted keys), so a block's pairs are PAIR_OFF[v] .. PAIR_OFF[v + 1]."""
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        in_pairs = i < n_pairs
        flat = tl.load(ORDER + i, mask=in_pairs, other=0)
        tl.store(PAIR_Q + i, ((flat // N_SEL) % Tq).to(tl.int32), mask=in_pairs)
        in_offsets = i < n_offsets
        lo = tl.zeros([BLOCK], dtype=tl.int64)
        hi = tl.zeros([BLOCK], dtype=tl.int64) + n_pairs
        for _ in range(steps):  # the first position whose key >= i (steps: a runtime bound, so no recompiles)
            mid = (lo + hi) // 2
            active = lo < hi
            below = tl.load(SKEY + mid, mask=active & in_offsets, other=0) < i
            lo = tl.where(active & below, mid + 1, lo)
            hi = tl.where(active & ~below, mid, hi)
        tl.store(PAIR_OFF + i, lo.to(PAIR_OFF.dtype.element_ty), mask=in_offsets)

    @triton.jit
    def _sel_heavy_keys_kernel(PAIR_OFF, KEY, SLOT_RANK, n_flat, heavy_min, rank_past, BLOCK: tl.constexpr):
        """Each (batch x kv head, block first key)'s pair count as a unique top-k key (count x n_flat + reversed
        index: the heaviest first, ties to the lower index) and its SLOT_RANK before the slots are given: rank_past
        (n_heavy + 1) where heavy, else 0 (_sel_heavy_slots is the oracle)."""
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = i < n_flat
        cnt = (tl.load(PAIR_OFF + i + 1, mask=ok, other=0) - tl.load(PAIR_OFF + i, mask=ok, other=0)).to(tl.int64)
        tl.store(KEY + i, cnt * n_flat + (n_flat - 1 - i), mask=ok)
        tl.store(SLOT_RANK + i, tl.where(cnt > heavy_min, rank_past, 0).to(SLOT_RANK.dtype.element_ty), mask=ok)

    @triton.jit
    def _sel_heavy_pieces_kernel(TOP, PAIR_OFF, SLOT_RANK, HPOS, PIECES, PIECE_START, n_flat, n_heavy, heavy_min,
                                 min_piece, max_pieces, QPB: tl.constexpr, SLOTS: tl.constexpr,
                                 PBLOCK: tl.constexpr, STEPS: tl.constexpr):
        """One program: the slots (TOP, the n_heavy heaviest blocks, heaviest first; those above heavy_min are
        split: HPOS, and SLOT_RANK 1 at each) and their pieces (PIECES rows (block, first pair, end pair), all of one
        size, PIECE_START each slot's first), as _sel_heavy_slots and _sel_heavy_pieces compute them with torch: one
        launch where those took about 30 (the backward's host launches bound it at 2k)."""
        h = tl.arange(0, SLOTS)
        h_ok = h < n_heavy
        f = tl.load(TOP + h, mask=h_ok, other=0)
        cnt = (tl.load(PAIR_OFF + f + 1, mask=h_ok, other=0) - tl.load(PAIR_OFF + f, mask=h_ok, other=0)).to(tl.int64)
        split = h_ok & (cnt > heavy_min)
        hpos = tl.where(split, f, n_flat)
        tl.store(HPOS + h, hpos, mask=h_ok)
        tl.store(SLOT_RANK + f, tl.full([SLOTS], 1, SLOT_RANK.dtype.element_ty), mask=split)
        slot_cnt = tl.where(split, cnt, 0)
        span = tl.maximum(tl.cdiv(tl.sum(slot_cnt, 0), max_pieces - n_heavy), min_piece)
        span = tl.cdiv(span, QPB) * QPB  # pairs per piece: whole pair tiles
        ends = tl.cumsum(tl.cdiv(slot_cnt, span), 0)  # (SLOTS,) each slot's pieces end here (0 pieces unsplit)
        starts = ends - tl.cdiv(slot_cnt, span)
        tl.store(PIECE_START + 1 + h, ends, mask=h_ok)
        tl.store(PIECE_START + h, starts, mask=h == 0)
        n_pieces = tl.max(tl.where(h_ok, ends, 0), 0)
        # each piece's slot: the number of slots whose pieces end at or before it (a binary search over ends)
        p = tl.arange(0, PBLOCK).to(tl.int64)
        lo = tl.zeros([PBLOCK], tl.int32)
        hi = tl.zeros([PBLOCK], tl.int32) + n_heavy
        for _ in tl.static_range(STEPS):
            mid = (lo + hi) // 2
            active = lo < hi
            below = tl.gather(ends, tl.minimum(mid, SLOTS - 1), 0) <= p
            lo = tl.where(active & below, mid + 1, lo)
            hi = tl.where(active & ~below, mid, hi)
        slot = tl.minimum(lo, SLOTS - 1)
        live = p < n_pieces
        block = tl.where(live, tl.gather(hpos, slot, 0), n_flat)
        safe = tl.where(live, block, 0)
        first = tl.load(PAIR_OFF + safe, mask=live, other=0).to(tl.int64) + (p - tl.gather(starts, slot, 0)) * span
        end = tl.minimum(tl.load(PAIR_OFF + safe + 1, mask=live, other=0).to(tl.int64), first + span)
        row = PIECES + p * 3
        in_table = p < max_pieces
        tl.store(row, block.to(PIECES.dtype.element_ty), mask=in_table)
        tl.store(row + 1, tl.where(live, first, 0).to(PIECES.dtype.element_ty), mask=in_table)
        tl.store(row + 2, tl.where(live, end, 0).to(PIECES.dtype.element_ty), mask=in_table)

    @triton.jit
    def _or_within_block(a1, bits1, a2, bits2):
        """tl.associative_scan's combine for a running OR of query bits restarted at each new block (the list is
        sorted by block, so a block's entries are contiguous and the scan is associative)."""
        return a2, tl.where(a1 == a2, bits1 | bits2, bits2)

    @triton.jit
    def _tile_union_kernel(IDX, DOCPOS, ENTRIES, HIGH_BITS, COUNTS, NPAST, Tq, Tk, q_off, n_tiles,
                           HKV: tl.constexpr, LB: tl.constexpr, N_SEL: tl.constexpr, QPB: tl.constexpr,
                           LIST: tl.constexpr, QBITS: tl.constexpr, WORDS: tl.constexpr, WIDE: tl.constexpr):
        """The QPB x N_SEL block choices of a query tile as absolute first keys, sorted in registers, each
        distinct block kept once with which of the tile's queries chose it (bit q % 32 of int32 word q // 32):
        ENTRIES (int64) holds first key << 32 | word 0 for the distinct blocks ascending, then int32-max << 32,
        each of the QPB x N_SEL slots written once; HIGH_BITS words 1 .. WORDS-1 of the distinct blocks. Also
        the count of distinct blocks and how many of the first end at or before the tile's first valid query
        (no row needs the causal mask on those).
        The sort key packs (first key, query in tile) as first_key << QBITS | query (int64 if WIDE)."""
        pid_t = tl.program_id(0)
        pid_bg = tl.program_id(1).to(tl.int64)
        b = pid_bg // HKV
        e = tl.arange(0, LIST)  # (LIST,) entry = query in tile x N_SEL + slot
        qi = pid_t * QPB + e // N_SEL
        ok = (e < QPB * N_SEL) & (qi < Tq)
        j = tl.load(IDX + (pid_bg * Tq + qi) * N_SEL + e % N_SEL, mask=ok, other=-1)
        t_abs = q_off + qi
        pos = tl.load(DOCPOS + b * Tk + t_abs, mask=ok, other=-1)  # -1: padding, which never attends
        chose = ok & (j >= 0)
        if WIDE:
            none = tl.full([LIST], 2**63 - 1, tl.int64)
            key = (t_abs - pos + j * LB).to(tl.int64)
        else:
            none = tl.full([LIST], 2**31 - 1, tl.int32)
            key = (t_abs - pos + j * LB).to(tl.int32)
        key = tl.sort(tl.where(chose, (key << QBITS) | (e // N_SEL), none), 0)
        real = key != none
        a = tl.where(real, key >> QBITS, 2**31 - 1).to(tl.int32)  # (LIST,) block first keys, int32-max unused
        q_in_tile = (key & ((1 << QBITS) - 1)).to(tl.int32)
        prev = tl.gather(a, tl.maximum(e - 1, 0), 0)
        first = (e == 0) | (a != prev)  # the first entry of each distinct value, the unused ones' included
        last = (e == LIST - 1) | (a != tl.gather(a, tl.minimum(e + 1, LIST - 1), 0))
        rank = tl.cumsum(first.to(tl.int32), 0) - 1
        n_first = tl.sum(first.to(tl.int32), 0)
        rest = tl.cumsum((~first).to(tl.int32), 0) - 1
        slot = tl.where(first, rank, n_first + rest)  # a permutation of 0 .. LIST-1
        out = (pid_bg * n_tiles + pid_t) * (QPB * N_SEL)
        # each block's query bits: the OR over its entries, complete at its last entry, written from there
        for w in tl.static_range(WORDS):
            bits = tl.where(real & (q_in_tile // 32 == w), tl.full([LIST], 1, tl.int32) << (q_in_tile % 32), 0)
            _, bits = tl.associative_scan((a, bits), 0, _or_within_block)
            if w == 0:
                packed = (a.to(tl.int64) << 32) | (bits.to(tl.int64) & 0xFFFFFFFF)
                tl.store(ENTRIES + out + rank, packed, mask=last & real)
            else:
                tl.store(HIGH_BITS + (out + rank) * (WORDS - 1) + (w - 1), bits, mask=last & real)
        listed = first & real  # one entry per distinct block, at slots 0 .. count - 1
        # the slots past the distinct blocks (n_first + rest, and the unused run's rank) hold the unused entry
        none_entry = tl.full([LIST], (2**31 - 1) << 32, tl.int64)
        tl.store(ENTRIES + out + slot, none_entry, mask=~listed & (slot < QPB * N_SEL))
        # the tile's first valid query (Tk if none): blocks whose last key is at or before it are seen whole
        t_first = tl.min(tl.where(ok & (pos >= 0), t_abs, Tk), 0)
        whole = listed & (a.to(tl.int64) + (LB - 1) <= t_first)
        tl.store(COUNTS + pid_bg * n_tiles + pid_t, tl.sum(listed.to(tl.int32), 0))
        tl.store(NPAST + pid_bg * n_tiles + pid_t, tl.sum(whole.to(tl.int32), 0))


# ----------------------------------------------------------------------------------------------
# Host-side launchers (static shapes, no host synchronization)
# ----------------------------------------------------------------------------------------------

def _union_query_bits(qpb: int) -> int:
    """Bits of a query's index within a tile of qpb queries (at least 1): _tile_union_kernel's QBITS."""
    return max(1, (qpb - 1).bit_length())


def _union_sort_keys_wide(num_keys: int, q_bits: int) -> bool:
    """Whether _tile_union_kernel must sort int64 keys: first_key << q_bits | query stays below int32's maximum,
    the unused entries' key, iff num_keys < 2**(31 - q_bits)."""
    return bool(_OVERRIDES.sel_union_wide_keys) or num_keys >= 2 ** (31 - q_bits)


def _tile_block_union(idx, doc_pos, qpb: int, sel_block_size: int):
    """The distinct selected blocks of each query tile (qpb consecutive queries) as absolute first keys,
    ascending, then padding, each with which of the tile's queries chose it. idx (B, Hkv, Tq, n') in-document
    block indices (-1 unused); doc_pos (B, Tk) with the queries its last Tq positions. Returns
    - entries (B, Hkv, n_tiles, qpb*n') int64: first key << 32 | the bits of the tile's queries 0-31 (bit q set
      where query q chose the block); int32-max << 32 past the distinct blocks;
    - high_bits (B, Hkv, n_tiles, qpb*n', ceil(qpb / 32) - 1) int32: word w - 1 holds queries 32w .. 32w+31
      (written at the distinct blocks only);
    - counts (B, Hkv, n_tiles) int32: distinct blocks;
    - n_past (B, Hkv, n_tiles) int32: how many of the first blocks end at or before every query of the tile, so
      no row needs the causal mask there (the mask on every block took the selected forward 29% and the fused dQ
      14% longer at 64k: the 2026-11-25 H100 sweep, bench/KERNELS.md).
    One kernel launch (a sort in registers per tile; two segmented torch sorts took 0.75 ms of the op at 2k x 32
    on the H100), static shapes, no host synchronization. Memory: 8 + 4 (ceil(qpb / 32) - 1) bytes per slot where
    the int32 list took 4 (24 at the 128-query dQ tiles of G = 1); built before the kernels' outputs, below the
    backward's peak at the 125M and fla layouts (bench/memory_cpu.py)."""
    batch, num_kv, num_q, n_sel = idx.shape
    num_keys = doc_pos.shape[1]
    n_tiles = _cdiv(num_q, qpb)
    q_bits = _union_query_bits(qpb)
    words = _cdiv(qpb, 32)
    entries = torch.empty(batch, num_kv, n_tiles, qpb * n_sel, device=idx.device, dtype=torch.int64)
    high_bits = torch.empty(batch, num_kv, n_tiles, qpb * n_sel, words - 1, device=idx.device, dtype=torch.int32)
    counts = torch.empty(batch, num_kv, n_tiles, device=idx.device, dtype=torch.int32)
    n_past = torch.empty_like(counts)
    _tile_union_kernel[(n_tiles, batch * num_kv)](
        idx, doc_pos, entries, high_bits, counts, n_past, num_q, num_keys, num_keys - num_q, n_tiles,
        HKV=num_kv, LB=sel_block_size, N_SEL=n_sel, QPB=qpb, LIST=_next_pow2(qpb * n_sel), QBITS=q_bits,
        WORDS=words, WIDE=_union_sort_keys_wide(num_keys, q_bits), **_FP_FUSION,
    )
    return entries, high_bits, counts, n_past


def _sel_fwd(q, k, v, idx, doc_pos, params: NSAParams, scale):
    """The selected branch's output and base-2 log-sum-exp: the union walk over query tiles, or the block-outer
    schedule where launch_overrides(sel_fwd_pairs=True) asks for it (_sel_fwd_pairs)."""
    if _OVERRIDES.sel_fwd_pairs:
        return _sel_fwd_pairs(q, k, v, idx, doc_pos, params, scale)
    batch, num_q, num_heads, head_dim, num_keys, num_kv, group = _launch_shapes(q, k)
    o = torch.empty_like(q)
    lse = torch.empty(batch, num_q, num_heads, device=q.device, dtype=torch.float32)
    n_sel = idx.shape[-1]
    block_m, qpb = _sel_rows_per_program(group, head_dim)
    entries, high_bits, counts, n_past = _tile_block_union(idx, doc_pos, qpb, params.sel_block_size)
    _sel_fwd_kernel[(_cdiv(num_q, qpb), batch * num_kv)](
        q, k, v, entries, high_bits, counts, n_past, o, lse, num_q, num_keys, num_keys - num_q, counts.shape[-1],
        scale * _LOG2E,
        H=num_heads, HKV=num_kv, G=group, D=head_dim,
        LB=params.sel_block_size, N_SEL=n_sel, QPB=qpb, WORDS=high_bits.shape[-1] + 1, BLOCK_M=block_m,
        SUB_M=_sel_sub_tile(block_m, head_dim, q.device), LIGHT_FIRST=_query_tiles_light_first(),
        KV32=_kv_offsets_fit_int32(num_keys, num_kv, head_dim), **_sel_fwd_opts(head_dim, q.device), **_FP_FUSION,
    )
    return o, lse


def _sel_pair_index(idx, doc_pos, num_keys: int, sel_block_size: int, chunk_q: int):
    """The (query, block) pairs of idx (B, Hkv, Tq, n') sorted by (query chunk of chunk_q queries, batch x KV head,
    block first key); stable, so a block's queries come in increasing order. Returns (sorted keys, each pair's flat
    index in idx, the chunks' pair offsets (n_chunks + 1,), n_chunks, the sentinel key of unused slots: above every
    pair's, n_chunks x B x Hkv x Tk). int32 keys and indices where they fit; built
    at the forward's or backward's peak, so temporaries are dropped early. Static shapes, no host synchronization."""
    batch, num_kv, num_q, _ = idx.shape
    n_bg = batch * num_kv
    q_off = num_keys - num_q
    n_chunks = _cdiv(num_q, chunk_q)
    sentinel = n_chunks * n_bg * num_keys  # above every pair's key: unused slots sort last
    key_dtype = torch.int32 if sentinel < 2**31 - 1 else torch.int64
    key = torch.empty(idx.numel(), device=idx.device, dtype=key_dtype)
    block = 1024
    _sel_pair_key_kernel[(_cdiv(max(idx.numel(), 1), block),)](
        idx, doc_pos, key, num_q, num_keys, q_off, chunk_q, n_bg, sentinel, idx.numel(), HKV=num_kv,
        N_SEL=idx.shape[-1], LB=sel_block_size, BLOCK=block, num_warps=4, **_FP_FUSION,
    )
    sorted_key, order = torch.sort(key, stable=True)
    del key
    order = order.to(torch.int32 if order.numel() < 2**31 - 1 else torch.int64)
    chunk_off = torch.searchsorted(
        sorted_key, torch.arange(n_chunks + 1, device=idx.device, dtype=key_dtype) * (n_bg * num_keys))
    return sorted_key, order, chunk_off, n_chunks, sentinel


def _sel_pair_plan(q, k, idx, doc_pos, params: NSAParams, q_sizes: float, dq: bool = False):
    """What both block-outer launchers set up: the query chunks (partials within q_sizes times q's size), the pair
    index, the pair tiles' launch and the kernels' shared meta-parameters. Returns (chunk_q, sorted keys, pair
    order, chunk offsets, n_chunks, programs per chunk, partial rows per chunk, meta, qpb)."""
    batch, num_q, num_heads, head_dim, num_keys, num_kv, group = _launch_shapes(q, k)
    n_sel = idx.shape[-1]
    n_bg = batch * num_kv
    chunk_q = _sel_fwd_pair_queries(num_q, n_sel, head_dim, q.element_size(), q_sizes)
    sorted_key, order, chunk_off, n_chunks, _ = _sel_pair_index(idx, doc_pos, num_keys, params.sel_block_size,
                                                                chunk_q)
    block_m, qpb, pairs, opts = _sel_fwd_pairs_launch(group, head_dim, q.device, dq)
    n_programs = _cdiv(chunk_q * n_bg * n_sel, pairs)  # a chunk's pairs at most
    meta = dict(H=num_heads, HKV=num_kv, G=group, D=head_dim, N_SEL=n_sel, QPB=qpb, BLOCK_M=block_m)
    tile = dict(LB=params.sel_block_size, PAIRS=pairs, **opts)
    return chunk_q, sorted_key, order, chunk_off, n_chunks, n_programs, n_bg * chunk_q * n_sel * group, meta, tile


def _sel_fwd_pairs(q, k, v, idx, doc_pos, params: NSAParams, scale):
    """The selected forward over (query, block) pairs (launch_overrides(sel_fwd_pairs=True); the kernels' comment
    says when it pays): per chunk of queries, one pass over the chunk's pairs sorted by block, then the combine.
    Static shapes, no host synchronization. Returns (o (B, Tq, H, D), lse (B, Tq, H) base 2, +inf where none)."""
    batch, num_q, num_heads, head_dim, num_keys, num_kv, _ = _launch_shapes(q, k)
    n_bg = batch * num_kv
    o = torch.empty_like(q)
    lse = torch.empty(batch, num_q, num_heads, device=q.device, dtype=torch.float32)
    chunk_q, sorted_key, order, chunk_off, n_chunks, n_programs, partial_rows, meta, tile = _sel_pair_plan(
        q, k, idx, doc_pos, params, q_sizes=2.0)  # (the forward's partials live below the backward's peak)
    o_part = torch.empty(partial_rows, head_dim, device=q.device, dtype=q.dtype)
    l_part = torch.empty(partial_rows, device=q.device, dtype=torch.float32)
    for chunk in range(n_chunks):
        c0 = chunk * chunk_q
        _sel_fwd_pairs_kernel[(n_programs,)](
            q, k, v, sorted_key, order, chunk_off, o_part, l_part,
            chunk, c0, chunk_q, n_bg, num_q, num_keys, num_keys - num_q, scale * _LOG2E, **meta, **tile,
            **_FP_FUSION,
        )
        _sel_fwd_pairs_combine_kernel[(_cdiv(min(chunk_q, num_q - c0), meta["QPB"]), n_bg)](
            idx, o_part, l_part, o, lse, c0, chunk_q, num_q, N_PAD=_next_pow2(meta["N_SEL"]), num_warps=4, **meta,
            **_FP_FUSION,
        )
    return o, lse


def _sel_dq_pairs(q, k, v, idx, doc_pos, do, lse_g, delta, dq_intervals, params: NSAParams, scale, reduce):
    """dQ in fp32, in dq_intervals' storage (a _FloatDq): the interval branches' dQ plus the selected branch's,
    formed pair by pair (launch_overrides(sel_dq_pairs=True)): per chunk of queries (as the block-outer forward's),
    _sel_dq_pairs_kernel stores each pair's share at its (query, slot), then `reduce(partials, idx, dq_intervals,
    dq_intervals, c0, chunk_q)` (nsa_triton_dq._sel_dq_reduce_chunk) adds a query's shares to its interval dQ in
    place, in slot order (deterministic; a program reads and writes its own rows: no third q-sized buffer)."""
    batch, num_q, _, head_dim, num_keys, num_kv, _ = _launch_shapes(q, k)
    chunk_q, sorted_key, order, chunk_off, n_chunks, n_programs, partial_rows, meta, tile = _sel_pair_plan(
        q, k, idx, doc_pos, params, q_sizes=1.0, dq=True)  # (these partials add to the backward's peak)
    partials = torch.empty(partial_rows, head_dim, device=q.device, dtype=q.dtype)
    for chunk in range(n_chunks):
        c0 = chunk * chunk_q
        _sel_dq_pairs_kernel[(n_programs,)](
            q, k, v, do, lse_g, delta, sorted_key, order, chunk_off, partials,
            chunk, c0, chunk_q, batch * num_kv, num_q, num_keys, num_keys - num_q, scale * _LOG2E, scale,
            **meta, **tile, **_FP_FUSION,
        )
        reduce(partials, idx, dq_intervals, dq_intervals, c0, chunk_q)
    return dq_intervals


def _sel_heavy_split(qpb: int) -> tuple[int, int, int, int]:
    """(heavy_min pairs, smallest piece in pairs, partial pieces, slots) of the selected dK/dV: the 256 heaviest
    blocks above 1,024 pairs (block 0 of a row holds a pair per query: every query's forced block) are cut into
    pieces of at least 32 pair tiles, into 1,024 fp32 partials in all (16 MiB each for dK and dV at head_dim 64,
    whatever the length). Chosen with bench/schedule_model.py (makespan over balanced time, random / correlated
    picks): 1.02-1.04 / 1.35-1.47x for blocks above 4,096 pairs and 512 slots, 1.06-1.08 / 1.17-1.26x here; the
    H100 timed the first kind only (bench/KERNELS.md, "2026-11-27, second H100 session"). launch_overrides(
    sel_pieces=...) forces other values."""
    return 1024, 32 * qpb, 1024, 256


def _sel_heavy_slots(cnt: torch.Tensor, heavy: torch.Tensor, n_heavy: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Which heavy blocks the selected dK/dV splits: the n_heavy heaviest (more than heavy_min pairs), heaviest
    first, so the heavy pass starts its longest programs first and a block left to the main pass (one program for
    all its pairs) is never heavier than a split one. Taking them in flat order instead left the second kv head's
    block 0 (every query's pair: 65,536 at 64k) unsplit once the first head's early blocks filled the slots: the
    kernel took 16 ms where 3.7 ms would do (H100, bench/KERNELS.md, "2026-11-27, second H100 session").
    Returns hpos (n_heavy,): the flat index of the h-th split block (n_flat where fewer are heavy), and slot_rank
    (n_flat,): 1 for a split block, n_heavy + 1 for a heavy block left to the main pass, 0 elsewhere (the kernel's
    SLOT_RANK: a block is the main pass's when it has pairs and is light or ranks past n_heavy). No host sync; ties go
    to the lower flat index (the key below is unique), so the split, and with it the summation order, is the same
    on every run. cnt * n_flat fits int64 for any input that fits memory (both factors below 2**31 there)."""
    n_flat = cnt.numel()
    flat = torch.arange(n_flat, device=cnt.device, dtype=torch.int64)
    top = torch.topk(cnt.long() * n_flat + (n_flat - 1 - flat), n_heavy, sorted=True).indices
    split = heavy[top]
    hpos = torch.where(split, top, n_flat).contiguous()
    slot_rank = torch.where(heavy, n_heavy + 1, 0)
    slot_rank[top] = torch.where(split, 1, slot_rank[top])
    return hpos, slot_rank.contiguous()


def _sel_heavy_pieces(cnt: torch.Tensor, pair_off: torch.Tensor, hpos: torch.Tensor, qpb: int, min_piece: int,
                      max_pieces: int, wide: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """How the split blocks (hpos, heaviest first; n_flat for an empty slot) are cut: every one into pieces of one
    size, a multiple of qpb (whole pair tiles) and at least min_piece, as small as keeps their pieces within
    max_pieces partials. With n slots and P pairs in the split blocks a piece of s >= P / (max_pieces - n) pairs
    needs sum(ceil(cnt / s)) <= P / s + n <= max_pieces pieces, so every split block fits (the launcher keeps n
    below max_pieces). Small pieces balance the heavy pass, which runs alone; a fixed count per block (16-64,
    until 2026-11-27) left correlated queries' many heavy blocks unsplit at 64k (bench/KERNELS.md, "2026-11-27,
    second H100 session"). On the device, no host sync. Returns pieces (max_pieces, 3), int32 (int64 where wide:
    2**31 pairs or flat blocks and more): each piece's block (flat index; n_flat, first = end = 0 past the last
    piece), first pair and end pair, in slot order; and piece_start (n + 1,): slot h's first piece (its last + 1 at
    h + 1), for the reduce. The oracle of _sel_heavy_plan's kernels (tests/triton_helpers.run_heavy_plan_case)."""
    n_flat, n_slots = cnt.numel(), hpos.numel()
    slot_cnt = torch.where(hpos < n_flat, cnt[hpos.clamp(max=n_flat - 1)], 0).long()  # (n,) pairs per split block
    span = torch.clamp(_cdiv_tensor(slot_cnt.sum(), max_pieces - n_slots), min=min_piece)
    span = _cdiv_tensor(span, qpb) * qpb  # (,) pairs per piece
    ends = torch.cumsum(_cdiv_tensor(slot_cnt, span), 0)  # (n,) each slot's pieces end here
    piece_start = torch.cat([ends.new_zeros(1), ends])
    piece = torch.arange(max_pieces, device=cnt.device, dtype=torch.int64)
    slot = torch.searchsorted(ends, piece, right=True).clamp(max=n_slots - 1)  # (max_pieces,) the piece's slot
    live = piece < ends[-1]
    block = torch.where(live, hpos[slot], n_flat)
    first = torch.where(live, pair_off[block.clamp(max=n_flat - 1)] + (piece - piece_start[slot]) * span, 0)
    end = torch.where(live, torch.minimum(pair_off[block.clamp(max=n_flat - 1) + 1], first + span), 0)
    # int32 where every value fits (fewer live registers in the heavy pass's tile loop: its int64 pair range spilled
    # one register there on sm_90 at the 125M layout), int64 from 2**31 pairs or flat blocks on
    pieces = torch.stack([block, first, end], 1).to(torch.int64 if wide else torch.int32)
    return pieces.contiguous(), piece_start.contiguous()


def _sel_heavy_plan(pair_off: torch.Tensor, n_flat: int, n_heavy: int, heavy_min: int, qpb: int, min_piece: int,
                    max_pieces: int, wide: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The selected dK/dV's slots and pieces in three launches (keys, topk, pieces): hpos (n_heavy,), slot_rank
    (n_flat,) int32, pieces (max_pieces, 3) and piece_start (n_heavy + 1,), as _sel_heavy_slots and
    _sel_heavy_pieces (the oracles, pure torch) give them."""
    device = pair_off.device
    key = torch.empty(n_flat, device=device, dtype=torch.int64)
    slot_rank = torch.empty(n_flat, device=device, dtype=torch.int32)
    block = 1024
    _sel_heavy_keys_kernel[(_cdiv(n_flat, block),)](pair_off, key, slot_rank, n_flat, heavy_min, n_heavy + 1,
                                                    BLOCK=block, num_warps=4, **_FP_FUSION)
    top = torch.topk(key, n_heavy, sorted=True).indices
    hpos = torch.empty(n_heavy, device=device, dtype=torch.int64)
    pieces = torch.empty(max_pieces, 3, device=device, dtype=torch.int64 if wide else torch.int32)
    piece_start = torch.empty(n_heavy + 1, device=device, dtype=torch.int64)
    slots = _next_pow2(n_heavy)
    _sel_heavy_pieces_kernel[(1,)](top, pair_off, slot_rank, hpos, pieces, piece_start, n_flat, n_heavy, heavy_min,
                                   min_piece, max_pieces, QPB=qpb, SLOTS=slots, PBLOCK=_next_pow2(max_pieces),
                                   STEPS=max(1, slots.bit_length()), num_warps=4, **_FP_FUSION)
    return hpos, slot_rank, pieces, piece_start


def _cdiv_tensor(a: torch.Tensor, b) -> torch.Tensor:
    return torch.div(a + b - 1, b, rounding_mode="floor")


def _sel_bwd_dkdv(q, k, v, idx, doc_pos, do, lse_g, delta, params: NSAParams, scale, dq_accum=None):
    """dK, dV of the selected branch over the (block -> queries) index; lse_g, delta: the branch's gated
    log-sum-exp and delta (B, Tq, H) from the dQ kernel (_bwd_rows). dq_accum: the fp32 dQ (a _FloatDq) the
    kernel adds the branch's dQ to, pair by pair, with atomics (launch_overrides(sel_dq_in_dkdv=True)); None: dQ
    is left to the fused dQ kernel."""
    batch, num_q, num_heads, head_dim, num_keys, num_kv, group = _launch_shapes(q, k)
    n_sel = idx.shape[-1]
    lb = params.sel_block_size
    q_off = num_keys - num_q
    # Inverted index: (query, block) pairs sorted by (batch, kv head, block start), all queries in one chunk;
    # stable, so every block's queries come in increasing order and the accumulation order is fixed. Built at the
    # backward's memory peak (_sel_pair_index keeps int32 where it fits and drops its temporaries early).
    sorted_key, order, _, _, sentinel = _sel_pair_index(idx, doc_pos, num_keys, lb, num_q)  # one chunk: B x Hkv x Tk
    # each pair's query, and each (batch x kv head, block first key) value's first pair: one launch
    n_pairs = order.numel()
    pair_q = torch.empty(n_pairs, device=q.device, dtype=torch.int32)
    # int32 pair positions below 2**31 pairs (the selected dK/dV's pair ranges then take half the registers: at 255
    # on sm_90's 125M layout its int64 ones spilled), int64 above
    wide_pairs = n_pairs >= 2**31 or bool(_OVERRIDES.sel_pairs_int64)
    pair_off = torch.empty(sentinel + 1, device=q.device, dtype=torch.int64 if wide_pairs else torch.int32)
    block = 1024
    _sel_pair_offsets_kernel[(_cdiv(max(n_pairs, sentinel + 1), block),)](
        sorted_key, order, pair_q, pair_off, n_pairs, sentinel + 1, num_q, max(1, n_pairs.bit_length()),
        N_SEL=n_sel, BLOCK=block, num_warps=4, **_FP_FUSION,
    )
    del order, sorted_key
    dk = torch.zeros_like(k)
    dv = torch.zeros_like(v)
    dq_pairs = dq_accum is not None
    block_m, qpb, dkdv_opts = _dkdv_launch(group, head_dim, q.device, pair_dq=dq_pairs, selected=True)
    # Heavy blocks (more than heavy_min pairs) are cut into pieces written as fp32 partials (static shapes, no
    # sync): at most total pairs / (heavy_min + 1) blocks can be heavy, and the heaviest max_slots of them get a
    # slot (fewer than the pieces: _sel_heavy_pieces' bound); the main pass keeps the rest. Defaults:
    # _sel_heavy_split.
    heavy_min, min_piece, max_pieces, max_slots = _OVERRIDES.sel_pieces or _sel_heavy_split(qpb)
    if not 1 <= max_slots < max_pieces:
        raise ValueError(f"launch_overrides(sel_pieces=...): {max_slots} slots for {max_pieces} partial pieces; "
                         "the slots must be at least 1 and fewer than the pieces (each slot's block needs a piece)")
    n_flat = batch * num_kv * num_keys
    n_heavy = max(1, min(n_flat, max_slots, (batch * num_kv * num_q * n_sel) // (heavy_min + 1)))
    hpos, slot_rank, pieces, piece_start = _sel_heavy_plan(pair_off, n_flat, n_heavy, heavy_min, qpb, min_piece,
                                                           max_pieces, wide=wide_pairs or n_flat >= 2**31)
    pdk = torch.empty(max_pieces, lb, head_dim, device=q.device, dtype=torch.float32)
    pdv = torch.empty_like(pdk)
    # where the pairs' dQ shares go (DQ, DQ_HI, DQ_HALF: _dq_add); without them a pointer the kernel never reads
    dq_out = dq_accum if dq_pairs else _FloatDq(pdk, pdk, head_dim)
    args = (q, k, v, pair_off, pair_q, slot_rank, pieces, doc_pos, do, lse_g, delta, dk, dv, pdk, pdv,
            dq_out.lo, dq_out.hi, num_q, num_keys, q_off, scale * _LOG2E, scale, heavy_min, n_flat, n_heavy)
    meta = dict(H=num_heads, HKV=num_kv, G=group, D=head_dim, LB=lb, QPB=qpb, BLOCK_M=block_m,
                DQ_PAIRS=dq_pairs, DQ_HALF=dq_out.half,
                CH=_sel_dkdv_chunk_tiles(group, qpb, head_dim, q.device),
                ROW32=_rows_fit_int32(num_q, num_heads, head_dim), **dkdv_opts)
    # the order timed until 2026-11-27 (main pass with the key range fastest, then the heavy pass); also past
    # 65,535 key ranges (4M keys a row), the most a grid's second axis takes
    n_ranges = _cdiv(num_keys, lb)
    ranges_fast = bool(_OVERRIDES.sel_dkdv_ranges_first) or n_ranges > 65535
    heavy_launch = ((max_pieces, 1, 1), True)
    main_launch = ((n_ranges, batch * num_kv, 1) if ranges_fast else (batch * num_kv, n_ranges, 1), False)
    for grid, heavy_pass in (main_launch, heavy_launch) if ranges_fast else (heavy_launch, main_launch):
        _sel_bwd_dkdv_kernel[grid](*args, HEAVY_PASS=heavy_pass, RANGES_FAST=ranges_fast, **meta, **_FP_FUSION)
    _sel_dkdv_reduce_kernel[(n_heavy,)](
        pdk, pdv, hpos, piece_start, doc_pos, dk, dv, num_keys, n_flat, HKV=num_kv, D=head_dim, LB=lb, num_warps=4,
        **_FP_FUSION,
    )
    return dk, dv
