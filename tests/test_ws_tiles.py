"""bench/ws_tiles.py, the warp-specialization measurement owed to a GPU session: its kernels compute the walks they
time (Triton's interpreter, against the torch walk), and on sm_90 Triton builds the specialized variants as a
producer and two consumer warpgroups and leaves the others as they are (compiled without a GPU). Both run in
subprocesses: the interpreter is chosen when triton is imported, and the compile must not see it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

try:
    from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401

    HAS_NVIDIA_BACKEND = True
except Exception:
    HAS_NVIDIA_BACKEND = False


def _run(code: str, interpret: bool) -> str:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_every_variant_matches_the_torch_walk_in_the_interpreter():
    """Each variant's dK/dV or dQ against the walk in torch (fp16: the interpreter multiplies bf16 as raw bits), at
    fixed tiles whose walks start at different rows (the last ones clamped to the end)."""
    out = _run("import sys, json, torch; sys.path.insert(0, 'bench'); import ws_tiles as w; "
               "print(json.dumps({v: w.check(v, 'cpu', R=384, N=384, D=16, walk=128, dtype=torch.float16) "
               "for v in w.VARIANTS}))", interpret=True)
    errors = json.loads(out.strip().splitlines()[-1])
    assert set(errors) == {"dkdv_ptr64", "dkdv_tma64", "dkdv_ws128", "dkdv_ptr128", "dq_ptr128", "dq_tma128",
                           "dq_ws128", "dq_ptr64"}
    bad = {v: e for v, e in errors.items() if not e < 2e-3}  # fp16 rounding of P and dS: ~2e-4
    assert not bad, bad


def test_the_reference_walk_is_what_the_kernels_are_checked_against():
    """The torch walk itself, on one tile by hand: a wrong reference would pass wrong kernels."""
    out = _run("import sys, json, torch; sys.path.insert(0, 'bench'); import ws_tiles as w; "
               "q, k, v, do, lse, delta = w.make_inputs(64, 64, 16, 'cpu', dtype=torch.float32); "
               "dk, dv = w.reference('dkdv_ptr64', q, k, v, do, lse, delta, 64); "
               "(dq,) = w.reference('dq_ptr64', q, k, v, do, lse, delta, 64); "
               "s = q @ k.T * 16 ** -0.5; p = torch.exp(s - lse[:, None] / w.LOG2E); "
               "ds = p * (do @ v.T - delta[:, None]); "
               "print(json.dumps([float((dv - p.T @ do).abs().max()), float((dk - ds.T @ q * 0.25).abs().max()), "
               "float((dq - ds @ k * 0.25).abs().max())]))", interpret=False)
    assert max(json.loads(out.strip().splitlines()[-1])) < 1e-4


@pytest.mark.skipif(not HAS_NVIDIA_BACKEND, reason="triton's NVIDIA backend is needed to compile for sm_90")
def test_ws_variants_compile_to_a_producer_and_two_consumer_warpgroups_on_sm90():
    out = _run("import runpy, sys; sys.argv = ['ws_tiles.py', '--compile-only']; "
               "runpy.run_path('bench/ws_tiles.py', run_name='__main__')", interpret=False)
    got = {r["variant"]: r for r in map(json.loads, (ln for ln in out.splitlines() if ln.startswith("{")))}
    # a fair race: no variant's tensor-core instructions serialized by ptxas (one group per HGMMA), which a loop
    # that may run no tile caused in the pointer and descriptor loops until they ran under an if
    serialized = {v: (r["hgmma"], r["hgmma_groups"]) for v, r in got.items() if r["hgmma_groups"] >= r["hgmma"]}
    assert len(got) == 8 and not serialized, serialized
    for name in ("dkdv_ws128", "dq_ws128"):
        r = got[name]
        # 4 warps asked for, 12 run: the default warpgroup issues the copies, two consumers split the tile
        assert r["warp_specialized"] and r["partitions"] == 2 and r["warps"] == 12, r
        assert len(r["partition_registers"]) == 2 and min(r["partition_registers"]) >= 200, r
        assert r["tma_copies"] > 0 and r["local"] == 0, r
    assert not got["dkdv_tma64"]["warp_specialized"] and got["dkdv_tma64"]["tma_copies"] > 0
    assert got["dkdv_ptr64"]["tma_copies"] == 0 and got["dkdv_ptr64"]["warps"] == 4


def test_the_timed_walks_count_every_product_and_start_apart():
    """The FLOPs the GPU run divides by: 4 (dK/dV) or 3 (dQ) products of 2 x 64 x 64 x D per 64 x 64 tile; and the
    other side long enough that every program's walk starts at a row of its own (no program reads another's
    rows from L2)."""
    sys.path.insert(0, str(ROOT / "bench"))
    import ws_tiles as w

    R, N, flops = w.walk_problem("dkdv", 3072, 65536, 64)
    assert (R, N) == (65536 + 3072, 65536) and flops == 1024 * 48 * 4 * 2 * 64 * 64 * 64
    # the kernels' start rule, min(p * fixed tile, other side - walk): distinct for every program
    assert len({min(p * 128, R - 3072) for p in range(N // 128)}) == N // 128
    R, N, flops = w.walk_problem("dq", 2048, 65536, 128)
    assert (R, N) == (65536, 65536 + 2048) and flops == 1024 * 32 * 3 * 2 * 64 * 64 * 128
    assert len({min(p * 128, N - 2048) for p in range(R // 128)}) == R // 128
