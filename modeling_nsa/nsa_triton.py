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
  which also writes the gate gradients and, per branch, what the dK/dV kernels read instead of the gate:
  delta = dout . o and the log-sum-exp with the gate folded in (lse - log2 g), so g scales the
  recomputed probabilities, not dout, and the dK/dV dots take dout straight from their pipelined loads.
- Decoding (one query per row), none of the launches with a serial loop over the whole context: the
  compressed keys split over programs (softmax partials and probabilities); the selection blocks split
  over programs, each scoring its range from those probabilities (no key re-read) and keeping its own
  top-n list; then one program per (row, KV group) merges the partials and the lists and runs the
  selected and window branches and the gates (three launches: eager decoding is host-bound). A static
  cache's step (CUDA-graphed) runs that last part as parts side by side (a few selected blocks, a span of
  the window, the compressed merge) and a combine kernel (four launches, a short chain on the GPU).

Files: each branch's kernels and launchers in its own sibling (nsa_triton_interval, _topn, _selected, _dq,
_decode), the shared @triton.jit helpers and the support checks in nsa_triton_common, every launch choice in
nsa_triton_launch. This file wraps them in torch.library custom ops (forward, backward, a static cache's
decoding step) with fake implementations and autograd, without host synchronization, so
torch.compile(fullgraph=True) works, and holds the public entry points, which raise on inputs the kernels do
not handle (nsa_backend.nsa_attention decides where the reference runs instead).
Tile sizes and warps are chosen per architecture with tests/triton_aot.py, which compiles every
launch for sm_90, sm_80 and sm_86 on a CPU machine and reports registers, spills and shared memory.
"""

from __future__ import annotations

import math

import torch

from .nsa_backend import _log_once
from .nsa_layout import NSAParams
from .nsa_triton_common import (  # noqa: F401  (_HAS_TRITON: callers ask this module whether triton imported)
    _GRID_AXIS_MAX,
    _HAS_TRITON,
    MIN_COMPUTE_CAPABILITY,
    _FloatDq,
    _interpreting,
    on_the_inputs_device,
    triton_is_usable,
    triton_supports,
    triton_unsupported_reason,
    triton_unusable_reason,
)
from .nsa_triton_decode import _decode_step
from .nsa_triton_dq import _bwd_dq, _sel_dq_reduce_chunk
from .nsa_triton_interval import _DKDV_KEY_TILE, _interval_bwd_dkdv, _interval_fwd, _interval_query_ranges, _layout
from .nsa_triton_launch import LaunchOverrides, _sel_dq_mode, launch_overrides
from .nsa_triton_selected import _sel_bwd_dkdv, _sel_dq_pairs, _sel_fwd
from .nsa_triton_topn import _select_topn

from . import (nsa_triton_common, nsa_triton_decode, nsa_triton_dq, nsa_triton_interval,  # noqa: E402, I001
               nsa_triton_selected, nsa_triton_topn)

# every kernel's Triton cache key the same in every process, whatever launches first (see the function)
nsa_triton_common._settle_jit_cache_keys((nsa_triton_common, nsa_triton_interval, nsa_triton_topn,
                                          nsa_triton_selected, nsa_triton_dq, nsa_triton_decode))


@on_the_inputs_device
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


@on_the_inputs_device
def _backward_impl(dout, q, k_cmp, v_cmp, cmp_end, k_slc, v_slc, k_win, v_win, gates, doc_pos, o_cmp, o_slc, o_win,
                   lse_cmp, lse_slc, lse_win, idx, params, scale, dq_over_outputs: bool):
    p = _params_from(params)
    intervals = _layout(cmp_end, doc_pos, q.shape[1], k_win.shape[1], p)
    c_lo, c_hi, w_lo, w_hi = intervals
    dout = dout.to(q.dtype).contiguous()
    # dQ of the three branches, dgates and the per-branch deltas and gated log-sum-exps in one kernel; the dK/dV
    # kernels then read those two. The selected branch's dQ (_sel_dq_mode): in that kernel over each query tile's
    # block union ("union"), or formed pair by pair: by a block-outer kernel of its own ("pairs", after the dK/dV
    # kernels), or by the selected dK/dV kernel, which adds them to an fp32 dQ with atomics ("atomic"); in those
    # two dQ is first the fp32 of the interval branches (a _FloatDq: with dq_over_outputs in o_cmp's and o_win's
    # storage, which no kernel reads after _bwd_dq).
    cmp, win = (k_cmp, v_cmp, c_lo, c_hi, lse_cmp, o_cmp), (k_win, v_win, w_lo, w_hi, lse_win, o_win)
    sel_dq_mode = _sel_dq_mode()
    dq, dgates, delta, lse_g = _bwd_dq(q, dout, gates, cmp, (k_slc, v_slc, lse_slc, o_slc), win, idx, doc_pos, p,
                                       scale, sel_dq=sel_dq_mode == "union", dq_over_outputs=dq_over_outputs)
    # the dK/dV kernels' query ranges per key tile, both interval branches in two launches
    cmp_ranges, win_ranges = _interval_query_ranges(intervals, (k_cmp.shape[1], k_win.shape[1]), _DKDV_KEY_TILE)
    dk_cmp, dv_cmp = _interval_bwd_dkdv(q, k_cmp, v_cmp, c_lo, c_hi, cmp_ranges, dout, lse_g[0], delta[0], scale)
    dk_slc, dv_slc = _sel_bwd_dkdv(q, k_slc, v_slc, idx, doc_pos, dout, lse_g[1], delta[1], p, scale,
                                   dq_accum=dq if sel_dq_mode == "atomic" else None)
    dk_win, dv_win = _interval_bwd_dkdv(q, k_win, v_win, w_lo, w_hi, win_ranges, dout, lse_g[2], delta[2], scale)
    if sel_dq_mode == "pairs":
        dq = _sel_dq_pairs(q, k_slc, v_slc, idx, doc_pos, dout, lse_g[1], delta[1], dq, p, scale,
                           _sel_dq_reduce_chunk)
    dq = dq.rounded(q) if isinstance(dq, _FloatDq) else dq
    return dq, dk_cmp, dv_cmp, dk_slc, dv_slc, dk_win, dv_win, dgates


def _bwd_fake(dout, q, k_cmp, v_cmp, cmp_end, k_slc, v_slc, k_win, v_win, gates, doc_pos, o_cmp, o_slc, o_win,
              lse_cmp, lse_slc, lse_win, idx, params, scale):
    return (
        torch.empty_like(q), torch.empty_like(k_cmp), torch.empty_like(v_cmp), torch.empty_like(k_slc),
        torch.empty_like(v_slc), torch.empty_like(k_win), torch.empty_like(v_win), torch.empty_like(gates),
    )


def _backward_custom_op(name: str, dq_over_outputs: bool):
    """The backward as a custom op (one schema for both): with dq_over_outputs, the backward of the pair-wise
    selected dQ modes, whose fp32 dQ (B*Tq*H*D floats, which the default's union walk never needs: 192 MiB at 64k
    tokens x 12 heads x 64, above dense SDPA's peak, bench/KERNELS.md) is kept in the storage of the saved o_cmp and
    o_win, which it overwrites once _bwd_dq has read them. That is declared as a mutation (their version counters
    move; torch.compile functionalizes it, and there, since the two are inputs of the compiled backward, keeps
    copies: the memory saved is eager mode's); _backward refuses a second backward through the same graph
    (retain_graph=True) instead of reading the overwritten outputs."""

    def backward(
        dout: torch.Tensor, q: torch.Tensor, k_cmp: torch.Tensor, v_cmp: torch.Tensor, cmp_end: torch.Tensor,
        k_slc: torch.Tensor, v_slc: torch.Tensor, k_win: torch.Tensor, v_win: torch.Tensor,
        gates: torch.Tensor, doc_pos: torch.Tensor, o_cmp: torch.Tensor, o_slc: torch.Tensor, o_win: torch.Tensor,
        lse_cmp: torch.Tensor, lse_slc: torch.Tensor, lse_win: torch.Tensor, idx: torch.Tensor,
        params: list[int], scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
               torch.Tensor]:
        return _backward_impl(dout, q, k_cmp, v_cmp, cmp_end, k_slc, v_slc, k_win, v_win, gates, doc_pos, o_cmp,
                              o_slc, o_win, lse_cmp, lse_slc, lse_win, idx, params, scale, dq_over_outputs)

    op = torch.library.custom_op(f"{_NS}::{name}", mutates_args=("o_cmp", "o_win") if dq_over_outputs else ())(
        backward)
    op.register_fake(_bwd_fake)
    return op


_nsa_bwd_op = _backward_custom_op("bwd", dq_over_outputs=False)
_nsa_bwd_reusing_op = _backward_custom_op("bwd_reusing_outputs", dq_over_outputs=True)


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


def _backward_op(o_cmp: torch.Tensor, o_win: torch.Tensor):
    """The backward op under the present launch overrides: the pair-wise selected dQ modes need an fp32 dQ, laid
    over the saved interval outputs, which are dead after _bwd_dq (_nsa_bwd_reusing_op); the default's union walk
    needs none."""
    if _sel_dq_mode() != "union" and _FloatDq.fits_over(o_cmp, o_win):
        return _nsa_bwd_reusing_op
    return _nsa_bwd_op


def _backward(ctx, dout, *unused):
    if dout is None:  # the gated output is not part of the loss
        return (None,) * 12
    if getattr(ctx, "outputs_overwritten", False):
        raise RuntimeError(
            "nsa_triton: a second backward through the same graph (retain_graph=True) after a backward with the "
            "pair-wise selected dQ (launch_overrides(sel_dq_in_dkdv=True) or sel_dq_pairs), which "
            "keeps its fp32 dQ in the saved branch outputs; backpropagate such graphs with the default dQ (no "
            "override) or run the forward again")
    saved = ctx.saved_tensors
    backward_op = _backward_op(o_cmp=saved[10], o_win=saved[12])
    grads = backward_op(dout, *saved, ctx.params, ctx.scale)
    ctx.outputs_overwritten = backward_op is _nsa_bwd_reusing_op
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
    CPU the inputs' own (the CPU tests run float32 exactly), except bfloat16, computed in float32 there: the
    interpreter multiplies bfloat16 tl.dot operands as their raw bits (triton-lang/triton#11584)."""
    if torch.device(device).type != "cuda":  # (a CPU launch captured for an ahead-of-time compile keeps bfloat16)
        return torch.float32 if dtype == torch.bfloat16 and _interpreting() else dtype
    if dtype in (torch.bfloat16, torch.float16):
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
        if q.device.type == "cuda":
            _log_once(f"nsa_triton: {dtype} inputs on a GPU: the kernels compute in {compute} with float32 "
                      f"accumulation and return {dtype} (nsa_backend='reference' computes in {dtype}; "
                      f"model.to({compute}) or torch.autocast skips the casts)")
        else:
            _log_once(f"nsa_triton: {dtype} inputs under Triton's interpreter compute in {compute} (its tl.dot "
                      f"multiplies {dtype} as raw bits) and return {dtype}")
    # (a no-op .to() still costs about a microsecond of dispatch: the decode step pays it per layer and token)
    return tuple(t.to(compute) if t.is_floating_point() and t.dtype != compute else t for t in tensors), dtype


def _require_support(caller: str, instead: str, params: NSAParams, head_dim: int, device) -> None:
    """Raise, naming what and what to use instead, where the kernels do not handle these parameters on device."""
    unsupported = triton_unsupported_reason(params, head_dim, device)
    if unsupported:
        raise ValueError(f"{caller}: the Triton kernels do not handle {unsupported}; use {instead}")


_USE_NSA_ATTENTION = ("nsa_backend.nsa_attention(..., backend='auto') (the PyTorch reference where the kernels "
                      "do not apply) or nsa_reference.nsa_attention_reference")




def _check_shapes(q, k_cmp, v_cmp, cmp_end, k_slc, v_slc, k_win, v_win, gates, doc_pos) -> None:
    """The shapes the kernels index by (NSA_SPEC's), each checked against q's and the cache's sizes: a mismatch
    would make them read out of bounds (wrong output, a fault or a hang), where the reference raises. Shapes are
    static: free under torch.compile."""
    if q.dim() != 4:
        raise ValueError(f"nsa_triton: q must be (B, Tq, H, D), got shape {tuple(q.shape)}.")
    batch, num_queries, num_heads, head_dim = q.shape
    num_kv, num_keys, num_slots = k_slc.shape[2] if k_slc.dim() == 4 else -1, k_slc.shape[1], cmp_end.shape[-1]
    keys, window, compressed = (batch, num_keys, num_kv, head_dim), (batch, k_win.shape[1], num_kv, head_dim), \
        (batch, num_slots, num_kv, head_dim)
    for name, tensor, shape in (("k_slc", k_slc, keys), ("v_slc", v_slc, keys), ("k_win", k_win, window),
                                ("v_win", v_win, window), ("k_cmp", k_cmp, compressed), ("v_cmp", v_cmp, compressed),
                                ("cmp_end", cmp_end, (batch, num_slots)), ("doc_pos", doc_pos, (batch, num_keys)),
                                ("gates", gates, (batch, num_queries, num_heads, 3))):  # fmt: skip
        if tensor.shape != shape:
            raise ValueError(f"nsa_triton: {name} has shape {tuple(tensor.shape)}; with q {tuple(q.shape)}, "
                             f"k_slc {tuple(k_slc.shape)} and cmp_end {tuple(cmp_end.shape)} it must be {shape}.")
    if num_kv < 1 or num_heads % num_kv:
        raise ValueError(f"nsa_triton: {num_heads} query heads do not share {num_kv} K/V heads evenly; give a "
                         "number of query heads that is a multiple of the K/V heads.")
    _check_grid_rows(batch, num_kv)


def _check_grid_rows(batch: int, num_kv: int) -> None:
    if batch * num_kv > _GRID_AXIS_MAX:  # the training kernels launch one program row per (row, K/V head)
        raise ValueError(f"nsa_triton: batch {batch} x {num_kv} K/V heads = {batch * num_kv} program rows, more than "
                         f"the {_GRID_AXIS_MAX:,} a CUDA launch grid's second axis holds; run the batch in parts of at "
                         f"most {_GRID_AXIS_MAX // num_kv} rows.")


def _kernel_args(q, k_cmp, v_cmp, cmp_end, k_slc, v_slc, k_win, v_win, gates, doc_pos, scale, batch_strided=False):
    """What both attention entry points do first: (the kernels' prepared inputs, the softmax scale, the dtype to
    return the output in)."""
    _check_shapes(q, k_cmp, v_cmp, cmp_end, k_slc, v_slc, k_win, v_win, gates, doc_pos)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    floats, out_dtype = _kernel_inputs(q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, gates)
    q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, gates = floats
    inputs = _prepare(q, k_cmp, v_cmp, cmp_end, k_slc, v_slc, k_win, v_win, gates, doc_pos, batch_strided)
    return inputs, scale, out_dtype


def nsa_attention_triton(q, k_cmp, v_cmp, cmp_end, k_slc, v_slc, k_win, v_win, gates, doc_pos,
                         params: NSAParams, scale: float | None = None, *, checked: bool = False) -> torch.Tensor:
    """Triton NSA for all queries (training / prefill, Tq == Tk == Tw); same contract as the reference.

    Differentiable w.r.t. q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win and gates. Raises ValueError for
    parameters the kernels do not handle on q's device (triton_unsupported_reason); checked=True: the caller
    has asked already (nsa_backend.nsa_attention, which runs the reference there under 'auto').
    gates must lie in [0, 1], as Eq. 5's sigmoid gates (the model's) do: the backward folds each into the
    log-sum-exp as log2 g, and in fp16 its dV operand g P carries a 2^15 scale (nsa_triton_common.FP16_DV_SCALE)
    that a gate above 1 could take past fp16's largest value. (Not checked: that would read the gates on the host.)
    """
    num_queries, num_keys, num_win = q.shape[1], k_slc.shape[1], k_win.shape[1]
    if not num_queries == num_keys == num_win:  # (the backward kernels have no cached keys before the queries)
        raise ValueError(f"nsa_attention_triton: one query per key (Tq == Tk == Tw), got Tq={num_queries}, "
                         f"Tk={num_keys}, Tw={num_win}; a chunk after a cache goes to nsa_decode_triton (no "
                         f"gradients) or {_USE_NSA_ATTENTION}")
    if not checked:
        _require_support("nsa_attention_triton", _USE_NSA_ATTENTION, params, q.shape[-1], q.device)
    args, scale, out_dtype = _kernel_args(q, k_cmp, v_cmp, cmp_end, k_slc, v_slc, k_win, v_win, gates, doc_pos,
                                          scale)
    out = _nsa_fwd_op(*args, _params_tuple(params), scale)[0]
    return out if out.dtype == out_dtype else out.to(out_dtype)


@torch.no_grad()
def nsa_decode_triton(q, k_cmp, v_cmp, cmp_end, k_slc, v_slc, k_win, v_win, gates, doc_pos,
                      params: NSAParams, scale: float | None = None, query_end: torch.Tensor | None = None, *,
                      checked: bool = False) -> torch.Tensor:
    """Cached decoding step(s): q holds the last Tq (usually 1) of the Tk key positions; k_win/v_win the
    last Tw. Reads only the visible compressed keys, the n selected blocks and the window keys. One query
    per row: the cache's tensors are read in place (views of NSACache's buffers, any batch stride).
    query_end: a static cache's step (one query per row, at key query_end[0] of fixed-size buffers, the
    window a ring; nsa_reference.nsa_attention_reference describes the layout). Raises ValueError where the
    kernels do not handle the parameters (checked=True: the caller has asked, as nsa_attention_triton)."""
    single = q.shape[1] == 1
    if query_end is not None and not single:
        raise ValueError(f"nsa_decode_triton: a static cache decodes one token per row per step, got {q.shape[1]}.")
    if not checked:
        _require_support("nsa_decode_triton", _USE_NSA_ATTENTION, params, q.shape[-1], q.device)
    args, scale, out_dtype = _kernel_args(q, k_cmp, v_cmp, cmp_end, k_slc, v_slc, k_win, v_win, gates, doc_pos,
                                          scale, batch_strided=single)
    if query_end is not None:
        out = _nsa_decode_static_op(*args, query_end, _params_tuple(params), scale)
    elif single:  # the generation step: three launches, no host work but allocation
        out = _decode_step(*args, params, scale)
    else:
        out = _forward_impl(*args, params, scale)[0]
    return out if out.dtype == out_dtype else out.to(out_dtype)


@torch.no_grad()
@on_the_inputs_device
def select_blocks_triton(q, k_cmp, cmp_end, doc_pos, params: NSAParams, scale: float | None = None) -> torch.Tensor:
    """Top-n selected blocks, (B, Hkv, Tq, n') int64 in-document block indices by priority, -1 unused.

    q (B, Tq, H, D) are the last Tq of doc_pos's Tk positions; the scores come from the compression
    branch's probabilities (recomputed from q, k_cmp and the log-sum-exp). Raises ValueError where the kernels
    do not handle the parameters.
    """
    head_dim = q.shape[-1]
    _require_support("select_blocks_triton", "nsa_reference.select_blocks", params, head_dim, q.device)
    _check_grid_rows(q.shape[0], k_cmp.shape[2])  # k_cmp (B, S, Hkv, D)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    (q, k_cmp), _ = _kernel_inputs(q, k_cmp)
    q = q.contiguous()
    k_cmp = k_cmp.to(q.dtype).contiguous()
    doc_pos = doc_pos.long().contiguous()
    c_lo, c_hi, _, _ = _layout(cmp_end.long(), doc_pos, q.shape[1], q.shape[1], params)
    _, lse = _interval_fwd(q, k_cmp, k_cmp, c_lo, c_hi, scale)
    return _select_topn(q, k_cmp, lse, doc_pos, c_lo, c_hi, params, scale).long()


__all__ = [
    "LaunchOverrides",
    "MIN_COMPUTE_CAPABILITY",
    "kernel_dtype",
    "launch_overrides",
    "nsa_attention_triton",
    "nsa_decode_triton",
    "select_blocks_triton",
    "triton_is_usable",
    "triton_supports",
    "triton_unsupported_reason",
    "triton_unusable_reason",
]
