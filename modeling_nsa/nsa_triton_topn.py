"""Top-n block selection (Eqs. 9-11): the scores of the selection blocks from the compression branch's
probabilities and a running top-n list per query, in one kernel per tile of queries; the decode step's top-n
(nsa_triton_decode) takes the same int64 keys.
"""

from __future__ import annotations

import torch

from .nsa_layout import NSAParams
from .nsa_triton_common import _FP_FUSION, _LOG2E, _cdiv, _launch_shapes, _next_pow2
from .nsa_triton_launch import (_OVERRIDES, _query_tiles_light_first, _topn_chunk, _topn_head_lanes, _topn_insert_max,
                                _topn_opts)


try:  # the module must import where triton is missing (CPU-only installs, macOS)
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - exercised only without triton
    triton = tl = None


if triton is not None:
    from .nsa_triton_common import _load_lse, _query_tile_id

    # ------------------------------------------------------------------------------------------
    # Top-n block selection
    # ------------------------------------------------------------------------------------------

    # A list entry (priority v, block i) is one int64 key, so that "a beats b" (v_a > v_b, or v_a == v_b and
    # i_a < i_b: Eq. 11's top-n with ties to the lower block) is key_a > key_b. High 32 bits: v's float bits mapped
    # to an order-preserving int32; low 32 bits: 0x7FFFFFFF - i. Each list operation is then one reduction of
    # keys (an insertion was three dependent reductions of (v, i) pairs, a sort two compares per pair), and keys
    # are distinct wherever their blocks are: every rank below is exact.
    _KEY_MIN = tl.constexpr(-(2 ** 63))  # below every key: a removed chunk entry, a slot no rank reached
    _KEY_MAX = tl.constexpr(2 ** 63 - 1)
    # the largest key of priority -inf (block 0): keys above it are real entries; free slots and ineligible
    # blocks (-inf) lie at or below it
    _KEY_NEG_INF = tl.constexpr(-2139095041 * 2 ** 32 + 0x7FFFFFFF)

    @triton.jit
    def _topn_flip_negatives(bits):
        """A float's int32 bits with a negative one's magnitude bits flipped: float order becomes int32 order. Its
        own inverse (the sign bit is kept), so it maps keys' high halves back to float bits too."""
        return bits ^ ((bits >> 31) & 0x7FFFFFFF)

    @triton.jit
    def _topn_key(v, i):
        """The int64 key of priority v (fp32, not NaN) of block i (int32, 0 <= i < 2**31 - 1)."""
        order = _topn_flip_negatives((v + 0.0).to(tl.int32, bitcast=True))  # + 0.0: -0.0 -> +0.0 (equal floats)
        return (order.to(tl.int64) << 32) | (0x7FFFFFFF - i).to(tl.int64)

    @triton.jit
    def _topn_key_block(key):
        """The block of a key (its low 32 bits hold 0x7FFFFFFF - block)."""
        return 0x7FFFFFFF - key.to(tl.int32)

    @triton.jit
    def _topn_key_value(key):
        """The priority of a key (fp32)."""
        return _topn_flip_negatives((key >> 32).to(tl.int32)).to(tl.float32, bitcast=True)

    @triton.jit
    def _topn_empty(Q: tl.constexpr, N_PAD: tl.constexpr):
        """Q empty lists (Q, N_PAD): free slot s holds priority -inf and stand-in block 2**30 + s, so free slots lose
        to every entry, are distinct, and lose to each other by slot."""
        slot = tl.arange(0, N_PAD)
        return _topn_key(tl.full([Q, N_PAD], float("-inf"), tl.float32), (1 << 30) + slot[None, :])

    @triton.jit
    def _topn_blocks(top):
        """A list's blocks (int32), -1 for free slots and -inf entries."""
        return tl.where(top > _KEY_NEG_INF, _topn_key_block(top), -1)

    @triton.jit
    def _topn_best(keys, K: tl.constexpr):
        """The K largest keys along the last axis (..., M) -> (..., K), largest first: tl.topk (Triton's bitonic
        top-k), or for K = 1 a max (triton 3.6, the H100's, does not compile tl.topk with k = 1). Shared by the
        training top-n (lists (Q, N_PAD)) and the decode top-n (one list)."""
        if K == 1:
            best = tl.max(keys, len(keys.shape) - 1, keep_dims=True)
        else:
            best = tl.topk(keys, K)
        return best

    @triton.jit
    def _topn_merge(top, chunk, N_SEL: tl.constexpr, N_PAD: tl.constexpr, BJ: tl.constexpr):
        """Each query's best N_SEL of its list top (Q, N_PAD; any order) and a chunk of keys (Q, BJ), sorted, in slots
        0 .. N_SEL-1: one bitonic top-k of the list's kept entries beside the chunk's best N_PAD (the chunk padded
        with _KEY_MIN when shorter). Chunk keys must be distinct from the list's."""
        slot = tl.arange(0, N_PAD)
        kept = tl.where(slot[None, :] < N_SEL, top, _KEY_MIN)
        if BJ > N_PAD:
            best_chunk = _topn_best(chunk, N_PAD)
        elif BJ < N_PAD:
            columns = tl.broadcast_to((slot % BJ)[None, :], (chunk.shape[0], N_PAD))
            best_chunk = tl.where(slot[None, :] < BJ, tl.gather(chunk, columns, 1), _KEY_MIN)
        else:
            best_chunk = chunk
        both = tl.reshape(tl.join(kept, best_chunk), (chunk.shape[0], 2 * N_PAD))
        return _topn_best(both, N_PAD)  # (slots past N_SEL: the next entries, which no later step reads)

    @triton.jit
    def _topn_worst(top, N_SEL: tl.constexpr, N_PAD: tl.constexpr):
        """Each query's worst kept entry (Q,) of its (unsorted) list of keys (Q, N_PAD): a free slot while any."""
        kept = tl.arange(0, N_PAD)[None, :] < N_SEL
        return tl.min(tl.where(kept, top, _KEY_MAX), 1)

    @triton.jit
    def _topn_insert(top, chunk, N_SEL: tl.constexpr, N_PAD: tl.constexpr):
        """Insert each query's best chunk key (chunk (Q, BJ)) into its unsorted list top (Q, N_PAD) in place of the
        worst kept entry, if it beats that entry and its priority is not -inf, and take it out of the chunk. Two
        independent reductions: the cheap path when few entries of a chunk enter a list (the common case past
        the first blocks); the lists are sorted once at the end (_topn_sort)."""
        kept = tl.arange(0, N_PAD)[None, :] < N_SEL
        best = tl.max(chunk, 1)  # (Q,)
        worst = _topn_worst(top, N_SEL, N_PAD)
        ins = best > tl.maximum(worst, _KEY_NEG_INF)
        top = tl.where(ins[:, None] & kept & (top == worst[:, None]), best[:, None], top)
        chunk = tl.where(ins[:, None] & (chunk == best[:, None]), _KEY_MIN, chunk)
        return top, chunk

    @triton.jit
    def _topn_sort(top, N_SEL: tl.constexpr, N_PAD: tl.constexpr):
        """The lists of keys (Q, N_PAD) in priority order in slots 0 .. N_SEL-1 (slots past N_SEL: _KEY_MIN): a bitonic
        sort of the kept entries (keys are distinct, so the order is exact)."""
        kept = tl.where(tl.arange(0, N_PAD)[None, :] < N_SEL, top, _KEY_MIN)
        return _topn_best(kept, N_PAD)

    @triton.jit
    def _topn_block_shares(r, L: tl.constexpr, DS: tl.constexpr, LB: tl.constexpr):
        """Eq. 9's overlap weights of a compressed token starting at offset r*d of its selection block (r: int
        tensor): w0 = min(l' - r*d, l) / d to its own block and w1 = max(0, r*d + l - l') / d to the next (l <= l'),
        as fp32. Shared by the training and decode top-n."""
        w0 = (tl.minimum(LB - r * DS, L) // DS).to(tl.float32)
        w1 = (tl.maximum(r * DS + L - LB, 0) // DS).to(tl.float32)
        return w0, w1

    @triton.jit
    def _topn_priority(score, jj, own, elig, INIT: tl.constexpr, LOCAL: tl.constexpr):
        """Eq. 11's priorities of blocks jj (own: the query's own block, broadcast against jj): the score where
        eligible and not NaN (a NaN score never enters), +inf for the forced initial and local blocks, else -inf."""
        forced = elig & ((jj < INIT) | ((jj > own - LOCAL) & (jj <= own)))
        prio = tl.where(elig & (score == score), score, float("-inf"))
        return tl.where(forced, float("inf"), prio)

    @triton.jit
    def _topn_chunk_update(ps, carry, top, j0, n_blocks, own,
                           L: tl.constexpr, DS: tl.constexpr, LB: tl.constexpr, N_SEL: tl.constexpr,
                           N_PAD: tl.constexpr, INIT: tl.constexpr, LOCAL: tl.constexpr, BJ: tl.constexpr,
                           QPB: tl.constexpr, INSERT_MAX: tl.constexpr):
        """Fold one chunk into QPB queries' running top-n lists of keys top (QPB, N_PAD) (Eqs. 9-11). ps
        (QPB, BJ*R): compression probabilities of the in-document compressed tokens starting in blocks
        j0 .. j0+BJ-1, summed over each query's heads. A token starting at offset r*d in its block gives
        w0[r] = min(l' - r*d, l) / d to it and w1[r] = max(0, r*d + l - l') / d to the next (l <= l'); carry
        (QPB,) brings the previous chunk's last block's share. Only blocks below n_blocks enter the lists. Forced
        initial/local blocks get +inf. The lists are kept unsorted between chunks (the
        caller sorts them once, _topn_sort). The first chunk (j0 = 0, the lists empty) becomes the lists as it is
        where it fills them exactly (BJ = N_SEL = N_PAD: every query's blocks in one step, where inserting them
        took up to BJ steps). A later chunk whose entries enter no list is skipped; one where at most INSERT_MAX
        of a query's entries beat its worst kept entry inserts them one at a time (_topn_insert), else the chunk is
        merged whole (_topn_merge: one bitonic top-k); all keep the same entries. Returns (carry, top)."""
        R: tl.constexpr = LB // DS
        jb = tl.arange(0, BJ)
        w0, w1 = _topn_block_shares(tl.arange(0, R), L, DS, LB)  # (R,)
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
        prio = _topn_priority(score, jj[None, :], own[:, None], jj[None, :] < n_blocks[:, None], INIT, LOCAL)
        # entries above the worst kept one and above -inf enter; the chunk's blocks come after the lists' (a tie with
        # the worst loses), so the count compares priorities and the chunk's keys are formed only when one enters
        worst_v = _topn_key_value(tl.maximum(_topn_worst(top, N_SEL, N_PAD), _KEY_NEG_INF))  # (QPB,)
        n_enter = tl.max(tl.sum((prio > worst_v[:, None]).to(tl.int32), 1), 0)  # most entries entering a list
        if n_enter > 0:  # (the loops inside a branch: then Triton still software-pipelines the chunk loop)
            chunk = _topn_key(prio, tl.broadcast_to(jj[None, :], (QPB, BJ)))  # ineligible blocks: -inf keys
            if BJ == N_PAD and N_SEL == N_PAD:  # the first chunk fills the empty lists (its -inf entries stay free)
                first = j0 == 0
                top = tl.where(first & (chunk > _KEY_NEG_INF), chunk, top)
                n_enter = tl.where(first, 0, n_enter)
            if INSERT_MAX >= BJ:  # at most BJ entries enter: every chunk inserts (no merge code compiled)
                for _ in range(n_enter):
                    top, chunk = _topn_insert(top, chunk, N_SEL, N_PAD)
            elif n_enter > INSERT_MAX:
                top = _topn_merge(top, chunk, N_SEL, N_PAD, BJ)
            else:
                for _ in range(n_enter):
                    top, chunk = _topn_insert(top, chunk, N_SEL, N_PAD)
        return carry, top

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
    def _topn_chunks(q, lse, kc_base, n_vis_rows, n_blocks, own, carry, top, j_from, j_to, sm_scale2,
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
            carry, top = _topn_chunk_update(ps, carry, top, j0, n_blocks, own,
                                            L, DS, LB, N_SEL, N_PAD, INIT, LOCAL, BJ, QPB, INSERT_MAX)
        return carry, top

    @triton.jit
    def _topn_tile(q, lse, row_ok, kc_base, n_vis_rows, pos, sm_scale2,
                   D: tl.constexpr, HKV: tl.constexpr, L: tl.constexpr, DS: tl.constexpr, LB: tl.constexpr,
                   N_SEL: tl.constexpr, N_PAD: tl.constexpr, INIT: tl.constexpr, LOCAL: tl.constexpr,
                   BJ: tl.constexpr, QPB: tl.constexpr, G_PAD: tl.constexpr, INSERT_MAX: tl.constexpr,
                   HEAD_LANES: tl.constexpr):
        """Top-n selection blocks of QPB queries at in-document positions pos (QPB,), for the rows of one pass
        (row_ok: the queries whose documents' compressed tokens start at kc_base); q/lse/row_ok hold the QPB x G_PAD
        rows in _topn_row_query_head's order (padded heads masked), with n_vis_rows visible compressed tokens per
        row. Streams over the blocks in chunks of BJ: one compressed-key tile per chunk serves every query and head (a tl.dot of all
        rows), and the probabilities exp2(s - lse) summed over each query's heads go to _topn_chunk_update.
        The chunks every row sees whole (all but the last one or two: a tile's queries are consecutive) run
        without masks, the rest masked (_topn_chunks). Returns (QPB, N_PAD) block indices by priority, -1 where
        unused."""
        R: tl.constexpr = LB // DS
        BC: tl.constexpr = BJ * R
        n_blocks = tl.where(pos >= 0, pos // LB + 1, 0).to(tl.int32)  # (QPB,) eligible blocks
        own = (pos // LB).to(tl.int32)
        top = _topn_empty(QPB, N_PAD)
        carry = tl.zeros([QPB], tl.float32)
        live = row_ok & (n_vis_rows > 0)  # this pass's rows with keys (another document's rows may see more)
        lse = tl.where(live, lse, float("inf"))
        n_vis_rows = tl.where(live, n_vis_rows, 0)
        j_end = tl.max(n_blocks, 0)
        # the chunks of tokens every live row sees (none when no row is live): up to the fewest any live row sees
        n_seen_by_all = tl.min(tl.where(live, n_vis_rows, 1 << 30), 0)
        n_seen_by_all = tl.where(n_seen_by_all == 1 << 30, 0, n_seen_by_all)
        j_split = tl.minimum(n_seen_by_all // BC * BJ, tl.cdiv(j_end, BJ) * BJ)
        carry, top = _topn_chunks(q, lse, kc_base, n_vis_rows, n_blocks, own, carry, top, 0, j_split, sm_scale2,
                                  D, HKV, L, DS, LB, N_SEL, N_PAD, INIT, LOCAL, BJ, QPB, G_PAD, INSERT_MAX,
                                  HEAD_LANES, False)
        carry, top = _topn_chunks(q, lse, kc_base, n_vis_rows, n_blocks, own, carry, top, j_split, j_end,
                                  sm_scale2, D, HKV, L, DS, LB, N_SEL, N_PAD, INIT, LOCAL, BJ, QPB, G_PAD,
                                  INSERT_MAX, HEAD_LANES, True)
        return _topn_blocks(_topn_sort(top, N_SEL, N_PAD))

    @triton.jit
    def _select_topn_kernel(
        Q, KC, LSE, DOCPOS, CLO, CHI, IDX,
        Tq, Tk, Nc, q_off, sm_scale2,
        H: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, G_PAD: tl.constexpr,
        L: tl.constexpr, DS: tl.constexpr, LB: tl.constexpr,
        N_SEL: tl.constexpr, N_PAD: tl.constexpr, INIT: tl.constexpr, LOCAL: tl.constexpr,
        BJ: tl.constexpr, QPB: tl.constexpr, INSERT_MAX: tl.constexpr, HEAD_LANES: tl.constexpr,
        LIGHT_FIRST: tl.constexpr,
    ):
        """Top-n for a tile of QPB consecutive queries x G_PAD head rows of one KV group. A tile inside one
        document shares each compressed-key tile; a tile across document boundaries takes one pass per distinct
        first compressed slot (c_lo) of its queries' documents, each masking the other documents' rows (two passes
        at one boundary: a pass per query took QPB, 8 at the 125M layout, which short documents pay often)."""
        pid_q = _query_tile_id(LIGHT_FIRST)
        pid_bg = tl.program_id(1)
        b = (pid_bg // HKV).to(tl.int64)
        g = pid_bg % HKV
        qq = tl.arange(0, QPB)
        tq = pid_q * QPB + qq  # (QPB,) queries
        tq_ok = tq < Tq
        tq = tl.where(tq_ok, tq, 0)
        pos = tl.load(DOCPOS + b * Tk + q_off + tq, mask=tq_ok, other=-1)
        c_lo = tl.load(CLO + b * Tq + tq, mask=tq_ok, other=0)
        valid = pos >= 0  # (QPB,) not padding
        # the passes: the distinct c_lo of the valid queries (documents without compressed tokens share the next
        # one's c_lo and may share its pass: every pass reads keys from c_lo, the rest is per row); a query's value
        # counts once, at its first valid query, by a (QPB, QPB) compare (QPB <= 16)
        same_before = (c_lo[:, None] == c_lo[None, :]) & valid[None, :] & (qq[None, :] < qq[:, None])
        first_of_value = valid & (tl.sum(same_before.to(tl.int32), 1) == 0)
        n_passes = tl.sum(first_of_value.to(tl.int32), 0)  # 0 when every query is padding: their lists stay -1
        r = tl.arange(0, QPB * G_PAD)
        rq, hh = _topn_row_query_head(r, G_PAD, HEAD_LANES)
        ti = pid_q * QPB + rq
        row_ok = (hh < G) & (ti < Tq)
        ti = tl.where(row_ok, ti, 0)
        d = tl.arange(0, D)
        row = (b * Tq + ti) * H + g * G + hh
        q = tl.load(Q + row[:, None] * D + d[None, :], mask=row_ok[:, None], other=0.0)
        lse = _load_lse(LSE, row, row_ok)
        c_lo_rows = tl.load(CLO + b * Tq + ti, mask=row_ok, other=0)
        n_vis_rows = tl.load(CHI + b * Tq + ti, mask=row_ok, other=0) - c_lo_rows
        top = tl.full([QPB, N_PAD], -1, tl.int32)
        c_lo_i = tl.full([], -1, tl.int32)
        for _ in range(n_passes):  # the distinct c_lo in increasing order
            c_lo_i = tl.min(tl.where(valid & (c_lo > c_lo_i), c_lo, 2 ** 31 - 1), 0)
            mine = valid & (c_lo == c_lo_i)  # (QPB,) the queries this pass decides
            kc_base = KC + b * Nc * HKV * D + g * D + c_lo_i.to(tl.int64) * (HKV * D)
            rows_i = row_ok & (c_lo_rows == c_lo_i)  # (padding rows have no visible tokens: never live)
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
        LIGHT_FIRST=_query_tiles_light_first(),
        **_topn_opts(head_dim, q.device), **_FP_FUSION,
    )
    return idx
