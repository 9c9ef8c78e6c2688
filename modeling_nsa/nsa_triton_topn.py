"""Top-n block selection (Eqs. 9-11): the scores of the selection blocks from the compression branch's
probabilities and a running top-n list per query, in one kernel per tile of queries; the list operations are
shared with the decode step's top-n.
"""

from __future__ import annotations

import torch

from .nsa_layout import NSAParams
from .nsa_triton_common import _LOG2E, _cdiv, _launch_shapes, _next_pow2
from .nsa_triton_launch import _OVERRIDES, _topn_chunk, _topn_head_lanes, _topn_insert_max, _topn_warps


try:  # the module must import where triton is missing (CPU-only installs, macOS)
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - exercised only without triton
    triton = tl = None


if triton is not None:
    from .nsa_triton_common import _load_lse

    # ------------------------------------------------------------------------------------------
    # Top-n block selection
    # ------------------------------------------------------------------------------------------

    @triton.jit
    def _topn_merge(top_v, top_i, prio, ci, N_SEL: tl.constexpr, N_PAD: tl.constexpr):
        """Merge a chunk (priorities prio (Q, BJ) of blocks ci (BJ,), all above the lists' indices) into
        each query's running top list (top_v, top_i) (Q, N_PAD), sorted by: a beats b iff v_a > v_b or
        (v_a == v_b and i_a < i_b). All in parallel: a list entry's new rank is its slot plus the chunk
        entries beating it; a chunk entry's rank counts the beaters in both; ranks >= N_SEL fall off."""
        slot = tl.arange(0, N_PAD)
        lv = top_v
        li = tl.where(top_i < 0, 1 << 30, top_i)
        cv = prio[:, None, :]  # chunk entries along the last axis
        c_beats_l = (cv > lv[:, :, None]) | ((cv == lv[:, :, None]) & (ci[None, None, :] < li[:, :, None]))
        rank_l = slot[None, :] + tl.sum(c_beats_l.to(tl.int32), 2)  # (Q, N_PAD)
        l_beats_c = (lv[:, None, :] > prio[:, :, None]) | (
            (lv[:, None, :] == prio[:, :, None]) & (li[:, None, :] < ci[None, :, None]))
        l_beats_c = l_beats_c & (slot[None, None, :] < N_SEL)
        c_beats_c = (cv > prio[:, :, None]) | ((cv == prio[:, :, None]) & (ci[None, None, :] < ci[None, :, None]))
        rank_c = tl.sum(l_beats_c.to(tl.int32), 2) + tl.sum(c_beats_c.to(tl.int32), 2)  # (Q, BJ)
        rank_l = tl.where(slot[None, :] < N_SEL, rank_l, 1 << 20)
        hit_l = rank_l[:, None, :] == slot[None, :, None]  # (Q, new slot, old slot)
        hit_c = rank_c[:, None, :] == slot[None, :, None]  # (Q, new slot, chunk entry)
        new_v = tl.maximum(tl.max(tl.where(hit_l, lv[:, None, :], float("-inf")), 2),
                           tl.max(tl.where(hit_c, cv, float("-inf")), 2))
        new_i = tl.maximum(tl.max(tl.where(hit_l, top_i[:, None, :], -1), 2),
                           tl.max(tl.where(hit_c, ci[None, None, :], -1), 2))
        return new_v, new_i

    @triton.jit
    def _topn_order_index(top_i, N_PAD: tl.constexpr):
        """The block index that breaks priority ties in a list (Q, N_PAD): the entry's own, and for a free slot
        (-1) a distinct stand-in above every block index, so free slots lose ties and stay distinct."""
        return tl.where(top_i < 0, (1 << 30) + tl.arange(0, N_PAD)[None, :], top_i)

    @triton.jit
    def _topn_worst(top_v, top_i, N_SEL: tl.constexpr, N_PAD: tl.constexpr):
        """Each query's worst kept entry of its (unsorted) list (Q, N_PAD): its priority (-inf while a slot is
        free) and its slot. Priority order: a beats b iff v_a > v_b or (v_a == v_b and i_a < i_b); free slots
        (-inf, -1) lose to every entry, and to each other by slot."""
        slot = tl.arange(0, N_PAD)
        kept = slot[None, :] < N_SEL
        li = _topn_order_index(top_i, N_PAD)
        v = tl.where(kept, top_v, float("inf"))
        worst_v = tl.min(v, 1)
        worst_li = tl.max(tl.where(kept & (v == worst_v[:, None]), li, -1), 1)
        worst_slot = tl.max(tl.where(kept & (li == worst_li[:, None]), slot[None, :], -1), 1)
        return worst_v, worst_slot

    @triton.jit
    def _topn_insert(top_v, top_i, prio, ci, N_SEL: tl.constexpr, N_PAD: tl.constexpr):
        """Insert each query's best chunk entry (prio (Q, BJ) of blocks ci, above the lists' indices) into its
        unsorted list (top_v, top_i) (Q, N_PAD) in place of the worst kept entry, if it beats it, and take it
        out of prio. A few (Q, N_PAD) and (Q, BJ) reductions: the cheap path when few entries of a chunk enter
        a list (the common case past the first blocks); the lists are sorted once at the end (_topn_sort)."""
        slot = tl.arange(0, N_PAD)
        best_v = tl.max(prio, 1)  # (Q,)
        best_i = tl.min(tl.where(prio == best_v[:, None], ci[None, :], 1 << 30), 1)  # lowest index first
        worst_v, worst_slot = _topn_worst(top_v, top_i, N_SEL, N_PAD)
        ins = best_v > worst_v  # the chunk's indices are above the list's, so a tie with the worst loses
        at = ins[:, None] & (slot[None, :] == worst_slot[:, None])
        top_v = tl.where(at, best_v[:, None], top_v)
        top_i = tl.where(at, best_i[:, None], top_i)
        prio = tl.where(ins[:, None] & (ci[None, :] == best_i[:, None]), float("-inf"), prio)
        return top_v, top_i, prio

    @triton.jit
    def _topn_sort(top_v, top_i, N_SEL: tl.constexpr, N_PAD: tl.constexpr):
        """The lists (Q, N_PAD) in priority order (see _topn_worst) in slots 0 .. N_SEL-1, free slots last:
        each kept entry's rank is the number of kept entries beating it."""
        slot = tl.arange(0, N_PAD)
        kept = slot < N_SEL
        li = _topn_order_index(top_i, N_PAD)
        beats = (top_v[:, :, None] > top_v[:, None, :]) | (
            (top_v[:, :, None] == top_v[:, None, :]) & (li[:, :, None] < li[:, None, :]))  # (Q, a, b): a beats b
        rank = tl.sum((beats & kept[None, :, None]).to(tl.int32), 1)  # (Q, N_PAD)
        rank = tl.where(kept[None, :], rank, 1 << 20)
        hit = rank[:, None, :] == slot[None, :, None]  # (Q, new slot, old slot)
        new_v = tl.max(tl.where(hit, top_v[:, None, :], float("-inf")), 2)
        new_i = tl.max(tl.where(hit, top_i[:, None, :], -1), 2)
        return new_v, new_i

    @triton.jit
    def _topn_chunk_update(ps, carry, top_v, top_i, j0, j_min, n_blocks, own,
                           L: tl.constexpr, DS: tl.constexpr, LB: tl.constexpr, N_SEL: tl.constexpr,
                           N_PAD: tl.constexpr, INIT: tl.constexpr, LOCAL: tl.constexpr, BJ: tl.constexpr,
                           QPB: tl.constexpr, INSERT_MAX: tl.constexpr):
        """Fold one chunk into QPB queries' running top-n lists (Eqs. 9-11). ps (QPB, BJ*R): compression
        probabilities of the in-document compressed tokens starting in blocks j0 .. j0+BJ-1, summed over
        each query's heads. A token starting at offset r*d in its block gives w0[r] = min(l' - r*d, l) / d
        to it and w1[r] = max(0, r*d + l - l') / d to the next (l <= l'); carry (QPB,) brings the previous
        chunk's last block's share. Only blocks j_min .. n_blocks-1 enter the lists (a decode program owns a
        block range, which it passes as j_min and n_blocks, and reads one block before it for the carry).
        Forced initial/local blocks get +inf. The lists are kept unsorted between chunks (the caller sorts
        them once, _topn_sort). A chunk whose entries enter no list is skipped; one where at most INSERT_MAX of
        a query's entries beat its worst kept entry inserts them one at a time (_topn_insert), else the lists
        are sorted and the chunk merged whole (_topn_merge); both keep the same entries.
        Returns (carry, top_v, top_i)."""
        R: tl.constexpr = LB // DS
        jb = tl.arange(0, BJ)
        rr = tl.arange(0, R) * DS
        w0 = (tl.minimum(LB - rr, L) // DS).to(tl.float32)  # (R,)
        w1 = (tl.maximum(rr + L - LB, 0) // DS).to(tl.float32)
        p3 = tl.reshape(ps, (QPB, BJ, R))
        to_own = tl.sum(p3 * w0[None, None, :], 2)  # (QPB, BJ)
        to_next = tl.sum(p3 * w1[None, None, :], 2)
        # block j receives to_next of block j - 1 (the previous chunk's last block for j = j0, through carry); an
        # in-register gather, where a (QPB, BJ, BJ) masked sum took about 2x the chunk's instructions (sm_90 SASS)
        prev = tl.broadcast_to(tl.maximum(jb - 1, 0)[None, :], (QPB, BJ))
        from_prev = tl.where(jb[None, :] > 0, tl.gather(to_next, prev, 1), 0.0)
        score = to_own + from_prev + tl.where(jb[None, :] == 0, carry[:, None], 0.0)
        carry = tl.sum(tl.where(jb[None, :] == BJ - 1, to_next, 0.0), 1)
        jj = (j0 + jb).to(tl.int32)
        elig = (jj[None, :] < n_blocks[:, None]) & (jj[None, :] >= j_min)
        local = (jj[None, :] > (own - LOCAL)[:, None]) & (jj[None, :] <= own[:, None])
        forced = elig & ((jj[None, :] < INIT) | local)
        prio = tl.where(elig, score, float("-inf"))
        prio = tl.where(forced, float("inf"), prio)
        worst = _topn_worst(top_v, top_i, N_SEL, N_PAD)[0]
        # chunk indices are above the lists' (blocks come in order), so a tie with the worst entry loses
        n_enter = tl.max(tl.sum((prio > worst[:, None]).to(tl.int32), 1), 0)  # most entries entering a list
        if INSERT_MAX >= BJ:  # at most BJ entries enter: every chunk inserts (no merge code compiled)
            if n_enter > 0:  # (the loop inside a branch: then Triton still software-pipelines the chunk loop)
                for _ in range(n_enter):
                    top_v, top_i, prio = _topn_insert(top_v, top_i, prio, jj, N_SEL, N_PAD)
        elif n_enter > INSERT_MAX:
            top_v, top_i = _topn_sort(top_v, top_i, N_SEL, N_PAD)  # the merge takes sorted lists
            top_v, top_i = _topn_merge(top_v, top_i, prio, jj, N_SEL, N_PAD)
        else:
            for _ in range(n_enter):
                top_v, top_i, prio = _topn_insert(top_v, top_i, prio, jj, N_SEL, N_PAD)
        return carry, top_v, top_i

    @triton.jit
    def _topn_row_query_head(r, G_PAD: tl.constexpr, HEAD_LANES: tl.constexpr):
        """(query, head) of each row r of a top-n tile of QPB queries x G_PAD heads. The order is chosen so the
        sum over a query's heads (_topn_head_sum) stays inside a warp and mostly inside a thread: in a dot's
        accumulator (wgmma, mma.sync) a warp holds 16 consecutive rows, a thread rows i and i + 8 (i = lane / 4).
        With HEAD_LANES = h > 0, row bit 3 (the thread's two rows) and the low log2(h) bits (lanes) hold the head,
        the other bits the query: the sum is one add in the thread and log2(h) shuffle rounds, where query-major
        rows (HEAD_LANES = 0, rows q * G_PAD + head) take log2(G_PAD) rounds on twice as many values."""
        if HEAD_LANES == 0:
            query = r // G_PAD
            head = r % G_PAD
        else:
            head = ((r // 8) % 2) * HEAD_LANES + r % HEAD_LANES
            query = (r // 16) * (8 // HEAD_LANES) + (r % 8) // HEAD_LANES  # 8 // HEAD_LANES queries per 8 lanes
        return query, head

    @triton.jit
    def _topn_head_sum(p, QPB: tl.constexpr, G_PAD: tl.constexpr, BC: tl.constexpr, HEAD_LANES: tl.constexpr):
        """p (QPB * G_PAD, BC) summed over each query's heads -> (QPB, BC), rows ordered by _topn_row_query_head."""
        if HEAD_LANES == 0:
            ps = tl.sum(tl.reshape(p, (QPB, G_PAD, BC)), 1)
        else:  # rows as (query hi, head hi, query lo, head lo)
            p5 = tl.reshape(p, (QPB // (8 // HEAD_LANES), 2, 8 // HEAD_LANES, HEAD_LANES, BC))
            ps = tl.reshape(tl.sum(tl.sum(p5, 3), 1), (QPB, BC))
        return ps

    @triton.jit
    def _topn_chunks(q, lse, kc_base, n_vis_rows, n_blocks, own, carry, top_v, top_i, j_from, j_to, sm_scale2,
                     D: tl.constexpr, HKV: tl.constexpr, L: tl.constexpr, DS: tl.constexpr, LB: tl.constexpr,
                     N_SEL: tl.constexpr, N_PAD: tl.constexpr, INIT: tl.constexpr, LOCAL: tl.constexpr,
                     BJ: tl.constexpr, QPB: tl.constexpr, G_PAD: tl.constexpr, INSERT_MAX: tl.constexpr,
                     HEAD_LANES: tl.constexpr, MASKED: tl.constexpr):
        """The chunks of blocks j_from, j_from + BJ, ... below j_to, folded into the lists (_topn_tile). Rows not
        taking part have lse = +inf, so their probabilities are exp2(-inf) = 0 without a mask. MASKED: tokens at
        or past a row's n_vis_rows are masked (the chunks at the end of the rows' visible tokens); otherwise every
        row sees every token of each chunk: no mask, no bounds on the loads."""
        R: tl.constexpr = LB // DS
        BC: tl.constexpr = BJ * R
        d = tl.arange(0, D)
        n_tok = tl.max(n_vis_rows, 0)  # (masked loads past the tokens any row sees)
        for j0 in range(j_from, j_to, BJ):
            ii = j0 * R + tl.arange(0, BC)  # in-document compressed tokens starting in the chunk's blocks
            kc_ptr = kc_base + ii.to(tl.int64)[:, None] * (HKV * D) + d[None, :]
            if MASKED:
                kc = tl.load(kc_ptr, mask=(ii < n_tok)[:, None], other=0.0)
                s = tl.dot(q, tl.trans(kc)) * sm_scale2  # (QPB*G_PAD, BC)
                p = tl.where(ii[None, :] < n_vis_rows[:, None], tl.exp2(s - lse[:, None]), 0.0)
            else:
                kc = tl.load(kc_ptr)
                p = tl.exp2(tl.dot(q, tl.trans(kc)) * sm_scale2 - lse[:, None])
            ps = _topn_head_sum(p, QPB, G_PAD, BC, HEAD_LANES)  # (QPB, BC): summed over the heads
            carry, top_v, top_i = _topn_chunk_update(ps, carry, top_v, top_i, j0, 0, n_blocks, own,
                                                     L, DS, LB, N_SEL, N_PAD, INIT, LOCAL, BJ, QPB, INSERT_MAX)
        return carry, top_v, top_i

    @triton.jit
    def _topn_tile(q, lse, row_ok, kc_base, n_vis_rows, pos, sm_scale2,
                   D: tl.constexpr, HKV: tl.constexpr, L: tl.constexpr, DS: tl.constexpr, LB: tl.constexpr,
                   N_SEL: tl.constexpr, N_PAD: tl.constexpr, INIT: tl.constexpr, LOCAL: tl.constexpr,
                   BJ: tl.constexpr, QPB: tl.constexpr, G_PAD: tl.constexpr, INSERT_MAX: tl.constexpr,
                   HEAD_LANES: tl.constexpr):
        """Top-n selection blocks of QPB queries of one document at in-document positions pos (QPB,); q/lse/
        row_ok hold their QPB x G_PAD rows in _topn_row_query_head's order (padded heads masked), with
        n_vis_rows visible compressed tokens per row from kc_base (the document's first). Streams over the
        blocks in chunks of BJ: one compressed-key tile per chunk serves every query and head (a tl.dot of all
        rows), and the probabilities exp2(s - lse) summed over each query's heads go to _topn_chunk_update.
        The chunks every row sees whole (all but the last one or two: a tile's queries are consecutive) run
        without masks, the rest masked (_topn_chunks). Returns (QPB, N_PAD) block indices by priority, -1 where
        unused."""
        R: tl.constexpr = LB // DS
        BC: tl.constexpr = BJ * R
        n_blocks = tl.where(pos >= 0, pos // LB + 1, 0).to(tl.int32)  # (QPB,) eligible blocks
        own = (pos // LB).to(tl.int32)
        top_v = tl.full([QPB, N_PAD], float("-inf"), tl.float32)
        top_i = tl.full([QPB, N_PAD], -1, tl.int32)
        carry = tl.zeros([QPB], tl.float32)
        live = row_ok & (n_vis_rows > 0)  # this pass's rows with keys (another document's rows may see more)
        lse = tl.where(live, lse, float("inf"))
        n_vis_rows = tl.where(live, n_vis_rows, 0)
        j_end = tl.max(n_blocks, 0)
        # the chunks of tokens every live row sees (none when no row is live): up to the fewest any live row sees
        n_seen_by_all = tl.min(tl.where(live, n_vis_rows, 1 << 30), 0)
        n_seen_by_all = tl.where(n_seen_by_all == 1 << 30, 0, n_seen_by_all)
        j_split = tl.minimum(n_seen_by_all // BC * BJ, tl.cdiv(j_end, BJ) * BJ)
        carry, top_v, top_i = _topn_chunks(q, lse, kc_base, n_vis_rows, n_blocks, own, carry, top_v, top_i, 0,
                                           j_split, sm_scale2, D, HKV, L, DS, LB, N_SEL, N_PAD, INIT, LOCAL, BJ,
                                           QPB, G_PAD, INSERT_MAX, HEAD_LANES, False)
        carry, top_v, top_i = _topn_chunks(q, lse, kc_base, n_vis_rows, n_blocks, own, carry, top_v, top_i,
                                           j_split, j_end, sm_scale2, D, HKV, L, DS, LB, N_SEL, N_PAD, INIT, LOCAL,
                                           BJ, QPB, G_PAD, INSERT_MAX, HEAD_LANES, True)
        top_v, top_i = _topn_sort(top_v, top_i, N_SEL, N_PAD)
        return tl.where(top_v > float("-inf"), top_i, -1)

    @triton.jit
    def _select_topn_kernel(
        Q, KC, LSE, DOCPOS, CLO, CHI, IDX,
        Tq, Tk, Nc, q_off, sm_scale2,
        H: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, G_PAD: tl.constexpr,
        L: tl.constexpr, DS: tl.constexpr, LB: tl.constexpr,
        N_SEL: tl.constexpr, N_PAD: tl.constexpr, INIT: tl.constexpr, LOCAL: tl.constexpr,
        BJ: tl.constexpr, QPB: tl.constexpr, INSERT_MAX: tl.constexpr, HEAD_LANES: tl.constexpr,
    ):
        """Top-n for a tile of QPB consecutive queries x G_PAD head rows of one KV group. A tile inside one
        document shares each compressed-key tile; a tile across a document boundary (rare) is done one
        query at a time (each pass masks the other queries' rows)."""
        pid_q = tl.program_id(0)
        pid_bg = tl.program_id(1)
        b = (pid_bg // HKV).to(tl.int64)
        g = pid_bg % HKV
        qq = tl.arange(0, QPB)
        tq = pid_q * QPB + qq  # (QPB,) queries
        tq_ok = tq < Tq
        tq = tl.where(tq_ok, tq, 0)
        pos = tl.load(DOCPOS + b * Tk + q_off + tq, mask=tq_ok, other=-1)
        c_lo = tl.load(CLO + b * Tq + tq, mask=tq_ok, other=0)
        start = q_off + tq - pos  # document start of each valid query
        # one document (or none: all padding) <=> the largest valid start is not above the smallest
        one_doc = tl.max(tl.where(pos >= 0, start, -1), 0) <= tl.min(tl.where(pos >= 0, start, 1 << 62), 0)
        r = tl.arange(0, QPB * G_PAD)
        rq, hh = _topn_row_query_head(r, G_PAD, HEAD_LANES)
        ti = pid_q * QPB + rq
        row_ok = (hh < G) & (ti < Tq)
        ti = tl.where(row_ok, ti, 0)
        d = tl.arange(0, D)
        row = (b * Tq + ti) * H + g * G + hh
        q = tl.load(Q + row[:, None] * D + d[None, :], mask=row_ok[:, None], other=0.0)
        lse = _load_lse(LSE, row, row_ok)
        n_vis_rows = tl.load(CHI + b * Tq + ti, mask=row_ok, other=0) - tl.load(CLO + b * Tq + ti, mask=row_ok, other=0)
        top = tl.full([QPB, N_PAD], -1, tl.int32)
        for i in range(tl.where(one_doc, 1, QPB)):
            mine = one_doc | (qq == i)  # (QPB,) the queries this pass decides
            c_lo_i = tl.where(one_doc, tl.max(c_lo, 0), tl.sum(tl.where(qq == i, c_lo, 0), 0))
            kc_base = KC + b * Nc * HKV * D + g * D + c_lo_i.to(tl.int64) * (HKV * D)
            rows_i = row_ok & (one_doc | (rq == i))
            res = _topn_tile(q, lse, rows_i, kc_base, n_vis_rows, pos, sm_scale2,
                             D, HKV, L, DS, LB, N_SEL, N_PAD, INIT, LOCAL, BJ, QPB, G_PAD, INSERT_MAX, HEAD_LANES)
            top = tl.where(mine[:, None], res, top)
        slot = tl.arange(0, N_PAD)
        out_ptr = IDX + (pid_bg.to(tl.int64) * Tq + tq)[:, None] * N_SEL + slot[None, :]
        tl.store(out_ptr, top, mask=tq_ok[:, None] & (slot < N_SEL)[None, :])


# ----------------------------------------------------------------------------------------------
# Host-side launchers (static shapes, no host synchronization)
# ----------------------------------------------------------------------------------------------

def _select_topn(q, k_cmp, lse_cmp, doc_pos, c_lo, c_hi, params: NSAParams, scale):
    batch, num_q, num_heads, head_dim, num_slots, num_kv, group = _launch_shapes(q, k_cmp)
    num_keys = doc_pos.shape[1]
    num_blocks = _cdiv(num_keys, params.sel_block_size)
    n_sel = min(params.sel_num_blocks, num_blocks)
    idx = torch.empty(batch, num_kv, num_q, n_sel, device=q.device, dtype=torch.int32)
    bj = _topn_chunk(params)
    g_pad = _next_pow2(group)
    rows = _OVERRIDES.topn_rows or 64
    qpb = max(1, min(16, rows // g_pad), 16 // g_pad)  # rows = qpb * g_pad (>= 16 for tl.dot), <= 16 queries
    _select_topn_kernel[(_cdiv(num_q, qpb), batch * num_kv)](
        q, k_cmp, lse_cmp, doc_pos, c_lo, c_hi, idx, num_q, num_keys, num_slots, num_keys - num_q, scale * _LOG2E,
        H=num_heads, HKV=num_kv, G=group, D=head_dim, G_PAD=g_pad,
        L=params.cmp_block_size, DS=params.cmp_stride, LB=params.sel_block_size,
        N_SEL=n_sel, N_PAD=_next_pow2(n_sel), INIT=params.sel_init_blocks, LOCAL=params.sel_local_blocks,
        BJ=bj, QPB=qpb, INSERT_MAX=_topn_insert_max(), HEAD_LANES=_topn_head_lanes(g_pad),
        num_warps=_topn_warps(q.device),
    )
    return idx
