"""Naive NSA oracle, written from NSA_SPEC (not from nsa_reference.py).

A plain loop over rows, queries and heads in float64 on tiny shapes. Every rule of the spec is
spelled out where it is used: documents are recovered from `doc_pos` and checked, compressed
tokens are looked up by the key index of their last raw key, block importance uses the overlap
weights, selection sorts by (-score, j). Nothing here is vectorized over queries; it is slow on
purpose and only meant for T of a few hundred at most.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


# ----------------------------------------------------------------------------------------------
# Documents
# ----------------------------------------------------------------------------------------------


def doc_pos_from_segments(segments, total_len=None):
    """One row's doc_pos from a list of ("doc", L) / ("pad", L) segments. Returns a list of ints."""
    row = []
    for kind, length in segments:
        if kind == "doc":
            row.extend(range(length))
        elif kind == "pad":
            row.extend([-1] * length)
        else:
            raise ValueError(kind)
    if total_len is not None:
        assert len(row) == total_len, (len(row), total_len)
    return row


def _doc_start(doc_pos_row, index):
    """Start index of the document of the valid token at `index`; checks the positions are 0,1,2,..."""
    pos = int(doc_pos_row[index])
    assert pos >= 0
    start = index - pos
    assert start >= 0, "doc_pos runs past the row start"
    for k in range(pos + 1):
        assert int(doc_pos_row[start + k]) == k, "doc_pos is not 0,1,2,... inside a document"
    return start


def num_compressed(doc_len, l, d):
    """N_cmp(T) = max(0, floor((T - l)/d) + 1)."""
    if doc_len < l:
        return 0
    return (doc_len - l) // d + 1


def overlap_weight(i, j, l, d, block):
    """w_ij = |[i*d, i*d+l) ∩ [j*l', (j+1)*l')| / d, an integer."""
    lo = max(i * d, j * block)
    hi = min(i * d + l, (j + 1) * block)
    overlap = max(0, hi - lo)
    assert overlap % d == 0, (i, j, overlap, d)
    return overlap // d


def _softmax_attend(q_vec, keys, values, index, scale):
    """q_vec (D,); keys/values (N, D); index: list of rows to attend. Empty -> zero output, empty probs."""
    if len(index) == 0:
        return q_vec.new_zeros(q_vec.shape), q_vec.new_zeros(0)
    idx = torch.tensor(index, dtype=torch.long)
    k = keys[idx]  # (n, D)
    v = values[idx]
    scores = (k @ q_vec) * scale
    probs = torch.softmax(scores, dim=0)
    return probs @ v, probs


def select_blocks_naive(scores, t, params):
    """Set of selected block indices for in-document position t given per-block scores (list of floats).

    scores[j] is P_t^g[j] for eligible j (j*l' <= t). Forced: first `init`, last `local` up to t's own block.
    Others: highest score, ties to the lower index.
    """
    block = params.sel_block_size
    own = t // block
    eligible = list(range(own + 1))
    assert all(j * block <= t for j in eligible)
    if len(eligible) <= params.sel_num_blocks:
        return set(eligible)
    forced = {j for j in eligible if j < params.sel_init_blocks}
    forced |= {j for j in eligible if own - params.sel_local_blocks + 1 <= j <= own}
    rest = [j for j in eligible if j not in forced]
    rest.sort(key=lambda j: (-scores[j], j))
    budget = params.sel_num_blocks - len(forced)
    assert budget >= 0
    return forced | set(rest[:budget])


# ----------------------------------------------------------------------------------------------
# The attention function (same inputs as nsa_attention_reference)
# ----------------------------------------------------------------------------------------------


def naive_nsa_attention(
    q, k_cmp, v_cmp, cmp_end, k_slc, v_slc, k_win, v_win, gates, doc_pos, params, scale=None,
    return_block_indices=False, return_debug=False,
):
    """NSA_SPEC, one query and one head at a time.

    q (B, Tq, H, D): queries at the last Tq of Tk key positions. k_cmp/v_cmp (B, Nc, Hkv, D) with
    cmp_end (B, Nc) = key index of the last raw key of each compressed token (-1 empty slot).
    k_slc/v_slc (B, Tk, Hkv, D), k_win/v_win (B, Tw, Hkv, D) = last Tw key positions.
    gates (B, Tq, H, 3) already in (0, 1), order (cmp, slc, win). doc_pos (B, Tk), -1 = padding.

    Returns out (B, Tq, H, D) (zeros at padded queries) and, if asked, the selected blocks as
    blocks[b][kv_head][query] = sorted list of in-document block indices.
    """
    l, d, block = params.cmp_block_size, params.cmp_stride, params.sel_block_size
    B, Tq, H, D = q.shape
    Tk, Hkv = k_slc.shape[1], k_slc.shape[2]
    Tw = k_win.shape[1]
    G = H // Hkv
    assert G * Hkv == H
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    f64 = torch.float64
    qf, kcf, vcf = q.to(f64), k_cmp.to(f64), v_cmp.to(f64)
    ksf, vsf, kwf, vwf = k_slc.to(f64), v_slc.to(f64), k_win.to(f64), v_win.to(f64)
    gf = gates.to(f64)
    cmp_end_list = cmp_end.tolist()
    doc_pos_list = doc_pos.tolist()

    rows = []
    blocks_out = []
    debug = []
    for b in range(B):
        dp = doc_pos_list[b]
        slot_of_end = {}
        for slot, end in enumerate(cmp_end_list[b]):
            if end >= 0:
                assert end not in slot_of_end, f"two compressed slots end at key {end}"
                slot_of_end[end] = slot
        row_out = []
        row_blocks = [[None] * Tq for _ in range(Hkv)]
        for qi in range(Tq):
            ta = Tk - Tq + qi  # absolute key index of this query
            t = dp[ta]
            if t < 0:  # padding query: nothing to attend; outputs are not compared
                row_out.append(qf.new_zeros(H, D))
                for g in range(Hkv):
                    row_blocks[g][qi] = []
                continue
            start = _doc_start(dp, ta)
            # Compressed tokens of this document visible to t: i*d + l - 1 <= t.
            cmp_slots = []
            for i in range(num_compressed(t + 1, l, d)):
                end_abs = start + i * d + l - 1
                assert end_abs <= ta
                assert end_abs in slot_of_end, f"no compressed slot for token {i} of the document at {start}"
                cmp_slots.append(slot_of_end[end_abs])
            heads_out = []
            probs_per_head = []
            for h in range(H):
                g = h // G
                o_cmp, p = _softmax_attend(qf[b, qi, h], kcf[b, :, g], vcf[b, :, g], cmp_slots, scale)
                probs_per_head.append(p)
                heads_out.append(o_cmp)
            own = t // block
            o_slc_heads = [None] * H
            for g in range(Hkv):
                # Eq. 9 (overlap form) then Eq. 10 (sum of probabilities over the group's heads).
                scores = [0.0] * (own + 1)
                group_probs = [probs_per_head[h].detach().tolist() for h in range(g * G, (g + 1) * G)]
                for j in range(own + 1):
                    total = 0.0
                    for p in group_probs:
                        for i in range(len(cmp_slots)):
                            total += overlap_weight(i, j, l, d, block) * p[i]
                    scores[j] = total
                chosen = select_blocks_naive(scores, t, params)
                row_blocks[g][qi] = sorted(chosen)
                if return_debug:
                    debug.append(((b, g, qi), scores))
                key_pos = [s for j in sorted(chosen) for s in range(j * block, (j + 1) * block) if s <= t]
                for h in range(g * G, (g + 1) * G):
                    index = [start + s for s in key_pos]
                    o_slc_heads[h], _ = _softmax_attend(qf[b, qi, h], ksf[b, :, g], vsf[b, :, g], index, scale)
            outs = []
            for h in range(H):
                g = h // G
                win_pos = range(max(0, t - params.window_size + 1), t + 1)
                win_idx = [start + s - (Tk - Tw) for s in win_pos]
                assert all(0 <= i < Tw for i in win_idx), "window keys fall outside k_win"
                o_win, _ = _softmax_attend(qf[b, qi, h], kwf[b, :, g], vwf[b, :, g], win_idx, scale)
                gate = gf[b, qi, h]
                outs.append(gate[0] * heads_out[h] + gate[1] * o_slc_heads[h] + gate[2] * o_win)
            row_out.append(torch.stack(outs))
        rows.append(torch.stack(row_out))
        blocks_out.append(row_blocks)
    out = torch.stack(rows).to(q.dtype)
    result = (out,)
    if return_block_indices:
        result += (blocks_out,)
    if return_debug:
        result += (debug,)
    return result[0] if len(result) == 1 else result


def block_sets_from_reference(block_indices):
    """(B, Hkv, Tq, n') int tensor with -1 for unused -> blocks[b][g][q] = sorted list."""
    out = []
    for row in block_indices.tolist():
        out.append([[sorted(j for j in slots if j >= 0) for slots in per_head] for per_head in row])
    return out


# ----------------------------------------------------------------------------------------------
# RoPE, compressor, full layer
# ----------------------------------------------------------------------------------------------


def rope_naive(x, positions, theta, angle_dtype=torch.float32):
    """Rotate-half RoPE (Llama convention). x (..., D) with positions broadcastable to x[..., 0].

    Angles are computed in `angle_dtype`; float32 is transformers' convention (Llama computes
    inv_freq and the angles in float32 whatever the model dtype), which the model follows.
    """
    D = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    pos = torch.as_tensor(positions).to(angle_dtype)
    freqs = pos[..., None] * inv_freq.to(angle_dtype)  # (..., D/2)
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    x1, x2 = x[..., : D // 2], x[..., D // 2 :]
    rotated = torch.cat([-x2, x1], dim=-1)
    return x * cos + rotated * sin


def naive_compress(raw, cmp_end, doc_pos, params, kind, phi=None, rope_theta=None):
    """Compressed tokens for every non-empty slot of cmp_end, one slot at a time.

    raw (B, T, Hkv, D) un-rotated keys (or values); slot s covers raw keys (cmp_end-l, cmp_end].
    kind "mean": the average. kind "mlp": phi = dict(pos_emb (l, D), w1 (hidden, l*D), b1, w2 (D, hidden), b2):
    x = raw block + pos_emb, flattened in (position, dim) order, GELU MLP. kind "mean_mlp": the average plus
    kind "mlp"'s result (the average of the raw block, without pos_emb). If rope_theta is given the
    result is rotated at in-document position i*d + l - 1 (keys). Empty slots are zero.
    """
    l, d = params.cmp_block_size, params.cmp_stride
    B, T, Hkv, D = raw.shape
    N = cmp_end.shape[1]
    rows = []
    for b in range(B):
        slots = []
        for s in range(N):
            end = int(cmp_end[b, s])
            if end < 0:
                slots.append(raw.new_zeros(Hkv, D))
                continue
            first = end - l + 1
            pos_end = int(doc_pos[b, end])
            assert first >= 0 and pos_end >= l - 1 and (pos_end - (l - 1)) % d == 0
            assert int(doc_pos[b, first]) == pos_end - l + 1, "compressed token straddles documents"
            heads = []
            for g in range(Hkv):
                blk = raw[b, first : end + 1, g]  # (l, D)
                if kind not in ("mean", "mlp", "mean_mlp"):
                    raise ValueError(kind)
                c = blk.mean(0) if kind in ("mean", "mean_mlp") else 0.0
                if kind in ("mlp", "mean_mlp"):
                    x = (blk + phi["pos_emb"]).reshape(-1)
                    hdn = F.gelu(F.linear(x, phi["w1"], phi.get("b1")))
                    c = c + F.linear(hdn, phi["w2"], phi.get("b2"))
                if rope_theta is not None:
                    c = rope_naive(c, float(pos_end), rope_theta)
                heads.append(c)
            slots.append(torch.stack(heads))
        rows.append(torch.stack(slots))
    return torch.stack(rows)


def naive_dense_attention(q, k, v, doc_pos, scale=None):
    """Plain causal softmax(QK^T)V with GQA inside documents. q (B,T,H,D), k/v (B,T,Hkv,D)."""
    B, T, H, D = q.shape
    Hkv = k.shape[2]
    G = H // Hkv
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    dp = doc_pos.tolist()
    rows = []
    for b in range(B):
        per_t = []
        for t in range(T):
            if dp[b][t] < 0:
                per_t.append(q.new_zeros(H, D))
                continue
            start = _doc_start(dp[b], t)
            heads = []
            for h in range(H):
                g = h // G
                scores = (k[b, start : t + 1, g] @ q[b, t, h]) * scale
                heads.append(torch.softmax(scores, 0) @ v[b, start : t + 1, g])
            per_t.append(torch.stack(heads))
        rows.append(torch.stack(per_t))
    return torch.stack(rows)
