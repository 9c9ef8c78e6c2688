"""Model-level behaviour: training steps, gradient checkpointing, tied weights, Auto classes."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from safetensors.torch import load_file, save_file

from modeling_nsa import NSAConfig, NSAForCausalLM

TINY = dict(
    vocab_size=113, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, cmp_block_size=8, cmp_stride=4, sel_block_size=16, sel_num_blocks=3,
    window_size=20, cmp_mlp_hidden_size=32, nsa_backend="reference",
)  # fmt: skip


def test_default_config_is_the_125m_reference_model():
    config = NSAConfig()
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads) == (768, 12, 12)
    assert (config.num_key_value_heads, config.num_key_value_groups, config.head_dim) == (2, 6, 64)
    assert (config.cmp_block_size, config.cmp_stride, config.sel_block_size) == (32, 16, 64)
    assert (config.sel_num_blocks, config.window_size, config.vocab_size) == (16, 512, 50304)
    assert config.tie_word_embeddings and config.attention_mode == "nsa" and config.nsa_backend == "auto"


def test_embeddings_are_tied_and_training_lowers_the_loss():
    torch.manual_seed(0)
    model = NSAForCausalLM(NSAConfig(**TINY)).train()
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    batch = torch.randint(0, 113, (4, 48))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(15):
        loss = model(batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.6 * losses[0], losses


@pytest.mark.parametrize("mode", ["nsa", "dense"])
def test_gradient_checkpointing_gives_the_same_gradients(mode):
    torch.manual_seed(0)
    model = NSAForCausalLM(NSAConfig(**TINY, attention_mode=mode)).double().train()
    batch = torch.randint(0, 113, (2, 40))
    model(batch, labels=batch).loss.backward()
    expected = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    # (transformers >= 5.23 names it activation checkpointing; 5.25 warns at the old name)
    getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()
    assert all(layer.gradient_checkpointing for layer in model.model.layers)
    model(batch, labels=batch).loss.backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], rtol=1e-10, atol=1e-12, msg=name)


def test_num_items_in_batch_turns_the_loss_into_a_token_sum_over_that_count():
    torch.manual_seed(0)
    model = NSAForCausalLM(NSAConfig(**TINY)).double()
    batch = torch.randint(0, 113, (2, 30))
    mean_loss = model(batch, labels=batch).loss
    summed = model(batch, labels=batch, num_items_in_batch=torch.tensor(2 * 29 * 4)).loss
    torch.testing.assert_close(summed * 4, mean_loss)


def test_auto_model_for_causal_lm_builds_from_the_registered_config():
    model = AutoModelForCausalLM.from_config(NSAConfig(**TINY))
    assert isinstance(model, NSAForCausalLM)


def test_cu_seqlens_and_position_id_restarts_describe_the_same_documents():
    torch.manual_seed(0)
    model = NSAForCausalLM(NSAConfig(**TINY)).double().eval()
    lengths = [13, 40, 7]
    ids = torch.randint(0, 113, (1, sum(lengths)))
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    cu_seqlens = torch.tensor([0, 13, 53, 60], dtype=torch.int32)
    by_positions = model(ids, position_ids=position_ids, use_cache=False).logits
    by_cu_seqlens = model(ids, cu_seq_lens_q=cu_seqlens, use_cache=False).logits
    torch.testing.assert_close(by_cu_seqlens, by_positions, rtol=0, atol=0)
    alone = model(ids[:, 13:53], use_cache=False).logits
    torch.testing.assert_close(by_cu_seqlens[:, 13:53], alone, rtol=1e-10, atol=1e-10)


def test_only_a_restart_at_zero_starts_a_document():
    """transformers' packed-sequence rule: a jump in position_ids (ids offset or skipped) is not a document start."""
    torch.manual_seed(0)
    model = NSAForCausalLM(NSAConfig(**TINY)).double().eval()
    ids = torch.randint(0, 113, (1, 30))
    one_document = model(ids, use_cache=False).logits
    jumps = torch.cat([torch.arange(5, 17), torch.arange(40, 58)])[None]  # starts at 5, jumps from 16 to 40
    torch.testing.assert_close(model(ids, position_ids=jumps, use_cache=False).logits, one_document, rtol=0, atol=0)
    restart = torch.cat([torch.arange(12), torch.arange(18)])[None]
    two_documents = model(ids, position_ids=restart, use_cache=False).logits
    torch.testing.assert_close(two_documents[:, 12:], model(ids[:, 12:], use_cache=False).logits, rtol=1e-10, atol=1e-10)


def test_backend_auto_is_reference_on_cpu_and_explicit_triton_without_a_gpu_fails_clearly(monkeypatch):
    from modeling_nsa.modeling_nsa import resolve_nsa_backend

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cpu = torch.device("cpu")
    assert resolve_nsa_backend("auto", cpu) == "reference"
    assert resolve_nsa_backend("reference", cpu) == "reference"
    model = NSAForCausalLM(NSAConfig(**{**TINY, "nsa_backend": "triton"}))
    with pytest.raises(RuntimeError, match="nsa_backend='triton' but .*Use nsa_backend='reference'"):
        model(torch.randint(0, 113, (1, 20)))


def test_rope_is_llamas_rotate_half_and_keeps_the_projection_dtype_under_autocast():
    # The model's RoPE (NSARotaryEmbedding's cos and signed sin, apply_rope's flip) is Llama's rotate-half
    # convention, written out independently in tests/naive_nsa.py; and bf16 projections x float32 cos/sin
    # (autocast): rotated once in float32, rounded back to bf16, so the attention gets (and the K cache keeps)
    # bf16, not a float32 promotion
    from naive_nsa import rope_naive

    from modeling_nsa.modeling_nsa import NSARotaryEmbedding, apply_rope

    gen = torch.Generator().manual_seed(0)
    config = NSAConfig(**TINY)
    positions = torch.randint(-1, 500, (2, 5), generator=gen)  # (padding, -1, is rotated as position 0)
    x = torch.randn(2, 5, 3, config.head_dim, generator=gen, dtype=torch.float64)
    cos, signed_sin = NSARotaryEmbedding(config)(positions, torch.float64)
    expected = rope_naive(x, positions.clamp(min=0)[..., None], config.rope_theta)
    torch.testing.assert_close(apply_rope(x, cos[:, :, None], signed_sin[:, :, None]), expected, rtol=1e-6, atol=1e-6)

    x = x.to(torch.bfloat16)
    cos, signed_sin = NSARotaryEmbedding(config)(positions, torch.float32)
    out = apply_rope(x, cos[:, :, None], signed_sin[:, :, None])
    assert out.dtype == torch.bfloat16
    exact = apply_rope(x.double(), cos.double()[:, :, None], signed_sin.double()[:, :, None])
    torch.testing.assert_close(out, exact.to(torch.bfloat16), rtol=0, atol=0)


def test_hidden_states_and_tuple_outputs_follow_transformers():
    """output_hidden_states gives num_hidden_layers + 1 states (the embeddings, each layer's output, the last one
    normalized), from forward, the config and generate(); return_dict=False gives a tuple, as for Llama."""
    torch.manual_seed(0)
    model = NSAForCausalLM(NSAConfig(**TINY)).double().eval()
    ids = torch.randint(0, 113, (2, 21))
    layer_outputs = []
    hooks = [layer.register_forward_hook(lambda m, a, out: layer_outputs.append(out)) for layer in model.model.layers]
    out = model(ids, output_hidden_states=True, use_cache=False)
    for hook in hooks:
        hook.remove()
    states = out.hidden_states
    assert len(states) == TINY["num_hidden_layers"] + 1
    torch.testing.assert_close(states[0], model.model.embed_tokens(ids))
    for k in range(1, len(states) - 1):
        torch.testing.assert_close(states[k], layer_outputs[k - 1])
    torch.testing.assert_close(states[-1], model.model.norm(layer_outputs[-1]))
    assert model(ids, use_cache=False).hidden_states is None
    model.config.output_hidden_states = True
    assert len(model.model(ids, use_cache=False).hidden_states) == TINY["num_hidden_layers"] + 1
    model.config.output_hidden_states = False
    generated = model.generate(ids[:, :5], max_new_tokens=3, do_sample=False, output_hidden_states=True,
                               return_dict_in_generate=True, pad_token_id=0)  # fmt: skip
    assert len(generated.hidden_states) == 3 and all(len(step) == TINY["num_hidden_layers"] + 1 for step in generated.hidden_states)
    loss, logits = model(ids, labels=ids, use_cache=False, return_dict=False)
    torch.testing.assert_close(logits, model(ids, use_cache=False).logits)
    assert loss.ndim == 0 and isinstance(model.model(ids, use_cache=False, return_dict=False), tuple)
    model.config.return_dict = False  # the config's default for every call: tuples from both classes
    loss, logits = model(ids, labels=ids, use_cache=False)
    torch.testing.assert_close(logits, model(ids, use_cache=False, return_dict=True).logits)
    model.config.return_dict = True


def test_output_attentions_in_dense_mode_with_eager_attention():
    """Dense mode with attn_implementation="eager" returns each layer's softmax weights (B, H, Tq, Tk), as Llama
    does: rows of one, causal, confined to each packed document, and they reproduce the layer's attention output.
    With SDPA, and in NSA mode, attentions is None and a log line says why."""
    torch.manual_seed(0)
    model = NSAForCausalLM(NSAConfig(**{**TINY, "attention_mode": "dense", "attn_implementation": "eager"})).double()
    ids = torch.randint(0, 113, (2, 12))
    position_ids = torch.cat([torch.arange(5), torch.arange(7)]).expand(2, 12)  # two documents per row
    out = model(ids, position_ids=position_ids, output_attentions=True, use_cache=False)
    assert len(out.attentions) == TINY["num_hidden_layers"]
    for weights in out.attentions:
        assert weights.shape == (2, TINY["num_attention_heads"], 12, 12)
        torch.testing.assert_close(weights.sum(-1), torch.ones(2, TINY["num_attention_heads"], 12, dtype=weights.dtype))
        assert (weights.triu(1) == 0).all()  # causal
        assert (weights[..., 5:, :5] == 0).all()  # the second document never sees the first
    assert model(ids, position_ids=position_ids, use_cache=False).attentions is None  # only when asked
    # the weights are the ones the layer used: weights @ V through o_proj gives its attention output
    attention = model.model.layers[0].self_attn
    captured = {}
    handle = attention.register_forward_hook(lambda m, a, o: captured.update(out=o[0], args=a))
    model(ids, position_ids=position_ids, output_attentions=True, use_cache=False)
    handle.remove()
    hidden = captured["args"][0]
    kv = attention.kv_proj(hidden).view(2, 12, attention.num_kv_sets * 2, TINY["num_key_value_heads"], 16).unbind(2)
    _, v = attention._branch_kv(kv, "slc")
    v = v.repeat_interleave(TINY["num_attention_heads"] // TINY["num_key_value_heads"], dim=2).transpose(1, 2)
    expected = attention.o_proj((out.attentions[0] @ v).transpose(1, 2).reshape(2, 12, -1))
    torch.testing.assert_close(captured["out"], expected)
    sdpa = NSAForCausalLM(NSAConfig(**{**TINY, "attention_mode": "dense"}))
    assert sdpa(ids, output_attentions=True, use_cache=False).attentions is None  # (a log line says to use eager)
    assert NSAForCausalLM(NSAConfig(**TINY))(ids, output_attentions=True, use_cache=False).attentions is None


def test_hidden_act_is_the_mlps_activation_and_checked():
    torch.manual_seed(0)
    silu = NSAForCausalLM(NSAConfig(**TINY)).eval()
    gelu = NSAForCausalLM(NSAConfig(**{**TINY, "hidden_act": "gelu_pytorch_tanh"})).eval()
    gelu.load_state_dict(silu.state_dict())
    ids = torch.randint(0, 113, (1, 16))
    assert (silu(ids).logits - gelu(ids).logits).abs().max() > 1e-3  # the same weights, another activation
    with pytest.raises(ValueError, match=r"hidden_act must be one of transformers' activations .* got 'swishy'"):
        NSAConfig(**{**TINY, "hidden_act": "swishy"})


@pytest.mark.parametrize("mode", ["nsa", "dense"])
def test_a_training_step_waits_for_the_device_only_at_the_vocabulary_check(mode):
    """A training forward and backward (padding, packed documents, labels) makes the host wait for the device only
    where the model checks the token ids against the vocabulary, once per forward: anything else that reads a
    device value on the host (.item(), a boolean index, nonzero, ...) stalls every step of a GPU run while the
    queue drains. The Triton op's launchers are held to none (triton_helpers.run_host_sync_case)."""
    import inspect

    from modeling_nsa import modeling_nsa
    from triton_helpers import HostSyncRecorder

    source = inspect.getsource(modeling_nsa).splitlines()
    vocabulary_check = 1 + next(i for i, line in enumerate(source) if "int(input_ids.min()), int(input_ids.max())" in line)
    torch.manual_seed(0)
    model = NSAForCausalLM(NSAConfig(**dict(TINY, attention_mode=mode))).train()
    ids = torch.randint(0, 113, (2, 64))
    attention_mask = torch.ones(2, 64, dtype=torch.long)
    attention_mask[1, :7] = 0
    position_ids = (torch.arange(64) % 40).expand(2, -1)
    for inputs in (dict(attention_mask=attention_mask), dict(position_ids=position_ids)):
        with HostSyncRecorder() as recorder:
            model(ids, labels=ids, **inputs).loss.backward()
        assert len(recorder.ops) > 100  # the step ran under the recorder
        assert set(recorder.syncs) == {f"_local_scalar_dense at modeling_nsa.py:{vocabulary_check}"}, recorder.syncs
        assert len(recorder.syncs) == 2  # the ids' min and max


def test_mean_mlp_compressor_starts_as_the_mean_and_learns_away_from_it(tmp_path):
    """compressor="mean_mlp" = the block mean + the paper's φ with its output layer at zero. At initialization the
    model computes what compressor="mean" computes with the same other weights; a training step moves φ (the
    output layer first: the hidden layer's gradient passes through it); from_pretrained keeps the trained φ (the
    zero start must not overwrite loaded weights)."""
    torch.manual_seed(0)
    model = NSAForCausalLM(NSAConfig(**TINY, compressor="mean_mlp")).double()
    mean_model = NSAForCausalLM(NSAConfig(**TINY, compressor="mean")).double()
    missing, unexpected = mean_model.load_state_dict(model.state_dict(), strict=False)
    assert not missing and unexpected and all(".compressor." in name for name in unexpected)
    batch = torch.randint(0, 113, (2, 61), generator=torch.Generator().manual_seed(1))  # 61: 14 compressed tokens
    start = model(batch).logits
    torch.testing.assert_close(start, mean_model(batch).logits, rtol=0, atol=0)

    compressor = model.model.layers[0].self_attn.compressor
    assert compressor.k_mlp[0].weight.abs().min() > 0 and compressor.k_pos_emb.abs().min() > 0
    model(batch, labels=batch).loss.backward()
    for output_layer in (compressor.k_mlp[2], compressor.v_mlp[2]):
        assert output_layer.weight.abs().max() == 0 and output_layer.weight.grad.abs().max() > 0
    torch.optim.AdamW(model.parameters(), lr=1e-2).step()
    assert compressor.k_mlp[2].weight.abs().max() > 0 and compressor.v_mlp[2].bias.abs().max() > 0
    trained = model(batch).logits
    assert not torch.allclose(trained, start)

    model.save_pretrained(tmp_path)
    reloaded = NSAForCausalLM.from_pretrained(tmp_path, torch_dtype=torch.float64)
    for name, tensor in model.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], tensor), name
    torch.testing.assert_close(reloaded(batch).logits, trained, rtol=1e-12, atol=1e-12)  # (train vs eval form)

    # a checkpoint without φ's output layers (e.g. converted from "mean"): those start at zero again, even though
    # the compressor's own parameters (the position embeddings) all loaded and transformers skips its visit
    weights = tmp_path / "model.safetensors"
    saved = load_file(weights)
    kept = {name: t for name, t in saved.items() if "_mlp.2." not in name}
    assert len(kept) == len(saved) - 4 * model.config.num_hidden_layers  # k/v output layers' weight and bias
    save_file(kept, weights, metadata={"format": "pt"})
    partial = NSAForCausalLM.from_pretrained(tmp_path, torch_dtype=torch.float64)
    for name, tensor in partial.state_dict().items():
        assert torch.equal(tensor, torch.zeros_like(tensor) if "_mlp.2." in name else model.state_dict()[name]), name
