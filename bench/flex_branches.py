"""FlexAttention against this project's interval kernels for NSA's compressed and sliding-window branches (GPU).

    python bench/flex_branches.py [--lengths 2048 8192 32768 65536] [--tokens 65536] [--inputs random correlated]
                                  [--layouts 12,2,64] [--json FILE]

Issue 18 names "FlexAttention for a branch, if it is faster" among the designs to try. Both branches it could
take are interval attention: query t sees one contiguous run of keys [lo(t), hi(t)) (its document's compressed
tokens that end at or before t; the last w keys of its document), so a FlexAttention BlockMask comes straight
from the intervals (`interval_block_mask`: per 128-query block, the key blocks some query sees, and those every
query sees in full, which skip the mask; O(query blocks x key blocks) work, no T x T evaluation), with a
mask_mod lo <= kv < hi for the rest. The selected branch is not interval attention: a 128-query block's union of
chosen blocks is the schedule the project's own kernels already walk.

Per layout, length and input kind (bench_attention's inputs: B x T = --tokens, one document per row), median ms
by CUDA events, each path computing the same thing:
- ours: the interval share of the op's kernels: the interval layout, both interval forwards (the window's
  writing the gated sum of the three branches), the fused dQ kernel without the selected branch's dQ (dQ of the
  two interval branches, the three gate gradients, the deltas), the dK/dV query ranges and both dK/dV kernels;
- flex: `torch.compile(flex_attention)` forward of both branches (the compressed one with its log-sum-exp, which
  the top-n reads), the gated sum of the three branches, and autograd's backward of it: dQ, both branches' dK/dV,
  the gate gradients; plus the two block masks (`mask_ms`, built once per forward for every layer).
- the whole op as it is (`nsa_attention_triton`, forward and autograd's backward) against the composed op:
  FlexAttention for the two interval branches, the kernels for the rest (the top-n on flex's log-sum-exp, the
  selected forward, the selected dQ in a launch of its own, the selected dK/dV).
Before timing, each pair's outputs, log-sum-exps and gradients are compared (the composed op with the full op's
blocks: a near-tie that bf16 rounds the other way would pick another block; the share of selections that agree
is reported); a difference beyond bf16 rounding stops the run. The verdict is the last column but one: composed
f+b / whole op f+b, below 1 where the composed op would be faster.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from modeling_nsa.nsa_layout import NSAParams, compressed_token_ends  # noqa: E402

FLEX_BLOCK = 128  # FlexAttention's default query and key block

try:  # the log-sum-exp: return_aux from torch 2.9 on (return_lse, deprecated there, before)
    from torch.nn.attention.flex_attention import AuxRequest

    _LSE_REQUEST = {"return_aux": AuxRequest(lse=True)}
except ImportError:
    _LSE_REQUEST = {"return_lse": True}


def interval_bounds(doc_pos: torch.Tensor, cmp_end: torch.Tensor, params: NSAParams):
    """Each query's key intervals, computed with torch ops from the layout's definition (NSA_SPEC; the kernels'
    `_layout` computes the same on a GPU): doc_pos (B, T) (padding -1), cmp_end (B, Nc) (each compressed token's
    last raw key, -1 = empty slot) -> c_lo, c_hi, w_lo, w_hi (B, T) int32: compressed slots [c_lo, c_hi), window
    keys [w_lo, w_hi); padding 0, 0. Every query is also a key (training / prefill)."""
    t = torch.arange(doc_pos.shape[1], device=doc_pos.device)
    valid = doc_pos >= 0
    start = t - doc_pos  # (B, T) the document's first key
    filled = cmp_end >= 0
    c_lo = (filled[:, None, :] & (cmp_end[:, None, :] < start[:, :, None])).sum(-1)  # tokens before the document
    c_hi = torch.maximum((filled[:, None, :] & (cmp_end[:, None, :] <= t[None, :, None])).sum(-1), c_lo)
    w_lo = torch.maximum(start, t - params.window_size + 1)
    w_hi = (t + 1).expand_as(w_lo)
    zero = torch.zeros_like(c_lo)
    return tuple(torch.where(valid, x, zero).to(torch.int32) for x in (c_lo, c_hi, w_lo, w_hi))


def interval_block_mask(lo: torch.Tensor, hi: torch.Tensor, num_keys: int, block: int = FLEX_BLOCK):
    """A FlexAttention BlockMask for interval attention: query t of row b sees keys [lo[b, t], hi[b, t]).

    lo, hi (B, T) int32, empty intervals (lo >= hi) see nothing. Per block of `block` queries: the key blocks some
    query sees are listed; those that every query of the block sees whole are "full" (FlexAttention skips the
    mask_mod there), the others partial (the mask_mod decides per element). Returns (block_mask, lo_padded,
    hi_padded): the mask_mod reads the intervals padded to whole query blocks with empty ones."""
    from torch.nn.attention.flex_attention import BlockMask

    batch, num_queries = lo.shape
    q_blocks, k_blocks = -(-num_queries // block), -(-num_keys // block)
    pad = q_blocks * block - num_queries
    lo_p = torch.nn.functional.pad(lo, (0, pad)).contiguous()  # (B, Qb * block), padding rows empty (0, 0)
    hi_p = torch.nn.functional.pad(hi, (0, pad)).contiguous()
    empty = (hi_p <= lo_p).view(batch, q_blocks, block)
    lo_b, hi_b = lo_p.view(batch, q_blocks, block), hi_p.view(batch, q_blocks, block)
    big = torch.iinfo(torch.int32).max
    some_lo = torch.where(empty, big, lo_b).amin(-1)  # (B, Qb) the keys any query of the block sees
    some_hi = torch.where(empty, 0, hi_b).amax(-1)
    every_lo = lo_b.amax(-1)  # the keys every query sees (none where one query sees none: its hi is counted as 0)
    every_hi = torch.where(empty, 0, hi_b).amin(-1)
    key_start = torch.arange(k_blocks, device=lo.device) * block  # (Kb,)
    key_end = key_start + block
    seen = (key_start < some_hi[..., None]) & (key_end.clamp(max=num_keys) > some_lo[..., None])  # (B, Qb, Kb)
    # (a key block that runs past the last key is never full: every hi <= num_keys)
    full = seen & (key_start >= every_lo[..., None]) & (key_end <= every_hi[..., None])
    partial = seen & ~full

    def listed(blocks):  # (B, Qb, Kb) bool -> counts (B, 1, Qb), indices (B, 1, Qb, Kb), the listed ones first
        order = torch.argsort((~blocks).to(torch.int8), dim=-1, stable=True)
        return blocks.sum(-1, dtype=torch.int32)[:, None], order.to(torch.int32)[:, None]

    def inside_interval(b, h, q_idx, kv_idx):
        return (kv_idx >= lo_p[b, q_idx]) & (kv_idx < hi_p[b, q_idx])

    mask = BlockMask.from_kv_blocks(*listed(partial), *listed(full), block, inside_interval,
                                    seq_lengths=(num_queries, num_keys))
    return mask, lo_p, hi_p


def flex_interval_branches(q, k_cmp, v_cmp, k_win, v_win, cmp_mask, win_mask, scale, flex):
    """The compressed and window branches by FlexAttention (`flex`: the compiled flex_attention): their outputs
    (B, T, H, D) and the compressed branch's base-2 log-sum-exp (B, T, H), contiguous, as the kernels return it
    (the top-n reads it). q (B, T, H, D), k/v (B, N, Hkv, D)."""

    def heads_first(x):
        return x.transpose(1, 2)

    o_cmp, lse_cmp = flex(heads_first(q), heads_first(k_cmp), heads_first(v_cmp), block_mask=cmp_mask, scale=scale,
                          enable_gqa=True, **_LSE_REQUEST)  # fmt: skip
    lse_cmp = getattr(lse_cmp, "lse", lse_cmp)  # (an AuxOutput where return_aux asked for it)
    o_win = flex(heads_first(q), heads_first(k_win), heads_first(v_win), block_mask=win_mask, scale=scale,
                 enable_gqa=True)  # fmt: skip
    lse2_cmp = (heads_first(lse_cmp.detach()) * (1 / math.log(2))).contiguous()
    return heads_first(o_cmp), lse2_cmp, heads_first(o_win)


def gated_sum(gates, o_cmp, o_slc, o_win):
    """Eq. 5: each branch's output (B, T, H, D) times its gate (gates (B, T, H, 3) in (cmp, slc, win) order)."""
    g = gates.to(o_cmp.dtype)
    return g[..., 0:1] * o_cmp + g[..., 1:2] * o_slc + g[..., 2:3] * o_win


def flex_branches(q, k_cmp, v_cmp, k_win, v_win, gates, o_slc, cmp_mask, win_mask, scale, flex):
    """The gated NSA output (B, T, H, D) with the compressed and window branches by FlexAttention and the selected
    branch's output o_slc given; also the compressed base-2 log-sum-exp and both interval branches' outputs."""
    o_cmp, lse2_cmp, o_win = flex_interval_branches(q, k_cmp, v_cmp, k_win, v_win, cmp_mask, win_mask, scale, flex)
    return gated_sum(gates, o_cmp, o_slc, o_win), lse2_cmp, o_cmp, o_win


# ----------------------------------------------------------------------------------------------
# The GPU run
# ----------------------------------------------------------------------------------------------


def _compare(name, got, expected, atol, rows_ok=None):
    """Max |got - expected| over the rows that see keys; raises past atol (a mask that differs is not rounding)."""
    diff = (got.detach().float() - expected.detach().float()).abs()
    if rows_ok is not None:
        diff = diff[rows_ok]
    worst = float(diff.max()) if diff.numel() else 0.0
    if not worst <= atol:
        raise SystemExit(f"flex_branches: {name} differs from the project's kernels by {worst:.3g} (> {atol}), "
                         "beyond bf16 rounding: the two paths compute different things (block mask, mask_mod or "
                         "gated sum)")
    return worst


def _gradient_tolerance(expected) -> float:
    """A gradient's tolerance: 2% of its largest entry (bf16 rounding of sums over thousands of queries)."""
    return 0.02 * (float(expected.detach().float().abs().max()) or 1.0)


def check_and_time(x, cmp_end, doc_pos, params, flex, time_ms):
    """One row: both paths' outputs, log-sum-exps and gradients compared (SystemExit past bf16 rounding), then each
    timed by time_ms(fn) -> ms; then the same for the whole op (`composed_and_full`). x: bench_attention.nsa_inputs'
    tensors (B, T, ...), requiring gradients; flex: the compiled flex_attention."""
    from modeling_nsa import nsa_triton as tri
    from modeling_nsa import nsa_triton_dq as dq_mod
    from modeling_nsa import nsa_triton_interval as interval
    q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, gates = (x[n] for n in ("q", "k_cmp", "v_cmp", "k_slc", "v_slc",
                                                                       "k_win", "v_win", "gates"))  # fmt: skip
    B, T, H, D = q.shape
    num_slots = k_cmp.shape[1]
    scale = D**-0.5
    with torch.no_grad():  # the selected branch's output, log-sum-exp and blocks: fixed inputs of both paths
        _, _, o_slc, _, _, lse_slc, _, idx = tri._forward_impl(q, k_cmp, v_cmp, cmp_end, k_slc, v_slc, k_win, v_win,
                                                               gates, doc_pos, params, scale)  # fmt: skip
    do = torch.randn_like(q)
    intervals = interval._layout(cmp_end, doc_pos, T, T, params)
    if not torch.equal(torch.stack(interval_bounds(doc_pos, cmp_end, params)), intervals):
        raise SystemExit("flex_branches: interval_bounds differs from the kernels' _layout")
    c_lo, c_hi, w_lo, w_hi = intervals

    def ours(grad):
        lay = interval._layout(cmp_end, doc_pos, T, T, params)
        o_c, lse_c = interval._interval_fwd(q, k_cmp, v_cmp, lay[0], lay[1], scale)
        o_w, lse_w, out = interval._interval_fwd(q, k_win, v_win, lay[2], lay[3], scale, combine=(o_c, o_slc, gates))
        if not grad:
            return out, lse_c, o_c, o_w
        cmp, win = (k_cmp, v_cmp, lay[0], lay[1], lse_c, o_c), (k_win, v_win, lay[2], lay[3], lse_w, o_w)
        dq, dgates, delta, lse_g = dq_mod._bwd_dq(q, do, gates, cmp, (k_slc, v_slc, lse_slc, o_slc), win, idx,
                                                  doc_pos, params, scale, sel_dq=False)  # fmt: skip
        ranges = interval._interval_query_ranges(lay, (num_slots, T), interval._DKDV_KEY_TILE)
        dk_c, dv_c = interval._interval_bwd_dkdv(q, k_cmp, v_cmp, lay[0], lay[1], ranges[0], do, lse_g[0], delta[0],
                                                 scale)  # fmt: skip
        dk_w, dv_w = interval._interval_bwd_dkdv(q, k_win, v_win, lay[2], lay[3], ranges[1], do, lse_g[2], delta[2],
                                                 scale)  # fmt: skip
        return dq.lo.view(q.shape), dk_c, dv_c, dk_w, dv_w, dgates  # (the interval branches' fp32 dQ: _FloatDq)

    def masks():
        return interval_block_mask(c_lo, c_hi, num_slots)[0], interval_block_mask(w_lo, w_hi, T)[0]

    def theirs(grad):
        cmp_mask, win_mask = masks()
        with torch.set_grad_enabled(grad):
            result = flex_branches(q, k_cmp, v_cmp, k_win, v_win, gates, o_slc, cmp_mask, win_mask, scale, flex)
            if not grad:
                return result
            return torch.autograd.grad(result[0], (q, k_cmp, v_cmp, k_win, v_win, gates), do)

    started = time.perf_counter()
    flex_out, flex_grads = theirs(False), theirs(True)  # (the first calls compile)
    if q.is_cuda:
        torch.cuda.synchronize()
    compile_s = time.perf_counter() - started
    ours_out, ours_grads = ours(False), ours(True)
    seen_c = (c_hi > c_lo)[..., None].expand(-1, -1, H)  # rows that see a compressed token: their lse is defined
    errors = {
        "out": _compare("the gated output", flex_out[0], ours_out[0], 0.03),
        "lse_cmp": _compare("the compressed log-sum-exp", flex_out[1], ours_out[1], 0.03, seen_c),
        "o_cmp": _compare("the compressed output", flex_out[2], ours_out[2], 0.03),
        "o_win": _compare("the window output", flex_out[3], ours_out[3], 0.03),
    }
    for name, got, expected in zip(("dq", "dk_cmp", "dv_cmp", "dk_win", "dv_win", "dgates"), flex_grads, ours_grads):
        errors[name] = _compare(name, got, expected, _gradient_tolerance(expected))
    row = dict(T=T, B=B, compile_s=round(compile_s, 1), ours_fwd=time_ms(lambda: ours(False)),
               ours_fb=time_ms(lambda: ours(True)), flex_fwd=time_ms(lambda: theirs(False)),
               flex_fb=time_ms(lambda: theirs(True)), mask_ms=time_ms(masks),
               max_errors={name: float(f"{value:.3g}") for name, value in errors.items()})  # fmt: skip
    row["flex_over_ours_fb"] = row["flex_fb"] / row["ours_fb"]
    row.update(composed_and_full(x, cmp_end, doc_pos, params, flex, time_ms, masks, idx))
    return row


def composed_and_full(x, cmp_end, doc_pos, params, flex, time_ms, masks, idx_full):
    """The whole op two ways: as it is (nsa_attention_triton, autograd), and composed: FlexAttention for the two
    interval branches (autograd through them and the gated sum), the kernels for the rest (the top-n on flex's
    log-sum-exp, the selected forward, the selected dQ in a launch of its own and the selected dK/dV). Compared on
    every output and gradient with the full op's blocks (a near-tie that bf16 rounds the other way would otherwise
    pick another block: the share of selections that agree is reported instead), then timed."""
    from modeling_nsa import nsa_triton as tri
    from modeling_nsa import nsa_triton_dq as dq_mod
    from modeling_nsa import nsa_triton_interval as interval
    from modeling_nsa import nsa_triton_selected as sel
    from modeling_nsa import nsa_triton_topn as topn

    names = ("q", "k_cmp", "v_cmp", "k_slc", "v_slc", "k_win", "v_win", "gates")
    q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, gates = (x[n] for n in names)
    B, T, H, D = q.shape
    scale = D**-0.5
    do = torch.randn(q.shape, generator=torch.Generator(q.device).manual_seed(1), device=q.device, dtype=q.dtype)
    kv32 = dq_mod._kv_offsets_fit_int32(max(T, k_cmp.shape[1]), k_slc.shape[2], D)

    def full(grad):
        with torch.set_grad_enabled(grad):
            out = tri.nsa_attention_triton(q, k_cmp, v_cmp, cmp_end, k_slc, v_slc, k_win, v_win, gates, doc_pos,
                                           params, scale)  # fmt: skip
            return (out, torch.autograd.grad(out, [x[n] for n in names], do)) if grad else (out, None)

    def composed(grad, idx=None):
        cmp_mask, win_mask = masks()
        lay = interval._layout(cmp_end, doc_pos, T, T, params)
        with torch.set_grad_enabled(grad):
            o_cmp, lse2_cmp, o_win = flex_interval_branches(q, k_cmp, v_cmp, k_win, v_win, cmp_mask, win_mask, scale,
                                                            flex)  # fmt: skip
        if idx is None:
            idx = topn._select_topn(q, k_cmp, lse2_cmp, doc_pos, lay[0], lay[1], params, scale)
        o_slc, lse_slc = sel._sel_fwd(q, k_slc, v_slc, idx, doc_pos, params, scale)
        with torch.set_grad_enabled(grad):
            out = gated_sum(gates, o_cmp, o_slc, o_win)
            if not grad:
                return out, None, idx
            dq, dk_cmp, dv_cmp, dk_win, dv_win, dgates = torch.autograd.grad(out, (q, k_cmp, v_cmp, k_win, v_win,
                                                                                   gates), do)  # fmt: skip
        dq_slc, _, delta, lse_g = dq_mod._sel_dq_split(q, do, gates, (k_slc, v_slc, lse_slc, o_slc), idx, doc_pos,
                                                       params, scale, kv32)  # fmt: skip
        dk_slc, dv_slc = sel._sel_bwd_dkdv(q, k_slc, v_slc, idx, doc_pos, do, lse_g[1], delta[1], params, scale)
        return out, (dq + dq_slc, dk_cmp, dv_cmp, dk_slc, dv_slc, dk_win, dv_win, dgates), idx

    full_out, full_grads = full(True)
    out, grads, _ = composed(True, idx=idx_full.to(torch.int32))
    errors = {"out": _compare("the composed op's output", out, full_out, 0.03)}
    for name, got, expected in zip(names, grads, full_grads):
        errors[name] = _compare(f"the composed op's d{name}", got, expected,
                                _gradient_tolerance(expected))  # fmt: skip
    idx_flex = composed(False)[2]
    row = dict(full_fwd=time_ms(lambda: full(False)), full_fb=time_ms(lambda: full(True)),
               composed_fwd=time_ms(lambda: composed(False)), composed_fb=time_ms(lambda: composed(True)),
               selections_agree=float((idx_flex.long() == idx_full.long()).float().mean()),
               composed_max_errors={name: float(f"{value:.3g}") for name, value in errors.items()})  # fmt: skip
    row["composed_over_full_fb"] = row["composed_fb"] / row["full_fb"]
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192, 32768, 65536])
    ap.add_argument("--tokens", type=int, default=65536, help="B x T per step (default 65536, as bench_attention)")
    ap.add_argument("--inputs", nargs="+", default=["random", "correlated"], choices=["random", "correlated"])
    ap.add_argument("--layouts", nargs="+", default=["12,2,64"],
                    help="q heads,kv heads,head_dim (default: the 125M layout; fla's is 16,1,64). Every (layout, "
                         "length) compiles FlexAttention's forward and backward anew")
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench/flex_branches.py needs a CUDA GPU (on CPU, tests/test_flex_branches.py checks its "
                         "masks and its comparison).")
    sys.path.insert(0, str(ROOT / "bench"))
    import bench_attention as ba
    from torch.nn.attention.flex_attention import flex_attention

    # fullgraph: past dynamo's recompile_limit (8 entries on flex_attention's code, 4 per (layout, length): two key
    # lengths x grad on/off) a call would otherwise fall back to eager flex_attention, whose math path materializes
    # the B x H x T x N scores (OOM at T = 32768 for the window). Fail loudly instead; reset per row below.
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    flex = torch.compile(flex_attention, dynamic=False, fullgraph=True)
    torch.manual_seed(0)
    rows = []
    meta = dict(date=datetime.date.today().isoformat(), device=torch.cuda.get_device_name(), torch=torch.__version__,
                command=" ".join(sys.argv))
    for layout in args.layouts:
        H, Hkv, D = (int(v) for v in layout.split(","))
        for T in args.lengths:
            torch._dynamo.reset()  # each (layout, length) compiles anew: 4 cache entries, never the limit
            for kind in args.inputs:
                x, cmp_end, doc_pos = ba.nsa_inputs(max(1, args.tokens // T), T, H, Hkv, D, kind=kind)
                row = dict(layout=f"{H}q/{Hkv}kv d{D}", inputs=kind,
                           **check_and_time(x, cmp_end, doc_pos, ba.PARAMS, flex, ba.time_ms))
                rows.append(row)
                print(json.dumps(row), flush=True)
                if args.json:  # after every row: a later crash keeps the rows measured so far
                    Path(args.json).write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
                torch.cuda.empty_cache()
    print("\n| layout | T | inputs | interval share f+b: kernels / flex | masks | whole op f+b: kernels / composed | "
          "composed / kernels | selections agree |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['layout']} | {r['T']} | {r['inputs']} | {r['ours_fb']:.3f} / {r['flex_fb']:.3f} "
              f"({r['flex_over_ours_fb']:.2f}x) | {r['mask_ms']:.3f} | {r['full_fb']:.3f} / {r['composed_fb']:.3f} | "
              f"{r['composed_over_full_fb']:.2f}x | {r['selections_agree']:.4f} |")


if __name__ == "__main__":
    main()
