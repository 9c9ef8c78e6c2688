"""Pure-PyTorch NSA, vectorized over every query at once: the CPU path and the kernels' oracle.

It computes exactly NSA_SPEC (paper §3): three branches on the same queries, each a softmax
attention under its own mask, gated per head. No loop whose length grows with the tokens,
queries or blocks: each branch builds a boolean (query x key) mask from the document layout and
runs a masked softmax over it. Memory is O(Tq x Tk) per head, which is what an oracle may spend;
the Triton path (nsa_triton.py) computes the same function in O(Tq x keys-touched).

Two forms of the masked softmax, one function: `reference_branches` writes the softmax out and
returns every branch's probabilities (what a diagnosis reads); `nsa_attention_reference`, the
CPU training path, needs only the outputs and hands each mask to F.scaled_dot_product_attention,
whose fused softmax keeps no (Tq x Tk) float tensor for the backward: on CPU about 3x faster per
branch, and the float memory of a training step falls from O(H x T^2) to the boolean masks.
The training form also leaves out keys a mask hides wholesale: the selected branch goes in a fixed
SELECTED_QUERY_CHUNKS chunks of queries, each over the keys up to its last query (causality hides
the rest), and where it at least halves the pairs the window branch goes as one batched call over
chunks of w queries by the 2w - 1 slots they can reach. The compressed branch's probabilities,
which the selection scores (Eqs. 8-10), are computed the written-out way in both forms, so both
select the same blocks.

Queries are the last Tq of the Tk key positions, so the same function serves training
(Tq = Tk), prefill and cached decoding (Tq = 1).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from .nsa_layout import NSAParams


# The training form gives the window branch in chunks (`_banded_window_output`: w queries by 2w - 1 slots each)
# where they cover at most this fraction of the (query, slot) pairs the full mask does (`_banding_pays`; at
# Tq = Tw = T from about 4w on); nearer, the chunks' gathers cost more than the pairs they leave out save.
BANDED_WINDOW_MAX_PAIR_FRACTION = 0.5


# The training form gives the selected branch in this many chunks of queries, each with the keys up to its last
# query (`_causal_chunks_output`): (c + 1) / 2c of the (query, key) pairs of one call, 0.56 at 8; more chunks
# save less and launch more.
SELECTED_QUERY_CHUNKS = 8


def _banding_pays(num_queries: int, num_win: int, window_size: int) -> bool:
    """Whether the banded window's (query, slot) pairs, the last chunk's padded queries included, are at most
    BANDED_WINDOW_MAX_PAIR_FRACTION of the Tq x Tw the full mask covers. At Tq = Tw = T: from T = 4w - 1 where T
    is a multiple of w, always from about 4.5w (the padding counts just past each multiple); never for a lone
    decoding query (its chunk is w queries)."""
    if num_queries == 0:
        return False
    chunked_pairs = -(-num_queries // window_size) * window_size * (2 * window_size - 1)
    return chunked_pairs <= BANDED_WINDOW_MAX_PAIR_FRACTION * num_queries * num_win


def _masked_softmax(q, k, mask, scale):
    """Softmax probabilities in fp32 (or fp64); rows with no visible key are 0, never NaN.

    q (B, Hkv, G, Tq, D), k (B, Hkv, Tk, D), mask (B, Hkv or 1, Tq, Tk) bool -> (B, Hkv, G, Tq, Tk).
    """
    scores = torch.einsum("bhgqd,bhkd->bhgqk", q, k) * scale
    scores = scores.masked_fill(~mask[:, :, None], float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    weights = torch.exp(scores - row_max)  # exp(-inf) = 0 at masked keys
    return weights / weights.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(weights.dtype).tiny)


def _masked_softmax_attention(q, k, v, mask, scale):
    """Softmax attention written out (`_masked_softmax`): q (B, Hkv, G, Tq, D), k/v (B, Hkv, Tk, D), mask
    (B, Hkv or 1, Tq, Tk) bool -> output (B, Hkv, G, Tq, D), probabilities (B, Hkv, G, Tq, Tk)."""
    probs = _masked_softmax(q, k, mask, scale)
    return torch.einsum("bhgqk,bhkd->bhgqd", probs, v), probs


def _masked_attention_output(q, k, v, mask, scale):
    """The output of `_masked_softmax_attention`, through SDPA's fused softmax (no probabilities kept).

    q (B, Hkv, G, Tq, D), k/v (B, Hkv, Tk, D), mask (B, Hkv or 1, Tq, Tk) bool -> (B, Hkv, G, Tq, D).
    A row with no visible key (padding, a ring slot not written yet) gives 0, as the written-out form does:
    it attends to every key and is then zeroed, since what SDPA returns for a fully masked row has differed
    between torch versions and backends (NaN in some). Its gradient is zero: the zeroing cuts it.
    """
    batch, num_kv_heads, group, num_queries, head_dim = q.shape
    has_key = mask.any(dim=-1, keepdim=True)  # (B, Hkv or 1, Tq, 1)
    mask = mask | ~has_key
    if mask.shape[1] != 1:  # per KV group (the selection) -> per query head h = kv * G + g
        mask = mask[:, :, None].expand(-1, -1, group, -1, -1).reshape(batch, num_kv_heads * group, num_queries, -1)
    out = torch.nn.functional.scaled_dot_product_attention(
        q.reshape(batch, num_kv_heads * group, num_queries, head_dim), k, v, attn_mask=mask, scale=scale,
        enable_gqa=True,
    )  # (B, H, Tq, D)
    out = out.view(batch, num_kv_heads, group, num_queries, head_dim)
    return out * has_key[:, :, None].to(out.dtype)


def _window_mask(q_index, q_doc_pos, win_index, win_doc_pos, window_size):
    """(B, Tq, Tw) bool: the window slot holds one of the last w keys of the query's document, itself included."""
    return (
        _same_document(q_index, q_doc_pos, win_index, win_doc_pos)
        & (win_index >= 0)[:, None, :]  # ring slots not written yet
        & (q_index[:, :, None] >= win_index[:, None, :])
        & (q_index[:, :, None] - win_index[:, None, :] < window_size)
    )


def _banded_window_output(q, k_win, v_win, q_index, q_doc_pos, win_index, win_doc_pos, window_size, scale):
    """The window branch's output through `_masked_attention_output`, each chunk of w queries given only the
    2w - 1 slots its queries can reach instead of all Tw slots under the mask: the same masked softmax (a key
    left out is one the mask hides), with about 2w keys per query where the full form has Tw.

    For queries and window slots that are suffixes of the same key positions (no ring: query_end is None), so
    query j's own key sits at slot j + Tw - Tq. q (B, Hkv, G, Tq, D), k_win/v_win (B, Hkv, Tw, D),
    q_index/q_doc_pos (B, Tq), win_index/win_doc_pos (B, Tw) -> (B, Hkv, G, Tq, D).
    """
    batch, num_kv_heads, group, num_queries, head_dim = q.shape
    num_win = k_win.shape[2]
    device = q.device
    chunk, span = window_size, 2 * window_size - 1  # a chunk's queries reach back w - 1 slots before its first
    num_chunks = -(-num_queries // chunk)
    query = torch.arange(num_chunks * chunk, device=device).view(num_chunks, chunk)  # (nC, C), padded past Tq
    slot = (num_win - num_queries - (window_size - 1) + query[:, :1]) + torch.arange(span, device=device)  # (nC, S)
    query_ok, slot_ok = query < num_queries, (slot >= 0) & (slot < num_win)
    query, slot = query.clamp(max=num_queries - 1), slot.clamp(0, num_win - 1)

    def per_chunk(values, at, ok):  # (B, N) at (nC, M) -> (B * nC, M), -1 (no document) at a padded entry
        return values[:, at].masked_fill(~ok, -1).reshape(batch * num_chunks, -1)

    mask = _window_mask(  # (B * nC, C, S)
        per_chunk(q_index, query, query_ok), per_chunk(q_doc_pos, query, query_ok),
        per_chunk(win_index, slot, slot_ok), per_chunk(win_doc_pos, slot, slot_ok), window_size,
    )
    q_chunks = torch.nn.functional.pad(q, (0, 0, 0, num_chunks * chunk - num_queries))
    q_chunks = q_chunks.view(batch, num_kv_heads, group, num_chunks, chunk, head_dim).permute(0, 3, 1, 2, 4, 5)
    q_chunks = q_chunks.reshape(batch * num_chunks, num_kv_heads, group, chunk, head_dim)

    def kv_chunks(x):  # (B, Hkv, Tw, D) -> (B * nC, Hkv, S, D)
        return x[:, :, slot].transpose(1, 2).reshape(batch * num_chunks, num_kv_heads, span, head_dim)

    out = _masked_attention_output(q_chunks, kv_chunks(k_win), kv_chunks(v_win), mask[:, None], scale)
    out = out.view(batch, num_chunks, num_kv_heads, group, chunk, head_dim).permute(0, 2, 3, 1, 4, 5)
    return out.reshape(batch, num_kv_heads, group, num_chunks * chunk, head_dim)[:, :, :, :num_queries]


def _causal_chunks_output(q, k, v, mask, scale):
    """`_masked_attention_output` under a causal mask in SELECTED_QUERY_CHUNKS chunks of queries, each given only
    the keys up to its last query: the same masked softmax (a key left out is one causality hides) over about
    half the (query, key) pairs of one call.

    Query j's key index is at most Tk - Tq + j (the last Tq of Tk positions; a static cache's queries end earlier,
    and the keys past them that a chunk keeps are masked). q (B, Hkv, G, Tq, D), k/v (B, Hkv, Tk, D), mask
    (B, Hkv or 1, Tq, Tk) bool, False at every key after its query -> (B, Hkv, G, Tq, D).
    """
    num_queries, num_keys = q.shape[3], k.shape[2]
    bounds = [num_queries * c // SELECTED_QUERY_CHUNKS for c in range(SELECTED_QUERY_CHUNKS + 1)]
    outputs = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end > start:
            keys = num_keys - num_queries + end  # one past the latest key the chunk's last query can see
            outputs.append(_masked_attention_output(q[:, :, :, start:end], k[:, :, :keys], v[:, :, :keys],
                                                    mask[:, :, start:end, :keys], scale))  # fmt: skip
    return torch.cat(outputs, dim=3) if outputs else _masked_attention_output(q, k, v, mask, scale)


def _same_document(q_index, q_doc_pos, k_index, k_doc_pos):
    """(B, Tq, Tk) bool: key and query are valid tokens of the same document."""
    q_start = (q_index - q_doc_pos)[:, :, None]
    k_start = (k_index - k_doc_pos)[:, None, :]
    return (q_start == k_start) & (q_doc_pos >= 0)[:, :, None] & (k_doc_pos >= 0)[:, None, :]


def selection_block_scores(p_cmp, cmp_end, doc_pos, num_sel_blocks, params: NSAParams, num_kv_heads: int):
    """Block importance summed over each KV group (Eqs. 9-10, overlap form).

    p_cmp (B, H, Tq, Nc) compression probabilities; returns (B, Hkv, Tq, Nb) with
    P[j] = sum_{h in group} sum_i w_ij p_cmp^h[i], w_ij = |[i*d, i*d+l) ∩ [j*l', (j+1)*l')| / d.
    """
    l, d, block = params.cmp_block_size, params.cmp_stride, params.sel_block_size
    batch, num_heads, num_queries, num_slots = p_cmp.shape
    end_doc_pos = doc_pos.gather(1, cmp_end.clamp(min=0))  # (B, Nc)
    first_key = (end_doc_pos - (l - 1)).clamp(min=0)  # i*d, in-document
    valid = cmp_end >= 0
    p_group = p_cmp.view(batch, num_kv_heads, num_heads // num_kv_heads, num_queries, num_slots).sum(2)
    scores = p_cmp.new_zeros(batch, num_kv_heads, num_queries, num_sel_blocks)
    # A compressed token of l keys overlaps at most ceil((l - 1) / l') + 1 selection blocks:
    # a constant-length loop over those offsets, not over tokens or blocks.
    for offset in range((l - 1) // block + 2):
        j = first_key // block + offset  # (B, Nc)
        overlap = torch.minimum((j + 1) * block, first_key + l) - torch.maximum(j * block, first_key)
        weight = torch.where(valid & (j < num_sel_blocks), overlap.clamp(min=0) // d, torch.zeros_like(j))
        index = j.clamp(max=num_sel_blocks - 1)[:, None, None, :].expand(-1, num_kv_heads, num_queries, -1)
        scores.scatter_add_(-1, index, p_group * weight[:, None, None, :].to(p_group.dtype))
    return scores


def select_blocks(block_scores, q_doc_pos, params: NSAParams):
    """Top-n selection with forced blocks and lower-index tie-break.

    block_scores (B, Hkv, Tq, Nb), q_doc_pos (B, Tq) -> (B, Hkv, Tq, n') int64 in-document block
    indices sorted by priority, -1 for unused slots; n' = min(n, Nb).
    """
    block = params.sel_block_size
    num_blocks = block_scores.shape[-1]
    j = torch.arange(num_blocks, device=block_scores.device)
    pos = q_doc_pos[:, None, :, None]  # (B, 1, Tq, 1)
    eligible = (j * block <= pos) & (pos >= 0)
    own_block = pos // block
    forced = eligible & ((j < params.sel_init_blocks) | ((j > own_block - params.sel_local_blocks) & (j <= own_block)))
    priority = torch.where(eligible, block_scores, torch.full_like(block_scores, float("-inf")))
    priority = torch.where(forced, torch.full_like(priority, float("inf")), priority)
    # A stable descending sort keeps equal scores in index order: ties go to the lower block.
    order = torch.sort(priority, dim=-1, descending=True, stable=True).indices
    top = order[..., : min(params.sel_num_blocks, num_blocks)]
    chosen_eligible = eligible.expand_as(priority).gather(-1, top)
    return torch.where(chosen_eligible, top, torch.full_like(top, -1))


def _grouped_queries(q, num_kv_heads: int, dtype: torch.dtype) -> torch.Tensor:
    """q (B, Tq, H, D) -> (B, Hkv, G, Tq, D) in `dtype`: query head h = kv * G + g beside its KV group."""
    batch, num_queries, num_heads, head_dim = q.shape
    grouped = q.to(dtype).view(batch, num_queries, num_kv_heads, num_heads // num_kv_heads, head_dim)
    return grouped.permute(0, 2, 3, 1, 4)


def _compressed_visibility(q_index, q_doc_pos, cmp_end, doc_pos):
    """(B, Tq, Nc) bool, the compression branch's mask (Eq. 7): compressed token i is visible to query t iff its
    last key i*d + l - 1 (cmp_end) is at or before t, inside t's document."""
    end_index = cmp_end.clamp(min=0)
    return (
        _same_document(q_index, q_doc_pos, end_index, doc_pos.gather(1, end_index))
        & (cmp_end >= 0)[:, None, :]
        & (end_index[:, None, :] <= q_index[:, :, None])
    )


def _top_blocks(p_cmp, cmp_end, doc_pos, q_doc_pos, params: NSAParams):
    """The selected blocks (B, Hkv, Tq, n') from the compression probabilities p_cmp (B, Hkv, G, Tq, Nc): their
    block scores summed over each KV group (Eqs. 9-10), then the top-n with forced blocks (Eqs. 11-12)."""
    batch, num_kv_heads, group, num_queries, _ = p_cmp.shape
    num_sel_blocks = (doc_pos.shape[1] + params.sel_block_size - 1) // params.sel_block_size
    block_scores = selection_block_scores(p_cmp.reshape(batch, num_kv_heads * group, num_queries, -1), cmp_end,
                                          doc_pos, num_sel_blocks, params, num_kv_heads)  # fmt: skip
    return select_blocks(block_scores.detach(), q_doc_pos, params)


@torch.no_grad()
def reference_block_indices(q, k_cmp, cmp_end, doc_pos, params: NSAParams, scale: float | None = None) -> torch.Tensor:
    """The selected blocks alone, as `nsa_attention_reference(..., return_block_indices=True)` selects them:
    (B, Hkv, Tq, n') int64 in-document block indices by priority, -1 unused.

    q (B, Tq, H, D) are the last Tq of doc_pos's Tk positions; k_cmp (B, Nc, Hkv, D) and cmp_end (B, Nc) as there.
    Only the compression branch's probabilities are computed (the selection reads nothing else: Eqs. 8-12), so
    the statistics' and diagnostics' selections do not pay for the selected and window branches; the signature
    is `nsa_triton.select_blocks_triton`'s."""
    batch, num_queries, _, head_dim = q.shape
    num_keys, num_kv_heads = doc_pos.shape[1], k_cmp.shape[2]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    compute_dtype = torch.promote_types(q.dtype, torch.float32)
    q_grouped = _grouped_queries(q, num_kv_heads, compute_dtype)  # (B, Hkv, G, Tq, D)
    k_grouped = k_cmp.to(compute_dtype).transpose(1, 2)  # (B, Hkv, Nc, D)
    q_index = torch.arange(num_keys - num_queries, num_keys, device=q.device).expand(batch, -1)
    q_doc_pos = doc_pos[:, num_keys - num_queries :]
    cmp_visible = _compressed_visibility(q_index, q_doc_pos, cmp_end, doc_pos)
    p_cmp = _masked_softmax(q_grouped, k_grouped, cmp_visible[:, None], scale)  # (B, Hkv, G, Tq, Nc)
    return _top_blocks(p_cmp, cmp_end, doc_pos, q_doc_pos, params)


class ReferenceBranches(NamedTuple):
    """The three branches of one layer before the gates (`reference_branches`), in grouped-query layout."""

    o_cmp: torch.Tensor  # (B, Hkv, G, Tq, D) compression branch output
    p_cmp: torch.Tensor  # (B, Hkv, G, Tq, Nc) its attention probabilities over the compressed tokens
    o_slc: torch.Tensor  # (B, Hkv, G, Tq, D) selection branch output
    p_slc: torch.Tensor | None  # (B, Hkv, G, Tq, Tk) its probabilities over the key positions (0 outside chosen
    # blocks); None when reference_branches(probabilities=False)
    o_win: torch.Tensor  # (B, Hkv, G, Tq, D) sliding-window branch output
    p_win: torch.Tensor | None  # (B, Hkv, G, Tq, Tw) its probabilities over the window's slots; None as p_slc
    win_index: torch.Tensor  # (B, Tw) the key position in each window slot (negative: a ring slot not written yet)
    block_indices: torch.Tensor  # (B, Hkv, Tq, n') selected in-document blocks, -1 unused

    def gated(self, gates: torch.Tensor) -> torch.Tensor:
        """The layer's output (B, Tq, H, D) in the branches' dtype: each branch's output scaled by its gate
        (gates (B, Tq, H, 3) in (cmp, slc, win) order, Eq. 5) and summed."""
        batch, num_kv_heads, group, num_queries, head_dim = self.o_cmp.shape

        def heads_last(o):  # (B, Hkv, G, Tq, D) -> (B, Tq, H, D)
            return o.permute(0, 3, 1, 2, 4).reshape(batch, num_queries, num_kv_heads * group, head_dim)

        g = gates.to(self.o_cmp.dtype)
        return (g[..., 0:1] * heads_last(self.o_cmp) + g[..., 1:2] * heads_last(self.o_slc)
                + g[..., 2:3] * heads_last(self.o_win))  # fmt: skip


def reference_branches(
    q: torch.Tensor,
    k_cmp: torch.Tensor,
    v_cmp: torch.Tensor,
    cmp_end: torch.Tensor,
    k_slc: torch.Tensor,
    v_slc: torch.Tensor,
    k_win: torch.Tensor,
    v_win: torch.Tensor,
    doc_pos: torch.Tensor,
    params: NSAParams,
    scale: float | None = None,
    query_end: torch.Tensor | None = None,
    block_indices: torch.Tensor | None = None,
    probabilities: bool = True,
) -> ReferenceBranches:
    """Each branch's output and attention probabilities for queries at the last Tq of Tk key positions, before the
    gates combine them (NSA_SPEC, one layer, step 3); `nsa_attention_reference` documents the arguments. What a
    diagnosis of a trained model reads: where each branch looks, not only what the gated sum gives.

    block_indices (B, Hkv, Tq, n'): the selected blocks to attend instead of this function's top-n (the kernels'
    selection, which near a tie in low precision may pick another block); default: the reference's own.
    probabilities=False: p_slc and p_win are None and the branches' outputs come from SDPA's fused softmax (the
    training path's form; the module docstring says why), the selected branch in query chunks over their causal
    key prefixes and the window, where that pays, in chunks of w queries; p_cmp is still returned, without a
    gradient."""
    batch, num_queries, num_heads, head_dim = q.shape
    num_keys, num_kv_heads = k_slc.shape[1], k_slc.shape[2]
    num_win = k_win.shape[1]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    compute_dtype = torch.promote_types(q.dtype, torch.float32)
    device = q.device
    if probabilities:
        attend = _masked_softmax_attention
    else:
        def attend(q, k, v, mask, scale):
            return _masked_attention_output(q, k, v, mask, scale), None

    def heads_first(x):  # (B, T, Hkv, D) -> (B, Hkv, T, D)
        return x.to(compute_dtype).transpose(1, 2)

    q_grouped = _grouped_queries(q, num_kv_heads, compute_dtype)  # (B, Hkv, G, Tq, D)
    key_index = torch.arange(num_keys, device=device).expand(batch, -1)
    if query_end is None:
        q_index = key_index[:, num_keys - num_queries :]
        q_doc_pos = doc_pos[:, num_keys - num_queries :]
        win_index = key_index[:, num_keys - num_win :]  # (B, Tw) the last Tw positions
    else:
        last = query_end.reshape(1, 1).to(device=device, dtype=torch.long)
        q_index = (last - num_queries + 1 + torch.arange(num_queries, device=device)).expand(batch, -1)
        q_doc_pos = doc_pos.gather(1, q_index)
        slot = torch.arange(num_win, device=device)
        win_index = (last - (last - slot) % num_win).expand(batch, -1)  # ring slot r holds key t - ((t - r) mod Tw)
    causal = q_index[:, :, None] >= key_index[:, None, :]
    same_doc_causal = _same_document(q_index, q_doc_pos, key_index, doc_pos) & causal  # (B, Tq, Tk)

    cmp_visible = _compressed_visibility(q_index, q_doc_pos, cmp_end, doc_pos)
    cmp_inputs = (q_grouped, heads_first(k_cmp), heads_first(v_cmp), cmp_visible[:, None], scale)
    if probabilities:
        o_cmp, p_cmp = _masked_softmax_attention(*cmp_inputs)  # (B, Hkv, G, Tq, D), (B, Hkv, G, Tq, Nc)
    else:  # the selection reads p_cmp without a gradient (Eq. 8 picks blocks, it is not differentiated)
        with torch.no_grad():
            p_cmp = _masked_softmax(*cmp_inputs[:2], cmp_visible[:, None], scale)
        o_cmp = _masked_attention_output(*cmp_inputs)

    # Selection branch (Eqs. 8-12): top-n blocks per KV group from the compression probabilities.
    num_sel_blocks = (num_keys + params.sel_block_size - 1) // params.sel_block_size
    if block_indices is None:
        block_indices = _top_blocks(p_cmp, cmp_end, doc_pos, q_doc_pos, params)  # (B, Hkv, Tq, n')
    chosen = torch.zeros(batch, num_kv_heads, num_queries, num_sel_blocks + 1, dtype=torch.bool, device=device)
    chosen.scatter_(-1, torch.where(block_indices >= 0, block_indices, num_sel_blocks), True)
    key_block = (doc_pos.clamp(min=0) // params.sel_block_size)[:, None, None, :].expand(-1, num_kv_heads, num_queries, -1)
    slc_mask = chosen.gather(-1, key_block) & same_doc_causal[:, None]  # (B, Hkv, Tq, Tk)
    if probabilities:
        o_slc, p_slc = attend(q_grouped, heads_first(k_slc), heads_first(v_slc), slc_mask, scale)
    else:
        o_slc, p_slc = _causal_chunks_output(q_grouped, heads_first(k_slc), heads_first(v_slc), slc_mask, scale), None

    # Sliding window: the last w keys of the query's document, itself included.
    win_doc_pos = doc_pos.gather(1, win_index.clamp(min=0))
    if not probabilities and query_end is None and _banding_pays(num_queries, num_win, params.window_size):
        o_win, p_win = _banded_window_output(
            q_grouped, heads_first(k_win), heads_first(v_win), q_index, q_doc_pos, win_index, win_doc_pos,
            params.window_size, scale,
        ), None
    else:
        win_mask = _window_mask(q_index, q_doc_pos, win_index, win_doc_pos, params.window_size)
        o_win, p_win = attend(q_grouped, heads_first(k_win), heads_first(v_win), win_mask[:, None], scale)
    return ReferenceBranches(o_cmp, p_cmp, o_slc, p_slc, o_win, p_win, win_index, block_indices)


def nsa_attention_reference(
    q: torch.Tensor,
    k_cmp: torch.Tensor,
    v_cmp: torch.Tensor,
    cmp_end: torch.Tensor,
    k_slc: torch.Tensor,
    v_slc: torch.Tensor,
    k_win: torch.Tensor,
    v_win: torch.Tensor,
    gates: torch.Tensor,
    doc_pos: torch.Tensor,
    params: NSAParams,
    scale: float | None = None,
    return_block_indices: bool = False,
    query_end: torch.Tensor | None = None,
):
    """NSA output for queries at the last Tq of Tk key positions (NSA_SPEC, one layer, step 3).

    q (B, Tq, H, D); k_cmp/v_cmp (B, Nc, Hkv, D) compressed (k already rotated) with
    cmp_end (B, Nc) = key index of each one's last raw key (-1 empty); k_slc/v_slc (B, Tk, Hkv, D);
    k_win/v_win (B, Tw, Hkv, D) = the last Tw key positions; gates (B, Tq, H, 3) in (cmp, slc, win)
    order, already sigmoid-ed; doc_pos (B, Tk) from `nsa_layout`. Returns (B, Tq, H, D) in q's dtype
    (and the selected block indices (B, Hkv, Tq, n') if asked).

    query_end (a static cache's fixed-size buffers, NSACache(static=True)): a 1-element int64 tensor, the
    key index of the last query; the queries are the Tq key positions ending there, and keys past it are
    not written yet (doc_pos -1 there). k_win/v_win are then a ring of Tw >= w slots, key p at slot p % Tw.
    A tensor, not an int: compiled decoding steps must not depend on a host value that changes per token.
    """
    branches = reference_branches(
        q, k_cmp, v_cmp, cmp_end, k_slc, v_slc, k_win, v_win, doc_pos, params, scale, query_end, probabilities=False
    )
    out = branches.gated(gates).to(q.dtype)
    return (out, branches.block_indices) if return_block_indices else out


__all__ = [
    "ReferenceBranches",
    "nsa_attention_reference",
    "reference_block_indices",
    "reference_branches",
    "select_blocks",
    "selection_block_scores",
]
