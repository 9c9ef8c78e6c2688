"""attention_mode="dense" against an independent causal attention, and clear errors on bad input."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from modeling_nsa.configuration_nsa import NSAConfig
from modeling_nsa.modeling_nsa import NSAForCausalLM

from model_helpers import doc_pos_tensor, layer_inputs, naive_layer_forward, randomize_, tiny_config, valid_mask

TOL64 = dict(rtol=1e-10, atol=1e-10)


def dense_model(seed=0, **overrides):
    torch.manual_seed(seed)
    model = NSAForCausalLM(tiny_config(attention_mode="dense", **overrides)).double().eval()
    return randomize_(model, torch.Generator().manual_seed(seed + 1), std=0.3)


# ----------------------------------------------------------------------------------------------
# Dense mode
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout,T", [("single", 1), ("single", 37), ("docs", 41), ("pad", 30), ("docs-pad", 33)])
@pytest.mark.parametrize("heads", [(4, 2), (6, 1), (3, 3)], ids=["G2", "G6", "G1"])
def test_dense_layer_matches_plain_causal_attention(layout, T, heads):
    H, Hkv = heads
    model = dense_model(num_attention_heads=H, num_key_value_heads=Hkv, num_hidden_layers=1, rope_theta=100.0)
    layer = model.model.layers[0].self_attn
    assert not hasattr(layer, "g_proj") and not hasattr(layer, "compressor")
    assert set(dict(layer.named_parameters())) == {"q_proj.weight", "kv_proj.weight", "o_proj.weight"}
    doc_pos = doc_pos_tensor(layout, T)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(doc_pos.shape[0], T, model.config.hidden_size, generator=gen, dtype=torch.float64).requires_grad_()
    out, _ = layer(x, doc_pos, layer_inputs(model, x, doc_pos))
    naive = naive_layer_forward(layer, x, doc_pos, model.config)
    mask = valid_mask(doc_pos)
    torch.testing.assert_close(out[mask], naive[mask], **TOL64)
    weight = torch.randn(out.shape, generator=gen, dtype=torch.float64) * mask[:, :, None]
    tensors = [x, *layer.parameters()]
    g_out = torch.autograd.grad((out * weight).sum(), tensors)
    g_naive = torch.autograd.grad((naive * weight).sum(), tensors)
    for a, b in zip(g_out, g_naive):
        torch.testing.assert_close(a, b, **TOL64)


def test_dense_model_matches_manual_forward():
    """Whole model in dense mode, recomputed by hand: embeddings, RMSNorm, plain causal GQA attention
    with the layer weights, SwiGLU, final norm, lm_head."""
    model = dense_model()
    cfg = model.config
    ids = torch.randint(0, cfg.vocab_size, (2, 29), generator=torch.Generator().manual_seed(3))
    doc_pos = torch.arange(29).expand(2, 29)

    def rms(x, w):  # Llama's RMSNorm normalizes in float32 whatever the model dtype
        x32 = x.float()
        return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps)).to(x.dtype)

    h = model.model.embed_tokens.weight[ids]
    for layer in model.model.layers:
        attn = naive_layer_forward(layer.self_attn, rms(h, layer.input_layernorm.weight), doc_pos, cfg)
        h = h + attn
        y = rms(h, layer.post_attention_layernorm.weight)
        h = h + layer.mlp.down_proj(F.silu(layer.mlp.gate_proj(y)) * layer.mlp.up_proj(y))
    logits = model.lm_head(rms(h, model.model.norm.weight))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, logits, rtol=1e-9, atol=1e-9)


def test_dense_packed_and_padded():
    model = dense_model()
    lengths = [11, 3, 20]
    ids = torch.randint(0, 61, (1, 34), generator=torch.Generator().manual_seed(4))
    position_ids = torch.cat([torch.arange(L) for L in lengths])[None]
    with torch.no_grad():
        packed = model(ids, position_ids=position_ids, use_cache=False).logits
        start = 0
        for L in lengths:
            torch.testing.assert_close(packed[:, start : start + L], model(ids[:, start : start + L]).logits, **TOL64)
            start += L
        mask = torch.ones(2, 34, dtype=torch.long)
        mask[0, :6] = 0
        mask[1, -4:] = 0
        batched = model(ids.expand(2, 34), attention_mask=mask).logits
        torch.testing.assert_close(batched[0, 6:], model(ids[:, 6:]).logits[0], **TOL64)
        torch.testing.assert_close(batched[1, :-4], model(ids[:, :-4]).logits[0], **TOL64)


# ----------------------------------------------------------------------------------------------
# Errors
# ----------------------------------------------------------------------------------------------

BAD_CONFIGS = [
    # (overrides, substrings the message must contain)
    (dict(cmp_block_size=32, cmp_stride=12), ["12", "32"]),  # d does not divide l
    (dict(cmp_block_size=32, cmp_stride=16, sel_block_size=40), ["16", "40"]),  # d does not divide l'
    (dict(num_attention_heads=6, num_key_value_heads=4), ["6", "4"]),
    (dict(compressor="conv"), ["conv"]),
    (dict(nsa_backend="cuda"), ["cuda"]),
    (dict(attention_mode="sparse"), ["sparse"]),
    (dict(sel_num_blocks=3, sel_init_blocks=2, sel_local_blocks=2), ["2", "3"]),  # init + local > n
    (dict(cmp_stride=0), ["cmp_stride", "0"]),
    (dict(window_size=-1), ["window_size", "-1"]),
    (dict(sel_init_blocks=-1), ["-1"]),
    (dict(sel_local_blocks=-1), ["sel_local_blocks", "-1"]),
    (dict(head_dim=15, num_attention_heads=4), ["head_dim", "15"]),  # RoPE rotates pairs
    (dict(training_seq_len=0), ["training_seq_len", "0"]),
    (dict(kv_per_branch="window"), ["kv_per_branch", "'window'", "'win'"]),  # names the branches it takes
    (dict(rope_theta=-1.0), ["rope_theta", "-1.0"]),
    (dict(rope_theta=float("nan")), ["rope_theta", "nan", "finite"]),  # (NaN <= 0 is False: a NaN RoPE base)
    (dict(rope_theta=float("inf")), ["rope_theta", "inf"]),  # (every frequency but the first 0: RoPE nearly off)
    (dict(initializer_range=-0.1), ["initializer_range", "-0.1"]),  # (else a late error from the weights' init)
    (dict(rms_norm_eps=-1.0), ["rms_norm_eps", "-1.0"]),  # (else NaN logits)
    (dict(rms_norm_eps=0.0), ["rms_norm_eps", "0.0"]),
    (dict(head_dim=None, hidden_size=130, num_attention_heads=4), ["head_dim", "130", "4"]),  # no whole quotient
]


@pytest.mark.parametrize(
    "overrides,needles", BAD_CONFIGS, ids=["-".join(f"{k}={v}" for k, v in o.items()) for o, _ in BAD_CONFIGS]
)
def test_invalid_config_raises_naming_the_value(overrides, needles):
    with pytest.raises(ValueError) as info:
        NSAConfig(**overrides)
    message = str(info.value)
    for needle in needles:
        assert needle in message, f"{needle!r} not in {message!r}"


def test_invalid_config_on_load(tmp_path):
    """The same validation runs when a saved config is loaded."""
    import json

    NSAConfig().save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    data = json.loads(path.read_text())
    data["cmp_stride"] = 24
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="24"):
        NSAConfig.from_pretrained(tmp_path)


def test_kv_per_branch_naming_a_branch_saves_and_loads(tmp_path):
    """kv_per_branch as a branch name (that branch's own K/V set, one shared by the other two) survives the
    config's JSON and builds a K/V projection of two sets."""
    NSAConfig(kv_per_branch="win").save_pretrained(tmp_path)
    loaded = NSAConfig.from_pretrained(tmp_path)
    assert loaded.kv_per_branch == "win" and loaded.kv_set_of_branch == {"cmp": 0, "slc": 0, "win": 1}
    model = NSAForCausalLM(tiny_config(kv_per_branch="win", num_hidden_layers=1))
    layer = model.model.layers[0].self_attn
    assert layer.kv_proj.out_features == 2 * 2 * layer.num_kv_heads * layer.head_dim


def test_attention_masks_of_the_wrong_shape_are_refused_naming_the_shapes():
    """A mask must be (batch, past + seq_len): another shape (peft's prompt tuning gave one too short) is refused
    saying what it got, the cached and new lengths, and the shape it must have."""
    from modeling_nsa.nsa_cache import NSACache

    model = NSAForCausalLM(tiny_config()).eval()
    ids = torch.randint(0, 61, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), pytest.raises(ValueError, match=r"shape \(2, 1, 10\); .* must be 2-D .* = \(2, 10\)\.$"):
        model(ids, attention_mask=torch.ones(2, 1, 10, dtype=torch.long))
    cache = NSACache(model.config)
    with torch.no_grad():
        model(ids, attention_mask=torch.ones(2, 10, dtype=torch.long), past_key_values=cache, use_cache=True)
        step = ids[:, :3]
        model(step, attention_mask=torch.ones(2, 13, dtype=torch.long), past_key_values=copy.deepcopy(cache))
        with pytest.raises(ValueError) as info:
            model(step, attention_mask=torch.ones(2, 8, dtype=torch.long), past_key_values=cache, use_cache=True)
    message = str(info.value)
    for needle in ("(2, 8)", "10 cached and 3 new", "(2, 13)"):
        assert needle in message, f"{needle!r} not in {message!r}"


def test_head_dim_none_derives_it_as_llama_does(tmp_path):
    """head_dim=None (a Llama config ported as it is) is hidden_size // num_attention_heads, saved as that number."""
    config = NSAConfig(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=None)
    assert config.head_dim == 32
    config.save_pretrained(tmp_path)
    assert NSAConfig.from_pretrained(tmp_path).head_dim == 32
    assert NSAConfig().head_dim == 64  # the default stays the 125M model's


def test_valid_odd_config_accepted():
    """Any G (not only powers of two), d = l, l > l'."""
    cfg = NSAConfig(num_attention_heads=9, num_key_value_heads=3, cmp_block_size=16, cmp_stride=16, sel_block_size=48,
                    sel_num_blocks=2, sel_init_blocks=1, sel_local_blocks=1)  # fmt: skip
    assert cfg.num_key_value_groups == 3


def test_a_field_set_after_construction_is_checked_when_the_model_is_built():
    config = tiny_config()
    config.window_size = 0  # attribute assignment runs no validation of its own
    with pytest.raises(ValueError, match="window_size must be a positive integer, got 0"):
        NSAForCausalLM(config)
    config = tiny_config()
    config.cmp_stride = 3
    with pytest.raises(ValueError, match="cmp_stride"):
        NSAForCausalLM(config)


def test_an_integer_rope_theta_is_accepted_as_a_float(tmp_path):
    """config.json files often say "rope_theta": 500000."""
    import json

    assert NSAConfig(rope_theta=500000).rope_theta == 500000.0
    NSAConfig().save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    data = json.loads(path.read_text())
    data["rope_theta"] = 500000
    path.write_text(json.dumps(data))
    loaded = NSAConfig.from_pretrained(tmp_path)
    assert isinstance(loaded.rope_theta, float) and loaded.rope_theta == 500000.0
    with pytest.raises(ValueError, match="rope_theta"):
        NSAConfig(rope_theta=0)


def test_rope_parameters_give_rope_theta_and_scaling_is_refused():
    """transformers 5's rope_parameters (rope_scaling before it): plain RoPE takes its rope_theta; a scaled RoPE,
    which NSA does not implement, is refused rather than ignored (also when set after construction)."""
    config = NSAConfig(rope_parameters={"rope_type": "default", "rope_theta": 500000})
    assert config.rope_theta == 500000.0 and "rope_parameters" not in config.to_dict()
    for bad in [dict(rope_parameters={"rope_type": "yarn", "factor": 4.0}),
                dict(rope_scaling={"rope_type": "linear", "factor": 4.0})]:  # fmt: skip
        with pytest.raises(ValueError, match="plain RoPE .*set rope_theta"):
            NSAConfig(**bad)
    config = tiny_config()
    config.rope_parameters = {"rope_type": "linear", "factor": 2.0}
    with pytest.raises(ValueError, match="plain RoPE"):
        NSAForCausalLM(config)
    config = tiny_config()
    config.rope_parameters = {"rope_type": "default", "rope_theta": 1000.0}
    model = NSAForCausalLM(config)
    expected = 1.0 / 1000.0 ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8)
    torch.testing.assert_close(model.model.rotary_emb.inv_freq, expected)


@pytest.mark.parametrize("overrides,needle", [
    (dict(head_dim=48), "head_dim=48"),  # even (RoPE), not a power of two
    (dict(head_dim=16, cmp_block_size=32, cmp_stride=4, sel_block_size=16), "cmp_block_size=32"),  # l > l'
], ids=["head_dim48", "l-above-lsel"])  # fmt: skip
def test_explicit_triton_with_parameters_the_kernels_do_not_handle_fails_when_built(overrides, needle):
    with pytest.raises(ValueError, match=f"nsa_backend='triton' but the Triton kernels do not handle {needle}"):
        NSAForCausalLM(tiny_config(nsa_backend="triton", **overrides))
    NSAForCausalLM(tiny_config(nsa_backend="auto", **overrides))  # 'auto' runs the reference there


@pytest.fixture(scope="module")
def small_model():
    torch.manual_seed(0)
    return NSAForCausalLM(tiny_config()).eval()


@pytest.mark.parametrize("bad", [61, 1000, -1], ids=["vocab", "far", "negative"])
def test_input_ids_outside_vocabulary(small_model, bad):
    ids = torch.randint(0, 61, (2, 10))
    ids[1, 4] = bad
    with pytest.raises(ValueError) as info:
        small_model(ids)
    assert str(bad) in str(info.value) and "61" in str(info.value)


@pytest.mark.parametrize("shape", [(2, 9), (2, 11), (1, 10), (2, 10, 1)], ids=lambda s: "x".join(map(str, s)))
def test_attention_mask_shape_mismatch(small_model, shape):
    ids = torch.randint(0, 61, (2, 10))
    with pytest.raises(ValueError) as info:
        small_model(ids, attention_mask=torch.ones(shape, dtype=torch.long))
    assert str(tuple(shape)) in str(info.value)
    assert "(2, 10)" in str(info.value)


def test_position_ids_length_mismatch(small_model):
    ids = torch.randint(0, 61, (1, 10))
    with pytest.raises(ValueError, match="9"):
        small_model(ids, position_ids=torch.arange(9)[None])


@pytest.mark.parametrize("cu_seqlens", [[2, 5, 10], [0, 7, 5, 10], [0, 5, 11], [0]],
                         ids=["not-from-0", "decreasing", "past-the-row", "one-value"])  # fmt: skip
def test_malformed_cu_seqlens_raise_naming_them(small_model, cu_seqlens):
    ids = torch.randint(0, 61, (1, 10))
    with pytest.raises(ValueError, match="cu_seqlens") as info:
        small_model(ids, cu_seq_lens_q=torch.tensor(cu_seqlens, dtype=torch.int32), use_cache=False)
    assert str(cu_seqlens) in str(info.value)
