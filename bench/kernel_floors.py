"""The two numbers first: for each kernel of the Triton NSA path, the FLOPs it must do and the bytes it must
move, against the machine's ceilings measured in the same run, next to the time it took.

    python bench/kernel_floors.py [--json floors.json] [--lengths 2048 8192 32768 65536] [--tokens 65536]
                                  [--layouts 12,2,64 16,1,64] [--decode-batch 1 32] [--inputs random]
    python bench/kernel_floors.py --ceilings 790,3000     # no GPU: the counts and the floors at given ceilings

On a GPU it measures the ceilings first (bf16 TFLOP/s of an 8192^3 torch.matmul on random data; copy GB/s of a
1 GiB device-to-device copy, bytes read + written; fp32 exp2/s of a register-only Triton loop), then times one
forward + backward of the op per layout and length (B*T fixed as in bench/bench_attention.py) under torch.profiler, by kernel name, and one decoding
step per context and batch (each kernel under the profiler; the whole static-cache step replayed from a CUDA
graph). It prints, per kernel: time ms, FLOP floor ms (FLOPs / TFLOP/s), byte floor ms (bytes / GB/s), exp
floor ms (exponentials / exp/s), floor = the largest, achieved = floor / time, and what bounds the floor
(compute, memory or exp). Dense causal
SDPA's forward, backward and decode rows are the baseline, timed in the same run. Without a GPU (or with
--analytic) it prints the counts, and the floors when --ceilings TFLOPS,GBPS[,GEXPS] is given.

Counting rules (`kernel_work`, `dense_work`, `decode_work`; pure functions of the NSA parameters):
- Every row of the batch is one document of T tokens (bench_attention's inputs). A (query, head, key) pair is
  one query of one head attending one key; pairs are counted exactly from the visibility rules of NSA_SPEC:
  compressed token i is seen by the queries t >= i*d + l - 1; a query's selected keys are the keys s <= t of
  its n selected blocks (all eligible blocks while there are at most n of them; else n - 1 whole blocks and
  its own block up to t, which is forced when sel_local_blocks >= 1; with sel_local_blocks = 0 that count is
  a lower bound); the window is min(t + 1, w) keys; dense causal attention is T (T + 1) / 2 pairs per head.
- FLOPs are matmul FLOPs only, 2*M*N*K per product: 2*D per pair per product (q.k or p.v). Forward: 2
  products (S = Q K^T, O = P V), 4*D per pair. Top-n re-scores the compressed keys: 1 product, 2*D per
  compressed pair (the overlap-weighted fold into block scores and the list updates are not matmuls and are
  not counted). The fused dQ kernel recomputes S and dP = dO V^T and forms dQ = dS K: 3 products, 6*D per
  pair, for all three branches. Each dK/dV kernel recomputes S and dP and forms dV = P^T dO and dK = dS^T Q:
  4 products, 8*D per pair (the split recomputes S and dP in both, 14*D per pair in all against
  FlashAttention-2's 10*D, which dense SDPA's backward row counts). Exponentials are counted apart, one per
  pair in every kernel that forms probabilities (each forward, top-n, dQ, each dK/dV; dense forward and
  backward): at head_dim 64 a pair's 4*D = 256 forward FLOPs take about as long on the tensor cores as its
  exponential on the special-function units. Other softmax bookkeeping is not counted.
- Bytes: every input the kernel needs read once and every output written once, in the dtype the launcher
  passes or stores it: q, k, v, o, dO, gates, dq, dk, dv in bf16 (the benchmark's dtype); log-sum-exps and
  deltas fp32; query ranges and top-n indices int32; doc_pos and cmp_end int64. Only the compressed tokens a
  row has (N_cmp(T) = floor((T - l)/d) + 1) are counted, not the empty slots of the (T // d)-slot buffer.
  Launch-dependent traffic (fp32 split partials, the block-union and inverted-index lists the launcher sorts,
  the decode step's per-split softmax partials) is not counted: it is what a better schedule can avoid.
  Selected-attention rows also give the bytes of K and V gathered per (query, KV group) with no sharing
  between queries ("gather"): what the kernel reads if no tile shares a block load; tiles of queries that
  chose the same blocks, and the L2, bring the real traffic below it.
- Decoding: one query per row at the end of a T-key cache (position T - 1). Its kernels: the compressed split
  kernel (reads the visible compressed K/V, writes each head's probabilities in fp32), top-n (reads those
  probabilities, writes the n block indices and scores per KV group), and the selected + window + gates part
  (the finish kernel in an eager step, the parts and combine kernels in a static cache's step).

A kernel's floor assumes it runs at the machine's full matmul rate or full bandwidth, whichever binds; at
small shapes (decode at B = 1) launch latency, not either ceiling, is what the time shows.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass, fields
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from modeling_nsa.configuration_nsa import NSAConfig  # noqa: E402
from modeling_nsa.nsa_layout import NSAParams  # noqa: E402

try:  # the exp-rate kernel of the GPU run; the counts need no triton
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - CPU installs without triton
    triton = tl = None

BF16, FP32, INT32, INT64 = 2, 4, 4, 8  # bytes per element as the launchers store them

# Profiler kernel names (the Triton functions' names) of each row; (name, k): the k-th launch of that kernel
# in one step (the compressed and window branches share the interval kernels, launched compressed first in
# both the forward and the backward), (name, None): every launch of it. Names that match no row are summed in
# "other" and listed, so a renamed kernel shows up there rather than vanishing.
TRAINING_KERNELS = {
    "cmp_fwd": [("_interval_fwd_kernel", 0)],
    "topn": [("_select_topn_kernel", None)],
    "sel_fwd": [("_sel_fwd_kernel", None), ("_sel_fwd_pairs_kernel", None), ("_sel_fwd_pairs_combine_kernel", None)],
    "win_fwd": [("_interval_fwd_kernel", 1)],
    "dq": [("_bwd_dq_kernel", None), ("_sel_dq_pairs_kernel", None), ("_sel_dq_reduce_kernel", None)],
    "cmp_dkdv": [("_interval_bwd_dkdv_kernel", 0)],
    "sel_dkdv": [("_sel_bwd_dkdv_kernel", None), ("_sel_dkdv_reduce_kernel", None)],
    "win_dkdv": [("_interval_bwd_dkdv_kernel", 1)],
}
DECODE_KERNELS = {
    "decode_cmp": [("_decode_cmp_split_kernel", None)],
    "decode_topn": [("_decode_topn_kernel", None)],
    "decode_sel_win": [("_decode_finish_kernel", None), ("_decode_parts_kernel", None),
                       ("_decode_combine_kernel", None)],
}
DESCRIPTIONS = {
    "cmp_fwd": "compressed attention fwd", "topn": "top-n selection", "sel_fwd": "selected attention fwd",
    "win_fwd": "window fwd + gated sum", "dq": "fused dQ (3 branches) + dgates", "cmp_dkdv": "compressed dK/dV",
    "sel_dkdv": "selected dK/dV", "win_dkdv": "window dK/dV", "dense_fwd": "dense SDPA fwd",
    "dense_bwd": "dense SDPA bwd", "decode_cmp": "decode compressed split", "decode_topn": "decode top-n",
    "decode_sel_win": "decode selected + window + gates", "dense_decode": "dense SDPA decode",
}


@dataclass(frozen=True)
class KernelWork:
    """What one kernel must do for one call: `pairs` (query, head, key) pairs, `flops` matmul FLOPs, and the
    bytes of its inputs read once and outputs written once (module docstring: the counting rules)."""

    name: str
    phase: str  # "fwd", "bwd", "decode"
    pairs: int
    flops: int
    exps: int  # exponentials (one per pair where the kernel forms probabilities)
    bytes_read: int
    bytes_written: int
    gather_bytes: int | None = None  # all its bytes when each (query, KV group) reads its own selected K/V

    @property
    def bytes(self) -> int:
        return self.bytes_read + self.bytes_written

    def floors(self, tflops: float, gbps: float, gexps: float | None = None) -> dict:
        """FLOP floor, byte floor (and exp floor at `gexps` G exp/s) and their max in ms at `tflops` TFLOP/s and
        `gbps` GB/s, and which of them binds ("compute", "memory", "exp")."""
        floors = dict(compute=self.flops / (tflops * 1e12) * 1e3, memory=self.bytes / (gbps * 1e9) * 1e3)
        if gexps:
            floors["exp"] = self.exps / (gexps * 1e9) * 1e3
        bound = max(floors, key=floors.get)
        out = dict(flop_ms=floors["compute"], byte_ms=floors["memory"], exp_ms=floors.get("exp"),
                   floor_ms=floors[bound], bound=bound)
        if self.gather_bytes is not None:
            out["gather_ms"] = self.gather_bytes / (gbps * 1e9) * 1e3
        return out


def nsa_params(config_or_params) -> NSAParams:
    """NSAParams from an NSAParams, an NSAConfig (or anything with its fields) or a dict of the fields."""
    if isinstance(config_or_params, NSAParams):
        return config_or_params
    names = [f.name for f in fields(NSAParams)]
    if isinstance(config_or_params, dict):
        missing = [n for n in names if n not in config_or_params]
        if missing:
            raise ValueError(f"NSA parameters {config_or_params!r} lack {missing}; give all of {names}.")
        return NSAParams(**{n: int(config_or_params[n]) for n in names})
    return NSAParams.from_config(config_or_params)


def _check_shape(batch, seq_len, num_q_heads, num_kv_heads, head_dim):
    for name, value in dict(batch=batch, seq_len=seq_len, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                            head_dim=head_dim).items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}.")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads}).")


# ------------------------------------------------------------------------------------------------ pair counts
# Closed forms over one document of T tokens; tests/test_kernel_floors.py checks each against an enumeration
# of (query, key) pairs by the naive oracle's rules.


def num_compressed(seq_len: int, p: NSAParams) -> int:
    """N_cmp(T) = max(0, floor((T - l) / d) + 1) compressed tokens in a T-token document (Eq. 7)."""
    return 0 if seq_len < p.cmp_block_size else (seq_len - p.cmp_block_size) // p.cmp_stride + 1


def compressed_pairs(seq_len: int, p: NSAParams) -> int:
    """Sum over queries of the compressed tokens each sees: token i is seen by the T - (i*d + l - 1) queries
    t >= i*d + l - 1."""
    n = num_compressed(seq_len, p)
    return n * (seq_len - p.cmp_block_size + 1) - p.cmp_stride * n * (n - 1) // 2


def selected_keys(t: int, p: NSAParams) -> int:
    """Keys s <= t in query t's selected blocks: every eligible block while there are at most n, else n - 1
    whole blocks and its own block up to t (forced when sel_local_blocks >= 1; a lower bound otherwise)."""
    lb, n = p.sel_block_size, p.sel_num_blocks
    return t + 1 if t // lb + 1 <= n else (n - 1) * lb + t % lb + 1


def selected_pairs(seq_len: int, p: NSAParams) -> int:
    """Sum of selected_keys over t < T: the queries before n*l' see every key before them (m (m + 1) / 2); each
    later query n - 1 whole blocks plus (t mod l') + 1 keys of its own block."""
    lb, n = p.sel_block_size, p.sel_num_blocks
    m = min(seq_len, n * lb)
    total = m * (m + 1) // 2
    later = seq_len - m
    if later > 0:  # n*l' is a multiple of l': the later queries start at offset 0 of a block
        full, rest = divmod(later, lb)
        total += later * (n - 1) * lb + full * lb * (lb + 1) // 2 + rest * (rest + 1) // 2
    return total


def selected_block_pairs(seq_len: int, p: NSAParams) -> int:
    """(query, selected block) pairs: min(n, t // l' + 1) per query."""
    lb, n = p.sel_block_size, p.sel_num_blocks
    m = min(seq_len, n * lb)
    full, rest = divmod(m, lb)
    return lb * full * (full + 1) // 2 + rest * (full + 1) + (seq_len - m) * n


def window_pairs(seq_len: int, p: NSAParams) -> int:
    """Sum over t of min(t + 1, w)."""
    w = p.window_size
    if seq_len <= w:
        return seq_len * (seq_len + 1) // 2
    return w * (w + 1) // 2 + (seq_len - w) * w


def dense_pairs(seq_len: int) -> int:
    """Causal attention: T (T + 1) / 2 pairs per head."""
    return seq_len * (seq_len + 1) // 2


# ------------------------------------------------------------------------------------------------ work per kernel


def kernel_work(config_or_params, batch: int, seq_len: int, num_q_heads: int, num_kv_heads: int,
                head_dim: int) -> list[KernelWork]:
    """The training kernels' work for B rows of one T-token document each (module docstring: the rules), in
    launch order: forward (compressed, top-n, selected, window + gated sum), then backward (fused dQ, then the
    compressed, selected and window dK/dV)."""
    p = nsa_params(config_or_params)
    _check_shape(batch, seq_len, num_q_heads, num_kv_heads, head_dim)
    B, T, H, Hkv, D = batch, seq_len, num_q_heads, num_kv_heads, head_dim
    n_cmp = num_compressed(T, p)
    n_sel = min(p.sel_num_blocks, -(-T // p.sel_block_size))
    pairs = dict(cmp=compressed_pairs(T, p), sel=selected_pairs(T, p), win=window_pairs(T, p))
    head_pairs = {k: B * H * v for k, v in pairs.items()}  # over rows and query heads
    q = B * T * H * D * BF16  # q, o, dO, dq and each branch output
    kv = B * T * Hkv * D * BF16  # one of k_slc, v_slc, k_win, v_win
    kv_cmp = B * n_cmp * Hkv * D * BF16  # one of k_cmp, v_cmp
    lse = B * T * H * FP32  # a log-sum-exp or a delta
    gates = B * T * H * 3 * BF16
    gate = B * T * H * BF16  # one branch's gate column (the dK/dV kernels read their own)
    ranges = 2 * B * T * INT32  # a branch's per-query [lo, hi)
    doc_pos = B * T * INT64
    idx = B * Hkv * T * n_sel * INT32  # top-n indices
    # K and V of every selected key, per (query, KV group), in place of reading k_slc and v_slc once
    gather = B * Hkv * pairs["sel"] * D * BF16 * 2 - 2 * kv

    def work(name, phase, branch_pairs, flops_per_pair, read, written, gather_extra=None):
        return KernelWork(name, phase, branch_pairs, flops_per_pair * head_dim * branch_pairs, branch_pairs, read,
                          written, None if gather_extra is None else read + written + gather_extra)

    return [
        work("cmp_fwd", "fwd", head_pairs["cmp"], 4, q + 2 * kv_cmp + ranges, q + lse),
        work("topn", "fwd", head_pairs["cmp"], 2, q + kv_cmp + lse + ranges + doc_pos, idx),
        work("sel_fwd", "fwd", head_pairs["sel"], 4, q + 2 * kv + idx + doc_pos, q + lse, gather),
        # reads o_cmp and o_slc and the gates to write the gated sum of the three branches
        work("win_fwd", "fwd", head_pairs["win"], 4, q + 2 * kv + ranges + 2 * q + gates, 2 * q + lse),
        work("dq", "bwd", sum(head_pairs.values()), 6,
             2 * q + gates + (2 * kv_cmp + ranges + lse + q) + (2 * kv + idx + doc_pos + lse + q)
             + (2 * kv + ranges + lse + q), q + gates + 3 * lse),
        work("cmp_dkdv", "bwd", head_pairs["cmp"], 8, 2 * q + 2 * kv_cmp + ranges + gate + 2 * lse, 2 * kv_cmp),
        work("sel_dkdv", "bwd", head_pairs["sel"], 8, 2 * q + 2 * kv + idx + doc_pos + gate + 2 * lse, 2 * kv,
             gather),
        work("win_dkdv", "bwd", head_pairs["win"], 8, 2 * q + 2 * kv + ranges + gate + 2 * lse, 2 * kv),
    ]


def dense_work(batch: int, seq_len: int, num_q_heads: int, num_kv_heads: int, head_dim: int) -> list[KernelWork]:
    """Dense causal SDPA (GQA): forward (S, O: 4*D per pair) and FlashAttention-2's backward (S, dP, dV, dK, dQ:
    10*D per pair); inputs read once, outputs written once."""
    _check_shape(batch, seq_len, num_q_heads, num_kv_heads, head_dim)
    B, T, H, Hkv, D = batch, seq_len, num_q_heads, num_kv_heads, head_dim
    pairs = B * H * dense_pairs(T)
    q, kv, lse = B * T * H * D * BF16, B * T * Hkv * D * BF16, B * T * H * FP32
    return [KernelWork("dense_fwd", "fwd", pairs, 4 * D * pairs, pairs, q + 2 * kv, q + lse),
            KernelWork("dense_bwd", "bwd", pairs, 10 * D * pairs, pairs, 3 * q + 2 * kv + lse, q + 2 * kv)]


def decode_work(config_or_params, batch: int, context: int, num_q_heads: int, num_kv_heads: int,
                head_dim: int) -> list[KernelWork]:
    """One decoding step per row, its query at position T - 1 of a T-key cache: the NSA step's three parts
    (module docstring) and dense SDPA's (every cached K and V read once)."""
    p = nsa_params(config_or_params)
    _check_shape(batch, context, num_q_heads, num_kv_heads, head_dim)
    B, T, H, Hkv, D = batch, context, num_q_heads, num_kv_heads, head_dim
    n_cmp = num_compressed(T, p)
    n_sel = min(p.sel_num_blocks, -(-T // p.sel_block_size))
    sel_keys, win_keys = selected_keys(T - 1, p), min(T, p.window_size)
    q = B * H * D * BF16
    probs = B * H * n_cmp * FP32
    lists = B * Hkv * n_sel * (INT32 + FP32)
    cmp_pairs, sel_win_pairs, dense = B * H * n_cmp, B * H * (sel_keys + win_keys), B * H * T
    return [
        KernelWork("decode_cmp", "decode", cmp_pairs, 4 * D * cmp_pairs, cmp_pairs,
                   q + B * n_cmp * (2 * Hkv * D * BF16 + INT64), probs),
        KernelWork("decode_topn", "decode", 0, 0, 0, probs, lists),
        KernelWork("decode_sel_win", "decode", sel_win_pairs, 4 * D * sel_win_pairs, sel_win_pairs,
                   q + lists + B * Hkv * (sel_keys + win_keys) * D * BF16 * 2 + B * H * 3 * BF16, q),
        KernelWork("dense_decode", "decode", dense, 4 * D * dense, dense, q + B * Hkv * T * D * BF16 * 2, q),
    ]


# ------------------------------------------------------------------------------------------------ scheduled work
# The floors above count what any schedule must do. The selected kernels' schedules do more, by their design:
# - the forward and the fused dQ give a program a tile of QPB consecutive queries x G heads (BLOCK_M rows) and walk
#   the union of the blocks its queries chose: every row does the math of every union block (whole tiles, sm_90 at
#   head_dim 64), and each union block's K and V are read once per tile (from L2 where another tile read them);
# - the selected dK/dV pads each block's (query, block) pairs to whole pair tiles of QPB queries x G heads, each
#   reading its rows' q and dO.
# scheduled_work counts that work from the selections of the inputs being timed; its floor reads the block and row
# loads at L2's read rate (l2_read_rate), the data being shared between tiles. A kernel near that floor is bound by
# its schedule: tuning cannot take it to the first floor, only a schedule that does less can.

SCHEDULED_KERNELS = ("sel_fwd", "dq", "sel_dkdv")


@dataclass(frozen=True)
class Schedule:
    """The selected kernels' tiles as the launchers choose them: (BLOCK_M, queries per tile) of the forward's and
    the fused dQ's query tiles (whole tiles: every row does every union block's math) and of the selected dK/dV's
    pair tiles."""

    sel_fwd: tuple[int, int]
    dq: tuple[int, int]
    sel_dkdv: tuple[int, int]


def launcher_schedule(group: int, head_dim: int, n_sel: int, device) -> Schedule | None:
    """The launchers' tiles on `device` (modeling_nsa.nsa_triton_launch), or None where a query tile runs as
    sub-tiles (each doing only its own queries' blocks: not what scheduled_work counts)."""
    from modeling_nsa import nsa_triton_launch as launch

    fwd = launch._sel_rows_per_program(group, head_dim)
    dq_m, dq_qpb, _ = launch._dq_launch(group, head_dim, n_sel, device)
    dkdv_m, dkdv_qpb, _ = launch._dkdv_launch(group, head_dim, device, selected=True)
    if launch._sel_sub_tile(fwd[0], head_dim, device) != fwd[0] or \
            launch._sel_sub_tile(dq_m, head_dim, device, dq=True) != dq_m:
        return None
    return Schedule(sel_fwd=fwd, dq=(dq_m, dq_qpb), sel_dkdv=(dkdv_m, dkdv_qpb))


def _block_starts(idx, doc_pos, sel_block_size: int):
    """(B, Hkv, Tq, n') absolute first key of each chosen block (the block's document start + j * l'), -1 where
    unused. idx (B, Hkv, Tq, n') in-document block indices, -1 unused; doc_pos (B, Tk), the queries its last Tq."""
    import torch

    num_q, num_keys = idx.shape[2], doc_pos.shape[1]
    t_abs = torch.arange(num_keys - num_q, num_keys, device=idx.device)
    start = t_abs - doc_pos[:, num_keys - num_q:].long()  # (B, Tq) each query's document start
    a = start[:, None, :, None] + idx.long() * sel_block_size
    return torch.where(idx >= 0, a, -1)


def union_block_visits(idx, doc_pos, sel_block_size: int, queries_per_tile: int) -> int:
    """Sum over query tiles (queries_per_tile consecutive queries of one row and KV head) of the distinct blocks
    their queries chose: the blocks a union walk visits."""
    import torch

    a = _block_starts(idx, doc_pos, sel_block_size)
    batch, num_kv, num_q, n_sel = a.shape
    pad = -num_q % queries_per_tile
    if pad:
        a = torch.cat([a, a.new_full((batch, num_kv, pad, n_sel), -1)], dim=2)
    a = a.view(batch, num_kv, -1, queries_per_tile * n_sel).sort(dim=-1).values
    first = torch.ones_like(a, dtype=torch.bool)
    first[..., 1:] = a[..., 1:] != a[..., :-1]
    return int((first & (a >= 0)).sum())


def pair_tiles(idx, doc_pos, sel_block_size: int, queries_per_tile: int) -> int:
    """Pair tiles of the selected dK/dV: each (row, KV head, block)'s (query, block) pairs in tiles of
    queries_per_tile."""
    import torch

    a = _block_starts(idx, doc_pos, sel_block_size)
    batch, num_kv, _, _ = a.shape
    num_keys = doc_pos.shape[1]
    key = torch.arange(batch * num_kv, device=a.device).view(batch, num_kv, 1, 1) * num_keys + a
    counts = torch.bincount(key[a >= 0].flatten(), minlength=batch * num_kv * num_keys)
    return int(((counts + queries_per_tile - 1) // queries_per_tile).sum())


def scheduled_work(config_or_params, idx, doc_pos, shape: tuple[int, int, int, int, int], schedule: Schedule,
                   ideal: list[KernelWork], repeat: float = 1.0) -> dict[str, KernelWork]:
    """The selected kernels' work as scheduled (the section's comment), for the selections idx of the timed
    inputs, beside `ideal` (kernel_work's rows for the same shape, (B, T, H, Hkv, D)). Bytes: the loads the tiles
    make in place of reading their inputs once (K and V per union block visit; q, dO, lse and delta per pair tile
    row), at the dtypes the launchers read them, plus the ideal count of every other input and output. repeat: the
    union visits and pair tiles counted on idx stand for that many times theirs (idx a sample of the queries)."""
    p = nsa_params(config_or_params)
    B, T, H, Hkv, D = shape
    lb = p.sel_block_size
    block_kv = 2 * lb * D * BF16  # one block's K and V
    kv_once = 2 * B * T * Hkv * D * BF16  # k_slc and v_slc read once, as kernel_work counts them
    rows_once = B * T * H * (2 * D * BF16 + 2 * FP32)  # q, dO (bf16), lse, delta (fp32) read once
    by_name = {w.name: w for w in ideal}
    out = {}
    for name, dots in (("sel_fwd", 2), ("dq", 3)):
        block_m, qpb = getattr(schedule, name)
        visits = round(union_block_visits(idx, doc_pos, lb, qpb) * repeat)
        w = by_name[name]
        sel_ideal = by_name["sel_fwd"].pairs  # the selected (query, head, key) pairs
        flops = visits * dots * 2 * block_m * lb * D
        exps = visits * block_m * lb
        if name == "dq":  # plus the interval branches' share of the fused dQ, counted as in kernel_work
            flops += w.flops - 6 * D * sel_ideal
            exps += w.exps - sel_ideal
        out[name] = KernelWork(name, w.phase, w.pairs, flops, exps, w.bytes_read - kv_once + visits * block_kv,
                               w.bytes_written)
    block_m, qpb = schedule.sel_dkdv
    tiles = round(pair_tiles(idx, doc_pos, lb, qpb) * repeat)
    w = by_name["sel_dkdv"]
    rows = tiles * block_m  # q and dO rows (bf16) with their lse and delta (fp32), read per pair tile
    out["sel_dkdv"] = KernelWork("sel_dkdv", w.phase, w.pairs, tiles * 4 * 2 * block_m * lb * D, tiles * block_m * lb,
                                 w.bytes_read - rows_once + rows * (2 * D * BF16 + 2 * FP32), w.bytes_written)
    return out


def scheduled_floors(work: KernelWork, tflops: float, l2_gbps: float, gexps: float | None) -> dict:
    """A scheduled work's floor (ms) with its loads at L2's read rate, and what binds it."""
    floors = work.floors(tflops, l2_gbps, gexps)
    return dict(scheduled_floor_ms=floors["floor_ms"], scheduled_bound=floors["bound"],
                scheduled_flops=work.flops, scheduled_exps=work.exps, scheduled_bytes=work.bytes)


# ------------------------------------------------------------------------------------------------ profiler times


def group_kernel_times(events, reps: int) -> dict[str, list[float]]:
    """Per kernel name, the median ms of its k-th launch within a step, from (name, start_us, duration_us) of
    every kernel of `reps` identical steps. A name whose launch count is not a multiple of reps gets one entry:
    its total per step."""
    by_name: dict[str, list[tuple[float, float]]] = {}
    for name, start, duration in events:
        by_name.setdefault(name, []).append((start, duration))
    out = {}
    for name, launches in by_name.items():
        durations = [d / 1e3 for _, d in sorted(launches)]
        per_step, remainder = divmod(len(durations), reps)
        if remainder or per_step == 0:
            out[name] = [sum(durations) / reps]
        else:  # launch k of step r is the (r * per_step + k)-th in time order
            out[name] = [statistics.median(durations[k::per_step]) for k in range(per_step)]
    return out


def idle_gaps(events, reps: int, top: int = 3) -> tuple[float, list[dict]]:
    """GPU idle time per step (ms) between the kernels of `reps` identical steps, from (name, start_us,
    duration_us) events, and the `top` kernel pairs with the most idle time between them (per step, ms): where
    a step waits on the host (launch overhead, a synchronization) rather than on its kernels. Time before the
    first kernel and after the last is not counted; overlapping kernels count once."""
    spans = sorted((start, start + duration, name) for name, start, duration in events)
    idle = 0.0
    by_pair: dict[tuple[str, str], float] = {}
    if spans:
        busy_until, last_name = spans[0][1], spans[0][2]
        for start, end, name in spans[1:]:
            if start > busy_until:
                gap = (start - busy_until) / 1e3
                idle += gap
                by_pair[(last_name, name)] = by_pair.get((last_name, name), 0.0) + gap
            if end >= busy_until:
                busy_until, last_name = end, name
    largest = sorted(by_pair.items(), key=lambda kv: -kv[1])[:top]
    return idle / reps, [dict(after=a, before=b, ms=ms / reps) for (a, b), ms in largest]


def short_kernel_name(name: str) -> str:
    """A profiler's kernel name without its C++ return type, namespaces, template arguments and parameters
    ("void at::native::(anonymous namespace)::radixSortKVInPlace<...>(...)" -> "radixSortKVInPlace"): the full
    demangled names run to thousands of characters in a log line."""
    name = name.strip()
    if name.startswith("void "):
        name = name[len("void "):]
    name = name.replace("(anonymous namespace)", "anonymous")  # (its parenthesis is not the parameters')
    cut = min((i for i in (name.find("<"), name.find("(")) if i > 0), default=len(name))
    return name[:cut].rsplit("::", 1)[-1].strip() or name


def describe_other(other: dict[str, float], top: int = 6) -> str:
    """The unclaimed kernels in a line: short names (times of one short name summed), the `top` longest with their
    ms, then how many more."""
    by_short: dict[str, float] = {}
    for name, ms in other.items():
        short = short_kernel_name(name)
        by_short[short] = by_short.get(short, 0.0) + ms
    ranked = sorted(by_short.items(), key=lambda kv: -kv[1])
    text = ", ".join(f"{name} {ms:.2f}" for name, ms in ranked[:top]) or "none"
    return text + (f", {len(ranked) - top} more" if len(ranked) > top else "")


def describe_gaps(gaps: list[dict]) -> str:
    """idle_gaps' largest pairs in a line: the kernel each gap follows (short name) and its ms."""
    return ", ".join(f"{short_kernel_name(g['after'])} ({g['ms']:.2f} ms)" for g in gaps) or "none"


def assign_rows(kernel_times: dict[str, list[float]], table: dict) -> tuple[dict[str, float | None], dict]:
    """Row times (ms) from group_kernel_times' output by `table` (TRAINING_KERNELS, DECODE_KERNELS). A kernel
    the table splits by launch (name, k) must have exactly as many launches per step as the table names;
    otherwise (a changed launcher) its rows get None and its time goes to the unclaimed. Returns (row ms or
    None where none of its kernels ran, unclaimed ms per kernel name)."""
    split = {}  # name -> launches per step the table expects
    for parts in table.values():
        for name, k in parts:
            if k is not None:
                split[name] = max(split.get(name, 0), k + 1)
    rows, claimed = {}, set()
    for row, parts in table.items():
        found = [(name, k) for name, k in parts if name in kernel_times
                 and (k is None or len(kernel_times[name]) == split[name])]
        rows[row] = sum(sum(kernel_times[n]) if k is None else kernel_times[n][k] for n, k in found) if found else None
        claimed.update(n for n, _ in found)
    other = {name: sum(times) for name, times in kernel_times.items() if name not in claimed}
    return rows, other


# ------------------------------------------------------------------------------------------------ printing


def _fmt(value, digits=3):
    return "-" if value is None else f"{value:.{digits}f}"


def table_rows(works: list[KernelWork], ceilings: tuple | None, times: dict | None = None,
               scheduled: dict[str, KernelWork] | None = None, l2_gbps: float | None = None) -> list[dict]:
    """One dict per kernel: the counts, the floors at `ceilings` (TFLOP/s, GB/s, G exp/s or None), the time and
    the achieved fraction (floor / time); for the kernels in `scheduled` (scheduled_work) also the scheduled
    floor with loads at `l2_gbps` and the fraction of it achieved."""
    rows = []
    for w in works:
        row = dict(asdict(w), kernel=w.name, description=DESCRIPTIONS.get(w.name, w.name), bytes=w.bytes)
        if ceilings:
            row.update(w.floors(*ceilings))
            if scheduled and w.name in scheduled and l2_gbps:
                row.update(scheduled_floors(scheduled[w.name], ceilings[0], l2_gbps, ceilings[2]))
        if times is not None:
            row["time_ms"] = times.get(w.name)
            if ceilings and row["time_ms"]:
                row["achieved"] = row["floor_ms"] / row["time_ms"]
                if "scheduled_floor_ms" in row:
                    row["achieved_scheduled"] = row["scheduled_floor_ms"] / row["time_ms"]
        rows.append(row)
    return rows


def print_table(title: str, rows: list[dict], timed: bool, unit: str = "ms"):
    """A markdown table of table_rows' output; times in `unit` ("ms" or "us")."""
    scale, digits = (1e3, 2) if unit == "us" else (1.0, 3)
    print(f"\n## {title}")
    head = ["kernel", "GFLOP", "Gexp", "MB moved"]
    has_floors = bool(rows) and "floor_ms" in rows[0]
    has_exp = has_floors and rows[0].get("exp_ms") is not None
    if has_floors:
        head += [f"FLOP floor {unit}", f"byte floor {unit}"] + ([f"exp floor {unit}"] if has_exp else [])
        head += [f"floor {unit}", "bound", f"no-sharing gather {unit}"]
    has_scheduled = any("scheduled_floor_ms" in r for r in rows)
    if has_scheduled:
        head += [f"scheduled floor {unit}", "scheduled bound"]
    if timed:
        head[1:1] = [f"time {unit}"]
        head += ["achieved"] + (["of scheduled"] if has_scheduled else [])
    print("| " + " | ".join(head) + " |")
    print("|---" * len(head) + "|")

    def t(value):
        return "-" if value is None else f"{value * scale:.{digits}f}"

    for r in rows:
        cells = [r["description"]] + ([t(r.get("time_ms"))] if timed else [])
        cells += [f"{r['flops'] / 1e9:.2f}", f"{r['exps'] / 1e9:.3f}", f"{r['bytes'] / 1e6:.2f}"]
        if has_floors:
            cells += [t(r["flop_ms"]), t(r["byte_ms"])] + ([t(r["exp_ms"])] if has_exp else [])
            cells += [t(r["floor_ms"]), r["bound"], t(r.get("gather_ms"))]
        if has_scheduled:
            cells += [t(r.get("scheduled_floor_ms")), r.get("scheduled_bound", "-")]
        if timed:
            cells.append(f"{r['achieved']:.2f}" if r.get("achieved") else "-")
            if has_scheduled:
                cells.append(f"{r['achieved_scheduled']:.2f}" if r.get("achieved_scheduled") else "-")
        print("| " + " | ".join(cells) + " |")


def layout_cases(layouts, lengths, tokens):
    for spec in layouts:
        H, Hkv, D = (int(s) for s in spec.split(","))
        for T in lengths:
            yield H, Hkv, D, T, max(1, tokens // T)


def _commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except Exception:  # noqa: BLE001 - not a checkout
        return None


# ------------------------------------------------------------------------------------------------ GPU


def measure_ceilings(time_ms):
    """(bf16 TFLOP/s of an 8192^3 matmul on random data, GB/s of a 1 GiB copy counting read + write, G exp/s of
    fp32 exp2 in registers or None where that kernel cannot run)."""
    import torch

    n = 8192
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    tflops = 2 * n**3 / (time_ms(lambda: torch.matmul(a, b), 3, 10) * 1e-3) / 1e12
    del a, b
    src = torch.empty(2**28, device="cuda", dtype=torch.float32).normal_()
    dst = torch.empty_like(src)
    gbps = 2 * src.numel() * 4 / (time_ms(lambda: dst.copy_(src), 3, 10) * 1e-3) / 1e9
    del src, dst
    torch.cuda.empty_cache()
    try:
        gexps = exp_rate(time_ms)
    except Exception as exc:  # noqa: BLE001 - report, keep the other two ceilings
        print(f"# exp ceiling not measured: {type(exc).__name__}: {exc}"[:300])
        gexps = None
    return tflops, gbps, gexps


def exp_rate(time_ms, iterations: int = 2048, block: int = 1024) -> float:
    """G exp/s of fp32 exp2 on the GPU's special-function units (what a softmax's exponentials run on; about
    matmul's rate per (query, key) pair at head_dim 64): many independent chains of x = exp2(x) * -0.5 held in
    registers (_exp_rate_kernel), so neither memory nor latency limits it."""
    import torch

    if triton is None:
        raise RuntimeError("triton is not installed")
    programs = torch.cuda.get_device_properties(0).multi_processor_count * 32
    out = torch.empty(programs * block, device="cuda", dtype=torch.float32)
    ms = time_ms(lambda: _exp_rate_kernel[(programs,)](out, iterations, BLOCK=block, num_warps=4), 2, 5)
    return programs * block * iterations / (ms * 1e-3) / 1e9


if triton is not None:

    @triton.jit
    def _exp_rate_kernel(out, n_iter, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        x = offs.to(tl.float32) * -1e-9
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for _ in range(n_iter):
            x = tl.exp2(x) * -0.5  # stays in [-0.5, -0.35]
            acc += x
        tl.store(out + offs, acc)

    @triton.jit
    def _l2_read_kernel(src, out, n_slices, n_iter, BLOCK: tl.constexpr):
        """Program p of P sums slices p, p + P, p + 2P, ... (mod n_slices) of BLOCK elements of src."""
        pid = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for i in range(n_iter):
            start = ((pid + i * tl.num_programs(0)) % n_slices) * BLOCK
            acc += tl.load(src + start + offs).to(tl.float32)
        tl.store(out + pid * BLOCK + offs, acc)


def l2_read_rate(time_ms, buffer_mib: int = 16, block: int = 4096, iterations: int = 512) -> float:
    """GB/s of loads served by L2: every program reads 8 KiB slices of one 16 MiB bf16 buffer in turn (H100's L2
    holds 50 MB, in two partitions), summing them in registers (_l2_read_kernel), so each slice comes from L2
    after the first pass. The ceiling for loads many programs share, as the selected kernels' blocks are."""
    import torch

    if triton is None:
        raise RuntimeError("triton is not installed")
    n_elem = buffer_mib * 2**20 // BF16
    src = torch.randn(n_elem, device="cuda", dtype=torch.bfloat16)
    programs = torch.cuda.get_device_properties(0).multi_processor_count * 8
    out = torch.empty(programs * block, device="cuda", dtype=torch.float32)
    ms = time_ms(lambda: _l2_read_kernel[(programs,)](src, out, n_elem // block, iterations, BLOCK=block,
                                                        num_warps=4), 2, 5)
    return programs * iterations * block * BF16 / (ms * 1e-3) / 1e9


def profile_events(fn, reps: int = 5):
    """(name, start_us, duration_us) of every CUDA kernel of `reps` calls of fn, after two warm-up calls."""
    import torch

    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    events = []
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        events.append((ev.name, ev.time_range.start, ev.time_range.elapsed_us()))
    return events


def run_gpu(args, params):
    import torch

    sys.path.insert(0, str(ROOT / "bench"))
    import bench_attention as ba  # its inputs and timers; the kernels through the public entry points only

    if ba.PARAMS != params:
        raise SystemExit(f"bench_attention.PARAMS {ba.PARAMS} differ from NSAConfig's defaults {params}: the counts "
                         "would not describe the timed op.")
    if "captured" in args.inputs:
        ba.use_captured(args.captured)
    ceilings = args.ceilings or measure_ceilings(ba.time_ms)
    tflops, gbps, gexps = ceilings
    print(f"# ceilings ({'given' if args.ceilings else 'measured'}): {tflops:.0f} TFLOP/s bf16 matmul, "
          f"{gbps:.0f} GB/s copy, {'-' if gexps is None else f'{gexps:.0f}'} G exp/s", flush=True)
    try:
        l2_gbps = args.l2_gbps or l2_read_rate(ba.time_ms)
    except Exception as exc:  # noqa: BLE001 - report, keep the first floors
        print(f"# L2 read rate not measured: {type(exc).__name__}: {exc}"[:300])
        l2_gbps = None
    print(f"# L2 read rate ({'given' if args.l2_gbps else 'measured'}): {_fmt(l2_gbps, 0)} GB/s (the scheduled "
          "floors' loads)", flush=True)
    out = dict(ceilings=dict(tflops=tflops, gbps=gbps, gexps=gexps, l2_gbps=l2_gbps, measured=not args.ceilings),
               training=[], decode=[])
    for H, Hkv, D, T, B in layout_cases(args.layouts, args.lengths, args.tokens):
        for kind in args.inputs:
            if kind == "captured" and not ba.capture_qkv.fits(ba.CAPTURED["saved"], H, Hkv, D):
                print(f"# no captured inputs for {H}q/{Hkv}kv d{D}", flush=True)
                continue
            torch.manual_seed(0)
            x, cmp_end, doc_pos = ba.nsa_inputs(B, T, H, Hkv, D, kind=kind)
            do = torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16)

            def step():
                o = ba.tri.nsa_attention_triton(x["q"], x["k_cmp"], x["v_cmp"], cmp_end, x["k_slc"], x["v_slc"],
                                                x["k_win"], x["v_win"], x["gates"], doc_pos, params)
                torch.autograd.grad(o, list(x.values()), do)

            events = profile_events(step)
            times, other = assign_rows(group_kernel_times(events, 5), TRAINING_KERNELS)
            idle_ms, gaps = idle_gaps(events, 5)
            kernels_ms = sum(t for t in times.values() if t) + sum(other.values())
            op_ms = ba.time_ms(step)
            works = kernel_work(params, B, T, H, Hkv, D) + dense_work(B, T, H, Hkv, D)
            schedule = launcher_schedule(H // Hkv, D, params.sel_num_blocks, torch.device("cuda"))
            scheduled = None
            if schedule is not None:  # the selections the timed step made (the top-n is deterministic)
                idx = ba.tri.select_blocks_triton(x["q"], x["k_cmp"], cmp_end, doc_pos, params)
                scheduled = scheduled_work(params, idx, doc_pos, (B, T, H, Hkv, D), schedule, works)
                del idx
            del x, do
            torch.cuda.empty_cache()
            dense = ba.time_sdpa(B, T, H, Hkv, D)
            dense_fwd, dense_fb = dense["sdpa_fwd"], dense["sdpa_fb"]
            times.update(dense_fwd=dense_fwd, dense_bwd=dense_fb - dense_fwd)
            rows = table_rows(works, ceilings, times, scheduled, l2_gbps)
            nsa_floor = sum(r["floor_ms"] for r in rows if not r["kernel"].startswith("dense"))
            case = dict(layout=f"{H}q/{Hkv}kv d{D}", H=H, Hkv=Hkv, D=D, T=T, B=B, inputs=kind, rows=rows,
                        other_ms=other, nsa_fb_ms=op_ms, nsa_kernels_ms=kernels_ms, nsa_floor_ms=nsa_floor,
                        dense_fb_ms=dense_fb, idle_ms=idle_ms, largest_gaps=gaps)
            out["training"].append(case)
            print_table(f"{case['layout']} T={T} B={B} {kind}: NSA f+b {op_ms:.2f} ms (kernels' floors sum "
                        f"{nsa_floor:.2f} ms), dense SDPA f+b {dense_fb:.2f} ms; other kernels "
                        f"{sum(other.values()):.2f} ms ({describe_other(other)}); GPU idle between "
                        f"kernels {idle_ms:.2f} ms per step, most after {describe_gaps(gaps)}", rows, timed=True)
            save(args, out, params)
    H, Hkv, D = (int(s) for s in args.layouts[0].split(","))
    for B in args.decode_batch:
        for T in args.decode_lengths or args.lengths:
            out["decode"].append(time_decode(ba, params, ceilings, B, T, H, Hkv, D))
            save(args, out, params)
    return out


def time_decode(ba, params, ceilings, B, T, H, Hkv, D):
    """One decoding step (B rows, a T-key cache): each kernel of a static cache's step called eagerly (the
    kernels generate() records in its graph), the whole step replayed from a CUDA graph, and dense SDPA's."""
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    x, cmp_end, doc_pos = ba.nsa_inputs(B, T, H, Hkv, D, grad=False)
    w = params.window_size
    q1, g1 = x["q"][:, -1:].contiguous(), x["gates"][:, -1:].contiguous()
    kw, vw = x["k_win"][:, -w:].contiguous(), x["v_win"][:, -w:].contiguous()
    query_end = torch.tensor([T - 1], device="cuda")

    def step():
        return ba.tri.nsa_decode_triton(q1, x["k_cmp"], x["v_cmp"], cmp_end, x["k_slc"], x["v_slc"], kw, vw, g1,
                                        doc_pos, params, query_end=query_end)

    times, other = assign_rows(group_kernel_times(profile_events(step, 20), 20), DECODE_KERNELS)
    graphed = ba.time_ms(ba.cuda_graph(step), 5, 50)
    del x
    qd = ba.rnd(B, H, 1, D, grad=False)
    kd, vd = ba.rnd(B, Hkv, T, D, grad=False), ba.rnd(B, Hkv, T, D, grad=False)
    dense = ba.cuda_graph(lambda: F.scaled_dot_product_attention(qd, kd, vd, enable_gqa=True))
    times["dense_decode"] = ba.time_ms(dense, 5, 50)
    del qd, kd, vd
    torch.cuda.empty_cache()
    rows = table_rows(decode_work(params, B, T, H, Hkv, D), ceilings, times)
    floor = sum(r["floor_ms"] for r in rows if r["kernel"] != "dense_decode")
    case = dict(layout=f"decode {H}q/{Hkv}kv d{D}", B=B, T=T, rows=rows, other_ms=other, nsa_graphed_ms=graphed,
                nsa_floor_ms=floor, dense_graphed_ms=times["dense_decode"])
    print_table(f"decode B={B} context {T}: NSA static step graphed {graphed * 1e3:.1f} us (floors sum "
                f"{floor * 1e3:.2f} us), dense SDPA graphed {times['dense_decode'] * 1e3:.1f} us", rows, timed=True,
                unit="us")
    return case


def save(args, out, params):
    if args.json:
        import torch

        meta = dict(device=torch.cuda.get_device_name() if torch.cuda.is_available() and not args.analytic else "none",
                    date=str(datetime.date.today()), commit=_commit(), tokens=args.tokens, params=asdict(params))
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(dict(meta, **out), indent=1))


def run_analytic(args, params):
    ceilings = dict(zip(("tflops", "gbps", "gexps"), args.ceilings), measured=False) if args.ceilings else None
    out = dict(ceilings=ceilings, training=[], decode=[])
    for H, Hkv, D, T, B in layout_cases(args.layouts, args.lengths, args.tokens):
        works = kernel_work(params, B, T, H, Hkv, D) + dense_work(B, T, H, Hkv, D)
        scheduled, title = None, f"{H}q/{Hkv}kv d{D} T={T} B={B} (counts)"
        if args.scheduled_queries:
            scheduled, sampled = sampled_scheduled_work(params, B, T, H, Hkv, D, args.scheduled_queries, works)
            title += (f"; scheduled on sm_90's tiles from the reference's top-n of {sampled} random queries at the "
                      f"end of one row, scaled to B x T")
        rows = table_rows(works, args.ceilings, scheduled=scheduled, l2_gbps=args.l2_gbps)
        out["training"].append(dict(layout=f"{H}q/{Hkv}kv d{D}", H=H, Hkv=Hkv, D=D, T=T, B=B, rows=rows))
        print_table(title, rows, timed=False)
    H, Hkv, D = (int(s) for s in args.layouts[0].split(","))
    for B in args.decode_batch:
        for T in args.decode_lengths or args.lengths:
            rows = table_rows(decode_work(params, B, T, H, Hkv, D), args.ceilings)
            out["decode"].append(dict(layout=f"decode {H}q/{Hkv}kv d{D}", B=B, T=T, rows=rows))
            print_table(f"decode B={B} context {T} (counts)", rows, timed=False, unit="us")
    save(args, out, params)
    return out


def sampled_scheduled_work(params, B, T, H, Hkv, D, num_queries: int, works: list[KernelWork]):
    """scheduled_work without a GPU: the reference's top-n (bench/selection_tiles.py) for random queries, the last
    num_queries of one T-token row (those see the most blocks, so the scaled counts lean high), scaled to B rows of
    T queries. Returns (the scheduled works, the queries sampled)."""
    import torch

    sys.path.insert(0, str(ROOT / "bench"))
    import selection_tiles

    sampled = min(T, num_queries)
    idx = selection_tiles.selections(T, H, Hkv, D, sampled, "random", torch.Generator().manual_seed(0))[None]
    doc_pos = torch.arange(T).view(1, T)
    schedule = launcher_schedule(H // Hkv, D, params.sel_num_blocks, "cpu")  # sm_90's (the interpreter's) tiles
    return scheduled_work(params, idx, doc_pos, (B, T, H, Hkv, D), schedule, works, repeat=B * T / sampled), sampled


def parse_ceilings(text: str) -> tuple[float, float, float | None]:
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        values = []
    if len(values) not in (2, 3) or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"--ceilings {text!r}: give TFLOPS,GBPS or TFLOPS,GBPS,GEXPS (positive), "
                                         "e.g. 790,3000 or 790,3000,3900")
    return values[0], values[1], values[2] if len(values) == 3 else None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=None)
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192, 32768, 65536])
    ap.add_argument("--tokens", type=int, default=65536, help="B*T per training step (bench_attention's)")
    ap.add_argument("--layouts", nargs="+", default=["12,2,64", "16,1,64"], help="H,Hkv,D; decode uses the first")
    ap.add_argument("--decode-batch", type=int, nargs="*", default=[1, 32])
    ap.add_argument("--decode-lengths", type=int, nargs="*", default=None, help="default: --lengths")
    ap.add_argument("--inputs", nargs="+", default=["random"], choices=["random", "correlated", "captured"],
                    help="query kinds of the timed training steps (bench_attention's)")
    ap.add_argument("--captured", default=None, help="bench/capture_qkv.py's file, for --inputs captured")
    ap.add_argument("--ceilings", type=parse_ceilings, default=None,
                    help="TFLOPS,GBPS[,GEXPS] given by hand (bf16 matmul TFLOP/s, copy GB/s, G exp/s)")
    ap.add_argument("--l2-gbps", type=float, default=None,
                    help="L2 read GB/s given by hand for the scheduled floors (default: measured, l2_read_rate)")
    ap.add_argument("--analytic", action="store_true", help="counts (and floors at --ceilings) only, even on a GPU")
    ap.add_argument("--scheduled-queries", type=int, default=0,
                    help="without a GPU: the selected kernels' scheduled work from the reference's top-n of this "
                         "many random queries per case (floors with --ceilings and --l2-gbps)")
    args = ap.parse_args(argv)
    params = NSAParams.from_config(NSAConfig())
    import torch

    if args.analytic or not torch.cuda.is_available():
        return run_analytic(args, params)
    return run_gpu(args, params)


if __name__ == "__main__":
    main()
