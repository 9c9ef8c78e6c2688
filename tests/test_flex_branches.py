"""bench/flex_branches.py on CPU: the intervals, the block masks built from them, and FlexAttention's forward for the
compressed and window branches against the PyTorch reference (FlexAttention has no CPU backward and, uncompiled,
evaluates the mask_mod everywhere, so the block lists are checked as a property of their own; the GPU run compares
outputs and gradients with the project's kernels before it times anything)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import flex_branches  # noqa: E402
from modeling_nsa.nsa_layout import NSAParams, compressed_token_ends, document_positions  # noqa: E402
from modeling_nsa.nsa_reference import reference_branches  # noqa: E402

PARAMS = NSAParams(cmp_block_size=8, cmp_stride=4, sel_block_size=16, sel_num_blocks=3, sel_init_blocks=1,
                   sel_local_blocks=1, window_size=24)


def layout(case: str, seq_len: int, seed: int, rows: int = 2):
    """doc_pos (rows, T) and cmp_end for a row layout: "one" document per row, "docs" (random document lengths), or
    "padded" (left padding in the first row, right padding in the last, documents between: both in one row when
    rows = 1)."""
    generator = torch.Generator().manual_seed(seed)
    position_ids = torch.empty(rows, seq_len, dtype=torch.long)
    for row in range(rows):
        if case == "one":
            position_ids[row] = torch.arange(seq_len)
            continue
        filled = 0
        while filled < seq_len:
            length = int(torch.randint(1, 90, (1,), generator=generator))
            position_ids[row, filled:filled + length] = torch.arange(min(length, seq_len - filled))
            filled += length
    mask = torch.ones(rows, seq_len, dtype=torch.long)
    if case == "padded":
        mask[0, :11] = 0
        mask[-1, -13:] = 0
    doc_pos = document_positions(position_ids, mask, rows, seq_len, torch.device("cpu"))
    return doc_pos, compressed_token_ends(doc_pos, PARAMS)


CASES = [("one", 301), ("docs", 257), ("padded", 200), ("docs", 64)]


def reference_visibility(doc_pos, cmp_end):
    """(compressed (B, T, Nc), window (B, T, T)) bool: which keys each query's branch attends in the reference
    (probabilities above 0 on float64 inputs)."""
    batch, seq_len = doc_pos.shape
    generator = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    num_slots = cmp_end.shape[1]
    kv = [rand(batch, n, 1, 8) for n in (num_slots, num_slots, seq_len, seq_len, seq_len, seq_len)]
    branches = reference_branches(rand(batch, seq_len, 1, 8), kv[0], kv[1], cmp_end, kv[2], kv[3], kv[4], kv[5],
                                  doc_pos, PARAMS)  # fmt: skip
    return branches.p_cmp[:, 0, 0] > 0, branches.p_win[:, 0, 0] > 0


def inside(lo, hi, num_keys):
    return (torch.arange(num_keys) >= lo[..., None]) & (torch.arange(num_keys) < hi[..., None])


@pytest.mark.parametrize("case,seq_len", CASES, ids=[f"{c}-T{t}" for c, t in CASES])
def test_interval_bounds_are_the_keys_each_branch_attends(case, seq_len):
    doc_pos, cmp_end = layout(case, seq_len, seed=seq_len)
    c_lo, c_hi, w_lo, w_hi = flex_branches.interval_bounds(doc_pos, cmp_end, PARAMS)
    cmp_visible, win_visible = reference_visibility(doc_pos, cmp_end)
    assert torch.equal(inside(c_lo, c_hi, cmp_end.shape[1]), cmp_visible)
    assert torch.equal(inside(w_lo, w_hi, seq_len), win_visible)
    assert bool((c_lo[doc_pos < 0] == 0).all() and (c_hi[doc_pos < 0] == 0).all()), "padding sees no keys"


def expand_block_lists(counts, indices, num_q_blocks, num_k_blocks):
    """(B, 1, Qb) counts, (B, 1, Qb, Kb) indices -> (B, Qb, Kb) bool: the key blocks listed per query block."""
    batch = counts.shape[0]
    listed = torch.zeros(batch, num_q_blocks, num_k_blocks, dtype=torch.bool)
    for b in range(batch):
        for qb in range(num_q_blocks):
            listed[b, qb, indices[b, 0, qb, : counts[b, 0, qb]].long()] = True
    return listed


@pytest.mark.parametrize("block", [8, 16, 32])
@pytest.mark.parametrize("case,seq_len", CASES, ids=[f"{c}-T{t}" for c, t in CASES])
def test_block_mask_lists_every_visible_key_and_only_whole_blocks_as_full(case, seq_len, block):
    """What FlexAttention's compiled kernels rely on: a visible (query, key) pair lies in a listed block of its query
    block (partial or full), and every query of a query block sees all of each block listed as full (the kernel
    skips the mask_mod there)."""
    doc_pos, cmp_end = layout(case, seq_len, seed=seq_len + block)
    c_lo, c_hi, w_lo, w_hi = flex_branches.interval_bounds(doc_pos, cmp_end, PARAMS)
    full_blocks_seen = 0
    for lo, hi, num_keys in ((c_lo, c_hi, cmp_end.shape[1]), (w_lo, w_hi, seq_len)):
        mask, lo_p, hi_p = flex_branches.interval_block_mask(lo, hi, num_keys, block=block)
        q_blocks, k_blocks = -(-seq_len // block), -(-num_keys // block)
        partial = expand_block_lists(mask.kv_num_blocks, mask.kv_indices, q_blocks, k_blocks)
        full = expand_block_lists(mask.full_kv_num_blocks, mask.full_kv_indices, q_blocks, k_blocks)
        assert not bool((partial & full).any()), "a key block listed as both partial and full"
        visible = inside(lo, hi, num_keys)  # (B, T, N)
        padded = torch.zeros(2, q_blocks * block, k_blocks * block, dtype=torch.bool)
        padded[:, :seq_len, :num_keys] = visible
        per_block = padded.view(2, q_blocks, block, k_blocks, block)
        any_seen = per_block.any(4).any(2)  # (B, Qb, Kb)
        assert torch.equal(partial | full, any_seen), "listed blocks must be exactly the blocks some query sees"
        # a full block: every real query of the block sees every key of it
        queries_real = (torch.arange(q_blocks * block) < seq_len).view(q_blocks, block)
        all_seen = (per_block.all(4) | ~queries_real[None, :, :, None]).all(2)
        assert not bool((full & ~all_seen).any()), "a block listed as full holds a pair the query does not see"
        full_blocks_seen += int(full.sum())
        # the mask_mod reads the padded intervals: the same intervals, empty past the last query
        assert torch.equal(lo_p[:, :seq_len], lo) and torch.equal(hi_p[:, :seq_len], hi)
        assert bool((lo_p[:, seq_len:] == 0).all() and (hi_p[:, seq_len:] == 0).all())
    if block == 8:
        assert full_blocks_seen > 0, "the case exercises no full block"


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")  # (its math path, on purpose)
@pytest.mark.parametrize("group", [1, 2, 3, 4, 6, 8, 16])
@pytest.mark.parametrize("case,seq_len", [("padded", 200), ("docs", 257)], ids=["padded-T200", "docs-T257"])
def test_flex_branches_forward_matches_the_reference(case, seq_len, group):
    """FlexAttention (uncompiled: its math path, with the mask_mod) on the masks and the gated sum the GPU run
    times: the gated output, each interval branch's output and the compressed branch's base-2 log-sum-exp."""
    from torch.nn.attention.flex_attention import flex_attention

    doc_pos, cmp_end = layout(case, seq_len, seed=group)
    num_kv, head_dim = 2, 16
    num_heads = num_kv * group
    num_slots = cmp_end.shape[1]
    generator = torch.Generator().manual_seed(group)

    def rand(*shape):
        return torch.randn(*shape, generator=generator)

    q = rand(2, seq_len, num_heads, head_dim)
    k_cmp, v_cmp = rand(2, num_slots, num_kv, head_dim), rand(2, num_slots, num_kv, head_dim)
    k_slc, v_slc, k_win, v_win = (rand(2, seq_len, num_kv, head_dim) for _ in range(4))
    gates = torch.rand(2, seq_len, num_heads, 3, generator=generator)
    ref = reference_branches(q, k_cmp, v_cmp, cmp_end, k_slc, v_slc, k_win, v_win, doc_pos, PARAMS)
    o_slc = ref.o_slc.permute(0, 3, 1, 2, 4).reshape(2, seq_len, num_heads, head_dim)
    c_lo, c_hi, w_lo, w_hi = flex_branches.interval_bounds(doc_pos, cmp_end, PARAMS)
    cmp_mask = flex_branches.interval_block_mask(c_lo, c_hi, num_slots, block=32)[0]
    win_mask = flex_branches.interval_block_mask(w_lo, w_hi, seq_len, block=32)[0]
    out, lse2, o_cmp, o_win = flex_branches.flex_branches(q, k_cmp, v_cmp, k_win, v_win, gates, o_slc, cmp_mask,
                                                          win_mask, head_dim**-0.5, flex_attention)  # fmt: skip

    def heads_last(o):  # (B, Hkv, G, T, D) -> (B, T, H, D)
        return o.permute(0, 3, 1, 2, 4).reshape(2, seq_len, num_heads, head_dim)

    torch.testing.assert_close(out, ref.gated(gates), atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(o_cmp, heads_last(ref.o_cmp), atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(o_win, heads_last(ref.o_win), atol=2e-5, rtol=1e-4)
    # base-2 log-sum-exp of the visible compressed scores, rows that see a compressed token
    scores = torch.einsum("bthd,bnhd->bthn", q, k_cmp.repeat_interleave(group, dim=2)) * head_dim**-0.5
    visible = inside(c_lo, c_hi, num_slots)[:, :, None, :]
    expected = torch.logsumexp(scores.masked_fill(~visible, -math.inf), dim=-1) / math.log(2)
    seen = (c_hi > c_lo)[..., None].expand_as(expected)
    assert bool(seen.any()) and bool((~seen).any())
    torch.testing.assert_close(lse2[seen], expected[seen], atol=1e-4, rtol=1e-5)


def masked_attention_like_flex(q, k, v, block_mask=None, scale=None, enable_gqa=False, return_lse=False,
                               return_aux=None):
    """flex_attention's contract written out (dense scores, the block mask's mask_mod everywhere), differentiable on
    CPU, where FlexAttention has no backward: q (B, H, T, D), k/v (B, Hkv, N, D) -> o (B, H, T, D) and, when asked,
    the natural log-sum-exp (B, H, T) (-inf and a zero output for a row that sees no key, as flex's)."""
    batch, num_heads, num_queries, _ = q.shape
    group = num_heads // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    index = [torch.arange(n).view([-1 if i == axis else 1 for i in range(4)])
             for axis, n in enumerate((batch, num_heads, num_queries, k.shape[2]))]
    visible = block_mask.mask_mod(*index)
    scores = ((q @ k.transpose(-1, -2)) * scale).masked_fill(~visible, -math.inf)
    lse = torch.logsumexp(scores, -1)
    probs = torch.where(visible, torch.exp(scores - lse[..., None].clamp(min=-1e30)), 0.0)
    out = probs @ v
    return (out, lse) if (return_lse or return_aux is not None) else out


PLUMBING = """
import json, sys
sys.path[:0] = ["bench", "tests"]
import torch
import flex_branches, test_flex_branches as t

doc_pos, cmp_end = t.layout("padded", 70, seed=3, rows=1)
generator = torch.Generator().manual_seed(3)
shapes = dict(q=(70, 6), k_cmp=(cmp_end.shape[1], 2), v_cmp=(cmp_end.shape[1], 2), k_slc=(70, 2), v_slc=(70, 2),
              k_win=(70, 2), v_win=(70, 2))
x = {name: torch.randn(1, n, heads, 16, generator=generator).requires_grad_() for name, (n, heads) in shapes.items()}
x["gates"] = torch.rand(1, 70, 6, 3, generator=generator).requires_grad_()
row = flex_branches.check_and_time(x, cmp_end, doc_pos, t.PARAMS, t.masked_attention_like_flex, lambda fn: 1.0)
print("ROW " + json.dumps(row))
"""


def test_gpu_run_compares_flex_with_the_kernels_outputs_and_gradients():
    """The GPU run's own checks, on CPU: the project's kernels under Triton's interpreter (the interval share of the
    op: both forwards, the fused dQ without the selected branch's, both dK/dV; and the whole op) against the flex
    path and the composed op (flex for the interval branches, the kernels for the top-n and the selected branch)
    with FlexAttention's contract written out, documents and padding (left and right in one row), G = 3. Every
    output and gradient agrees, so a difference on the GPU is FlexAttention's or the block mask's, not the
    comparison's plumbing. (One row: the interpreter's time goes with the programs; the kernels' batch offsets are
    test_triton_kernels.py's.)"""
    from modeling_nsa import nsa_triton_common

    reason = nsa_triton_common._interpreter_reason() if nsa_triton_common._HAS_TRITON else "triton is not installed"
    if reason:
        pytest.skip(reason)
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", PLUMBING], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    row = json.loads(done.stdout.split("ROW ", 1)[1])
    assert set(row["max_errors"]) == {"out", "lse_cmp", "o_cmp", "o_win", "dq", "dk_cmp", "dv_cmp", "dk_win",
                                      "dv_win", "dgates"}  # fmt: skip
    assert max(row["max_errors"].values()) < 1e-4, row["max_errors"]  # float32 on both sides
    # the whole op composed (flex for the interval branches, the kernels for the rest) is the op
    assert set(row["composed_max_errors"]) == {"out", "q", "k_cmp", "v_cmp", "k_slc", "v_slc", "k_win", "v_win",
                                               "gates"}  # fmt: skip
    assert max(row["composed_max_errors"].values()) < 1e-4, row["composed_max_errors"]
    assert row["selections_agree"] == 1.0  # the top-n on flex's log-sum-exp picks the op's blocks
