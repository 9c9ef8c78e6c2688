"""Helpers for the Triton-vs-reference kernel tests (shared by the CPU interpreter and GPU tests).

Run as a script (``TRITON_INTERPRET=1 python tests/triton_helpers.py '<json list of cases>'``) it
checks each case and prints one JSON line of results; the CPU tests do this in a subprocess so
Triton reads TRITON_INTERPRET before any kernel is defined, whatever pytest imported first.

Selection near-ties: the kernels sum probabilities in another order than the reference, so an
(n)-th/(n+1)-th block pair whose scores agree to rounding may flip. The check therefore (1) compares
the selected indices, and where they differ requires that the reference's scores of the two
selections agree (sorted, to 1e-4 relative): only a genuine near-tie may differ; and (2) compares
outputs and gradients with the reference run on the kernel's selection (same blocks), so the
attention math is checked exactly whatever the tie outcome.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import json
import math
import os
import sys
import time
import types
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]


def import_nsa():
    """(nsa_layout, nsa_reference, nsa_triton) modules, even while modeling_nsa.py is being written."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    try:
        pkg = importlib.import_module("modeling_nsa")
    except Exception:  # package __init__ broken: load the three flat modules without it
        for name in [m for m in sys.modules if m == "modeling_nsa" or m.startswith("modeling_nsa.")]:
            del sys.modules[name]
        pkg = types.ModuleType("modeling_nsa")
        pkg.__path__ = [str(ROOT / "modeling_nsa")]
        sys.modules["modeling_nsa"] = pkg
    layout = importlib.import_module("modeling_nsa.nsa_layout")
    reference = importlib.import_module("modeling_nsa.nsa_reference")
    tri = importlib.import_module("modeling_nsa.nsa_triton")
    return layout, reference, tri


KERNEL_FILES = ("common", "launch", "interval", "topn", "selected", "dq", "decode")


def kernel_module(name: str):
    """modeling_nsa.nsa_triton_<name>: one of KERNEL_FILES (nsa_triton.py imports them all)."""
    import_nsa()
    return importlib.import_module(f"modeling_nsa.nsa_triton_{name}")


def kernel_modules() -> list:
    """nsa_triton and its sibling kernel files: where the kernels, the launchers and their globals live."""
    return [import_nsa()[2]] + [kernel_module(name) for name in KERNEL_FILES]


TINY = dict(cmp_block_size=8, cmp_stride=4, sel_block_size=16, sel_num_blocks=4, sel_init_blocks=1,
            sel_local_blocks=2, window_size=16)
DEFAULT = dict(cmp_block_size=32, cmp_stride=16, sel_block_size=64, sel_num_blocks=16, sel_init_blocks=1,
               sel_local_blocks=2, window_size=512)


def make_inputs(B, T, H, Hkv, D, params, dtype, device, layout_kind="single", seed=0, gate_logit=0.0):
    """Random inputs of the op; gate_logit shifts the gates' logits (gates = sigmoid(N(gate_logit, 1)))."""
    layout, _, _ = import_nsa()
    gen = torch.Generator().manual_seed(seed)
    position_ids, attention_mask = None, None
    if layout_kind == "varlen":  # packed documents: position ids restart at 0
        position_ids = torch.zeros(B, T, dtype=torch.long)
        for b in range(B):
            cuts = sorted(torch.randint(1, max(2, T), (3,), generator=gen).tolist())
            starts = [0] + cuts
            pos = torch.arange(T)
            for s in starts:
                pos = torch.where(torch.arange(T) >= s, torch.arange(T) - s, pos)
            position_ids[b] = pos
    elif layout_kind == "pad":  # left padding on row 0, right padding on the last row
        attention_mask = torch.ones(B, T, dtype=torch.long)
        attention_mask[0, : T // 3] = 0
        attention_mask[-1, T - T // 4 :] = 0
    doc_pos = layout.document_positions(position_ids, attention_mask, B, T, torch.device("cpu"))
    p = layout.NSAParams(**params)
    cmp_end = layout.compressed_token_ends(doc_pos, p)
    Nc = cmp_end.shape[1]

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    tensors = dict(
        q=rnd(B, T, H, D), k_cmp=rnd(B, Nc, Hkv, D), v_cmp=rnd(B, Nc, Hkv, D),
        k_slc=rnd(B, T, Hkv, D), v_slc=rnd(B, T, Hkv, D), k_win=rnd(B, T, Hkv, D), v_win=rnd(B, T, Hkv, D),
        gates=torch.sigmoid(torch.randn(B, T, H, 3, generator=gen) + gate_logit).to(device=device, dtype=dtype),
    )
    return tensors, cmp_end.to(device), doc_pos.to(device), p


GRAD_NAMES = ["q", "k_cmp", "v_cmp", "k_slc", "v_slc", "k_win", "v_win", "gates"]


def rel(x, ref, floor: float = 1e-2):
    """||x - ref|| / ||ref||, the norm of ref taken as at least `floor` RMS per element: an all-zero reference (e.g.
    dq at T=1: one key, softmax gradient 0) gives an absolute RMS error. A case whose gradients are small by
    design (gates near 0) sets floor 0 (its "rel_floor"), else its errors would read as absolute and tiny."""
    x, ref = x.double(), ref.double()
    if not torch.isfinite(x).all():
        return float("nan")
    return ((x - ref).norm() / ref.norm().clamp_min(floor * max(1, ref.numel()) ** 0.5)).item()


# case keys named otherwise than the LaunchOverrides field they force (the other keys are the fields' names)
CASE_KEY_FIELDS = {"bj": "topn_blocks_per_chunk", "split": "dkdv_split"}


@contextlib.contextmanager
def as_arch(arch: int | None):
    """Inside the block the launchers see an sm_<arch> device (the launch configuration that architecture gets);
    None: the real one."""
    common = kernel_module("common")  # (where _compute_capability is looked up)
    real = common._compute_capability
    if arch:
        common._compute_capability = lambda device: arch
    try:
        yield
    finally:
        common._compute_capability = real


@contextlib.contextmanager
def case_launch(case: dict):
    """Inside the block the launchers take the case's forced launch choices (launch_overrides) and the launch
    configuration of the case's architecture ("arch": tiles differ before Hopper); the defaults outside, so
    cases sharing one process do not leak into each other."""
    _, _, tri = import_nsa()
    fields = {field.name for field in dataclasses.fields(tri.LaunchOverrides)}
    choices = {CASE_KEY_FIELDS.get(key, key): tuple(value) if isinstance(value, list) else value
               for key, value in case.items() if CASE_KEY_FIELDS.get(key, key) in fields and value is not None}
    with as_arch(case.get("arch")), tri.launch_overrides(**choices):
        yield


def with_case_launch(runner):
    """`runner(case)` run inside case_launch(case)."""

    @functools.wraps(runner)
    def run(case: dict) -> dict:
        with case_launch(case):
            return runner(case)

    return run


def case_setup(case: dict):
    """Build a case's inputs. Returns (inputs, cmp_end, doc_pos, params, dtype, device)."""
    dtype = getattr(torch, case.get("dtype", "float32"))
    device = case.get("device", "cpu")
    params = dict(TINY if case.get("params", "tiny") == "tiny" else DEFAULT)
    params.update(case.get("param_overrides", {}))
    t, cmp_end, doc_pos, p = make_inputs(case["B"], case["T"], case["H"], case["Hkv"], case["D"], params, dtype,
                                         device, case.get("layout", "single"), case.get("seed", 0),
                                         case.get("gate_logit", 0.0))
    return t, cmp_end, doc_pos, p, dtype, device


@with_case_launch
def run_case(case: dict) -> dict:
    """Forward, selection and gradients Triton vs reference for one case; returns relative errors."""
    layout, reference, tri = import_nsa()
    t, cmp_end, doc_pos, p, dtype, device = case_setup(case)
    leaves = {n: t[n].clone().requires_grad_(True) for n in GRAD_NAMES}
    out = tri.nsa_attention_triton(
        leaves["q"], leaves["k_cmp"], leaves["v_cmp"], cmp_end, leaves["k_slc"], leaves["v_slc"],
        leaves["k_win"], leaves["v_win"], leaves["gates"], doc_pos, p,
    )
    gen = torch.Generator().manual_seed(1234)
    dout = torch.randn(out.shape, generator=gen).to(device=device, dtype=dtype)
    out.backward(dout)
    idx_tri = tri.select_blocks_triton(t["q"], t["k_cmp"], cmp_end, doc_pos, p).cpu()

    # reference in fp32 on the kernel's selection (see the module docstring)
    captured = {}
    ref_out, ref_grads = _reference_on(t, cmp_end, doc_pos, p, idx_tri, dout, captured)
    res = {"out": rel(out.detach(), ref_out, case.get("rel_floor", 1e-2)), "nan": bool(torch.isnan(out).any())}
    for n in GRAD_NAMES:
        g = leaves[n].grad
        res["d" + n] = float("nan") if g is None else rel(g, ref_grads[n], case.get("rel_floor", 1e-2))
    res.update(selection_errors(idx_tri, captured))
    if case.get("judge_rounding") and dtype != torch.float32:
        # the same gradients against the exact ones plus what the stored output's rounding adds (flash_rounding_terms)
        # (the selected dQ formed pair by pair takes dout itself, its gate folded into the log-sum-exp)
        pairwise = bool(case.get("sel_dq_in_dkdv") or case.get("sel_dq_pairs"))
        terms = flash_rounding_terms(t, cmp_end, doc_pos, p, idx_tri, dout, selected_dq_pairwise=pairwise)
        for n, term in terms.items():
            g = leaves[n].grad
            res[f"d{n}_rounded"] = float("nan") if g is None else rel(
                g, ref_grads[n].double() + term.to(ref_grads[n].device), case.get("rel_floor", 1e-2))
    return res


@torch.no_grad()
def flash_rounding_terms(t, cmp_end, doc_pos, p, idx, dout, selected_dq_pairwise: bool = False) -> dict:
    """What the kernels' backward adds to the exact gradients of q and each branch's keys by taking each branch's
    delta = dout . o from its output as stored, rounded to the inputs' dtype (as FlashAttention's backward does;
    nsa_triton_dq._branch_prep): a row's dS gains P c, c = g dout . (o - round(o)), the gradient of c lse (d lse /
    dS = P), so dq gains scale c (P K) and each key scale c P q. Where a query sees few keys whose dP nearly agree,
    dq is a small difference that this moves by more than fp16's tolerance (tests/README.md, "Random cases"); the
    fuzzer judges a low-precision case that fails against the exact gradients plus these terms too. The dQ kernel
    also rounds g dout (its dP and delta from it), except for the selected branch's dQ formed pair by pair
    (selected_dq_pairwise: launch_overrides sel_dq_in_dkdv or sel_dq_pairs), which takes dout with the gate folded
    into the log-sum-exp as the dK/dV kernels do. The stored output is emulated for one key tile per row (the small
    rows this judges). In float64 on the kernel's selection idx; returns {"q": (B, Tq, H, D), "k_cmp", "k_slc",
    "k_win": each (B, N, Hkv, D)}."""
    _, reference, _ = import_nsa()
    x = {n: t[n].detach().double() for n in GRAD_NAMES}
    device = x["q"].device
    branches = reference.reference_branches(x["q"], x["k_cmp"], x["v_cmp"], cmp_end, x["k_slc"], x["v_slc"],
                                            x["k_win"], x["v_win"], doc_pos, p, block_indices=idx.to(device),
                                            probabilities=True)
    batch, num_q, num_heads, head_dim = x["q"].shape
    num_kv = x["k_slc"].shape[2]
    scale = head_dim ** -0.5

    def grouped(y):  # (B, Tq, H, X) -> (B, Hkv, G, Tq, X), head h = kv * G + g
        return y.reshape(batch, num_q, num_kv, num_heads // num_kv, -1).permute(0, 2, 3, 1, 4)

    dtype = t["q"].dtype
    q_g, dout_g, gates_g = grouped(x["q"]), grouped(dout.to(device).double()), grouped(x["gates"])
    dq = torch.zeros_like(q_g)
    terms = {}
    for b, (name, o, probs) in enumerate((("k_cmp", branches.o_cmp, branches.p_cmp),
                                          ("k_slc", branches.o_slc, branches.p_slc),
                                          ("k_win", branches.o_win, branches.p_win))):
        keys, values = x[name].transpose(1, 2), x["v" + name[1:]].transpose(1, 2)  # (B, Hkv, N, D)
        gated_dout = gates_g[..., b, None] * dout_g  # (B, Hkv, G, Tq, D)
        # the output as the forward kernel stores it: its P V dot takes exp(s - m) rounded to the dtype (m the row's
        # largest score, one key tile's: the small rows this judges), then the store rounds o
        peak = probs.amax(-1, keepdim=True).clamp_min(1e-300)
        stored = (peak * ((probs / peak).to(dtype).double() @ values[:, :, None])).to(dtype).double()
        rounding = o - stored
        c = (gated_dout * rounding).sum(-1)  # (B, Hkv, G, Tq): the dK/dV kernels' delta error
        terms[name] = (scale * torch.einsum("bkgt,bkgtn,bkgtd->bknd", c, probs, q_g)).transpose(1, 2)
        if b == 1 and selected_dq_pairwise:  # (as the dK/dV kernels: dout itself, the gate in the log-sum-exp)
            dq += scale * c[..., None] * (probs @ keys[:, :, None])
            continue
        # the dQ kernel takes g dout rounded too (its delta and dP from round(g dout)): the exact backward of that
        # output gradient, and its delta from the rounded output
        rounded_dout = (dout_g.float() * gates_g[..., b, None].float()).to(dtype).double()
        error = rounded_dout - gated_dout
        ds = probs * (error @ values[:, :, None].transpose(-1, -2) - (error * o).sum(-1)[..., None])
        c_dq = (rounded_dout * rounding).sum(-1)
        dq += scale * (ds + c_dq[..., None] * probs) @ keys[:, :, None]
    terms["q"] = dq.permute(0, 3, 1, 2, 4).reshape(batch, num_q, num_heads, head_dim)
    return terms


@with_case_launch
def run_select_case(case: dict) -> dict:
    """The training top-n kernel alone (select_blocks_triton) against the reference's block scores: cheaper
    than a whole run_case, so the selection can be checked over many blocks (longer T) at every G."""
    _, _, tri = import_nsa()
    t, cmp_end, doc_pos, p, dtype, device = case_setup(case)
    idx_tri = tri.select_blocks_triton(t["q"], t["k_cmp"], cmp_end, doc_pos, p).cpu()
    captured = {}
    _reference_on(t, cmp_end, doc_pos, p, idx_tri, None, captured)  # (its forward computes the block scores)
    return selection_errors(idx_tri, captured)


def tile_block_union_torch(idx, doc_pos, qpb: int, sel_block_size: int):
    """The oracle of nsa_triton_selected._tile_block_union in torch ops (two segmented sorts; the launcher's
    own code before the union kernel): each query tile's distinct blocks as absolute first keys ascending, then
    int32-max padding; which of the tile's queries chose each (bit q % 32 of int32 word q // 32, zero past the
    distinct blocks); their count; how many of them end at or before the tile's first valid query."""
    batch, num_kv, num_q, n_sel = idx.shape
    num_keys = doc_pos.shape[1]
    q_off = num_keys - num_q
    n_tiles = -(-num_q // qpb)
    none = torch.iinfo(torch.int32).max
    t_abs = torch.arange(q_off, num_keys, device=idx.device).expand(batch, -1)
    start = (t_abs - doc_pos[:, q_off:]).to(torch.int32)
    a = torch.where(idx >= 0, start[:, None, :, None] + idx * sel_block_size, none)
    a = torch.nn.functional.pad(a, (0, 0, 0, n_tiles * qpb - num_q), value=none)
    chosen_by_query = a.view(batch, num_kv, n_tiles, qpb, n_sel)
    a = a.view(batch, num_kv, n_tiles, qpb * n_sel).sort(-1).values
    repeat = torch.zeros_like(a, dtype=torch.bool)
    repeat[..., 1:] = a[..., 1:] == a[..., :-1]
    a = torch.where(repeat, none, a).sort(-1).values
    # (B, Hkv, tiles, qpb, entries): query q of the tile chose the tile's distinct block at that entry
    chose = (chosen_by_query[..., :, :, None] == a[..., None, None, :]).any(-2) & (a < none)[..., None, :]
    words = -(-qpb // 32)
    bit = torch.ones(qpb, dtype=torch.int64) << (torch.arange(qpb) % 32)
    word_of = torch.arange(qpb) // 32
    masks = torch.stack([(chose.long() * torch.where(word_of == w, bit, 0)[:, None]).sum(-2)
                         for w in range(words)], -1)  # (B, Hkv, tiles, entries, words) as unsigned 32-bit
    masks = torch.where(masks >= 2**31, masks - 2**32, masks).to(torch.int32)
    t_first = torch.where(doc_pos[:, q_off:] >= 0, t_abs, num_keys)
    t_first = torch.nn.functional.pad(t_first, (0, n_tiles * qpb - num_q), value=num_keys)
    t_first = t_first.view(batch, 1, n_tiles, qpb).amin(-1, keepdim=True)
    n_past = (a.long() + (sel_block_size - 1) <= t_first).sum(-1, dtype=torch.int32)
    return a, masks, (a < none).sum(-1, dtype=torch.int32), n_past


def run_heavy_plan_case(case: dict) -> dict:
    """The selected dK/dV's slots and pieces (_sel_heavy_plan: two Triton launches and a topk) against the torch
    oracles (_sel_heavy_slots, _sel_heavy_pieces) on pair counts per (row, block first key) drawn uniform or
    concentrated (1 / rank**1.2), block 0 of each row holding a pair per query; ties included (counts repeat).
    Returns the count of mismatching entries per output and how many blocks were split."""
    selected = kernel_module("selected")
    gen = torch.Generator().manual_seed(case.get("seed", 0))
    rows, keys, queries = case["rows"], case["keys"], case["queries"]
    weights = torch.ones(keys) if case["picks"] == "uniform" else 1.0 / torch.arange(1, keys + 1) ** 1.2
    cnt = torch.stack([torch.bincount(torch.multinomial(weights, queries * 13, replacement=True, generator=gen),
                                      minlength=keys) for _ in range(rows)])
    cnt[:, 0] = queries
    cnt = cnt.flatten()
    pair_off = torch.cat([cnt.new_zeros(1), torch.cumsum(cnt, 0)]).to(torch.int32)
    heavy_min, qpb, min_piece, max_pieces, n_heavy = (case[k] for k in ("heavy_min", "qpb", "min_piece",
                                                                         "max_pieces", "slots"))
    hpos, slot_rank, pieces, piece_start = selected._sel_heavy_plan(pair_off, cnt.numel(), n_heavy, heavy_min, qpb,
                                                                    min_piece, max_pieces, wide=False)
    want_hpos, want_rank = selected._sel_heavy_slots(cnt, cnt > heavy_min, n_heavy)
    want_pieces, want_start = selected._sel_heavy_pieces(cnt, pair_off.long(), want_hpos, qpb, min_piece, max_pieces,
                                                         wide=False)
    return dict(hpos=int((hpos.cpu() != want_hpos).sum()), slot_rank=int((slot_rank.cpu().long() != want_rank).sum()),
                pieces=int((pieces.cpu().long() != want_pieces.long()).sum()),
                piece_start=int((piece_start.cpu() != want_start).sum()),
                split=int((want_hpos < cnt.numel()).sum()), n_pieces=int(want_start[-1]))


@with_case_launch
def run_union_case(case: dict) -> dict:
    """The tile-union kernel against tile_block_union_torch on random block choices (repeats across and within
    queries, unused slots, padding rows) over the case's document layout, for each query-tile size in
    case["qpbs"] (int64 sort keys where the case forces them: sel_union_wide_keys), the queries the last T - q_off
    positions. The masks are compared at the distinct blocks only (the kernels read no further)."""
    selected = kernel_module("selected")
    _, _, doc_pos, _, _, device = case_setup(case)
    gen = torch.Generator().manual_seed(case.get("seed", 0))
    lb, n_sel, hkv, q_off = case["LB"], case["n_sel"], case["Hkv"], case.get("q_off", 0)
    pos = doc_pos[:, q_off:].cpu()  # (B, Tq)
    n_blocks = torch.where(pos >= 0, pos // lb + 1, 0)[:, None, :, None]  # blocks in the document so far
    shape = (pos.shape[0], hkv, pos.shape[1], n_sel)
    j = (torch.rand(shape, generator=gen) * n_blocks).long()
    unused = (torch.rand(shape, generator=gen) < 0.2) | (n_blocks == 0)
    idx = torch.where(unused, -1, j).to(device=device, dtype=torch.int32).contiguous()
    res = {"mismatches": 0, "tiles": 0, "mask_bits": 0}
    for qpb in case["qpbs"]:
        entries, high_bits, counts, n_past = selected._tile_block_union(idx, doc_pos, qpb, lb)
        entries = entries.cpu()
        blocks = (entries >> 32).to(torch.int32)
        word0 = entries & 0xFFFFFFFF
        word0 = torch.where(word0 >= 2**31, word0 - 2**32, word0).to(torch.int32)
        masks = torch.cat([word0[..., None], high_bits.cpu()], -1)
        want = tile_block_union_torch(idx, doc_pos, qpb, lb)
        listed = torch.arange(blocks.shape[-1]) < want[2].cpu()[..., None]  # (B, Hkv, tiles, entries)
        masks = torch.where(listed[..., None], masks.cpu(), 0)
        for g, w in zip((blocks, masks, counts, n_past), want):
            res["mismatches"] += int((g.cpu() != w.cpu()).sum())
        res["tiles"] += want[2].numel()
        res["mask_bits"] += int(sum(bin(int(x) & 0xFFFFFFFF).count("1") for x in want[1].flatten()))
        res["max_count"] = max(res.get("max_count", 0), int(want[2].max()))
        res["max_past"] = max(res.get("max_past", 0), int(want[3].max()))
    return res


def random_block_choices(doc_pos, num_kv: int, n_sel: int, sel_block_size: int, gen) -> torch.Tensor:
    """idx (B, Hkv, Tq, n') int32 as the top-n gives it: per (row, KV head, query) up to n' distinct blocks of the
    query's document at or before its own (j <= pos // l'), in random order, a random number of them unused (-1,
    at the end); padding queries none."""
    batch, num_q = doc_pos.shape
    idx = torch.full((batch, num_kv, num_q, n_sel), -1, dtype=torch.int32)
    for b in range(batch):
        for t in range(num_q):
            pos = int(doc_pos[b, t])
            if pos < 0:
                continue
            for g in range(num_kv):
                chosen = torch.randperm(pos // sel_block_size + 1, generator=gen)[:n_sel]
                keep = int(torch.randint(1, len(chosen) + 1, (1,), generator=gen))
                idx[b, g, t, :keep] = chosen[:keep].to(torch.int32)
    return idx


def selected_branch_torch(q, k, v, idx, doc_pos, sel_block_size: int, scale: float):
    """The selected branch by its definition (NSA_SPEC), in fp32 torch ops: query t of KV group g attends the keys
    s <= t of the blocks idx lists for it (block j of t's document: keys start + j l' ... + l' - 1 of that
    document). Returns (o (B, Tq, H, D), base-2 log-sum-exp (B, Tq, H), +inf where no key)."""
    batch, num_q, num_heads, _ = q.shape
    num_keys, num_kv = k.shape[1], k.shape[2]
    group = num_heads // num_kv
    q_off = num_keys - num_q
    t = torch.arange(q_off, num_keys)
    start = t - doc_pos[:, q_off:]  # (B, Tq)
    s_pos = doc_pos  # (B, Tk)
    keys = torch.arange(num_keys)
    key_start = keys - s_pos  # each key's document start
    visible = torch.zeros(batch, num_kv, num_q, num_keys, dtype=torch.bool)
    for slot in range(idx.shape[-1]):
        j = idx[..., slot].long()  # (B, Hkv, Tq)
        a = start[:, None, :] + j * sel_block_size
        in_block = (keys[None, None, None, :] >= a[..., None]) & (keys < a[..., None] + sel_block_size)
        same_doc = key_start[:, None, None, :] == start[:, None, :, None]
        visible |= (j >= 0)[..., None] & in_block & same_doc & (s_pos >= 0)[:, None, None, :]
    visible &= keys[None, None, None, :] <= t[None, None, :, None]
    qf = q.float().view(batch, num_q, num_kv, group, -1).permute(0, 2, 3, 1, 4)  # (B, Hkv, G, Tq, D)
    kf, vf = k.float().permute(0, 2, 1, 3), v.float().permute(0, 2, 1, 3)  # (B, Hkv, Tk, D)
    logits = torch.einsum("bkgtd,bksd->bkgts", qf, kf) * scale
    logits = logits.masked_fill(~visible[:, :, None], float("-inf"))
    lse = torch.logsumexp(logits, -1)  # (B, Hkv, G, Tq)
    probs = torch.where(visible[:, :, None], torch.exp(logits - lse[..., None].clamp_min(-1e30)), 0.0)
    o = torch.einsum("bkgts,bksd->bkgtd", probs, vf)
    lse2 = torch.where(torch.isfinite(lse), lse / math.log(2), float("inf"))
    o = o.permute(0, 3, 1, 2, 4).reshape(batch, num_q, num_heads, -1)
    return o, lse2.permute(0, 3, 1, 2).reshape(batch, num_q, num_heads)


@with_case_launch
def run_selfwd_case(case: dict) -> dict:
    """The selected forward alone (_sel_fwd, under the case's launch choices) against selected_branch_torch on
    random valid choices (random_block_choices) over the case's layout: relative errors of o and of the
    log-sum-exp where finite, and whether the +inf rows (no chosen block) agree."""
    selected = kernel_module("selected")
    t, _, doc_pos, p, dtype, device = case_setup(case)
    gen = torch.Generator().manual_seed(case.get("seed", 0) + 17)
    idx = random_block_choices(doc_pos.cpu(), case["Hkv"], p.sel_num_blocks, p.sel_block_size, gen)
    scale = 1.0 / math.sqrt(case["D"])
    o, lse = selected._sel_fwd(t["q"], t["k_slc"], t["v_slc"], idx.to(device), doc_pos, p, scale)
    ref_o, ref_lse = selected_branch_torch(t["q"].cpu(), t["k_slc"].cpu(), t["v_slc"].cpu(), idx, doc_pos.cpu(),
                                           p.sel_block_size, scale)
    lse, finite = lse.cpu(), torch.isfinite(ref_lse)
    return {"out": rel(o.cpu().float(), ref_o), "lse": rel(lse[finite], ref_lse[finite]),
            "inf_rows_agree": bool(torch.equal(torch.isinf(lse), ~finite)), "rows_without_blocks": int((~finite).sum()),
            "nan": bool(torch.isnan(o).any())}


@with_case_launch
def run_seldq_case(case: dict) -> dict:
    """The selected branch's dQ alone by the block-outer pair kernel (_sel_dq_pairs, launch_overrides(sel_dq_pairs=
    True) implied) against autograd through selected_branch_torch on random valid choices (the branch's output
    gradient round(g_slc dout)), with the gate folded into the log-sum-exp and delta = rowsum(dout * o) as the
    fused dQ kernel stores them (_branch_prep), added to a zero interval dQ. Cheaper than a whole-op case, so every
    G can be checked."""
    selected, dq_module = kernel_module("selected"), kernel_module("dq")
    t, _, doc_pos, p, dtype, device = case_setup(case)
    gen = torch.Generator().manual_seed(case.get("seed", 0) + 29)
    idx = random_block_choices(doc_pos.cpu(), case["Hkv"], p.sel_num_blocks, p.sel_block_size, gen)
    scale = 1.0 / math.sqrt(case["D"])
    q, k, v, gates = t["q"], t["k_slc"], t["v_slc"], t["gates"]
    dout = torch.randn(q.shape, generator=gen).to(device=device, dtype=dtype)
    do_slc = (dout.float() * gates[..., 1:2].float()).to(dtype)  # round(g dout), as the kernels load it
    q_ref = q.detach().float().cpu().requires_grad_(True)
    o_ref, _ = selected_branch_torch(q_ref, k.float().cpu(), v.float().cpu(), idx, doc_pos.cpu(), p.sel_block_size,
                                     scale)
    (dq_ref,) = torch.autograd.grad(o_ref, q_ref, do_slc.float().cpu())
    o, lse = selected._sel_fwd(q, k, v, idx.to(device), doc_pos, p, scale)
    delta = (dout.float() * o.float()).sum(-1).contiguous()  # (B, Tq, H)
    lse_g = (torch.where(torch.isinf(lse), 0.0, lse) - torch.log2(gates[..., 1].float())).contiguous()
    zero = dq_module._FloatDq.new(q)
    zero.lo.zero_()
    dq = selected._sel_dq_pairs(q, k, v, idx.to(device), doc_pos, dout, lse_g, delta, zero, p, scale,
                                dq_module._sel_dq_reduce_chunk).lo.view(q.shape)
    return {"dq": rel(dq.cpu().float(), dq_ref), "nan": bool(torch.isnan(dq).any())}


def random_doc_positions(batch: int, num_keys: int, seed: int) -> torch.Tensor:
    """doc_pos (B, T) int64 of a random layout: packed documents (positions restart at two random cuts per row),
    left padding on row 0, right padding on row 1, a run of padding inside row 2 (batch >= 3)."""
    layout, _, _ = import_nsa()
    gen = torch.Generator().manual_seed(seed)
    mask = torch.ones(batch, num_keys, dtype=torch.long)
    mask[0, : int(torch.randint(1, max(2, num_keys // 2), (1,), generator=gen))] = 0
    mask[1, num_keys - int(torch.randint(1, max(2, num_keys // 2), (1,), generator=gen)):] = 0
    if batch > 2 and num_keys > 30:
        hole = int(torch.randint(10, num_keys - 20, (1,), generator=gen))
        mask[2, hole : hole + 7] = 0
    position_ids = torch.zeros(batch, num_keys, dtype=torch.long)
    for b in range(batch):
        pos = torch.arange(num_keys)
        for cut in sorted(torch.randint(1, max(2, num_keys), (2,), generator=gen).tolist()):
            pos = torch.where(torch.arange(num_keys) >= cut, torch.arange(num_keys) - cut, pos)
        position_ids[b] = pos
    return layout.document_positions(position_ids, mask, batch, num_keys, torch.device("cpu"))


def layout_by_torch(cmp_end, doc_pos, num_queries, num_win, params):
    """The per-query intervals (c_lo, c_hi, w_lo, w_hi) in torch ops, as the launcher computed them before
    _layout_kernel (about 25 ops): the kernel's oracle."""
    batch, num_keys = doc_pos.shape
    q_off = num_keys - num_queries
    t_abs = torch.arange(q_off, num_keys, device=doc_pos.device).expand(batch, -1)
    pos = doc_pos[:, q_off:]
    valid = pos >= 0
    start = t_abs - pos
    ends = torch.where(cmp_end >= 0, cmp_end, torch.iinfo(torch.int64).max).contiguous()
    c_lo = torch.searchsorted(ends, start.contiguous(), right=False)
    c_hi = torch.searchsorted(ends, t_abs.contiguous(), right=True)
    c_lo, c_hi = torch.where(valid, c_lo, 0), torch.where(valid, torch.maximum(c_hi, c_lo), 0)
    w_off = num_keys - num_win
    w_lo = (torch.maximum(start, t_abs - params.window_size + 1) - w_off).clamp(min=0)
    w_hi = t_abs + 1 - w_off
    return tuple(torch.where(valid, x, 0).to(torch.int32) for x in (c_lo, c_hi, w_lo, w_hi))


def random_layouts(case: dict):
    """(doc_pos, params, cmp_end) of a layout or ranges case: random layouts (random_doc_positions, seeds
    case["seeds"]) for every (compressed block, stride, window) in case["params"]."""
    layout, _, _ = import_nsa()
    for seed in case["seeds"]:
        doc_pos = random_doc_positions(case["B"], case["T"], seed)
        for cmp_l, cmp_d, window in case["params"]:
            p = layout.NSAParams(cmp_block_size=cmp_l, cmp_stride=cmp_d, sel_block_size=16, sel_num_blocks=4,
                                 sel_init_blocks=1, sel_local_blocks=2, window_size=window)
            yield doc_pos, p, layout.compressed_token_ends(doc_pos, p)


def run_layout_case(case: dict) -> dict:
    """_layout_kernel against layout_by_torch over random layouts (seeds case["seeds"]), for every (compressed
    block, stride, window) in case["params"], the queries the last T - q_off positions and the window the last
    T - w_off keys; mismatching elements counted."""
    interval = kernel_module("interval")
    res = {"mismatches": 0, "checked": 0, "slots_max": 0}
    for doc_pos, p, cmp_end in random_layouts(case):
        num_q, num_win = case["T"] - case.get("q_off", 0), case["T"] - case.get("w_off", 0)
        got = interval._layout(cmp_end, doc_pos, num_q, num_win, p)
        want = layout_by_torch(cmp_end, doc_pos, num_q, num_win, p)
        for g, w in zip(got, want):
            assert g.dtype == torch.int32 and g.shape == w.shape, (g.dtype, g.shape, w.shape)
            res["mismatches"] += int((g != w).sum())
            res["checked"] += w.numel()
        res["slots_max"] = max(res["slots_max"], cmp_end.shape[1])
    return res


def query_ranges_by_definition(lo, hi, num_keys, block_n):
    """_interval_query_ranges's (qa, qb, ia, ib) for one branch from their definitions: the running maxima in a
    Python loop over the queries, then per key tile the counts of queries below each bound and the first empty
    interval at or after ia (whole-row comparisons, none of the launcher's chunks or binary searches)."""
    batch, num_q = lo.shape
    n_tiles = -(-max(num_keys, 1) // block_n)
    out = [torch.zeros(batch, n_tiles, dtype=torch.int32) for _ in range(4)]
    c0 = torch.arange(n_tiles) * block_n  # (tiles,)
    c1 = (c0 + block_n).clamp(max=num_keys)
    for b in range(batch):
        lo_b, hi_b = lo[b].tolist(), hi[b].tolist()
        hi_m, seen_m, lo_m, run_hi, run_seen, run_lo = [], [], [], -1, -1, -1
        for t in range(num_q):
            run_hi, run_lo = max(run_hi, hi_b[t]), max(run_lo, lo_b[t])
            run_seen = max(run_seen, lo_b[t] if hi_b[t] > lo_b[t] else 0)
            hi_m.append(run_hi), seen_m.append(run_seen), lo_m.append(run_lo)
        hi_m, seen_m, lo_m = (torch.tensor(x)[None, :] for x in (hi_m, seen_m, lo_m))  # (1, Tq)
        qa = (hi_m <= c0[:, None]).sum(1)  # queries before the first whose running max of hi passes c0
        qb = (seen_m < c1[:, None]).sum(1)
        ia = (hi_m < (c0 + block_n)[:, None]).sum(1)
        ib = torch.maximum((lo_m <= c0[:, None]).sum(1), ia)
        empty = torch.tensor([u for u in range(num_q) if hi_b[u] <= lo_b[u]] + [num_q])  # (E + 1,) ascending
        next_empty = empty[torch.searchsorted(empty, ia)]  # the first empty interval at or after ia
        for k, value in enumerate((qa, qb, ia, torch.minimum(ib, next_empty))):
            out[k][b] = value.to(torch.int32)
    return out


def run_ranges_case(case: dict) -> dict:
    """_interval_query_ranges (two launches: chunk scans, then searches) against query_ranges_by_definition for
    both interval branches, on random layouts (packed documents, padding on both sides and inside a row), for
    every (compressed block, stride, window) in case["params"]; case["range_chunk"] forces the launcher's query chunk
    (small chunks: many chunks per row, runs and empty intervals crossing chunk ends). Also what the ranges
    mean to the dK/dV kernel: every query seeing a key of a tile lies in [qa, qb), every query in [ia, ib) sees
    all of it. Counts mismatches, violations and the unmasked runs found."""
    interval = kernel_module("interval")
    res = {"mismatches": 0, "violations": 0, "checked": 0, "runs": 0}
    block_n = case.get("block_n", 64)
    with case_launch(case):
        for doc_pos, p, cmp_end in random_layouts(case):
            num_q = case["T"]
            intervals = torch.stack(layout_by_torch(cmp_end, doc_pos, num_q, num_q, p))
            num_keys = (cmp_end.shape[1], num_q)
            got = interval._interval_query_ranges(intervals, num_keys, block_n)
            for (lo, hi), keys, ranges in zip((intervals[:2], intervals[2:]), num_keys, got):
                want = query_ranges_by_definition(lo, hi, keys, block_n)
                for mine, expected in zip(ranges, want):
                    assert mine.dtype == torch.int32 and mine.is_contiguous() and mine.shape == expected.shape
                    res["mismatches"] += int((mine != expected).sum())
                    res["checked"] += expected.numel()
                qa, qb, ia, ib = (x.long()[:, :, None] for x in ranges)  # (B, tiles, 1)
                res["runs"] += int((ia < ib).sum())
                c0 = (torch.arange(qa.shape[1]) * block_n)[None, :, None]
                c1 = (c0 + block_n).clamp(max=keys)
                t = torch.arange(num_q)[None, None, :]
                lo_, hi_ = lo[:, None, :], hi[:, None, :]  # (B, 1, Tq)
                sees = (lo_ < hi_) & (lo_ < c1) & (hi_ > c0)  # (B, tiles, Tq): the query sees a key of the tile
                res["violations"] += int((sees & ((t < qa) | (t >= qb))).sum())
                in_run = (t >= ia) & (t < ib)  # every query of the unmasked run sees all of the tile
                res["violations"] += int((in_run & ~((lo_ <= c0) & (hi_ >= c0 + block_n))).sum())
    return res


def selection_errors(idx_tri: torch.Tensor, captured: dict) -> dict:
    """The kernel's selected blocks idx_tri against the reference's (captured by _reference_on): equal except at
    genuine near-ties (idx_tie_gap: the largest score gap, relative to the row's largest score, between the
    blocks the two chose where they differ) and listed in the reference's priority order (idx_order_gap)."""
    res = {}
    ref_idx, scores = captured["ref"], captured["scores"]
    res["idx_shape_ok"] = tuple(ref_idx.shape) == tuple(idx_tri.shape)
    diff = (ref_idx != idx_tri).any(-1)
    res["idx_rows_differ"] = int(diff.sum())
    res["idx_rows"] = int(diff.numel())
    scale = scores.abs().amax(-1, keepdim=True).double().clamp_min(1e-12)

    def scores_at(ix):  # the reference's score of each listed block, in list order
        return scores.gather(-1, ix.clamp(min=0)).double()

    if diff.any():
        def chosen_scores(ix):
            s = scores_at(ix)
            return torch.where(ix >= 0, s, torch.full_like(s, -1.0)).sort(-1, descending=True).values
        a, b_ = chosen_scores(ref_idx)[diff], chosen_scores(idx_tri)[diff]
        res["idx_tie_gap"] = ((a - b_).abs() / scale[diff]).max().item()
        res["idx_sets_valid"] = bool(((idx_tri[diff] >= 0) == (ref_idx[diff] >= 0)).all())
    else:
        res["idx_tie_gap"] = 0.0
        res["idx_sets_valid"] = True
    # order: where both chose the same blocks, each position's block has the reference's score up to near-ties
    # (the lists are by priority: forced blocks first, then by score, ties to the lower index)
    same_set = (ref_idx.sort(-1).values == idx_tri.sort(-1).values).all(-1) & diff
    if same_set.any():
        res["idx_order_gap"] = ((scores_at(ref_idx) - scores_at(idx_tri)).abs() / scale)[same_set].max().item()
    else:
        res["idx_order_gap"] = 0.0
    return res


def in_buffer(x: torch.Tensor, front: int = 3, back: int = 5) -> torch.Tensor:
    """x as NSACache holds it: a view of a larger (B, front + n + back, ...) buffer, each row contiguous, the
    rest NaN (floats) or 7 (ints), so a read outside the view or with the wrong batch stride shows."""
    buffer = x.new_full((x.shape[0], front + x.shape[1] + back, *x.shape[2:]), float("nan") if x.is_floating_point() else 7)
    buffer[:, front : front + x.shape[1]] = x
    return buffer[:, front : front + x.shape[1]]


def static_layout(t, ce, doc_pos, Tk, Tw):
    """The cache as NSACache(static=True) holds it after Tk keys: key and position buffers of the case's full
    length (keys not written yet NaN, their positions -1), the window a ring of Tw slots (key p at p % Tw; slots
    not written yet NaN), and the query's key index Tk - 1 as a tensor. Any read of an unwritten entry shows."""
    nan = float("nan")
    k_slc, v_slc = t["k_slc"].clone(), t["v_slc"].clone()
    k_slc[:, Tk:], v_slc[:, Tk:] = nan, nan
    dp = doc_pos.clone()
    dp[:, Tk:] = -1
    k_win = t["k_win"].new_full((t["k_win"].shape[0], Tw, *t["k_win"].shape[2:]), nan)
    v_win = k_win.clone()
    kept = torch.arange(max(0, Tk - Tw), Tk)
    k_win[:, kept % Tw], v_win[:, kept % Tw] = t["k_win"][:, kept], t["v_win"][:, kept]
    query_end = torch.tensor([Tk - 1], dtype=torch.long, device=doc_pos.device)
    return [t["k_cmp"], t["v_cmp"], ce, k_slc, v_slc, k_win, v_win, dp], query_end


@with_case_launch
def run_decode_case(case: dict) -> dict:
    """Decoding after a cache, Triton vs reference at every position Tk in steps: the last `chunk` (default 1) of
    the Tk positions as queries, the window cache the Tw keys before the first query and the chunk's own (the
    last Tw + chunk - 1; NSACache passes that many with one K/V set, more with a window set of its own and after
    an assisted-decoding crop: a Tw of T covers those). chunk > 1 is a chunked prefill or a speculative
    verification (nsa_decode_triton runs the training forward's kernels on the chunk).
    cache_views: every cache tensor a view of a larger buffer (`in_buffer`), as NSACache passes them.
    static: NSACache(static=True)'s layout (`static_layout`), for both the kernels and the reference."""
    layout, reference, tri = import_nsa()
    t, cmp_end_full, doc_pos, p, dtype, device = case_setup(case)
    chunk = case.get("chunk", 1)
    if chunk > 1 and (case.get("static") or min(case["steps"]) < chunk):
        raise ValueError(f"decode case: chunk={chunk} needs every step >= chunk and no static cache (one query)")
    worst = 0.0
    for Tk in case["steps"]:
        Tw = min(Tk, case.get("Tw", p.window_size) + chunk - 1)
        dp = doc_pos[:, :Tk]
        ce = layout.compressed_token_ends(dp, p, num_slots=cmp_end_full.shape[1])
        # slots of the prefix are the first slots of the full layout (sorted by end index)
        sl = lambda x: x[:, :Tk]  # noqa: E731
        cache = [t["k_cmp"], t["v_cmp"], ce, sl(t["k_slc"]), sl(t["v_slc"]), t["k_win"][:, Tk - Tw : Tk],
                 t["v_win"][:, Tk - Tw : Tk], dp]
        if case.get("cache_views"):
            cache = [in_buffer(x) for x in cache]
        query_end = None
        if case.get("static"):  # its oracle: the reference on the plain layout (the static one must not change it)
            plain = [x.float() if x.is_floating_point() else x for x in cache]
            cache, query_end = static_layout(t, ce, doc_pos, Tk, case.get("Tw", p.window_size))
        k_cmp, v_cmp, ce, k_slc, v_slc, k_win, v_win, dp = cache
        queries = slice(Tk - chunk, Tk)
        args = (t["q"][:, queries], k_cmp, v_cmp, ce, k_slc, v_slc, k_win, v_win, t["gates"][:, queries], dp, p)
        o = tri.nsa_decode_triton(*args, query_end=query_end)
        floats = [a.float() if torch.is_tensor(a) and a.is_floating_point() else a for a in args]
        if query_end is not None:
            static_ref = reference.nsa_attention_reference(*floats, query_end=query_end)
            floats[1:8], floats[9] = plain[:7], plain[7]
        r = reference.nsa_attention_reference(*floats)
        if query_end is not None:
            worst = max(worst, rel(static_ref, r) if r.norm() > 0 else static_ref.abs().max().item())
        worst = max(worst, rel(o, r) if r.norm() > 0 else o.float().abs().max().item())
    return {"decode": worst}


PDL_DECODE_POSITIONS = (1000, 4097, 9000)  # three block ranges of a 9,000-token row


def pdl_decode_case(device) -> types.SimpleNamespace:
    """The decoding calls test_gpu_decode_pdl_equals_the_default_eager_and_graphed compares (and the warm step of
    bench/gpu_session.sh compiles): rows of packed documents, 2 x 9,000 keys, 12 q / 2 kv heads. `eager(tk)` decodes
    the query at position tk - 1 from the first tk keys; `static_step()` is a static cache's step (fixed-size
    buffers, the window as a ring, the query's index on the device), positioned by `set_position(tk)`."""
    _, _, tri = import_nsa()
    t, cmp_end, doc_pos, p = make_inputs(2, 9000, 12, 2, 64, DEFAULT, torch.bfloat16, device, "varlen")
    w = p.window_size

    def eager(tk):
        return tri.nsa_decode_triton(t["q"][:, tk - 1:tk], t["k_cmp"], t["v_cmp"], cmp_end, t["k_slc"][:, :tk],
                                     t["v_slc"][:, :tk], t["k_win"][:, tk - w:tk], t["v_win"][:, tk - w:tk],
                                     t["gates"][:, tk - 1:tk], doc_pos[:, :tk], p)

    query_end = torch.tensor([0], device=device)
    q_step, gates_step = torch.empty_like(t["q"][:, :1]), torch.empty_like(t["gates"][:, :1])
    ring_k, ring_v = torch.empty_like(t["k_win"][:, :w]), torch.empty_like(t["v_win"][:, :w])

    def static_step():
        return tri.nsa_decode_triton(q_step, t["k_cmp"], t["v_cmp"], cmp_end, t["k_slc"], t["v_slc"], ring_k, ring_v,
                                     gates_step, doc_pos, p, query_end=query_end)

    def set_position(tk):
        query_end.fill_(tk - 1)
        q_step.copy_(t["q"][:, tk - 1:tk])
        gates_step.copy_(t["gates"][:, tk - 1:tk])
        slots = torch.arange(tk - w, tk, device=device) % w  # key p at ring slot p % w
        ring_k[:, slots], ring_v[:, slots] = t["k_win"][:, tk - w:tk], t["v_win"][:, tk - w:tk]

    return types.SimpleNamespace(eager=eager, static_step=static_step, set_position=set_position, params=p,
                                 head_dim=64, device=t["q"].device, positions=PDL_DECODE_POSITIONS)


def _device_inputs(B, T, H, Hkv, D, p, dtype, device, seed=0):
    """make_inputs' tensors (one document per row), drawn on the device: the large-offset cases hold GBs."""
    layout, _, _ = import_nsa()
    doc_pos = torch.arange(T, device=device).expand(B, T).contiguous()
    cmp_end = layout.compressed_token_ends(doc_pos, p)
    gen = torch.Generator(device).manual_seed(seed)
    Nc = cmp_end.shape[1]

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=dtype)

    t = dict(q=rnd(B, T, H, D), k_cmp=rnd(B, Nc, Hkv, D), v_cmp=rnd(B, Nc, Hkv, D), k_slc=rnd(B, T, Hkv, D),
             v_slc=rnd(B, T, Hkv, D), k_win=rnd(B, T, Hkv, D), v_win=rnd(B, T, Hkv, D))
    t["gates"] = torch.sigmoid(rnd(B, T, H, 3).float()).to(dtype)
    return t, cmp_end, doc_pos


def _reference_on(t, cmp_end, doc_pos, p, idx, dout, captured=None):
    """The fp32 reference's output and input gradients (for output gradient dout; None: the forward alone, no
    gradients) on the kernel's selection idx (near-ties may pick other blocks: see the module docstring).
    captured, when given, receives the reference's block scores ("scores") and its own selection ("ref"), on
    CPU."""
    _, reference, _ = import_nsa()
    leaves = {n: t[n].detach().float().clone().requires_grad_(True) for n in GRAD_NAMES}
    orig = reference.select_blocks

    def kernel_selection(block_scores, q_doc_pos, prm):
        if captured is not None:
            captured["scores"] = block_scores.detach().cpu()
            captured["ref"] = orig(block_scores, q_doc_pos, prm).cpu()
        return idx.to(block_scores.device)

    reference.select_blocks = kernel_selection
    try:
        out = reference.nsa_attention_reference(
            leaves["q"], leaves["k_cmp"], leaves["v_cmp"], cmp_end, leaves["k_slc"], leaves["v_slc"],
            leaves["k_win"], leaves["v_win"], leaves["gates"], doc_pos, p,
        )
    finally:
        reference.select_blocks = orig
    if dout is None:
        return out.detach(), None
    out.backward(dout.float())
    return out.detach(), {n: leaves[n].grad for n in GRAD_NAMES}


def run_large_offset_case(case: dict) -> dict:
    """The op (forward and backward) on a batch whose q-sized tensors hold more than 2**31 elements, so the
    last rows' offsets overflow int32: the kernels must address in int64. For rows `case["rows"]` (the first
    and the last): the full batch must give them exactly the selection and output the kernels give them in
    a batch of their own (small offsets), and their gradients must match the fp32 reference on those rows."""
    layout, _, tri = import_nsa()
    dtype, device = getattr(torch, case.get("dtype", "bfloat16")), case.get("device", "cuda")
    p = layout.NSAParams(**(TINY if case.get("params", "default") == "tiny" else DEFAULT))
    B, T, H, Hkv, D, rows = case["B"], case["T"], case["H"], case["Hkv"], case["D"], case["rows"]
    t, cmp_end, doc_pos = _device_inputs(B, T, H, Hkv, D, p, dtype, device)

    def op(x, ce, dp):
        return tri.nsa_attention_triton(x["q"], x["k_cmp"], x["v_cmp"], ce, x["k_slc"], x["v_slc"], x["k_win"],
                                        x["v_win"], x["gates"], dp, p)

    for x in t.values():
        x.requires_grad_(True)
    out = op(t, cmp_end, doc_pos)
    dout = torch.randn(out.shape, generator=torch.Generator(device).manual_seed(1), device=device, dtype=dtype)
    out.backward(dout)
    out = out.detach()[rows]
    dout = dout[rows]
    idx = tri.select_blocks_triton(t["q"].detach(), t["k_cmp"].detach(), cmp_end, doc_pos, p)[rows]
    grads = {n: t[n].grad[rows] for n in GRAD_NAMES}
    alone = {n: t[n].detach()[rows] for n in GRAD_NAMES}
    cmp_end, doc_pos = cmp_end[rows], doc_pos[rows]
    del t  # the full batch (GBs) is no longer needed
    with torch.no_grad():
        out_alone = op(alone, cmp_end, doc_pos)
    idx_alone = tri.select_blocks_triton(alone["q"], alone["k_cmp"], cmp_end, doc_pos, p)
    res = {"q_elements / 2**31": B * T * H * D / 2**31, "finite": bool(torch.isfinite(out).all()),
           "idx_equal_alone": bool(torch.equal(idx, idx_alone)), "out_equal_alone": bool(torch.equal(out, out_alone))}
    ref_out, ref_grads = _reference_on(alone, cmp_end, doc_pos, p, idx, dout)
    res["out"] = rel(out, ref_out)
    res.update({"d" + n: rel(grads[n], ref_grads[n]) for n in GRAD_NAMES})
    return res


def run_large_offset_decode_case(case: dict) -> dict:
    """One decoding step over a cache whose K/V hold more than 2**31 elements (B x Tk x Hkv x D): for rows
    `case["rows"]` (the first and the last) the full batch must give exactly the output of a batch of those
    rows alone (small offsets), and a finite one."""
    layout, _, tri = import_nsa()
    dtype, device = getattr(torch, case.get("dtype", "bfloat16")), case.get("device", "cuda")
    p = layout.NSAParams(**(TINY if case.get("params", "default") == "tiny" else DEFAULT))
    B, Tk, H, Hkv, D, rows = case["B"], case["T"], case["H"], case["Hkv"], case["D"], case["rows"]
    doc_pos = torch.arange(Tk, device=device).expand(B, Tk).contiguous()
    cmp_end = layout.compressed_token_ends(doc_pos, p)
    gen = torch.Generator(device).manual_seed(0)
    rnd = lambda *shape: torch.randn(*shape, generator=gen, device=device, dtype=dtype)  # noqa: E731
    Nc, w = cmp_end.shape[1], min(Tk, p.window_size)
    x = dict(q=rnd(B, 1, H, D), k_cmp=rnd(B, Nc, Hkv, D), v_cmp=rnd(B, Nc, Hkv, D), k_slc=rnd(B, Tk, Hkv, D),
             v_slc=rnd(B, Tk, Hkv, D), k_win=rnd(B, w, Hkv, D), v_win=rnd(B, w, Hkv, D),
             gates=torch.sigmoid(rnd(B, 1, H, 3).float()).to(dtype))

    def step(r):
        return tri.nsa_decode_triton(x["q"][r], x["k_cmp"][r], x["v_cmp"][r], cmp_end[r], x["k_slc"][r],
                                     x["v_slc"][r], x["k_win"][r], x["v_win"][r], x["gates"][r], doc_pos[r], p)

    out = step(slice(None))[rows]
    out_alone = step(rows)  # (a copy of those rows: small offsets)
    return {"kv_elements / 2**31": B * Tk * Hkv * D / 2**31, "finite": bool(torch.isfinite(out).all()),
            "out_equal_alone": bool(torch.equal(out, out_alone))}


@with_case_launch
def run_compile_case(case: dict) -> dict:
    """torch.compile(fullgraph=True) of the op (AOTAutograd, `case["backend"]`) against eager: loss and
    all gradients. The custom ops' fake implementations, autograd registration and unused-output
    gradients are what this exercises."""
    _, _, tri = import_nsa()
    t, cmp_end, doc_pos, p, _, _ = case_setup(case)

    def loss(q, kc, vc, ks, vs, kw, vw, g):
        return tri.nsa_attention_triton(q, kc, vc, cmp_end, ks, vs, kw, vw, g, doc_pos, p).square().sum()

    results = []
    for fn in (loss, torch.compile(loss, fullgraph=True, backend=case.get("backend", "aot_eager"))):
        leaves = [t[n].clone().requires_grad_(True) for n in GRAD_NAMES]
        value = fn(*leaves)
        value.backward()
        results.append([value.detach()] + [x.grad for x in leaves])
    return {"compile": max(rel(c, e) for c, e in zip(results[1], results[0]))}


@with_case_launch
def run_opcheck_case(case: dict) -> dict:
    """torch.library.opcheck of the custom ops at the case's shape: schema, autograd registration, the fake
    implementations against the real outputs (shapes, dtypes, strides: what torch.compile traces with) and
    AOT dispatch. Returns {"fwd/<check>": "SUCCESS" or the error}. The static decoding step's op at a static
    cache's layout after T - 5 keys."""
    _, _, tri = import_nsa()
    t, cmp_end, doc_pos, p, _, _ = case_setup(case)
    args = tri._prepare(t["q"], t["k_cmp"], t["v_cmp"], cmp_end, t["k_slc"], t["v_slc"], t["k_win"], t["v_win"],
                        t["gates"], doc_pos)
    params, scale = tri._params_tuple(p), case["D"] ** -0.5
    leaves = [a.clone().requires_grad_(True) if a.is_floating_point() else a for a in args]
    outs = tri._nsa_fwd_op(*args, params, scale)
    dout = torch.randn_like(outs[0])
    res = {}
    # (the pair-wise dQ's backward writes its fp32 dQ over o_cmp and o_win, declared mutated: opcheck's schema check
    # fails an op that mutates an argument it does not declare; it gets copies of the outputs)
    for name, op, op_args, overrides in [
            ("fwd", tri._nsa_fwd_op, (*leaves, params, scale), {}),
            ("bwd", tri._nsa_bwd_op, (dout, *args, *outs[1:], params, scale), {}),
            ("bwd_reusing_outputs", tri._nsa_bwd_reusing_op,
             (dout, *args, *[o.clone() for o in outs[1:]], params, scale), dict(sel_dq_in_dkdv=True))]:
        with tri.launch_overrides(**overrides):
            checks = torch.library.opcheck(op, op_args, raise_exception=False)
        res.update({f"{name}/{check}": str(outcome)[:400] for check, outcome in checks.items()})
    Tk = case["T"] - 5
    ce = import_nsa()[0].compressed_token_ends(doc_pos[:, :Tk], p, num_slots=cmp_end.shape[1])
    cache, query_end = static_layout(t, ce, doc_pos, Tk, p.window_size)
    cache = [torch.nan_to_num(x) if x.is_floating_point() else x for x in cache]  # opcheck compares outputs
    step = tri._prepare(t["q"][:, Tk - 1 : Tk], *cache[:7], t["gates"][:, Tk - 1 : Tk], cache[7], batch_strided=True)
    checks = torch.library.opcheck(tri._nsa_decode_static_op, (*step, query_end, params, scale), raise_exception=False)
    res.update({f"decode_static/{check}": str(outcome)[:400] for check, outcome in checks.items()})
    return res


# torch ops that wait for the device on a GPU: a value read by the host (item, tolist, bool(), int()) or an output
# whose size depends on the data (nonzero, boolean indexing, unique, ...)
HOST_SYNCING_OPS = {"_local_scalar_dense", "nonzero", "nonzero_static", "masked_select", "unique", "_unique",
                    "_unique2", "unique_dim", "unique_consecutive", "equal", "is_nonzero", "argwhere"}


class HostSyncRecorder(TorchDispatchMode):
    """Inside the block, every torch op run (`ops`, by name) and those that would make the host wait for the GPU
    (`syncs`: HOST_SYNCING_OPS and indexing by a boolean mask), each with the modeling_nsa line that ran it. A
    dispatch mode sees a custom op, not the ops inside it: record below the custom ops to see the launchers'."""

    def __init__(self):
        super().__init__()
        self.ops, self.syncs = [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        import traceback

        name = func.overloadpacket.__name__
        self.ops.append(name)
        bool_index = name == "index" and any(torch.is_tensor(i) and i.dtype == torch.bool
                                             for i in args[1] if i is not None)
        if name in HOST_SYNCING_OPS or bool_index:
            frames = [f for f in traceback.extract_stack() if "modeling_nsa" in f.filename]
            where = f"{Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else "?"
            self.syncs.append(f"{name} at {where}")
        return func(*args, **(kwargs or {}))


@with_case_launch
def run_host_sync_case(case: dict) -> dict:
    """Every torch op the op's launchers run for one training forward and backward and two decoding steps (eager
    and a static cache's), called below the custom ops (HostSyncRecorder): those that would make the host wait for
    the GPU, each with the launcher line that ran it. The launchers promise none: the host queues a step's kernels
    without waiting, so steps pipeline (bench/KERNELS.md: a wait per layer exposes the host's launch time and the
    GPU's idle)."""
    layout, _, tri = import_nsa()
    t, cmp_end, doc_pos, p, _, _ = case_setup(case)
    args = tri._prepare(t["q"], t["k_cmp"], t["v_cmp"], cmp_end, t["k_slc"], t["v_slc"], t["k_win"], t["v_win"],
                        t["gates"], doc_pos)
    params, scale = tri._params_tuple(p), case["D"] ** -0.5
    dout = torch.randn_like(t["q"])
    Tk = case["T"] - 5
    ce = layout.compressed_token_ends(doc_pos[:, :Tk], p, num_slots=cmp_end.shape[1])
    cache, query_end = static_layout(t, ce, doc_pos, Tk, p.window_size)
    w = min(Tk, p.window_size)
    eager_step = tri._prepare(t["q"][:, Tk - 1:Tk], t["k_cmp"], t["v_cmp"], ce, t["k_slc"][:, :Tk], t["v_slc"][:, :Tk],
                              t["k_win"][:, Tk - w:Tk], t["v_win"][:, Tk - w:Tk], t["gates"][:, Tk - 1:Tk],
                              doc_pos[:, :Tk], batch_strided=True)
    static_step = tri._prepare(t["q"][:, Tk - 1:Tk], *cache[:7], t["gates"][:, Tk - 1:Tk], cache[7], batch_strided=True)
    decode = kernel_module("decode")
    with HostSyncRecorder() as recorder:
        outs = tri._nsa_fwd_op._init_fn(*args, params, scale)
        tri._backward_op(outs[1], outs[3])._init_fn(dout, *args, *outs[1:], params, scale)
        decode._decode_step(*eager_step, p, scale)
        tri._nsa_decode_static_op._init_fn(*static_step, query_end, params, scale)
    return {"syncs": recorder.syncs, "ops": len(recorder.ops)}


class PoisonedAllocations(types.ModuleType):
    """torch as the kernel files see it in the kernel tests: torch.empty / torch.empty_like return memory filled with
    NaN (floating point) or 2**30 (integers) instead of whatever the allocator held. On a GPU that memory is
    arbitrary (often an earlier tensor's values, NaN included), while fresh CPU memory tends to be zero, so a
    kernel reading an element it never wrote, or a launcher leaving part of an output unwritten, would pass on
    CPU and fail on a GPU; poisoned, the NaN or the out-of-range index shows in the results."""

    def __init__(self):
        super().__init__("torch")

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def _poison(x):
        return x.fill_(float("nan") if x.is_floating_point() else (True if x.dtype == torch.bool else 1 << 30))

    def empty(self, *args, **kwargs):
        return self._poison(torch.empty(*args, **kwargs))

    def empty_like(self, *args, **kwargs):
        return self._poison(torch.empty_like(*args, **kwargs))


class MemoryAccessError(RuntimeError):
    pass


def check_memory_accesses():
    """Make Triton's interpreter check every load and store of a kernel, as compute-sanitizer's memcheck and
    racecheck do on a GPU. Within one launch:
    - each address a program touches (mask on) lies inside one of the tensors the kernel was launched with (a
      view's whole span): the interpreter reads and writes raw host addresses unchecked, so an access outside
      returns a neighbour's bytes or corrupts them and may pass on CPU; on a GPU it faults or corrupts silently;
    - no program reads or writes an element another program of the launch wrote: the interpreter runs programs
      one after another, so such a dependency works on CPU; on a GPU they run concurrently and it is a race.
      Except a read ordered by atomics, as on a GPU: a program's atomic with release semantics (at GPU scope)
      publishes the writes it made before it, and a later atomic on the same address with acquire semantics makes
      them readable by its program (a decode part that counts itself after storing its partial and, arriving
      last, reads the others', nsa_triton_decode._decode_parts_kernel). Writes after the release stay private.
    Raises MemoryAccessError naming the kernel, the program and the access."""
    import numpy as np
    from triton.runtime import interpreter

    launch = {}  # the running launch: kernel, tensors' address ranges, addresses earlier programs wrote

    def spans(values):
        for x in values:
            if isinstance(x, (tuple, list)):
                yield from spans(x)
            elif torch.is_tensor(x) and x.numel() > 0:
                extent = 1 + sum((size - 1) * stride for size, stride in zip(x.shape, x.stride()))
                yield x.data_ptr(), x.data_ptr() + extent * x.element_size()

    init_args = interpreter.GridExecutor._init_args_hst

    def init_args_recording_ranges(self, args_dev, kwargs):
        args_hst, kwargs_hst = init_args(self, args_dev, kwargs)
        merged = []
        for lo, hi in sorted(spans([*args_hst, *kwargs_hst.values()])):
            if merged and lo <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], hi)
            else:
                merged.append([lo, hi])
        launch.clear()
        launch.update(kernel=self.fn.__name__, lo=np.array([r[0] for r in merged], dtype=np.uint64),
                      hi=np.array([r[1] for r in merged], dtype=np.uint64), program=None,
                      written_before=np.empty(0, np.uint64), written_now=[], released={},
                      acquired=np.empty(0, np.uint64))
        return args_hst, kwargs_hst

    set_grid_idx = interpreter.InterpreterBuilder.set_grid_idx

    def set_grid_idx_closing_the_program(self, x, y, z):
        if launch:
            if launch["written_now"]:  # the finished program's writes join those the next programs may not touch
                launch["written_before"] = np.union1d(launch["written_before"], np.concatenate(launch["written_now"]))
                launch["written_now"] = []
            launch["program"] = (x, y, z)
            launch["acquired"] = np.empty(0, np.uint64)
        return set_grid_idx(self, x, y, z)

    def fail(kind, what, count, first):
        raise MemoryAccessError(f"{launch['kernel']}, program {launch['program']}: {kind} of {count} element(s) "
                                f"{what} (first at {first})")

    def check(kind, ptrs, mask):
        address = ptrs.data[np.broadcast_to(mask.data, ptrs.data.shape)].astype(np.uint64).ravel()
        if address.size == 0 or not launch:
            return
        size = np.uint64(np.dtype(interpreter._get_np_dtype(ptrs.get_element_ty())).itemsize)
        i = np.searchsorted(launch["lo"], address, side="right") - 1
        inside = (i >= 0) & (address + size <= launch["hi"][np.maximum(i, 0)])
        if not inside.all():
            bad = int(address[~inside][0])
            gaps = [bad - int(hi) if bad >= int(hi) else bad - int(lo) for lo, hi in zip(launch["lo"], launch["hi"])]
            nearest = min(gaps, key=abs)
            fail(kind, "outside every tensor it was given", int((~inside).sum()),
                 f"{nearest:+d} bytes {'past the end of' if nearest >= 0 else 'before'} the nearest one")
        before = launch["written_before"]
        if before.size:
            j = np.minimum(np.searchsorted(before, address), before.size - 1)
            shared = before[j] == address
            if kind == "load" and launch["acquired"].size:  # published to this program through an atomic
                shared &= ~np.isin(address, launch["acquired"])
            if shared.any():
                fail(kind, "that another program of the launch wrote (a race on a GPU)", int(shared.sum()),
                     f"byte {int(address[shared][0] - launch['lo'][i[shared][0]])} of its tensor")
        if kind == "store":
            launch["written_now"].append(address)

    load, store = interpreter.InterpreterBuilder.create_masked_load, interpreter.InterpreterBuilder.create_masked_store

    def checked_load(self, ptrs, mask, *rest):  # (the arguments after mask differ between triton versions)
        check("load", ptrs, mask)
        return load(self, ptrs, mask, *rest)

    def checked_store(self, ptrs, value, mask, *rest):
        check("store", ptrs, mask)
        return store(self, ptrs, value, mask, *rest)

    atomic_rmw = interpreter.InterpreterBuilder.create_atomic_rmw

    def atomic_rmw_ordering(self, rmw_op, ptr, val, mask, sem, scope):
        if launch and "CTA" not in str(scope).upper():  # (a block-scope atomic orders nothing across programs)
            addresses = ptr.data[np.broadcast_to(mask.data, ptr.data.shape)].astype(np.uint64).ravel()
            mine = np.unique(np.concatenate(launch["written_now"])) if launch["written_now"] else np.empty(0, np.uint64)
            for address in np.unique(addresses).tolist():
                if "ACQUIRE" in str(sem).upper():  # what earlier programs released at this address
                    launch["acquired"] = np.union1d(launch["acquired"], launch["released"].get(address, mine[:0]))
                if "RELEASE" in str(sem).upper():
                    launch["released"][address] = np.union1d(launch["released"].get(address, mine[:0]), mine)
        return atomic_rmw(self, rmw_op, ptr, val, mask, sem, scope)

    interpreter.InterpreterBuilder.create_atomic_rmw = atomic_rmw_ordering
    interpreter.GridExecutor._init_args_hst = init_args_recording_ranges
    interpreter.InterpreterBuilder.set_grid_idx = set_grid_idx_closing_the_program
    interpreter.InterpreterBuilder.create_masked_load = checked_load
    interpreter.InterpreterBuilder.create_masked_store = checked_store


def vectorize_interpreter_reductions():
    """Run the interpreter's reductions and scans that have no numpy path as whole-array steps instead of one Python
    call of the combine per element (the interpreter's "slow mode"), so the kernel cases take minutes less of CI.

    - tl.xor_sum (tl.sort's compare-and-swap steps reduce with xor, triton.language.standard._xor_combine): one
      numpy reduction. Xor is associative and commutative on integers: the same array.
    - tl.associative_scan with a kernel's own combine (_max_combine, _min_combine, _or_within_block): the kernel's
      combine itself, called on whole shifted arrays in log2(n) steps (Hillis-Steele: after the step of distance d,
      element i holds the combine of elements i - 2d + 1 .. i, earlier ones as the first operand), the order of
      a GPU's tree scan; reverse scans are flipped around it as before. Exact for the integer combines the kernels
      scan with (a float combine may round otherwise, as on a GPU).
    Before these, the combines' per-element calls took ~40% (xor) and ~30% (scans) of the kernel cases' CPU.
    tests/test_triton_kernels.py checks both against the interpreter's own per-element path. Returns False where
    the interpreter lacks the methods replaced (another triton version): its own path then runs, slower."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    reduce_ops, scan_ops = getattr(interpreter, "ReduceOps", None), getattr(interpreter, "ScanOps", None)
    if not (hasattr(reduce_ops, "apply_impl") and hasattr(scan_ops, "generic_scan")
            and hasattr(tl.standard, "_xor_combine")):
        return False
    slow_reduce = reduce_ops.apply_impl
    if getattr(slow_reduce, "vectorized", False):
        return True

    def apply_impl(self, input):
        if self.combine_fn is tl.standard._xor_combine:
            data = input[0].handle.data
            return self.to_tensor(np.bitwise_xor.reduce(data, axis=self.axis, keepdims=self.keep_dims), input[0].dtype)
        return slow_reduce(self, input)

    def generic_scan(self, input):
        data = [arg.handle.data for arg in input]
        n = data[0].shape[self.axis]
        position = np.arange(n).reshape([-1 if i == self.axis else 1 for i in range(data[0].ndim)])
        d = 1
        while d < n:
            # earlier[i] = data[i - d] from i = d on (below d: data[i], a valid value whose result is not kept)
            earlier = [np.concatenate([np.take(x, np.arange(d), self.axis), np.take(x, np.arange(n - d), self.axis)],
                                      self.axis) for x in data]
            out = self.combine_fn.fn(*(self.to_tensor(x, arg.dtype) for x, arg in zip(earlier, input)),
                                     *(self.to_tensor(x, arg.dtype) for x, arg in zip(data, input)))
            out = out if isinstance(out, tuple) else (out,)
            data = [np.where(position >= d, np.broadcast_to(o.handle.data if isinstance(o, tl.core.tensor) else o,
                                                            x.shape), x).astype(x.dtype) for o, x in zip(out, data)]
            d *= 2
        return [self.to_tensor(x, arg.dtype) for x, arg in zip(data, input)]

    apply_impl.vectorized = True
    reduce_ops.apply_impl = apply_impl
    scan_ops.generic_scan = generic_scan
    return True


def patch_the_language_once_per_launch():
    """Skip the interpreter's re-patching of triton.language at every @triton.jit helper call inside a launch.

    The interpreter replaces tl's builtins with host versions when a launch starts (GridExecutor.__call__), and
    restores them when it ends. It calls the same patching again at every call of a jit helper (_patch_lang, an
    inspect.getmembers walk of tl, tl.math and tl.tensor): ~30% of the kernel cases' CPU time, for nothing where
    the helper sees only language modules patched earlier in the launch (the interpreter never restores a helper
    call's patches; the launch's restore undoes its own). Such calls now return an empty scope; the first call
    seeing another module (tl.standard's helpers see tl.core, the kernels tl) patches as before.
    Returns False where the interpreter lacks the functions replaced (another triton version)."""
    import inspect

    import triton.language as tl
    from triton.runtime import interpreter

    patch_lang = getattr(interpreter, "_patch_lang", None)
    grid_call = getattr(getattr(interpreter, "GridExecutor", None), "__call__", None)
    if patch_lang is None or grid_call is None or not hasattr(interpreter, "_LangPatchScope"):
        return False
    if getattr(patch_lang, "once_per_launch", False):
        return True
    launch = {"starting": False, "patched": None}  # the language modules patched since the running launch began

    seen_in = {}  # id of a function's module globals -> the language modules they hold (a walk per module, not call)

    def language_modules(fn) -> frozenset:
        key = id(fn.__globals__)
        if key not in seen_in:
            seen_in[key] = frozenset(id(v) for v in fn.__globals__.values()
                                     if inspect.ismodule(v) and v in (tl, tl.core))
        return seen_in[key]

    def patch_lang_once(fn):
        modules = language_modules(fn)
        if launch["starting"]:  # the launch's own patching
            launch["starting"], launch["patched"] = False, modules
            return patch_lang(fn)
        if launch["patched"] is not None:
            if modules <= launch["patched"]:
                return interpreter._LangPatchScope()  # patched earlier in this launch: nothing to undo
            launch["patched"] = launch["patched"] | modules  # e.g. tl.standard's helpers see tl.core, kernels tl
        return patch_lang(fn)

    def grid_call_marking_the_launch(self, *args, **kwargs):
        launch["starting"], launch["patched"] = True, None
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            launch["starting"], launch["patched"] = False, None

    patch_lang_once.once_per_launch = True
    interpreter._patch_lang = patch_lang_once
    interpreter.GridExecutor.__call__ = grid_call_marking_the_launch
    return True


def check_kernels_as_on_a_gpu():
    """Poisoned allocations in the kernel files' launchers and, under the interpreter, every kernel access checked
    (see PoisonedAllocations and check_memory_accesses). Call once per process, before the kernels run."""
    for module in kernel_modules():
        if hasattr(module, "torch"):
            module.torch = PoisonedAllocations()
    if os.environ.get("TRITON_INTERPRET") == "1":
        check_memory_accesses()
        vectorize_interpreter_reductions()
        patch_the_language_once_per_launch()


def main(argv):
    cases = json.loads(argv[1])
    check_kernels_as_on_a_gpu()
    results = []
    for case in cases:
        started = time.perf_counter()
        try:
            runner = {"decode": run_decode_case, "compile": run_compile_case, "opcheck": run_opcheck_case,
                      "select": run_select_case, "union": run_union_case, "layout": run_layout_case,
                      "heavyplan": run_heavy_plan_case,
                      "ranges": run_ranges_case,
                      "selfwd": run_selfwd_case, "seldq": run_seldq_case, "hostsync": run_host_sync_case,
                      "large_offset": run_large_offset_case,
                      "large_offset_decode": run_large_offset_decode_case}.get(case.get("kind"), run_case)
            res = runner(case)
        except Exception as exc:  # report, so the test names the failing case
            import traceback

            res = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-3000:]}
        res["seconds"] = round(time.perf_counter() - started, 2)  # the fixture's cost-balanced split reads these
        results.append(res)
    print("RESULTS_JSON=" + json.dumps(results))


if __name__ == "__main__":
    os.environ.setdefault("TRITON_INTERPRET", "1")
    main(sys.argv)
