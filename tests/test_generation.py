"""Cached generation computes the same function as the full forward (NSA_SPEC, "Incremental decoding")."""

import json
from pathlib import Path

import pytest
import torch

from modeling_nsa import NSACache, NSAConfig, NSAForCausalLM
from modeling_nsa.modeling_nsa import CACHE_NAME  # generate()'s name for the cache: "cache" from transformers 5.24
from triton_helpers import HostSyncRecorder

# Small blocks so that 70 generated tokens cross compression (l=8, d=4), selection (l'=16, n=3)
# and window (w=20) boundaries many times.
TINY = dict(
    vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=6,
    num_key_value_heads=2, head_dim=16, cmp_block_size=8, cmp_stride=4, sel_block_size=16, sel_num_blocks=3,
    window_size=20, cmp_mlp_hidden_size=32, nsa_backend="reference",
)  # fmt: skip

VARIANTS = {
    "mlp-kvsplit": dict(compressor="mlp", kv_per_branch=True),
    "mean-kvshared": dict(compressor="mean", kv_per_branch=False),
    # the compressor's own K/V set, the window reading the selection's keys (kept apart from the raw-key tail)
    "mean-kv-own-cmp": dict(compressor="mean", kv_per_branch="cmp"),
    "dense": dict(attention_mode="dense"),
}


def make_model(seed=0, **overrides):
    torch.manual_seed(seed)
    return NSAForCausalLM(NSAConfig(**{**TINY, **overrides})).double().eval()


def next_token_logits_without_cache(model, sequences, prompt_len):
    """The logits each of generate()'s steps should have had, from one forward over its whole output without a
    cache: the model is causal, so position t's logits are those of a full recompute over the first t + 1 tokens
    (B, steps, vocab)."""
    return model(sequences, use_cache=False).logits[:, prompt_len - 1 : -1]


@pytest.mark.parametrize("variant", list(VARIANTS), ids=list(VARIANTS))
@pytest.mark.parametrize("prompt_len", [1, 7, 33], ids=lambda n: f"prompt{n}")
def test_greedy_generate_with_cache_equals_full_recompute(variant, prompt_len):
    model = make_model(**VARIANTS[variant])
    prompt = torch.randint(0, 97, (2, prompt_len), generator=torch.Generator().manual_seed(prompt_len))
    steps = 70
    out = model.generate(
        prompt, max_new_tokens=steps, min_new_tokens=steps, do_sample=False, output_logits=True,
        return_dict_in_generate=True, pad_token_id=0,
    )  # fmt: skip
    expected_logits = next_token_logits_without_cache(model, out.sequences, prompt_len)
    assert isinstance(out.past_key_values, NSACache)
    # each generated token is the greedy pick of a recompute without cache (so a greedy loop without cache
    # generates the same sequence), and its logits are the recompute's; generate() returns float32 logits
    assert torch.equal(out.sequences[:, prompt_len:], expected_logits.argmax(-1))
    torch.testing.assert_close(torch.stack(out.logits, 1), expected_logits.float(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("variant", list(VARIANTS), ids=list(VARIANTS))
def test_cached_logits_match_full_forward_for_chunks_and_single_tokens(variant):
    model = make_model(**VARIANTS[variant])
    tokens = torch.randint(0, 97, (2, 90), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(tokens, use_cache=False).logits
        cache = NSACache(model.config)
        pieces = [model(tokens[:, :13], past_key_values=cache, use_cache=True).logits]
        pieces.append(model(tokens[:, 13:18], past_key_values=cache, use_cache=True).logits)  # a chunk after a cache
        pieces += [model(tokens[:, t : t + 1], past_key_values=cache, use_cache=True).logits for t in range(18, 90)]
    torch.testing.assert_close(torch.cat(pieces, 1), full, rtol=1e-9, atol=1e-9)
    assert cache.get_seq_length() == 90


@pytest.mark.parametrize("variant", list(VARIANTS), ids=list(VARIANTS))
def test_chunks_with_padding_gaps_and_document_restarts_give_the_full_forward_logits(variant):
    """The document rules (a new document where position_ids is 0 and after padding) hold across chunks: a
    chunk's first token may follow padding or start a document, a gap may open inside a chunk. Padded tokens
    are never attended: changing their ids changes no valid logit, cached or not."""
    model = make_model(**VARIANTS[variant])
    T = 64
    tokens = torch.randint(1, 97, (2, T), generator=torch.Generator().manual_seed(5))
    mask = torch.ones(2, T, dtype=torch.long)
    mask[0, :3] = 0  # left padding
    mask[0, 19:22] = 0  # a gap inside the second chunk, running to its end
    mask[0, 30:31] = 0  # a gap inside the third chunk
    mask[1, 40:41] = 0  # a gap that is the first token of a chunk
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)  # generate()'s ids: they run on across gaps
    position_ids[1, 45:] = torch.arange(T - 45)  # row 1: a packed document starts inside a later chunk
    position_ids[1, 52:] = torch.arange(T - 52)  # ... and one at a chunk's first token
    bounds = [0, 9, 22, 40, 46, 52, 53, 57, *range(58, T + 1)]
    valid = mask.bool()

    def chunked(ids):
        cache, pieces = NSACache(model.config), []
        for a, b in zip(bounds, bounds[1:]):
            out = model(ids[:, a:b], attention_mask=mask[:, :b], position_ids=position_ids[:, a:b],
                        past_key_values=cache, use_cache=True)  # fmt: skip
            pieces.append(out.logits)
        return torch.cat(pieces, 1)

    with torch.no_grad():
        full = model(tokens, attention_mask=mask, position_ids=position_ids, use_cache=False).logits
        got = chunked(tokens)
        torch.testing.assert_close(got[valid], full[valid], rtol=1e-9, atol=1e-9)
        other_padding = torch.where(valid, tokens, torch.randint_like(tokens, 1, 97))
        torch.testing.assert_close(chunked(other_padding)[valid], got[valid], rtol=0, atol=0)
        full_other = model(other_padding, attention_mask=mask, position_ids=position_ids, use_cache=False).logits
        torch.testing.assert_close(full_other[valid], full[valid], rtol=0, atol=0)


@pytest.mark.parametrize("variant", list(VARIANTS), ids=list(VARIANTS))
def test_left_padded_batch_generation_equals_one_by_one(variant):
    model = make_model(**VARIANTS[variant])
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(1, 97, (n,), generator=gen) for n in (5, 23, 12)]
    width = max(len(p) for p in prompts)
    batch = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        batch[row, width - len(prompt) :], mask[row, width - len(prompt) :] = prompt, 1
    steps = 40
    batched = model.generate(
        batch, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps, do_sample=False, pad_token_id=0
    )
    for row, prompt in enumerate(prompts):
        alone = model.generate(prompt[None], max_new_tokens=steps, min_new_tokens=steps, do_sample=False, pad_token_id=0)
        assert torch.equal(batched[row, width:], alone[0, len(prompt) :]), f"row {row} differs"


def test_sampling_with_cache_equals_sampling_without_cache():
    model = make_model()
    prompt = torch.randint(0, 97, (3, 9), generator=torch.Generator().manual_seed(3))
    kwargs = dict(max_new_tokens=30, min_new_tokens=30, do_sample=True, top_k=20, temperature=0.9, pad_token_id=0)
    torch.manual_seed(11)
    with_cache = model.generate(prompt, **kwargs)
    torch.manual_seed(11)
    without_cache = model.generate(prompt, use_cache=False, **kwargs)
    assert with_cache.shape == (3, 39)
    assert torch.equal(with_cache, without_cache)


@pytest.mark.parametrize("variant", ["mlp-kvsplit", "mean-kvshared"])
def test_beam_search_with_cache_equals_beam_search_without(variant):
    # beam search reorders the cache's rows every step (NSACache.reorder_cache: every buffer, the positions)
    model = make_model(**VARIANTS[variant])
    prompt = torch.randint(1, 97, (2, 9), generator=torch.Generator().manual_seed(4))
    kwargs = dict(max_new_tokens=30, min_new_tokens=30, num_beams=3, do_sample=False, pad_token_id=0)
    with_cache = model.generate(prompt, **kwargs)
    assert torch.equal(with_cache, model.generate(prompt, use_cache=False, **kwargs))


def test_cache_memory_is_bounded_by_what_nsa_reads():
    model = make_model()
    cfg = model.config
    out = model.generate(
        torch.randint(1, 97, (2, 150)), max_new_tokens=90, min_new_tokens=90, do_sample=False,
        return_dict_in_generate=True, pad_token_id=0,
    )  # fmt: skip
    total = out.sequences.shape[1] - 1  # the last token is generated, never fed back
    for layer in out.past_key_values.layers:
        assert layer.k_win.shape[1] == cfg.window_size  # the window cache never grows beyond w
        assert layer.tail_k.shape[1] == cfg.cmp_block_size - 1
        for name in ("k_win", "v_win", "tail_k", "tail_v"):  # nor does its storage
            assert layer.buffers[name].storage.shape[1] <= 2 * cfg.window_size + 64
        assert layer.cmp_k.shape[1] <= total // cfg.cmp_stride + 1
        expected_emitted = (total - cfg.cmp_block_size) // cfg.cmp_stride + 1
        assert torch.equal(layer.cmp_count, torch.full((2,), expected_emitted))
        assert layer.k_slc.shape[1] == total
    with torch.no_grad():  # right after a long prompt too: its window and tail are copies of its last keys
        cache = model(torch.randint(1, 97, (2, 300)), use_cache=True).past_key_values
    for layer in cache.layers:
        for name in ("k_win", "v_win", "tail_k", "tail_v"):
            assert layer.buffers[name].storage.shape[1] <= 2 * cfg.window_size + 64


@pytest.mark.parametrize("variant", list(VARIANTS), ids=list(VARIANTS))
def test_cached_decoding_step_makes_no_host_synchronization(variant):
    """A generation step queues its GPU work without waiting for it (no .item(), nonzero or data-dependent shapes),
    so steps pipeline. The default cache's decision to skip the compressor at a step comes from a flag copied to
    the host during the step before (NSACache.predict_emits), read without a device read."""
    model = make_model(**VARIANTS[variant])
    prompt = torch.randint(0, TINY["vocab_size"], (2, 37), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(prompt)
    mask[0, :4] = 0  # left padding
    with torch.no_grad():
        out = model(prompt, attention_mask=mask, use_cache=True)
        cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        skipped = 0
        for step in range(6):  # crosses a compression boundary (d=4)
            mask = torch.cat([mask, mask.new_ones(2, 1)], dim=1)
            with HostSyncRecorder() as recorder:
                out = model(token, attention_mask=mask, past_key_values=cache, use_cache=True)
            assert recorder.syncs == [], (step, recorder.syncs)
            cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
            skipped += cache.step is not None and not cache.step.compresses
    # the rows' tokens sit at in-document positions 33-38 and 37-42; only step 2's (35, 39) complete one (p = l - 1 mod d)
    assert skipped == (0 if variant == "dense" else 5)


def test_a_step_said_to_complete_no_compressed_token_completes_none():
    """NSACache.predict_emits promises, at the end of a chunk, that no row's next token completes a compressed token;
    the promise must hold whatever that token's attention mask and position_ids (padding, a new document) and
    after crop() and beam reordering. Random rows and next tokens: wherever it promised, no row emits."""
    from modeling_nsa.nsa_layout import ends_compressed_token

    cfg = NSAConfig(**TINY)
    gen = torch.Generator().manual_seed(7)
    promised = 0
    for trial in range(300):
        batch, length = 3, int(torch.randint(1, 40, (1,), generator=gen))
        mask = (torch.rand(batch, length, generator=gen) > 0.2).long()
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
        restart = int(torch.randint(0, length, (1,), generator=gen))
        position_ids[0, restart:] = torch.arange(length - restart)  # a packed document starting mid-row
        cache = NSACache(cfg)
        cache.append_positions(position_ids, mask, batch, length, "cpu")
        if trial % 3 == 1 and length > 2:
            cache.crop(-int(torch.randint(1, length, (1,), generator=gen)))
        if trial % 3 == 2:
            cache.reorder_cache(torch.randint(0, batch, (batch,), generator=gen))
        if not cache.no_row_can_emit():
            continue
        promised += 1
        past = cache.get_seq_length()
        step_mask = torch.cat([torch.ones(batch, past, dtype=torch.long), (torch.rand(batch, 1, generator=gen) > 0.3).long()], 1)
        step_positions = torch.where(torch.rand(batch, 1, generator=gen) > 0.7, 0, past)  # some rows restart
        cache.append_positions(step_positions, step_mask, batch, 1, "cpu")
        assert not ends_compressed_token(cache.doc_pos[:, -1:], cache.params).any(), trial
        assert not cache.step.compresses
    assert promised > 100


def test_ranks_running_together_never_skip_the_compressor(monkeypatch):
    """Under torch.distributed with several ranks (FSDP or ZeRO-3 may gather the compressor's weights as it runs, a
    collective every rank must join), no step skips the compressor on its own rows' account: ranks whose rows sit
    at different positions would otherwise wait for each other forever."""
    def steps_compress(cache):  # 9 tokens (the next sits at 9: it completes no compressed token), then 3 steps
        cache.append_positions(None, None, 1, 9, "cpu")
        compressing = []
        for _ in range(3):
            cache.append_positions(None, None, 1, 1, "cpu")
            compressing.append(cache.step.compresses)
        return compressing

    assert steps_compress(NSACache(NSAConfig(**TINY))) == [False, False, True]  # at 9, 10; 11 completes one (l=8, d=4)
    monkeypatch.setattr(torch.distributed, "is_available", lambda: True)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    assert steps_compress(NSACache(NSAConfig(**TINY))) == [True, True, True]


@pytest.mark.parametrize("variant", ["mlp-kvsplit", "mean-kvshared"])
def test_generation_without_the_skip_equals_generation_with_it(variant, monkeypatch):
    """A compiled or CUDA-graph-captured default-cache step has no host flag, so it makes every step's compressed
    token (empty where no row completes one): the same tokens and logits as the eager steps that skip it."""
    model = make_model(**VARIANTS[variant])
    prompt, mask = left_padded_prompt()
    kw = dict(max_new_tokens=30, min_new_tokens=30, do_sample=False, output_logits=True, return_dict_in_generate=True,
              pad_token_id=0)  # fmt: skip
    skipping = model.generate(prompt, attention_mask=mask, **kw)
    monkeypatch.setattr(NSACache, "no_row_can_emit", lambda self: False)
    every_step = model.generate(prompt, attention_mask=mask, **kw)
    assert torch.equal(skipping.sequences, every_step.sequences)
    torch.testing.assert_close(torch.stack(skipping.logits, 1), torch.stack(every_step.logits, 1), rtol=1e-5, atol=1e-6)


def _ops_per_layer(run, monkeypatch, **overrides):
    """The ops a model's call launches per layer beyond the first (bench/model_traffic_cpu.py's StepCounter: views
    and allocations not counted; a Counter of op names): run(model, counter) with one and with two layers, the
    attention math stubbed out (its own ops are per layer by nature)."""
    import modeling_nsa.modeling_nsa as modeling

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "bench"))
    import model_traffic_cpu

    monkeypatch.setattr(modeling, "nsa_attention", lambda q, *args, **kwargs: torch.zeros_like(q))
    counts = []
    for layers in (1, 2):
        counter = model_traffic_cpu.StepCounter()
        run(make_model(num_hidden_layers=layers, **overrides), counter)
        counts.append(counter.calls)
    return counts[1] - counts[0]


# the ops of the document layout's index math (ends_compressed_token, compressed_token_ends, the rings' slots)
LAYOUT_OPS = {"remainder", "cumsum", "bitwise_and", "eq"}


@pytest.mark.parametrize("cache", ["none", "default", "static"])
def test_the_compressed_tokens_layout_is_worked_out_once_per_step_not_per_layer(cache, monkeypatch):
    """A forward over whole rows builds the compressed tokens' slots, gather index and RoPE once for every layer
    (nsa_layout.compressed_layout), and a decoding step its token's slots once (nsa_cache.TokenStep): the
    layout's index math is no layer's work (eager decoding dispatches every op of every layer per token)."""
    prompt = torch.randint(0, TINY["vocab_size"], (2, 37), generator=torch.Generator().manual_seed(5))

    def run(model, counter):
        with torch.no_grad():
            if cache == "none":
                with counter:
                    model(prompt, use_cache=False)
                return
            past = NSACache(model.config, max_cache_len=48, static=True) if cache == "static" else None
            out = model(prompt, past_key_values=past, use_cache=True)
            token = out.logits[:, -1:].argmax(-1)
            for step in range(4):  # crosses a compression boundary (d = 4)
                kwargs = dict(cache_position=torch.tensor([37 + step])) if cache == "static" else {}
                with counter:
                    out = model(token, past_key_values=out.past_key_values, use_cache=True, **kwargs)
                token = out.logits[:, -1:].argmax(-1)

    per_layer = _ops_per_layer(run, monkeypatch, **VARIANTS["mlp-kvsplit"])
    assert per_layer["mm"] > 0  # (the second layer was run and counted)
    assert not LAYOUT_OPS & set(per_layer), {op: per_layer[op] for op in LAYOUT_OPS & set(per_layer)}


def test_a_token_step_follows_its_layer_to_another_device():
    """A model split over GPUs (device_map) runs each layer on its own device, with the cache's TokenStep made on
    the first: each layer cache reads it on the device of its own keys (here the meta device stands in for a second
    GPU), and a step already there is used as it is."""
    from modeling_nsa.nsa_cache import TokenStep

    emits = torch.tensor([[True], [False]])
    dynamic = TokenStep(emits, torch.tensor([[5], [-1]]))
    assert dynamic.on(torch.device("cpu")) is dynamic
    moved = dynamic.on(torch.device("meta"))
    assert moved.emits.is_meta and moved.end.is_meta and moved.tail_slot is None and moved.tail_order is None
    static = TokenStep(emits, torch.tensor([[5], [-1]]), torch.tensor([5]), torch.tensor([5]), torch.arange(8))
    moved = static.on(torch.device("meta"))
    assert all(tensor.is_meta for tensor in moved[:5]) and moved.compresses is True
    idle = TokenStep(None, None, compresses=False)  # (no row completes a token: nothing to move)
    assert idle.on(torch.device("meta")) is idle


def test_token_buffer_appends_in_place_and_matches_concatenation():
    from modeling_nsa.nsa_cache import TokenBuffer

    gen = torch.Generator().manual_seed(6)
    grown, window = TokenBuffer(), TokenBuffer(keep_last=20)
    expected, expected_window, reallocations, storage = None, None, 0, None
    for step in range(600):
        new = torch.randn(2, 37 if step == 0 else 1 + step % 3, 3, generator=gen)
        expected = new if expected is None else torch.cat([expected, new], 1)
        got = grown.append(new)
        reallocations += grown.storage is not storage
        storage = grown.storage
        assert torch.equal(got, expected)
        # the window cache: what was kept plus the new tokens, then only the last 20 kept (the old torch.cat)
        with_new = new if expected_window is None else torch.cat([expected_window, new], 1)
        assert torch.equal(window.append(new), with_new)
        expected_window = with_new[:, -20:]
        assert torch.equal(window.view(), expected_window)
    assert reallocations <= 16, reallocations  # 1.25x growth from 37 to about 1,240 tokens: 15, not 600
    assert window.storage.shape[1] <= 2 * 20 + 64 + 3  # bounded by w, not by the sequence
    reserved = TokenBuffer(reserve=1000)
    reserved.append(torch.zeros(1, 10))
    first = reserved.storage
    for _ in range(990):
        reserved.append(torch.ones(1, 1))
    assert reserved.storage is first and reserved.view().shape == (1, 1000)


def test_generate_reserves_its_length_and_never_copies_the_cache(monkeypatch):
    from modeling_nsa.nsa_cache import TokenBuffer

    storages = {}

    def recording(method):
        def record_storage(self, *args):
            out = method(self, *args)
            storages.setdefault(id(self), set()).add(self.storage.data_ptr())
            return out

        return record_storage

    monkeypatch.setattr(TokenBuffer, "append", recording(TokenBuffer.append))
    # the cache's storage is what is checked, not the attention math (the reference's, per token over 400 tokens,
    # was most of this test's time): the attention is stubbed out
    import modeling_nsa.modeling_nsa as modeling

    monkeypatch.setattr(modeling, "nsa_attention", lambda q, *args, **kwargs: torch.zeros_like(q))
    model = make_model(kv_per_branch=True)
    rotated = []  # positions RoPE is computed for per forward: each step's token and the l - 1 before it
    model.model.rotary_emb.register_forward_hook(lambda module, args, output: rotated.append(args[0].shape[1]))
    monkeypatch.setattr(TokenBuffer, "resize", recording(TokenBuffer.resize))
    out = model.generate(
        torch.randint(0, 97, (2, 10)), max_new_tokens=400, min_new_tokens=400, do_sample=False,
        return_dict_in_generate=True, pad_token_id=0,
    )  # fmt: skip
    cache = out.past_key_values
    names = ("k_slc", "v_slc", "cmp_k", "cmp_v", "cmp_end")
    grown = [cache.positions] + [layer.buffers[n] for layer in cache.layers for n in names]
    for buffer in grown:  # one storage for the whole generation, sized for generate()'s max_length
        assert len(storages[id(buffer)]) == 1, buffer
    assert cache.positions.storage.shape[1] >= 409
    for layer in cache.layers:  # the window cache moves its last w keys to the front only when full
        assert len(storages[id(layer.buffers["k_win"])]) <= 10  # 400 tokens, w = 20: every 20+ tokens
    assert rotated[0] == 10 and set(rotated[1:]) == {1 + model.config.cmp_block_size - 1}


@pytest.mark.skipif(not __import__("modeling_nsa.nsa_triton").nsa_triton._HAS_TRITON, reason="triton is not installed")
def test_triton_decoding_step_reads_the_cache_where_it_is():
    """The decode kernels get the cache's buffers themselves (batch strides), not per-token copies."""
    from triton_aot import capture_launches

    from modeling_nsa import nsa_triton

    model = make_model(**VARIANTS["mean-kvshared"])
    prompt = torch.randint(1, 97, (3, 45), generator=torch.Generator().manual_seed(8))
    mask = torch.ones_like(prompt)
    mask[1, :6] = 0
    with torch.no_grad():
        cache = model(prompt, attention_mask=mask, use_cache=True).past_key_values
    layer, doc_pos = cache.layers[0], cache.doc_pos
    window = layer.k_slc[:, -model.config.window_size :], layer.v_slc[:, -model.config.window_size :]
    assert not layer.k_slc.is_contiguous() and not doc_pos.is_contiguous()  # views with room to grow
    q = torch.randn(3, 1, 6, 16, dtype=torch.float64)
    gates = torch.rand(3, 1, 6, 3, dtype=torch.float64)
    launches = capture_launches(lambda: nsa_triton.nsa_decode_triton(
        q, layer.cmp_k, layer.cmp_v, layer.cmp_end, layer.k_slc, layer.v_slc, *window, gates, doc_pos, model.model.layers[0].self_attn.params
    ))  # fmt: skip
    passed = {arg.data_ptr() for _, _, args, _ in launches for arg in args if torch.is_tensor(arg)}
    for tensor in (layer.cmp_k, layer.cmp_v, layer.cmp_end, layer.k_slc, layer.v_slc, *window, doc_pos):
        assert tensor.data_ptr() in passed
    finish = next(args for name, _, args, _ in launches if name == "_decode_finish_kernel")
    strides = [arg for arg in finish if isinstance(arg, int)]
    assert layer.buffers["k_slc"].storage.stride(0) in strides  # the buffer's batch stride, not a copy's


@pytest.mark.parametrize("variant", list(VARIANTS), ids=list(VARIANTS))
def test_decoding_step_allocates_nothing_that_grows_with_the_context(variant, monkeypatch):
    """Outside the attention math (stubbed here), a cached step makes no tensor the size of the cache: it
    appends in place (no torch.cat of the cache) and rotates only the new token (no RoPE of every cached
    position). The largest fresh allocation is the same at 100 and at 1,000 cached tokens."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from modeling_nsa import modeling_nsa

    class LargestAllocation(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.numel = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            inputs = [a for a in (*args, *(kwargs or {}).values()) if torch.is_tensor(a)]
            inputs += [t for a in args if isinstance(a, (list, tuple)) for t in a if torch.is_tensor(t)]
            shared = {t.untyped_storage().data_ptr() for t in inputs}
            for tensor in out if isinstance(out, (list, tuple)) else [out]:
                if torch.is_tensor(tensor) and tensor.untyped_storage().data_ptr() not in shared:  # not a view
                    self.numel = max(self.numel, tensor.numel())
            return out

    monkeypatch.setattr(modeling_nsa, "nsa_attention", lambda q, *args, **kwargs: torch.zeros_like(q))
    model = make_model(**VARIANTS[variant])
    if variant == "dense":  # dense attention reads every key by definition: stub it too (its mask included)
        model.config._attn_implementation = "eager"
        monkeypatch.setattr(modeling_nsa, "dense_attention_kwargs", lambda *args, **kwargs: {"attention_mask": None})
        monkeypatch.setattr(modeling_nsa, "eager_attention_forward",
                            lambda module, q, *args, **kwargs: (torch.zeros_like(q).transpose(1, 2), None))
    largest = []
    for context in (100, 1000):
        prompt = torch.randint(1, 97, (2, context), generator=torch.Generator().manual_seed(context))
        cache = NSACache(model.config, max_cache_len=context + 8)
        with torch.no_grad():
            model(prompt, past_key_values=cache, use_cache=True)
            recorder = LargestAllocation()
            with recorder:
                model(prompt[:, :1], past_key_values=cache, use_cache=True)
        largest.append(recorder.numel)
    assert largest[0] == largest[1], largest


@pytest.mark.parametrize("variant", list(VARIANTS), ids=list(VARIANTS))
def test_assisted_and_prompt_lookup_decoding_give_plain_greedy_tokens(variant):
    # speculative decoding verifies draft tokens in one chunk and takes the rejected ones back
    # (NSACache.crop); greedy verification must reproduce plain greedy decoding exactly
    model = make_model(**VARIANTS[variant])
    assistant = make_model(seed=1, **VARIANTS[variant])  # a different model: most drafts get rejected
    prompt = torch.randint(1, 97, (1, 40), generator=torch.Generator().manual_seed(9))
    prompt[0, 20:30] = prompt[0, :10]  # repeats for prompt lookup to draft from
    kwargs = dict(max_new_tokens=60, min_new_tokens=60, do_sample=False, pad_token_id=0)
    plain = model.generate(prompt, **kwargs)
    assert torch.equal(model.generate(prompt, assistant_model=assistant, **kwargs), plain)
    assert torch.equal(model.generate(prompt, prompt_lookup_num_tokens=5, **kwargs), plain)


def test_continuous_batching_is_refused_at_every_entry_point_before_any_request_runs():
    """generate_batch() and generate(cache_implementation="paged") run the model on transformers' paged cache, which
    cannot hold NSA's state: both end in one clear error, not in a per-request failure inside the batching loop
    (generate_batch() would otherwise return each request FAILED with the model's cache-type error)."""
    from transformers import GenerationConfig

    model = make_model()
    if not hasattr(model, "generate_batch"):
        pytest.skip("this transformers has no continuous batching (generate_batch)")
    calls = []
    model.forward = lambda *args, **kwargs: calls.append(1)  # nothing may run the model
    with pytest.raises(NotImplementedError, match="continuous batching.*left padding"):
        model.generate_batch([[1, 2, 3, 4, 5]], generation_config=GenerationConfig(max_new_tokens=3, do_sample=False))
    prompt = torch.randint(1, 97, (1, 12), generator=torch.Generator().manual_seed(0))
    with pytest.raises(NotImplementedError, match="continuous batching"):
        model.generate(prompt, max_new_tokens=3, do_sample=False, cache_implementation="paged", pad_token_id=0)
    assert calls == []


def test_cache_methods_take_every_argument_the_installed_transformers_passes():
    """generate() calls NSACache through transformers' Cache methods, whose arguments grow between releases (5.25's
    assisted decoding passes activate_past_recording a recurrent_states_to_keep, which broke every speculative
    decoding here). Each method NSACache overrides, but __init__ and update (which the model calls itself), must
    take each of the installed Cache's parameters by the same name, and any keyword where Cache takes any."""
    import inspect

    from transformers import Cache

    overridden = [name for name, value in vars(NSACache).items()
                  if callable(value) and callable(getattr(Cache, name, None)) and name not in ("__init__", "update")]
    assert {"activate_past_recording", "crop", "reorder_cache", "batch_select_indices"} <= set(overridden)
    for name in overridden:
        ours, theirs = (inspect.signature(getattr(cls, name)).parameters for cls in (NSACache, Cache))
        takes_any_keyword = any(p.kind is p.VAR_KEYWORD for p in ours.values())
        for parameter in theirs.values():
            if parameter.kind is parameter.VAR_KEYWORD:
                assert takes_any_keyword, f"NSACache.{name} takes no **kwargs; transformers' Cache.{name} does"
            elif parameter.kind is not parameter.VAR_POSITIONAL:
                assert parameter.name in ours or takes_any_keyword, (
                    f"NSACache.{name} has no parameter {parameter.name!r}, which transformers' Cache.{name} takes"
                )


@pytest.mark.parametrize("variant", ["mlp-kvsplit", "dense"])
def test_early_exit_drafts_with_the_first_layers_and_gives_plain_greedy_tokens(variant):
    """generate(assistant_early_exit=1) (self-speculative decoding, LayerSkip) drafts with the model's first layer:
    transformers sets config.num_hidden_layers to 1 for the draft calls, and the forward runs that many layers (as
    Llama's), so the drafts' cache of one layer suffices. The verified tokens are plain greedy's."""
    model = make_model(**VARIANTS[variant])
    prompt = torch.randint(1, 97, (1, 40), generator=torch.Generator().manual_seed(9))
    kwargs = dict(max_new_tokens=30, min_new_tokens=30, do_sample=False, pad_token_id=0)
    plain = model.generate(prompt, **kwargs)
    calls = [0] * len(model.model.layers)

    def count(index):
        def hook(module, args, output):
            calls[index] += 1
        return hook

    hooks = [layer.register_forward_hook(count(i)) for i, layer in enumerate(model.model.layers)]
    try:
        early_exit = model.generate(prompt, assistant_early_exit=1, **kwargs)
    finally:
        for hook in hooks:
            hook.remove()
    assert torch.equal(early_exit, plain)
    assert calls[0] > calls[1] > 0, calls  # the draft calls ran the first layer only, the verifications both
    assert model.config.num_hidden_layers == 2  # (transformers restores it after each draft)


def test_training_forwards_build_no_cache_and_evaluation_forwards_do():
    """use_cache defaults to the config's only outside training: a training step keeps no K/V cache (memory)."""
    model = make_model()
    ids = torch.randint(1, 97, (1, 30), generator=torch.Generator().manual_seed(3))
    assert model.train()(ids).past_key_values is None
    assert isinstance(model.eval()(ids).past_key_values, NSACache)
    assert model.train()(ids, use_cache=True).past_key_values is not None  # asked for: built


@pytest.mark.parametrize("variant", list(VARIANTS), ids=list(VARIANTS))
def test_crop_takes_tokens_back_exactly(variant):
    model = make_model(**VARIANTS[variant])
    tokens = torch.randint(1, 97, (2, 70), generator=torch.Generator().manual_seed(10))
    draft = torch.randint(1, 97, (2, 12), generator=torch.Generator().manual_seed(11))
    mask = torch.ones(2, 82, dtype=torch.long)
    mask[1, :7] = 0  # left padding: the rows' compressed tokens fall at different steps
    with torch.no_grad():
        full = model(tokens, attention_mask=mask[:, :70], use_cache=False).logits
    # kept = 46 / 47: the first token taken back completes a compressed token (l = 8, d = 4: row 1's ends at
    # 46, row 0's at 47), which goes with it
    for kept in (45, 46, 47):
        with torch.no_grad():
            cache = NSACache(model.config)
            model(tokens[:, :kept], attention_mask=mask[:, :kept], past_key_values=cache, use_cache=True)
            cache.activate_past_recording()
            model(draft[:, :5], attention_mask=mask[:, : kept + 5], past_key_values=cache, use_cache=True)  # a chunk
            for t in range(5, 12):  # and single tokens
                model(draft[:, t : t + 1], attention_mask=mask[:, : kept + 1 + t], past_key_values=cache,
                      use_cache=True)  # fmt: skip
            cache.crop(-12)  # across compression (d = 4), selection (l' = 16) and window (w = 20) boundaries
            assert cache.get_seq_length() == kept
            rest = [model(tokens[:, t : t + 1], attention_mask=mask[:, : t + 1], past_key_values=cache,
                          use_cache=True).logits for t in range(kept, 70)]  # fmt: skip
        torch.testing.assert_close(torch.cat(rest, 1)[0], full[0, kept:], rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(torch.cat(rest, 1)[1], full[1, kept:], rtol=1e-9, atol=1e-9)


def test_crop_deeper_than_what_the_cache_kept_says_how_to_allow_it():
    model = make_model()  # separate window K/V: only the last w = 20 are kept without recording
    cache = NSACache(model.config)
    with torch.no_grad():
        model(torch.randint(1, 97, (1, 60)), past_key_values=cache, use_cache=True)
    cache.crop(0)
    with pytest.raises(ValueError, match="activate_past_recording"):
        cache.crop(-30)
    assert cache.get_seq_length() == 60 and cache.layers[0].k_slc.shape[1] == 60  # nothing changed
    with pytest.raises(ValueError, match="minus the number of tokens"):
        cache.crop(5)


def test_a_requested_cache_implementation_is_declined_in_the_log(caplog):
    import logging

    from modeling_nsa import modeling_nsa

    modeling_nsa._logged_once.clear()
    model = make_model()
    with caplog.at_level(logging.WARNING):
        out = model.generate(torch.randint(1, 97, (1, 5)), max_new_tokens=3, do_sample=False, pad_token_id=0,
                             cache_implementation="offloaded", return_dict_in_generate=True)
    assert isinstance(out.past_key_values, NSACache) and not out.past_key_values.static
    assert any("cache_implementation='offloaded' is ignored" in r.getMessage() for r in caplog.records)
    caplog.clear()  # "static" is honoured (NSACache(static=True)), so not declined
    with caplog.at_level(logging.WARNING):
        out = model.generate(torch.randint(1, 97, (1, 5)), max_new_tokens=3, do_sample=False, pad_token_id=0,
                             cache_implementation="static", return_dict_in_generate=True)
    assert out.past_key_values.static
    assert not any("is ignored" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("variant", list(VARIANTS), ids=list(VARIANTS))
def test_gradients_flow_through_chunks_after_a_cache(variant):
    # two chunks with gradients after a cache filled without: the same function of the parameters as one
    # chunk of both, so the same gradients (the cache's in-place writes must not break autograd's saved views)
    model = make_model(**VARIANTS[variant])
    tokens = torch.randint(1, 97, (1, 40), generator=torch.Generator().manual_seed(12))
    grads = []
    for chunks in ([(30, 40)], [(30, 35), (35, 40)]):
        model.zero_grad()
        cache = NSACache(model.config)
        with torch.no_grad():
            model(tokens[:, :30], past_key_values=cache, use_cache=True)
        logits = [model(tokens[:, a:b], past_key_values=cache, use_cache=True).logits for a, b in chunks]
        torch.cat(logits, 1).pow(2).sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-9, atol=1e-9)


def test_recording_stops_when_transformers_clears_it():
    model = make_model()  # separate window K/V
    cache = NSACache(model.config)
    cache.activate_past_recording()
    with torch.no_grad():
        model(torch.randint(1, 97, (1, 30)), past_key_values=cache, use_cache=True)
        for layer in cache.layers:
            assert layer.record_past
            layer.record_past = False  # what generate() does when it hands a recording cache back
        for _ in range(3):
            model(torch.randint(1, 97, (1, 1)), past_key_values=cache, use_cache=True)
    assert all(layer.k_win.shape[1] == model.config.window_size for layer in cache.layers)


def test_a_prompt_recorded_whole_does_not_size_the_window_storage_after_a_crop():
    # assisted decoding turns recording on before the prompt: the first crop gives the prompt-sized window and
    # tail storage back
    model = make_model()
    cache = NSACache(model.config)
    cache.activate_past_recording()
    with torch.no_grad():
        model(torch.randint(1, 97, (1, 400)), past_key_values=cache, use_cache=True)
    cache.crop(-2)
    for layer in cache.layers:
        for name in ("k_win", "v_win", "tail_k", "tail_v"):
            assert layer.buffers[name].storage.shape[1] <= 4 * 64, name


# ---------------------------------------------------------------- static cache (compiled decoding)


def left_padded_prompt(batch=2, length=13, pad=4, seed=3):
    prompt = torch.randint(1, 97, (batch, length), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(prompt)
    mask[0, :pad] = 0
    return prompt, mask


@pytest.mark.parametrize("variant", list(VARIANTS), ids=list(VARIANTS))
def test_static_cache_generates_what_the_default_cache_does(variant):
    # 70 tokens after a left-padded prompt: the window ring (w = 20) and raw-tail ring (l = 8) wrap many times
    model = make_model(**VARIANTS[variant])
    prompt, mask = left_padded_prompt()
    kw = dict(max_new_tokens=70, min_new_tokens=70, do_sample=False, output_logits=True, return_dict_in_generate=True,
              pad_token_id=0)  # fmt: skip
    default = model.generate(prompt, attention_mask=mask, **kw)
    static = model.generate(prompt, attention_mask=mask, cache_implementation="static", **kw)
    cache = static.past_key_values
    assert cache.static and cache.is_compileable and not default.past_key_values.static
    assert torch.equal(static.sequences, default.sequences)
    torch.testing.assert_close(torch.stack(static.logits, 1), torch.stack(default.logits, 1), rtol=1e-6, atol=1e-6)
    # fixed sizes: the keys of max_length tokens, a w-slot window ring and an l-slot raw ring
    layer = cache.layers[0]
    assert layer.k_slc.shape[1] == cache.capacity >= 13 + 69 and int(cache.cursor) == 13 + 69
    if variant != "dense":
        assert layer.tail_k.shape[1] == TINY["cmp_block_size"]
        assert layer.cmp_end.shape[1] == cache.capacity // TINY["cmp_stride"] + 2
        if variant == "mlp-kvsplit":
            assert layer.k_win.shape[1] == TINY["window_size"]
        else:  # the window shares the selection's K/V set: it reads k_slc, and the cache keeps no ring of its own
            assert getattr(layer, "k_win", None) is None


def test_beam_search_with_the_static_cache_equals_the_default_cache():
    model = make_model()
    prompt, mask = left_padded_prompt()
    kw = dict(max_new_tokens=30, num_beams=3, do_sample=False, pad_token_id=0, attention_mask=mask)
    assert torch.equal(model.generate(prompt, cache_implementation="static", **kw), model.generate(prompt, **kw))


@pytest.mark.parametrize("variant", list(VARIANTS), ids=list(VARIANTS))
def test_static_cache_decoding_step_compiles_to_one_graph(variant):
    """What generate() compiles on a GPU (the decoding forward with a static cache) is one graph for every
    token: fullgraph (no break, no host sync) and no recompilation as the cache fills (no guard on a length)."""
    from torch._dynamo.backends.debugging import aot_eager

    model = make_model(**VARIANTS[variant])
    prompt, mask = left_padded_prompt()
    graphs = []

    def counting_backend(gm, example_inputs):
        graphs.append(gm)
        return aot_eager(gm, example_inputs)  # functionalizes the in-place cache writes, as inductor does

    torch._dynamo.reset()
    compiled = torch.compile(model.forward, fullgraph=True, dynamic=False, backend=counting_backend)

    @torch.no_grad()
    def decode(forward, steps=24):
        cache = NSACache(model.config, max_cache_len=13 + steps + 1, static=True)
        out = model(prompt, attention_mask=mask, past_key_values=cache)  # the prompt: eager, as in generate()
        logits = [out.logits[:, -1]]
        for _ in range(steps):
            out = forward(input_ids=logits[-1].argmax(-1, keepdim=True), past_key_values=cache)
            logits.append(out.logits[:, -1])
        return torch.stack(logits, 1)

    eager = decode(model.forward)
    assert torch.equal(decode(compiled), eager)
    assert len(graphs) == 1, f"{len(graphs)} graphs for 24 decoding steps"
    # and no host read inside it (a captured .item() compiles, but syncs and keeps CUDA graphs off)
    host_reads = [str(node.target) for node in graphs[0].graph.nodes
                  if node.op in ("call_method", "call_function") and str(getattr(node.target, "__name__", node.target))
                  in ("item", "tolist", "nonzero", "_local_scalar_dense")]
    assert host_reads == [], host_reads


def test_generate_compiles_the_static_cache_steps_into_one_graph():
    """generate()'s own path (as on a GPU, here forced on CPU with aot_eager): transformers compiles the forward
    for the steps after the prompt; fullgraph=True, one graph for 30 tokens, the default cache's tokens."""
    from transformers import CompileConfig

    model = make_model()
    prompt, mask = left_padded_prompt()
    compile_config = CompileConfig(fullgraph=True, backend="aot_eager", dynamic=False)
    compile_config._compile_all_devices = True  # transformers compiles on GPUs only unless told
    kw = dict(max_new_tokens=30, min_new_tokens=30, do_sample=False, pad_token_id=0, attention_mask=mask)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = model.generate(prompt, cache_implementation="static", compile_config=compile_config, **kw)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert torch.equal(compiled, model.generate(prompt, **kw))


def test_static_cache_says_what_it_cannot_do():
    model = make_model()
    prompt, mask = left_padded_prompt()
    with pytest.raises(ValueError, match="max_cache_len > 0"):
        NSACache(model.config, static=True)
    with pytest.raises(ValueError, match="cannot hold a prompt of 13 tokens"):
        model(prompt, past_key_values=NSACache(model.config, max_cache_len=12, static=True))
    cache = NSACache(model.config, max_cache_len=40, static=True)
    model(prompt, attention_mask=mask, past_key_values=cache)
    with pytest.raises(ValueError, match="one token per step after the prompt, got 2"):
        model(prompt[:, :2], past_key_values=cache)
    with pytest.raises(ValueError, match="cannot take tokens back"):
        cache.crop(-1)
    full = NSACache(model.config, max_cache_len=15, static=True)  # the prompt's 13 tokens + 2 steps
    model(prompt, attention_mask=mask, past_key_values=full)
    step_mask = torch.cat([mask, mask.new_ones(2, 2)], 1)
    for i in range(2):
        model(prompt[:, -1:], attention_mask=step_mask[:, :14 + i], past_key_values=full)
    with pytest.raises(ValueError, match="max_cache_len=15. is full"):
        model(prompt[:, -1:], attention_mask=torch.cat([step_mask, mask.new_ones(2, 1)], 1), past_key_values=full)
    with pytest.raises(ValueError, match="(?i)static"):  # transformers declines it first, else our crop() would
        model.generate(prompt, attention_mask=mask, assistant_model=make_model(seed=1), max_new_tokens=5,
                       do_sample=False, pad_token_id=0, cache_implementation="static")


def test_generate_with_offloaded_weights_equals_generate_in_memory():
    """accelerate's offloading (device_map with disk/CPU offload, cpu_offload) loads a module's weights when its
    forward runs: a decoding step's compressed token must go through the compressor's forward, or its weights
    stay on the meta device."""
    from accelerate import cpu_offload

    model = make_model(compressor="mlp")
    prompt = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(2))
    kwargs = dict(max_new_tokens=30, min_new_tokens=30, do_sample=False, pad_token_id=0)  # crosses l = 8, d = 4
    expected = model.generate(prompt, **kwargs)
    offloaded = cpu_offload(make_model(compressor="mlp"), execution_device=torch.device("cpu"))
    assert offloaded.model.layers[0].self_attn.compressor.k_pos_emb.device.type == "meta"
    assert torch.equal(offloaded.generate(prompt, **kwargs), expected)


def test_bench_generate_smoke_run_times_every_model_and_their_ratios(tmp_path, monkeypatch, capsys):
    """bench/bench_generate.py (the GPU session's `generate` step) in its CPU smoke mode: every model generates the
    asked tokens (the script asserts it per run), its JSON holds each model's prefill and per-token figures, and the
    table's ratio columns are those figures' ratios; bad flags are named."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "gen.json"
    proc = subprocess.run([sys.executable, str(root / "bench" / "bench_generate.py"), "--device", "cpu", "--size",
                           "tiny", "--prompt-lens", "40", "--new-tokens", "3", "--repeats", "1", "--models", "nsa",
                           "nsa-dense", "llama", "--json", str(out)], cwd=root, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    (row,) = json.loads(out.read_text())["rows"]
    assert row["prompt_len"] == 40
    for model in ("nsa", "nsa-dense", "llama"):
        assert row[model]["ms_per_token"] > 0 and row[model]["prefill_ms"] > 0
        assert row[model]["tokens_per_s"] == pytest.approx(1e3 * row["batch"] / row[model]["ms_per_token"])
    table = proc.stdout.split("generate(): tiny")[1].splitlines()
    line = next(line.split() for line in table if line.split()[:1] == ["40"])
    assert [float(x) for x in line[-2:]] == [  # nsa/llama, nsa-dense/llama
        pytest.approx(row[m]["ms_per_token"] / row["llama"]["ms_per_token"], abs=0.006) for m in ("nsa", "nsa-dense")]
    # bad flags, in this process (each is refused before any model is built)
    monkeypatch.syspath_prepend(str(root / "bench"))
    import bench_generate

    for bad, said in ((["--new-tokens", "1"], "--new-tokens 1: give at least 2"),
                      (["--models", "nsa", "mamba"], "--models mamba: each is one of nsa, nsa-dense, nsa-dense-flex, nsa-dense-eager, llama")):
        monkeypatch.setattr(sys, "argv", ["bench_generate.py", "--device", "cpu", *bad])
        with pytest.raises(SystemExit) as exit_info:
            bench_generate.main()
        assert exit_info.value.code == 2 and said in capsys.readouterr().err


# ---------------------------------------------------------------- transformers' Cache API, generate()'s cache arguments


def _prompt_and_cache(model, batch=3, length=21, seed=5):
    prompt = torch.randint(1, 97, (batch, length), generator=torch.Generator().manual_seed(seed))
    cache = NSACache(model.config)
    model(prompt, past_key_values=cache)
    return prompt, cache


@pytest.mark.parametrize("variant", ["mlp-kvsplit", "mean-kvshared", "dense"])
def test_selecting_and_repeating_a_caches_rows_continues_as_those_rows_alone(variant):
    """batch_select_indices / batch_repeat_interleave (transformers' Cache API: a subset of a batch, a prompt
    expanded for several samples): the next chunk's logits are those of the chosen rows' own forwards."""
    model = make_model(**VARIANTS[variant])
    prompt, cache = _prompt_and_cache(model)
    nxt = torch.randint(1, 97, (3, 6), generator=torch.Generator().manual_seed(6))
    whole = model(torch.cat([prompt, nxt], 1), use_cache=False).logits[:, -6:]  # (3, 6, V)
    rows = torch.tensor([2, 0])
    cache.batch_select_indices(rows)
    assert cache.batch_size == 2 and cache.get_seq_length() == 21
    torch.testing.assert_close(model(nxt[rows], past_key_values=cache).logits, whole[rows], rtol=1e-9, atol=1e-9)
    prompt, cache = _prompt_and_cache(model)
    cache.batch_repeat_interleave(2)  # rows 0, 0, 1, 1, 2, 2
    repeated = torch.arange(3).repeat_interleave(2)
    assert cache.batch_size == 6
    torch.testing.assert_close(model(nxt[repeated], past_key_values=cache).logits, whole[repeated], rtol=1e-9,
                               atol=1e-9)  # fmt: skip


def test_a_reset_cache_serves_another_prompt_as_a_new_one():
    model = make_model()
    _, cache = _prompt_and_cache(model, batch=2, length=40)
    assert cache.is_initialized and cache.get_max_length() == -1
    cache.reset()
    assert not cache.is_initialized and cache.get_seq_length() == 0 and cache.batch_size == -1
    prompt = torch.randint(1, 97, (3, 17), generator=torch.Generator().manual_seed(8))  # another batch size
    nxt = torch.randint(1, 97, (3, 1), generator=torch.Generator().manual_seed(9))
    model(prompt, past_key_values=cache)
    expected = model(torch.cat([prompt, nxt], 1), use_cache=False).logits[:, -1:]
    torch.testing.assert_close(model(nxt, past_key_values=cache).logits, expected, rtol=1e-9, atol=1e-9)
    assert cache.get_mask_sizes(4, 0) == (18 + 4, 0)
    static = NSACache(model.config, max_cache_len=40, static=True)
    model(prompt, past_key_values=static)
    assert static.get_max_length() == 40 and static.get_mask_sizes(1, 0) == (40, 0)
    with pytest.raises(ValueError, match="holds 3 rows in buffers of fixed size and cannot take 2; .*default cache"):
        static.batch_select_indices(torch.tensor([0, 1]))
    static.reset()
    model(prompt[:2], past_key_values=static)  # a new prompt, of another batch size
    assert static.batch_size == 2 and int(static.cursor) == 17


def test_generate_takes_a_callers_cache_as_transformers_does():
    model = make_model()
    prompt = torch.randint(1, 97, (1, 9), generator=torch.Generator().manual_seed(4))
    cache = NSACache(model.config)
    model.generate(prompt, **{CACHE_NAME: cache}, max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert cache._is_user_defined and cache.get_seq_length() >= 9 + 2  # marked as the caller's, and filled
    with pytest.raises(ValueError, match="either cache_implementation='static' or a cache"):
        model.generate(prompt, **{CACHE_NAME: NSACache(model.config)}, cache_implementation="static",
                       max_new_tokens=3, do_sample=False, pad_token_id=0)  # fmt: skip


@pytest.mark.skipif(not hasattr(__import__("transformers").GenerationConfig(), "max_cache_len"),
                    reason="this transformers has no generation_config.max_cache_len")
def test_a_static_cache_is_sized_by_max_cache_len_when_given():
    model = make_model()
    out = model.generate(torch.randint(1, 97, (1, 9)), max_new_tokens=3, do_sample=False, pad_token_id=0,
                         cache_implementation="static", max_cache_len=64, return_dict_in_generate=True)
    assert out.past_key_values.capacity == 64  # (without it: the call's max_length, 12)


@pytest.mark.parametrize("variant", ["mlp-kvsplit", "dense"])
def test_gradient_checkpointing_keeps_a_cache_without_gradients_and_refuses_one_with_them(variant):
    """The backward replays a checkpointed layer, which would store its keys in the cache again: a training forward
    with gradients refuses a cache, naming the ways out; without gradients (decoding from a model in training mode)
    the cache works as in eval mode."""
    model = make_model(**VARIANTS[variant]).train()
    # (transformers >= 5.23 names it activation checkpointing)
    getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()
    ids = torch.randint(1, 97, (1, 30), generator=torch.Generator().manual_seed(1))
    with pytest.raises(ValueError, match="gradient checkpointing: the backward replays each layer.*torch.no_grad"):
        model(ids, past_key_values=NSACache(model.config), labels=ids)
    with torch.no_grad():
        out = model(ids[:, :29], use_cache=True)
        assert isinstance(out.past_key_values, NSACache)
        step = model(ids[:, 29:], past_key_values=out.past_key_values).logits
        whole = model(ids, use_cache=False).logits[:, -1:]
    torch.testing.assert_close(step, whole, rtol=1e-9, atol=1e-9)
    loss = model(ids, labels=ids).loss  # a training step without a cache still trains
    loss.backward()
    assert model.lm_head.weight.grad is not None


def test_trainer_evaluation_with_the_cache_on_takes_the_logits_not_the_cache(tmp_path):
    """Trainer.prediction_step drops the output fields named in config.keys_to_ignore_at_inference before it
    takes the rest for logits: the cache's field ("cache" from transformers 5.24, "past_key_values" before) is
    among them, so an evaluation with the config's use_cache on (NSA builds a cache in eval mode) still works."""
    from transformers import Trainer, TrainingArguments

    model = make_model().float()
    model.config.use_cache = True
    rows = [{"input_ids": ids, "labels": ids} for ids in torch.randint(1, 97, (4, 16)).tolist()]
    # (transformers >= 5.2x's Trainer sets the config's use_cache from its own argument)
    use_cache = {"use_cache": True} if "use_cache" in TrainingArguments.__dataclass_fields__ else {}
    args = TrainingArguments(str(tmp_path), per_device_eval_batch_size=2, report_to=[], use_cpu=True, **use_cache)
    seen = []

    def metrics(prediction):
        seen.append(prediction.predictions)
        return {"rows": len(prediction.predictions)}

    result = Trainer(model=model, args=args, eval_dataset=rows, compute_metrics=metrics).evaluate()
    assert result["eval_rows"] == 4 and seen[0].shape == (4, 16, 97)  # the logits, gathered over both batches


def test_a_cache_the_model_cannot_read_is_refused_naming_the_fix():
    """A transformers DynamicCache holds none of NSA's state: it was dropped without a word, leaving the caller's
    object empty, so a hand-driven next step ran as a new prompt (logits off by up to ~1). A cache built from
    another model's config gave wrong logits or unrelated shape errors; a cache of other rows, an input with no
    tokens, torch's own messages. Each is refused now, naming the value and the fix."""
    from transformers import DynamicCache

    model = make_model()
    prompt = torch.randint(0, TINY["vocab_size"], (1, 19), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for foreign in (DynamicCache(), (torch.zeros(1),)):
            with pytest.raises(ValueError, match=r"NSA needs an NSACache, got (DynamicCache|tuple).*NSACache\(model"):
                model(prompt, past_key_values=foreign, use_cache=True)
        with pytest.raises(ValueError, match=r"NSA needs an NSACache, got DynamicCache"):
            model.generate(prompt, max_new_tokens=2, do_sample=False, **{CACHE_NAME: DynamicCache()})
        for field, value in (("window_size", 4), ("cmp_stride", 2), ("num_hidden_layers", 1)):
            other = NSACache(NSAConfig(**{**TINY, field: value}))
            with pytest.raises(ValueError, match=rf"another model \(cache vs model: {field} {value} vs {TINY[field]}"):
                model(prompt, past_key_values=other, use_cache=True)
        same = NSACache(NSAConfig(**TINY))  # an equal config, another object: readable
        logits = model(prompt, past_key_values=same, use_cache=True).logits
        torch.testing.assert_close(logits, model(prompt, use_cache=False).logits)
        with pytest.raises(ValueError, match=r"the cache holds 1 row\(s\) and the input has 2.*batch_repeat_interleave"):
            model(prompt[:, :1].repeat(2, 1), past_key_values=same, use_cache=True)
        with pytest.raises(ValueError, match=r"no tokens \(shape \(1, 0\)\); the cache already holds 19 .*reset\(\)"):
            model(prompt[:, :0], past_key_values=same, use_cache=True)
        same.batch_repeat_interleave(2)  # the fix the message names: both rows continue the prompt
        step = model(prompt[:, -1:].repeat(2, 1), past_key_values=same, use_cache=True).logits
        full = model(torch.cat([prompt, prompt[:, -1:]], 1), use_cache=False).logits[:, -1]
        torch.testing.assert_close(step[:, -1], full.expand(2, -1))
