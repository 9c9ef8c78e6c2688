"""Properties of NSA through NSAForCausalLM (nsa_backend="reference") and of the block selection.

causality, packed documents == documents alone, padded batch == unpadded rows, finiteness for
t < l - 1 and length-1 inputs (forward and backward), and selected-block invariants
(causal, forced blocks present, deterministic, ties to the lower index).
"""

from __future__ import annotations

import pytest
import torch

from modeling_nsa.modeling_nsa import NSAForCausalLM
from modeling_nsa.nsa_layout import NSAParams, compressed_token_ends
from modeling_nsa.nsa_reference import nsa_attention_reference, selection_block_scores

from model_helpers import doc_pos_tensor, make_params, randomize_, tiny_config
from naive_nsa import block_sets_from_reference, naive_nsa_attention, overlap_weight

TOL64 = dict(rtol=1e-10, atol=1e-10)

MODEL_VARIANTS = {
    "mlp-kvsplit-G2": dict(compressor="mlp", kv_per_branch=True),
    "mean-kvshared-G3": dict(compressor="mean", kv_per_branch=False, num_attention_heads=6, num_key_value_heads=2),
}


def make_model(dtype=torch.float64, seed=0, **overrides):
    torch.manual_seed(seed)
    model = NSAForCausalLM(tiny_config(**overrides)).to(dtype).eval()
    return randomize_(model, torch.Generator().manual_seed(seed + 1), std=0.3)


def random_ids(*shape, seed=0, vocab=61):
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module", params=list(MODEL_VARIANTS), ids=list(MODEL_VARIANTS))
def model(request):
    return make_model(**MODEL_VARIANTS[request.param])


# ----------------------------------------------------------------------------------------------
# Model-level properties
# ----------------------------------------------------------------------------------------------


def test_causality(model):
    """Changing tokens at positions >= k never changes logits before k (all three branches, all layers)."""
    T = 45  # > window (12), > n * l' (24): selection and window both drop keys
    ids = random_ids(2, T, seed=3)
    with torch.no_grad():
        base = model(ids).logits
        for k in (1, 7, 8, 20, 33, 44):
            changed = ids.clone()
            changed[:, k:] = random_ids(2, T - k, seed=100 + k)
            assert (changed[:, k:] != ids[:, k:]).any()
            logits = model(changed).logits
            torch.testing.assert_close(logits[:, :k], base[:, :k], rtol=1e-12, atol=1e-12, msg=f"k={k}")
            assert not torch.allclose(logits[:, k:], base[:, k:])


def test_causality_of_gradients():
    """d logits[t] / d embedding[s] is zero for s > t."""
    model = make_model(compressor="mlp")
    T = 30
    emb = model.model.embed_tokens(random_ids(1, T, seed=4)).detach().requires_grad_()
    logits = model(inputs_embeds=emb).logits
    for t in (0, 6, 13, 29):
        (grad,) = torch.autograd.grad(logits[0, t].sum(), emb, retain_graph=True)
        if t + 1 < T:
            assert grad[0, t + 1 :].abs().max() == 0, f"logits at {t} depend on later tokens"
        assert grad[0, : t + 1].abs().sum() > 0


USE_CACHE = {"default-cache": {}, "use_cache-False": {"use_cache": False}}


@pytest.mark.parametrize("cache_kwargs", list(USE_CACHE.values()), ids=list(USE_CACHE))
def test_packed_documents_equal_documents_alone(model, cache_kwargs):
    """position_ids restarting at 0 = separate documents, whether or not the call builds a cache
    (config.use_cache defaults to True, so a plain forward must honour the packing too)."""
    lengths = [17, 5, 1, 30, 9]  # shorter than l, longer than the window, block boundaries crossed
    ids = random_ids(1, sum(lengths), seed=5)
    position_ids = torch.cat([torch.arange(L) for L in lengths])[None]
    with torch.no_grad():
        packed = model(ids, position_ids=position_ids, **cache_kwargs).logits
        start = 0
        for L in lengths:
            alone = model(ids[:, start : start + L]).logits
            torch.testing.assert_close(packed[:, start : start + L], alone, **TOL64, msg=f"document at {start}")
            start += L


@pytest.mark.parametrize("cache_kwargs", list(USE_CACHE.values()), ids=list(USE_CACHE))
def test_packed_documents_gradients_do_not_cross(cache_kwargs):
    model = make_model(compressor="mlp").train()
    lengths = [20, 25]
    emb = model.model.embed_tokens(random_ids(1, 45, seed=6)).detach().requires_grad_()
    position_ids = torch.cat([torch.arange(L) for L in lengths])[None]
    logits = model(inputs_embeds=emb, position_ids=position_ids, **cache_kwargs).logits
    (grad,) = torch.autograd.grad(logits[0, 20:].sum(), emb)
    assert grad[0, :20].abs().max() == 0


@pytest.mark.parametrize("with_position_ids", [False, True], ids=["mask-only", "mask+position_ids"])
def test_padded_batch_equals_unpadded_rows(model, with_position_ids):
    a = random_ids(1, 26, seed=7)[0]
    b = random_ids(1, 40, seed=8)[0]
    c = random_ids(1, 33, seed=9)[0]
    T = 40
    pad = 0
    rows = [
        (torch.cat([torch.full((T - 26,), pad), a]), torch.cat([torch.zeros(T - 26), torch.ones(26)])),  # left
        (b, torch.ones(T)),
        (torch.cat([c, torch.full((T - 33,), pad)]), torch.cat([torch.ones(33), torch.zeros(T - 33)])),  # right
    ]
    ids = torch.stack([r[0] for r in rows]).long()
    mask = torch.stack([r[1] for r in rows]).long()
    kwargs = {}
    if with_position_ids:
        kwargs["position_ids"] = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        batched = model(ids, attention_mask=mask, **kwargs).logits
        assert torch.isfinite(batched).all()
        for row, doc in enumerate((a, b, c)):
            alone = model(doc[None]).logits[0]
            got = batched[row][mask[row].bool()]
            torch.testing.assert_close(got, alone, **TOL64, msg=f"row {row}")


@pytest.mark.parametrize("T", [1, 2, 6, 7], ids=lambda T: f"T{T}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_short_inputs_finite_forward_backward(T, dtype):
    """t < l - 1 (no compressed token visible: o_cmp = 0, probabilities 0) is never NaN/inf."""
    model = make_model(dtype=dtype, compressor="mlp").train()
    ids = random_ids(2, T, seed=T)
    out = model(ids, labels=ids if T > 1 else None)
    assert torch.isfinite(out.logits).all()
    loss = out.loss if T > 1 else out.logits.square().mean()
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is None or torch.isfinite(p.grad).all(), name
    # With padding and a length-1 document in the batch, too.
    model.zero_grad()
    ids = random_ids(2, 9, seed=11)
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[0, :8] = 0  # row 0: 8 pads then a single token
    out = model(ids, attention_mask=mask)
    (out.logits * mask[:, :, None]).sum().backward()
    assert torch.isfinite(out.logits[mask.bool()]).all()
    for name, p in model.named_parameters():
        assert p.grad is None or torch.isfinite(p.grad).all(), name


# ----------------------------------------------------------------------------------------------
# Selected blocks
# ----------------------------------------------------------------------------------------------


def _random_call(T, G, Hkv, params, layout="single", seed=0, D=8, zero_cmp=False):
    g = torch.Generator().manual_seed(seed)
    doc_pos = doc_pos_tensor(layout, T)
    B, H = doc_pos.shape[0], G * Hkv
    cmp_end = compressed_token_ends(doc_pos, params)
    f64 = torch.float64
    q = torch.randn(B, T, H, D, generator=g, dtype=f64)
    k_cmp = torch.randn(B, cmp_end.shape[1], Hkv, D, generator=g, dtype=f64)
    if zero_cmp:
        k_cmp = torch.zeros_like(k_cmp)
    v_cmp = torch.randn(B, cmp_end.shape[1], Hkv, D, generator=g, dtype=f64)
    kv = [torch.randn(B, T, Hkv, D, generator=g, dtype=f64) for _ in range(4)]
    gates = torch.rand(B, T, H, 3, generator=g, dtype=f64)
    return (q, k_cmp, v_cmp, cmp_end, kv[0], kv[1], kv[2], kv[3], gates, doc_pos, params)


def _forced(t, params):
    own = t // params.sel_block_size
    return {j for j in range(own + 1) if j < params.sel_init_blocks or j > own - params.sel_local_blocks}


@pytest.mark.parametrize("layout", ["single", "docs-pad"])
def test_selected_blocks_causal_forced_deterministic(layout):
    params = make_params(l=8, d=4, block=8, n=4, init=1, local=2, w=16)
    args = _random_call(97, 3, 2, params, layout=layout, seed=2)
    _, idx = nsa_attention_reference(*args, return_block_indices=True)
    _, idx2 = nsa_attention_reference(*args, return_block_indices=True)
    assert torch.equal(idx, idx2), "block selection is not deterministic"
    assert idx.dtype == torch.long and idx.shape[-1] == min(params.sel_num_blocks, (97 + 7) // 8)
    doc_pos = args[9]
    sets = block_sets_from_reference(idx)
    saw_topn = False
    for b, row in enumerate(sets):
        for g, per_q in enumerate(row):
            for tq, chosen in enumerate(per_q):
                t = int(doc_pos[b, tq])
                slots = idx[b, g, tq].tolist()
                if t < 0:
                    assert chosen == [], "a padded query selected blocks"
                    continue
                assert len(set(j for j in slots if j >= 0)) == len([j for j in slots if j >= 0]), "duplicate block"
                assert all(j * params.sel_block_size <= t for j in chosen), f"non-causal block at t={t}: {chosen}"
                assert _forced(t, params) <= set(chosen), f"forced blocks missing at t={t}: {chosen}"
                eligible = t // params.sel_block_size + 1
                assert len(chosen) == min(eligible, params.sel_num_blocks)
                saw_topn |= eligible > params.sel_num_blocks
    assert saw_topn


def test_ties_go_to_lower_block_index():
    """Zero compressed keys -> uniform compression probabilities -> every fully covered block
    has the same importance: the free slots go to the lowest-index free blocks."""
    params = make_params(l=8, d=4, block=8, n=5, init=1, local=1, w=16)
    T = 80
    args = _random_call(T, 2, 1, params, zero_cmp=True, seed=4)
    _, idx = nsa_attention_reference(*args, return_block_indices=True)
    sets = block_sets_from_reference(idx)[0][0]
    for t in (40, 63, 71, 79):
        own = t // 8
        # Blocks 1..own-1 are fully covered by visible compressed tokens (weights 1,2,1) and tie; block 0
        # gets 2+1 only, so the three free slots go to blocks 1, 2, 3.
        assert sets[t] == sorted({0, own} | {1, 2, 3}), (t, sets[t])
    assert block_sets_from_reference(idx) == naive_nsa_attention(*args, return_block_indices=True)[1]


def test_ties_when_no_compressed_token_is_visible():
    """t < l - 1: all importances are 0; the free slots go to the lowest indices after the forced ones."""
    params = make_params(l=16, d=4, block=4, n=3, init=1, local=1, w=8)
    args = _random_call(15, 2, 2, params, seed=5)
    _, idx = nsa_attention_reference(*args, return_block_indices=True)
    sets = block_sets_from_reference(idx)[0]
    for g in range(2):
        assert sets[g][14] == [0, 1, 3]  # eligible 0..3, forced 0 and 3, free slot -> 1 (not 2)
        assert sets[g][9] == [0, 1, 2]
        assert sets[g][3] == [0]


def test_overlap_weights_at_paper_defaults():
    """Eq. 9 overlap form: at l=32, d=16, l'=64 block j takes 1,2,2,2,1 from tokens 4j-1 .. 4j+3."""
    params = NSAParams(32, 16, 64, 16, 1, 2, 512)
    T = 256
    doc_pos = torch.arange(T)[None]
    cmp_end = compressed_token_ends(doc_pos, params)
    n_cmp = int((cmp_end >= 0).sum())
    assert n_cmp == (T - 32) // 16 + 1
    p_cmp = torch.eye(cmp_end.shape[1], dtype=torch.float64)[None, None]  # query i: one-hot on token i
    scores = selection_block_scores(p_cmp, cmp_end, doc_pos, T // 64, params, num_kv_heads=1)[0, 0]
    for i in range(n_cmp):
        expected = [overlap_weight(i, j, 32, 16, 64) for j in range(T // 64)]
        assert scores[i].tolist() == expected, i
    for j in range(1, T // 64):
        assert [overlap_weight(i, j, 32, 16, 64) for i in range(4 * j - 1, 4 * j + 4)] == [1, 2, 2, 2, 1]


def test_group_scores_are_sums_of_probabilities():
    """Eq. 10: the group importance is the sum over the G heads of their block importances."""
    params = make_params(l=8, d=4, block=8, n=3)
    T = 40
    doc_pos = torch.arange(T)[None]
    cmp_end = compressed_token_ends(doc_pos, params)
    g = torch.Generator().manual_seed(0)
    p = torch.rand(1, 6, T, cmp_end.shape[1], generator=g, dtype=torch.float64)
    grouped = selection_block_scores(p, cmp_end, doc_pos, 5, params, num_kv_heads=2)
    single = selection_block_scores(p, cmp_end, doc_pos, 5, params, num_kv_heads=6)
    torch.testing.assert_close(grouped, single.view(1, 2, 3, T, 5).sum(2), rtol=1e-12, atol=1e-12)


def test_fully_padded_row_keeps_batch_finite():
    """A row that is all padding (attention_mask all 0) must not put NaN into the other rows or the gradients."""
    model = make_model(dtype=torch.float32, compressor="mlp").train()
    ids = random_ids(2, 12, seed=12)
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1] = 0
    out = model(ids, attention_mask=mask)
    assert torch.isfinite(out.logits).all()
    out.logits[0].sum().backward()
    for name, p in model.named_parameters():
        assert p.grad is None or torch.isfinite(p.grad).all(), name
    with torch.no_grad():
        torch.testing.assert_close(out.logits[0], model(ids[:1]).logits[0], rtol=1e-5, atol=1e-5)
