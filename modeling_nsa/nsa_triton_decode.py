"""The cached decoding step (one query per row): the compressed keys split over programs, the selection blocks'
top-n per block range, then the selected and window branches and the gates, in one program per (row, KV group)
or, for a CUDA-graphed static cache, in parts side by side and a combine kernel.
"""

from __future__ import annotations

import dataclasses

import torch

from .nsa_layout import NSAParams
from .nsa_triton_common import (_FP_FUSION, _GRID_AXIS_MAX, _LOG2E, _cdiv, _launch_shapes, _next_pow2,
                                 on_the_inputs_device)
from .nsa_triton_launch import _decode_launch


try:  # the module must import where triton is missing (CPU-only installs, macOS)
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - exercised only without triton
    triton = tl = None


if triton is not None:
    from .nsa_triton_common import _branch_output, _gated_sum, _softmax_init, _softmax_tile
    from .nsa_triton_topn import (_topn_best, _topn_block_shares, _topn_blocks, _topn_key, _topn_priority,
                                     _KEY_MIN, _KEY_NEG_INF)

    # ------------------------------------------------------------------------------------------
    # Decoding: compressed keys split over programs, block ranges' top-n, then the branches and the gates (one
    # program per row and KV group, or parts side by side and their combination)
    # ------------------------------------------------------------------------------------------

    @triton.jit
    def _decode_query(TEND, Tk, STATIC: tl.constexpr):
        """Key index of the decoded query: the last of the Tk keys, or (STATIC: a static cache's buffers of Tk
        slots, written up to the query) TEND[0], read on the device so that a CUDA graph of the step replays
        for every token."""
        if STATIC:
            t = tl.load(TEND)
        else:
            t = Tk - 1
        return t

    @triton.jit
    def _after_previous_launch(PDL: tl.constexpr):
        """A decode kernel's first step. With PDL (a programmatic dependent launch, Hopper and datacenter
        Blackwell: the launch made with launch_pdl=True), this launch's programs are placed on the SMs while the
        launch before it in the stream still runs: wait here until that launch has ended and its writes are
        visible (every input read below may be its output, or an earlier launch's, which it waited for in turn),
        then let the next launch's programs be placed. A CUDA-graphed step is a chain of short launches; each link then starts without a
        launch's latency. Without PDL, nothing (the stream orders the launches)."""
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()

    @triton.jit
    def _decode_cmp_split_kernel(
        Q, KC, VC, CEND, DOCPOS, TEND, PM, PL, PACC, PP, PCNT,
        Tk, Nc, S, sm_scale2, kc_bs, vc_bs, ce_bs, dp_bs,
        H: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, G_PAD: tl.constexpr,
        CS: tl.constexpr, STATIC: tl.constexpr, PDL: tl.constexpr,
    ):
        """Decode, split s of the compressed slots [s*CS, (s+1)*CS) of one (row, KV group): the split's
        softmax partials (max m, sum l, unnormalized output acc), its probabilities exp2(x - m) per head and
        slot (the top-n rescales them once the log-sum-exp is known), and two counts: slots of earlier
        documents and visible slots. A slot is visible iff start <= cmp_end <= t (slots sorted by end).
        *_bs: batch strides (elements) of KC, VC, CEND, DOCPOS: the cache's buffers are views with room to grow.
        STATIC (a static cache's fixed-size buffers): the query is key TEND[0], not Tk - 1 (_decode_query)."""
        _after_previous_launch(PDL)
        pid_bg = tl.program_id(0)
        sp = tl.program_id(1)
        b, g, t, start, valid, hh, row, row_ok, q, d = _decode_rows(Q, DOCPOS, TEND, pid_bg, Tk, dp_bs, H, HKV, G, D,
                                                                     G_PAD, STATIC)
        start = tl.where(valid, start, Tk)  # a padded query sees nothing
        cc = sp * CS + tl.arange(0, CS)
        end = tl.load(CEND + b * ce_bs + cc, mask=cc < Nc, other=-1)
        vis = (end >= start) & (end <= t)
        kv_off = g * D + cc.to(tl.int64)[:, None] * (HKV * D) + d[None, :]
        k = tl.load(KC + b * kc_bs + kv_off, mask=vis[:, None], other=0.0)
        v = tl.load(VC + b * vc_bs + kv_off, mask=vis[:, None], other=0.0)
        x = tl.where(vis[None, :], tl.dot(q, tl.trans(k)) * sm_scale2, float("-inf"))  # (G_PAD, CS)
        m = tl.max(x, 1)
        p = tl.exp2(x - tl.where(m == float("-inf"), 0.0, m)[:, None])
        base = (pid_bg.to(tl.int64) * S + sp) * G_PAD + hh  # (G_PAD,) partial rows
        tl.store(PM + base, m)
        tl.store(PL + base, tl.sum(p, 1))
        tl.store(PACC + base[:, None] * D + d[None, :], tl.dot(p.to(v.dtype), v))
        # the G heads' probabilities only (the top-n reads no padded head's): at G = 6, 6 of the 16 rows' bytes, the
        # step's largest write at B = 32 (16.8 MB at 64k with the padded rows)
        tl.store(PP + base[:, None] * CS + tl.arange(0, CS)[None, :], p, mask=row_ok[:, None])
        cnt = (pid_bg.to(tl.int64) * S + sp) * 2
        tl.store(PCNT + cnt, tl.sum(((end >= 0) & (end < start)).to(tl.int32), 0))
        tl.store(PCNT + cnt + 1, tl.sum(vis.to(tl.int32), 0))

    @triton.jit
    def _merge_partials(PM, PL, PACC, PCNT, first, count, hh, d, G_PAD: tl.constexpr, D: tl.constexpr,
                        SB: tl.constexpr, WITH_ACC: tl.constexpr, COUNTS: tl.constexpr):
        """Online-softmax merge of `count` consecutive softmax partials (rows first*G_PAD + head of PM, PL, PACC),
        SB per vector load: per head the running max m and sum l and (WITH_ACC) the unnormalized output; with
        COUNTS (the compressed-key splits) also the two slot counts (slots of earlier documents = the document's
        first slot, visible slots)."""
        m_i, l_i, acc = _softmax_init(G_PAD, D)
        c_lo = tl.full([], 0, tl.int32)
        n_vis = tl.full([], 0, tl.int32)
        sb = tl.arange(0, SB)
        for s0 in range(0, count, SB):
            sp = s0 + sb
            ok = sp < count
            base = (first + sp)[:, None] * G_PAD + hh[None, :]  # (SB, G_PAD) partial rows
            m_s = tl.load(PM + base, mask=ok[:, None], other=float("-inf"))
            m_new = tl.maximum(m_i, tl.max(m_s, 0))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            a_old = tl.exp2(m_i - m_safe)
            a_s = tl.exp2(m_s - m_safe[None, :])  # 0 for empty partials (m_s = -inf)
            l_i = l_i * a_old + tl.sum(tl.load(PL + base, mask=ok[:, None], other=0.0) * a_s, 0)
            if WITH_ACC:
                p_acc = tl.load(PACC + base[:, :, None] * D + d[None, None, :], mask=ok[:, None, None], other=0.0)
                acc = acc * a_old[:, None] + tl.sum(p_acc * a_s[:, :, None], 0)
            m_i = m_new
            if COUNTS:
                cnt = (first + sp) * 2
                c_lo += tl.sum(tl.load(PCNT + cnt, mask=ok, other=0), 0)
                n_vis += tl.sum(tl.load(PCNT + cnt + 1, mask=ok, other=0), 0)
        return m_i, l_i, acc, c_lo, n_vis

    @triton.jit
    def _decode_token_probs(PP, PM, lse, pid_bg, S, c_lo, ii, tok_ok, hh, row_ok, G_PAD: tl.constexpr,
                            CS: tl.constexpr):
        """Compression probabilities exp2(x - lse) of the in-document compressed tokens ii (those with tok_ok)
        summed over the G heads, from the splits' stored exp2(x - m_split) (no key read again): (len(ii),)."""
        slot = (c_lo + ii).to(tl.int64)
        pbase = (pid_bg.to(tl.int64) * S + slot // CS)[None, :] * G_PAD + hh[:, None]  # (G_PAD, tokens)
        ok = row_ok[:, None] & tok_ok[None, :]
        p = tl.load(PP + pbase * CS + (slot % CS)[None, :], mask=ok, other=0.0)
        m_tok = tl.load(PM + pbase, mask=ok, other=0.0)
        return tl.sum(tl.where(ok, p * tl.exp2(m_tok - lse[:, None]), 0.0), 0)

    @triton.jit
    def _decode_topn_kernel(
        PM, PL, PACC, PP, PCNT, DOCPOS, TEND, TOPK,
        Tk, S, n_prog, dp_bs,
        HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, G_PAD: tl.constexpr,
        L: tl.constexpr, DS: tl.constexpr, LB: tl.constexpr,
        N_SEL: tl.constexpr, N_PAD: tl.constexpr, INIT: tl.constexpr, LOCAL: tl.constexpr,
        CS: tl.constexpr, SB: tl.constexpr, TB: tl.constexpr, TB_PAD: tl.constexpr, RC: tl.constexpr,
        STATIC: tl.constexpr, PDL: tl.constexpr,
    ):
        """Decode, program (row x KV group, j) of the selection blocks [j*TB, (j+1)*TB): their scores (Eqs. 9-10)
        from the splits' stored probabilities, summed over the G heads, and the range's top-n as N_PAD keys,
        best first (_topn_key; KEY_MIN past the eligible blocks), for the selected parts to merge. All of the
        range's blocks at once and one bitonic top-k (tl.topk), where a loop of chunks merged into a list took a
        chain of dependent reductions per chunk. Block ranges run in parallel: no program walks every block."""
        _after_previous_launch(PDL)
        pid_bg = tl.program_id(0)
        pj = tl.program_id(1)
        b = (pid_bg // HKV).to(tl.int64)
        t = _decode_query(TEND, Tk, STATIC)
        hh = tl.arange(0, G_PAD)
        row_ok = hh < G
        d = tl.arange(0, D)
        m_i, l_i, _, c_lo, n_vis = _merge_partials(PM, PL, PACC, PCNT, pid_bg.to(tl.int64) * S, S, hh, d, G_PAD, D,
                                                   SB, False, True)
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), 0.0)
        pos = tl.load(DOCPOS + b * dp_bs + t)
        n_blocks = tl.where(pos >= 0, pos // LB + 1, 0).to(tl.int32)
        own = (pos // LB).to(tl.int32)
        R: tl.constexpr = LB // DS  # compressed tokens starting in a block
        # each token's score to its block and the next (Eq. 9, _topn_block_shares); the range's tokens RC offsets at
        # a time, so a step holds at most TB_PAD x RC probabilities per head (RC = R at the defaults: one step)
        j_lo = pj * TB
        jb = tl.arange(0, TB_PAD)
        to_own = tl.zeros([TB_PAD], tl.float32)
        to_next = tl.zeros([TB_PAD], tl.float32)
        for r0 in tl.static_range(0, R, RC):
            rr = r0 + tl.arange(0, RC)
            ii = tl.reshape((j_lo + jb)[:, None] * R + rr[None, :], (TB_PAD * RC,))  # the range's tokens
            ps = _decode_token_probs(PP, PM, lse, pid_bg, S, c_lo, ii, ii < n_vis, hh, row_ok, G_PAD, CS)
            ps = tl.reshape(ps, (TB_PAD, RC))
            w0, w1 = _topn_block_shares(rr, L, DS, LB)
            to_own += tl.sum(ps * w0[None, :], 1)
            to_next += tl.sum(ps * w1[None, :], 1)
        rr = tl.arange(0, R)
        ii_prev = (j_lo - 1) * R + rr  # the block before the range: its share in block j_lo
        ps_prev = _decode_token_probs(PP, PM, lse, pid_bg, S, c_lo, ii_prev, (ii_prev >= 0) & (ii_prev < n_vis), hh,
                                      row_ok, G_PAD, CS)
        _, w1_prev = _topn_block_shares(rr, L, DS, LB)
        carry = tl.sum(ps_prev * w1_prev, 0)
        from_prev = tl.where(jb > 0, tl.gather(to_next, tl.maximum(jb - 1, 0), 0), carry)
        score = to_own + from_prev
        jj = (j_lo + jb).to(tl.int32)
        elig = (jb < TB) & (jj < n_blocks)
        keys = tl.where(elig, _topn_key(_topn_priority(score, jj, own, elig, INIT, LOCAL), jj), _KEY_MIN)
        top = _topn_best(keys, N_PAD)  # (N_PAD,) best first
        slot_n = tl.arange(0, N_PAD)
        out = (pid_bg.to(tl.int64) * n_prog + pj) * N_PAD + slot_n
        tl.store(TOPK + out, tl.where((slot_n < N_SEL) & (top > _KEY_NEG_INF), top, _KEY_MIN))

    @triton.jit
    def _group_rows(pid_bg, H: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
                    G_PAD: tl.constexpr):
        """A decode program's (row b, KV group g) and its G heads: (b, g, head index hh (G_PAD,), their rows of
        the (B * H) query/output rows, row_ok (hh < G), d = arange(D))."""
        b = (pid_bg // HKV).to(tl.int64)
        g = pid_bg % HKV
        hh = tl.arange(0, G_PAD)
        return b, g, hh, b * H + g * G + hh, hh < G, tl.arange(0, D)

    @triton.jit
    def _decode_rows(Q, DOCPOS, TEND, pid_bg, Tk, dp_bs, H: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr,
                     D: tl.constexpr, G_PAD: tl.constexpr, STATIC: tl.constexpr):
        """A decode program's query: _group_rows' (b, g, hh, row, row_ok, d) with the query's key index t, its
        document's first key (t + 1 for a padded query), valid (not padding) and q (G_PAD, D)."""
        b, g, hh, row, row_ok, d = _group_rows(pid_bg, H, HKV, G, D, G_PAD)
        t = _decode_query(TEND, Tk, STATIC)
        pos = tl.load(DOCPOS + b * dp_bs + t)
        q = tl.load(Q + row[:, None] * D + d[None, :], mask=row_ok[:, None], other=0.0)
        return b, g, t, t - pos, pos >= 0, hh, row, row_ok, q, d

    @triton.jit
    def _decode_attend(q, K, V, kv_off, vis, sm_scale2, m_i, l_i, acc):
        """One step of a decode branch: the keys at kv_off (those with vis) into the softmax state of q's heads."""
        k = tl.load(K + kv_off, mask=vis[:, None], other=0.0)
        v = tl.load(V + kv_off, mask=vis[:, None], other=0.0)
        x = tl.where(vis[None, :], tl.dot(q, tl.trans(k)), float("-inf"))
        return _softmax_tile(x, sm_scale2, v, m_i, l_i, acc)

    @triton.jit
    def _decode_selected(q, TOPK, KS, VS, pid_bg, b, g, t, start, n_prog, slot_lo, slot_hi, sm_scale2, ks_bs,
                         vs_bs, d, HKV: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, LB: tl.constexpr,
                         N_PAD: tl.constexpr, N_SEL: tl.constexpr, LISTS: tl.constexpr, SEL_STEP: tl.constexpr):
        """Selected attention over list slots [slot_lo, slot_hi) of the query's top-n, SEL_STEP blocks (SEL_STEP * l'
        keys up to t) per step, after merging the block ranges' lists of keys (_decode_topn_kernel) LISTS at a time
        (ranges are disjoint: every block once). Returns the softmax state (max, sum, unnormalized output) per
        head."""
        E: tl.constexpr = LISTS * N_PAD
        e = tl.arange(0, E)
        top = tl.full([N_PAD], _KEY_MIN, tl.int64)
        for l0 in range(0, n_prog, LISTS):
            keys = tl.load(TOPK + (pid_bg.to(tl.int64) * n_prog + l0) * N_PAD + e, mask=l0 + e // N_PAD < n_prog,
                           other=_KEY_MIN)
            # the step's best N_PAD keys, then the best N_PAD of those and the running list's (tl.topk: a bitonic
            # top-k, where a merge by ranks took (E, N_PAD) compares and a scatter: 6x the SASS per step on sm_90)
            both = tl.reshape(tl.join(top, _topn_best(keys, N_PAD)), (2 * N_PAD,))
            top = _topn_best(both, N_PAD)
        top_i = _topn_blocks(top)
        slot_n = tl.arange(0, N_PAD)
        kb = tl.arange(0, SEL_STEP * LB)
        m_i, l_i, acc = _softmax_init(G_PAD, D)
        for i0 in range(slot_lo, slot_hi, SEL_STEP):
            slot_k = i0 + kb // LB  # (SEL_STEP * LB,) list slot of each key
            j = tl.sum(tl.where(slot_k[:, None] == slot_n[None, :], top_i[None, :], 0), 1)  # the slot's block
            j = tl.where(slot_k < slot_hi, j, -1)  # -1 (also an unused slot's): nothing visible
            kk = tl.where(j >= 0, start + j.to(tl.int64) * LB, t + 1) + kb % LB
            vis = kk <= t
            kv_off = g * D + kk[:, None] * (HKV * D) + d[None, :]
            m_i, l_i, acc = _decode_attend(q, KS + b * ks_bs, VS + b * vs_bs, kv_off, vis, sm_scale2, m_i, l_i, acc)
        return m_i, l_i, acc

    @triton.jit
    def _decode_window(q, KW, VW, b, g, t, start, valid, Tk, Tw, i_from, i_count, sm_scale2, kw_bs, vw_bs, d,
                       HKV: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, WIN: tl.constexpr,
                       BLOCK_N: tl.constexpr, STATIC: tl.constexpr):
        """Window attention over i_count of the query's visible window keys, from the i_from-th, BLOCK_N per step.
        KW holds the Tw keys ending at t, key first_kept + i at slot i (STATIC, a ring: at slot (first_kept + i) %
        Tw); visible from max(start, t - w + 1). Returns the softmax state per head."""
        if STATIC:
            first_kept = t - Tw + 1
        else:
            first_kept = Tk - Tw
        w_lo = tl.maximum(tl.maximum(start, t - WIN + 1) - first_kept, 0).to(tl.int32)
        i_lo = w_lo + i_from
        i_hi = tl.minimum(i_lo + i_count, tl.where(valid, Tw, 0))
        kn = tl.arange(0, BLOCK_N)
        m_i, l_i, acc = _softmax_init(G_PAD, D)
        for i0 in range(i_lo, i_hi, BLOCK_N):
            ii = i0 + kn
            vis = ii < i_hi
            if STATIC:
                ii = (ii + first_kept) % Tw  # >= 0 where visible: first_kept + w_lo >= start >= 0
            kv_off = g * D + ii.to(tl.int64)[:, None] * (HKV * D) + d[None, :]
            m_i, l_i, acc = _decode_attend(q, KW + b * kw_bs, VW + b * vw_bs, kv_off, vis, sm_scale2, m_i, l_i, acc)
        return m_i, l_i, acc

    @triton.jit
    def _decode_finish_kernel(
        Q, PM, PL, PACC, PCNT, TOPK, KS, VS, KW, VW, GATE, DOCPOS, TEND, OUT,
        Tk, Tw, S, n_prog, sm_scale2, ks_bs, vs_bs, kw_bs, vw_bs, dp_bs,
        H: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, G_PAD: tl.constexpr,
        LB: tl.constexpr, N_SEL: tl.constexpr, N_PAD: tl.constexpr, WIN: tl.constexpr,
        SB: tl.constexpr, LISTS: tl.constexpr, SEL_STEP: tl.constexpr, BLOCK_N: tl.constexpr,
        STATIC: tl.constexpr, PDL: tl.constexpr,
    ):
        """Decode, one program per (row, KV group), rows = its G heads: merges the compressed-branch splits,
        then selected and window attention, and the gated sum. The third and last launch of an eager step, where
        every launch costs host time (eager decoding at small batch is host-bound: bench/KERNELS.md). At B = 1 it
        runs two programs whose chain of steps is what costs on the GPU: a CUDA-graphed step (a static cache)
        takes _decode_parts_kernel and _decode_combine_kernel instead. *_bs: batch strides (elements) of KS, VS, KW, VW, DOCPOS (views of the
        cache's buffers). STATIC: the query is key TEND[0] and KW/VW a ring of Tw slots (key p at slot p % Tw);
        otherwise KW/VW hold keys Tk - Tw .. Tk - 1."""
        _after_previous_launch(PDL)
        pid_bg = tl.program_id(0)
        b, g, t, start, valid, hh, row, row_ok, q, d = _decode_rows(Q, DOCPOS, TEND, pid_bg, Tk, dp_bs, H, HKV, G, D,
                                                                     G_PAD, STATIC)
        dtype: tl.constexpr = OUT.dtype.element_ty
        _, l_i, acc, _, _ = _merge_partials(PM, PL, PACC, PCNT, pid_bg.to(tl.int64) * S, S, hh, d, G_PAD, D, SB, True,
                                            False)  # (the slot counts are the top-n kernel's)
        o_cmp = _branch_output(acc, l_i, dtype)
        _, l_i, acc = _decode_selected(q, TOPK, KS, VS, pid_bg, b, g, t, start, n_prog, 0, N_SEL, sm_scale2,
                                       ks_bs, vs_bs, d, HKV, G_PAD, D, LB, N_PAD, N_SEL, LISTS, SEL_STEP)
        o_slc = _branch_output(acc, l_i, dtype)
        _, l_i, acc = _decode_window(q, KW, VW, b, g, t, start, valid, Tk, Tw, 0, Tw, sm_scale2, kw_bs, vw_bs, d,
                                     HKV, G_PAD, D, WIN, BLOCK_N, STATIC)
        o_win = _branch_output(acc, l_i, dtype)
        out = _gated_sum(GATE, row, row_ok, o_cmp, o_slc, o_win)
        tl.store(OUT + row[:, None] * D + d[None, :], out.to(dtype), mask=row_ok[:, None])

    @triton.jit
    def _decode_parts_kernel(
        Q, PM, PL, PACC, PCNT, TOPK, KS, VS, KW, VW, DOCPOS, TEND, OM, OL, OACC, ARRIVED, GATE, OUT,
        Tk, Tw, S, n_prog, n_parts, sm_scale2, ks_bs, vs_bs, kw_bs, vw_bs, dp_bs,
        H: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, G_PAD: tl.constexpr,
        LB: tl.constexpr, N_SEL: tl.constexpr, N_PAD: tl.constexpr, WIN: tl.constexpr,
        SB: tl.constexpr, LISTS: tl.constexpr, SEL_STEP: tl.constexpr, SEL_PART: tl.constexpr,
        SEL_PARTS: tl.constexpr, BLOCK_N: tl.constexpr, WIN_PART: tl.constexpr, STATIC: tl.constexpr,
        COMBINE: tl.constexpr, PB: tl.constexpr, PDL: tl.constexpr,
    ):
        """Decode, program (row x KV group, part): _decode_finish_kernel's work in parts that run side by side, for
        a CUDA-graphed step, where a launch costs microseconds and the finish kernel's chain of steps is what
        costs. Parts 0 .. SEL_PARTS - 1: SEL_PART of the n selected blocks (list slots); the next parts up to
        n_parts - 2: WIN_PART window keys each; the last part: the compressed branch's splits merged. Each writes
        its softmax partial (max, sum, unnormalized output per head) for _decode_combine_kernel, or (COMBINE) counts
        itself in ARRIVED[row x KV group] (zeros before the launch) and the last of a row's parts to arrive combines
        them (_combine_parts): one launch fewer in the step's chain, and no program waits for another."""
        _after_previous_launch(PDL)
        pid_bg = tl.program_id(0)
        part = tl.program_id(1)
        # (rows unused: a name reused by the branches below must keep one type, so not `_`)
        b, g, t, start, valid, hh, rows, rows_ok, q, d = _decode_rows(Q, DOCPOS, TEND, pid_bg, Tk, dp_bs, H, HKV, G, D,
                                                                     G_PAD, STATIC)
        if part < SEL_PARTS:
            slot_hi = tl.minimum(part * SEL_PART + SEL_PART, N_SEL)
            m_i, l_i, acc = _decode_selected(q, TOPK, KS, VS, pid_bg, b, g, t, start, n_prog, part * SEL_PART,
                                             slot_hi, sm_scale2, ks_bs, vs_bs, d, HKV, G_PAD, D, LB, N_PAD, N_SEL,
                                             LISTS, SEL_STEP)
        elif part < n_parts - 1:
            m_i, l_i, acc = _decode_window(q, KW, VW, b, g, t, start, valid, Tk, Tw, (part - SEL_PARTS) * WIN_PART,
                                           WIN_PART, sm_scale2, kw_bs, vw_bs, d, HKV, G_PAD, D, WIN, BLOCK_N, STATIC)
        else:
            m_i, l_i, acc, _, _ = _merge_partials(PM, PL, PACC, PCNT, pid_bg.to(tl.int64) * S, S, hh, d, G_PAD, D, SB,
                                                  True, False)
        base = (pid_bg.to(tl.int64) * n_parts + part) * G_PAD + hh  # (G_PAD,) partial rows
        tl.store(OM + base, m_i)
        tl.store(OL + base, l_i)
        tl.store(OACC + base[:, None] * D + d[None, :], acc)
        if COMBINE:
            # every thread's stores before the count (the barrier), the count a release and an acquire at the GPU's
            # scope: the part that sees n_parts - 1 earlier arrivals reads every part's partial
            tl.debug_barrier()
            if tl.atomic_add(ARRIVED + pid_bg, 1, sem="acq_rel", scope="gpu") == n_parts - 1:
                _combine_parts(OM, OL, OACC, GATE, OUT, pid_bg, n_parts, H, HKV, G, D, G_PAD, SEL_PARTS, PB)

    @triton.jit
    def _combine_parts(OM, OL, OACC, GATE, OUT, pid_bg, n_parts, H: tl.constexpr, HKV: tl.constexpr,
                       G: tl.constexpr, D: tl.constexpr, G_PAD: tl.constexpr, SEL_PARTS: tl.constexpr,
                       PB: tl.constexpr):
        """(Row, KV group) pid_bg's output: each branch's output from its parts' partials (selected: the first
        SEL_PARTS, window: the next, compressed: the last), PB parts per vector load, rounded to the output dtype
        as the training path stores them, and the gated sum (Eq. 5)."""
        _, _, hh, row, row_ok, d = _group_rows(pid_bg, H, HKV, G, D, G_PAD)
        dtype: tl.constexpr = OUT.dtype.element_ty
        first = pid_bg.to(tl.int64) * n_parts
        _, l_i, acc, _, _ = _merge_partials(OM, OL, OACC, OM, first, SEL_PARTS, hh, d, G_PAD, D, PB, True, False)
        o_slc = _branch_output(acc, l_i, dtype)
        _, l_i, acc, _, _ = _merge_partials(OM, OL, OACC, OM, first + SEL_PARTS, n_parts - 1 - SEL_PARTS, hh, d,
                                            G_PAD, D, PB, True, False)
        o_win = _branch_output(acc, l_i, dtype)
        _, l_i, acc, _, _ = _merge_partials(OM, OL, OACC, OM, first + n_parts - 1, 1, hh, d, G_PAD, D, PB, True,
                                            False)
        o_cmp = _branch_output(acc, l_i, dtype)
        out = _gated_sum(GATE, row, row_ok, o_cmp, o_slc, o_win)
        tl.store(OUT + row[:, None] * D + d[None, :], out.to(dtype), mask=row_ok[:, None])

    @triton.jit
    def _decode_combine_kernel(
        OM, OL, OACC, GATE, OUT, n_parts,
        H: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, G_PAD: tl.constexpr,
        SEL_PARTS: tl.constexpr, PB: tl.constexpr, PDL: tl.constexpr,
    ):
        """Decode, one program per (row, KV group): the parts' partials combined and gated (_combine_parts)."""
        _after_previous_launch(PDL)
        _combine_parts(OM, OL, OACC, GATE, OUT, tl.program_id(0), n_parts, H, HKV, G, D, G_PAD, SEL_PARTS, PB)


# ----------------------------------------------------------------------------------------------
# Host-side launchers (static shapes, no host synchronization)
# ----------------------------------------------------------------------------------------------

@on_the_inputs_device
def _decode_step(q, k_cmp, v_cmp, cmp_end, k_slc, v_slc, k_win, v_win, gates, doc_pos, params: NSAParams, scale,
                 query_end=None):
    """One query per row (Tq == 1), none of the launches with a long serial loop at long context: the
    compressed keys split over CS-slot programs (softmax partials and probabilities); the selection blocks
    split over TB-block programs (scores and a top-n list per range); then the branches and the gates. Those
    last take one program per (row, KV group) in an eager step (three launches: each costs host time, and eager
    decoding is host-bound at small batch), or, in a static cache's step (CUDA-graphed by generate()), parts
    side by side (a few selected blocks, a span of the window, the compressed splits' merge) and a combine
    kernel (four launches, a short chain of steps on the GPU).
    query_end (a static cache): the query's key index as a 1-element int64 tensor, read by the kernels; every
    grid then follows the buffers' fixed sizes, so the launches are the same at every token (CUDA graphs)."""
    batch, _, num_heads, head_dim, num_slots, num_kv, group = _launch_shapes(q, k_cmp)
    num_keys, num_win = k_slc.shape[1], k_win.shape[1]
    g_pad = max(16, _next_pow2(group))
    num_blocks = _cdiv(num_keys, params.sel_block_size)
    n_sel = min(params.sel_num_blocks, num_blocks)
    n_pad = _next_pow2(n_sel)
    static = query_end is not None
    launch = _decode_launch(head_dim, n_sel, params, static, q.device)
    split = launch.split
    n_split = max(1, _cdiv(num_slots, split))
    n_prog = _cdiv(num_blocks, launch.topn_blocks)
    rows = batch * num_kv * n_split * g_pad
    part_m = torch.empty(rows, device=q.device, dtype=torch.float32)
    part_l = torch.empty_like(part_m)
    part_acc = torch.empty(rows, head_dim, device=q.device, dtype=torch.float32)
    part_p = torch.empty(rows, split, device=q.device, dtype=torch.float32)
    counts = torch.empty(batch * num_kv * n_split, 2, device=q.device, dtype=torch.int32)
    top_keys = torch.empty(batch * num_kv * n_prog, n_pad, device=q.device, dtype=torch.int64)  # _topn_key's
    common = dict(HKV=num_kv, G=group, D=head_dim, G_PAD=g_pad)
    topn = dict(LB=params.sel_block_size, N_SEL=n_sel, N_PAD=n_pad)
    # window parts over the keys a query can see, at most w of them (_decode_window counts a part's keys from the
    # window's first visible one): a window cache sharing the selection keys (kv_per_branch False or "cmp") holds
    # every key, and parts over all of them would be idle past the first w (254 of 256 at 64k keys, w = 512)
    sel_parts, win_parts = _cdiv(n_sel, launch.sel_part), _cdiv(min(num_win, params.window_size), launch.win_part)
    n_parts = sel_parts + win_parts + 1  # the last: the compressed branch
    if launch.parts and n_parts > _GRID_AXIS_MAX:
        # past 65,535 parts (a window of millions of keys) a launch grid's second axis cannot hold them: the finish
        # kernel walks them, one program per row and KV group (the same result)
        launch = dataclasses.replace(launch, parts=False, fused_combine=False)
    query_end = query_end if static else doc_pos  # (unread without STATIC)
    # PDL: every launch below waits for the one before it on the device (_after_previous_launch), so the chain
    # holds only these kernels: the fused combine's count zeroed before the first
    pdl = dict(PDL=True, launch_pdl=True) if launch.pdl else dict(PDL=False)
    combine = launch.parts and launch.fused_combine
    # (row x KV group) parts arrived, for the part that arrives last to combine them (fused_combine; unread otherwise:
    # no memset launch on the default step)
    arrived = torch.zeros(batch * num_kv, device=q.device, dtype=torch.int32) if combine else counts
    _decode_cmp_split_kernel[(batch * num_kv, n_split)](
        q, k_cmp, v_cmp, cmp_end, doc_pos, query_end, part_m, part_l, part_acc, part_p, counts,
        num_keys, num_slots, n_split, scale * _LOG2E, k_cmp.stride(0), v_cmp.stride(0), cmp_end.stride(0),
        doc_pos.stride(0), H=num_heads, CS=split, STATIC=static, num_warps=4, **common, **pdl, **_FP_FUSION,
    )
    _decode_topn_kernel[(batch * num_kv, n_prog)](
        part_m, part_l, part_acc, part_p, counts, doc_pos, query_end, top_keys, num_keys, n_split, n_prog,
        doc_pos.stride(0),
        L=params.cmp_block_size, DS=params.cmp_stride, INIT=params.sel_init_blocks, LOCAL=params.sel_local_blocks,
        CS=split, SB=launch.topn_merge_splits, TB=launch.topn_blocks,
        # its TB blocks padded to a power of two, at least n (tl.topk takes k <= the length)
        TB_PAD=max(_next_pow2(launch.topn_blocks), n_pad), RC=launch.topn_offsets,
        STATIC=static, num_warps=launch.topn_warps, **common, **topn, **pdl, **_FP_FUSION,
    )
    out = torch.empty_like(q)
    common_last = dict(H=num_heads, WIN=params.window_size, SB=launch.part_splits, LISTS=launch.lists,
                       SEL_STEP=launch.sel_step, BLOCK_N=launch.win_tile, STATIC=static, num_warps=launch.num_warps,
                       **common, **topn)
    strides = (k_slc.stride(0), v_slc.stride(0), k_win.stride(0), v_win.stride(0), doc_pos.stride(0))
    if not launch.parts:
        _decode_finish_kernel[(batch * num_kv,)](
            q, part_m, part_l, part_acc, counts, top_keys, k_slc, v_slc, k_win, v_win, gates, doc_pos, query_end,
            out, num_keys, num_win, n_split, n_prog, scale * _LOG2E, *strides, **common_last, **pdl, **_FP_FUSION,
        )
        return out
    out_m = torch.empty(batch * num_kv * n_parts * g_pad, device=q.device, dtype=torch.float32)
    out_l = torch.empty_like(out_m)
    out_acc = torch.empty(out_m.shape[0], head_dim, device=q.device, dtype=torch.float32)
    pb = max(1, 256 // head_dim)  # parts per load in the combine: spill-free to head_dim 256
    # one stage: a part is one step by default (nothing to overlap), and the two branches' pipeline buffers would
    # not share shared memory (258 KiB on sm_90)
    _decode_parts_kernel[(batch * num_kv, n_parts)](
        q, part_m, part_l, part_acc, counts, top_keys, k_slc, v_slc, k_win, v_win, doc_pos, query_end,
        out_m, out_l, out_acc, arrived, gates, out, num_keys, num_win, n_split, n_prog, n_parts, scale * _LOG2E,
        *strides, SEL_PART=launch.sel_part, SEL_PARTS=sel_parts, WIN_PART=launch.win_part, COMBINE=combine, PB=pb,
        num_stages=1, **common_last, **pdl, **_FP_FUSION,
    )
    if not combine:
        _decode_combine_kernel[(batch * num_kv,)](
            out_m, out_l, out_acc, gates, out, n_parts, H=num_heads, SEL_PARTS=sel_parts, PB=pb, num_warps=4,
            **common, **pdl, **_FP_FUSION,
        )
    return out
