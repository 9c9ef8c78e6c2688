"""Shared helpers for the NSA tests: case builders and the naive layer (uses tests/naive_nsa.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from modeling_nsa.configuration_nsa import COMPRESSORS_WITH_MLP, NSAConfig
from modeling_nsa.nsa_layout import NSAParams

from naive_nsa import (
    doc_pos_from_segments,
    naive_compress,
    naive_dense_attention,
    naive_nsa_attention,
    num_compressed,
    rope_naive,
)


def make_params(l=8, d=4, block=8, n=4, init=1, local=2, w=16):
    return NSAParams(
        cmp_block_size=l, cmp_stride=d, sel_block_size=block, sel_num_blocks=n,
        sel_init_blocks=init, sel_local_blocks=local, window_size=w,
    )  # fmt: skip


def layout_rows(layout: str, T: int):
    """Rows of ("doc", L)/("pad", L) segments for a named layout of row length T."""
    if layout == "single":
        return [[("doc", T)]]
    if layout == "docs":  # packed documents, one shorter than l, boundaries off the block grid
        a = max(1, T // 3 + 1)
        b = min(5, T - a)
        rest = T - a - b
        segs = [("doc", a)] + ([("doc", b)] if b > 0 else []) + ([("doc", rest)] if rest > 0 else [])
        return [segs]
    if layout == "pad":  # left padding in row 0, right padding in row 1
        return [[("pad", 5), ("doc", T - 5)], [("doc", T - 7), ("pad", 7)]]
    if layout == "docs-pad":  # left padding, two documents, right padding
        a = (T - 6) // 2 + 3
        return [[("pad", 2), ("doc", a), ("doc", T - 6 - a), ("pad", 4)], [("doc", T // 2), ("doc", T - T // 2)]]
    raise ValueError(layout)


def doc_pos_tensor(layout: str, T: int) -> torch.Tensor:
    return torch.tensor([doc_pos_from_segments(r, T) for r in layout_rows(layout, T)], dtype=torch.long)


def naive_cmp_end(doc_pos: torch.Tensor, params: NSAParams, num_slots: int | None = None) -> torch.Tensor:
    """Our own compressed-token layout: every document's tokens i ending at start + i*d + l - 1,
    in order of that index, padded with -1 to `num_slots` (default T // d)."""
    l, d = params.cmp_block_size, params.cmp_stride
    B, T = doc_pos.shape
    num_slots = max(1, T // d) if num_slots is None else num_slots
    rows = []
    for row in doc_pos.tolist():
        ends = []
        index = 0
        while index < T:
            if row[index] != 0:  # padding (or a document continuing); documents start at doc_pos 0
                assert row[index] == -1, "document must start at doc_pos 0"
                index += 1
                continue
            length = 1
            while index + length < T and row[index + length] == length:
                length += 1
            ends += [index + i * d + l - 1 for i in range(num_compressed(length, l, d))]
            index += length
        assert len(ends) <= num_slots
        rows.append(ends + [-1] * (num_slots - len(ends)))
    return torch.tensor(rows, dtype=torch.long)


def valid_mask(doc_pos: torch.Tensor, num_queries: int | None = None) -> torch.Tensor:
    dp = doc_pos if num_queries is None else doc_pos[:, doc_pos.shape[1] - num_queries :]
    return dp >= 0


def tiny_config(**overrides) -> NSAConfig:
    base = dict(
        vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=512, cmp_block_size=8, cmp_stride=4,
        sel_block_size=8, sel_num_blocks=3, sel_init_blocks=1, sel_local_blocks=1, window_size=12,
        cmp_mlp_hidden_size=16, nsa_backend="reference", tie_word_embeddings=False,
    )  # fmt: skip
    base.update(overrides)
    return NSAConfig(**base)


def randomize_(module: torch.nn.Module, generator: torch.Generator, std: float = 0.5):
    """Non-trivial weights everywhere (the default init leaves pos embeddings small and norms at 1)."""
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=generator, dtype=torch.float64).to(p.dtype) * std)
    return module


def naive_layer_forward(layer, hidden_states, doc_pos, config):
    """NSAAttention.forward recomputed from NSA_SPEC with the layer's own weights (no cache).

    Layout read from modeling_nsa.py: q_proj -> (H, D); kv_proj -> (sets, 2, Hkv, D) with sets in
    (cmp, slc, win) order (one shared set when kv_per_branch=False; two when it names a branch);
    g_proj -> (H, 3) in (cmp, slc, win) order; compressor k_pos_emb/v_pos_emb and k_mlp/v_mlp =
    Sequential(Linear, GELU, Linear).
    """
    B, T, _ = hidden_states.shape
    H, Hkv, D = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    params = NSAParams.from_config(config)
    theta = config.rope_theta
    x = hidden_states
    pos = doc_pos.clamp(min=0)
    pos4 = pos[:, :, None]
    q = rope_naive(F.linear(x, layer.q_proj.weight).view(B, T, H, D), pos4, theta)
    dense = config.attention_mode == "dense"
    # the set each of (cmp, slc, win) reads: own sets in that order, or one shared set, or (kv_per_branch naming a
    # branch) the shared set at the first of the other two and the named branch's own set where it comes
    own = config.kv_per_branch
    cmp_set, slc_set, win_set = {True: (0, 1, 2), False: (0, 0, 0), "cmp": (0, 1, 1), "slc": (0, 1, 0),
                                 "win": (0, 0, 1)}[own]  # fmt: skip
    if dense:
        cmp_set = slc_set = win_set = 0
    sets = max(cmp_set, slc_set, win_set) + 1
    kv = F.linear(x, layer.kv_proj.weight).view(B, T, sets, 2, Hkv, D)
    if dense:
        k = rope_naive(kv[:, :, 0, 0], pos4, theta)
        out = naive_dense_attention(q, k, kv[:, :, 0, 1], doc_pos)
        return F.linear(out.reshape(B, T, H * D), layer.o_proj.weight)
    gates = torch.sigmoid(F.linear(x, layer.g_proj.weight)).view(B, T, H, 3)
    k_raw, v_raw = kv[:, :, cmp_set, 0], kv[:, :, cmp_set, 1]
    k_slc, v_slc = rope_naive(kv[:, :, slc_set, 0], pos4, theta), kv[:, :, slc_set, 1]
    k_win, v_win = rope_naive(kv[:, :, win_set, 0], pos4, theta), kv[:, :, win_set, 1]
    cmp_end = naive_cmp_end(doc_pos, params)
    comp = layer.compressor
    if config.compressor in COMPRESSORS_WITH_MLP:
        def phi(pos_emb, mlp):
            return dict(pos_emb=pos_emb, w1=mlp[0].weight, b1=mlp[0].bias, w2=mlp[2].weight, b2=mlp[2].bias)

        k_phi, v_phi = phi(comp.k_pos_emb, comp.k_mlp), phi(comp.v_pos_emb, comp.v_mlp)
    else:
        k_phi = v_phi = None
    k_cmp = naive_compress(k_raw, cmp_end, doc_pos, params, config.compressor, k_phi, rope_theta=theta)
    v_cmp = naive_compress(v_raw, cmp_end, doc_pos, params, config.compressor, v_phi)
    out = naive_nsa_attention(q, k_cmp, v_cmp, cmp_end, k_slc, v_slc, k_win, v_win, gates, doc_pos, params)
    return F.linear(out.reshape(B, T, H * D), layer.o_proj.weight)


def layer_inputs(model, hidden_states, doc_pos):
    """position_embeddings the model would give the layers for this doc_pos."""
    return model.model.rotary_emb(doc_pos, hidden_states.dtype)
