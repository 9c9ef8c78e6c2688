"""Does Hopper warp specialization speed up the backward's tile loops? A measurement before a rewrite.

The dK/dV kernels run at 0.2-0.3 of their floors on the H100 and the fused dQ at 0.14-0.31 (bench/KERNELS.md):
one or two warpgroups per program walk 64 x 64 tiles, and each tile's dots wait for the one before.
FlashAttention-3 reaches 0.5-0.6 in its backward with a producer warp loading tiles by TMA and two consumer
warpgroups computing. Triton (3.6 on the H100, 3.9 here) builds that structure itself for a loop marked
``tl.range(..., warp_specialize=True)`` on sm_90 (its NVGPUWarpSpecialization pass: the program's fixed tile split
over two consumer warpgroups of 232 registers a thread, a producer warpgroup of 40 issuing the TMA copies), under
three conditions found by compiling (bench/KERNELS.md, "2026-11-28, second CPU session"):
- 4 warps: at 8 the pass leaves the loop as it is;
- every load before the loop through a tensor descriptor (a pointer load there fails the pass: "unsupported load
  type for producer commit"); pointer loads inside the loop are allowed (the dK/dV loop's lse and delta);
- descriptors made on the device (`tl.make_tensor_descriptor`): the pass rewrites the split tile's descriptor
  block, which it cannot do to one passed from the host ("descriptor block and tensor must have the same number of
  elements"). They take 128 bytes of global scratch per program from `triton.set_allocator`.
This script times that structure on the two loops alone, against the loops as the project's kernels write them,
before any kernel is rewritten around it.

The loops, unmasked (the interior tiles' case), with the gate folded into the log-sum-exp as in the kernels:
- dK/dV (`_interval_bwd_dkdv_kernel`'s unmasked interior): program p holds keys [p BN, (p + 1) BN) and walks
  `--dkdv-walk` query rows from row min(p BN, R - walk) in tiles of 64: S^T = K Q^T, P^T = exp2(S^T scale2 -
  lse_g), dV += P^T dO, dP^T = V dO^T, dS^T = P^T (dP^T - delta), dK += dS^T Q; stores dK scale and dV (fp32);
- dQ (the fused dQ's interval loops): program p holds query rows [p BM, (p + 1) BM) and walks `--dq-walk` keys
  from key min(p BM, N - walk) in tiles of 64: S = Q K^T, P = exp2(S scale2 - lse_g), dS = P (dO V^T - delta),
  dQ += dS K; stores dQ scale.

Variants (`dkdv_*`, `dq_*`; rows of the table):
- `dkdv_ptr64`, `dq_ptr128`: the kernels' own loops (`_dkdv_query_tiles`, `_interval_dq_range`: pointer loads
  with int32 offsets), at the tiles and warps of the project's kernels
  (64 keys at 4 warps; 128 query rows at 8 warps);
- `dkdv_tma64`, `dq_tma128`: the same tiles and warps with tensor-descriptor loads (TMA), no specialization;
- `dkdv_ws128`, `dq_ws128`: tensor descriptors, a 128-row fixed tile at 4 warps, warp_specialize (12 warps run);
- `dkdv_ptr128`, `dq_ptr64`: the other tile with pointer loads (128 keys at 8 warps, two warpgroups without a
  producer; 64 query rows at 4 warps): whether a gain is the specialization or only the tile.

    python bench/ws_tiles.py [--json ws.json] [--length 65536] [--dkdv-walk 3072] [--dq-walk 2048] [--stages 0 2 4]
    python bench/ws_tiles.py --compile-only [--arch 90]     # no GPU: compile each variant, print its structure

Each variant is first checked against the same walk in torch (fp32); then timed (10 launches per timing, median of
20 timings after 3 warm-ups)
and reported as TFLOP/s (2 x 64 x 64 x D FLOPs per product, 4 products per dK/dV tile and 3 per dQ tile) and as
a fraction of a bf16 8192^3 torch.matmul timed in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

import torch

try:
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - the script needs triton
    triton = tl = None

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
if triton is not None:  # the kernels' own tile updates and row loads, so the pointer variants are the kernels' loops
    from modeling_nsa.nsa_triton_common import _dkdv_update, _dv_unscaled
    from modeling_nsa.nsa_triton_dq import _dq_update, _interval_dq_range
    from modeling_nsa.nsa_triton_interval import _dkdv_query_tiles

LOG2E = 1.4426950408889634
REPEAT = 10  # launches per timed call
LAUNCHED: dict = {}  # variant -> the compiled kernel its last launch ran (what the GPU run records per row)
TESTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests")  # tests/triton_aot.py's compile
VARIANTS = {  # name: (loop, rows of the program's fixed tile, tensor descriptors, warp_specialize, num_warps)
    "dkdv_ptr64": ("dkdv", 64, False, False, 4),
    "dkdv_tma64": ("dkdv", 64, True, False, 4),
    "dkdv_ws128": ("dkdv", 128, True, True, 4),
    "dkdv_ptr128": ("dkdv", 128, False, False, 8),
    "dq_ptr128": ("dq", 128, False, False, 8),
    "dq_tma128": ("dq", 128, True, False, 8),
    "dq_ws128": ("dq", 128, True, True, 4),
    "dq_ptr64": ("dq", 64, False, False, 4),
}


if triton is not None:

    @triton.jit
    def _dkdv_tiles_ptr_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, R, N, WALK, scale2, scale,
                               D: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr):
        # Q, DO (R, D), K, V (N, D) bf16; LSE, DELTA (R,) fp32; DK, DV (N, D) fp32
        pid = tl.program_id(0)
        kk = pid * BN + tl.arange(0, BN)
        d = tl.arange(0, D)
        k = tl.load(K + kk[:, None] * D + d[None, :])  # (BN, D)
        v = tl.load(V + kk[:, None] * D + d[None, :])
        dk = tl.zeros([BN, D], tl.float32)
        dv = tl.zeros([BN, D], tl.float32)
        start = tl.minimum(pid * BN, R - WALK)
        # the compressed/window dK/dV kernel's own unmasked query-tile loop, one head per query (G = 1, BM rows =
        # BM queries; LO and HI are not read unmasked; int32 row offsets)
        dk, dv = _dkdv_query_tiles(Q, DO, LSE, DELTA, LSE, LSE, 0, 0, start, start + WALK, start + WALK, R, kk, k, v,
                                   scale2, dk, dv, 1, 1, D, BM, BM, False, True)
        tl.store(DK + kk[:, None] * D + d[None, :], dk * scale)
        tl.store(DV + kk[:, None] * D + d[None, :], _dv_unscaled(dv, DO))  # (fp16: the kernels' 2^15 scale)

    @triton.jit
    def _dkdv_tiles_tma_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, R, N, WALK, scale2, scale,
                               D: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr, WS: tl.constexpr):
        # K and V (before the loop) and the query tiles through descriptors made on the device, the conditions of
        # the warp-specialization pass on sm_90 (module docstring): it splits the BN keys over two consumer
        # warpgroups and rewrites the K and V descriptors' blocks to BN / 2 rows. lse and delta stay pointer loads
        # (allowed inside the loop)
        qd = tl.make_tensor_descriptor(Q, shape=[R, D], strides=[D, 1], block_shape=[BM, D])
        dod = tl.make_tensor_descriptor(DO, shape=[R, D], strides=[D, 1], block_shape=[BM, D])
        kd = tl.make_tensor_descriptor(K, shape=[N, D], strides=[D, 1], block_shape=[BN, D])
        vd = tl.make_tensor_descriptor(V, shape=[N, D], strides=[D, 1], block_shape=[BN, D])
        pid = tl.program_id(0)
        k = kd.load([pid * BN, 0])  # (BN, D)
        v = vd.load([pid * BN, 0])
        dk = tl.zeros([BN, D], tl.float32)
        dv = tl.zeros([BN, D], tl.float32)
        start = tl.minimum(pid * BN, R - WALK)
        r = tl.arange(0, BM)
        # a dK/dV loop that may run no tile lets ptxas serialize the dots (_dkdv_query_tiles says why), so it runs
        # under an if where it has tiles; not when warp-specialized, which the pass does not do to a loop in an if
        if WS or WALK > 0:
            for r0 in tl.range(start, start + WALK, BM, warp_specialize=WS):
                q = qd.load([r0, 0])  # (BM, D)
                do = dod.load([r0, 0])
                lse = tl.load(LSE + r0 + r)
                delta = tl.load(DELTA + r0 + r)
                dk, dv = _dkdv_update(q, do, lse, delta, k, v, True, scale2, dk, dv)
        kk = pid * BN + tl.arange(0, BN)
        d = tl.arange(0, D)
        tl.store(DK + kk[:, None] * D + d[None, :], dk * scale)
        tl.store(DV + kk[:, None] * D + d[None, :], _dv_unscaled(dv, DO))  # (fp16: the kernels' 2^15 scale)

    @triton.jit
    def _dq_tiles_ptr_kernel(Q, K, V, DO, LSE, DELTA, DQ, R, N, WALK, scale2, scale,
                             D: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr):
        pid = tl.program_id(0)
        rows = pid * BM + tl.arange(0, BM)
        d = tl.arange(0, D)
        q = tl.load(Q + rows[:, None] * D + d[None, :])  # (BM, D)
        do = tl.load(DO + rows[:, None] * D + d[None, :])
        lse = tl.load(LSE + rows)
        delta = tl.load(DELTA + rows)
        dq = tl.zeros([BM, D], tl.float32)
        start = tl.minimum(pid * BM, N - WALK)
        # the fused dQ's own unmasked interval loop (one KV head: K/V rows of D; lo and hi are not read unmasked)
        dq = _interval_dq_range(q, do, lse, delta, K, V, 0, 0, 0, start, start + WALK, start + WALK, scale2, dq,
                                1, D, BN, False, True)
        tl.store(DQ + rows[:, None] * D + d[None, :], dq * scale)

    @triton.jit
    def _dq_tiles_tma_kernel(Q, K, V, DO, LSE, DELTA, DQ, R, N, WALK, scale2, scale,
                             D: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr, WS: tl.constexpr):
        # everything before the loop through descriptors made on the device (the pass's conditions, module
        # docstring): it splits the BM query rows over two consumer warpgroups, as FlashAttention-3 splits a
        # 128-row query tile
        qd = tl.make_tensor_descriptor(Q, shape=[R, D], strides=[D, 1], block_shape=[BM, D])
        dod = tl.make_tensor_descriptor(DO, shape=[R, D], strides=[D, 1], block_shape=[BM, D])
        kd = tl.make_tensor_descriptor(K, shape=[N, D], strides=[D, 1], block_shape=[BN, D])
        vd = tl.make_tensor_descriptor(V, shape=[N, D], strides=[D, 1], block_shape=[BN, D])
        # the rows' lse and delta through descriptors as well: a pointer load before the loop fails the pass
        ld = tl.make_tensor_descriptor(LSE, shape=[R], strides=[1], block_shape=[BM])
        dd = tl.make_tensor_descriptor(DELTA, shape=[R], strides=[1], block_shape=[BM])
        pid = tl.program_id(0)
        rows = pid * BM + tl.arange(0, BM)
        q = qd.load([pid * BM, 0])  # (BM, D)
        do = dod.load([pid * BM, 0])
        lse = ld.load([pid * BM])
        delta = dd.load([pid * BM])
        dq = tl.zeros([BM, D], tl.float32)
        start = tl.minimum(pid * BM, N - WALK)
        for k0 in tl.range(start, start + WALK, BN, warp_specialize=WS):
            k = kd.load([k0, 0])  # (BN, D)
            v = vd.load([k0, 0])
            dq = _dq_update(q, do, lse, delta, k, v, True, scale2, dq, False)
        d = tl.arange(0, D)
        tl.store(DQ + rows[:, None] * D + d[None, :], dq * scale)


def make_inputs(R: int, N: int, D: int, device, seed: int = 0, dtype=torch.bfloat16):
    """Q, dO (R, D) and K, V (N, D) in dtype (bf16; Triton's interpreter multiplies bf16 as its raw bits, so the
    CPU test passes fp16); lse_g and delta (R,) in fp32, lse_g at the scale of a row's log2-sum-exp over ~R keys
    so the probabilities are in range."""
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    q, k, v, do = rnd(R, D), rnd(N, D), rnd(N, D), rnd(R, D)
    lse = (torch.rand(R, generator=gen) * 2 + 10).to(device)
    delta = (torch.randn(R, generator=gen) * 0.1).to(device)
    return q, k, v, do, lse, delta


def launch(variant: str, q, k, v, do, lse, delta, walk: int, num_stages: int | None = None):
    """The variant's walk: dK, dV (N, D) fp32 for a dK/dV variant (each key tile over `walk` query rows), dQ (R, D)
    fp32 for a dQ variant (each query tile over `walk` keys)."""
    loop, tile, descriptors, ws, warps = VARIANTS[variant]
    R, D = q.shape
    N = k.shape[0]
    fixed, walked = (N, R) if loop == "dkdv" else (R, N)
    if fixed % tile or walk % 64 or walk > walked:
        raise ValueError(f"{variant}: {fixed} fixed rows must be a multiple of {tile}, and the walk of {walk} a "
                         f"multiple of 64 no longer than the {walked} rows it walks")
    scale = D ** -0.5
    opts = dict(num_warps=warps)
    if num_stages:
        opts["num_stages"] = num_stages
    if descriptors:
        # descriptors made on the device take 128 bytes of global scratch per program, from this allocator
        triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device=q.device))
        opts["WS"] = ws
    grid = (fixed // tile,)
    if loop == "dkdv":
        dk = torch.empty(N, D, device=q.device, dtype=torch.float32)
        dv = torch.empty_like(dk)
        kernel = _dkdv_tiles_tma_kernel if descriptors else _dkdv_tiles_ptr_kernel
        LAUNCHED[variant] = kernel[grid](q, k, v, do, lse, delta, dk, dv, R, N, walk, scale * LOG2E, scale, D=D,
                                         BN=tile, BM=64, **opts)
        return dk, dv
    dq = torch.empty(R, D, device=q.device, dtype=torch.float32)
    kernel = _dq_tiles_tma_kernel if descriptors else _dq_tiles_ptr_kernel
    LAUNCHED[variant] = kernel[grid](q, k, v, do, lse, delta, dq, R, N, walk, scale * LOG2E, scale, D=D, BM=tile,
                                     BN=64, **opts)
    return (dq,)


def reference(variant: str, q, k, v, do, lse, delta, walk: int):
    """The same walk in torch, fp32."""
    loop, tile = VARIANTS[variant][:2]
    R, D = q.shape
    N = k.shape[0]
    scale = D ** -0.5
    qf, kf, vf, dof = q.float(), k.float(), v.float(), do.float()
    if loop == "dkdv":
        dk = torch.empty(k.shape, dtype=torch.float32, device=k.device)
        dv = torch.empty_like(dk)
        for p in range(N // tile):
            keys = slice(p * tile, (p + 1) * tile)
            start = min(p * tile, R - walk)
            rows = slice(start, start + walk)
            pt = torch.exp2(kf[keys] @ qf[rows].T * (scale * LOG2E) - lse[rows][None, :])
            dv[keys] = pt @ dof[rows]
            dst = pt * (vf[keys] @ dof[rows].T - delta[rows][None, :])
            dk[keys] = dst @ qf[rows] * scale
        return dk, dv
    dq = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for p in range(R // tile):
        rows = slice(p * tile, (p + 1) * tile)
        start = min(p * tile, N - walk)
        keys = slice(start, start + walk)
        pr = torch.exp2(qf[rows] @ kf[keys].T * (scale * LOG2E) - lse[rows][:, None])
        ds = pr * (dof[rows] @ vf[keys].T - delta[rows][:, None])
        dq[rows] = ds @ kf[keys] * scale
    return (dq,)


def check(variant: str, device, R=512, N=512, D=64, walk=256, dtype=torch.bfloat16,
          num_stages: int | None = None) -> float:
    """Largest error of a variant's outputs against the torch walk, relative to the reference's largest value."""
    inputs = make_inputs(R, N, D, device, dtype=dtype)
    got = launch(variant, *inputs, walk, num_stages)
    want = reference(variant, *inputs, walk)
    return max(((g - w).abs().max() / w.abs().max()).item() for g, w in zip(got, want))


def compile_variant(variant: str, arch: int = 90, D: int = 64):
    """One variant compiled for sm_<arch> without a GPU, specialized as its timed launch is (the JIT's argument
    specialization of the default walk's arguments: 16-byte aligned pointers and sizes, which the pointer loads
    need to become pipelined asynchronous copies)."""
    sys.path.insert(0, TESTS)
    from triton_aot import _specialize

    from triton.compiler import ASTSource

    loop, tile, descriptors, ws, warps = VARIANTS[variant]
    q, k, v, do, lse, delta = make_inputs(256, 256, D, "cpu")  # (only the pointers' alignment is read)
    outs = (torch.empty(256, D), torch.empty(256, D)) if loop == "dkdv" else (torch.empty(256, D),)
    walk = 3072 if loop == "dkdv" else 2048
    args = (q, k, v, do, lse, delta, *outs, 8192, 65536, walk, 0.18, 0.125)
    kwargs = dict(D=D, BN=tile, BM=64) if loop == "dkdv" else dict(D=D, BN=64, BM=tile)
    if descriptors:
        kwargs["WS"] = ws
    fn = {("dkdv", False): _dkdv_tiles_ptr_kernel, ("dkdv", True): _dkdv_tiles_tma_kernel,
          ("dq", False): _dq_tiles_ptr_kernel, ("dq", True): _dq_tiles_tma_kernel}[loop, descriptors]
    target, options, signature, constexprs, attrs = _specialize(fn, args, dict(kwargs, num_warps=warps), arch)
    return triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)


def compile_structure(variant: str, arch: int = 90, D: int = 64) -> dict:
    """Registers, shared memory and warps of one variant compiled for sm_<arch> (compile_variant), whether Triton
    built the warp-specialized form (its partitions and their register budgets), its TMA copies, and its HGMMA
    instructions and their groups (as many groups as HGMMAs: ptxas serialized them, and the timing would not be
    of the loop the kernels run)."""
    sys.path.insert(0, TESTS)
    from triton_aot import _resources, _sass, _wgmma_groups  # the wheel's cuobjdump on the cubin

    kern = compile_variant(variant, arch, D)
    ttgir = kern.asm["ttgir"]
    hgmma, groups = _wgmma_groups(_sass(kern.asm["cubin"])) if arch >= 90 else (0, 0)
    budgets = re.search(r"requestedRegisters = array<i32: ([0-9, ]+)>", ttgir)
    return dict(variant=variant, arch=arch, warps=kern.metadata.num_warps, shared=kern.metadata.shared,
                warp_specialized="ttg.warp_specialize" in ttgir,
                partitions=len(re.findall(r"^\s*partition\d+\(", ttgir, re.M)),
                partition_registers=[int(x) for x in budgets.group(1).split(",")] if budgets else [],
                tma_copies=ttgir.count("async_tma_copy_global_to_local"), hgmma=hgmma, hgmma_groups=groups,
                triton=triton.__version__, **_resources(kern.asm["cubin"]))


def matmul_tflops(time_ms) -> float:
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    return 2 * n ** 3 / (time_ms(lambda: a @ b, 3, 20) * 1e-3) / 1e12


def walk_problem(loop: str, walk: int, length: int, D: int) -> tuple[int, int, int]:
    """(query rows R, keys N, FLOPs) of one variant's timed walk: `length` fixed rows (keys for dK/dV, query rows
    for dQ), each walking `walk` of the other side from its own row (the other side has length + walk rows, so no
    two programs start at the same row: a sliding walk, as the window's, not one the L2 holds for every program);
    4 products of 2 x 64 x 64 x D FLOPs per 64 x 64 tile for dK/dV, 3 for dQ."""
    other = length + walk
    R, N = (other, length) if loop == "dkdv" else (length, other)
    tiles = (length // 64) * (walk // 64)
    return R, N, tiles * (4 if loop == "dkdv" else 3) * 2 * 64 * 64 * D


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--length", type=int, default=65536,
                    help="fixed rows per walk: keys for the dK/dV loops, query rows for the dQ loops (a multiple "
                         "of 128)")
    ap.add_argument("--dkdv-walk", type=int, default=3072,
                    help="query rows each key tile walks (3,072: about what a 125M window key tile sees, 512 "
                         "queries x 6 heads)")
    ap.add_argument("--dq-walk", type=int, default=2048, help="keys each query tile walks")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--stages", type=int, nargs="*", default=[0],
                    help="num_stages to try per variant (0: Triton's default)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--compile-only", action="store_true", help="no GPU: compile each variant and print its structure")
    ap.add_argument("--arch", type=int, default=90)
    return ap.parse_args(argv)


def main():
    args = parse_args()
    if args.compile_only:
        for name in args.variants:
            print(json.dumps(compile_structure(name, args.arch, args.head_dim)), flush=True)
        return
    if not torch.cuda.is_available():
        sys.exit("no GPU: run with --compile-only, or on a machine with an NVIDIA GPU (sm_90 for the warp-specialized "
                 "variants)")
    from bench_attention import time_ms  # the benchmarks' timer: median of CUDA-event timings

    peak = matmul_tflops(time_ms)
    D = args.head_dim
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; bf16 matmul "
          f"{peak:.0f} TFLOP/s; head_dim {D}; {args.length} fixed rows, dK/dV walks {args.dkdv_walk} query rows, "
          f"dQ walks {args.dq_walk} keys")
    print("| variant | stages | warps (specialized) | error vs torch | ms | TFLOP/s | of matmul |")
    print("|---|---|---|---|---|---|---|")
    rows = []
    for name in args.variants:
        loop = VARIANTS[name][0]
        walk = args.dkdv_walk if loop == "dkdv" else args.dq_walk
        R, N, flops = walk_problem(loop, walk, args.length, D)
        inputs = make_inputs(R, N, D, "cuda")
        for stages in args.stages:
            row = dict(variant=name, stages=stages or "default", walk=walk)
            try:
                row["error"] = check(name, "cuda", D=D, num_stages=stages or None)
                # REPEAT launches per timing, so the host's launch time (~30 us, with the GPU idle after the start
                # event) is a small share of the 0.2-0.5 ms a launch takes
                ms = time_ms(lambda: [launch(name, *inputs, walk, stages or None) for _ in range(REPEAT)], 3, 20)
                ms /= REPEAT
                compiled = LAUNCHED.get(name)
                if compiled is not None and hasattr(compiled, "asm"):  # what this triton made of the launch
                    row.update(warps=compiled.metadata.num_warps,
                               warp_specialized="ttg.warp_specialize" in compiled.asm.get("ttgir", ""))
                row.update(ms=ms, tflops=flops / (ms * 1e-3) / 1e12)
                row["of_matmul"] = row["tflops"] / peak
                warps = f"{row.get('warps', '?')}{' (yes)' if row.get('warp_specialized') else ''}"
                print(f"| {name} | {row['stages']} | {warps} | {row['error']:.1e} | {ms:.3f} | {row['tflops']:.0f} "
                      f"| {row['of_matmul']:.2f} |", flush=True)
            except Exception as exc:  # report and go on: one variant failing must not hide the rest
                row["failed"] = f"{type(exc).__name__}: {exc}"[:300]
                print(f"| {name} | {row['stages']} | | FAILED: {row['failed'][:120]} | | | |", flush=True)
            rows.append(row)
        del inputs
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                           matmul_tflops=peak, length=args.length, head_dim=D, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
