"""The whole model on the Triton path equals the model on the reference path.

CPU (CI): with TRITON_INTERPRET=1 a model built with nsa_backend="triton" runs the real kernels on CPU
tensors: forward, backward, cached generation (default and static cache) and prompt-lookup decoding, one subprocess
per model variant (Triton reads the variable when kernels are defined), started in the background when collection
ends (tests/background.py), with every kernel access bounds-checked and the launchers' empty buffers poisoned
(tests/triton_helpers.py). GPU: logits and loss at the 125M NSA sizes in bf16, cached decoding, and
torch.compile(fullgraph=True) of a decoder layer.
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

try:
    import triton  # noqa: F401

    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False

# Blocks the kernels accept (head_dim and l'/d powers of two) and small enough that T=70 crosses
# compression, selection and window boundaries.
TINY = dict(
    vocab_size=89, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=6,
    num_key_value_heads=2, head_dim=16, cmp_block_size=8, cmp_stride=4, sel_block_size=16, sel_num_blocks=3,
    window_size=20, cmp_mlp_hidden_size=32,
)  # fmt: skip

INTERPRETED = textwrap.dedent(
    """
    import json, sys, torch
    from modeling_nsa import NSAConfig, NSAForCausalLM
    from modeling_nsa import modeling_nsa as mn
    from modeling_nsa import nsa_backend
    sys.path.insert(0, "tests")
    from triton_helpers import check_kernels_as_on_a_gpu
    check_kernels_as_on_a_gpu()  # bounds, races, unwritten memory (NSACache's views included)
    config, variants = json.loads(sys.argv[1]), json.loads(sys.argv[2])
    results = {}
    for variant, extra in variants.items():
        torch.manual_seed(0)
        ref = NSAForCausalLM(NSAConfig(**config, **extra, nsa_backend="reference")).float()
        tri = NSAForCausalLM(NSAConfig(**config, **extra, nsa_backend="triton")).float()
        tri.load_state_dict(ref.state_dict())
        assert mn.resolve_nsa_backend("triton", torch.device("cpu")) == "triton"
        ids = torch.randint(0, config["vocab_size"], (2, 70))
        position_ids = torch.cat([torch.arange(30), torch.arange(40)]).expand(2, -1)  # two documents per row
        out = {}
        for name, model in (("ref", ref), ("tri", tri)):
            o = model(ids, position_ids=position_ids, labels=ids, use_cache=False)
            o.loss.backward()
            grads = torch.cat([p.grad.flatten() for p in model.parameters()])
            model.eval()
            gen = model.generate(ids[:, :9], max_new_tokens=28, min_new_tokens=28, do_sample=False,
                                 output_logits=True, return_dict_in_generate=True, pad_token_id=0)
            out[name] = (o.logits.detach(), o.loss.detach(), grads, gen.sequences, torch.stack(gen.logits, 1))
        # speculative (prompt-lookup) decoding on the kernels: draft chunks verified after the cache (the chunk
        # kernels, a window cache longer than w while recording), rejected drafts cropped; plain greedy tokens
        prompt = torch.cat([ids[:1, :12], ids[:1, :8], ids[:1, 12:20]], 1)  # repeats to draft from
        greedy = dict(max_new_tokens=20, min_new_tokens=20, do_sample=False, pad_token_id=0)
        lookup = tri.generate(prompt, prompt_lookup_num_tokens=4, **greedy)
        rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()
        # the static cache's step on the kernels (STATIC launches: the query's key index read on the device, the
        # window a ring; with kv_per_branch=False the window reads the key buffer) after a left-padded prompt
        mask = torch.ones(2, 9, dtype=torch.long)
        mask[0, :3] = 0
        static_kw = dict(max_new_tokens=18, min_new_tokens=18, do_sample=False, output_logits=True,
                         return_dict_in_generate=True, pad_token_id=0, attention_mask=mask)
        s_tri = tri.generate(ids[:, :9], cache_implementation="static", **static_kw)
        s_ref = ref.generate(ids[:, :9], **static_kw)
        assert s_tri.past_key_values.static
        results[variant] = dict(
            static_same_tokens=bool(torch.equal(s_tri.sequences, s_ref.sequences)),
            static_logits=rel(torch.stack(s_tri.logits, 1), torch.stack(s_ref.logits, 1)),
            lookup_same_tokens=bool(torch.equal(lookup, ref.generate(prompt, **greedy))),
            logits=rel(out["tri"][0], out["ref"][0]), loss=abs(out["tri"][1] - out["ref"][1]).item(),
            grads=rel(out["tri"][2], out["ref"][2]), same_tokens=bool(torch.equal(out["tri"][3], out["ref"][3])),
            gen_logits=rel(out["tri"][4], out["ref"][4]),
        )
    fell_back = [m for m in nsa_backend._logged_once if "do not handle" in m]
    assert not fell_back, f"the Triton path fell back to the reference: {fell_back}"
    print("RESULTS " + json.dumps(results))
    """
)


def _interpreter_reason():
    from modeling_nsa import nsa_triton_common

    return nsa_triton_common._interpreter_reason() if HAS_TRITON else "triton is not installed"


# the model variants, one interpreter process each (side by side in the background: tests/background.py)
VARIANTS = {"mlp-kvsplit": {}, "mean-kvshared": {"compressor": "mean", "kv_per_branch": False}}


def interpreted_model_commands() -> list:
    if _interpreter_reason():
        return []  # the test is skipped, naming why
    from background import Command

    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    return [Command([sys.executable, "-c", INTERPRETED, json.dumps(TINY), json.dumps({name: extra})], env=env,
                    cwd=str(ROOT))
            for name, extra in VARIANTS.items()]


@pytest.fixture(scope="module")
def interpreted_model_results():
    if _interpreter_reason():
        pytest.skip(_interpreter_reason())
    import background

    results = {}
    for done in background.results(interpreted_model_commands, timeout=880):  # (pytest-timeout: 900)
        assert not done.timed_out, "the model under the interpreter took over 880 s"
        assert done.returncode == 0, done.stderr[-4000:]
        results.update(json.loads(done.stdout.split("RESULTS ", 1)[1]))
    return results


BACKGROUND_JOBS = {"interpreted_model_results": interpreted_model_commands}  # started when collection ends


def test_triton_model_under_interpreter_matches_reference_forward_backward_generate(interpreted_model_results):
    results = interpreted_model_results
    assert sorted(results) == sorted(VARIANTS), results
    for variant, r in results.items():
        assert r["logits"] < 1e-5 and r["loss"] < 1e-5, (variant, r)
        assert r["grads"] < 1e-4, (variant, r)
        assert r["same_tokens"] and r["gen_logits"] < 1e-5, (variant, r)
        assert r["lookup_same_tokens"], (variant, r)
        assert r["static_same_tokens"] and r["static_logits"] < 1e-5, (variant, r)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _models_125m_sizes(layers=2, dtype=torch.bfloat16, **extra):
    from modeling_nsa import NSAConfig, NSAForCausalLM

    torch.manual_seed(0)
    config = dict(num_hidden_layers=layers, **extra)  # NSA defaults: l=32, d=16, l'=64, n=16, w=512, G=6
    ref = NSAForCausalLM(NSAConfig(**config, nsa_backend="reference")).cuda().to(dtype)
    tri = NSAForCausalLM(NSAConfig(**config, nsa_backend="triton")).cuda().to(dtype)
    tri.load_state_dict(ref.state_dict())
    return ref, tri


@needs_cuda
@pytest.mark.parametrize("seq_len,documents", [(1000, False), (2048, True)], ids=["T1000", "T2048-docs"])
def test_gpu_model_logits_loss_and_grads_triton_vs_reference(seq_len, documents):
    ref, tri = _models_125m_sizes()
    ids = torch.randint(0, 50304, (2, seq_len), device="cuda")
    position_ids = None
    if documents:
        position_ids = torch.cat([torch.arange(700), torch.arange(seq_len - 700)]).cuda().expand(2, -1)
    outs = []
    for model in (ref, tri):
        o = model(ids, position_ids=position_ids, labels=ids, use_cache=False)
        o.loss.backward()
        outs.append((o.logits.float(), o.loss.float(), model.model.layers[0].self_attn.q_proj.weight.grad.float()))
    (ref_logits, ref_loss, ref_grad), (tri_logits, tri_loss, tri_grad) = outs
    assert ((tri_logits - ref_logits).norm() / ref_logits.norm()).item() < 1e-2
    assert abs(tri_loss.item() - ref_loss.item()) < 1e-2 * ref_loss.item()
    assert ((tri_grad - ref_grad).norm() / ref_grad.norm()).item() < 5e-2


def _decoding_model_and_left_padded_ids(seq_len: int):
    """The Triton model in eval mode and 2 rows of ids, the second left-padded by 50 (per-row positions: the decode
    kernels read the cache's buffers with batch strides)."""
    _, tri = _models_125m_sizes()
    ids = torch.randint(0, 50304, (2, seq_len), device="cuda")
    mask = torch.ones_like(ids)
    mask[1, :50] = 0
    return tri.eval(), ids, mask


@needs_cuda
def test_gpu_cached_decoding_matches_full_forward():
    tri, ids, mask = _decoding_model_and_left_padded_ids(700)
    with torch.no_grad():
        full = tri(ids, attention_mask=mask, use_cache=False).logits.float()
        from modeling_nsa import NSACache

        cache = NSACache(tri.config)
        steps = [tri(ids[:, :600], attention_mask=mask[:, :600], past_key_values=cache, use_cache=True).logits.float()]
        steps += [tri(ids[:, t : t + 1], attention_mask=mask[:, : t + 1], past_key_values=cache, use_cache=True).logits.float()
                  for t in range(600, 700)]  # fmt: skip
    cached = torch.cat(steps, 1)
    assert ((cached - full).norm() / full.norm()).item() < 1e-2


@needs_cuda
def test_gpu_default_cache_decoding_step_never_synchronizes():
    """An eager default-cache step on the GPU waits for nothing: the flag that lets it skip the compressor was copied
    to pinned host memory during the step before (NSACache.predict_emits), so reading it is no implicit
    synchronization (torch.cuda's sync debug mode raises on one: a copy to pageable memory, .item(), nonzero), and
    the steps skip the compressor where they should (rows at the same position: d - 1 steps of every d)."""
    from modeling_nsa import NSACache

    tri, ids, _ = _decoding_model_and_left_padded_ids(600)
    cache, skipped = NSACache(tri.config), 0
    with torch.no_grad():
        tri(ids[:, :500], past_key_values=cache, use_cache=True)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for t in range(500, 532):
                tri(ids[:, t : t + 1], past_key_values=cache, use_cache=True)
                skipped += not cache.step.compresses
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert skipped == 32 - 32 // tri.config.cmp_stride


@needs_cuda
def test_gpu_static_cache_generate_compiles_the_step_and_matches_the_default_cache():
    # generate(cache_implementation="static") on a GPU: transformers compiles the decoding forward (its default
    # compile_config: inductor, CUDA graphs); the tokens follow the default cache's until a bf16 near-tie
    # parts them, and the logits agree up to there (the same inputs)
    tri, ids, mask = _decoding_model_and_left_padded_ids(600)
    kw = dict(max_new_tokens=64, min_new_tokens=64, do_sample=False, output_logits=True, return_dict_in_generate=True,
              pad_token_id=0, attention_mask=mask)  # fmt: skip
    default = tri.generate(ids, **kw)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    static = tri.generate(ids, cache_implementation="static", **kw)
    assert static.past_key_values.static and torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1
    new_default, new_static = default.sequences[:, 600:], static.sequences[:, 600:]
    differs = (new_default != new_static).any(0).nonzero()
    same_until = int(differs[0]) if len(differs) else 64  # steps 0 .. same_until saw the same tokens
    a, b = torch.stack(static.logits, 1)[:, : same_until + 1], torch.stack(default.logits, 1)[:, : same_until + 1]
    assert ((a - b).norm() / b.norm()).item() < 2e-2, same_until


@needs_cuda
def test_gpu_decoder_layer_compiles_fullgraph():
    from modeling_nsa.nsa_layout import document_positions

    _, tri = _models_125m_sizes(layers=1)
    layer, rotary = tri.model.layers[0], tri.model.rotary_emb
    hidden = torch.randn(2, 1024, 768, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    position_ids = torch.cat([torch.arange(300), torch.arange(724)]).cuda().expand(2, -1)
    doc_pos = document_positions(position_ids, None, 2, 1024, hidden.device)
    rope = rotary(doc_pos, hidden.dtype)
    eager = layer(hidden, doc_pos, rope)
    compiled = torch.compile(layer, fullgraph=True)(hidden, doc_pos, rope)
    assert ((compiled.float() - eager.float()).norm() / eager.float().norm()).item() < 1e-2
    compiled.sum().backward()
    assert torch.isfinite(hidden.grad).all()


@needs_cuda
def test_gpu_float32_weights_run_the_kernels_in_bf16():
    # float32 weights under autocast (the trainer's accelerate bf16; RoPE runs in float32 there) and without
    # it: the kernels run in bf16 both times (no reference fallback); outside autocast the output comes back
    # in float32 and the log says the kernels computed in bf16
    from modeling_nsa import nsa_backend

    ref, tri = _models_125m_sizes(dtype=torch.float32)
    ids = torch.randint(0, 50304, (2, 1000), device="cuda")
    for autocast in (True, False):
        nsa_backend._logged_once.clear()
        losses = []
        for model in (ref, tri):
            model.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                loss = model(ids, labels=ids, use_cache=False).loss
            loss.backward()
            losses.append(loss.float().item())
        assert not [m for m in nsa_backend._logged_once if "do not handle" in m], nsa_backend._logged_once
        said_bf16 = [m for m in nsa_backend._logged_once if "compute in torch.bfloat16" in m]
        assert bool(said_bf16) == (not autocast), nsa_backend._logged_once
        assert abs(losses[1] - losses[0]) < 1e-2 * losses[0], (autocast, losses)
        grad = tri.model.layers[0].self_attn.q_proj.weight.grad
        assert grad is not None and torch.isfinite(grad).all()
