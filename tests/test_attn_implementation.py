"""attention_mode="dense" through transformers' attention interface: attn_implementation picks the function, packed
documents and padding reach each one as it takes them (nsa_layout.dense_attention_kwargs), and NSA mode refuses a
choice it would not use. On CPU: "eager", "sdpa" and "flex_attention" (forward only: torch has no flex backward on
CPU); flash-attn cannot be installed here, so its path is not run."""

from __future__ import annotations

import pytest
import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from modeling_nsa import modeling_nsa
from modeling_nsa.configuration_nsa import NSAConfig
from modeling_nsa.modeling_nsa import NSAForCausalLM

from model_helpers import randomize_, tiny_config

CPU_IMPLEMENTATIONS = ["eager", "sdpa", "flex_attention"]
TOL64 = dict(rtol=1e-10, atol=1e-10)


@pytest.fixture(autouse=True)
def uncompiled_flex(monkeypatch):
    """transformers compiles flex_attention on first use (about 30 s of inductor work on CPU for each new shape);
    the tests run torch's flex_attention itself, the same function uncompiled."""
    import transformers.integrations.flex_attention as transformers_flex
    from torch.nn.attention.flex_attention import flex_attention

    monkeypatch.setattr(transformers_flex, "compile_friendly_flex_attention",
                        lambda query, key, value, training=False, **kwargs: flex_attention(query, key, value, **kwargs))


def dense_model(attn_implementation=None, seed=0):
    torch.manual_seed(seed)
    extra = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    model = NSAForCausalLM(tiny_config(attention_mode="dense", **extra)).double().eval()
    return randomize_(model, torch.Generator().manual_seed(seed + 1), std=0.3)


@pytest.fixture(scope="module")
def inputs():
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 61, (2, 34), generator=gen)
    position_ids = torch.cat([torch.arange(11), torch.arange(3), torch.arange(20)])[None].expand(2, -1)  # 3 documents
    mask = torch.ones(2, 34, dtype=torch.long)
    mask[0, :6] = 0  # left padding
    mask[1, -4:] = 0  # right padding
    return ids, position_ids, mask


def logits_and_grads(model, **batch):
    model.zero_grad()
    logits = model(**batch).logits
    weight = torch.randn(logits.shape, generator=torch.Generator().manual_seed(9), dtype=logits.dtype)
    if "attention_mask" in batch:
        weight = weight * batch["attention_mask"][:, :, None]  # padded positions' outputs are unused
    (logits * weight).sum().backward()
    return logits.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


class Spy:
    """Wraps an attention function and counts the calls (one per layer and forward)."""

    def __init__(self, function):
        self.function, self.calls = function, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.function(*args, **kwargs)


@pytest.fixture
def spy(monkeypatch):
    """spy(name) -> the Spy now registered (or, "eager", used) under that attn_implementation."""

    def install(name):
        if name == "eager":  # not in the registry: the model's own eager_attention_forward is the interface's default
            spied = Spy(modeling_nsa.eager_attention_forward)
            monkeypatch.setattr(modeling_nsa, "eager_attention_forward", spied)
        else:
            spied = Spy(ALL_ATTENTION_FUNCTIONS[name])
            monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, name, spied)
        return spied

    return install


@pytest.mark.parametrize("implementation", CPU_IMPLEMENTATIONS)
@pytest.mark.parametrize("layout", ["packed", "padded", "single"])
def test_every_cpu_implementation_gives_the_dense_results(implementation, layout, inputs, spy):
    """The same logits (and, but for flex on CPU, gradients) as the default path with packed documents, with padding,
    and with one document per row; the implementation asked for is the one that runs."""
    ids, position_ids, mask = inputs
    # use_cache=False: a training forward's path (in eval mode the default builds a cache, and a row after a cache
    # always gets a mask, so "single" would not reach the plain causal kernel without one)
    batch = {"packed": dict(position_ids=position_ids), "padded": dict(attention_mask=mask), "single": {}}[layout]
    batch["use_cache"] = False
    # reference: documents cut apart by hand, each row-piece run alone with the default implementation
    reference = dense_model()
    with torch.no_grad():
        if layout == "packed":
            expected = torch.cat([reference(ids[:, a:b]).logits for a, b in ((0, 11), (11, 14), (14, 34))], dim=1)
        elif layout == "padded":
            expected = torch.zeros(2, 34, reference.config.vocab_size, dtype=torch.float64)
            expected[0, 6:], expected[1, :-4] = reference(ids[:1, 6:]).logits[0], reference(ids[1:, :-4]).logits[0]
        else:
            expected = reference(ids).logits
    _, expected_grads = logits_and_grads(dense_model(), input_ids=ids, **batch)  # the default path's
    model = dense_model(implementation)
    assert model.config._attn_implementation == implementation
    spied = spy(implementation)
    valid = batch.get("attention_mask", torch.ones_like(ids)).bool()
    if implementation == "flex_attention":  # torch: "FlexAttention does not support backward on CPU"
        with torch.no_grad():
            logits = model(ids, **batch).logits
    else:
        logits, grads = logits_and_grads(model, input_ids=ids, **batch)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, expected_grads[name], **TOL64, msg=name)
    assert spied.calls == model.config.num_hidden_layers
    torch.testing.assert_close(logits[valid], expected[valid], **TOL64)


@pytest.mark.parametrize("implementation", CPU_IMPLEMENTATIONS)
def test_from_pretrained_attn_implementation_takes_effect(implementation, tmp_path, inputs, spy):
    dense_model().save_pretrained(tmp_path)
    model = NSAForCausalLM.from_pretrained(tmp_path, attn_implementation=implementation, dtype=torch.float64).eval()
    assert model.config._attn_implementation == implementation
    spied = spy(implementation)
    ids, position_ids, _ = inputs
    with torch.no_grad():
        model(ids, position_ids=position_ids)
    assert spied.calls == model.config.num_hidden_layers


@pytest.mark.parametrize("implementation", ["eager", "flex_attention"])
def test_cached_generation_with_each_implementation_equals_the_default(implementation, inputs, spy):
    """Steps after a cache (dynamic and static): the queries' masks cover the cached keys."""
    ids, _, mask = inputs
    prompt, prompt_mask = ids[:, :9], mask[:, :9]
    kwargs = dict(max_new_tokens=7, min_new_tokens=7, do_sample=False, pad_token_id=0, attention_mask=prompt_mask)
    expected = dense_model().generate(prompt, **kwargs)
    model = dense_model(implementation)
    spied = spy(implementation)
    assert torch.equal(model.generate(prompt, **kwargs), expected)
    assert spied.calls == 7 * model.config.num_hidden_layers  # the prompt and 6 steps after it
    assert torch.equal(model.generate(prompt, cache_implementation="static", **kwargs), expected)


def test_nsa_mode_refuses_an_attn_implementation_it_would_not_use(tmp_path):
    for bad in ("flash_attention_2", "flex_attention"):
        with pytest.raises(ValueError, match=f"attn_implementation='{bad}' applies to attention_mode='dense'"):
            NSAConfig(attn_implementation=bad)
    NSAForCausalLM(tiny_config()).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="attention_mode='nsa' computes its attention with the NSA kernels"):
        NSAForCausalLM.from_pretrained(tmp_path, attn_implementation="flex_attention")
    model = NSAForCausalLM.from_pretrained(tmp_path)  # transformers' default, which NSA mode takes
    assert model.config._attn_implementation == "sdpa"
    with pytest.raises(ValueError, match="nsa_backend"):
        model.set_attn_implementation("flex_attention")


def test_an_unknown_attn_implementation_is_refused_naming_it(tmp_path):
    dense_model().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="flash_attention_9"):
        NSAForCausalLM.from_pretrained(tmp_path, attn_implementation="flash_attention_9")


def test_flash_attention_gets_every_document_as_one_varlen_sequence():
    """flash-attn is not installed here: this checks what the model hands transformers' flash path (the varlen
    lengths of the flattened batch, and after a cache the keys of each row's last document), not flash itself."""
    from modeling_nsa.nsa_layout import dense_attention_kwargs, document_positions

    mask = torch.ones(2, 8, dtype=torch.long)
    mask[0, :2] = 0
    position_ids = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]]).expand(2, -1)
    doc_pos = document_positions(position_ids, mask, 2, 8, "cpu")
    varlen = dense_attention_kwargs("flash_attention_2", doc_pos, num_queries=8)
    # row 0: two padding tokens (a sequence each), a 1-token document, a 5-token one; row 1: 3 + 5 tokens
    assert varlen["attention_mask"] is None
    assert varlen["cu_seq_lens_q"].tolist() == varlen["cu_seq_lens_k"].tolist() == [0, 1, 2, 3, 8, 11, 16]
    assert int(varlen["max_length_q"]) == int(varlen["max_length_k"]) == 5
    step = dense_attention_kwargs("flash_attention_2", doc_pos, num_queries=1)
    assert step["attention_mask"].tolist() == [[0, 0, 0, 1, 1, 1, 1, 1]] * 2
    with pytest.raises(ValueError, match="starts a document"):
        dense_attention_kwargs("flash_attention_2", doc_pos, num_queries=6)


def test_a_hub_flash_kernel_gets_what_flash_attention_gets(monkeypatch):
    """Where flash-attn is not installed but `kernels` is, transformers runs attn_implementation="flash_attention_2" as
    the Hub kernel "kernels-community/flash-attn2" (its flash wrapper, registered with flash's mask function): the
    model must hand it flash's arguments (varlen lengths, a 2-D mask after a cache), not a (B, 1, Tq, Tk) mask."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, flash_attention_mask

    from modeling_nsa.nsa_layout import dense_attention_kwargs, document_positions

    hub_flash = "kernels-community/flash-attn2"
    # registered as transformers' load_and_register_attn_kernel registers a Hub flash kernel
    monkeypatch.setitem(ALL_MASK_ATTENTION_FUNCTIONS._global_mapping, hub_flash, flash_attention_mask)
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[0, :2] = 0
    doc_pos = document_positions(torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]]).expand(2, -1), mask, 2, 8, "cpu")
    for name in (hub_flash, "kernels-community/vllm-flash-attn3"):  # registered, or not yet: the name says flash
        for num_queries in (8, 1):
            got, expected = (dense_attention_kwargs(n, doc_pos, num_queries) for n in (name, "flash_attention_2"))
            assert got.keys() == expected.keys(), (name, num_queries)
            for key, value in expected.items():
                same = (got[key] is None if value is None
                        else torch.equal(torch.as_tensor(got[key]), torch.as_tensor(value)))
                assert same, (name, num_queries, key)
        assert dense_attention_kwargs(name, doc_pos, 8, single_document=True) == {"attention_mask": None}
    # a Hub kernel registered with SDPA's mask function gets SDPA's (B, 1, Tq, Tk) mask, as transformers gives it
    sdpa_like = "kernels-community/sdpa-like"
    monkeypatch.setitem(ALL_MASK_ATTENTION_FUNCTIONS._global_mapping, sdpa_like, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    assert dense_attention_kwargs(sdpa_like, doc_pos, 8)["attention_mask"].shape == (2, 1, 8, 8)
