"""What every NSA kernel file shares: whether the kernels can run here (Triton installed, the GPU's architecture,
the NSA parameters), the GPU's shared memory, and the @triton.jit helpers of more than one branch (the online
softmax, the packing of (query x head) rows, the flash-attention dK/dV update, the gated sum of Eq. 5).
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import torch

from .nsa_layout import NSAParams


try:  # the module must import where triton is missing (CPU-only installs, macOS)
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - exercised only without triton
    triton = tl = None
_HAS_TRITON = triton is not None


if _HAS_TRITON:
    # The dK/dV kernels fold a branch's gate g into its log-sum-exp (_bwd_rows), so their dV dot's operand is g P,
    # not P. fp16's smallest normal is 6.1e-5: where g is small (g < ~0.03 over a 512-key window) g P falls below
    # it and the dV lost precision that a gated attention rounding P and g dout apart keeps (with g ~ 5e-5, dV's
    # error was 13x the reference's in fp16). In fp16 the operand is g P times 2^15 (a power of two: exact; g P
    # <= 1 keeps it below fp16's largest, 65,504) and the kernel's dV is scaled back before its store. bf16 has
    # fp32's exponent range and takes no scale.
    FP16_DV_SCALE = tl.constexpr(32768.0)

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
    def _bwd_rows(Q, DOUT, LSE_G, DELTA, row, row_ok, d, D: tl.constexpr):
        """A query tile's rows for a branch's dK/dV update with its gate g folded into the log-sum-exp: q, dout as
        given, lse_g = lse - log2 g and delta = rowsum(dout * o) (both written by the dQ kernels' _branch_prep).
        With them _dkdv_update's p = exp2(s - lse_g) is g times the branch's probabilities, and its dV, dP and dS
        are those of the branch's output gradient g dout: g scales each row's probabilities, not its dout. So the
        dots take dout from the loop's pipelined shared-memory buffer, and Triton keeps the dV dot in flight, which
        it cannot do for an operand re-stored to shared memory every tile (bench/KERNELS.md, "gate folded")."""
        q = tl.load(Q + row[:, None] * D + d[None, :], mask=row_ok[:, None], other=0.0)
        dout = tl.load(DOUT + row[:, None] * D + d[None, :], mask=row_ok[:, None], other=0.0)
        lse_g = tl.load(LSE_G + row, mask=row_ok, other=0.0)
        delta = tl.load(DELTA + row, mask=row_ok, other=0.0)
        return q, dout, lse_g, delta

    # The fp32 dQ of the pair-wise selected dQ modes: (R, D) rows of flat (batch, query, head) index. DQ_HALF == D:
    # one buffer DQ. DQ_HALF < D: laid over the two interval branches' saved outputs, dead by then
    # (nsa_triton._nsa_bwd_reusing_op): each row's first DQ_HALF columns in DQ (R, DQ_HALF), the rest in DQ_HI, so
    # that fp32 row r lies in the bytes of the bf16/fp16 output rows r, which only the program that owns row r
    # reads. Each half goes through a pointer of its own, contiguous along the row, with the other half's columns
    # masked off: a pointer chosen per column (tl.where) made the selected dK/dV's atomics scalar (32 instead of 8
    # vector ones per tile on sm_90) and spilled its main pass; the two masked halves keep them 4-wide.
    @triton.jit
    def _dq_halves(DQ, DQ_HI, rows, d, DQ_HALF: tl.constexpr, row_ok):
        """DQ_HALF < D: the two halves' addresses (rows, D), each contiguous along the row, and their masks."""
        col = rows[:, None] * DQ_HALF + d[None, :] % DQ_HALF
        return (DQ + col, DQ_HI + col, row_ok[:, None] & (d < DQ_HALF)[None, :],
                row_ok[:, None] & (d >= DQ_HALF)[None, :])

    @triton.jit
    def _dq_store(DQ, DQ_HI, rows, d, D: tl.constexpr, DQ_HALF: tl.constexpr, value, row_ok):
        """Store value (rows, D) at those rows of the fp32 dQ (DQ, DQ_HI, DQ_HALF)."""
        if DQ_HALF == D:
            tl.store(DQ + rows[:, None] * D + d[None, :], value, mask=row_ok[:, None])
        else:
            lo, hi, lo_ok, hi_ok = _dq_halves(DQ, DQ_HI, rows, d, DQ_HALF, row_ok)
            tl.store(lo, value, mask=lo_ok)
            tl.store(hi, value, mask=hi_ok)

    @triton.jit
    def _dq_add(DQ, DQ_HI, rows, d, D: tl.constexpr, DQ_HALF: tl.constexpr, value, row_ok):
        """Add value (rows, D) to those rows of the fp32 dQ with atomics."""
        if DQ_HALF == D:
            tl.atomic_add(DQ + rows[:, None] * D + d[None, :], value, mask=row_ok[:, None], sem="relaxed")
        else:
            lo, hi, lo_ok, hi_ok = _dq_halves(DQ, DQ_HI, rows, d, DQ_HALF, row_ok)
            tl.atomic_add(lo, value, mask=lo_ok, sem="relaxed")
            tl.atomic_add(hi, value, mask=hi_ok, sem="relaxed")

    @triton.jit
    def _dq_load(DQ, DQ_HI, rows, d, D: tl.constexpr, DQ_HALF: tl.constexpr, row_ok):
        """Those rows of the fp32 dQ, (rows, D) (0 off row_ok)."""
        if DQ_HALF == D:
            return tl.load(DQ + rows[:, None] * D + d[None, :], mask=row_ok[:, None], other=0.0)
        lo, hi, lo_ok, hi_ok = _dq_halves(DQ, DQ_HI, rows, d, DQ_HALF, row_ok)
        return tl.load(lo, mask=lo_ok, other=0.0) + tl.load(hi, mask=hi_ok, other=0.0)

    @triton.jit
    def _dv_operand(p_t, do):
        """P^T (keys, rows) as the dV dot's operand in dout's dtype; in fp16 times FP16_DV_SCALE (see there), which
        _dv_unscaled takes back before the dV store. Resolved when the kernel is compiled: no branch in the loop."""
        if do.dtype == tl.float16:
            return (p_t * FP16_DV_SCALE).to(do.dtype)
        return p_t.to(do.dtype)

    @triton.jit
    def _dkdv_update_ds(q, do, lse, delta, k, v, vis_t, sm_scale2, dk, dv):
        """One query tile's share of a key tile's dK (unscaled) and dV: the flash-attention backward with
        the probabilities recomputed from the saved log-sum-exp; vis_t (keys, rows) says which row sees which
        key. Computed key-major (S^T = K Q^T), so P^T and dS^T come out of their dots in the layout the dV and
        dK dots take them in (no transpose through shared memory) and the keys, not the query rows, are the
        dots' M dimension. Returns (dk, dv, dS^T (keys, rows) in q's dtype: the rows' dQ share is dS K)."""
        s_t = tl.dot(k, tl.trans(q)) * sm_scale2  # (keys, rows)
        p_t = tl.where(vis_t, tl.exp2(s_t - lse[None, :]), 0.0)
        dv += tl.dot(_dv_operand(p_t, do), do)
        dp_t = tl.dot(v, tl.trans(do))
        ds_t = (p_t * (dp_t - delta[None, :])).to(q.dtype)
        dk += tl.dot(ds_t, q)
        return dk, dv, ds_t

    @triton.jit
    def _dv_unscaled(dv, DO):
        """A dK/dV kernel's fp32 dV accumulator as the gradient: _dkdv_update_ds scales the dV dot's operand by
        FP16_DV_SCALE where dout (DO's element type) is fp16."""
        if DO.dtype.element_ty == tl.float16:
            return dv * (1.0 / FP16_DV_SCALE)
        return dv

    @triton.jit
    def _dkdv_update(q, do, lse, delta, k, v, vis_t, sm_scale2, dk, dv):
        """_dkdv_update_ds without dS^T."""
        dk, dv, _ = _dkdv_update_ds(q, do, lse, delta, k, v, vis_t, sm_scale2, dk, dv)
        return dk, dv

    @triton.jit
    def _query_tile_id(LIGHT_FIRST: tl.constexpr):
        """This program's query tile (grid axis 0). A row's last tiles see the most keys and choose among the most
        blocks, so they take the lowest program ids, which start first, and the launch ends on a row's first,
        shortest tiles instead of its longest (bench/schedule_model.py, query_tiles). LIGHT_FIRST: tile i on
        program i, the order timed until 2026-11-27."""
        if LIGHT_FIRST:
            return tl.program_id(0)
        return tl.num_programs(0) - 1 - tl.program_id(0)

    @triton.jit
    def _head_rows(b, g, qi, hh, Tq, H: tl.constexpr, G: tl.constexpr, ROW32: tl.constexpr):
        """(base, rows) of query qi's head g * G + hh in batch b's (Tq, H) rows, base + rows the flat row: with
        ROW32 (_rows_fit_int32) base is the batch and kv group's first row (int64, once) and rows are int32 within
        it, which takes 8-14% off the dK/dV kernels' unmasked tiles on sm_90 against flat int64 rows (base 0)."""
        if ROW32:
            base = b * Tq * H + g * G
            rows = qi * H + hh
        else:
            base = b * 0
            rows = (b * Tq + qi) * H + g * G + hh
        return base, rows

    @triton.jit
    def _kv_offsets(kk, HKV: tl.constexpr, D: tl.constexpr, KV32: tl.constexpr):
        """(keys, D) element offsets of keys kk (int32) within a row's (T, HKV, D) K or V, whose base (batch and kv
        head) the caller adds once as a scalar: int32 where KV32 (_kv_offsets_fit_int32), which takes a few SASS
        instructions off each address of the union walk and the interval tiles against int64, else int64."""
        if KV32:
            rows = kk
        else:
            rows = kk.to(tl.int64)
        return rows[:, None] * (HKV * D) + tl.arange(0, D)[None, :]

    @triton.jit
    def _tile_rows(pid_q, Tq, r0, G: tl.constexpr, QPB: tl.constexpr, ROWS: tl.constexpr):
        """Rows r0 .. r0+ROWS-1 of query tile pid_q, packed query-major (QPB queries x G heads): (r, query qi,
        row_ok); rows past the tile or past Tq get qi = 0 and row_ok = False."""
        r = r0 + tl.arange(0, ROWS)
        qi = pid_q * QPB + r // G
        row_ok = (r < QPB * G) & (qi < Tq)
        return r, tl.where(row_ok, qi, 0), row_ok

    @triton.jit
    def _max_combine(a, b):
        """tl.associative_scan's combine for running maxima."""
        return tl.maximum(a, b)

    @triton.jit
    def _min_combine(a, b):
        """tl.associative_scan's combine for running minima."""
        return tl.minimum(a, b)

    @triton.jit
    def _softmax_init(ROWS: tl.constexpr, D: tl.constexpr):
        """Online-softmax state of ROWS rows: running max, running sum, unnormalized output."""
        return tl.full([ROWS], float("-inf"), tl.float32), tl.zeros([ROWS], tl.float32), tl.zeros([ROWS, D], tl.float32)

    @triton.jit
    def _softmax_tile(s, scale2, v, m_i, l_i, acc):
        """Online-softmax update with one key tile: s (M, N) the raw q.k dots, -inf where not visible; scale2 > 0 the
        softmax scale times log2(e), so the state (m_i, and the log-sum-exp made from it) is in base-2 logits.
        The scale is applied inside the exponent (one fused multiply-add per element, s * scale2 - m) and to the
        row maxima, not to the tile before them: the selected and interval loops' time follows their instruction
        count (latency-bound chains), and a multiply per element was 32 of a step's ~600 instructions
        (bench/KERNELS.md)."""
        m_new = tl.maximum(m_i, tl.max(s, 1) * scale2)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s * scale2 - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        return m_new, l_i, acc


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
        if _interpreting():
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


def on_the_inputs_device(launcher):
    """Run `launcher` with the CUDA device of its first tensor argument current: Triton launches on the current
    device, while a model split over GPUs (device_map) runs each layer on its inputs' own GPU (launched on another,
    the kernels would read addresses that are not there)."""

    @functools.wraps(launcher)
    def on_device(*args, **kwargs):
        tensor = next((a for a in args if isinstance(a, torch.Tensor)), None)
        if tensor is None or not tensor.is_cuda:
            return launcher(*args, **kwargs)
        with torch.cuda.device(tensor.device):
            return launcher(*args, **kwargs)

    return on_device


def _settle_jit_cache_keys(modules) -> None:
    """Compute the Triton cache key of every @triton.jit function of `modules`, each after those it calls.

    Triton before 3.9 (JITFunction.cache_key, DependenciesFinder._update_hash) folds into a function's key the
    constexpr globals its callees use (FP16_DV_SCALE, the top-n's key constants) only for the callees whose own key
    was computed before: which kernel launched first in a process decided other kernels' keys, so a kernel compiled
    by one process was not found in Triton's on-disk cache by another that launched in another order (a training run
    after a generate() call, the pytest workers of a GPU session, bench/warm_kernel_cache.py's compile processes:
    15% of its kernels compiled again; bench/KERNELS.md). Computed callees first, each key holds all of them, in
    every process. Triton 3.9 computes the callee's key first itself: there this only computes the keys early
    (~0.1 s, once per process)."""
    if not _HAS_TRITON or _interpreting():
        return
    import ast

    from triton.runtime.jit import JITFunction

    settled: dict[int, JITFunction] = {}

    def settle(fn):
        if id(fn) in settled:
            return
        settled[id(fn)] = fn
        try:
            names = [node.id for node in ast.walk(fn.parse()) if isinstance(node, ast.Name)]
        except Exception:  # pragma: no cover - a triton whose JIT internals differ: its keys come at launch
            names = []
        for name in names:
            callee = fn.__globals__.get(name)
            if isinstance(callee, JITFunction):
                settle(callee)
        try:
            fn.cache_key  # noqa: B018  (a property: computes and keeps the key)
        except Exception:  # raised again at the kernel's launch, with its name, as before (below)
            pass

    for module in modules:
        for value in list(vars(module).values()):
            if isinstance(value, JITFunction):
                settle(value)
    # A key whose computation raised keeps Triton's placeholder ("recursion:<name>", set before it computes), and
    # every key computed after it over that callee holds the placeholder instead of its source: then put every
    # function back as unhashed, so each launch computes its key as before and the failing one raises there
    if any(str(getattr(fn, "hash", None)).startswith("recursion:") for fn in settled.values()):
        for fn in settled.values():  # pragma: no cover - a kernel whose key cannot be computed
            fn.hash, fn.used_global_vals = None, {}


def _interpreting() -> bool:
    """Whether the kernels run in Triton's interpreter (TRITON_INTERPRET=1: on CPU, in numpy)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


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


def _launch_shapes(q: torch.Tensor, k: torch.Tensor) -> tuple[int, int, int, int, int, int, int]:
    """A launcher's sizes from q (B, Tq, H, D) and one branch's keys k (B, Tk, Hkv, D): (batch, queries, heads,
    head_dim, keys, KV heads, group G = heads per KV head)."""
    batch, num_q, num_heads, head_dim = q.shape
    num_keys, num_kv = k.shape[1], k.shape[2]
    return batch, num_q, num_heads, head_dim, num_keys, num_kv, num_heads // num_kv


class _FloatDq(NamedTuple):
    """The backward's fp32 dQ (B, Tq, H, D) while the selected branch's share is added to it pair by pair (the
    pair-wise dQ modes, nsa_triton_launch._sel_dq_mode): its (B*Tq*H) rows' first `half` columns in `lo` and the
    rest in `hi`, each (B*Tq*H, half) (the kernels' DQ, DQ_HI, DQ_HALF: _dq_store). half == D: one buffer (lo is
    hi)."""

    lo: torch.Tensor
    hi: torch.Tensor
    half: int

    @classmethod
    def new(cls, q: torch.Tensor) -> "_FloatDq":
        """A buffer of its own: B*Tq*H*D floats (192 MiB at 64k tokens x 12 heads x 64)."""
        rows = torch.empty(q.numel() // q.shape[-1], q.shape[-1], device=q.device, dtype=torch.float32)
        return cls(rows, rows, q.shape[-1])

    @classmethod
    def over(cls, o_cmp: torch.Tensor, o_win: torch.Tensor) -> "_FloatDq":
        """Laid over the storage of the two interval branches' saved outputs (contiguous (B, Tq, H, D), q's
        dtype), which the backward has read by the time it writes dQ: with 2-byte outputs each fp32 row r takes
        o_cmp's row r (its first D/2 columns) and o_win's row r (the rest), so dQ needs no memory of its own;
        with 4-byte outputs o_cmp alone holds it."""
        head_dim = o_cmp.shape[-1]
        half = head_dim * o_cmp.element_size() // 4
        lo = o_cmp.view(torch.float32).view(-1, half)
        return cls(lo, o_win.view(torch.float32).view(-1, half) if half < head_dim else lo, half)

    @staticmethod
    def fits_over(o_cmp: torch.Tensor, o_win: torch.Tensor) -> bool:
        """Whether `over` applies: both contiguous from their storage's start, with the same shape and dtype, whose
        rows hold a whole number of floats. (Their storages are two: outputs of one custom op may not alias, which
        torch.library enforces; and data pointers are not read here, since under torch.compile these are fake.)"""
        return (o_cmp.is_contiguous() and o_win.is_contiguous() and o_cmp.shape == o_win.shape
                and o_cmp.dtype == o_win.dtype and o_cmp.element_size() in (2, 4)
                and o_cmp.storage_offset() == 0 == o_win.storage_offset()
                and (o_cmp.shape[-1] * o_cmp.element_size()) % 4 == 0)

    def rounded(self, like: torch.Tensor) -> torch.Tensor:
        """dQ in like's dtype and shape: a new tensor (never the buffer, which may be an op's input)."""
        out = torch.empty_like(like)
        rows = out.view(-1, like.shape[-1])
        rows[:, : self.half].copy_(self.lo)  # (rounded as they are copied: no fp32 temporary)
        if self.half < like.shape[-1]:
            rows[:, self.half:].copy_(self.hi)
        return out


def _cdiv(a: int, b: int) -> int:
    """Ceiling division of host integers (triton.cdiv goes through Triton's JIT machinery: about 2 us a call,
    which the cached decode step pays three times per token)."""
    return -(-a // b)


MAX_SEL_BLOCK_SIZE = 128  # the largest l' whose launches are compiled and fit (tests/triton_aot.py, KERNELS.md)
# l' x head_dim past which a block's tiles need more than the 99 KiB of shared memory of RTX 30xx/40xx, A10, L4
# (the eager decode step's finish kernel at l' = 128, head_dim 128: 136 KiB)
_SMALL_SHARED_MEMORY_BLOCK = 64 * 128


def triton_unsupported_reason(params: NSAParams, head_dim: int, device=None) -> str | None:
    """Why the kernels do not handle these parameters (None: they do). They need head_dim a power of two in
    [16, 256], l' a power of two in [16, 128] (a selection block is one tl.dot operand; larger blocks outgrow the
    launches' registers and shared memory), l'/d a power of two, l a multiple of d and l <= l' (a compressed
    token overlaps at most two selection blocks); head_dim 256, and l' x head_dim above 64 x 128, also need 160 KiB
    of shared memory per block (A100, H100; not the 99 KiB of RTX 30xx/40xx, A10, L4)."""
    lb, ds = params.sel_block_size, params.cmp_stride
    pow2 = lambda x: x > 0 and (x & (x - 1)) == 0  # noqa: E731
    if not (pow2(head_dim) and 16 <= head_dim <= 256):
        return f"head_dim={head_dim} (the kernels take a power of two in [16, 256])"
    if not (pow2(lb) and 16 <= lb <= MAX_SEL_BLOCK_SIZE):
        return f"sel_block_size={lb} (the kernels take a power of two in [16, {MAX_SEL_BLOCK_SIZE}])"
    if not (lb % ds == 0 and pow2(lb // ds)):
        return f"sel_block_size / cmp_stride = {lb} / {ds} (the kernels take a power of two)"
    if not (params.cmp_block_size % ds == 0 and params.cmp_block_size <= lb):
        return (f"cmp_block_size={params.cmp_block_size} (the kernels take a multiple of cmp_stride={ds} "
                f"no larger than sel_block_size={lb})")
    if device is not None and head_dim > 128 and _shared_memory_limit(device) < _LARGE_SHARED_MEMORY:
        return (f"head_dim={head_dim} needs {_LARGE_SHARED_MEMORY // 1024} KiB of shared memory per block; this "
                f"GPU has {_shared_memory_limit(device) // 1024} KiB (head_dim <= 128 runs on it)")
    if device is not None and lb * head_dim > _SMALL_SHARED_MEMORY_BLOCK and \
            _shared_memory_limit(device) < _LARGE_SHARED_MEMORY:
        return (f"sel_block_size={lb} at head_dim={head_dim}: needs {_LARGE_SHARED_MEMORY // 1024} KiB of shared "
                f"memory per block; this GPU has {_shared_memory_limit(device) // 1024} KiB (sel_block_size x "
                f"head_dim <= {_SMALL_SHARED_MEMORY_BLOCK} runs on it)")
    return None


def triton_supports(params: NSAParams, head_dim: int, device=None) -> bool:
    """The kernels handle these parameters (on `device`, when given): see triton_unsupported_reason."""
    return triton_unsupported_reason(params, head_dim, device) is None


def _compute_capability(device) -> int:
    """sm version (90 for H100, 80 for A100) of a CUDA device; 90 elsewhere (interpreter). tests/triton_aot.py
    replaces this to record the launches each architecture gets."""
    if torch.device(device).type != "cuda":
        return 90
    major, minor = torch.cuda.get_device_capability(device)
    return 10 * major + minor


def _is_sm90(device) -> bool:
    """An H100/H200 (sm_90): for the launch choices timed there alone (the register caps)."""
    return _compute_capability(device) == 90


def _hopper_class(device) -> bool:
    """Hopper (sm_90, wgmma) and datacenter Blackwell (sm_100/103, tcgen05) multiply 64- or 128-row tiles from
    shared memory and hold 227 KiB of it per block: they take the wide-tile launch choices below. Ampere and
    Ada (sm_80-89) and consumer Blackwell (sm_120: mma.sync, 99 KiB) hold accumulators in registers: the
    smaller tiles (at sm_120 the wide choices spill 500-1000 bytes per thread: tests/triton_aot.py)."""
    return 90 <= _compute_capability(device) < 120


def _has_programmatic_dependent_launch(device) -> bool:
    """Where a launch's programs may be placed on the SMs while the launch before it in the stream still runs,
    waiting there (griddepcontrol, sm_90 and later): Hopper and datacenter Blackwell (sm_90-103). Not consumer
    Blackwell (sm_120) until tried there (CUDA-graph capture of such launches has been reported to fail on it), nor
    in the interpreter, which runs programs one at a time."""
    return 90 <= _compute_capability(device) < 120 and not _interpreting()


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


# log2(e): the kernels exponentiate with exp2, so every launcher passes them scale * _LOG2E
_LOG2E = 1.4426950408889634
_GRID_AXIS_MAX = 65535  # CUDA's limit on a launch grid's y and z sizes

# Every launch asks for FMA contraction (a * b + c as one fused instruction), Triton's default so far and what each
# kernel here was sized, timed and checked with (the SASS instruction counts of bench/KERNELS.md, the registers and
# spills of tests/triton_aot.py): Triton 3.10 turns the default off (3.9 warns at the first compile that it will),
# which would change the kernels' speed and rounding with no line of this project changed.
_FP_FUSION = {"enable_fp_fusion": True}
