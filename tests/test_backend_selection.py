"""Which GPUs get the Triton kernels, and what happens elsewhere: checked on CPU by standing in for the
CUDA queries. `nsa_backend="auto"` uses the kernels only where they run (an NVIDIA GPU of compute
capability 8.0 or newer), says once in the log why it does not, and an explicit "triton" that cannot run
raises with the reason; parameters or head sizes the kernels do not handle run the reference, logged
(nsa_backend.nsa_attention decides; the kernel entry points raise on them)."""

from __future__ import annotations

import logging
import re

import pytest
import torch

from triton_helpers import DEFAULT, import_nsa, kernel_module, make_inputs

layout, _, tri = import_nsa()
common, launch = kernel_module("common"), kernel_module("launch")
from modeling_nsa import nsa_backend as backend  # noqa: E402

needs_triton = pytest.mark.skipif(not tri._HAS_TRITON, reason="triton is not installed")
CUDA = torch.device("cuda")


@pytest.fixture
def fake_gpu(monkeypatch):
    """Stand in for one CUDA GPU: set(capability, name, rocm=False)."""

    def set_gpu(capability, name, rocm=False):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.version, "hip", "6.2" if rocm else None)
        monkeypatch.setattr(common, "_CUDA_DEVICE_REASONS", {})  # the per-GPU answer is cached
        backend._logged_once.clear()

    return set_gpu


@needs_triton
@pytest.mark.parametrize("capability,name", [((8, 0), "A100"), ((8, 6), "RTX 3090"), ((8, 9), "L4"),
                                             ((9, 0), "H100")])
def test_kernels_run_on_ampere_and_newer(fake_gpu, capability, name):
    fake_gpu(capability, name)
    assert tri.triton_unusable_reason(CUDA) is None
    assert backend.resolve_nsa_backend("auto", CUDA) == "triton"
    assert backend.resolve_nsa_backend("triton", CUDA) == "triton"


@needs_triton
@pytest.mark.parametrize("capability,name,rocm,expected", [
    ((7, 5), "Tesla T4", False, "compute capability 8.0 or newer .* Tesla T4 is 7.5"),
    ((7, 0), "Tesla V100", False, "Tesla V100 is 7.0"),
    ((9, 4), "AMD Instinct MI300X", True, "ROCm build"),
], ids=["T4", "V100", "ROCm"])
def test_older_or_non_nvidia_gpus_use_the_reference_and_say_why(fake_gpu, caplog, capability, name, rocm, expected):
    fake_gpu(capability, name, rocm)
    assert tri.triton_unusable_reason(CUDA) is not None
    with caplog.at_level(logging.WARNING):
        assert backend.resolve_nsa_backend("auto", CUDA) == "reference"
        assert backend.resolve_nsa_backend("auto", CUDA) == "reference"
    logged = [r.getMessage() for r in caplog.records if "falls back to the PyTorch reference" in r.getMessage()]
    assert len(logged) == 1, logged  # once, not per layer and step
    assert re.search(expected, logged[0]), logged[0]
    with pytest.raises(RuntimeError, match=f"nsa_backend='triton' but .*{expected}"):
        backend.resolve_nsa_backend("triton", CUDA)


@pytest.mark.parametrize("capability,expected_kib", [(90, 227), (80, 163), (86, 99), (89, 99), (120, 99)])
def test_shared_memory_limit_by_architecture(monkeypatch, capability, expected_kib):
    monkeypatch.setattr(common, "_compute_capability", lambda device: capability)
    assert common._shared_memory_limit("cpu") == expected_kib * 1024


@pytest.mark.parametrize("capability,supported", [(90, True), (80, True), (86, False), (89, False)])
def test_head_dim_256_needs_the_large_shared_memory_of_a100_and_h100(monkeypatch, capability, supported):
    monkeypatch.setattr(common, "_compute_capability", lambda device: capability)
    params = layout.NSAParams(**DEFAULT)
    assert tri.triton_supports(params, 128, "cpu")
    assert tri.triton_supports(params, 256, "cpu") == supported
    if not supported:
        assert "head_dim=256 needs 160 KiB" in tri.triton_unsupported_reason(params, 256, "cpu")


@pytest.mark.parametrize("head_dim,overrides,expected", [
    (96, {}, "head_dim=96"),
    (64, {"sel_block_size": 48}, "sel_block_size=48"),
    (64, {"cmp_stride": 32, "cmp_block_size": 32, "sel_block_size": 96}, "sel_block_size=96"),
    (64, {"cmp_block_size": 40}, "cmp_block_size=40"),
    # a power of two past what the launches are sized for: ptxas runs out of registers under sm_90's cap, and
    # the selected forward's tiles outgrow shared memory at head_dim 128 (review, 2026-12-02, AOT compiles)
    (64, {"cmp_stride": 16, "cmp_block_size": 32, "sel_block_size": 256},
     "sel_block_size=256 (the kernels take a power of two in [16, 128])"),
], ids=["head_dim96", "sel_block48", "sel_block96", "cmp_block40", "sel_block256"])
def test_unsupported_parameters_are_named(head_dim, overrides, expected):
    params = layout.NSAParams(**{**DEFAULT, **overrides})
    assert expected in tri.triton_unsupported_reason(params, head_dim)


@pytest.mark.parametrize("capability,supported", [(80, True), (90, True), (86, False), (89, False)])
def test_selection_blocks_of_128_at_head_dim_128_need_the_large_shared_memory(monkeypatch, capability, supported):
    # the eager decode step's finish kernel at l' = 128, head_dim 128 takes 136 KiB (AOT compile, 2026-12-02):
    # past the 99 KiB of RTX 30xx/40xx, A10, L4; l' = 128 at head_dim 64 fits everywhere
    monkeypatch.setattr(common, "_compute_capability", lambda device: capability)
    params = layout.NSAParams(**{**DEFAULT, "cmp_stride": 16, "cmp_block_size": 32, "sel_block_size": 128})
    assert tri.triton_supports(params, 64, "cpu")
    assert tri.triton_supports(params, 128, "cpu") == supported
    if not supported:
        assert "sel_block_size=128 at head_dim=128: needs 160 KiB" in tri.triton_unsupported_reason(params, 128, "cpu")


def test_a_backend_name_outside_the_three_is_refused():
    with pytest.raises(ValueError, match=r"backend='Triton': choose one of 'auto', 'reference', 'triton'"):
        backend.resolve_nsa_backend("Triton", torch.device("cpu"))


def test_a_chunk_after_a_cache_with_any_input_needing_gradients_is_differentiated(monkeypatch, caplog):
    """The kernels' chunk path (no autograd) is taken only where no input needs gradients: with q frozen but the
    keys trained (a frozen query projection, trained K/V or gate projections) 'auto' runs the reference, logged,
    and an explicit 'triton' raises, naming the way out; before, the output silently had no gradient."""
    monkeypatch.setattr(backend, "_logged_once", set())
    _on_a_gpu_where_the_kernels_run(monkeypatch)
    t, cmp_end, doc_pos, p = make_inputs(1, 40, 2, 1, 16, DEFAULT, torch.float32, "cpu")
    k_slc = t["k_slc"].clone().requires_grad_(True)
    chunk = (t["q"][:, -4:], t["k_cmp"], t["v_cmp"], cmp_end, k_slc, t["v_slc"], t["k_win"], t["v_win"],
             t["gates"][:, -4:], doc_pos, p)  # fmt: skip
    with caplog.at_level(logging.WARNING):
        out = backend.nsa_attention(*chunk)
    assert out.requires_grad and "no differentiable Triton kernel for a chunk after a cache" in caplog.text
    torch.testing.assert_close(out, import_nsa()[1].nsa_attention_reference(*chunk))
    with pytest.raises(RuntimeError, match="nsa_backend='triton' but no Triton kernel differentiates a chunk"):
        backend.nsa_attention(*chunk, backend="triton")


def test_the_kernels_refuse_shapes_they_would_read_out_of_bounds():
    """Shapes that disagree with q's and the cache's (the reference raises on them; the kernels would read out of
    bounds, fault or hang) are refused before any launch, naming the tensor, its shape and the one expected."""
    t, cmp_end, doc_pos, p = make_inputs(1, 32, 4, 2, 16, DEFAULT, torch.float32, "cpu")
    good = dict(q=t["q"], k_cmp=t["k_cmp"], v_cmp=t["v_cmp"], cmp_end=cmp_end, k_slc=t["k_slc"], v_slc=t["v_slc"],
                k_win=t["k_win"], v_win=t["v_win"], gates=t["gates"], doc_pos=doc_pos)
    cases = {
        "gates": (t["gates"][..., :2], r"gates has shape \(1, 32, 4, 2\); .* must be \(1, 32, 4, 3\)"),
        "k_cmp": (t["k_cmp"][:, :-1], rf"k_cmp has shape \(1, {cmp_end.shape[1] - 1}, 2, 16\)"),  # a slot short
        "v_win": (torch.cat([t["v_win"], t["v_win"]], -1), r"v_win has shape \(1, 32, 2, 32\)"),
        "doc_pos": (doc_pos[:, :16], r"doc_pos has shape \(1, 16\); .* must be \(1, 32\)"),
    }
    for name, (bad, message) in cases.items():
        with pytest.raises(ValueError, match=message):
            tri.nsa_attention_triton(**{**good, name: bad}, params=p)
    # the chunk entry point (one query after 31 cached keys) checks the same
    with pytest.raises(ValueError, match=r"doc_pos has shape \(1, 16\); .* must be \(1, 32\)"):
        tri.nsa_decode_triton(**{**good, "q": t["q"][:, -1:], "gates": t["gates"][:, -1:], "doc_pos": doc_pos[:, :16]},
                              params=p)  # fmt: skip
    q3 = t["q"][:, :, :3]  # 3 query heads over 2 K/V heads
    with pytest.raises(ValueError, match="3 query heads do not share 2 K/V heads evenly"):
        tri.nsa_attention_triton(**{**good, "q": q3, "gates": t["gates"][:, :, :3]}, params=p)
    # 32,768 rows x 2 K/V heads: one program row more than a launch grid's second axis holds (stride-0 copies)
    wide = {name: x.expand(32768, *x.shape[1:]) for name, x in good.items()}
    with pytest.raises(ValueError, match=r"batch 32768 x 2 K/V heads = 65536 program rows.*parts of at most 32767"):
        tri.nsa_attention_triton(**wide, params=p)
    with pytest.raises(ValueError, match=r"batch 32768 x 2 K/V heads = 65536 program rows"):  # (the top-n alone too)
        tri.select_blocks_triton(wide["q"], wide["k_cmp"], wide["cmp_end"], wide["doc_pos"], p)


def _on_a_gpu_where_the_kernels_run(monkeypatch):
    """nsa_backend='auto' resolved as on such a GPU (on CPU it resolves to the reference without asking)."""
    monkeypatch.setattr(backend, "resolve_nsa_backend", lambda requested, device: "triton")


def test_unsupported_shape_runs_the_reference_and_logs_the_reason_once(monkeypatch, caplog):
    # head_dim 256 on a 99 KiB GPU: the op gives the reference's output and says why, once per reason
    monkeypatch.setattr(common, "_compute_capability", lambda device: 86)
    monkeypatch.setattr(backend, "_logged_once", set())
    _on_a_gpu_where_the_kernels_run(monkeypatch)
    t, cmp_end, doc_pos, p = make_inputs(1, 40, 2, 1, 256, DEFAULT, torch.float32, "cpu")
    args = (t["q"], t["k_cmp"], t["v_cmp"], cmp_end, t["k_slc"], t["v_slc"], t["k_win"], t["v_win"], t["gates"],
            doc_pos, p)
    with caplog.at_level(logging.WARNING):
        out = backend.nsa_attention(*args)
        backend.nsa_attention(*args)
    ref = import_nsa()[1].nsa_attention_reference(*args)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    logged = [r.getMessage() for r in caplog.records if "do not handle head_dim=256" in r.getMessage()]
    assert len(logged) == 1, [r.getMessage() for r in caplog.records]


@pytest.mark.parametrize("capability,wide", [(80, False), (86, False), (89, False), (90, True), (100, True),
                                             (120, False)])
def test_wide_tile_launches_only_where_mma_reads_shared_memory(monkeypatch, capability, wide):
    # sm_120 (RTX 50xx) is numbered above Hopper but multiplies from registers with 99 KiB of shared memory:
    # given Hopper's tiles its kernels spill 500-1000 bytes per thread (tests/triton_aot.py --arch 120)
    monkeypatch.setattr(common, "_compute_capability", lambda device: capability)
    assert common._hopper_class("cpu") == wide
    block_m, _, opts = launch._dq_launch(6, 64, 16, "cpu")
    assert (block_m, opts["num_warps"]) == ((128, 8) if wide else (32, 4))


@pytest.mark.parametrize("device,dtype,computes_in", [
    ("cuda", torch.bfloat16, torch.bfloat16), ("cuda", torch.float16, torch.float16),
    ("cuda", torch.float32, torch.bfloat16), ("cuda", torch.float64, torch.bfloat16),
    ("cpu", torch.float32, torch.float32),  # the interpreter computes float32 exactly: the CPU kernel tests use it
])
def test_kernel_dtype_on_a_gpu_is_bf16_or_fp16(device, dtype, computes_in):
    assert tri.kernel_dtype(dtype, device) == computes_in


@pytest.mark.parametrize("interpreting,computes_in", [(True, torch.float32), (False, torch.bfloat16)])
def test_bf16_under_the_interpreter_computes_in_float32(monkeypatch, interpreting, computes_in):
    # the interpreter multiplies bf16 tl.dot operands as raw bits (triton-lang/triton#11584): float32 there; a CPU
    # launch captured for an ahead-of-time compile (tests/triton_aot.py, not interpreting) keeps bf16
    monkeypatch.setattr(tri, "_interpreting", lambda: interpreting)
    assert tri.kernel_dtype(torch.bfloat16, "cpu") == computes_in
    assert tri.kernel_dtype(torch.float16, "cpu") == torch.float16


def test_under_autocast_the_kernels_get_the_autocast_dtype(monkeypatch):
    # The model's RoPE promotes q and the rotated keys to float32 under autocast (bf16 projection x float32
    # cos/sin); the op must still get the autocast dtype, as SDPA does, not float32 (the reference on a GPU).
    seen = {}

    class Launched(Exception):
        pass

    def record(*args):
        seen.update({i: a.dtype for i, a in enumerate(args[:10]) if torch.is_tensor(a) and a.is_floating_point()})
        raise Launched  # the launch itself is not what this checks

    monkeypatch.setattr(tri, "_nsa_fwd_op", record)
    monkeypatch.setattr(tri, "_decode_step", record)
    t, cmp_end, doc_pos, p = make_inputs(1, 40, 4, 2, 16, DEFAULT, torch.float32, "cpu")
    args = (t["q"], t["k_cmp"], t["v_cmp"], cmp_end, t["k_slc"], t["v_slc"], t["k_win"], t["v_win"], t["gates"],
            doc_pos, p)
    decode_args = (t["q"][:, -1:], *args[1:6], t["k_win"][:, -16:], t["v_win"][:, -16:], t["gates"][:, -1:],
                   doc_pos, p)
    for fn, fn_args in ((tri.nsa_attention_triton, args), (tri.nsa_decode_triton, decode_args)):
        seen.clear()
        with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(Launched):
            fn(*fn_args)
        assert seen and set(seen.values()) == {torch.bfloat16}, (fn.__name__, seen)
        seen.clear()
        with pytest.raises(Launched):  # without autocast the inputs keep their dtype
            fn(*fn_args)
        assert set(seen.values()) == {torch.float32}, (fn.__name__, seen)


def test_shared_memory_limit_asks_the_gpu_once(monkeypatch):
    from types import SimpleNamespace

    asked = []

    def props(index):
        asked.append(index)
        return SimpleNamespace(shared_memory_per_block_optin=101376)

    monkeypatch.setattr(torch.cuda, "get_device_properties", props)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(common, "_CUDA_SHARED_MEMORY", {})
    assert common._shared_memory_limit(CUDA) == 101376
    assert common._shared_memory_limit(torch.device("cuda", 0)) == 101376
    assert asked == [0]  # cached: the decode step asks on every call
    # a torch without the attribute: the table by compute capability
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: SimpleNamespace())
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(common, "_CUDA_SHARED_MEMORY", {})
    assert common._shared_memory_limit(CUDA) == 163 * 1024


def test_kernel_entry_points_raise_on_what_they_do_not_handle(monkeypatch):
    # no fallback inside the kernels' entry points: the error names the parameter and where the reference is
    monkeypatch.setattr(common, "_compute_capability", lambda device: 86)
    t, cmp_end, doc_pos, p = make_inputs(1, 40, 2, 1, 256, DEFAULT, torch.float32, "cpu")
    args = (t["q"], t["k_cmp"], t["v_cmp"], cmp_end, t["k_slc"], t["v_slc"], t["k_win"], t["v_win"], t["gates"],
            doc_pos, p)
    decode_args = (t["q"][:, -1:], *args[1:8], t["gates"][:, -1:], *args[9:])
    for fn, fn_args in ((tri.nsa_attention_triton, args), (tri.nsa_decode_triton, decode_args)):
        with pytest.raises(ValueError, match=rf"{fn.__name__}: the Triton kernels do not handle head_dim=256 .*"
                                             r"nsa_backend.nsa_attention\(..., backend='auto'\)"):
            fn(*fn_args)
    # the differentiable entry point takes one query per key: a chunk after a cache (decode_args' last query of
    # 40 keys) is refused, naming the shapes and the decode entry point, before any kernel runs
    with pytest.raises(ValueError, match=r"nsa_attention_triton: one query per key \(Tq == Tk == Tw\), got Tq=1, "
                                         r"Tk=40, Tw=40; .*nsa_decode_triton"):
        tri.nsa_attention_triton(*decode_args)
    # the seam under an explicit 'triton' raises too (under 'auto' it runs the reference: the test above)
    _on_a_gpu_where_the_kernels_run(monkeypatch)
    with pytest.raises(RuntimeError, match="nsa_backend='triton' but the Triton kernels do not handle head_dim=256"):
        backend.nsa_attention(*args, backend="triton")


def test_reference_fallback_compiles_fullgraph(monkeypatch):
    # the fallback's log line must not break torch.compile(fullgraph=True) of a model that falls back
    monkeypatch.setattr(common, "_compute_capability", lambda device: 86)
    monkeypatch.setattr(backend, "_logged_once", set())
    _on_a_gpu_where_the_kernels_run(monkeypatch)
    t, cmp_end, doc_pos, p = make_inputs(1, 40, 2, 1, 256, DEFAULT, torch.float32, "cpu")
    args = (t["q"], t["k_cmp"], t["v_cmp"], cmp_end, t["k_slc"], t["v_slc"], t["k_win"], t["v_win"], t["gates"],
            doc_pos)
    compiled = torch.compile(lambda *a: backend.nsa_attention(*a, p), fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(*args), import_nsa()[1].nsa_attention_reference(*args, p))
    # ... and says it there too: dynamo replays the log call after the graph (a whole model compiled has no eager
    # call around it that would), once
    compiled(*args)
    assert len([m for m in backend._logged_once if "do not handle head_dim=256" in m]) == 1


def test_float32_inputs_computed_in_bf16_come_back_in_float32_and_say_so(monkeypatch, caplog):
    # what a float32 model outside autocast gets on a GPU, with the GPU's dtype rule stood in on CPU
    monkeypatch.setattr(tri, "kernel_dtype", lambda dtype, device: torch.bfloat16)
    monkeypatch.setattr(backend, "_logged_once", set())
    seen = []

    def fake_op(*args):
        seen.append(args[0].dtype)
        return (args[0] * 2,)

    monkeypatch.setattr(tri, "_nsa_fwd_op", fake_op)
    t, cmp_end, doc_pos, p = make_inputs(1, 40, 4, 2, 16, DEFAULT, torch.float32, "cpu")
    args = (t["q"], t["k_cmp"], t["v_cmp"], cmp_end, t["k_slc"], t["v_slc"], t["k_win"], t["v_win"], t["gates"],
            doc_pos, p)
    with caplog.at_level(logging.WARNING):
        outs = [tri.nsa_attention_triton(*args) for _ in range(2)]
    assert seen == [torch.bfloat16, torch.bfloat16] and all(o.dtype == torch.float32 for o in outs)
    torch.testing.assert_close(outs[0], (t["q"].to(torch.bfloat16) * 2).float(), rtol=0, atol=0)
    said = [r.getMessage() for r in caplog.records if "compute in torch.bfloat16" in r.getMessage()]
    assert len(said) == 1 and "return torch.float32" in said[0], said


def test_select_blocks_triton_names_what_it_cannot_do():
    params = layout.NSAParams(**{**DEFAULT, "sel_block_size": 48})
    q = torch.zeros(1, 8, 2, 64)
    with pytest.raises(ValueError, match="sel_block_size=48 .*nsa_reference.select_blocks"):
        tri.select_blocks_triton(q, torch.zeros(1, 1, 1, 64), torch.zeros(1, 1, dtype=torch.long),
                                 torch.arange(8)[None], params)


@pytest.mark.parametrize("capability", [90, 80])
def test_pipeline_stages_where_the_loads_stay_in_flight(monkeypatch, capability):
    """sm_90: three stages for the fused dQ (every tile to head_dim 128), the selected forward at head_dim 128 and
    the compressed/window dK/dV at head_dim 128, where two left their loops waiting for every copy
    (tests/test_triton_compile.py checks the TTGIR); the selected dK/dV at head_dim 128 keeps two (its per-tile index
    load waits anyway); head_dim 256 two. Before Hopper: two for the dQ and selected forward, one for the dK/dV."""
    monkeypatch.setattr(common, "_compute_capability", lambda device: capability)
    hopper = capability == 90
    assert launch._dq_launch(6, 64, 16, "cpu")[2]["num_stages"] == (3 if hopper else 2)
    assert launch._dq_launch(6, 64, 16, "cpu")[0] == (128 if hopper else 32)
    assert launch._dq_launch(6, 64, 8, "cpu")[2]["num_stages"] == (3 if hopper else 2)  # the 64-row tile (T < 1024)
    assert launch._dq_launch(8, 128, 16, "cpu")[2]["num_stages"] == (3 if hopper else 2)
    assert launch._dq_launch(2, 256, 16, "cpu")[2]["num_stages"] == 2
    with tri.launch_overrides(dq_rows=64):
        assert launch._dq_launch(6, 64, 16, "cpu")[2]["num_stages"] == (3 if hopper else 2)
    assert launch._sel_fwd_opts(128, "cpu") == dict(num_warps=8, num_stages=3 if hopper else 2)
    assert launch._sel_fwd_opts(256, "cpu")["num_stages"] == 2
    # the register caps were timed on sm_90 only: other architectures keep the compiler's allocation
    assert launch._sel_fwd_opts(64, "cpu").get("maxnreg") == launch._topn_opts(64, "cpu").get("maxnreg") == \
        (128 if hopper else None)
    assert launch._dkdv_launch(8, 128, "cpu")[2]["num_stages"] == (3 if hopper else 1)
    assert launch._dkdv_launch(8, 128, "cpu", selected=True)[2]["num_stages"] == (2 if hopper else 1)
    assert launch._dkdv_launch(2, 256, "cpu")[2]["num_stages"] == (2 if hopper else 1)


@pytest.mark.parametrize("capability", [90, 80])
def test_selected_dkdv_chunks_where_they_pipeline(monkeypatch, capability):
    """The selected dK/dV's tile loop in chunks of 256 pairs only on sm_90 at head_dim <= 64 with an even G (where
    tests/triton_aot.py finds it pipelined without spills); each tile's own index load elsewhere; forced either way."""
    monkeypatch.setattr(common, "_compute_capability", lambda device: capability)
    hopper = capability == 90
    for group, qpb, head_dim, expected in [(6, 10, 64, 25), (16, 4, 64, 64), (2, 32, 64, 8), (1, 64, 64, 0),
                                           (3, 21, 64, 0), (8, 4, 128, 0)]:
        assert launch._sel_dkdv_chunk_tiles(group, qpb, head_dim, "cpu") == (expected if hopper else 0)
    with tri.launch_overrides(sel_dkdv_chunk_pairs=12):
        assert launch._sel_dkdv_chunk_tiles(3, 21, 64, "cpu") == 1 and launch._sel_dkdv_chunk_tiles(16, 4, 64, "cpu") == 3
    with tri.launch_overrides(sel_dkdv_chunk_pairs=0):
        assert launch._sel_dkdv_chunk_tiles(6, 10, 64, "cpu") == 0


@pytest.mark.parametrize("num_q, n_sel, head_dim, element_size", [(65536, 16, 64, 2), (8192, 16, 128, 2),
                                                                   (100, 4, 16, 4), (1, 16, 64, 2), (3, 1, 64, 2)])
def test_block_outer_chunks_keep_their_partials_within_twice_q(num_q, n_sel, head_dim, element_size):
    """The block-outer schedules' query chunks: a chunk's partials (per query and head n' slots of an output row and
    an fp32 log-sum-exp) stay within twice q's bytes per head (the forward's) or once (the dQ's), so the extra
    memory does not grow with n'; one query more would not fit (where the chunk is not the whole sequence); at
    least one query; the override wins."""
    per_query = n_sel * (head_dim * element_size + 4)
    for q_sizes in (2.0, 1.0):
        chunk = launch._sel_fwd_pair_queries(num_q, n_sel, head_dim, element_size, q_sizes)
        budget = q_sizes * num_q * head_dim * element_size
        assert 1 <= chunk <= num_q
        assert chunk == num_q or chunk == 1 or (chunk * per_query <= budget < (chunk + 1) * per_query)
    assert launch._sel_fwd_pair_queries(num_q, n_sel, head_dim, element_size) == \
        launch._sel_fwd_pair_queries(num_q, n_sel, head_dim, element_size, 2.0)
    with tri.launch_overrides(sel_fwd_pair_queries=7):
        assert launch._sel_fwd_pair_queries(num_q, n_sel, head_dim, element_size) == min(7, num_q)


def test_launch_overrides_reach_the_launchers_for_the_block_only_and_name_the_valid_choices():
    # G = 6, head_dim 64: the selected tile is 64 rows by default, 32 rows forced, and the default again after
    default = launch._sel_rows_per_program(6, 64)
    with tri.launch_overrides(sel_rows=32, dkdv_warps=2):
        assert launch._sel_rows_per_program(6, 64) == (32, 5)
        assert launch._dkdv_launch(6, 64, "cpu")[2]["num_warps"] == 2
        with tri.launch_overrides(sel_rows=16):  # nested: the inner block's value, then the outer one's again
            assert launch._sel_rows_per_program(6, 64)[0] == 16
        assert launch._sel_rows_per_program(6, 64) == (32, 5)
    assert launch._sel_rows_per_program(6, 64) == default == (64, 10)
    assert launch._dkdv_launch(6, 64, "cpu")[2]["num_warps"] == 4
    # pipeline stages (bench/gpu_session.sh's `stages` sweep): Triton's own unless forced, per kernel
    assert "num_stages" not in launch._dkdv_launch(6, 64, "cpu")[2]
    assert "num_stages" not in launch._sel_fwd_opts(64, "cpu")
    with tri.launch_overrides(dkdv_stages=4, dq_stages=2, sel_stages=2):
        assert launch._dkdv_launch(6, 64, "cpu")[2]["num_stages"] == 4
        assert launch._dkdv_launch(8, 128, "cpu", selected=True)[2]["num_stages"] == 4
        assert launch._dq_launch(6, 64, 16, "cpu")[2]["num_stages"] == 2
        assert launch._sel_fwd_opts(64, "cpu") == dict(num_warps=4, num_stages=2, maxnreg=128)
        assert launch._sel_fwd_opts(128, "cpu") == dict(num_warps=8, num_stages=2)
    # the register caps (sm_90, which the interpreter's launches count as, at head_dim 64): 128 by default, none
    # above head_dim 64, none when forced to 0, the forced value otherwise
    assert launch._sel_fwd_opts(64, "cpu")["maxnreg"] == launch._topn_opts(64, "cpu")["maxnreg"] == 128
    assert "maxnreg" not in launch._sel_fwd_opts(128, "cpu") and "maxnreg" not in launch._topn_opts(128, "cpu")
    with tri.launch_overrides(sel_fwd_max_registers=0, topn_max_registers=96):
        assert "maxnreg" not in launch._sel_fwd_opts(64, "cpu") and launch._topn_opts(64, "cpu")["maxnreg"] == 96
    with pytest.raises(TypeError, match=r"unknown launch choice\(s\) \['sel_tile'\]; valid: .*'sel_rows'"):
        with tri.launch_overrides(sel_tile=32):
            pass


@pytest.mark.parametrize("qpb", [1, 10, 21, 32, 64, 128])
def test_union_sort_keys_turn_int64_exactly_where_int32_ones_would_collide(qpb):
    """_tile_union_kernel sorts first_key << QBITS | query as int32 with int32's maximum as the unused entries' key:
    at the last length the launcher keeps int32 for, the largest real key stays below it; one key more and it
    would reach it, so the launcher sorts int64 there (and everywhere under sel_union_wide_keys)."""
    selected = kernel_module("selected")
    q_bits = selected._union_query_bits(qpb)
    assert 2**q_bits >= qpb and (q_bits == 1 or 2 ** (q_bits - 1) < qpb)
    last_narrow = 2 ** (31 - q_bits) - 1
    assert not selected._union_sort_keys_wide(last_narrow, q_bits)
    assert selected._union_sort_keys_wide(last_narrow + 1, q_bits)

    def largest_key(num_keys):  # the last key's block start, the tile's last query
        return ((num_keys - 1) << q_bits) | (qpb - 1)

    assert largest_key(last_narrow) < 2**31 - 1 <= largest_key(last_narrow + 1) | (2**q_bits - 1)
    with launch.launch_overrides(sel_union_wide_keys=True):
        assert selected._union_sort_keys_wide(100, q_bits)


def test_heavy_split_slots_go_to_the_heaviest_blocks_heaviest_first():
    """The selected dK/dV splits its n_heavy heaviest blocks (_sel_heavy_slots), not the first heavy ones in flat
    (batch x kv head, block) order: at 64k tokens the first kv head's early blocks filled the slots in flat order and
    the second head's block 0 (65,536 pairs) ran unsplit in one program (16 ms where 3.7 ms would do). Flat layout
    here: two rows of 6 blocks; heavy_min 10; 3 slots. The heaviest (row 1's block 0) comes first, ties go to the
    lower flat index, a heavy block past the slots is left to the main pass (rank n_heavy + 1), light ones 0."""
    selected = kernel_module("selected")
    cnt = torch.tensor([20, 12, 11, 0, 3, 12,
                        90, 15, 1, 12, 0, 0])
    heavy = cnt > 10
    hpos, slot_rank = selected._sel_heavy_slots(cnt, heavy, 3)
    assert hpos.tolist() == [6, 0, 7]
    assert slot_rank.tolist() == [1, 4, 4, 0, 0, 4,
                                  1, 1, 0, 4, 0, 0]
    # fewer heavy blocks than slots: the spare slots name no block (n_flat)
    hpos, slot_rank = selected._sel_heavy_slots(cnt, cnt > 15, 3)
    assert hpos.tolist() == [6, 0, 12] and slot_rank.tolist() == [1] + [0] * 5 + [1] + [0] * 5
    # ties: the lower flat index takes the last slot (blocks 1, 5 and 9 hold 12 pairs each)
    hpos, _ = selected._sel_heavy_slots(cnt, heavy, 5)
    assert hpos.tolist() == [6, 0, 7, 1, 5]


def test_offsets_within_a_row_are_int32_exactly_while_the_row_fits():
    """The union walk and the interval tiles take K/V element offsets within a row as int32 (KV32) while the row's
    num_keys x num_kv x head_dim elements stay below 2**31, and the dK/dV kernels their q/dO rows (ROW32) while
    num_q x num_heads x head_dim do; int64 from there on and under launch_overrides(offsets_int64=True)."""
    last = 2**31 // (2 * 64) - 1  # keys at 2 kv heads x head_dim 64
    assert launch._kv_offsets_fit_int32(last, 2, 64) and not launch._kv_offsets_fit_int32(last + 1, 2, 64)
    assert (last + 1) * 2 * 64 == 2**31
    with launch.launch_overrides(offsets_int64=True):
        assert not launch._kv_offsets_fit_int32(100, 2, 64) and not launch._rows_fit_int32(100, 12, 64)
    # the dK/dV kernels' q/dO rows within a batch row (ROW32)
    last_q = -(-(2**31) // (12 * 64)) - 1  # (2**31 is not a multiple of 768)
    assert launch._rows_fit_int32(last_q, 12, 64) and not launch._rows_fit_int32(last_q + 1, 12, 64)


@needs_triton
@pytest.mark.parametrize("capability,interpreting,opted_in,expected", [
    (90, False, True, True), (100, False, True, True), (80, False, True, False), (86, False, True, False),
    (120, False, True, False), (90, True, True, False), (90, False, False, False),
], ids=["sm90", "sm100", "sm80", "sm86", "sm120", "sm90-interpreter", "sm90-default"])
@pytest.mark.parametrize("static,fused_combine", [(False, False), (True, False), (True, True)],
                         ids=["eager", "static", "static-fusedcombine"])
def test_decode_launches_are_programmatic_dependent_only_where_asked_and_supported(
        monkeypatch, capability, interpreting, opted_in, expected, static, fused_combine):
    """decode_pdl=1 makes every launch of the decode step a programmatic dependent launch (launch_pdl) and its
    kernel wait for the launch before it (PDL, _after_previous_launch) on Hopper and datacenter Blackwell, the two
    always together (a launch_pdl kernel that did not wait could read its inputs before they are written); never
    before Hopper, on consumer Blackwell (untried), in the interpreter (griddepcontrol is PTX), or by default.
    The step's launches then follow each other with no torch kernel between them (only allocations): the fused
    combine's zeroed count comes before the first, so each link's wait is on the link before it."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from triton_aot import _Recorder, with_kernels_replaced

    monkeypatch.setattr(common, "_compute_capability", lambda device: capability)
    monkeypatch.setenv("TRITON_INTERPRET", "1" if interpreting else "0")
    t, cmp_end, doc_pos, p = make_inputs(2, 300, 12, 2, 64, DEFAULT, torch.bfloat16, "cpu", "pad")
    tk, w = 300, p.window_size
    events: list = []  # torch ops (names) and recorded launches ((name, fn, args, kwargs)) in the order they run

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            events.append(str(func.overloadpacket.__name__))
            return func(*args, **(kwargs or {}))

    def step():  # the launcher itself (nsa_decode_triton runs a static step inside a custom op: the mode sees only it)
        query_end = torch.tensor([tk - 1]) if static else None
        window = slice(0, w) if static else slice(tk - w, tk)  # a static cache's ring, or the last w keys
        k_win, v_win = t["k_win"][:, window], t["v_win"][:, window]
        args, scale, _ = tri._kernel_args(t["q"][:, tk - 1:], t["k_cmp"], t["v_cmp"], cmp_end, t["k_slc"], t["v_slc"],
                                          k_win, v_win, t["gates"][:, tk - 1:], doc_pos, None, batch_strided=True)
        with Ops():
            kernel_module("decode")._decode_step(*args, p, scale, query_end)

    with tri.launch_overrides(decode_pdl=int(opted_in), decode_fused_combine=int(fused_combine)):
        with_kernels_replaced(step, lambda name, fn: _Recorder(name, fn, events))
    launched = [i for i, e in enumerate(events) if isinstance(e, tuple)]
    expected_kernels = (["_decode_cmp_split_kernel", "_decode_topn_kernel"]
                        + (["_decode_parts_kernel"] if static else ["_decode_finish_kernel"])
                        + (["_decode_combine_kernel"] if static and not fused_combine else []))
    assert [events[i][0] for i in launched] == expected_kernels
    for i in launched:
        name, _, _, kwargs = events[i]
        assert kwargs["PDL"] is expected and kwargs.get("launch_pdl", False) is expected, (name, kwargs)
    between = [e for e in events[launched[0]:launched[-1]] if not isinstance(e, tuple)]
    assert all(op.startswith("empty") for op in between), between
    if fused_combine:  # the count zeroed before the first launch
        assert {"zeros", "zero_", "fill_"} & set(events[:launched[0]]), events[:launched[0]]


def test_the_launchers_run_on_their_inputs_gpu(monkeypatch):
    """Triton launches on the current CUDA device: each launcher (training forward and backward, the decode step,
    the block selection) makes its inputs' GPU current, so a model split over GPUs (device_map) launches each
    layer where its tensors are. Checked with a tensor that says it is on cuda:1 and torch.cuda.device recorded."""
    import contextlib

    decode = kernel_module("decode")
    for launcher in (tri._forward_impl, tri._backward_impl, decode._decode_step, tri.select_blocks_triton):
        assert getattr(launcher, "__wrapped__", None) is not None, launcher  # (wrapped by on_the_inputs_device)

    class OnSecondGpu(torch.Tensor):
        is_cuda = property(lambda self: True)
        device = property(lambda self: torch.device("cuda", 1))

    entered = []
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext(entered.append(device)))
    launched = common.on_the_inputs_device(lambda *tensors: torch.cuda.current_device if entered else None)
    assert launched(2.0, torch.zeros(1).as_subclass(OnSecondGpu)) is not None and entered == [torch.device("cuda", 1)]
    entered.clear()
    assert launched(torch.zeros(1)) is None and entered == []  # a CPU tensor (the interpreter): no device switch
