"""nsa_attention_reference (and the NSA attention layer) against the naive per-query oracle, fp64.

The oracle (tests/naive_nsa.py) is written from NSA_SPEC: one query, one head at a time.
Compared: outputs, gradients w.r.t. every input (q, compressed k/v, each branch's k/v, gates),
and the selected block sets.
"""

from __future__ import annotations

import math

import pytest
import torch

from modeling_nsa.modeling_nsa import NSAForCausalLM
from modeling_nsa.nsa_layout import compressed_token_ends, document_positions
from modeling_nsa.nsa_reference import (
    _banded_window_output,
    _causal_chunks_output,
    _masked_attention_output,
    _same_document,
    _window_mask,
    nsa_attention_reference,
    reference_block_indices,
    reference_branches,
)

from model_helpers import (
    doc_pos_tensor,
    layer_inputs,
    layout_rows,
    make_params,
    naive_cmp_end,
    naive_layer_forward,
    randomize_,
    tiny_config,
    valid_mask,
)
from naive_nsa import block_sets_from_reference, naive_compress, naive_nsa_attention

TOL = dict(rtol=1e-10, atol=1e-10)

# Small blocks so that every branch, the forced blocks and the top-n all matter:
P_A = dict(l=8, d=4, block=8, n=4, init=1, local=2, w=16)  # 13 blocks at T=97 > n
P_B = dict(l=8, d=4, block=16, n=3, init=1, local=2, w=24)
P_WIDE = dict(l=16, d=8, block=8, n=3, init=1, local=1, w=16)  # l > l': a token spans 2-3 blocks
P_NOOVL = dict(l=8, d=8, block=16, n=3, init=1, local=1, w=20)  # d = l: no overlap
P_TOPN = dict(l=8, d=4, block=8, n=3, init=0, local=0, w=16)  # nothing forced: pure top-n
P_INIT2 = dict(l=8, d=4, block=8, n=4, init=2, local=1, w=16)

# (T, G, Hkv, compressor, kv, layout, params, params_tag, Tq, Tw)
CASES = [
    (1, 1, 2, "mean", "kvsplit", "single", P_A, "A", None, None),
    (31, 2, 2, "mlp", "kvshared", "single", P_A, "A", None, None),
    (33, 3, 2, "mlp", "kvsplit", "docs", P_B, "B", None, None),
    (97, 6, 1, "mlp", "kvsplit", "docs", P_A, "A", None, None),
    (97, 16, 1, "mean", "kvshared", "pad", P_A, "A", None, None),
    (130, 2, 2, "mlp", "kvsplit", "docs-pad", P_A, "A", None, None),
    (130, 1, 2, "mean", "kvsplit", "single", P_B, "B", None, None),
    (64, 3, 1, "mean", "kvsplit", "docs", P_WIDE, "wide", None, None),
    (50, 2, 1, "mlp", "kvshared", "pad", P_NOOVL, "noovl", None, None),
    (75, 2, 2, "mean", "kvsplit", "single", P_TOPN, "topn", None, None),
    (75, 3, 1, "mlp", "kvsplit", "docs", P_INIT2, "init2", None, None),
    # Queries = the last Tq of Tk keys, window = the last Tw keys (the cached-decoding shapes).
    (97, 2, 2, "mlp", "kvsplit", "single", P_A, "A", 1, 20),
    (70, 3, 1, "mean", "kvsplit", "pad", P_A, "A", 5, 24),
]


def case_id(c):
    T, G, Hkv, comp, kv, layout, _, tag, Tq, Tw = c
    extra = f"-q{Tq}w{Tw}" if Tq else ""
    return f"T{T}-G{G}-{comp}-{kv}-{layout}-{tag}{extra}"


def build_inputs(T, G, Hkv, comp, kv, layout, p, Tq, Tw, seed=0, D=8):
    params = make_params(**p)
    g = torch.Generator().manual_seed(seed)
    f64 = torch.float64
    doc_pos = doc_pos_tensor(layout, T)
    B, H = doc_pos.shape[0], G * Hkv
    Tq = T if Tq is None else Tq
    Tw = T if Tw is None else Tw

    def rnd(*shape, std=1.0):
        return (torch.randn(*shape, generator=g, dtype=f64) * std).requires_grad_()

    leaves = dict(q=rnd(B, Tq, H, D), gate_logits=rnd(B, Tq, H, 3))
    if kv == "kvsplit":
        leaves.update(k_cr=rnd(B, T, Hkv, D), v_cr=rnd(B, T, Hkv, D), k_slc=rnd(B, T, Hkv, D),
                      v_slc=rnd(B, T, Hkv, D), k_win=rnd(B, T, Hkv, D), v_win=rnd(B, T, Hkv, D))  # fmt: skip
        k_cr, v_cr, k_slc, v_slc = leaves["k_cr"], leaves["v_cr"], leaves["k_slc"], leaves["v_slc"]
        k_win, v_win = leaves["k_win"][:, T - Tw :], leaves["v_win"][:, T - Tw :]
    else:  # one K/V shared by the three branches
        leaves.update(k=rnd(B, T, Hkv, D), v=rnd(B, T, Hkv, D))
        k_cr = k_slc = leaves["k"]
        v_cr = v_slc = leaves["v"]
        k_win, v_win = leaves["k"][:, T - Tw :], leaves["v"][:, T - Tw :]
    cmp_end = compressed_token_ends(doc_pos, params)
    l = params.cmp_block_size
    if comp == "mlp":
        def phi():
            return dict(pos_emb=torch.randn(l, D, generator=g, dtype=f64), w1=torch.randn(12, l * D, generator=g, dtype=f64) / math.sqrt(l * D),
                        b1=torch.randn(12, generator=g, dtype=f64), w2=torch.randn(D, 12, generator=g, dtype=f64) / math.sqrt(12),
                        b2=torch.randn(D, generator=g, dtype=f64))  # fmt: skip

        k_phi, v_phi = phi(), phi()
    else:
        k_phi = v_phi = None
    k_cmp = naive_compress(k_cr, cmp_end, doc_pos, params, comp, k_phi, rope_theta=10000.0)
    v_cmp = naive_compress(v_cr, cmp_end, doc_pos, params, comp, v_phi)
    # Empty slots hold garbage: neither implementation may read them.
    empty = (cmp_end < 0)[:, :, None, None]
    k_cmp = torch.where(empty, torch.full_like(k_cmp, 1e3), k_cmp)
    v_cmp = torch.where(empty, torch.full_like(v_cmp, -1e3), v_cmp)
    gates = torch.sigmoid(leaves["gate_logits"])
    args = (leaves["q"], k_cmp, v_cmp, cmp_end, k_slc, v_slc, k_win, v_win, gates, doc_pos, params)
    grad_wrt = {n: t for n, t in dict(leaves, k_cmp=k_cmp, v_cmp=v_cmp, gates=gates).items() if t.requires_grad}
    weight = torch.randn(B, Tq, H, D, generator=g, dtype=f64) * valid_mask(doc_pos, Tq)[:, :, None, None]
    return args, grad_wrt, weight


def _grads(out, weight, tensors):
    return torch.autograd.grad((out * weight).sum(), list(tensors), materialize_grads=True, allow_unused=True, retain_graph=True)


@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
def test_reference_matches_naive(case):
    T, G, Hkv, comp, kv, layout, p, _, Tq, Tw = case
    args, grad_wrt, weight = build_inputs(T, G, Hkv, comp, kv, layout, p, Tq, Tw)
    doc_pos = args[9]
    mask = valid_mask(doc_pos, args[0].shape[1])

    ref, ref_idx = nsa_attention_reference(*args, return_block_indices=True)
    naive, naive_blocks = naive_nsa_attention(*args, return_block_indices=True)
    assert ref.dtype == torch.float64 and torch.isfinite(ref).all()
    torch.testing.assert_close(ref[mask], naive[mask], **TOL)
    assert block_sets_from_reference(ref_idx) == naive_blocks

    names = list(grad_wrt)
    g_ref = _grads(ref, weight, grad_wrt.values())
    g_naive = _grads(naive, weight, grad_wrt.values())
    for name, a, b in zip(names, g_ref, g_naive):
        assert torch.isfinite(a).all(), name
        torch.testing.assert_close(a, b, **TOL, msg=lambda m, name=name: f"grad wrt {name}: {m}")


SELECTION_CASES = CASES + [(83, 4, 2, "mlp", "kvsplit", "docs-pad", P_WIDE, "wide", None, None),
                           (45, 8, 1, "mean", "kvsplit", "docs", P_INIT2, "init2", 7, 45)]  # fmt: skip


@pytest.mark.parametrize("case", SELECTION_CASES, ids=[case_id(c) for c in SELECTION_CASES])
def test_selection_alone_is_the_whole_references_selection(case):
    """reference_block_indices (the compression branch's probabilities and the top-n only, what the selection
    statistics run) selects exactly the blocks of the whole reference, slot for slot, and the naive oracle's
    sets: documents, padding, queries a suffix of the keys, G = 1-16."""
    T, G, Hkv, comp, kv, layout, p, _, Tq, Tw = case
    args, _, _ = build_inputs(T, G, Hkv, comp, kv, layout, p, Tq, Tw)
    q, k_cmp, _, cmp_end, *_, doc_pos, params = args
    alone = reference_block_indices(q, k_cmp, cmp_end, doc_pos, params)
    _, whole = nsa_attention_reference(*args, return_block_indices=True)
    assert alone.dtype == torch.int64 and not alone.requires_grad
    assert torch.equal(alone, whole)
    assert block_sets_from_reference(alone) == naive_nsa_attention(*args, return_block_indices=True)[1]
    # the softmax scale reaches the selection as it does the whole reference's (it changes the ranking where a
    # block is picked freely: the pure top-n case below)
    flat = reference_block_indices(q, k_cmp, cmp_end, doc_pos, params, scale=0.05)
    assert torch.equal(flat, nsa_attention_reference(*args, scale=0.05, return_block_indices=True)[1])
    if p is P_TOPN:
        assert not torch.equal(flat, alone)


FORM_CASES = [c for c in CASES if c[5] in ("pad", "docs-pad")] + [CASES[3], CASES[-2]]


@pytest.mark.parametrize("case", FORM_CASES, ids=[case_id(c) for c in FORM_CASES])
def test_training_form_equals_the_written_out_form(case):
    """nsa_attention_reference (each branch through SDPA's fused softmax) against the same function with the
    softmax written out (reference_branches' form, which the naive comparison above does not see): outputs at
    every row, padding included, where both must give exactly 0, and gradients with the padded rows weighted
    too, where both must send nothing back."""
    T, G, Hkv, comp, kv, layout, p, _, Tq, Tw = case
    args, grad_wrt, _ = build_inputs(T, G, Hkv, comp, kv, layout, p, Tq, Tw)
    q, *rest = args
    params = args[10]
    fused, fused_blocks = nsa_attention_reference(*args, return_block_indices=True)
    written = reference_branches(*args[:8], args[9], params, probabilities=True)
    written_out = written.gated(args[8])
    assert torch.equal(fused_blocks, written.block_indices)
    torch.testing.assert_close(fused, written_out, **TOL)
    padded = ~valid_mask(args[9], q.shape[1])
    if padded.any():
        assert torch.equal(fused[padded], torch.zeros_like(fused[padded]))
    weight = torch.randn(fused.shape, generator=torch.Generator().manual_seed(1), dtype=fused.dtype)
    for name, a, b in zip(grad_wrt, _grads(fused, weight, grad_wrt.values()), _grads(written_out, weight, grad_wrt.values())):
        assert torch.isfinite(a).all(), name
        torch.testing.assert_close(a, b, **TOL, msg=lambda m, name=name: f"grad wrt {name}: {m}")


# (Tq, Tw, w, G, layout): odd lengths, a chunk cut short at the end, queries a suffix of the window's slots
# (a prefill after cached tokens), the window longer than a document, and padding at either end.
BANDED_CASES = [(97, 97, 16, 6, "docs"), (61, 61, 5, 1, "docs-pad"), (40, 40, 8, 16, "pad"),
                (33, 70, 9, 2, "single"), (70, 70, 70, 3, "docs"), (1, 41, 7, 4, "single"),
                (50, 20, 7, 2, "docs")]  # fewer slots than queries: the first queries' keys are not in the window  # fmt: skip


def _grouped_qkv(batch, group, num_queries, num_keys, seed, num_kv_heads=2, head_dim=8):
    """fp64 leaves q (B, Hkv, G, Tq, D), k/v (B, Hkv, Tk, D) for the branch helpers, and their generator."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, num_kv_heads, group, num_queries, head_dim, generator=g, dtype=torch.float64)
    k, v = (torch.randn(batch, num_kv_heads, num_keys, head_dim, generator=g, dtype=torch.float64) for _ in "kv")
    return tuple(x.requires_grad_() for x in (q, k, v)), g


def _assert_same_branch_output(got, expected, q_doc_pos, leaves, g):
    """got == expected in outputs and in gradients wrt `leaves` (fp64), and exactly 0 at padded queries."""
    torch.testing.assert_close(got, expected, **TOL)
    padded = (q_doc_pos < 0)[:, None, None, :, None]
    assert torch.equal(got * padded, torch.zeros_like(got))
    weight = torch.randn(got.shape, generator=g, dtype=torch.float64)
    for name, a, b in zip("qkv", _grads(got, weight, leaves), _grads(expected, weight, leaves)):
        torch.testing.assert_close(a, b, **TOL, msg=lambda m, name=name: f"grad wrt {name}: {m}")


@pytest.mark.parametrize("case", BANDED_CASES, ids=[f"q{c[0]}-w{c[1]}-win{c[2]}-G{c[3]}-{c[4]}" for c in BANDED_CASES])
def test_banded_window_equals_the_masked_window(case):
    """The training form's window branch in chunks of w queries, each given only the 2w - 1 slots it can reach,
    against every slot under the window mask: outputs (0 at padded rows) and gradients, fp64."""
    num_queries, num_win, window, group, layout = case
    num_keys = max(num_queries, num_win)  # the window's slots are the last Tw keys, the queries the last Tq
    doc_pos = doc_pos_tensor(layout, num_keys)
    batch = doc_pos.shape[0]
    (q, k, v), g = _grouped_qkv(batch, group, num_queries, num_win, seed=num_queries * 1000 + num_win)
    key_index = torch.arange(num_keys).expand(batch, -1)
    win_index, win_doc_pos = key_index[:, num_keys - num_win :], doc_pos[:, num_keys - num_win :]
    q_index, q_doc_pos = key_index[:, num_keys - num_queries :], doc_pos[:, num_keys - num_queries :]
    full_mask = _window_mask(q_index, q_doc_pos, win_index, win_doc_pos, window)
    expected = _masked_attention_output(q, k, v, full_mask[:, None], 0.3)
    banded = _banded_window_output(q, k, v, q_index, q_doc_pos, win_index, win_doc_pos, window, 0.3)
    assert banded.shape == expected.shape
    _assert_same_branch_output(banded, expected, q_doc_pos, (q, k, v), g)


# (Tq, Tk, G, layout): chunks of unequal length, fewer queries than chunks (some empty), queries a suffix of the
# keys (a prefill after cached tokens), documents and padding.
CHUNKED_CASES = [(97, 97, 6, "docs"), (61, 61, 1, "docs-pad"), (40, 40, 16, "pad"), (5, 70, 2, "single"),
                 (33, 70, 3, "docs"), (1, 41, 4, "single")]  # fmt: skip


@pytest.mark.parametrize("case", CHUNKED_CASES, ids=[f"q{c[0]}-k{c[1]}-G{c[2]}-{c[3]}" for c in CHUNKED_CASES])
def test_causal_chunks_equal_one_masked_call(case):
    """The training form's selected branch in chunks of queries, each given the keys up to its last query, against
    one call over every key under the same mask (a random selection of keys, causal, in-document): outputs (0 at
    padded rows) and gradients, fp64."""
    num_queries, num_keys, group, layout = case
    doc_pos = doc_pos_tensor(layout, num_keys)
    batch = doc_pos.shape[0]
    (q, k, v), g = _grouped_qkv(batch, group, num_queries, num_keys, seed=num_queries * 1000 + num_keys)
    key_index = torch.arange(num_keys).expand(batch, -1)
    q_index, q_doc_pos = key_index[:, num_keys - num_queries :], doc_pos[:, num_keys - num_queries :]
    causal = q_index[:, :, None] >= key_index[:, None, :]
    chosen = torch.rand(batch, k.shape[1], num_queries, num_keys, generator=g) < 0.4  # per KV group, as selection
    mask = chosen & (_same_document(q_index, q_doc_pos, key_index, doc_pos) & causal)[:, None]
    expected = _masked_attention_output(q, k, v, mask, 0.3)
    chunked = _causal_chunks_output(q, k, v, mask, 0.3)
    _assert_same_branch_output(chunked, expected, q_doc_pos, (q, k, v), g)


def test_training_form_chunks_the_selected_branch(monkeypatch):
    """The training form gives the selected branch in query chunks with their causal key prefixes, each chunk's
    keys ending at its last query; the written-out form covers every key (its probabilities do)."""
    from modeling_nsa import nsa_reference

    calls = []
    real = nsa_reference._masked_attention_output

    def spy(q, k, *rest):  # records (queries, keys) of each call
        calls.append((q.shape[3], k.shape[2]))
        return real(q, k, *rest)

    monkeypatch.setattr(nsa_reference, "_masked_attention_output", spy)
    args, *_ = build_inputs(97, 2, 2, "mean", "kvsplit", "docs", dict(P_A, w=25), None, None)  # window not banded
    nsa_attention_reference(*args)
    chunks = nsa_reference.SELECTED_QUERY_CHUNKS
    ends = [97 * (c + 1) // chunks for c in range(chunks)]
    sizes = [end - start for start, end in zip([0] + ends[:-1], ends)]
    compressed, window = calls[0], calls[-1]
    assert calls[1:-1] == list(zip(sizes, ends)) and window == (97, 97) and compressed[0] == 97
    calls.clear()
    reference_branches(*args[:8], args[9], args[10], probabilities=True)
    assert calls == []


@pytest.mark.parametrize("num_keys,num_queries,window,expect_banded", [(97, 97, 16, True), (97, 97, 25, False),
                                                                       (97, 1, 16, False), (600, 1, 8, True)])  # fmt: skip
def test_training_form_bands_the_window_where_it_halves_the_pairs(monkeypatch, num_keys, num_queries, window,
                                                                  expect_banded):  # fmt: skip
    """The training form takes the banded window where its chunks cover at most half the (query, slot) pairs of
    the full mask (Tw >= 4w in training; a single query pays for a chunk of w); the written-out form never does
    (its probabilities cover every slot)."""
    from modeling_nsa import nsa_reference

    calls = []
    real = nsa_reference._banded_window_output
    monkeypatch.setattr(nsa_reference, "_banded_window_output", lambda *a: calls.append(a) or real(*a))
    p = dict(P_A, w=window)
    args, *_ = build_inputs(num_keys, 2, 2, "mean", "kvsplit", "docs", p, num_queries, None)
    nsa_attention_reference(*args)
    assert len(calls) == expect_banded
    reference_branches(*args[:8], args[9], args[10], probabilities=True)
    assert len(calls) == expect_banded


@pytest.mark.parametrize("num_queries", [1, 3])
def test_a_static_cache_step_never_bands_its_ring(num_queries):
    """A static cache's window is a ring (key p at slot p % Tw, queries ending at query_end), not the last Tw key
    positions, so the training form must not band it even where banding would pay (a shared-K/V static cache
    passes its whole key buffer as the window: Tw = 64 >= 2w(2w - 1) at w = 4): both forms agree."""
    query_end, num_keys = 30, 64
    args, *_ = build_inputs(num_keys, 2, 2, "mean", "kvshared", "single", dict(P_A, w=4), num_queries, None)
    q, k_cmp, v_cmp, cmp_end, k_slc, v_slc, k_win, v_win, gates, doc_pos, params = args
    doc_pos = doc_pos.masked_fill(torch.arange(num_keys) > query_end, -1)  # keys past query_end: not written yet
    cmp_end = cmp_end.masked_fill(cmp_end > query_end, -1)
    inputs = (q, k_cmp, v_cmp, cmp_end, k_slc, v_slc, k_win, v_win, doc_pos, params)
    end = torch.tensor([query_end])
    training = reference_branches(*inputs, query_end=end, probabilities=False)
    written = reference_branches(*inputs, query_end=end, probabilities=True)
    for name in ("o_cmp", "o_slc", "o_win"):
        torch.testing.assert_close(getattr(training, name), getattr(written, name), **TOL, msg=name)


def test_cases_exercise_every_rule():
    """The parametrization above must reach: top-n beyond the forced blocks, a window shorter
    than the document, documents, left and right padding, t < l - 1, and all G values."""
    assert {c[1] for c in CASES} >= {1, 2, 3, 6, 16}
    assert {c[3] for c in CASES} == {"mlp", "mean"} and {c[4] for c in CASES} == {"kvsplit", "kvshared"}
    for T, G, Hkv, comp, kv, layout, p, *_ in CASES:
        if T == 97 and layout == "docs":
            longest = max(L for kind, L in layout_rows(layout, T)[0] if kind == "doc")
            assert longest > p["w"] and math.ceil(longest / p["block"]) > p["n"] and longest > p["l"]
    layouts = {c[5] for c in CASES}
    assert {"single", "docs", "pad", "docs-pad"} <= layouts


# ----------------------------------------------------------------------------------------------
# Layout helpers the reference relies on
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout,T", [("single", 1), ("single", 37), ("docs", 97), ("pad", 40), ("docs-pad", 61)])
@pytest.mark.parametrize("p", [P_A, P_WIDE, P_NOOVL], ids=["A", "wide", "noovl"])
def test_layout_matches_naive(layout, T, p):
    params = make_params(**p)
    expected = doc_pos_tensor(layout, T)
    # Rebuild doc_pos the way the model does: position_ids restarting at 0 + attention_mask.
    position_ids = torch.stack([torch.tensor([max(x, 0) for x in row]) for row in expected.tolist()])
    attention_mask = (expected >= 0).long()
    got = document_positions(position_ids, attention_mask, expected.shape[0], T, torch.device("cpu"))
    assert got.tolist() == expected.tolist()
    if "docs" not in layout:  # no packed documents: the mask alone must do
        got = document_positions(None, attention_mask, expected.shape[0], T, torch.device("cpu"))
        assert got.tolist() == expected.tolist()
    ends = compressed_token_ends(expected, params)
    assert ends.tolist() == naive_cmp_end(expected, params, ends.shape[1]).tolist()


# ----------------------------------------------------------------------------------------------
# The attention layer (projections, RoPE, compressor, kv_per_branch) against the naive layer
# ----------------------------------------------------------------------------------------------

LAYER_CASES = [
    # (T, heads, kv heads, compressor, kv_per_branch, layout)
    (45, 6, 1, "mlp", True, "docs"),
    (45, 6, 2, "mlp", False, "pad"),
    (40, 4, 2, "mean", True, "docs-pad"),
    (40, 3, 3, "mean", False, "single"),
    (1, 2, 1, "mlp", True, "single"),
    (45, 4, 2, "mean_mlp", True, "docs-pad"),
    # one branch's own K/V set and one shared by the other two (kv_per_branch naming the branch)
    (45, 6, 2, "mlp", "win", "docs"),
    (40, 4, 2, "mean", "cmp", "docs-pad"),
    (45, 6, 3, "mean_mlp", "slc", "pad"),
]


def layer_id(c):
    T, H, Hkv, comp, kvb, layout = c
    kv_layout = {True: "kvsplit", False: "kvshared"}.get(kvb, f"kv-own-{kvb}")
    return f"T{T}-G{H // Hkv}-{comp}-{kv_layout}-{layout}"


@pytest.mark.parametrize("case", LAYER_CASES, ids=[layer_id(c) for c in LAYER_CASES])
def test_attention_layer_matches_naive(case):
    T, H, Hkv, comp, kvb, layout = case
    config = tiny_config(num_attention_heads=H, num_key_value_heads=Hkv, compressor=comp, kv_per_branch=kvb,
                         num_hidden_layers=1, rope_theta=100.0)  # fmt: skip
    torch.manual_seed(0)
    model = NSAForCausalLM(config).double().eval()
    gen = torch.Generator().manual_seed(1)
    randomize_(model, gen, std=0.3)
    layer = model.model.layers[0].self_attn
    doc_pos = doc_pos_tensor(layout, T)
    B = doc_pos.shape[0]
    x = torch.randn(B, T, config.hidden_size, generator=gen, dtype=torch.float64).requires_grad_()
    out, _ = layer(x, doc_pos, layer_inputs(model, x, doc_pos))
    naive = naive_layer_forward(layer, x, doc_pos, config)
    mask = valid_mask(doc_pos)
    torch.testing.assert_close(out[mask], naive[mask], **TOL)

    weight = torch.randn(out.shape, generator=gen, dtype=torch.float64) * mask[:, :, None]
    params = dict(layer.named_parameters())
    expected_names = {"q_proj.weight", "kv_proj.weight", "o_proj.weight", "g_proj.weight"}
    if comp in ("mlp", "mean_mlp"):
        expected_names |= {f"compressor.{kv}_{n}" for kv in "kv" for n in ("pos_emb", "mlp.0.weight", "mlp.0.bias", "mlp.2.weight", "mlp.2.bias")}
    assert set(params) == expected_names, "layer parameters changed: update naive_layer_forward"
    assert layer.kv_proj.weight.shape[0] == {True: 3, False: 1}.get(kvb, 2) * 2 * Hkv * config.head_dim
    tensors = [x, *params.values()]
    g_out = _grads(out, weight, tensors)
    g_naive = _grads(naive, weight, tensors)
    for name, a, b in zip(["x", *params], g_out, g_naive):
        torch.testing.assert_close(a, b, **TOL, msg=lambda m, name=name: f"grad wrt {name}: {m}")


def test_bench_reference_cpu_times_each_form(monkeypatch, capsys):
    """bench/bench_reference_cpu.py: the written-out row really runs the written-out form (reference_branches with
    probabilities), the fused rows the training form, in chunks and then in one call per branch, and the model's
    reference and the chunking are the training form's again after."""
    import importlib.util
    from pathlib import Path

    from modeling_nsa import nsa_backend, nsa_reference

    spec = importlib.util.spec_from_file_location("bench_reference_cpu",
                                                  Path(__file__).parent.parent / "bench" / "bench_reference_cpu.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    forms = []
    real = nsa_reference.reference_branches

    def spy(*args, probabilities=True, **kwargs):
        forms.append(probabilities)
        return real(*args, probabilities=probabilities, **kwargs)

    monkeypatch.setattr(nsa_reference, "reference_branches", spy)
    banded = []
    real_banded = nsa_reference._banded_window_output
    monkeypatch.setattr(nsa_reference, "_banded_window_output", lambda *a: banded.append(len(forms)) or real_banded(*a))
    settings = (nsa_reference.BANDED_WINDOW_MAX_PAIR_FRACTION, nsa_reference.SELECTED_QUERY_CHUNKS)
    chunked = []  # (forward calls so far, the chunk count in force) at each selected branch of the training form
    real_chunked = nsa_reference._causal_chunks_output
    monkeypatch.setattr(nsa_reference, "_causal_chunks_output",
                        lambda *a: chunked.append((len(forms), nsa_reference.SELECTED_QUERY_CHUNKS)) or real_chunked(*a))
    # 128 tokens = 4 windows of the tiny preset's 32: the fused form bands its window there
    result = bench.main(["--preset", "tiny", "--seq-len", "128", "--batch", "1", "--steps", "1", "--warmup", "0"])
    assert list(result["rows"]) == ["nsa, fused", "nsa, fused, one call per branch", "nsa, written out", "dense mode"]
    assert all(row["s_per_step"] > 0 for row in result["rows"].values())
    layers = 2  # the tiny preset's; one forward a variant, each layer one call
    assert forms == [False] * (2 * layers) + [True] * layers
    assert banded == list(range(1, layers + 1))  # only in the first row's forward, once per layer
    chunks = settings[1]
    assert chunked == [(1, chunks), (2, chunks), (3, 1), (4, 1)]  # the form's chunks in the first row, one in the second
    assert nsa_backend.nsa_attention_reference is nsa_reference.nsa_attention_reference
    assert (nsa_reference.BANDED_WINDOW_MAX_PAIR_FRACTION, nsa_reference.SELECTED_QUERY_CHUNKS) == settings
    assert "| nsa, written out |" in capsys.readouterr().out
