"""bench/model_traffic_cpu.py: the step counter's bytes and matmul FLOPs against independent counts (footprints by
hand, every nn.Linear's FLOPs from forward hooks), the attention stand-ins holding in both modes, and the CPU
command line. No GPU."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "bench"))

import model_traffic_cpu as mt  # noqa: E402

TINY_SIZE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, tie_word_embeddings=True, window_size=64, sel_block_size=32,
                 sel_num_blocks=4, cmp_block_size=16, cmp_stride=8, cmp_mlp_hidden_size=32)  # fmt: skip


def test_footprint_counts_broadcast_dimensions_once():
    x = torch.empty(4, 8, dtype=torch.bfloat16)
    assert mt.footprint_bytes(x) == 4 * 8 * 2
    assert mt.footprint_bytes(torch.empty(4, 1).expand(4, 1000)) == 4 * 4  # the expanded dim is one element
    assert mt.footprint_bytes(x.t()) == 64  # a transpose moves the same bytes
    assert mt.footprint_bytes(3.0) == 0


def _linear_flops_by_hooks(model_name: str, batch: int, seq_len: int) -> int:
    """6 x rows x in x out per nn.Linear call (forward 2, input and weight gradients 2 each), rows from the
    inputs each Linear really received (token rows, or the compressor's block rows)."""
    total = 0

    def hook(module, inputs, output):
        nonlocal total
        rows = inputs[0].numel() // module.in_features
        total += 6 * rows * module.in_features * module.out_features

    with mt.meta_model(model_name, batch, seq_len, TINY_SIZE) as (model, ids):
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                module.register_forward_hook(hook)
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    return total


def test_matmul_flops_match_every_linear_forward_and_backward():
    for model_name in ("nsa", "nsa-dense"):
        counter = mt.count_step(model_name, 2, 256, TINY_SIZE)
        assert counter.total("flops") == _linear_flops_by_hooks(model_name, 2, 256), model_name


def test_attention_stand_ins_hold_and_nsa_parts_are_counted():
    nsa = mt.count_step("nsa", 2, 256, TINY_SIZE)
    dense = mt.count_step("nsa-dense", 2, 256, TINY_SIZE)
    for counter in (nsa, dense):  # neither attention ran: no score matrices, no softmax over them
        attention_ops = {"bmm", "_softmax", "_safe_softmax", "_scaled_dot_product_flash_attention_for_cpu"}
        assert not attention_ops & set(counter.calls)
    # NSA's own parts: the gates (sigmoid), the compressor's MLP (gelu) and its block gather
    for kind in ("sigmoid", "gelu", "gather", "sigmoid_backward", "gelu_backward"):
        assert nsa.calls[kind] > 0 and dense.calls[kind] == 0, kind
    assert nsa.total("bytes") > dense.total("bytes") > 0
    assert mt.floor_ms(nsa, 773.0, 2978.0) > mt.floor_ms(dense, 773.0, 2978.0)


def test_decoding_steps_count_one_step_whatever_the_context():
    """--decode's counters hold one decoding step each (one embedding lookup), with the attention stand-ins (no
    softmax over scores), and a step dispatches the same ops after 16 cached tokens as after 80 (nothing per cached
    token, in either cache; 64 apart keeps each step's place in the compression cycle)."""
    stride = TINY_SIZE["cmp_stride"]
    for static in (False, True):
        short, long = (mt.count_decode_steps("nsa", 2, prompt, stride, static, TINY_SIZE) for prompt in (16, 80))
        for step, (a, b) in enumerate(zip(short, long)):
            assert a.calls == b.calls, (static, step, a.calls - b.calls, b.calls - a.calls)
            assert a.calls["embedding"] == 1 and not {"_softmax", "_safe_softmax", "bmm"} & set(a.calls)
    llama = mt.count_decode_step("llama", 2, 16, size=TINY_SIZE)
    assert llama.calls["embedding"] == 1 and llama.calls["gelu"] == 0 and llama.total("calls") > 0


def test_default_cache_runs_the_compressor_only_at_steps_that_complete_a_compressed_token():
    """The default cache's eager steps skip the compressor (its MLP's gelu, its RoPE, the compressed caches'
    scatters) wherever no row completes a compressed token: one step in d for rows at the same position (in-document
    position i*d + l - 1, Eq. 7). The static cache's step is one graph, so it runs them at every step."""
    block, stride, prompt = TINY_SIZE["cmp_block_size"], TINY_SIZE["cmp_stride"], 16
    positions = range(prompt + 1, prompt + 1 + stride)  # the counted steps' tokens (the first step is not counted)
    completes = [(p - (block - 1)) % stride == 0 for p in positions]
    assert sum(completes) == 1
    dynamic = mt.count_decode_steps("nsa", 2, prompt, stride, False, TINY_SIZE)
    assert [step.calls["gelu"] > 0 for step in dynamic] == completes
    assert [step.calls["scatter_"] > 0 for step in dynamic] == completes
    skipped, compressing = (min(s.total("calls") for s in dynamic), max(s.total("calls") for s in dynamic))
    assert compressing - skipped >= 10 * TINY_SIZE["num_hidden_layers"]
    static = mt.count_decode_steps("nsa", 2, prompt, stride, True, TINY_SIZE)
    assert all(step.calls["gelu"] > 0 and step.calls["scatter_"] > 0 for step in static)


def test_decode_host_timing_times_each_step_in_float32(monkeypatch):
    """--decode's host column: one wall time per counted step (the least over the repeats), of a float32 model
    (this CPU's bf16 matmuls would time arithmetic), with the attention stand-ins in place while it runs and
    restored after."""
    dtypes = []
    real_forward = mt.modeling.NSAForCausalLM.forward
    monkeypatch.setattr(mt.modeling.NSAForCausalLM, "forward",
                        lambda self, *a, **k: dtypes.append(self.lm_head.weight.dtype) or real_forward(self, *a, **k))
    saved = mt.modeling.nsa_attention
    seconds = mt.time_decode_steps("nsa", 1, 16, 3, size=TINY_SIZE, repeats=2)
    assert len(seconds) == 3 and all(s > 0 for s in seconds)
    assert set(dtypes) == {torch.float32} and len(dtypes) == 2 * (1 + 1 + 3)  # twice: prompt, first step, 3 timed
    assert mt.modeling.nsa_attention is saved


def test_command_line_prints_the_table(capsys):
    mt.main(["--seq-lens", "2048", "--tokens-per-step", "4096", "--top", "3"])
    out = capsys.readouterr().out
    assert "| all |" in out and "NSA's parts outside the op add" in out


def test_profiled_step_breakdown_sorts_kernels_by_kind_and_finds_idle_time():
    """bench_model.py --profile's breakdown on made-up kernel events of 2 steps: (name, start_us, duration_us)."""
    from bench_model import kernel_kind, step_breakdown

    assert kernel_kind("_sel_fwd_kernel") == "NSA op (Triton)"
    assert kernel_kind("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTN") == "matmuls"
    assert kernel_kind("sm90_xmma_gemm_bf16bf16_bf16f32") == "matmuls"
    assert kernel_kind("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64>>") == "dense attention"
    assert kernel_kind("void at::native::vectorized_elementwise_kernel<4, ...>") == "other (elementwise, copies, ...)"
    step = [("nvjet_gemm", 0, 100), ("_sel_fwd_kernel", 100, 50), ("elementwise", 400, 10)]  # 250 us idle
    events = step + [(name, start + 500, duration) for name, start, duration in step]  # 90 us between steps
    out = step_breakdown(events, reps=2)
    assert out["kinds_ms"] == {"matmuls": 0.1, "NSA op (Triton)": 0.05, "other (elementwise, copies, ...)": 0.01}
    assert abs(out["kernels_ms"] - 0.16) < 1e-12
    # 250 us after _sel_fwd_kernel in each step, 90 us between the steps (after "elementwise"), over 2 steps
    assert abs(out["idle_ms"] - (0.25 * 2 + 0.09) / 2) < 1e-12
    assert out["largest_gaps"][0]["after"] == "_sel_fwd_kernel"
