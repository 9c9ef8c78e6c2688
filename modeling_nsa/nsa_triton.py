"""Triton kernels for NSA (NSA_SPEC): forward, backward, top-n selection and the cached decode step.

Layout of the work (no (T x Nc) or (T x T) tensor is ever built):

- Compressed and sliding-window branches are both "interval attention": query t sees a contiguous
  run of keys [lo(t), hi(t)) (compressed slots of its document with end <= t; the last w keys of its
  document). One flash-attention kernel family serves both; the key tiles inside every row's interval
  run without masks. A program packs BLOCK_M rows = (several consecutive queries) x (the G heads of one
  KV group), so any G (6, 1, 16, ...) fills the tensor cores and each K/V tile is read once for G heads.
  dK/dV: one program per key tile loops over the queries that can see it (a query range found by
  searchsorted on the monotone lo/hi), so every key tile has a single writer (deterministic, fp32
  accumulation), computed key-major (S^T = K Q^T: no transposes through shared memory).
- Top-n: one program per tile of consecutive queries (x their G heads) of one KV group recomputes
  the compression probabilities from q, the compressed keys and the saved log-sum-exp (each key tile
  serves the whole tile in one tl.dot), folds them into selection-block scores with the overlap
  weights (summed over the G heads), forces the initial/local blocks, and keeps a running top-n list
  per query (unsorted: an entering block replaces the worst entry; sorted once at the end; ties to the
  lower block index) while streaming over the blocks.
- Selected attention forward: query tiles walk the union of their queries' blocks (listed, sorted
  and deduplicated by the launcher), loading each block once for the tile; each row attends only the
  blocks its query chose (before Hopper the rows run in 16-row sub-tiles that skip the blocks none of
  their queries chose).
  dK/dV: the (query, block) pairs are sorted by block (an inverted index, static shapes); one program
  per selection block loops over the queries that chose it: one writer, heavy blocks split into
  fp32 partials summed in a fixed order.
- Backward dQ: one kernel per query tile for all three branches (dQ in registers, written once),
  which also writes the gate gradients and the per-branch deltas the dK/dV kernels read.
- Decoding (one query per row), none of the launches with a serial loop over the whole context: the
  compressed keys split over programs (softmax partials and probabilities); the selection blocks split
  over programs, each scoring its range from those probabilities (no key re-read) and keeping its own
  top-n list; then one program per (row, KV group) merges the partials and the lists and runs the
  selected and window branches and the gates (three launches: eager decoding is host-bound). A static
  cache's step (CUDA-graphed) runs that last part as parts side by side (a few selected blocks, a span of
  the window, the compressed merge) and a combine kernel (four launches, a short chain on the GPU).

Everything is wrapped in two torch.library custom ops (forward, backward) with fake
implementations and autograd, without host synchronization, so torch.compile(fullgraph=True) works.
Tile sizes and warps are chosen per architecture with tests/triton_aot.py, which compiles every
launch for sm_90, sm_80 and sm_86 on a CPU machine and reports registers, spills and shared memory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os

import torch

from .nsa_layout import NSAParams

try:  # the module must import where triton is missing (CPU-only installs, macOS)
    import triton
    import triton.language as tl

    _HAS_TRITON = True
except Exception:  # pragma: no cover - exercised only without triton
    triton = None
    tl = None
    _HAS_TRITON = False


# Oldest NVIDIA architecture the kernels are written for: bf16 tensor cores and at least 99 KiB of shared
# memory per block (compute capability 8.0: A100; 8.6/8.9: RTX 30xx/40xx, A10, L4; 9.0: H100).
MIN_COMPUTE_CAPABILITY = (8, 0)


def triton_unusable_reason(device) -> str | None:
    """Why the Triton kernels cannot run on `device` (None: they can): Triton missing, no CUDA, a ROCm build,
    an NVIDIA GPU older than MIN_COMPUTE_CAPABILITY, or a CPU without TRITON_INTERPRET=1."""
    if not _HAS_TRITON:
        return "Triton is not installed (pip install triton)"
    device = torch.device(device)
    if device.type == "cpu":
        if os.environ.get("TRITON_INTERPRET", "0") == "1":
            return _interpreter_reason()
        return "Triton cannot run on device cpu (set TRITON_INTERPRET=1 to run the kernels on CPU, slowly)"
    if device.type != "cuda":
        return f"the kernels run on NVIDIA CUDA GPUs, not on device type {device.type!r}"
    if not torch.cuda.is_available():
        return "CUDA is not available"
    index = _cuda_index(device)
    if index not in _CUDA_DEVICE_REASONS:  # asked once per GPU: the model asks on every attention call
        _CUDA_DEVICE_REASONS[index] = _cuda_device_reason(index)
    return _CUDA_DEVICE_REASONS[index]


_CUDA_DEVICE_REASONS: dict[int, str | None] = {}


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("+")[0].split(".")[:2] if part.isdigit())


def _interpreter_reason() -> str | None:
    """Triton before 3.7 turns a loop bound computed in a kernel into an int with int(array) (fixed in 3.7 with
    .squeeze()); numpy 2.4 made that an error for 1-element arrays, so every kernel with such a loop fails in the
    interpreter there (the compiled GPU path is unaffected)."""
    import numpy

    if _version(triton.__version__) < (3, 7) and _version(numpy.__version__) >= (2, 4):
        return (f"Triton {triton.__version__}'s interpreter fails with numpy {numpy.__version__} (int() of a "
                "1-element array); install triton>=3.7 or numpy<2.4 to run the kernels on CPU")
    return None


def _cuda_index(device: torch.device) -> int:
    """The index of a CUDA device ("cuda" alone: the current one): the key of the per-GPU caches."""
    return device.index if device.index is not None else torch.cuda.current_device()


def _cuda_device_reason(index: int) -> str | None:
    if getattr(torch.version, "hip", None):
        return "the kernels are written and tested for NVIDIA GPUs; this is a ROCm build of PyTorch"
    capability = torch.cuda.get_device_capability(index)
    if tuple(capability) < MIN_COMPUTE_CAPABILITY:
        need = ".".join(map(str, MIN_COMPUTE_CAPABILITY))
        return (f"the kernels need compute capability {need} or newer (bf16 tensor cores, 99 KiB of shared "
                f"memory per block); {torch.cuda.get_device_name(index)} is {capability[0]}.{capability[1]}")
    return None


def triton_is_usable(device) -> bool:
    """The kernels can run on `device` (see triton_unusable_reason)."""
    return triton_unusable_reason(device) is None


def _next_pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def _cdiv(a: int, b: int) -> int:
    """Ceiling division of host integers (triton.cdiv goes through Triton's JIT machinery: about 2 us a call,
    which the cached decode step pays three times per token)."""
    return -(-a // b)


def triton_unsupported_reason(params: NSAParams, head_dim: int, device=None) -> str | None:
    """Why the kernels do not handle these parameters (None: they do). They need head_dim a power of two in
    [16, 256], l' a power of two >= 16 (a selection block is one tl.dot operand), l'/d a power of two,
    l a multiple of d and l <= l' (a compressed token overlaps at most two selection blocks); head_dim 256
    also needs 160 KiB of shared memory per block (A100, H100; not the 99 KiB of RTX 30xx/40xx, A10, L4)."""
    lb, ds = params.sel_block_size, params.cmp_stride
    pow2 = lambda x: x > 0 and (x & (x - 1)) == 0  # noqa: E731
    if not (pow2(head_dim) and 16 <= head_dim <= 256):
        return f"head_dim={head_dim} (the kernels take a power of two in [16, 256])"
    if not (pow2(lb) and lb >= 16):
        return f"sel_block_size={lb} (the kernels take a power of two >= 16)"
    if not (lb % ds == 0 and pow2(lb // ds)):
        return f"sel_block_size / cmp_stride = {lb} / {ds} (the kernels take a power of two)"
    if not (params.cmp_block_size % ds == 0 and params.cmp_block_size <= lb):
        return (f"cmp_block_size={params.cmp_block_size} (the kernels take a multiple of cmp_stride={ds} "
                f"no larger than sel_block_size={lb})")
    if device is not None and head_dim > 128 and _shared_memory_limit(device) < _LARGE_SHARED_MEMORY:
        return (f"head_dim={head_dim} needs {_LARGE_SHARED_MEMORY // 1024} KiB of shared memory per block; this "
                f"GPU has {_shared_memory_limit(device) // 1024} KiB (head_dim <= 128 runs on it)")
    return None


def triton_supports(params: NSAParams, head_dim: int, device=None) -> bool:
    """The kernels handle these parameters (on `device`, when given): see triton_unsupported_reason."""
    return triton_unsupported_reason(params, head_dim, device) is None


if _HAS_TRITON:

    @triton.jit
    def _load_do(DO, GATE, row, row_ok, d, D: tl.constexpr, BR: tl.constexpr):
        """The branch's output gradient g_br * dout for the given rows, rounded to the input dtype (never
        materialized in memory)."""
        do = tl.load(DO + row[:, None] * D + d[None, :], mask=row_ok[:, None], other=0.0)
        gt = tl.load(GATE + row * 3 + BR, mask=row_ok, other=0.0).to(tl.float32)
        return (do.to(tl.float32) * gt[:, None]).to(DO.dtype.element_ty)

    @triton.jit
    def _gated_sum(GATE, row, row_ok, o_cmp, o_slc, o_win):
        """g_cmp o_cmp + g_slc o_slc + g_win o_win in fp32 (Eq. 5), from the branch outputs as stored."""
        g0 = tl.load(GATE + row * 3, mask=row_ok, other=0.0).to(tl.float32)
        g1 = tl.load(GATE + row * 3 + 1, mask=row_ok, other=0.0).to(tl.float32)
        g2 = tl.load(GATE + row * 3 + 2, mask=row_ok, other=0.0).to(tl.float32)
        return g0[:, None] * o_cmp + g1[:, None] * o_slc + g2[:, None] * o_win

    @triton.jit
    def _branch_output(acc, l_i, dtype: tl.constexpr):
        """A branch's normalized output (0 where no key was visible) rounded to the stored dtype, in fp32."""
        return (acc / tl.where(l_i > 0, l_i, 1.0)[:, None]).to(dtype).to(tl.float32)

    @triton.jit
    def _load_lse(LSE, row, row_ok):
        """A branch's saved log-sum-exp of the given rows, 0 where no key was visible (stored as +inf): the
        probabilities recomputed from it are then 0 through their masks, never NaN."""
        lse = tl.load(LSE + row, mask=row_ok, other=0.0)
        return tl.where(lse == float("inf"), 0.0, lse)

    @triton.jit
    def _bwd_rows(Q, DO, GATE, LSE, DELTA, row, row_ok, d, D: tl.constexpr, BR: tl.constexpr):
        """A query tile's rows for a dK/dV update: q, the branch's output gradient round(g dout), the
        log-sum-exp (0 where no key was visible) and delta."""
        q = tl.load(Q + row[:, None] * D + d[None, :], mask=row_ok[:, None], other=0.0)
        do = _load_do(DO, GATE, row, row_ok, d, D, BR)
        delta = tl.load(DELTA + row, mask=row_ok, other=0.0)
        return q, do, _load_lse(LSE, row, row_ok), delta

    @triton.jit
    def _dkdv_update(q, do, lse, delta, k, v, vis_t, sm_scale2, dk, dv):
        """One query tile's share of a key tile's dK (unscaled) and dV: the flash-attention backward with
        the probabilities recomputed from the saved log-sum-exp; vis_t (keys, rows) says which row sees which
        key. Computed key-major (S^T = K Q^T), so P^T and dS^T come out of their dots in the layout the dV and
        dK dots take them in (no transpose through shared memory) and the keys, not the query rows, are the
        dots' M dimension."""
        s_t = tl.dot(k, tl.trans(q)) * sm_scale2  # (keys, rows)
        p_t = tl.where(vis_t, tl.exp2(s_t - lse[None, :]), 0.0)
        dv += tl.dot(p_t.to(do.dtype), do)
        dp_t = tl.dot(v, tl.trans(do))
        ds_t = p_t * (dp_t - delta[None, :])
        dk += tl.dot(ds_t.to(q.dtype), q)
        return dk, dv

    @triton.jit
    def _tile_rows(pid_q, Tq, r0, G: tl.constexpr, QPB: tl.constexpr, ROWS: tl.constexpr):
        """Rows r0 .. r0+ROWS-1 of query tile pid_q, packed query-major (QPB queries x G heads): (r, query qi,
        row_ok); rows past the tile or past Tq get qi = 0 and row_ok = False."""
        r = r0 + tl.arange(0, ROWS)
        qi = pid_q * QPB + r // G
        row_ok = (r < QPB * G) & (qi < Tq)
        return r, tl.where(row_ok, qi, 0), row_ok

    @triton.jit
    def _softmax_init(ROWS: tl.constexpr, D: tl.constexpr):
        """Online-softmax state of ROWS rows: running max, running sum, unnormalized output."""
        return tl.full([ROWS], float("-inf"), tl.float32), tl.zeros([ROWS], tl.float32), tl.zeros([ROWS, D], tl.float32)

    @triton.jit
    def _softmax_tile(s, v, m_i, l_i, acc):
        """Online-softmax update with one key tile: s (M, N) base-2 logits, -inf where not visible."""
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        return m_new, l_i, acc

    # ------------------------------------------------------------------------------------------
    # Interval attention (compressed + window branches)
    # ------------------------------------------------------------------------------------------

    @triton.jit
    def _interval_tiles(lo, hi, row_ok, Nk, BLOCK_N: tl.constexpr):
        """Key range of a query tile's interval branch: (k_begin, k_end) covers every row's [lo, hi), and the
        BLOCK_N tiles from k_begin that lie in [full_lo, full_hi) are inside every valid row's interval, so
        they need no mask (the window's and the compressed branch's middle tiles). A valid row with an empty
        interval (hi <= lo) empties that middle."""
        hi = tl.where(row_ok, hi, lo)
        k_begin = tl.min(tl.where(hi > lo, lo, Nk), axis=0)
        k_end = tl.max(hi, axis=0)
        lo_max = tl.max(tl.where(row_ok, lo, 0), axis=0)  # [lo_max, hi_min): keys every valid row sees
        hi_min = tl.min(tl.where(row_ok, hi, Nk), axis=0)
        n_tiles = tl.cdiv(tl.maximum(k_end - k_begin, 0), BLOCK_N)
        first = tl.minimum(tl.cdiv(tl.maximum(lo_max - k_begin, 0), BLOCK_N), n_tiles)
        last = tl.maximum(tl.minimum(tl.maximum(hi_min - k_begin, 0) // BLOCK_N, n_tiles), first)
        return k_begin, k_end, k_begin + first * BLOCK_N, k_begin + last * BLOCK_N

    @triton.jit
    def _interval_kv(K, V, kv_base, k0, k_end, lo, hi,
                     HKV: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr):
        """Key tile [k0, k0 + BLOCK_N): K, V (BLOCK_N, D) and which rows see which keys (MASKED; otherwise every
        key is in range and seen by every row, and vis is a constant)."""
        kk = k0 + tl.arange(0, BLOCK_N)
        kv_off = kv_base + kk.to(tl.int64)[:, None] * (HKV * D) + tl.arange(0, D)[None, :]
        if MASKED:
            k_ok = kk < k_end
            k = tl.load(K + kv_off, mask=k_ok[:, None], other=0.0)
            v = tl.load(V + kv_off, mask=k_ok[:, None], other=0.0)
            vis = (kk[None, :] >= lo[:, None]) & (kk[None, :] < hi[:, None])
        else:
            k = tl.load(K + kv_off)
            v = tl.load(V + kv_off)
            vis = True
        return k, v, vis

    @triton.jit
    def _interval_fwd_range(q, K, V, kv_base, lo, hi, k_from, k_to, k_end, sm_scale2, m_i, l_i, acc,
                            HKV: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr):
        """Online softmax over the key tiles from k_from to k_to (masked or not, see _interval_tiles)."""
        for k0 in range(k_from, k_to, BLOCK_N):
            k, v, vis = _interval_kv(K, V, kv_base, k0, k_end, lo, hi, HKV, D, BLOCK_N, MASKED)
            s = tl.dot(q, tl.trans(k)) * sm_scale2
            if MASKED:
                s = tl.where(vis, s, float("-inf"))
            m_i, l_i, acc = _softmax_tile(s, v, m_i, l_i, acc)
        return m_i, l_i, acc

    @triton.jit
    def _interval_fwd_kernel(
        Q, K, V, LO, HI, O, LSE, OC, OS, GATE, OUT,
        Tq, Nk, sm_scale2,
        H: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
        QPB: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, COMBINE: tl.constexpr,
    ):
        pid_q = tl.program_id(0)
        pid_bg = tl.program_id(1)
        b = (pid_bg // HKV).to(tl.int64)
        g = pid_bg % HKV
        r, qi, row_ok = _tile_rows(pid_q, Tq, 0, G, QPB, BLOCK_M)
        hh = r % G
        lo = tl.load(LO + b * Tq + qi, mask=row_ok, other=0)
        hi = tl.load(HI + b * Tq + qi, mask=row_ok, other=0)
        hi = tl.where(row_ok, hi, lo)
        k_begin, k_end, full_lo, full_hi = _interval_tiles(lo, hi, row_ok, Nk, BLOCK_N)
        d = tl.arange(0, D)
        row = (b * Tq + qi) * H + g * G + hh
        q = tl.load(Q + row[:, None] * D + d[None, :], mask=row_ok[:, None], other=0.0)
        kv_base = b * Nk * HKV * D + g * D
        m_i, l_i, acc = _softmax_init(BLOCK_M, D)
        # boundary tiles masked, the middle ones not (rows outside the tile hold q = 0 and are not stored)
        m_i, l_i, acc = _interval_fwd_range(q, K, V, kv_base, lo, hi, k_begin, full_lo, k_end, sm_scale2, m_i, l_i,
                                            acc, HKV, D, BLOCK_N, True)
        m_i, l_i, acc = _interval_fwd_range(q, K, V, kv_base, lo, hi, full_lo, full_hi, k_end, sm_scale2, m_i, l_i,
                                            acc, HKV, D, BLOCK_N, False)
        m_i, l_i, acc = _interval_fwd_range(q, K, V, kv_base, lo, hi, full_hi, k_end, k_end, sm_scale2, m_i, l_i,
                                            acc, HKV, D, BLOCK_N, True)
        has = l_i > 0
        out = acc / tl.where(has, l_i, 1.0)[:, None]
        out_ptr = row[:, None] * D + d[None, :]
        tl.store(O + out_ptr, out.to(O.dtype.element_ty), mask=row_ok[:, None])
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("inf"))
        tl.store(LSE + row, lse, mask=row_ok)
        if COMBINE:  # o = g_cmp o_cmp + g_slc o_slc + g_win o_win (fp32), the branch outputs as stored
            o_c = tl.load(OC + out_ptr, mask=row_ok[:, None], other=0.0).to(tl.float32)
            o_s = tl.load(OS + out_ptr, mask=row_ok[:, None], other=0.0).to(tl.float32)
            res = _gated_sum(GATE, row, row_ok, o_c, o_s, out.to(O.dtype.element_ty).to(tl.float32))
            tl.store(OUT + out_ptr, res.to(OUT.dtype.element_ty), mask=row_ok[:, None])

    @triton.jit
    def _interval_bwd_dkdv_kernel(
        Q, K, V, LO, HI, QA, QB, DO, GATE, LSE, DELTA, DK, DV,
        Tq, Nk, n_ktiles, sm_scale2, scale,
        H: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
        QPB: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, N_SPLIT: tl.constexpr, BR: tl.constexpr,
    ):
        # N_SPLIT > 1: program (tile, split) handles one slice of the tile's query range and writes an
        # fp32 partial to DK/DV[split] (summed afterwards in a fixed order: deterministic).
        pid_k = tl.program_id(0)
        pid_bg = tl.program_id(1)
        pid_s = tl.program_id(2)
        b = (pid_bg // HKV).to(tl.int64)
        g = pid_bg % HKV
        kk = pid_k * BLOCK_N + tl.arange(0, BLOCK_N)
        k_ok = kk < Nk
        d = tl.arange(0, D)
        kv_off = b * Nk * HKV * D + g * D + kk.to(tl.int64)[:, None] * (HKV * D) + d[None, :]
        k = tl.load(K + kv_off, mask=k_ok[:, None], other=0.0)
        v = tl.load(V + kv_off, mask=k_ok[:, None], other=0.0)
        q_begin = tl.load(QA + b * n_ktiles + pid_k)
        q_end = tl.load(QB + b * n_ktiles + pid_k)
        if N_SPLIT > 1:
            span = tl.cdiv(tl.cdiv(q_end - q_begin, N_SPLIT), QPB) * QPB
            q_begin = q_begin + pid_s * span
            q_end = tl.minimum(q_end, q_begin + span)
        dk = tl.zeros([BLOCK_N, D], tl.float32)
        dv = tl.zeros([BLOCK_N, D], tl.float32)
        r = tl.arange(0, BLOCK_M)
        hh = r % G
        for q0 in range(q_begin, q_end, QPB):
            qi = q0 + r // G
            row_ok = (r < QPB * G) & (qi < q_end)
            qi = tl.where(row_ok, qi, 0)
            lo = tl.load(LO + b * Tq + qi, mask=row_ok, other=0)
            hi = tl.load(HI + b * Tq + qi, mask=row_ok, other=0)
            row = (b * Tq + qi) * H + g * G + hh
            q, do, lse, delta = _bwd_rows(Q, DO, GATE, LSE, DELTA, row, row_ok, d, D, BR)
            # every tile masked, even those inside all rows' intervals: a branch in the loop body would keep
            # the compiler from software-pipelining the next query tile's loads (tests/triton_aot.py: TTGIR)
            vis_t = row_ok[None, :] & (kk[:, None] >= lo[None, :]) & (kk[:, None] < hi[None, :])
            dk, dv = _dkdv_update(q, do, lse, delta, k, v, vis_t, sm_scale2, dk, dv)
        split_off = pid_s.to(tl.int64) * (tl.num_programs(1) // HKV) * Nk * HKV * D
        tl.store(DK + split_off + kv_off, (dk * scale).to(DK.dtype.element_ty), mask=k_ok[:, None])
        tl.store(DV + split_off + kv_off, dv.to(DV.dtype.element_ty), mask=k_ok[:, None])

    # ------------------------------------------------------------------------------------------
    # Top-n block selection
    # ------------------------------------------------------------------------------------------

    @triton.jit
    def _topn_merge(top_v, top_i, prio, ci, N_SEL: tl.constexpr, N_PAD: tl.constexpr):
        """Merge a chunk (priorities prio (Q, BJ) of blocks ci (BJ,), all above the lists' indices) into
        each query's running top list (top_v, top_i) (Q, N_PAD), sorted by: a beats b iff v_a > v_b or
        (v_a == v_b and i_a < i_b). All in parallel: a list entry's new rank is its slot plus the chunk
        entries beating it; a chunk entry's rank counts the beaters in both; ranks >= N_SEL fall off."""
        slot = tl.arange(0, N_PAD)
        lv = top_v
        li = tl.where(top_i < 0, 1 << 30, top_i)
        cv = prio[:, None, :]  # chunk entries along the last axis
        c_beats_l = (cv > lv[:, :, None]) | ((cv == lv[:, :, None]) & (ci[None, None, :] < li[:, :, None]))
        rank_l = slot[None, :] + tl.sum(c_beats_l.to(tl.int32), 2)  # (Q, N_PAD)
        l_beats_c = (lv[:, None, :] > prio[:, :, None]) | (
            (lv[:, None, :] == prio[:, :, None]) & (li[:, None, :] < ci[None, :, None]))
        l_beats_c = l_beats_c & (slot[None, None, :] < N_SEL)
        c_beats_c = (cv > prio[:, :, None]) | ((cv == prio[:, :, None]) & (ci[None, None, :] < ci[None, :, None]))
        rank_c = tl.sum(l_beats_c.to(tl.int32), 2) + tl.sum(c_beats_c.to(tl.int32), 2)  # (Q, BJ)
        rank_l = tl.where(slot[None, :] < N_SEL, rank_l, 1 << 20)
        hit_l = rank_l[:, None, :] == slot[None, :, None]  # (Q, new slot, old slot)
        hit_c = rank_c[:, None, :] == slot[None, :, None]  # (Q, new slot, chunk entry)
        new_v = tl.maximum(tl.max(tl.where(hit_l, lv[:, None, :], float("-inf")), 2),
                           tl.max(tl.where(hit_c, cv, float("-inf")), 2))
        new_i = tl.maximum(tl.max(tl.where(hit_l, top_i[:, None, :], -1), 2),
                           tl.max(tl.where(hit_c, ci[None, None, :], -1), 2))
        return new_v, new_i

    @triton.jit
    def _topn_order_index(top_i, N_PAD: tl.constexpr):
        """The block index that breaks priority ties in a list (Q, N_PAD): the entry's own, and for a free slot
        (-1) a distinct stand-in above every block index, so free slots lose ties and stay distinct."""
        return tl.where(top_i < 0, (1 << 30) + tl.arange(0, N_PAD)[None, :], top_i)

    @triton.jit
    def _topn_worst(top_v, top_i, N_SEL: tl.constexpr, N_PAD: tl.constexpr):
        """Each query's worst kept entry of its (unsorted) list (Q, N_PAD): its priority (-inf while a slot is
        free) and its slot. Priority order: a beats b iff v_a > v_b or (v_a == v_b and i_a < i_b); free slots
        (-inf, -1) lose to every entry, and to each other by slot."""
        slot = tl.arange(0, N_PAD)
        kept = slot[None, :] < N_SEL
        li = _topn_order_index(top_i, N_PAD)
        v = tl.where(kept, top_v, float("inf"))
        worst_v = tl.min(v, 1)
        worst_li = tl.max(tl.where(kept & (v == worst_v[:, None]), li, -1), 1)
        worst_slot = tl.max(tl.where(kept & (li == worst_li[:, None]), slot[None, :], -1), 1)
        return worst_v, worst_slot

    @triton.jit
    def _topn_insert(top_v, top_i, prio, ci, N_SEL: tl.constexpr, N_PAD: tl.constexpr):
        """Insert each query's best chunk entry (prio (Q, BJ) of blocks ci, above the lists' indices) into its
        unsorted list (top_v, top_i) (Q, N_PAD) in place of the worst kept entry, if it beats it, and take it
        out of prio. A few (Q, N_PAD) and (Q, BJ) reductions: the cheap path when few entries of a chunk enter
        a list (the common case past the first blocks); the lists are sorted once at the end (_topn_sort)."""
        slot = tl.arange(0, N_PAD)
        best_v = tl.max(prio, 1)  # (Q,)
        best_i = tl.min(tl.where(prio == best_v[:, None], ci[None, :], 1 << 30), 1)  # lowest index first
        worst_v, worst_slot = _topn_worst(top_v, top_i, N_SEL, N_PAD)
        ins = best_v > worst_v  # the chunk's indices are above the list's, so a tie with the worst loses
        at = ins[:, None] & (slot[None, :] == worst_slot[:, None])
        top_v = tl.where(at, best_v[:, None], top_v)
        top_i = tl.where(at, best_i[:, None], top_i)
        prio = tl.where(ins[:, None] & (ci[None, :] == best_i[:, None]), float("-inf"), prio)
        return top_v, top_i, prio

    @triton.jit
    def _topn_sort(top_v, top_i, N_SEL: tl.constexpr, N_PAD: tl.constexpr):
        """The lists (Q, N_PAD) in priority order (see _topn_worst) in slots 0 .. N_SEL-1, free slots last:
        each kept entry's rank is the number of kept entries beating it."""
        slot = tl.arange(0, N_PAD)
        kept = slot < N_SEL
        li = _topn_order_index(top_i, N_PAD)
        beats = (top_v[:, :, None] > top_v[:, None, :]) | (
            (top_v[:, :, None] == top_v[:, None, :]) & (li[:, :, None] < li[:, None, :]))  # (Q, a, b): a beats b
        rank = tl.sum((beats & kept[None, :, None]).to(tl.int32), 1)  # (Q, N_PAD)
        rank = tl.where(kept[None, :], rank, 1 << 20)
        hit = rank[:, None, :] == slot[None, :, None]  # (Q, new slot, old slot)
        new_v = tl.max(tl.where(hit, top_v[:, None, :], float("-inf")), 2)
        new_i = tl.max(tl.where(hit, top_i[:, None, :], -1), 2)
        return new_v, new_i

    @triton.jit
    def _topn_chunk_update(ps, carry, top_v, top_i, j0, j_min, n_blocks, own,
                           L: tl.constexpr, DS: tl.constexpr, LB: tl.constexpr, N_SEL: tl.constexpr,
                           N_PAD: tl.constexpr, INIT: tl.constexpr, LOCAL: tl.constexpr, BJ: tl.constexpr,
                           QPB: tl.constexpr, INSERT_MAX: tl.constexpr):
        """Fold one chunk into QPB queries' running top-n lists (Eqs. 9-11). ps (QPB, BJ*R): compression
        probabilities of the in-document compressed tokens starting in blocks j0 .. j0+BJ-1, summed over
        each query's heads. A token starting at offset r*d in its block gives w0[r] = min(l' - r*d, l) / d
        to it and w1[r] = max(0, r*d + l - l') / d to the next (l <= l'); carry (QPB,) brings the previous
        chunk's last block's share. Only blocks j_min .. n_blocks-1 enter the lists (a decode program owns a
        block range, which it passes as j_min and n_blocks, and reads one block before it for the carry).
        Forced initial/local blocks get +inf. The lists are kept unsorted between chunks (the caller sorts
        them once, _topn_sort). A chunk whose entries enter no list is skipped; one where at most INSERT_MAX of
        a query's entries beat its worst kept entry inserts them one at a time (_topn_insert), else the lists
        are sorted and the chunk merged whole (_topn_merge); both keep the same entries.
        Returns (carry, top_v, top_i)."""
        R: tl.constexpr = LB // DS
        jb = tl.arange(0, BJ)
        rr = tl.arange(0, R) * DS
        w0 = (tl.minimum(LB - rr, L) // DS).to(tl.float32)  # (R,)
        w1 = (tl.maximum(rr + L - LB, 0) // DS).to(tl.float32)
        p3 = tl.reshape(ps, (QPB, BJ, R))
        to_own = tl.sum(p3 * w0[None, None, :], 2)  # (QPB, BJ)
        to_next = tl.sum(p3 * w1[None, None, :], 2)
        # block j receives to_next of block j - 1 (the previous chunk's last block for j = j0)
        from_prev = tl.sum(tl.where(jb[None, :, None] == jb[None, None, :] + 1, to_next[:, None, :], 0.0), 2)
        score = to_own + from_prev + tl.where(jb[None, :] == 0, carry[:, None], 0.0)
        carry = tl.sum(tl.where(jb[None, :] == BJ - 1, to_next, 0.0), 1)
        jj = (j0 + jb).to(tl.int32)
        elig = (jj[None, :] < n_blocks[:, None]) & (jj[None, :] >= j_min)
        local = (jj[None, :] > (own - LOCAL)[:, None]) & (jj[None, :] <= own[:, None])
        forced = elig & ((jj[None, :] < INIT) | local)
        prio = tl.where(elig, score, float("-inf"))
        prio = tl.where(forced, float("inf"), prio)
        worst = _topn_worst(top_v, top_i, N_SEL, N_PAD)[0]
        # chunk indices are above the lists' (blocks come in order), so a tie with the worst entry loses
        n_enter = tl.max(tl.sum((prio > worst[:, None]).to(tl.int32), 1), 0)  # most entries entering a list
        if INSERT_MAX >= BJ:  # at most BJ entries enter: every chunk inserts (no merge code compiled)
            if n_enter > 0:  # (the loop inside a branch: then Triton still software-pipelines the chunk loop)
                for _ in range(n_enter):
                    top_v, top_i, prio = _topn_insert(top_v, top_i, prio, jj, N_SEL, N_PAD)
        elif n_enter > INSERT_MAX:
            top_v, top_i = _topn_sort(top_v, top_i, N_SEL, N_PAD)  # the merge takes sorted lists
            top_v, top_i = _topn_merge(top_v, top_i, prio, jj, N_SEL, N_PAD)
        else:
            for _ in range(n_enter):
                top_v, top_i, prio = _topn_insert(top_v, top_i, prio, jj, N_SEL, N_PAD)
        return carry, top_v, top_i

    @triton.jit
    def _topn_tile(q, lse, row_ok, kc_base, n_vis_rows, pos, sm_scale2,
                   D: tl.constexpr, HKV: tl.constexpr, L: tl.constexpr, DS: tl.constexpr, LB: tl.constexpr,
                   N_SEL: tl.constexpr, N_PAD: tl.constexpr, INIT: tl.constexpr, LOCAL: tl.constexpr,
                   BJ: tl.constexpr, QPB: tl.constexpr, G_PAD: tl.constexpr, INSERT_MAX: tl.constexpr):
        """Top-n selection blocks of QPB queries of one document at in-document positions pos (QPB,); q/lse/
        row_ok hold their rows query-major (QPB x G_PAD heads, padded heads masked), with n_vis_rows visible
        compressed tokens per row from kc_base (the document's first). Streams over the blocks in chunks of
        BJ: one compressed-key tile per chunk serves every query and head (a tl.dot of all rows), and the
        probabilities exp2(s - lse) summed over each query's heads go to _topn_chunk_update. Returns
        (QPB, N_PAD) block indices by priority, -1 where unused."""
        R: tl.constexpr = LB // DS
        BC: tl.constexpr = BJ * R
        d = tl.arange(0, D)
        n_blocks = tl.where(pos >= 0, pos // LB + 1, 0).to(tl.int32)  # (QPB,) eligible blocks
        own = (pos // LB).to(tl.int32)
        top_v = tl.full([QPB, N_PAD], float("-inf"), tl.float32)
        top_i = tl.full([QPB, N_PAD], -1, tl.int32)
        carry = tl.zeros([QPB], tl.float32)
        n_tok = tl.max(tl.where(row_ok, n_vis_rows, 0), 0)  # this pass's rows: another document's may see more
        for j0 in range(0, tl.max(n_blocks, 0), BJ):
            ii = j0 * R + tl.arange(0, BC)  # in-document compressed tokens starting in the chunk's blocks
            kc = tl.load(kc_base + ii.to(tl.int64)[:, None] * (HKV * D) + d[None, :], mask=(ii < n_tok)[:, None],
                         other=0.0)
            s = tl.dot(q, tl.trans(kc)) * sm_scale2  # (QPB*G_PAD, BC)
            vis = row_ok[:, None] & (ii[None, :] < n_vis_rows[:, None])
            p = tl.where(vis, tl.exp2(s - lse[:, None]), 0.0)
            ps = tl.sum(tl.reshape(p, (QPB, G_PAD, BC)), 1)  # (QPB, BC): summed over the heads
            carry, top_v, top_i = _topn_chunk_update(ps, carry, top_v, top_i, j0, 0, n_blocks, own,
                                                     L, DS, LB, N_SEL, N_PAD, INIT, LOCAL, BJ, QPB, INSERT_MAX)
        top_v, top_i = _topn_sort(top_v, top_i, N_SEL, N_PAD)
        return tl.where(top_v > float("-inf"), top_i, -1)

    @triton.jit
    def _select_topn_kernel(
        Q, KC, LSE, DOCPOS, CLO, CHI, IDX,
        Tq, Tk, Nc, q_off, sm_scale2,
        H: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, G_PAD: tl.constexpr,
        L: tl.constexpr, DS: tl.constexpr, LB: tl.constexpr,
        N_SEL: tl.constexpr, N_PAD: tl.constexpr, INIT: tl.constexpr, LOCAL: tl.constexpr,
        BJ: tl.constexpr, QPB: tl.constexpr, INSERT_MAX: tl.constexpr,
    ):
        """Top-n for a tile of QPB consecutive queries x G_PAD head rows of one KV group. A tile inside one
        document shares each compressed-key tile; a tile across a document boundary (rare) is done one
        query at a time (each pass masks the other queries' rows)."""
        pid_q = tl.program_id(0)
        pid_bg = tl.program_id(1)
        b = (pid_bg // HKV).to(tl.int64)
        g = pid_bg % HKV
        qq = tl.arange(0, QPB)
        tq = pid_q * QPB + qq  # (QPB,) queries
        tq_ok = tq < Tq
        tq = tl.where(tq_ok, tq, 0)
        pos = tl.load(DOCPOS + b * Tk + q_off + tq, mask=tq_ok, other=-1)
        c_lo = tl.load(CLO + b * Tq + tq, mask=tq_ok, other=0)
        start = q_off + tq - pos  # document start of each valid query
        # one document (or none: all padding) <=> the largest valid start is not above the smallest
        one_doc = tl.max(tl.where(pos >= 0, start, -1), 0) <= tl.min(tl.where(pos >= 0, start, 1 << 62), 0)
        r = tl.arange(0, QPB * G_PAD)
        rq = r // G_PAD  # query of each row
        hh = r % G_PAD
        ti = pid_q * QPB + rq
        row_ok = (hh < G) & (ti < Tq)
        ti = tl.where(row_ok, ti, 0)
        d = tl.arange(0, D)
        row = (b * Tq + ti) * H + g * G + hh
        q = tl.load(Q + row[:, None] * D + d[None, :], mask=row_ok[:, None], other=0.0)
        lse = _load_lse(LSE, row, row_ok)
        n_vis_rows = tl.load(CHI + b * Tq + ti, mask=row_ok, other=0) - tl.load(CLO + b * Tq + ti, mask=row_ok, other=0)
        top = tl.full([QPB, N_PAD], -1, tl.int32)
        for i in range(tl.where(one_doc, 1, QPB)):
            mine = one_doc | (qq == i)  # (QPB,) the queries this pass decides
            c_lo_i = tl.where(one_doc, tl.max(c_lo, 0), tl.sum(tl.where(qq == i, c_lo, 0), 0))
            kc_base = KC + b * Nc * HKV * D + g * D + c_lo_i.to(tl.int64) * (HKV * D)
            rows_i = row_ok & (one_doc | (rq == i))
            res = _topn_tile(q, lse, rows_i, kc_base, n_vis_rows, pos, sm_scale2,
                             D, HKV, L, DS, LB, N_SEL, N_PAD, INIT, LOCAL, BJ, QPB, G_PAD, INSERT_MAX)
            top = tl.where(mine[:, None], res, top)
        slot = tl.arange(0, N_PAD)
        out_ptr = IDX + (pid_bg.to(tl.int64) * Tq + tq)[:, None] * N_SEL + slot[None, :]
        tl.store(out_ptr, top, mask=tq_ok[:, None] & (slot < N_SEL)[None, :])

    # ------------------------------------------------------------------------------------------
    # Selected attention
    # ------------------------------------------------------------------------------------------

    # Query tiles: a program packs BLOCK_M rows = QPB consecutive queries x the G heads of one KV group
    # and walks the union of the tile's selected blocks (consecutive queries share the forced blocks and
    # much of the top-n). A block is named by its absolute first key a = doc_start + j * l' (a block
    # start lies inside its document, so equal a means same document). The launcher lists each tile's
    # distinct blocks (_tile_block_union: sorted, deduplicated, static shapes); each row attends block a
    # iff its own query selected it (keys s <= t).
    # Sub-tiles: the tile's rows are split in SUBS sub-tiles of SUB_M rows (1, 2 or 4, each with its own
    # softmax state); a union block is loaded once for the tile, and a sub-tile does its math only if one
    # of its rows' queries chose the block. The tile shares the block loads of many queries while the
    # math stays near what each query chose (bench/selection_tiles.py counts both). On sm_90 at head_dim 64
    # the tile is one sub-tile (_sel_sub_tile: a 16-row wgmma costs about a 64-row one), as it is for the
    # forward at head_dim 128.

    @triton.jit
    def _sel_tile_rows(IDX, DOCPOS, pid_q, pid_bg, b, Tq, Tk, q_off, r0,
                       G: tl.constexpr, LB: tl.constexpr, N_SEL: tl.constexpr, N_PAD: tl.constexpr,
                       QPB: tl.constexpr, ROWS: tl.constexpr):
        """Rows r0 .. r0+ROWS-1 of a query tile: (r, qi, row_ok, t_abs, a_rows (ROWS, N_PAD) first keys of the
        blocks each row's query chose, -1 unused)."""
        r, qi, row_ok = _tile_rows(pid_q, Tq, r0, G, QPB, ROWS)
        t_abs = q_off + qi
        pos = tl.load(DOCPOS + b * Tk + t_abs, mask=row_ok, other=-1)
        start = t_abs - pos
        slot = tl.arange(0, N_PAD)
        j_rows = tl.load(IDX + (pid_bg.to(tl.int64) * Tq + qi)[:, None] * N_SEL + slot[None, :],
                         mask=row_ok[:, None] & (slot < N_SEL)[None, :], other=-1)
        a_rows = tl.where(j_rows >= 0, start[:, None] + j_rows.to(tl.int64) * LB, -1)  # (ROWS, N_PAD)
        return r, qi, row_ok, t_abs, a_rows

    @triton.jit
    def _sel_sub_rows(Q, IDX, DOCPOS, pid_q, pid_bg, Tq, Tk, q_off, r0,
                      H: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, LB: tl.constexpr,
                      N_SEL: tl.constexpr, N_PAD: tl.constexpr, QPB: tl.constexpr, SUB_M: tl.constexpr):
        """A sub-tile's q, row indices (into (B*T*H) rows), row mask, query positions and chosen blocks."""
        b = (pid_bg // HKV).to(tl.int64)
        g = pid_bg % HKV
        r, qi, row_ok, t_abs, a_rows = _sel_tile_rows(IDX, DOCPOS, pid_q, pid_bg, b, Tq, Tk, q_off, r0,
                                                      G, LB, N_SEL, N_PAD, QPB, SUB_M)
        row = (b * Tq + qi) * H + g * G + r % G
        d = tl.arange(0, D)
        q = tl.load(Q + row[:, None] * D + d[None, :], mask=row_ok[:, None], other=0.0)
        return q, row, row_ok, t_abs, a_rows

    @triton.jit
    def _sel_block(K, V, UBLK, tile, u, kv_base, Tk,
                   HKV: tl.constexpr, D: tl.constexpr, LB: tl.constexpr, N_SEL: tl.constexpr, QPB: tl.constexpr):
        """The tile's u-th distinct block: its first key a, key indices kk (LB,) and K, V (LB, D)."""
        a = tl.load(UBLK + tile * (QPB * N_SEL) + u).to(tl.int64)
        kk = a + tl.arange(0, LB)
        k_ld = kk < Tk
        kv_off = kv_base + kk[:, None] * (HKV * D) + tl.arange(0, D)[None, :]
        k = tl.load(K + kv_off, mask=k_ld[:, None], other=0.0)
        v = tl.load(V + kv_off, mask=k_ld[:, None], other=0.0)
        return a, kk, k, v

    @triton.jit
    def _sel_fwd_sub(a, kk, k, v, q, t_abs, a_rows, sm_scale2, m_i, l_i, acc, WHOLE: tl.constexpr):
        """Block a for one sub-tile: skipped unless one of its rows' queries chose it. WHOLE: the sub-tile is
        the whole tile, whose union holds only blocks its queries chose, so no test (and no branch in the
        loop, which lets the compiler pipeline the block loads)."""
        sel = tl.sum((a_rows == a).to(tl.int32), 1) > 0  # rows whose query selected it
        if WHOLE:
            vis = sel[:, None] & (kk[None, :] <= t_abs[:, None])
            s = tl.where(vis, tl.dot(q, tl.trans(k)) * sm_scale2, float("-inf"))
            m_i, l_i, acc = _softmax_tile(s, v, m_i, l_i, acc)
        elif tl.max(sel.to(tl.int32), 0) > 0:
            vis = sel[:, None] & (kk[None, :] <= t_abs[:, None])
            s = tl.where(vis, tl.dot(q, tl.trans(k)) * sm_scale2, float("-inf"))
            m_i, l_i, acc = _softmax_tile(s, v, m_i, l_i, acc)
        return m_i, l_i, acc

    @triton.jit
    def _sel_fwd_store(O, LSE, row, row_ok, m_i, l_i, acc, D: tl.constexpr):
        has = l_i > 0
        out = acc / tl.where(has, l_i, 1.0)[:, None]
        d = tl.arange(0, D)
        tl.store(O + row[:, None] * D + d[None, :], out.to(O.dtype.element_ty), mask=row_ok[:, None])
        tl.store(LSE + row, tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("inf")), mask=row_ok)

    @triton.jit
    def _sel_fwd_kernel(
        Q, K, V, IDX, UBLK, UCNT, DOCPOS, O, LSE,
        Tq, Tk, q_off, n_tiles, sm_scale2,
        H: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
        LB: tl.constexpr, N_SEL: tl.constexpr, N_PAD: tl.constexpr, QPB: tl.constexpr, BLOCK_M: tl.constexpr,
        SUB_M: tl.constexpr,
    ):
        SUBS: tl.constexpr = BLOCK_M // SUB_M
        pid_q = tl.program_id(0)
        pid_bg = tl.program_id(1)
        tile = pid_bg.to(tl.int64) * n_tiles + pid_q
        kv_base = (pid_bg // HKV).to(tl.int64) * Tk * HKV * D + (pid_bg % HKV) * D
        q0, row0, ok0, t0, a0 = _sel_sub_rows(Q, IDX, DOCPOS, pid_q, pid_bg, Tq, Tk, q_off, 0,
                                              H, HKV, G, D, LB, N_SEL, N_PAD, QPB, SUB_M)
        m0, l0, acc0 = _softmax_init(SUB_M, D)
        if SUBS >= 2:
            q1, row1, ok1, t1, a1 = _sel_sub_rows(Q, IDX, DOCPOS, pid_q, pid_bg, Tq, Tk, q_off, SUB_M,
                                                  H, HKV, G, D, LB, N_SEL, N_PAD, QPB, SUB_M)
            m1, l1, acc1 = _softmax_init(SUB_M, D)
        if SUBS >= 4:
            q2, row2, ok2, t2, a2 = _sel_sub_rows(Q, IDX, DOCPOS, pid_q, pid_bg, Tq, Tk, q_off, 2 * SUB_M,
                                                  H, HKV, G, D, LB, N_SEL, N_PAD, QPB, SUB_M)
            m2, l2, acc2 = _softmax_init(SUB_M, D)
            q3, row3, ok3, t3, a3 = _sel_sub_rows(Q, IDX, DOCPOS, pid_q, pid_bg, Tq, Tk, q_off, 3 * SUB_M,
                                                  H, HKV, G, D, LB, N_SEL, N_PAD, QPB, SUB_M)
            m3, l3, acc3 = _softmax_init(SUB_M, D)
        for u in range(tl.load(UCNT + tile)):
            a, kk, k, v = _sel_block(K, V, UBLK, tile, u, kv_base, Tk, HKV, D, LB, N_SEL, QPB)
            m0, l0, acc0 = _sel_fwd_sub(a, kk, k, v, q0, t0, a0, sm_scale2, m0, l0, acc0, SUBS == 1)
            if SUBS >= 2:
                m1, l1, acc1 = _sel_fwd_sub(a, kk, k, v, q1, t1, a1, sm_scale2, m1, l1, acc1, False)
            if SUBS >= 4:
                m2, l2, acc2 = _sel_fwd_sub(a, kk, k, v, q2, t2, a2, sm_scale2, m2, l2, acc2, False)
                m3, l3, acc3 = _sel_fwd_sub(a, kk, k, v, q3, t3, a3, sm_scale2, m3, l3, acc3, False)
        _sel_fwd_store(O, LSE, row0, ok0, m0, l0, acc0, D)
        if SUBS >= 2:
            _sel_fwd_store(O, LSE, row1, ok1, m1, l1, acc1, D)
        if SUBS >= 4:
            _sel_fwd_store(O, LSE, row2, ok2, m2, l2, acc2, D)
            _sel_fwd_store(O, LSE, row3, ok3, m3, l3, acc3, D)

    @triton.jit
    def _sel_block_dkdv(Q, K, V, PAIR_Q, DOCPOS, DO, GATE, LSE, DELTA, a, pid_bg, p_begin, p_end,
                        Tq, Tk, q_off, sm_scale2,
                        H: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, LB: tl.constexpr,
                        QPB: tl.constexpr, BLOCK_M: tl.constexpr, BR: tl.constexpr):
        """dK (unscaled), dV of the selection block whose first key is a, over its (query, block) pairs
        [p_begin, p_end) (rows packed as query x head). Returns (dk, dv, kv_off, k_ok)."""
        b = (pid_bg // HKV).to(tl.int64)
        g = pid_bg % HKV
        kk = a + tl.arange(0, LB)
        # keys of this block: same document as its first key (a block may be cut by the doc end)
        a_start = a - tl.load(DOCPOS + b * Tk + a)
        k_pos = tl.load(DOCPOS + b * Tk + kk, mask=kk < Tk, other=-1)
        k_ok = (kk < Tk) & (k_pos >= 0) & (kk - k_pos == a_start)
        d = tl.arange(0, D)
        kv_off = b * Tk * HKV * D + g * D + kk.to(tl.int64)[:, None] * (HKV * D) + d[None, :]
        k = tl.load(K + kv_off, mask=k_ok[:, None], other=0.0)
        v = tl.load(V + kv_off, mask=k_ok[:, None], other=0.0)
        dk = tl.zeros([LB, D], tl.float32)
        dv = tl.zeros([LB, D], tl.float32)
        r = tl.arange(0, BLOCK_M)
        hh = r % G
        for p0 in range(p_begin, p_end, QPB):
            pi = p0 + r // G
            row_ok = (r < QPB * G) & (pi < p_end)
            qi = tl.load(PAIR_Q + pi, mask=row_ok, other=0)
            row = (b * Tq + qi) * H + g * G + hh
            q, do, lse, delta = _bwd_rows(Q, DO, GATE, LSE, DELTA, row, row_ok, d, D, BR)
            vis_t = row_ok[None, :] & k_ok[:, None] & (kk[:, None] <= (q_off + qi)[None, :])
            dk, dv = _dkdv_update(q, do, lse, delta, k, v, vis_t, sm_scale2, dk, dv)
        return dk, dv, kv_off, k_ok

    @triton.jit
    def _sel_bwd_dkdv_kernel(
        Q, K, V, PAIR_OFF, PAIR_Q, HPOS, HCUM, DOCPOS, DO, GATE, LSE, DELTA, DK, DV, PDK, PDV,
        Tq, Tk, q_off, sm_scale2, scale, heavy_min, n_flat, n_heavy,
        H: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
        LB: tl.constexpr, QPB: tl.constexpr, BLOCK_M: tl.constexpr, BR: tl.constexpr,
        HEAVY_PASS: tl.constexpr, N_SPLIT: tl.constexpr,
    ):
        # Main pass (grid: key range of LB keys x batch*kv head): the blocks starting in the range that
        # have (query, block) pairs, found with one vector load of their pair counts; usually one per
        # range (more where short documents start blocks close together). Load skew (block 0 is chosen by
        # every query of its document): a block with more than heavy_min pairs and a partial slot (HCUM, its
        # 1-based heavy rank, <= n_heavy) is left to the heavy pass (grid: heavy slot h x 1 x N_SPLIT;
        # HPOS[h] names the block), each split writing an fp32 partial that _sel_dkdv_reduce_kernel sums
        # in split order (deterministic, no atomics).
        d = tl.arange(0, D)
        if HEAVY_PASS:
            h = tl.program_id(0).to(tl.int64)
            pid_s = tl.program_id(2)
            f = tl.load(HPOS + h)
            if f < n_flat:
                a = f % Tk
                pid_bg = f // Tk
                p_begin = tl.load(PAIR_OFF + f)
                p_end = tl.load(PAIR_OFF + f + 1)
                span = tl.cdiv(tl.cdiv(p_end - p_begin, N_SPLIT), QPB) * QPB
                p_begin = p_begin + pid_s * span
                p_end = tl.minimum(p_end, p_begin + span)
                dk, dv, kv_off, k_ok = _sel_block_dkdv(Q, K, V, PAIR_Q, DOCPOS, DO, GATE, LSE, DELTA, a, pid_bg,
                                                       p_begin, p_end, Tq, Tk, q_off, sm_scale2,
                                                       H, HKV, G, D, LB, QPB, BLOCK_M, BR)
                p_off = ((h * N_SPLIT + pid_s) * LB + tl.arange(0, LB).to(tl.int64))[:, None] * D + d[None, :]
                tl.store(PDK + p_off, dk * scale)
                tl.store(PDV + p_off, dv)
        else:
            pid_bg = tl.program_id(1)
            aa = tl.program_id(0) * LB + tl.arange(0, LB)  # candidate block starts in this key range
            a_ok = aa < Tk
            off = pid_bg.to(tl.int64) * Tk + aa
            beg = tl.load(PAIR_OFF + off, mask=a_ok, other=0)
            cnt = tl.load(PAIR_OFF + off + 1, mask=a_ok, other=0) - beg
            # heavy blocks past the n_heavy partial slots stay here (slower, still exact)
            mine = (cnt > 0) & ((cnt <= heavy_min) | (tl.load(HCUM + off, mask=a_ok, other=0) > n_heavy))
            rank = tl.cumsum(mine.to(tl.int32), 0) - 1
            for i in range(tl.sum(mine.to(tl.int32), 0)):
                hit = mine & (rank == i)
                a = tl.sum(tl.where(hit, aa, 0), 0)
                p_begin = tl.sum(tl.where(hit, beg, 0), 0)
                p_end = p_begin + tl.sum(tl.where(hit, cnt, 0), 0)
                dk, dv, kv_off, k_ok = _sel_block_dkdv(Q, K, V, PAIR_Q, DOCPOS, DO, GATE, LSE, DELTA, a, pid_bg,
                                                       p_begin, p_end, Tq, Tk, q_off, sm_scale2,
                                                       H, HKV, G, D, LB, QPB, BLOCK_M, BR)
                tl.store(DK + kv_off, (dk * scale).to(DK.dtype.element_ty), mask=k_ok[:, None])
                tl.store(DV + kv_off, dv.to(DV.dtype.element_ty), mask=k_ok[:, None])

    @triton.jit
    def _sel_dkdv_reduce_kernel(
        PDK, PDV, HPOS, DOCPOS, DK, DV, Tk, n_flat,
        HKV: tl.constexpr, D: tl.constexpr, LB: tl.constexpr, N_SPLIT: tl.constexpr,
    ):
        h = tl.program_id(0).to(tl.int64)
        f = tl.load(HPOS + h)  # flat (batch * kv head, block start) of the h-th heavy block
        if f < n_flat:
            pid_bg = f // Tk
            a = f % Tk
            b = pid_bg // HKV
            g = pid_bg % HKV
            kk = a + tl.arange(0, LB)
            a_start = a - tl.load(DOCPOS + b * Tk + a)
            k_pos = tl.load(DOCPOS + b * Tk + kk, mask=kk < Tk, other=-1)
            k_ok = (kk < Tk) & (k_pos >= 0) & (kk - k_pos == a_start)
            d = tl.arange(0, D)
            kv_off = b * Tk * HKV * D + g * D + kk[:, None] * (HKV * D) + d[None, :]
            # one fp32 tile live at a time (dK, then dV), summed in split order: deterministic
            for which in tl.static_range(2):
                acc = tl.zeros([LB, D], tl.float32)
                for sp in range(N_SPLIT):
                    p_off = ((h * N_SPLIT + sp) * LB + tl.arange(0, LB).to(tl.int64))[:, None] * D + d[None, :]
                    if which == 0:
                        acc += tl.load(PDK + p_off)
                    else:
                        acc += tl.load(PDV + p_off)
                if which == 0:
                    tl.store(DK + kv_off, acc.to(DK.dtype.element_ty), mask=k_ok[:, None])
                else:
                    tl.store(DV + kv_off, acc.to(DV.dtype.element_ty), mask=k_ok[:, None])

    # ------------------------------------------------------------------------------------------
    # Backward dQ: one kernel for the three branches
    # ------------------------------------------------------------------------------------------

    @triton.jit
    def _dq_update(q, do, lse, delta, k, v, vis, sm_scale2, dq, MASKED: tl.constexpr):
        """A key tile's share of the query tile's dQ (unscaled): the flash-attention backward with the
        probabilities recomputed from the saved log-sum-exp (the dQ side of _dkdv_update); vis is ignored
        unless MASKED."""
        s = tl.dot(q, tl.trans(k)) * sm_scale2
        p = tl.exp2(s - lse[:, None])
        if MASKED:
            p = tl.where(vis, p, 0.0)
        ds = p * (tl.dot(do, tl.trans(v)) - delta[:, None])
        return dq + tl.dot(ds.to(k.dtype), k)

    @triton.jit
    def _interval_dq_range(q, do, lse, delta, K, V, kv_base, lo, hi, k_from, k_to, k_end, sm_scale2, dq,
                           HKV: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr):
        for k0 in range(k_from, k_to, BLOCK_N):
            k, v, vis = _interval_kv(K, V, kv_base, k0, k_end, lo, hi, HKV, D, BLOCK_N, MASKED)
            dq = _dq_update(q, do, lse, delta, k, v, vis, sm_scale2, dq, MASKED)
        return dq

    @triton.jit
    def _interval_dq(q, do, lse, delta, K, V, kv_base, lo, hi, row_ok, Nk, sm_scale2,
                     HKV: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr):
        """dQ (unscaled) of one interval branch for the tile's rows: keys [lo, hi) of K/V per row; the middle
        tiles unmasked (see _interval_tiles; rows outside the tile hold q = do = delta = 0 and add nothing)."""
        hi = tl.where(row_ok, hi, lo)
        k_begin, k_end, full_lo, full_hi = _interval_tiles(lo, hi, row_ok, Nk, BLOCK_N)
        dq = tl.zeros(q.shape, tl.float32)
        dq = _interval_dq_range(q, do, lse, delta, K, V, kv_base, lo, hi, k_begin, full_lo, k_end, sm_scale2, dq,
                                HKV, D, BLOCK_N, True)
        dq = _interval_dq_range(q, do, lse, delta, K, V, kv_base, lo, hi, full_lo, full_hi, k_end, sm_scale2, dq,
                                HKV, D, BLOCK_N, False)
        return _interval_dq_range(q, do, lse, delta, K, V, kv_base, lo, hi, full_hi, k_end, k_end, sm_scale2, dq,
                                  HKV, D, BLOCK_N, True)

    @triton.jit
    def _branch_prep(DOUT, O, GATE, DG, DELTA, row, row_ok, d, R, D: tl.constexpr, BR: tl.constexpr):
        """dgate = dout . o and delta = rowsum(round(g dout) * o) of one branch for the tile's rows;
        stores both (delta also feeds the dK/dV kernels) and returns (round(g dout), delta)."""
        off = row[:, None] * D + d[None, :]
        dout = tl.load(DOUT + off, mask=row_ok[:, None], other=0.0)
        o = tl.load(O + off, mask=row_ok[:, None], other=0.0).to(tl.float32)
        gt = tl.load(GATE + row * 3 + BR, mask=row_ok, other=0.0).to(tl.float32)
        tl.store(DG + row * 3 + BR, tl.sum(dout.to(tl.float32) * o, 1).to(DG.dtype.element_ty), mask=row_ok)
        do = (dout.to(tl.float32) * gt[:, None]).to(DOUT.dtype.element_ty)
        delta = tl.sum(do.to(tl.float32) * o, 1)
        tl.store(DELTA + BR * R + row, delta, mask=row_ok)
        return do, delta

    @triton.jit
    def _sel_dq_sub_rows(Q, IDX, DOCPOS, DOUT, OS, GATE, DG, DELTA, LSE_S, pid_q, pid_bg, Tq, Tk, q_off, R, r0,
                         H: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, LB: tl.constexpr,
                         N_SEL: tl.constexpr, N_PAD: tl.constexpr, QPB: tl.constexpr, SUB_M: tl.constexpr):
        """A sub-tile's rows for the selected branch's dQ: q, round(g dout), log-sum-exp, delta (delta and the
        gate gradient also stored), query positions and chosen blocks."""
        q, row, row_ok, t_abs, a_rows = _sel_sub_rows(Q, IDX, DOCPOS, pid_q, pid_bg, Tq, Tk, q_off, r0,
                                                      H, HKV, G, D, LB, N_SEL, N_PAD, QPB, SUB_M)
        do, delta = _branch_prep(DOUT, OS, GATE, DG, DELTA, row, row_ok, tl.arange(0, D), R, D, 1)
        return q, do, _load_lse(LSE_S, row, row_ok), delta, t_abs, a_rows

    @triton.jit
    def _sel_dq_sub(a, kk, k, v, q, do, lse, delta, t_abs, a_rows, sm_scale2, dq, WHOLE: tl.constexpr):
        """Block a's share of one sub-tile's dQ: skipped unless one of its rows' queries chose it (WHOLE: the
        whole tile, no test, as in _sel_fwd_sub)."""
        sel = tl.sum((a_rows == a).to(tl.int32), 1) > 0
        if WHOLE:
            vis = sel[:, None] & (kk[None, :] <= t_abs[:, None])
            dq = _dq_update(q, do, lse, delta, k, v, vis, sm_scale2, dq, True)
        elif tl.max(sel.to(tl.int32), 0) > 0:
            vis = sel[:, None] & (kk[None, :] <= t_abs[:, None])
            dq = _dq_update(q, do, lse, delta, k, v, vis, sm_scale2, dq, True)
        return dq

    @triton.jit
    def _rows_cat(x, y):
        """(M, D), (M, D) -> (2M, D): the rows of x, then those of y."""
        M: tl.constexpr = x.shape[0]
        D: tl.constexpr = x.shape[1]
        return tl.reshape(tl.permute(tl.join(x, y), (2, 0, 1)), (2 * M, D))

    @triton.jit
    def _bwd_dq_kernel(
        Q, DOUT, GATE, DG, DELTA, DQ,
        KC, VC, C_LO, C_HI, LSE_C, OC,
        KS, VS, IDX, UBLK, UCNT, DOCPOS, LSE_S, OS,
        KW, VW, W_LO, W_HI, LSE_W, OW,
        Tq, Tk, Nc, Tw, q_off, n_tiles, R, sm_scale2, scale,
        H: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
        LB: tl.constexpr, N_SEL: tl.constexpr, N_PAD: tl.constexpr, QPB: tl.constexpr, BLOCK_M: tl.constexpr,
        SUB_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        """dQ of all three branches for one query tile, accumulated in registers in a fixed branch order
        (compressed, window, selected) and written once in q's dtype; also the gate gradients and the
        per-branch deltas. The branch output gradient g_i * dout is formed here (never materialized). The
        selected branch runs in sub-tiles as in _sel_fwd_kernel, joined back into the tile's rows."""
        SUBS: tl.constexpr = BLOCK_M // SUB_M
        pid_q = tl.program_id(0)
        pid_bg = tl.program_id(1)
        b = (pid_bg // HKV).to(tl.int64)
        g = pid_bg % HKV
        r, qi, row_ok = _tile_rows(pid_q, Tq, 0, G, QPB, BLOCK_M)
        d = tl.arange(0, D)
        row = (b * Tq + qi) * H + g * G + r % G
        q = tl.load(Q + row[:, None] * D + d[None, :], mask=row_ok[:, None], other=0.0)
        # compressed branch
        do, delta = _branch_prep(DOUT, OC, GATE, DG, DELTA, row, row_ok, d, R, D, 0)
        lse = _load_lse(LSE_C, row, row_ok)
        lo = tl.load(C_LO + b * Tq + qi, mask=row_ok, other=0)
        hi = tl.load(C_HI + b * Tq + qi, mask=row_ok, other=0)
        dq = _interval_dq(q, do, lse, delta, KC, VC, b * Nc * HKV * D + g * D, lo, hi, row_ok, Nc, sm_scale2,
                          HKV, D, BLOCK_N)
        # window branch
        do, delta = _branch_prep(DOUT, OW, GATE, DG, DELTA, row, row_ok, d, R, D, 2)
        lse = _load_lse(LSE_W, row, row_ok)
        lo = tl.load(W_LO + b * Tq + qi, mask=row_ok, other=0)
        hi = tl.load(W_HI + b * Tq + qi, mask=row_ok, other=0)
        dq += _interval_dq(q, do, lse, delta, KW, VW, b * Tw * HKV * D + g * D, lo, hi, row_ok, Tw, sm_scale2,
                           HKV, D, BLOCK_N)
        # selected branch: the tile's distinct blocks (see _tile_block_union), math per sub-tile
        q0, do0, lse0, dl0, t0, a0 = _sel_dq_sub_rows(Q, IDX, DOCPOS, DOUT, OS, GATE, DG, DELTA, LSE_S, pid_q, pid_bg,
                                                      Tq, Tk, q_off, R, 0, H, HKV, G, D, LB, N_SEL, N_PAD, QPB, SUB_M)
        dq0 = tl.zeros([SUB_M, D], tl.float32)
        if SUBS >= 2:
            q1, do1, lse1, dl1, t1, a1 = _sel_dq_sub_rows(Q, IDX, DOCPOS, DOUT, OS, GATE, DG, DELTA, LSE_S, pid_q,
                                                          pid_bg, Tq, Tk, q_off, R, SUB_M,
                                                          H, HKV, G, D, LB, N_SEL, N_PAD, QPB, SUB_M)
            dq1 = tl.zeros([SUB_M, D], tl.float32)
        if SUBS >= 4:
            q2, do2, lse2, dl2, t2, a2 = _sel_dq_sub_rows(Q, IDX, DOCPOS, DOUT, OS, GATE, DG, DELTA, LSE_S, pid_q,
                                                          pid_bg, Tq, Tk, q_off, R, 2 * SUB_M,
                                                          H, HKV, G, D, LB, N_SEL, N_PAD, QPB, SUB_M)
            dq2 = tl.zeros([SUB_M, D], tl.float32)
            q3, do3, lse3, dl3, t3, a3 = _sel_dq_sub_rows(Q, IDX, DOCPOS, DOUT, OS, GATE, DG, DELTA, LSE_S, pid_q,
                                                          pid_bg, Tq, Tk, q_off, R, 3 * SUB_M,
                                                          H, HKV, G, D, LB, N_SEL, N_PAD, QPB, SUB_M)
            dq3 = tl.zeros([SUB_M, D], tl.float32)
        tile = pid_bg.to(tl.int64) * n_tiles + pid_q
        kv_base = b * Tk * HKV * D + g * D
        for u in range(tl.load(UCNT + tile)):
            a, kk, k, v = _sel_block(KS, VS, UBLK, tile, u, kv_base, Tk, HKV, D, LB, N_SEL, QPB)
            dq0 = _sel_dq_sub(a, kk, k, v, q0, do0, lse0, dl0, t0, a0, sm_scale2, dq0, SUBS == 1)
            if SUBS >= 2:
                dq1 = _sel_dq_sub(a, kk, k, v, q1, do1, lse1, dl1, t1, a1, sm_scale2, dq1, False)
            if SUBS >= 4:
                dq2 = _sel_dq_sub(a, kk, k, v, q2, do2, lse2, dl2, t2, a2, sm_scale2, dq2, False)
                dq3 = _sel_dq_sub(a, kk, k, v, q3, do3, lse3, dl3, t3, a3, sm_scale2, dq3, False)
        if SUBS == 1:
            dq += dq0
        if SUBS == 2:
            dq += _rows_cat(dq0, dq1)
        if SUBS == 4:
            dq += _rows_cat(_rows_cat(dq0, dq1), _rows_cat(dq2, dq3))
        tl.store(DQ + row[:, None] * D + d[None, :], (dq * scale).to(DQ.dtype.element_ty), mask=row_ok[:, None])

    # ------------------------------------------------------------------------------------------
    # Decoding: compressed keys split over programs, block ranges' top-n, then the branches and the gates (one
    # program per row and KV group, or parts side by side and their combination)
    # ------------------------------------------------------------------------------------------

    @triton.jit
    def _decode_query(TEND, Tk, STATIC: tl.constexpr):
        """Key index of the decoded query: the last of the Tk keys, or (STATIC: a static cache's buffers of Tk
        slots, written up to the query) TEND[0], read on the device so that a CUDA graph of the step replays
        for every token."""
        if STATIC:
            t = tl.load(TEND)
        else:
            t = Tk - 1
        return t

    @triton.jit
    def _decode_cmp_split_kernel(
        Q, KC, VC, CEND, DOCPOS, TEND, PM, PL, PACC, PP, PCNT,
        Tk, Nc, S, sm_scale2, kc_bs, vc_bs, ce_bs, dp_bs,
        H: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, G_PAD: tl.constexpr,
        CS: tl.constexpr, STATIC: tl.constexpr,
    ):
        """Decode, split s of the compressed slots [s*CS, (s+1)*CS) of one (row, KV group): the split's
        softmax partials (max m, sum l, unnormalized output acc), its probabilities exp2(x - m) per head and
        slot (the top-n rescales them once the log-sum-exp is known), and two counts: slots of earlier
        documents and visible slots. A slot is visible iff start <= cmp_end <= t (slots sorted by end).
        *_bs: batch strides (elements) of KC, VC, CEND, DOCPOS: the cache's buffers are views with room to grow.
        STATIC (a static cache's fixed-size buffers): the query is key TEND[0], not Tk - 1 (_decode_query)."""
        pid_bg = tl.program_id(0)
        sp = tl.program_id(1)
        b, g, t, start, valid, hh, row, row_ok, q, d = _decode_rows(Q, DOCPOS, TEND, pid_bg, Tk, dp_bs, H, HKV, G, D,
                                                                     G_PAD, STATIC)
        start = tl.where(valid, start, Tk)  # a padded query sees nothing
        cc = sp * CS + tl.arange(0, CS)
        end = tl.load(CEND + b * ce_bs + cc, mask=cc < Nc, other=-1)
        vis = (end >= start) & (end <= t)
        kv_off = g * D + cc.to(tl.int64)[:, None] * (HKV * D) + d[None, :]
        k = tl.load(KC + b * kc_bs + kv_off, mask=vis[:, None], other=0.0)
        v = tl.load(VC + b * vc_bs + kv_off, mask=vis[:, None], other=0.0)
        x = tl.where(vis[None, :], tl.dot(q, tl.trans(k)) * sm_scale2, float("-inf"))  # (G_PAD, CS)
        m = tl.max(x, 1)
        p = tl.exp2(x - tl.where(m == float("-inf"), 0.0, m)[:, None])
        base = (pid_bg.to(tl.int64) * S + sp) * G_PAD + hh  # (G_PAD,) partial rows
        tl.store(PM + base, m)
        tl.store(PL + base, tl.sum(p, 1))
        tl.store(PACC + base[:, None] * D + d[None, :], tl.dot(p.to(v.dtype), v))
        tl.store(PP + base[:, None] * CS + tl.arange(0, CS)[None, :], p)
        cnt = (pid_bg.to(tl.int64) * S + sp) * 2
        tl.store(PCNT + cnt, tl.sum(((end >= 0) & (end < start)).to(tl.int32), 0))
        tl.store(PCNT + cnt + 1, tl.sum(vis.to(tl.int32), 0))

    @triton.jit
    def _merge_partials(PM, PL, PACC, PCNT, first, count, hh, d, G_PAD: tl.constexpr, D: tl.constexpr,
                        SB: tl.constexpr, WITH_ACC: tl.constexpr, COUNTS: tl.constexpr):
        """Online-softmax merge of `count` consecutive softmax partials (rows first*G_PAD + head of PM, PL, PACC),
        SB per vector load: per head the running max m and sum l and (WITH_ACC) the unnormalized output; with
        COUNTS (the compressed-key splits) also the two slot counts (slots of earlier documents = the document's
        first slot, visible slots)."""
        m_i, l_i, acc = _softmax_init(G_PAD, D)
        c_lo = tl.full([], 0, tl.int32)
        n_vis = tl.full([], 0, tl.int32)
        sb = tl.arange(0, SB)
        for s0 in range(0, count, SB):
            sp = s0 + sb
            ok = sp < count
            base = (first + sp)[:, None] * G_PAD + hh[None, :]  # (SB, G_PAD) partial rows
            m_s = tl.load(PM + base, mask=ok[:, None], other=float("-inf"))
            m_new = tl.maximum(m_i, tl.max(m_s, 0))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            a_old = tl.exp2(m_i - m_safe)
            a_s = tl.exp2(m_s - m_safe[None, :])  # 0 for empty partials (m_s = -inf)
            l_i = l_i * a_old + tl.sum(tl.load(PL + base, mask=ok[:, None], other=0.0) * a_s, 0)
            if WITH_ACC:
                p_acc = tl.load(PACC + base[:, :, None] * D + d[None, None, :], mask=ok[:, None, None], other=0.0)
                acc = acc * a_old[:, None] + tl.sum(p_acc * a_s[:, :, None], 0)
            m_i = m_new
            if COUNTS:
                cnt = (first + sp) * 2
                c_lo += tl.sum(tl.load(PCNT + cnt, mask=ok, other=0), 0)
                n_vis += tl.sum(tl.load(PCNT + cnt + 1, mask=ok, other=0), 0)
        return m_i, l_i, acc, c_lo, n_vis

    @triton.jit
    def _decode_topn_kernel(
        PM, PL, PACC, PP, PCNT, DOCPOS, TEND, TOPV, TOPI,
        Tk, S, n_prog, dp_bs,
        HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, G_PAD: tl.constexpr,
        L: tl.constexpr, DS: tl.constexpr, LB: tl.constexpr,
        N_SEL: tl.constexpr, N_PAD: tl.constexpr, INIT: tl.constexpr, LOCAL: tl.constexpr,
        BJ: tl.constexpr, CS: tl.constexpr, SB: tl.constexpr, TB: tl.constexpr, INSERT_MAX: tl.constexpr,
        STATIC: tl.constexpr,
    ):
        """Decode, program (row x KV group, j) of the selection blocks [j*TB, (j+1)*TB): their scores from
        the splits' stored probabilities (exp2(x - lse) = p_split * exp2(m_split - lse), no key read again),
        summed over the G heads, and the range's own top-n list (priority, block) for the selected parts to
        merge. Block ranges run in parallel: at long context no single program walks every block."""
        pid_bg = tl.program_id(0)
        pj = tl.program_id(1)
        b = (pid_bg // HKV).to(tl.int64)
        t = _decode_query(TEND, Tk, STATIC)
        hh = tl.arange(0, G_PAD)
        row_ok = hh < G
        d = tl.arange(0, D)
        m_i, l_i, _, c_lo, n_vis = _merge_partials(PM, PL, PACC, PCNT, pid_bg.to(tl.int64) * S, S, hh, d, G_PAD, D,
                                                   SB, False, True)
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), 0.0)
        pos = tl.load(DOCPOS + b * dp_bs + t)
        R: tl.constexpr = LB // DS
        BC: tl.constexpr = BJ * R
        pos1 = tl.zeros([1], tl.int64) + pos
        n_blocks = tl.where(pos1 >= 0, pos1 // LB + 1, 0).to(tl.int32)
        own = (pos1 // LB).to(tl.int32)
        top_v = tl.full([1, N_PAD], float("-inf"), tl.float32)
        top_i = tl.full([1, N_PAD], -1, tl.int32)
        carry = tl.zeros([1], tl.float32)
        j_lo = pj * TB
        n_range = tl.minimum(n_blocks, j_lo + TB)  # blocks past the range belong to the next program
        j_hi = tl.max(n_range, 0)
        # start one block early: its tokens' share in block j_lo arrives as the carry (not merged itself)
        for j0 in range(tl.maximum(j_lo - 1, 0), j_hi, BJ):
            ii = j0 * R + tl.arange(0, BC)
            tok_ok = ii < n_vis
            slot = (c_lo + ii).to(tl.int64)
            pbase = (pid_bg.to(tl.int64) * S + slot // CS)[None, :] * G_PAD + hh[:, None]  # (G_PAD, BC)
            ok = row_ok[:, None] & tok_ok[None, :]
            p = tl.load(PP + pbase * CS + (slot % CS)[None, :], mask=ok, other=0.0)
            m_tok = tl.load(PM + pbase, mask=ok, other=0.0)
            prob = tl.where(ok, p * tl.exp2(m_tok - lse[:, None]), 0.0)
            ps = tl.reshape(tl.sum(prob, 0), (1, BC))
            carry, top_v, top_i = _topn_chunk_update(ps, carry, top_v, top_i, j0, j_lo, n_range, own,
                                                     L, DS, LB, N_SEL, N_PAD, INIT, LOCAL, BJ, 1, INSERT_MAX)
        slot_n = tl.arange(0, N_PAD)
        keep = (slot_n[None, :] < N_SEL) & (top_v > float("-inf"))
        out = (pid_bg.to(tl.int64) * n_prog + pj) * N_PAD + slot_n
        tl.store(TOPV + out, tl.reshape(tl.where(keep, top_v, float("-inf")), (N_PAD,)))
        tl.store(TOPI + out, tl.reshape(tl.where(keep, top_i, -1), (N_PAD,)))

    @triton.jit
    def _group_rows(pid_bg, H: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
                    G_PAD: tl.constexpr):
        """A decode program's (row b, KV group g) and its G heads: (b, g, head index hh (G_PAD,), their rows of
        the (B * H) query/output rows, row_ok (hh < G), d = arange(D))."""
        b = (pid_bg // HKV).to(tl.int64)
        g = pid_bg % HKV
        hh = tl.arange(0, G_PAD)
        return b, g, hh, b * H + g * G + hh, hh < G, tl.arange(0, D)

    @triton.jit
    def _decode_rows(Q, DOCPOS, TEND, pid_bg, Tk, dp_bs, H: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr,
                     D: tl.constexpr, G_PAD: tl.constexpr, STATIC: tl.constexpr):
        """A decode program's query: _group_rows' (b, g, hh, row, row_ok, d) with the query's key index t, its
        document's first key (t + 1 for a padded query), valid (not padding) and q (G_PAD, D)."""
        b, g, hh, row, row_ok, d = _group_rows(pid_bg, H, HKV, G, D, G_PAD)
        t = _decode_query(TEND, Tk, STATIC)
        pos = tl.load(DOCPOS + b * dp_bs + t)
        q = tl.load(Q + row[:, None] * D + d[None, :], mask=row_ok[:, None], other=0.0)
        return b, g, t, t - pos, pos >= 0, hh, row, row_ok, q, d

    @triton.jit
    def _decode_selected(q, TOPV, TOPI, KS, VS, pid_bg, b, g, t, start, n_prog, slot_lo, slot_hi, sm_scale2, ks_bs,
                         vs_bs, d, HKV: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, LB: tl.constexpr,
                         N_PAD: tl.constexpr, N_SEL: tl.constexpr, LISTS: tl.constexpr, SEL_STEP: tl.constexpr):
        """Selected attention over list slots [slot_lo, slot_hi) of the query's top-n, SEL_STEP blocks (SEL_STEP * l'
        keys up to t) per step, after merging the block ranges' lists LISTS at a time (ranges are disjoint: every
        block once). Returns the softmax state (max, sum, unnormalized output) per head."""
        E: tl.constexpr = LISTS * N_PAD
        e = tl.arange(0, E)
        top_v = tl.full([1, N_PAD], float("-inf"), tl.float32)
        top_i = tl.full([1, N_PAD], -1, tl.int32)
        for l0 in range(0, n_prog, LISTS):
            ok = l0 + e // N_PAD < n_prog
            off = (pid_bg.to(tl.int64) * n_prog + l0) * N_PAD + e
            v = tl.load(TOPV + off, mask=ok, other=float("-inf"))
            i = tl.load(TOPI + off, mask=ok, other=-1)
            i = tl.where(i >= 0, i, (1 << 29) + e)  # distinct stand-ins for unused entries (priority -inf)
            top_v, top_i = _topn_merge(top_v, top_i, tl.reshape(v, (1, E)), i, N_SEL, N_PAD)
        top_i = tl.reshape(tl.where(top_v > float("-inf"), top_i, -1), (N_PAD,))
        slot_n = tl.arange(0, N_PAD)
        kb = tl.arange(0, SEL_STEP * LB)
        m_i, l_i, acc = _softmax_init(G_PAD, D)
        for i0 in range(slot_lo, slot_hi, SEL_STEP):
            slot_k = i0 + kb // LB  # (SEL_STEP * LB,) list slot of each key
            j = tl.sum(tl.where(slot_k[:, None] == slot_n[None, :], top_i[None, :], 0), 1)  # the slot's block
            j = tl.where(slot_k < slot_hi, j, -1)  # -1 (also an unused slot's): nothing visible
            kk = tl.where(j >= 0, start + j.to(tl.int64) * LB, t + 1) + kb % LB
            vis = kk <= t
            kv_off = g * D + kk[:, None] * (HKV * D) + d[None, :]
            k = tl.load(KS + b * ks_bs + kv_off, mask=vis[:, None], other=0.0)
            v = tl.load(VS + b * vs_bs + kv_off, mask=vis[:, None], other=0.0)
            x = tl.where(vis[None, :], tl.dot(q, tl.trans(k)) * sm_scale2, float("-inf"))
            m_i, l_i, acc = _softmax_tile(x, v, m_i, l_i, acc)
        return m_i, l_i, acc

    @triton.jit
    def _decode_window(q, KW, VW, b, g, t, start, valid, Tk, Tw, i_from, i_count, sm_scale2, kw_bs, vw_bs, d,
                       HKV: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, WIN: tl.constexpr,
                       BLOCK_N: tl.constexpr, STATIC: tl.constexpr):
        """Window attention over i_count of the query's visible window keys, from the i_from-th, BLOCK_N per step.
        KW holds the Tw keys ending at t, key first_kept + i at slot i (STATIC, a ring: at slot (first_kept + i) %
        Tw); visible from max(start, t - w + 1). Returns the softmax state per head."""
        if STATIC:
            first_kept = t - Tw + 1
        else:
            first_kept = Tk - Tw
        w_lo = tl.maximum(tl.maximum(start, t - WIN + 1) - first_kept, 0).to(tl.int32)
        i_lo = w_lo + i_from
        i_hi = tl.minimum(i_lo + i_count, tl.where(valid, Tw, 0))
        kn = tl.arange(0, BLOCK_N)
        m_i, l_i, acc = _softmax_init(G_PAD, D)
        for i0 in range(i_lo, i_hi, BLOCK_N):
            ii = i0 + kn
            vis = ii < i_hi
            if STATIC:
                ii = (ii + first_kept) % Tw  # >= 0 where visible: first_kept + w_lo >= start >= 0
            kv_off = g * D + ii.to(tl.int64)[:, None] * (HKV * D) + d[None, :]
            k = tl.load(KW + b * kw_bs + kv_off, mask=vis[:, None], other=0.0)
            v = tl.load(VW + b * vw_bs + kv_off, mask=vis[:, None], other=0.0)
            x = tl.where(vis[None, :], tl.dot(q, tl.trans(k)) * sm_scale2, float("-inf"))
            m_i, l_i, acc = _softmax_tile(x, v, m_i, l_i, acc)
        return m_i, l_i, acc

    @triton.jit
    def _decode_finish_kernel(
        Q, PM, PL, PACC, PCNT, TOPV, TOPI, KS, VS, KW, VW, GATE, DOCPOS, TEND, OUT,
        Tk, Tw, S, n_prog, sm_scale2, ks_bs, vs_bs, kw_bs, vw_bs, dp_bs,
        H: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, G_PAD: tl.constexpr,
        LB: tl.constexpr, N_SEL: tl.constexpr, N_PAD: tl.constexpr, WIN: tl.constexpr,
        SB: tl.constexpr, LISTS: tl.constexpr, SEL_STEP: tl.constexpr, BLOCK_N: tl.constexpr,
        STATIC: tl.constexpr,
    ):
        """Decode, one program per (row, KV group), rows = its G heads: merges the compressed-branch splits,
        then selected and window attention, and the gated sum. The third and last launch of an eager step, where
        every launch costs host time (0.35 ms per call against 0.08 ms of GPU time at B = 1 on the H100,
        2026-11-22). At B = 1 it runs two programs whose chain of steps is what costs on the GPU (55 of the 73 us
        at 64k, in steps half as long): a CUDA-graphed step (a static cache) takes _decode_parts_kernel and
        _decode_combine_kernel instead. *_bs: batch strides (elements) of KS, VS, KW, VW, DOCPOS (views of the
        cache's buffers). STATIC: the query is key TEND[0] and KW/VW a ring of Tw slots (key p at slot p % Tw);
        otherwise KW/VW hold keys Tk - Tw .. Tk - 1."""
        pid_bg = tl.program_id(0)
        b, g, t, start, valid, hh, row, row_ok, q, d = _decode_rows(Q, DOCPOS, TEND, pid_bg, Tk, dp_bs, H, HKV, G, D,
                                                                     G_PAD, STATIC)
        dtype: tl.constexpr = OUT.dtype.element_ty
        _, l_i, acc, _, _ = _merge_partials(PM, PL, PACC, PCNT, pid_bg.to(tl.int64) * S, S, hh, d, G_PAD, D, SB, True,
                                            False)  # (the slot counts are the top-n kernel's)
        o_cmp = _branch_output(acc, l_i, dtype)
        _, l_i, acc = _decode_selected(q, TOPV, TOPI, KS, VS, pid_bg, b, g, t, start, n_prog, 0, N_SEL, sm_scale2,
                                       ks_bs, vs_bs, d, HKV, G_PAD, D, LB, N_PAD, N_SEL, LISTS, SEL_STEP)
        o_slc = _branch_output(acc, l_i, dtype)
        _, l_i, acc = _decode_window(q, KW, VW, b, g, t, start, valid, Tk, Tw, 0, Tw, sm_scale2, kw_bs, vw_bs, d,
                                     HKV, G_PAD, D, WIN, BLOCK_N, STATIC)
        o_win = _branch_output(acc, l_i, dtype)
        out = _gated_sum(GATE, row, row_ok, o_cmp, o_slc, o_win)
        tl.store(OUT + row[:, None] * D + d[None, :], out.to(dtype), mask=row_ok[:, None])

    @triton.jit
    def _decode_parts_kernel(
        Q, PM, PL, PACC, PCNT, TOPV, TOPI, KS, VS, KW, VW, DOCPOS, TEND, OM, OL, OACC,
        Tk, Tw, S, n_prog, n_parts, sm_scale2, ks_bs, vs_bs, kw_bs, vw_bs, dp_bs,
        H: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, G_PAD: tl.constexpr,
        LB: tl.constexpr, N_SEL: tl.constexpr, N_PAD: tl.constexpr, WIN: tl.constexpr,
        SB: tl.constexpr, LISTS: tl.constexpr, SEL_STEP: tl.constexpr, SEL_PART: tl.constexpr,
        SEL_PARTS: tl.constexpr, BLOCK_N: tl.constexpr, WIN_PART: tl.constexpr, STATIC: tl.constexpr,
    ):
        """Decode, program (row x KV group, part): _decode_finish_kernel's work in parts that run side by side, for
        a CUDA-graphed step, where a launch costs microseconds and the finish kernel's chain of steps is what
        costs. Parts 0 .. SEL_PARTS - 1: SEL_PART of the n selected blocks (list slots); the next parts up to
        n_parts - 2: WIN_PART window keys each; the last part: the compressed branch's splits merged. Each writes
        its softmax partial (max, sum, unnormalized output per head) for _decode_combine_kernel."""
        pid_bg = tl.program_id(0)
        part = tl.program_id(1)
        # (rows unused: a name reused by the branches below must keep one type, so not `_`)
        b, g, t, start, valid, hh, rows, rows_ok, q, d = _decode_rows(Q, DOCPOS, TEND, pid_bg, Tk, dp_bs, H, HKV, G, D,
                                                                     G_PAD, STATIC)
        if part < SEL_PARTS:
            slot_hi = tl.minimum(part * SEL_PART + SEL_PART, N_SEL)
            m_i, l_i, acc = _decode_selected(q, TOPV, TOPI, KS, VS, pid_bg, b, g, t, start, n_prog, part * SEL_PART,
                                             slot_hi, sm_scale2, ks_bs, vs_bs, d, HKV, G_PAD, D, LB, N_PAD, N_SEL,
                                             LISTS, SEL_STEP)
        elif part < n_parts - 1:
            m_i, l_i, acc = _decode_window(q, KW, VW, b, g, t, start, valid, Tk, Tw, (part - SEL_PARTS) * WIN_PART,
                                           WIN_PART, sm_scale2, kw_bs, vw_bs, d, HKV, G_PAD, D, WIN, BLOCK_N, STATIC)
        else:
            m_i, l_i, acc, _, _ = _merge_partials(PM, PL, PACC, PCNT, pid_bg.to(tl.int64) * S, S, hh, d, G_PAD, D, SB,
                                                  True, False)
        base = (pid_bg.to(tl.int64) * n_parts + part) * G_PAD + hh  # (G_PAD,) partial rows
        tl.store(OM + base, m_i)
        tl.store(OL + base, l_i)
        tl.store(OACC + base[:, None] * D + d[None, :], acc)

    @triton.jit
    def _decode_combine_kernel(
        OM, OL, OACC, GATE, OUT, n_parts,
        H: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, G_PAD: tl.constexpr,
        SEL_PARTS: tl.constexpr, PB: tl.constexpr,
    ):
        """Decode, one program per (row, KV group): each branch's output from its parts' partials (selected:
        the first SEL_PARTS, window: the next, compressed: the last), PB parts per vector load, rounded to the
        output dtype as the training path stores them, and the gated sum (Eq. 5)."""
        pid_bg = tl.program_id(0)
        _, _, hh, row, row_ok, d = _group_rows(pid_bg, H, HKV, G, D, G_PAD)
        dtype: tl.constexpr = OUT.dtype.element_ty
        first = pid_bg.to(tl.int64) * n_parts
        _, l_i, acc, _, _ = _merge_partials(OM, OL, OACC, OM, first, SEL_PARTS, hh, d, G_PAD, D, PB, True, False)
        o_slc = _branch_output(acc, l_i, dtype)
        _, l_i, acc, _, _ = _merge_partials(OM, OL, OACC, OM, first + SEL_PARTS, n_parts - 1 - SEL_PARTS, hh, d,
                                            G_PAD, D, PB, True, False)
        o_win = _branch_output(acc, l_i, dtype)
        _, l_i, acc, _, _ = _merge_partials(OM, OL, OACC, OM, first + n_parts - 1, 1, hh, d, G_PAD, D, PB, True,
                                            False)
        o_cmp = _branch_output(acc, l_i, dtype)
        out = _gated_sum(GATE, row, row_ok, o_cmp, o_slc, o_win)
        tl.store(OUT + row[:, None] * D + d[None, :], out.to(dtype), mask=row_ok[:, None])


# ----------------------------------------------------------------------------------------------
# Host-side launchers (static shapes, no host synchronization)
# ----------------------------------------------------------------------------------------------

_LOG2E = 1.4426950408889634
@dataclasses.dataclass
class LaunchOverrides:
    """Launch choices forced by the tests (to reach every path of the kernels at tiny sizes) and by
    bench/tune_kernels.py (to time the other side of a default). None: the launcher's own choice. They change
    how the work is scheduled (tiles, splits, warps), never the result. Set them with `launch_overrides`."""

    dkdv_split: int | None = None  # splits of the query range of the compressed/window dK/dV kernel
    topn_blocks_per_chunk: int | None = None  # selection blocks per top-n chunk (small: the multi-chunk merge)
    topn_insert_max: int | None = None  # the top-n insertion/merge threshold (0: always merge)
    topn_rows: int | None = None  # rows (queries x padded heads) per top-n program
    topn_warps: int | None = None  # warps of the top-n program
    dkdv_warps: int | None = None  # warps of the compressed/window and selected dK/dV kernels
    dq_rows: int | None = None  # rows of the fused dQ query tile (sm_90)
    dq_warps: int | None = None  # warps of the fused dQ kernel (sm_90)
    sel_rows: int | None = None  # the selected-attention query tile (rows = queries x G)
    sel_sub_rows: int | None = None  # rows per sub-tile of that tile (= the tile's rows: no sub-tiles)
    sel_split: tuple[int, int, int] | None = None  # (heavy_min pairs, splits, partial slots) of the selected dK/dV
    decode_split: int | None = None  # compressed slots per decode split program
    decode_topn_blocks: int | None = None  # selection blocks per decode top-n program
    decode_sel_step: int | None = None  # selected blocks per step of a decode selected part
    decode_win_tile: int | None = None  # window keys per step of a decode window part
    decode_parts: int | None = None  # 1/0: the decode step's parts + combine kernels / the finish kernel
    decode_sel_part: int | None = None  # selected blocks per decode part program
    decode_win_part: int | None = None  # window keys per decode part program
    decode_warps: int | None = None  # warps of the decode finish and parts kernels
    decode_merge_splits: int | None = None  # compressed-key splits per step of the decode merges
    decode_merge_lists: int | None = None  # block ranges' top-n lists per step of the decode parts' list merge


_OVERRIDES = LaunchOverrides()  # what the launchers read; changed only through launch_overrides


@contextlib.contextmanager
def launch_overrides(**choices):
    """Force launch choices inside a `with` block: `with launch_overrides(topn_blocks_per_chunk=2): ...`. The
    choices not named keep their current value (the default, or an enclosing block's); all are restored on
    exit. A name that is not a LaunchOverrides field raises, naming the valid ones."""
    valid = [field.name for field in dataclasses.fields(LaunchOverrides)]
    unknown = sorted(set(choices) - set(valid))
    if unknown:
        raise TypeError(f"launch_overrides: unknown launch choice(s) {unknown}; valid: {valid}")
    saved = {name: getattr(_OVERRIDES, name) for name in choices}
    try:
        for name, value in choices.items():
            setattr(_OVERRIDES, name, value)
        yield _OVERRIDES
    finally:
        for name, value in saved.items():
            setattr(_OVERRIDES, name, value)


def _query_tile(group: int, rows: int) -> tuple[int, int]:
    """(BLOCK_M, queries per program) for (query x head) row packing: about `rows` rows, at least 16 (the
    smallest tl.dot) and at least one query's G heads."""
    block_m = max(16, _next_pow2(group), rows)
    return block_m, max(1, block_m // group)


def _rows_per_program(group: int, head_dim: int) -> tuple[int, int]:
    """(BLOCK_M, queries per program) for the interval kernels."""
    return _query_tile(group, 64 if head_dim <= 128 else 32)


def _compute_capability(device) -> int:
    """sm version (90 for H100, 80 for A100) of a CUDA device; 90 elsewhere (interpreter). tests/triton_aot.py
    replaces this to record the launches each architecture gets."""
    if torch.device(device).type != "cuda":
        return 90
    major, minor = torch.cuda.get_device_capability(device)
    return 10 * major + minor


def _hopper_class(device) -> bool:
    """Hopper (sm_90, wgmma) and datacenter Blackwell (sm_100/103, tcgen05) multiply 64- or 128-row tiles from
    shared memory and hold 227 KiB of it per block: they take the wide-tile launch choices below. Ampere and
    Ada (sm_80-89) and consumer Blackwell (sm_120: mma.sync, 99 KiB) hold accumulators in registers: the
    smaller tiles (at sm_120 the wide choices spill 500-1000 bytes per thread: tests/triton_aot.py)."""
    return 90 <= _compute_capability(device) < 120


# CUDA's opt-in limit of shared memory per block by compute capability, where the device cannot be asked
# (tests/triton_aot.py compiles for an architecture on CPU); unknown architectures get the smallest.
_SHARED_MEMORY_BY_CAPABILITY = {80: 163 * 1024, 86: 99 * 1024, 87: 163 * 1024, 89: 99 * 1024, 90: 227 * 1024,
                                100: 227 * 1024, 103: 227 * 1024, 120: 99 * 1024}
# Launch choices at or above this limit (A100, H100) use the larger tiles; below it (RTX 30xx/40xx, A10, L4),
# the decode step takes shorter steps and head_dim 256 is not supported.
_LARGE_SHARED_MEMORY = 160 * 1024


def _shared_memory_limit(device) -> int:
    """Bytes of shared memory one block of a kernel may use on `device` (the launch choices keep within it;
    tests/test_triton_compile.py checks every launch against it per architecture)."""
    device = torch.device(device)
    if device.type == "cuda":
        index = _cuda_index(device)
        if index not in _CUDA_SHARED_MEMORY:  # asked once per GPU: the decode step asks on every call
            limit = getattr(torch.cuda.get_device_properties(index), "shared_memory_per_block_optin", 0)
            _CUDA_SHARED_MEMORY[index] = int(limit) or _SHARED_MEMORY_BY_CAPABILITY.get(
                _compute_capability(device), 99 * 1024)
        return _CUDA_SHARED_MEMORY[index]
    return _SHARED_MEMORY_BY_CAPABILITY.get(_compute_capability(device), 99 * 1024)


_CUDA_SHARED_MEMORY: dict[int, int] = {}


def _dkdv_launch(group: int, head_dim: int, device) -> tuple[int, int, dict]:
    """(BLOCK_M, queries per program, launch options) for the dK/dV kernels, which hold fp32 dK and dV
    tiles across their query loop. Chosen with tests/triton_aot.py (registers and spills per variant) for
    the key-major update (_dkdv_update): on sm_90 at head_dim 64, 64-row query tiles at 4 warps, spill-free
    for both kernels (H100, 2026-11-23, bench/tune_kernels.py: the selected kernel 3.9 ms at 64k and 2.0 ms
    at 2k x 32 against 6.0 and 3.9 ms at 8 warps, variant dkdv8warps; the compressed/window kernel 1.75 ms at
    2k x 32 against 2.75). Elsewhere 32-row tiles at 8 warps:
    2 pipeline stages on sm_90 (spill-free at head_dim 128; head_dim 256 spills about 300-400 bytes with or
    without them), none on sm_80, which keeps the stack frame there at 0-32 bytes at head_dim 64 (64 rows,
    or pipelining, spill more)."""
    if head_dim <= 64 and _hopper_class(device):
        block_m, qpb = _rows_per_program(group, head_dim)
        return block_m, qpb, dict(num_warps=_OVERRIDES.dkdv_warps or 4)
    stages = 2 if _hopper_class(device) else 1
    return *_query_tile(group, 32), dict(num_warps=_OVERRIDES.dkdv_warps or 8, num_stages=stages)


def _dq_launch(group: int, head_dim: int, n_sel: int, device) -> tuple[int, int, dict]:
    """(BLOCK_M, queries per program, launch options) for the fused dQ kernel. On sm_90 at head_dim 64 with
    16 or more selected blocks: 128-row tiles, 8 warps (bench/tune_kernels.py on the H100, 2026-11-22: dQ 4.3
    -> 2.7 ms at 2k, 9.5 -> 6.3 ms on fla's layout at 8k, equal at 64k; the selected forward is slower with
    128 rows, so it keeps 64); with fewer blocks (T < 1024 at n = 16) the 128-row tile spills, and at
    head_dim 128 it does not fit: the selected attention's tile there. Before Hopper 64 rows spill whatever
    the warps, so the tile is 32 rows there (tests/triton_aot.py). Two pipeline stages on sm_90: with the
    selected loop free of branches (_sel_dq_sub, WHOLE) its block loads are software-pipelined, and the
    default three stages spill 8 bytes at 128 rows. H100, 2026-11-23: 128 rows beat 64 (variant dq64rows)
    and 32 (sel32rows) at 2k, 8k and 64k, random and correlated queries (64k: 16.9 / 18.3 / 20.6 ms)."""
    if _hopper_class(device):
        wide = head_dim <= 64 and _next_pow2(n_sel) >= 16 and not _OVERRIDES.sel_rows
        rows = _OVERRIDES.dq_rows or (128 if wide else None)
        block_m, qpb = _query_tile(group, rows) if rows else _sel_rows_per_program(group, head_dim)
        return block_m, qpb, dict(num_warps=_OVERRIDES.dq_warps or 8, num_stages=2)
    return *_query_tile(group, 32), dict(num_warps=4 if head_dim <= 64 else 8, num_stages=2)


def _sel_sub_tile(block_m: int, head_dim: int, device, dq: bool = False) -> int:
    """Rows per sub-tile of a selected-attention query tile (a sub-tile skips the union blocks none of its
    queries chose). Hopper's wgmma works on 64-row tiles, so there a 16-row tl.dot costs about a 64-row
    one and sub-tiles only add work: measured on the H100 (bench/tune_kernels.py, 2026-11-22, d64) the
    whole 64-row tile was fastest at every length and both layouts; a whole tile also lets the block loop be
    software-pipelined (no per-block branch). At head_dim 128 the fused dQ (dq=True) keeps 16-row sub-tiles:
    its whole tile spills (tests/triton_aot.py); the forward's does not. Before Hopper mma works on 16 rows,
    so there the tile runs as 16-row sub-tiles (at most 4), which skip the blocks none of their queries
    chose (bench/selection_tiles.py counts the math saved; not timed on such a GPU)."""
    if _OVERRIDES.sel_sub_rows:
        return min(block_m, max(_OVERRIDES.sel_sub_rows, block_m // 4))
    if _hopper_class(device) and (head_dim <= 64 or not dq):
        return block_m
    return min(block_m, max(16, block_m // 4))


def _sel_rows_per_program(group: int, head_dim: int) -> tuple[int, int]:
    """(BLOCK_M, queries per program) for the selected-attention query tiles: as wide as registers allow.
    A tile loads each block of its queries' union once; its sub-tiles (_sel_sub_tile) do the math only for
    the blocks their own queries chose, so the math does not grow with the tile but the loads shared per
    query do (bench/selection_tiles.py)."""
    if _OVERRIDES.sel_rows:
        return _query_tile(group, _OVERRIDES.sel_rows)
    return _query_tile(group, 64 if head_dim <= 128 else 32)


def _layout(cmp_end, doc_pos, num_queries, num_win, params: NSAParams):
    """Per-query metadata in key coordinates: compressed [lo, hi) and window [lo, hi)."""
    batch, num_keys = doc_pos.shape
    device = doc_pos.device
    q_off = num_keys - num_queries
    t_abs = torch.arange(q_off, num_keys, device=device).expand(batch, -1)
    pos = doc_pos[:, q_off:]
    valid = pos >= 0
    start = t_abs - pos
    big = torch.iinfo(torch.int64).max
    ends = torch.where(cmp_end >= 0, cmp_end, torch.full_like(cmp_end, big)).contiguous()
    c_lo = torch.searchsorted(ends, start.contiguous(), right=False)
    c_hi = torch.searchsorted(ends, t_abs.contiguous(), right=True)
    zero = torch.zeros_like(c_lo)
    c_lo = torch.where(valid, c_lo, zero)
    c_hi = torch.where(valid, torch.maximum(c_hi, c_lo), zero)
    w_off = num_keys - num_win
    w_lo = (torch.maximum(start, t_abs - params.window_size + 1) - w_off).clamp(min=0)
    w_hi = t_abs + 1 - w_off
    w_lo = torch.where(valid, w_lo, zero)
    w_hi = torch.where(valid, w_hi, zero)
    as32 = lambda x: x.to(torch.int32).contiguous()  # noqa: E731
    return as32(c_lo), as32(c_hi), as32(w_lo), as32(w_hi)


def _interval_fwd(q, k, v, lo, hi, scale, combine=None):
    """combine=(o_cmp, o_slc, gates): also write the gated sum of the three branches (returned third)."""
    batch, num_q, num_heads, head_dim = q.shape
    num_keys, num_kv = k.shape[1], k.shape[2]
    group = num_heads // num_kv
    o = torch.empty_like(q)
    lse = torch.empty(batch, num_q, num_heads, device=q.device, dtype=torch.float32)
    out = torch.empty_like(q) if combine is not None else o
    o_c, o_s, gates = combine if combine is not None else (o, o, lse)
    block_m, qpb = _rows_per_program(group, head_dim)
    grid = (_cdiv(num_q, qpb), batch * num_kv)
    _interval_fwd_kernel[grid](
        q, k, v, lo, hi, o, lse, o_c, o_s, gates, out, num_q, num_keys, scale * _LOG2E,
        H=num_heads, HKV=num_kv, G=group, D=head_dim, QPB=qpb, BLOCK_M=block_m, BLOCK_N=64,
        COMBINE=combine is not None, num_warps=4 if head_dim <= 64 else 8,
    )
    return (o, lse, out) if combine is not None else (o, lse)


def _interval_bwd_dkdv(q, k, v, lo, hi, do, gates, branch, lse, delta, scale):
    batch, num_q, num_heads, head_dim = q.shape
    num_keys, num_kv = k.shape[1], k.shape[2]
    group = num_heads // num_kv
    block_m, qpb, dkdv_opts = _dkdv_launch(group, head_dim, q.device)
    block_n = 64
    n_ktiles = _cdiv(max(num_keys, 1), block_n)
    # Queries that can see key tile [c0, c1): hi(t) > c0 and lo(t) < c1 (lo, hi monotone on valid queries).
    hi_m = hi.long().cummax(-1).values.contiguous()
    lo_m = torch.where(hi > lo, lo, torch.zeros_like(lo)).long().cummax(-1).values.contiguous()
    c0 = (torch.arange(n_ktiles, device=q.device) * block_n).expand(batch, -1).contiguous()
    c1 = (c0 + block_n).clamp(max=num_keys).contiguous()
    qa = torch.searchsorted(hi_m, c0, right=True).to(torch.int32).contiguous()
    qb = torch.searchsorted(lo_m, c1, right=False).to(torch.int32).contiguous()
    # Long query ranges per key tile (the compressed branch: a compressed key is seen by the rest of
    # its document) with few key tiles: split the range so the GPU is filled.
    n_split = 1
    programs = n_ktiles * batch * num_kv
    if programs < 1024 and num_q > 4 * block_n:
        n_split = max(1, min(64, 1024 // max(1, programs), num_q // (8 * qpb)))
    n_split = _OVERRIDES.dkdv_split or n_split
    if n_split == 1:
        dk = torch.empty_like(k)
        dv = torch.empty_like(v)
    else:
        dk = torch.empty((n_split,) + tuple(k.shape), device=k.device, dtype=torch.float32)
        dv = torch.empty_like(dk)
    _interval_bwd_dkdv_kernel[(n_ktiles, batch * num_kv, n_split)](
        q, k, v, lo, hi, qa, qb, do, gates, lse, delta, dk, dv, num_q, num_keys, n_ktiles, scale * _LOG2E, scale,
        H=num_heads, HKV=num_kv, G=group, D=head_dim, QPB=qpb, BLOCK_M=block_m, BLOCK_N=block_n,
        N_SPLIT=n_split, BR=branch, **dkdv_opts,
    )
    if n_split > 1:
        dk, dv = dk.sum(0).to(k.dtype), dv.sum(0).to(v.dtype)
    return dk, dv


def _select_topn(q, k_cmp, lse_cmp, doc_pos, c_lo, c_hi, params: NSAParams, scale):
    batch, num_q, num_heads, head_dim = q.shape
    num_slots, num_kv = k_cmp.shape[1], k_cmp.shape[2]
    num_keys = doc_pos.shape[1]
    group = num_heads // num_kv
    num_blocks = _cdiv(num_keys, params.sel_block_size)
    n_sel = min(params.sel_num_blocks, num_blocks)
    idx = torch.empty(batch, num_kv, num_q, n_sel, device=q.device, dtype=torch.int32)
    bj = _topn_chunk(params)
    g_pad = _next_pow2(group)
    rows = _OVERRIDES.topn_rows or 64
    qpb = max(1, min(16, rows // g_pad), 16 // g_pad)  # rows = qpb * g_pad (>= 16 for tl.dot), <= 16 queries
    _select_topn_kernel[(_cdiv(num_q, qpb), batch * num_kv)](
        q, k_cmp, lse_cmp, doc_pos, c_lo, c_hi, idx, num_q, num_keys, num_slots, num_keys - num_q, scale * _LOG2E,
        H=num_heads, HKV=num_kv, G=group, D=head_dim, G_PAD=g_pad,
        L=params.cmp_block_size, DS=params.cmp_stride, LB=params.sel_block_size,
        N_SEL=n_sel, N_PAD=_next_pow2(n_sel), INIT=params.sel_init_blocks, LOCAL=params.sel_local_blocks,
        BJ=bj, QPB=qpb, INSERT_MAX=_topn_insert_max(), num_warps=_topn_warps(q.device),
    )
    return idx


def _topn_warps(device) -> int:
    """Warps of the training top-n program: 4 on sm_90 (bench/tune_kernels.py on the H100, 2026-11-22: 19.1
    -> 14.6 ms at 64k, 1.3 -> 1.2 ms at 2k, when it still spilled 8-16 bytes with 16 selected blocks; the
    unsorted lists made it spill-free, tests/triton_aot.py); 8 before Hopper (not timed there)."""
    return _OVERRIDES.topn_warps or (4 if _hopper_class(device) else 8)


def _topn_insert_max(decode: bool = False) -> int:
    """Entries of a chunk entering a query's list up to which they are inserted one at a time (_topn_insert)
    rather than merged whole (_topn_merge); tests and bench/tune_kernels.py force it
    (launch_overrides(topn_insert_max=...)).
    Training's top-n inserts every entering block (no merge compiled in the chunk loop). An insertion replaces
    the worst entry of an unsorted list, 283 SASS instructions on sm_90 against 741 for the sorted-list
    insertion timed on the H100 (2026-11-22: inserting up to 4 per chunk, merging above, took the 64k top-n
    from 23.1 to 19.1 ms; inserting up to 16 then was slower, 26.6 ms); a chunk of 16 entering blocks costs
    about what a merge does (tests/triton_aot.py SASS). H100, 2026-11-23 (64k, random queries): 9.4 ms
    inserting every entering block, 15.0 ms inserting up to 4 (variant insert4), 43.0 ms merging every chunk
    (merge_only). The decode top-n merges every chunk: a decode program scores 64 blocks for one query, so
    most of its chunks bring several entering blocks (64k cache, same day: 11.8 us merging against 31.3 us
    inserting, variant decode_insert_all)."""
    if _OVERRIDES.topn_insert_max is not None:
        return _OVERRIDES.topn_insert_max
    return 0 if decode else 1 << 16


def _topn_chunk(params: NSAParams) -> int:
    """BJ selection blocks per top-n chunk: about 64 compressed tokens, at least 16 (the smallest tl.dot)."""
    ratio = params.sel_block_size // params.cmp_stride
    bj = max(1, 64 // ratio) if ratio <= 64 else 1
    bj = max(bj, 16 // min(ratio, 16))
    return _OVERRIDES.topn_blocks_per_chunk or bj


def _decode_step(q, k_cmp, v_cmp, cmp_end, k_slc, v_slc, k_win, v_win, gates, doc_pos, params: NSAParams, scale,
                 query_end=None):
    """One query per row (Tq == 1), none of the launches with a long serial loop at long context: the
    compressed keys split over CS-slot programs (softmax partials and probabilities); the selection blocks
    split over TB-block programs (scores and a top-n list per range); then the branches and the gates. Those
    last take one program per (row, KV group) in an eager step (three launches: each costs host time, and eager
    decoding is host-bound at small batch), or, in a static cache's step (CUDA-graphed by generate()), parts
    side by side (a few selected blocks, a span of the window, the compressed splits' merge) and a combine
    kernel (four launches, a short chain of steps on the GPU).
    query_end (a static cache): the query's key index as a 1-element int64 tensor, read by the kernels; every
    grid then follows the buffers' fixed sizes, so the launches are the same at every token (CUDA graphs)."""
    batch, _, num_heads, head_dim = q.shape
    num_slots, num_kv = k_cmp.shape[1], k_cmp.shape[2]
    num_keys, num_win = k_slc.shape[1], k_win.shape[1]
    group = num_heads // num_kv
    g_pad = max(16, _next_pow2(group))
    num_blocks = _cdiv(num_keys, params.sel_block_size)
    n_sel = min(params.sel_num_blocks, num_blocks)
    n_pad = _next_pow2(n_sel)
    # compressed slots per split program (a power of two >= 16): 256 at head_dim <= 64 (H100, 2026-11-23, 64k,
    # the other defaults as they are: the finish kernel, which merges the splits, 34.9 us against 39.1 / 46.9 us
    # with splits of 128 / 64 slots), 128 above (256 spills 96-104 B at head_dim 128: tests/triton_aot.py)
    split = _OVERRIDES.decode_split or (256 if head_dim <= 64 else 128)
    n_split = max(1, _cdiv(num_slots, split))
    blocks_per_prog = _OVERRIDES.decode_topn_blocks or 64  # selection blocks per top-n program
    n_prog = _cdiv(num_blocks, blocks_per_prog)
    rows = batch * num_kv * n_split * g_pad
    part_m = torch.empty(rows, device=q.device, dtype=torch.float32)
    part_l = torch.empty_like(part_m)
    part_acc = torch.empty(rows, head_dim, device=q.device, dtype=torch.float32)
    part_p = torch.empty(rows, split, device=q.device, dtype=torch.float32)
    counts = torch.empty(batch * num_kv * n_split, 2, device=q.device, dtype=torch.int32)
    top_v = torch.empty(batch * num_kv * n_prog, n_pad, device=q.device, dtype=torch.float32)
    top_i = torch.empty(batch * num_kv * n_prog, n_pad, device=q.device, dtype=torch.int32)
    common = dict(HKV=num_kv, G=group, D=head_dim, G_PAD=g_pad)
    topn = dict(LB=params.sel_block_size, N_SEL=n_sel, N_PAD=n_pad)
    # splits per vector load in the top-n kernel's merge (m, l only)
    merge_splits = _OVERRIDES.decode_merge_splits or 32
    # Steps of SEL_STEP selected blocks and BLOCK_N window keys, 256 keys (128 at head_dim 128, 64 at 256: each
    # step's K and V stay within shared memory), 4 warps to head_dim 64 (H100, 2026-11-23, 64k: the finish kernel
    # 34.9 us at 4 warps against 41.2 us at 8, the graphed static step 50.1 against 53.7 us; the finish kernel
    # spills 8-104 B there with triton 3.9, tests/test_triton_compile.py), 8 above (4 spill 200-264 B at head_dim
    # 128).
    # With 99 KiB of shared memory per block (RTX 30xx/40xx, A10, L4) half as many keys per step: 256 keys at
    # head_dim 64 take 136 KiB there. In parts, a part is one step by default: at n = 16, l' = 64, w = 512 and
    # head_dim 64, 4 selected parts, 2 window parts and the compressed merge, 7 programs per (row, KV group)
    # where the finish kernel walks 12 steps (graphed at 64k on the H100, 2026-11-23, at 8 warps: 100 us in parts
    # against 125 us with the finish kernel).
    budget = 16384 if _shared_memory_limit(q.device) >= _LARGE_SHARED_MEMORY else 8192  # keys x head_dim
    keys_per_step = min(256, budget // head_dim)
    sel_step = _OVERRIDES.decode_sel_step or max(1, min(keys_per_step // params.sel_block_size, _next_pow2(n_sel)))
    win_tile = _OVERRIDES.decode_win_tile or keys_per_step
    sel_part = max(sel_step, _OVERRIDES.decode_sel_part or sel_step)
    win_part = max(win_tile, _OVERRIDES.decode_win_part or win_tile)
    sel_parts, win_parts = _cdiv(n_sel, sel_part), _cdiv(num_win, win_part)
    n_parts = sel_parts + win_parts + 1  # the last: the compressed branch
    # the compressed merge: 16 splits (with their outputs) per step; the list merge: 128 entries per step
    part_splits = _OVERRIDES.decode_merge_splits or 16
    lists = _OVERRIDES.decode_merge_lists or max(1, 128 // n_pad)
    static = query_end is not None
    query_end = query_end if static else doc_pos  # (unread without STATIC)
    _decode_cmp_split_kernel[(batch * num_kv, n_split)](
        q, k_cmp, v_cmp, cmp_end, doc_pos, query_end, part_m, part_l, part_acc, part_p, counts,
        num_keys, num_slots, n_split, scale * _LOG2E, k_cmp.stride(0), v_cmp.stride(0), cmp_end.stride(0),
        doc_pos.stride(0), H=num_heads, CS=split, STATIC=static, num_warps=4, **common,
    )
    _decode_topn_kernel[(batch * num_kv, n_prog)](
        part_m, part_l, part_acc, part_p, counts, doc_pos, query_end, top_v, top_i, num_keys, n_split, n_prog,
        doc_pos.stride(0),
        L=params.cmp_block_size, DS=params.cmp_stride, INIT=params.sel_init_blocks, LOCAL=params.sel_local_blocks,
        BJ=_topn_chunk(params), CS=split, SB=merge_splits, TB=blocks_per_prog, INSERT_MAX=_topn_insert_max(decode=True),
        STATIC=static, num_warps=4, **common, **topn,
    )
    out = torch.empty_like(q)
    common_last = dict(H=num_heads, WIN=params.window_size, SB=part_splits, LISTS=lists, SEL_STEP=sel_step,
                       BLOCK_N=win_tile, STATIC=static,
                       num_warps=_OVERRIDES.decode_warps or (4 if head_dim <= 64 else 8),
                       **common, **topn)
    strides = (k_slc.stride(0), v_slc.stride(0), k_win.stride(0), v_win.stride(0), doc_pos.stride(0))
    if not (static if _OVERRIDES.decode_parts is None else _OVERRIDES.decode_parts):
        _decode_finish_kernel[(batch * num_kv,)](
            q, part_m, part_l, part_acc, counts, top_v, top_i, k_slc, v_slc, k_win, v_win, gates, doc_pos, query_end,
            out, num_keys, num_win, n_split, n_prog, scale * _LOG2E, *strides, **common_last,
        )
        return out
    out_m = torch.empty(batch * num_kv * n_parts * g_pad, device=q.device, dtype=torch.float32)
    out_l = torch.empty_like(out_m)
    out_acc = torch.empty(out_m.shape[0], head_dim, device=q.device, dtype=torch.float32)
    # one stage: a part is one step by default (nothing to overlap), and the two branches' pipeline buffers would
    # not share shared memory (258 KiB on sm_90)
    _decode_parts_kernel[(batch * num_kv, n_parts)](
        q, part_m, part_l, part_acc, counts, top_v, top_i, k_slc, v_slc, k_win, v_win, doc_pos, query_end,
        out_m, out_l, out_acc, num_keys, num_win, n_split, n_prog, n_parts, scale * _LOG2E, *strides,
        SEL_PART=sel_part, SEL_PARTS=sel_parts, WIN_PART=win_part, num_stages=1, **common_last,
    )
    _decode_combine_kernel[(batch * num_kv,)](
        out_m, out_l, out_acc, gates, out, n_parts, H=num_heads, SEL_PARTS=sel_parts,
        PB=max(1, 256 // head_dim), num_warps=4, **common,  # PB parts per load: spill-free to head_dim 256
    )
    return out


def _tile_block_union(idx, doc_pos, qpb: int, sel_block_size: int):
    """The distinct selected blocks of each query tile (qpb consecutive queries), as absolute first keys,
    ascending, then padding. idx (B, Hkv, Tq, n') in-document block indices (-1 unused); doc_pos (B, Tk)
    with the queries its last Tq positions. Returns (blocks (B, Hkv, n_tiles, qpb*n') int32, counts
    (B, Hkv, n_tiles) int32). Two segmented sorts, static shapes, no host synchronization."""
    batch, num_kv, num_q, n_sel = idx.shape
    num_keys = doc_pos.shape[1]
    q_off = num_keys - num_q
    n_tiles = _cdiv(num_q, qpb)
    none = torch.iinfo(torch.int32).max  # key indices fit int32 (Tk < 2**31): half the memory of int64
    start = (torch.arange(q_off, num_keys, device=idx.device) - doc_pos[:, q_off:]).to(torch.int32)  # (B, Tq)
    a = torch.where(idx >= 0, start[:, None, :, None] + idx * sel_block_size, none)  # (B, Hkv, Tq, n') int32
    a = torch.nn.functional.pad(a, (0, 0, 0, n_tiles * qpb - num_q), value=none)
    a = a.view(batch, num_kv, n_tiles, qpb * n_sel).sort(-1).values
    repeat = torch.zeros_like(a, dtype=torch.bool)
    repeat[..., 1:] = a[..., 1:] == a[..., :-1]
    a = torch.where(repeat, none, a).sort(-1).values  # distinct blocks first
    return a.contiguous(), (a < none).sum(-1, dtype=torch.int32).contiguous()


def _sel_fwd(q, k, v, idx, doc_pos, params: NSAParams, scale):
    batch, num_q, num_heads, head_dim = q.shape
    num_keys, num_kv = k.shape[1], k.shape[2]
    group = num_heads // num_kv
    o = torch.empty_like(q)
    lse = torch.empty(batch, num_q, num_heads, device=q.device, dtype=torch.float32)
    n_sel = idx.shape[-1]
    block_m, qpb = _sel_rows_per_program(group, head_dim)
    blocks, counts = _tile_block_union(idx, doc_pos, qpb, params.sel_block_size)
    _sel_fwd_kernel[(_cdiv(num_q, qpb), batch * num_kv)](
        q, k, v, idx, blocks, counts, doc_pos, o, lse, num_q, num_keys, num_keys - num_q, counts.shape[-1],
        scale * _LOG2E,
        H=num_heads, HKV=num_kv, G=group, D=head_dim,
        LB=params.sel_block_size, N_SEL=n_sel, N_PAD=_next_pow2(n_sel), QPB=qpb, BLOCK_M=block_m,
        SUB_M=_sel_sub_tile(block_m, head_dim, q.device),
        # head_dim above 64: 8 warps and two pipeline stages (spill-free at 128 on sm_90; tests/triton_aot.py)
        **(dict(num_warps=4) if head_dim <= 64 else dict(num_warps=8, num_stages=2)),
    )
    return o, lse


def _sel_bwd_dkdv(q, k, v, idx, doc_pos, do, gates, branch, lse, delta, params: NSAParams, scale):
    batch, num_q, num_heads, head_dim = q.shape
    num_keys, num_kv = k.shape[1], k.shape[2]
    group = num_heads // num_kv
    n_sel = idx.shape[-1]
    lb = params.sel_block_size
    q_off = num_keys - num_q
    # Inverted index: (query, block) pairs sorted by (batch, kv head, block start); stable, so every
    # block's queries come in increasing order and the accumulation order is fixed.
    # Built in int32 where the flat (batch, kv head, key) index fits, and temporaries dropped early: this
    # runs at the backward's memory peak.
    sentinel = batch * num_kv * num_keys
    key_dtype = torch.int32 if sentinel < 2**31 - 1 else torch.int64
    start = (torch.arange(q_off, num_keys, device=q.device) - doc_pos[:, q_off:]).to(key_dtype)  # (B, Tq)
    bg = torch.arange(batch * num_kv, device=q.device, dtype=key_dtype).view(batch, num_kv, 1, 1)
    key = (bg * num_keys + start[:, None, :, None]) + idx.to(key_dtype) * lb  # (B, Hkv, Tq, n') block starts
    key = torch.where(idx >= 0, key, sentinel).flatten()
    sorted_key, order = torch.sort(key, stable=True)
    del key
    pair_q = (order // n_sel % num_q).to(torch.int32).contiguous()
    del order
    pair_off = torch.searchsorted(sorted_key, torch.arange(sentinel + 1, device=q.device, dtype=key_dtype))
    pair_off = pair_off.contiguous()
    del sorted_key
    dk = torch.zeros_like(k)
    dv = torch.zeros_like(v)
    block_m, qpb, dkdv_opts = _dkdv_launch(group, head_dim, q.device)
    # Heavy blocks (more than heavy_min pairs) are split over n_split programs writing fp32 partials to
    # n_heavy slots (static shapes, no sync): at most total pairs / (heavy_min + 1) blocks can be heavy,
    # capped at `slots` partials (16 MiB each for dK and dV at d64); the main pass keeps the rest.
    heavy_min, n_split, slots = _OVERRIDES.sel_split or (8192, 16, 64)
    n_flat = batch * num_kv * num_keys
    cnt = pair_off[1:] - pair_off[:-1]
    heavy = cnt > heavy_min
    n_heavy = max(1, min(n_flat, slots, (batch * num_kv * num_q * n_sel) // (heavy_min + 1)))
    heavy_cum = torch.cumsum(heavy.long(), 0)  # heavy blocks up to and including each (b, kv, block start)
    # flat index of the h-th heavy block (n_flat where there are fewer)
    hpos = torch.searchsorted(heavy_cum, torch.arange(1, n_heavy + 1, device=q.device, dtype=torch.int64))
    hpos = hpos.contiguous()
    heavy_cum = torch.where(heavy, heavy_cum, 0).contiguous()
    pdk = torch.empty(n_heavy, n_split, lb, head_dim, device=q.device, dtype=torch.float32)
    pdv = torch.empty_like(pdk)
    args = (q, k, v, pair_off, pair_q, hpos, heavy_cum, doc_pos, do, gates, lse, delta, dk, dv, pdk, pdv,
            num_q, num_keys, q_off, scale * _LOG2E, scale, heavy_min, n_flat, n_heavy)
    meta = dict(H=num_heads, HKV=num_kv, G=group, D=head_dim, LB=lb, QPB=qpb, BLOCK_M=block_m, BR=branch,
                N_SPLIT=n_split, **dkdv_opts)
    _sel_bwd_dkdv_kernel[(_cdiv(num_keys, lb), batch * num_kv, 1)](*args, HEAVY_PASS=False, **meta)
    _sel_bwd_dkdv_kernel[(n_heavy, 1, n_split)](*args, HEAVY_PASS=True, **meta)
    _sel_dkdv_reduce_kernel[(n_heavy,)](
        pdk, pdv, hpos, doc_pos, dk, dv, num_keys, n_flat, HKV=num_kv, D=head_dim, LB=lb, N_SPLIT=n_split,
        num_warps=4,
    )
    return dk, dv


def _forward_impl(q, k_cmp, v_cmp, cmp_end, k_slc, v_slc, k_win, v_win, gates, doc_pos, params, scale):
    num_q = q.shape[1]
    c_lo, c_hi, w_lo, w_hi = _layout(cmp_end, doc_pos, num_q, k_win.shape[1], params)
    o_cmp, lse_cmp = _interval_fwd(q, k_cmp, v_cmp, c_lo, c_hi, scale)
    idx = _select_topn(q, k_cmp, lse_cmp, doc_pos, c_lo, c_hi, params, scale)
    o_slc, lse_slc = _sel_fwd(q, k_slc, v_slc, idx, doc_pos, params, scale)
    # the window kernel also writes the gated sum of the three branches (fp32, one pass)
    o_win, lse_win, out = _interval_fwd(q, k_win, v_win, w_lo, w_hi, scale, combine=(o_cmp, o_slc, gates))
    return out, o_cmp, o_slc, o_win, lse_cmp, lse_slc, lse_win, idx


def _params_tuple(params: NSAParams):
    return [
        params.cmp_block_size, params.cmp_stride, params.sel_block_size, params.sel_num_blocks,
        params.sel_init_blocks, params.sel_local_blocks, params.window_size,
    ]


def _params_from(p) -> NSAParams:
    return NSAParams(*[int(x) for x in p])


# ----------------------------------------------------------------------------------------------
# torch.library custom ops
# ----------------------------------------------------------------------------------------------

_NS = "nsa_triton"


@torch.library.custom_op(f"{_NS}::fwd", mutates_args=())
def _nsa_fwd_op(
    q: torch.Tensor, k_cmp: torch.Tensor, v_cmp: torch.Tensor, cmp_end: torch.Tensor,
    k_slc: torch.Tensor, v_slc: torch.Tensor, k_win: torch.Tensor, v_win: torch.Tensor,
    gates: torch.Tensor, doc_pos: torch.Tensor, params: list[int], scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _forward_impl(
        q, k_cmp, v_cmp, cmp_end, k_slc, v_slc, k_win, v_win, gates, doc_pos, _params_from(params), scale
    )


@torch.library.custom_op(f"{_NS}::decode_static", mutates_args=())
def _nsa_decode_static_op(
    q: torch.Tensor, k_cmp: torch.Tensor, v_cmp: torch.Tensor, cmp_end: torch.Tensor,
    k_slc: torch.Tensor, v_slc: torch.Tensor, k_win: torch.Tensor, v_win: torch.Tensor,
    gates: torch.Tensor, doc_pos: torch.Tensor, query_end: torch.Tensor, params: list[int], scale: float,
) -> torch.Tensor:
    """A static cache's decoding step as one opaque op: torch.compile (generate()'s CUDA-graphed decoding)
    records its launches without tracing the launcher's host code."""
    return _decode_step(q, k_cmp, v_cmp, cmp_end, k_slc, v_slc, k_win, v_win, gates, doc_pos,
                        _params_from(params), scale, query_end=query_end)


@_nsa_decode_static_op.register_fake
def _(q, k_cmp, v_cmp, cmp_end, k_slc, v_slc, k_win, v_win, gates, doc_pos, query_end, params, scale):
    return torch.empty_like(q)


@_nsa_fwd_op.register_fake
def _(q, k_cmp, v_cmp, cmp_end, k_slc, v_slc, k_win, v_win, gates, doc_pos, params, scale):
    batch, num_q, num_heads, _ = q.shape
    num_kv = k_slc.shape[2]
    num_blocks = (k_slc.shape[1] + params[2] - 1) // params[2]
    n_sel = min(params[3], num_blocks)
    lse = q.new_empty(batch, num_q, num_heads, dtype=torch.float32)
    return (
        torch.empty_like(q), torch.empty_like(q), torch.empty_like(q), torch.empty_like(q),
        lse, torch.empty_like(lse), torch.empty_like(lse),
        q.new_empty(batch, num_kv, num_q, n_sel, dtype=torch.int32),
    )


@torch.library.custom_op(f"{_NS}::bwd", mutates_args=())
def _nsa_bwd_op(
    dout: torch.Tensor, q: torch.Tensor, k_cmp: torch.Tensor, v_cmp: torch.Tensor, cmp_end: torch.Tensor,
    k_slc: torch.Tensor, v_slc: torch.Tensor, k_win: torch.Tensor, v_win: torch.Tensor,
    gates: torch.Tensor, doc_pos: torch.Tensor, o_cmp: torch.Tensor, o_slc: torch.Tensor, o_win: torch.Tensor,
    lse_cmp: torch.Tensor, lse_slc: torch.Tensor, lse_win: torch.Tensor, idx: torch.Tensor,
    params: list[int], scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    p = _params_from(params)
    batch, num_q, num_heads, head_dim = q.shape
    num_keys, num_kv, num_win = k_slc.shape[1], k_slc.shape[2], k_win.shape[1]
    group = num_heads // num_kv
    c_lo, c_hi, w_lo, w_hi = _layout(cmp_end, doc_pos, num_q, num_win, p)
    dout = dout.to(q.dtype).contiguous()
    # dQ of the three branches, dgates and the per-branch deltas in one kernel (query tiles as the
    # selected attention's); the dK/dV kernels then read the deltas. The block union (sort temporaries)
    # comes before dQ is allocated, which lowers the backward's peak memory.
    n_sel = idx.shape[-1]
    block_m, qpb, dq_opts = _dq_launch(group, head_dim, n_sel, q.device)
    blocks, counts = _tile_block_union(idx, doc_pos, qpb, p.sel_block_size)
    dq = torch.empty_like(q)
    dgates = torch.empty_like(gates)
    delta = torch.empty(3, batch, num_q, num_heads, device=q.device, dtype=torch.float32)
    _bwd_dq_kernel[(_cdiv(num_q, qpb), batch * num_kv)](
        q, dout, gates, dgates, delta, dq,
        k_cmp, v_cmp, c_lo, c_hi, lse_cmp, o_cmp,
        k_slc, v_slc, idx, blocks, counts, doc_pos, lse_slc, o_slc,
        k_win, v_win, w_lo, w_hi, lse_win, o_win,
        num_q, num_keys, k_cmp.shape[1], num_win, num_keys - num_q, counts.shape[-1], batch * num_q * num_heads,
        scale * _LOG2E, scale,
        H=num_heads, HKV=num_kv, G=group, D=head_dim, LB=p.sel_block_size, N_SEL=n_sel, N_PAD=_next_pow2(n_sel),
        QPB=qpb, BLOCK_M=block_m, SUB_M=_sel_sub_tile(block_m, head_dim, q.device, dq=True), BLOCK_N=64,
        **dq_opts,
    )
    del blocks, counts
    dk_cmp, dv_cmp = _interval_bwd_dkdv(q, k_cmp, v_cmp, c_lo, c_hi, dout, gates, 0, lse_cmp, delta[0], scale)
    dk_slc, dv_slc = _sel_bwd_dkdv(q, k_slc, v_slc, idx, doc_pos, dout, gates, 1, lse_slc, delta[1], p, scale)
    dk_win, dv_win = _interval_bwd_dkdv(q, k_win, v_win, w_lo, w_hi, dout, gates, 2, lse_win, delta[2], scale)
    return dq, dk_cmp, dv_cmp, dk_slc, dv_slc, dk_win, dv_win, dgates


@_nsa_bwd_op.register_fake
def _(dout, q, k_cmp, v_cmp, cmp_end, k_slc, v_slc, k_win, v_win, gates, doc_pos, o_cmp, o_slc, o_win,
      lse_cmp, lse_slc, lse_win, idx, params, scale):
    return (
        torch.empty_like(q), torch.empty_like(k_cmp), torch.empty_like(v_cmp), torch.empty_like(k_slc),
        torch.empty_like(v_slc), torch.empty_like(k_win), torch.empty_like(v_win), torch.empty_like(gates),
    )


def _setup_context(ctx, inputs, output):
    q, k_cmp, v_cmp, cmp_end, k_slc, v_slc, k_win, v_win, gates, doc_pos, params, scale = inputs
    _, o_cmp, o_slc, o_win, lse_cmp, lse_slc, lse_win, idx = output
    ctx.save_for_backward(
        q, k_cmp, v_cmp, cmp_end, k_slc, v_slc, k_win, v_win, gates, doc_pos,
        o_cmp, o_slc, o_win, lse_cmp, lse_slc, lse_win, idx,
    )
    ctx.params = params
    ctx.scale = scale
    # The branch outputs, LSEs and indices are returned only to be saved; without this, autograd would
    # build zero gradients for them (three q-sized tensors: 288 MiB at B*T = 64k with 12 heads).
    ctx.set_materialize_grads(False)


def _backward(ctx, dout, *unused):
    if dout is None:  # the gated output is not part of the loss
        return (None,) * 12
    saved = ctx.saved_tensors
    grads = _nsa_bwd_op(dout, *saved, ctx.params, ctx.scale)
    dq, dk_cmp, dv_cmp, dk_slc, dv_slc, dk_win, dv_win, dgates = grads
    return dq, dk_cmp, dv_cmp, None, dk_slc, dv_slc, dk_win, dv_win, dgates, None, None, None


_nsa_fwd_op.register_autograd(_backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------------------------
# Public API (the dispatcher's seam)
# ----------------------------------------------------------------------------------------------

def _rows_contiguous(x: torch.Tensor) -> bool:
    """Each batch row of x is contiguous (any batch stride): a view [:, a:b] of a (B, capacity, ...) buffer."""
    expected = 1
    for size, stride in zip(reversed(x.shape[1:]), reversed(x.stride()[1:])):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def _prepare(q, k_cmp, v_cmp, cmp_end, k_slc, v_slc, k_win, v_win, gates, doc_pos, batch_strided=False):
    """Contiguous inputs, K/V in q's dtype, positions int64; tensors already so pass through untouched.
    batch_strided (the decode step, whose kernels take batch strides): the cache's tensors need only
    contiguous rows, so the views of the cache's buffers are read where they are, not copied per token."""

    def c(x, dtype, rows_only=False):
        x = x if x.dtype == dtype else x.to(dtype)
        return x if (x.is_contiguous() or (rows_only and _rows_contiguous(x))) else x.contiguous()

    dt, r = q.dtype, batch_strided
    return (
        c(q, dt), c(k_cmp, dt, r), c(v_cmp, dt, r), c(cmp_end, torch.int64, r), c(k_slc, dt, r), c(v_slc, dt, r),
        c(k_win, dt, r), c(v_win, dt, r), c(gates, gates.dtype), c(doc_pos, torch.int64, r),
    )


def kernel_dtype(dtype: torch.dtype, device) -> torch.dtype:
    """The dtype the kernels compute in (fp32 accumulation) for inputs of `dtype` on `device`: on a GPU
    bfloat16 or float16 as given, and bfloat16 for anything else (float32 tiles would take twice the shared
    memory the launches are sized for, and tl.dot would round them to TF32 anyway); under the interpreter on
    CPU the inputs' own (the CPU tests run float32 exactly)."""
    if torch.device(device).type != "cuda" or dtype in (torch.bfloat16, torch.float16):
        return dtype
    return torch.bfloat16


def _kernel_inputs(*tensors):
    """The floating tensors cast to the dtype the kernels compute in, and the dtype to return the output in.
    Under torch.autocast that is the autocast dtype, as for SDPA (the model's RoPE runs in float32 there).
    Float32 (or float64) inputs on a GPU outside autocast compute in bfloat16 and get their output back in
    their own dtype, said once in the log."""
    q = tensors[0]
    device_type = q.device.type
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else q.dtype
    compute = kernel_dtype(dtype, q.device)
    if compute != dtype:
        _log_once(f"nsa_triton: {dtype} inputs on a GPU: the kernels compute in {compute} with float32 "
                  f"accumulation and return {dtype} (nsa_backend='reference' computes in {dtype}; "
                  f"model.to({compute}) or torch.autocast skips the casts)")
    # (a no-op .to() still costs about a microsecond of dispatch: the decode step pays it per layer and token)
    return tuple(t.to(compute) if t.is_floating_point() and t.dtype != compute else t for t in tensors), dtype


_logged: set[str] = set()


def _log_once(message: str) -> None:
    """A warning the first time it comes up; not inside torch.compile (logging cannot be traced:
    fullgraph=True would fail), where the eager calls around it say it."""
    if message not in _logged and not torch.compiler.is_compiling():
        import logging

        logging.getLogger(__name__).warning(message)
        _logged.add(message)


def _reference_fallback(reason: str, *args, **kwargs):
    """The PyTorch reference in place of the kernels, for what they do not handle (parameters, a head_dim
    above the GPU's shared memory); says so once per reason (the math is the same function, the speed is
    not)."""
    from .nsa_reference import nsa_attention_reference

    _log_once(f"nsa_triton: the Triton kernels do not handle {reason}; using the PyTorch reference (much slower).")
    return nsa_attention_reference(*args, **kwargs)


def _entry(q, k_cmp, v_cmp, cmp_end, k_slc, v_slc, k_win, v_win, gates, doc_pos, params: NSAParams, scale,
           batch_strided=False, query_end=None):
    """What both entry points do first. Returns (the reference's output where the kernels do not handle the
    parameters, else None; the kernels' prepared inputs; the scale; the dtype to return the output in)."""
    head_dim = q.shape[-1]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    unsupported = triton_unsupported_reason(params, head_dim, q.device)
    if unsupported:
        out = _reference_fallback(unsupported, q, k_cmp, v_cmp, cmp_end, k_slc, v_slc, k_win, v_win, gates,
                                  doc_pos, params, scale, query_end=query_end)
        return out, None, scale, out.dtype
    floats, out_dtype = _kernel_inputs(q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, gates)
    q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, gates = floats
    inputs = _prepare(q, k_cmp, v_cmp, cmp_end, k_slc, v_slc, k_win, v_win, gates, doc_pos, batch_strided)
    return None, inputs, scale, out_dtype


def nsa_attention_triton(q, k_cmp, v_cmp, cmp_end, k_slc, v_slc, k_win, v_win, gates, doc_pos,
                         params: NSAParams, scale: float | None = None) -> torch.Tensor:
    """Triton NSA for all queries (training / prefill, Tq == Tk == Tw); same contract as the reference.

    Differentiable w.r.t. q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win and gates.
    """
    fallback, args, scale, out_dtype = _entry(q, k_cmp, v_cmp, cmp_end, k_slc, v_slc, k_win, v_win, gates, doc_pos,
                                              params, scale)
    if fallback is not None:
        return fallback
    out = _nsa_fwd_op(*args, _params_tuple(params), scale)[0]
    return out if out.dtype == out_dtype else out.to(out_dtype)


@torch.no_grad()
def nsa_decode_triton(q, k_cmp, v_cmp, cmp_end, k_slc, v_slc, k_win, v_win, gates, doc_pos,
                      params: NSAParams, scale: float | None = None, query_end: torch.Tensor | None = None) -> torch.Tensor:
    """Cached decoding step(s): q holds the last Tq (usually 1) of the Tk key positions; k_win/v_win the
    last Tw. Reads only the visible compressed keys, the n selected blocks and the window keys. One query
    per row: the cache's tensors are read in place (views of NSACache's buffers, any batch stride).
    query_end: a static cache's step (one query per row, at key query_end[0] of fixed-size buffers, the
    window a ring; nsa_reference.nsa_attention_reference describes the layout)."""
    single = q.shape[1] == 1
    if query_end is not None and not single:
        raise ValueError(f"nsa_decode_triton: a static cache decodes one token per row per step, got {q.shape[1]}.")
    fallback, args, scale, out_dtype = _entry(q, k_cmp, v_cmp, cmp_end, k_slc, v_slc, k_win, v_win, gates, doc_pos,
                                              params, scale, batch_strided=single, query_end=query_end)
    if fallback is not None:
        return fallback
    if query_end is not None:
        out = _nsa_decode_static_op(*args, query_end, _params_tuple(params), scale)
    elif single:  # the generation step: three launches, no host work but allocation
        out = _decode_step(*args, params, scale)
    else:
        out = _forward_impl(*args, params, scale)[0]
    return out if out.dtype == out_dtype else out.to(out_dtype)


@torch.no_grad()
def select_blocks_triton(q, k_cmp, cmp_end, doc_pos, params: NSAParams, scale: float | None = None) -> torch.Tensor:
    """Top-n selected blocks, (B, Hkv, Tq, n') int64 in-document block indices by priority, -1 unused.

    q (B, Tq, H, D) are the last Tq of doc_pos's Tk positions; the scores come from the compression
    branch's probabilities (recomputed from q, k_cmp and the log-sum-exp).
    """
    head_dim = q.shape[-1]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    unsupported = triton_unsupported_reason(params, head_dim, q.device)
    if unsupported:
        raise ValueError(f"select_blocks_triton: the kernels do not handle {unsupported}; use "
                         f"nsa_reference.select_blocks")
    (q, k_cmp), _ = _kernel_inputs(q, k_cmp)
    q = q.contiguous()
    k_cmp = k_cmp.to(q.dtype).contiguous()
    doc_pos = doc_pos.long().contiguous()
    c_lo, c_hi, _, _ = _layout(cmp_end.long(), doc_pos, q.shape[1], q.shape[1], params)
    _, lse = _interval_fwd(q, k_cmp, k_cmp, c_lo, c_hi, scale)
    return _select_topn(q, k_cmp, lse, doc_pos, c_lo, c_hi, params, scale).long()


__all__ = [
    "MIN_COMPUTE_CAPABILITY",
    "kernel_dtype",
    "nsa_attention_triton",
    "nsa_decode_triton",
    "select_blocks_triton",
    "triton_is_usable",
    "triton_supports",
    "triton_unsupported_reason",
    "triton_unusable_reason",
]
