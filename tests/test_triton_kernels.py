"""Triton NSA kernels vs the PyTorch reference.

CPU (CI): the real kernels run under Triton's interpreter (TRITON_INTERPRET=1) at tiny shapes, fp32
and fp16, in two subprocesses side by side, started in the background when collection ends (tests/background.py;
Triton reads the variable when kernels are defined, so it must be set before anything imports triton), with the
launchers' torch.empty buffers filled with NaN and 2**30 (triton_helpers.PoisonedAllocations: a GPU's fresh
memory is arbitrary, a CPU's tends to be zero). GPU: bf16/fp16
at the issue's shapes (skipped without CUDA).
Near-tie handling in the selection is explained in tests/triton_helpers.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

try:
    import triton  # noqa: F401

    HAS_TRITON = True
except Exception:
    HAS_TRITON = False

GRADS = ["dq", "dk_cmp", "dv_cmp", "dk_slc", "dv_slc", "dk_win", "dv_win", "dgates"]


# id parts of the launch choices a case may force (triton_helpers.case_launch)
_KNOB_IDS = {
    "bj": lambda c: f"bj{c['bj']}",
    "topn_insert_max": lambda c: f"insert{c['topn_insert_max']}",
    "split": lambda c: f"split{c['split']}",
    "sel_rows": lambda c: f"selrows{c['sel_rows']}",
    "sel_sub_rows": lambda c: f"subrows{c['sel_sub_rows']}",
    "sel_pieces": lambda c: f"heavy{c['sel_pieces'][0]}pieces{c['sel_pieces'][2]}slots{c['sel_pieces'][3]}",
    "decode_split": lambda c: f"split{c['decode_split']}",
    "decode_topn_blocks": lambda c: f"topn{c['decode_topn_blocks']}blocks",
    "decode_topn_offsets": lambda c: f"topn{c['decode_topn_offsets']}offsets",
    "decode_sel_step": lambda c: f"selstep{c['decode_sel_step']}",
    "decode_win_tile": lambda c: f"wintile{c['decode_win_tile']}",
    "decode_parts": lambda c: "parts" if c["decode_parts"] else "finish",
    "decode_fused_combine": lambda c: "fusedcombine" if c["decode_fused_combine"] else "combinekernel",
    "decode_sel_part": lambda c: f"selpart{c['decode_sel_part']}",
    "decode_win_part": lambda c: f"winpart{c['decode_win_part']}",
    "decode_merge_splits": lambda c: f"merge{c['decode_merge_splits']}splits",
    "decode_merge_lists": lambda c: f"merge{c['decode_merge_lists']}lists",
    "sel_dq_in_dkdv": lambda c: "seldqpairs" if c["sel_dq_in_dkdv"] else "seldqunion",
    "sel_dq_split": lambda c: "seldqsplit" if c["sel_dq_split"] else "seldqfused",
    "picks": lambda c: f"{c['picks']}picks",
    "offsets_int64": lambda c: "kv64" if c["offsets_int64"] else "kv32",
    "sel_pairs_int64": lambda c: "pairsint64" if c["sel_pairs_int64"] else "pairsint32",
    "sel_dkdv_ranges_first": lambda c: "rangesfirst" if c["sel_dkdv_ranges_first"] else "heavyfirst",
    "dkdv_key_tiles_fast": lambda c: "tilesfast" if c["dkdv_key_tiles_fast"] else "tilesslow",
    "query_tiles_light_first": lambda c: "lightfirst" if c["query_tiles_light_first"] else "heavyfirsttiles",
    "sel_fwd_pairs": lambda c: "selfwdpairs" if c["sel_fwd_pairs"] else "selfwdunion",
    "sel_fwd_max_registers": lambda c: f"selfwd{c['sel_fwd_max_registers']}regs",
    "topn_max_registers": lambda c: f"topn{c['topn_max_registers']}regs",
    "sel_union_wide_keys": lambda c: "unionwide" if c["sel_union_wide_keys"] else "unionnarrow",
    "sel_dq_pairs": lambda c: "seldqpairkernel" if c["sel_dq_pairs"] else "seldqnopairkernel",
    "sel_fwd_pair_queries": lambda c: f"chunk{c['sel_fwd_pair_queries']}queries",
    "sel_dkdv_chunk_pairs": lambda c: f"chunk{c['sel_dkdv_chunk_pairs']}pairs" if c["sel_dkdv_chunk_pairs"] else "pertile",
    "range_chunk": lambda c: f"rangechunk{c['range_chunk']}",
    "block_n": lambda c: f"keytile{c['block_n']}",
    "arch": lambda c: f"sm{c['arch']}",
    "cache_views": lambda c: "cacheviews",
    "dq_rows": lambda c: f"dq{c['dq_rows']}rows",
    "topn_rows": lambda c: f"topn{c['topn_rows']}rows",
    "static": lambda c: "static",
    "chunk": lambda c: f"chunk{c['chunk']}",
    "param_overrides": lambda c: "-".join(f"{k}{v}" for k, v in c["param_overrides"].items()),
    "gate_logit": lambda c: f"gatelogit{c['gate_logit']:g}",
}


def _case_id(c):
    parts = [c.get("kind", "attn"), f"T{c['T']}", f"G{c['H'] // c['Hkv']}", f"hkv{c['Hkv']}", f"d{c['D']}",
             c.get("layout", "single"), c.get("dtype", "float32")]
    parts += [name(c) for knob, name in _KNOB_IDS.items() if c.get(knob) is not None]
    return "-".join(parts)


# ---------------------------------------------------------------- CPU: interpreter, tiny shapes
# The pair-wise selected dQ's cases (each run with the atomic dQ below; some with the pair kernel too): G = 1, 2, 3, 4, 6, 8, 16 over documents
# and padding, fp16, sm_80's tiles, and heavy blocks split over 3 programs (several programs per block's pairs)
_PAIR_DQ_CASES = [
    dict(B=2, T=47, H=2, Hkv=2, D=16, layout="pad"),
    dict(B=1, T=65, H=4, Hkv=2, D=16, layout="varlen", dtype="float16"),
    dict(B=2, T=90, H=3, Hkv=1, D=16, layout="varlen", arch=80),
    dict(B=1, T=77, H=4, Hkv=1, D=32, layout="pad"),
    dict(B=2, T=81, H=6, Hkv=1, D=16, layout="varlen", dtype="float16"),
    dict(B=1, T=100, H=8, Hkv=1, D=16, layout="pad", sel_pieces=[5, 3, 64, 32]),
    dict(B=1, T=70, H=16, Hkv=1, D=16, layout="varlen", sel_pieces=[5, 3, 64, 32]),
]
# tiny params: l=8, d=4, l'=16, n=4, init 1, local 2, w=16 (so several blocks are eligible at T < 100)
CPU_CASES = [
    dict(B=1, T=1, H=2, Hkv=1, D=16),
    dict(B=1, T=17, H=2, Hkv=2, D=16),  # G=1
    dict(B=2, T=47, H=6, Hkv=2, D=16, layout="varlen"),  # G=3: not a power of two
    dict(B=2, T=64, H=4, Hkv=1, D=32, layout="pad", dtype="float16"),
    dict(B=1, T=81, H=6, Hkv=1, D=16, layout="varlen", dtype="float16"),  # G=6
    dict(B=2, T=53, H=8, Hkv=1, D=16, layout="pad"),  # G=8: every launch at its default
    dict(B=1, T=75, H=16, Hkv=1, D=16, layout="varlen"),  # G=16
    # 7 blocks in chunks of 4 = n: the first placed whole, the second merged whole into the top-n lists (a
    # top-k of list and chunk); dK/dV query ranges split in 3 partials
    dict(B=1, T=100, H=4, Hkv=2, D=16, bj=4, split=3, topn_insert_max=0),
    # chunks of 2 blocks (shorter than the list of 4: the merge pads them): one entering block inserted into the
    # unsorted list, two merged by a top-k into a sorted one, so lists pass between both forms (the default
    # inserts up to 2 entering blocks and merges above)
    dict(B=2, T=100, H=3, Hkv=1, D=16, layout="varlen", bj=2, topn_insert_max=1),
    # chunks of 4 blocks = n: each list's first chunk placed whole (_topn_chunk_update, BJ = N_SEL = N_PAD), the
    # later ones inserted; documents start lists mid-row, and their first chunk is the masked pass's
    dict(B=2, T=90, H=6, Hkv=1, D=16, layout="varlen", bj=4),
    # selected attention in narrow query tiles (2 queries x G=6 rows; 8 x G=2): tiles cut by document
    # boundaries and padding, T not a multiple of the tile
    dict(B=1, T=77, H=6, Hkv=1, D=16, layout="varlen", sel_rows=16),
    dict(B=2, T=45, H=4, Hkv=2, D=16, layout="pad", dtype="float16", sel_rows=16),
    # fp16 with gates near 5e-5 (sigmoid(-10)): the dK/dV kernels' dV operand g P lies below fp16's smallest
    # normal unless scaled (nsa_triton_common.FP16_DV_SCALE); the gradients are as small as the gates, so their
    # errors are taken relative to their own norms (rel_floor 0)
    # (measured: dV 3.4-4.0e-4 with the scale, 1.7-2.1e-3 without; the other gradients <= 8.3e-4 either way)
    dict(B=1, T=90, H=4, Hkv=2, D=16, layout="varlen", dtype="float16", gate_logit=-10.0, rel_floor=0.0,
         param_overrides=dict(window_size=64), tol=1e-3),
    # interval branches with key tiles inside every row's interval (run unmasked): a 160-key window, and up to
    # 99 compressed tokens, so whole 64-key tiles fall inside; padding and document starts around them
    dict(B=2, T=400, H=3, Hkv=1, D=16, layout="pad", param_overrides=dict(window_size=160)),
    dict(B=1, T=400, H=4, Hkv=1, D=16, layout="varlen", param_overrides=dict(window_size=160)),
    # the query-tile launches (top-n, selected forward, fused dQ, compressed/window forward) in the order timed
    # until 2026-11-27, tile i on program i (launch_overrides(query_tiles_light_first=True)); every other case runs
    # a row's last tiles on the first programs (_query_tile_id)
    dict(B=2, T=90, H=6, Hkv=1, D=16, layout="varlen", query_tiles_light_first=True),
    # the selected forward and the top-n under a register cap (launch_overrides(sel_fwd_max_registers=128,
    # topn_max_registers=128), Triton's maxnreg: a launch option the interpreter must accept as the GPU does)
    dict(B=1, T=70, H=6, Hkv=1, D=16, layout="pad", sel_fwd_max_registers=128, topn_max_registers=128),
    # the compressed/window dK/dV with the query tiles that see all of a key tile in an unmasked loop of their own
    # between masked ones (the kernel's only schedule since the 2026-11-25 sweep; the window and compressed sizes
    # in the ids): compressed tokens every 1-2 keys so that whole 64-key tiles fit, windows chosen so that one
    # query more past a run (ib + 1) or, at 5 queries per tile, one before it (ia - 1) moves a tile into the
    # unmasked loop (the checks fail then: tried); G = 6 in
    # sm_80's 32-row tiles (2 rows past QPB x G) with left and right padding; G = 3 in 64-row tiles across
    # documents, fp16; G = 1 with the query ranges split in 2
    dict(B=2, T=201, H=6, Hkv=1, D=16, layout="pad", arch=80,
         param_overrides=dict(window_size=129, cmp_block_size=4, cmp_stride=2)),
    dict(B=1, T=203, H=3, Hkv=1, D=16, layout="varlen", seed=26, dtype="float16",
         param_overrides=dict(window_size=125, cmp_block_size=2, cmp_stride=1)),
    dict(B=1, T=203, H=2, Hkv=2, D=16, split=2,
         param_overrides=dict(window_size=191, cmp_block_size=2, cmp_stride=1)),
    # ... with the split programs in the grid order timed until 2026-11-27 (key tile fastest; the default puts the
    # key tile on the last axis where the ranges are split: launch_overrides(dkdv_key_tiles_fast=True))
    dict(B=2, T=203, H=2, Hkv=2, D=16, split=2, dkdv_key_tiles_fast=True, layout="varlen",
         param_overrides=dict(window_size=191, cmp_block_size=2, cmp_stride=1)),
    # selected-attention sub-tiles (forward and dQ; the default before Hopper), each skipping the union blocks
    # none of its queries chose: 2 sub-tiles of a 32-row tile, 4 of the 64-row tile
    dict(B=2, T=90, H=3, Hkv=1, D=16, layout="varlen", sel_rows=32, sel_sub_rows=16),
    dict(B=1, T=77, H=8, Hkv=2, D=16, layout="pad", sel_sub_rows=16),
    # 16 selected blocks: the fused dQ takes 128-row tiles (21 queries x G=6) on sm_90
    dict(B=1, T=300, H=6, Hkv=1, D=16, layout="varlen", param_overrides=dict(sel_num_blocks=16)),
    # ... in 64-row tiles instead (tune variant dq64rows), over padding
    dict(B=2, T=150, H=6, Hkv=1, D=16, layout="pad", arch=90, dq_rows=64, param_overrides=dict(sel_num_blocks=16)),
    # the top-n in 128-row programs (16 queries x 8 padded heads) and 16-row ones (4 queries x 4 padded heads):
    # tiles cut by documents and padding
    dict(B=2, T=90, H=6, Hkv=1, D=16, layout="pad", topn_rows=128),
    dict(B=2, T=77, H=3, Hkv=1, D=16, layout="varlen", topn_rows=16),
    # G = 1 with 16 selected blocks: the fused dQ's 128-query tiles on sm_90, whose choice bits fill four words
    # (the union walk reads words 1-3 from a second tensor)
    dict(B=1, T=130, H=2, Hkv=2, D=16, layout="varlen", param_overrides=dict(sel_num_blocks=16)),
    # selected dK/dV: blocks with more than 5 (query, block) pairs cut into pieces of at least 3 pairs (one piece
    # size for the launch, as small as fits 64 partials; a block's last piece partly filled) + fixed-order reduce;
    # then with one slot of two partials: the heaviest block in one or two pieces, the other heavy blocks in the
    # main pass
    dict(B=2, T=70, H=3, Hkv=1, D=16, layout="varlen", sel_pieces=[5, 3, 64, 32]),
    dict(B=2, T=70, H=3, Hkv=1, D=16, layout="varlen", sel_pieces=[5, 3, 2, 1]),
    # the same splits over two KV heads (each head's heavy blocks in its own slots)
    dict(B=1, T=60, H=4, Hkv=2, D=16, layout="varlen", sel_pieces=[5, 3, 64, 32]),
    # ... at G = 1, 4 and 6, over padding
    dict(B=2, T=67, H=2, Hkv=2, D=16, layout="pad", sel_pieces=[5, 3, 64, 32]),
    dict(B=1, T=71, H=4, Hkv=1, D=16, layout="pad", sel_pieces=[5, 3, 2, 1]),
    dict(B=2, T=58, H=6, Hkv=1, D=16, layout="varlen", sel_pieces=[5, 3, 64, 32]),
    # the selected dQ in a launch of its own (launch_overrides(sel_dq_split=True)): G = 1 over padding, G = 16 in
    # fp16 over documents, and sm_80's sub-tiles
    dict(B=1, T=70, H=2, Hkv=2, D=16, layout="pad", sel_dq_split=True),
    dict(B=2, T=81, H=16, Hkv=1, D=16, layout="varlen", dtype="float16", sel_dq_split=True),
    dict(B=2, T=90, H=6, Hkv=1, D=16, layout="varlen", sel_dq_split=True, arch=80),
    # ... and G = 2, 3, 4, 8 over padding and documents
    dict(B=2, T=47, H=4, Hkv=2, D=16, layout="varlen", sel_dq_split=True),
    dict(B=2, T=61, H=3, Hkv=1, D=16, layout="pad", sel_dq_split=True),
    dict(B=1, T=77, H=4, Hkv=1, D=32, layout="varlen", sel_dq_split=True),
    dict(B=2, T=59, H=8, Hkv=1, D=16, layout="pad", dtype="float16", sel_dq_split=True),
    # ... with int64 pair positions (the launcher's choice from 2**31 pairs on; int32 below), and int64 K/V offsets
    # in the union walk and the interval tiles (from 2**31 elements in a row's K/V on)
    dict(B=1, T=60, H=4, Hkv=2, D=16, layout="varlen", sel_pieces=[5, 3, 64, 32], sel_pairs_int64=True,
         offsets_int64=True),
    dict(B=2, T=57, H=3, Hkv=1, D=16, layout="pad", sel_pairs_int64=True, offsets_int64=True),
    # ... with the programs in the order timed until 2026-11-27 (launch_overrides(sel_dkdv_ranges_first=True): key
    # range fastest, the main pass before the heavy pass), one slot so heavy blocks stay with their key range
    dict(B=1, T=60, H=4, Hkv=2, D=16, layout="varlen", sel_pieces=[5, 3, 2, 1], sel_dkdv_ranges_first=True),
    # the selected dK/dV's tile loop in chunks whose query indices are loaded once (the default on sm_90 at head_dim
    # <= 64 with an even G, which the interpreter's cases take: every even-G case above and below; odd G and other
    # GPUs load each tile's, which the odd-G cases take): small chunks so blocks span several, a chunk's last tile
    # cut by the block's end, masked and unmasked tiles in one chunk, heavy-block splits, and the pair-wise dQ
    # (its rows taken from the chunk too). Shifting a tile's rows by one in its chunk fails all three
    dict(B=2, T=90, H=16, Hkv=1, D=16, layout="varlen", sel_dkdv_chunk_pairs=12),  # 3 tiles of 4 queries a chunk
    dict(B=1, T=100, H=16, Hkv=1, D=16, sel_dkdv_chunk_pairs=12, sel_pieces=[5, 3, 64, 32]),
    dict(B=2, T=81, H=6, Hkv=1, D=16, layout="varlen", dtype="float16", sel_dkdv_chunk_pairs=20, sel_dq_in_dkdv=True),
    # the selected branch's dQ formed pair by pair by the selected dK/dV kernel instead of the fused dQ kernel's walk
    # over each tile's block union, over _PAIR_DQ_CASES: added to an fp32 dQ with atomics
    # (launch_overrides(sel_dq_in_dkdv=True); with the atomic add zeroed, dq's error is ~0.6)
    *[dict(case, sel_dq_in_dkdv=True) for case in _PAIR_DQ_CASES],
    # ... in fp16 at G = 16 and G = 1 too: each 2-byte case keeps its fp32 dQ over the saved o_cmp and o_win, half a
    # row in each (_FloatDq; swapping the halves' pointers fails every such case of the atomic and pair-dQ modes)
    dict(_PAIR_DQ_CASES[6], dtype="float16", sel_dq_in_dkdv=True),
    dict(_PAIR_DQ_CASES[0], dtype="float16", sel_dq_pairs=True),
    # ... and by a block-outer kernel of its own (sel_dq_pairs=True: the forward's pair walk, 3 dots per pair tile,
    # partials per chunk of queries summed in slot order): alone against autograd through the branch's definition
    # at G = 1, 2, 3, 4, 6, 8, 16 over documents, padding and odd lengths, fp16, sm_80's launch, chunks cutting
    # blocks' runs of pairs; then through the whole op, with the block-outer forward (the whole block-outer path)
    # and with heavy-block splits in the dK/dV. Halving the kernel's dQ takes dq's error to ~0.3 (tried)
    *[dict(kind="seldq", B=2, T=t, H=g * hkv, Hkv=hkv, D=d, layout=layout, sel_fwd_pair_queries=chunk, **extra)
      for g, hkv, t, d, layout, chunk, extra in [
          (1, 2, 47, 16, "pad", None, {}), (2, 2, 65, 16, "varlen", 13, dict(dtype="float16")),
          (3, 1, 90, 16, "varlen", None, dict(arch=80)), (4, 1, 77, 32, "pad", 13, {}),
          (6, 1, 81, 16, "varlen", 9, dict(dtype="float16")), (8, 1, 100, 16, "pad", 13, {}),
          (16, 1, 70, 16, "varlen", None, {})]],
    dict(_PAIR_DQ_CASES[4], sel_dq_pairs=True, sel_fwd_pairs=True),
    dict(_PAIR_DQ_CASES[6], sel_dq_pairs=True, sel_fwd_pair_queries=13),
    dict(_PAIR_DQ_CASES[0], sel_dq_pairs=True),  # the launcher's wiring over padding: G = 1, 4
    dict(_PAIR_DQ_CASES[3], sel_dq_pairs=True, sel_fwd_pair_queries=13),
    # the block-outer forward with the dQ formed in the selected dK/dV (the whole selected branch pair by pair: the
    # schedule whose floors fit issue 18's 64k target, bench/KERNELS.md): the dK/dV reads the pair forward's
    # log-sum-exp
    dict(_PAIR_DQ_CASES[4], sel_fwd_pairs=True, sel_dq_in_dkdv=True, sel_fwd_pair_queries=9),
    dict(_PAIR_DQ_CASES[5], sel_fwd_pairs=True, sel_dq_in_dkdv=True),
    # the block-outer selected forward (launch_overrides(sel_fwd_pairs=True)): each (query, block) pair's partial
    # softmax, merged per query by a combine kernel; queries in chunks (sel_fwd_pair_queries) so that tiles are cut
    # by chunk ends too. Alone against the branch's definition (tests/triton_helpers.selected_branch_torch) on random
    # valid choices at G = 1, 2, 3, 4, 6, 8, 16 over documents, padding and odd lengths, fp16, sm_80's launch; then
    # the whole op forward and backward (the backward reads its log-sum-exp). Weighting one slot wrongly in the
    # combine fails all of them (tried)
    *[dict(kind="selfwd", B=2, T=t, H=g * hkv, Hkv=hkv, D=16, layout=layout, sel_fwd_pairs=True,
           sel_fwd_pair_queries=chunk, **extra)
      for g, hkv, t, layout, chunk, extra in [
          (1, 2, 77, "varlen", 13, {}), (2, 1, 90, "pad", None, dict(dtype="float16")),
          (3, 1, 81, "varlen", 7, {}), (4, 2, 65, "pad", 40, dict(arch=80)), (6, 1, 100, "varlen", 9, {}),
          (8, 1, 71, "pad", None, {}), (16, 1, 83, "varlen", 30, dict(dtype="float16"))]],
    # the union walk against the same definition (the oracle checked against the default forward)
    dict(kind="selfwd", B=2, T=81, H=6, Hkv=1, D=16, layout="varlen"),
    dict(B=2, T=60, H=3, Hkv=1, D=16, layout="pad", dtype="float16", sel_fwd_pairs=True, sel_fwd_pair_queries=7),
    # ... whose log-sum-exp the default (union) dQ reads: G = 1, 2, 4 over documents and padding
    dict(B=2, T=55, H=2, Hkv=2, D=16, layout="varlen", sel_fwd_pairs=True),
    dict(B=1, T=69, H=4, Hkv=2, D=16, layout="pad", sel_fwd_pairs=True, sel_fwd_pair_queries=9),
    dict(B=2, T=63, H=4, Hkv=1, D=16, layout="varlen", dtype="float16", sel_fwd_pairs=True),
    # H100's launches at head_dim 128 (the dK/dV in 16-row tiles, the interval-only dQ in 32-row tiles; the same
    # launch for both pair-wise modes)
    dict(B=1, T=70, H=8, Hkv=1, D=128, layout="varlen", arch=90, sel_dq_in_dkdv=True),
    # the tiles an A100 (sm_80) gets: 32-row dQ and dK/dV query tiles, selected attention in 16-row sub-tiles (and
    # over two KV heads)
    dict(B=2, T=90, H=6, Hkv=1, D=16, layout="varlen", arch=80),
    dict(B=1, T=60, H=6, Hkv=2, D=16, layout="varlen", arch=80),
    # found by a randomized search (2026-11-23): a top-n tile across two documents at the end of the batch, whose
    # later document's pass read compressed keys past the tensor (the earlier document's rows see more of them)
    dict(B=1, T=65, H=6, Hkv=2, D=16, layout="varlen", dtype="float16", seed=628567,
         param_overrides=dict(cmp_block_size=4, cmp_stride=4, sel_block_size=64, sel_num_blocks=5, sel_init_blocks=0,
                              sel_local_blocks=1, window_size=1)),
    # the training top-n alone over many blocks per row (l' = 16), where a query's blocks compete and a wrong
    # sum over its heads picks other blocks (dropping half the heads gives a tie gap of ~0.3): G = 1, 2, 3, 4, 6,
    # 8, 16, each G's rows laid out by _topn_row_query_head (head lanes at G = 2-8, query-major at 1 and 16). A
    # chunk is 64 compressed tokens (16 blocks), so the rows see whole chunks, which run unmasked, only past ~260
    # tokens of a document: T = 700 for some, 4-block chunks (16 tokens) for the others
    *[dict(kind="select", B=2, T=t, H=g * hkv, Hkv=hkv, D=16, layout=layout, bj=bj)
      for g, hkv, layout, t, bj in [(1, 2, "pad", 300, 4), (2, 1, "varlen", 700, None), (3, 2, "pad", 700, None),
                                    (4, 1, "varlen", 300, 4), (6, 2, "varlen", 300, 4), (8, 1, "varlen", 600, None),
                                    (16, 1, "varlen", 300, 4)]],
    # every entering block merged by a top-k (topn_insert_max=0) and every one inserted (8), over documents and
    # padding: both of the top-n's list updates against the reference's scores
    dict(kind="select", B=2, T=300, H=6, Hkv=2, D=16, layout="varlen", bj=4, topn_insert_max=0),
    dict(kind="select", B=2, T=300, H=4, Hkv=1, D=16, layout="pad", bj=4, topn_insert_max=8),
    # lists of n = 5 in 8 slots, chunks of 16 blocks (38 blocks a row: three chunks): a chunk's best 8 merged with
    # the list's kept 5 (no first chunk placed: n < 8), slots past n then holding entries no later insertion or
    # merge may take for kept ones
    dict(kind="select", B=2, T=600, H=6, Hkv=2, D=16, layout="pad", param_overrides=dict(sel_num_blocks=5)),
    # the selected branch's tile unions (_tile_block_union: one kernel, a sort in registers per tile) against
    # their torch oracle on random choices: tiles of 1-21 queries (the forward's 10 and the dQ's 21 at G = 6;
    # 21 x 16 entries sort in a 512-wide list), documents, padding on both sides, queries after a prefix (q_off)
    # the selected dK/dV's slots and pieces (two launches and a topk) against their torch oracles: more heavy blocks
    # than slots (concentrated picks), fewer (uniform), pieces at the smallest size and larger, ties in the counts
    dict(kind="heavyplan", T=2048, H=1, Hkv=1, D=16, rows=3, keys=512, queries=2048, picks="concentrated",
         heavy_min=64, qpb=10, min_piece=40, max_pieces=256, slots=64),
    dict(kind="heavyplan", T=2048, H=1, Hkv=1, D=16, rows=2, keys=512, queries=2048, picks="uniform", seed=1,
         heavy_min=100, qpb=4, min_piece=128, max_pieces=1024, slots=256),
    dict(kind="union", B=2, T=130, H=2, Hkv=2, D=16, layout="varlen", LB=16, n_sel=4, qpbs=[1, 3, 5, 10, 21]),
    dict(kind="union", B=2, T=161, H=2, Hkv=1, D=16, layout="pad", LB=8, n_sel=16, qpbs=[10, 21], seed=3),
    dict(kind="union", B=2, T=141, H=2, Hkv=2, D=16, layout="varlen", LB=16, n_sel=5, qpbs=[4, 7], q_off=37, seed=5),
    # query masks of two and four int32 words (the forward's 64-query tiles at G = 1, the dQ's 128), the 32nd
    # query's bit (int32's sign), and the int64 sort keys that lengths from 2**(31 - log2 queries per tile) use
    # (2**24 keys at 128-query tiles), forced at a short one (launch_overrides(sel_union_wide_keys=True))
    dict(kind="union", B=1, T=300, H=2, Hkv=1, D=16, layout="varlen", LB=16, n_sel=4, qpbs=[32, 33, 64, 128],
         seed=7),
    dict(kind="union", B=2, T=141, H=2, Hkv=2, D=16, layout="pad", LB=8, n_sel=6, qpbs=[3, 40], seed=9,
         sel_union_wide_keys=True),
    # the per-query intervals (_layout_kernel: binary searches over the compressed tokens' ends) against the torch
    # ops they replaced, on random layouts (documents, padding on both sides and inside a row): every query, the
    # queries after a prefix (select_blocks_triton's) with a shorter window tensor, and rows too short for a
    # compressed token
    dict(kind="layout", B=3, T=301, H=2, Hkv=1, D=16, seeds=[0, 1, 2],
         params=[(8, 4, 16), (32, 16, 512), (4, 2, 64), (2, 1, 160)]),
    dict(kind="layout", B=3, T=97, H=2, Hkv=1, D=16, seeds=[3, 4], q_off=29, w_off=13, params=[(8, 4, 16), (4, 4, 5)]),
    dict(kind="layout", B=3, T=6, H=2, Hkv=1, D=16, seeds=[5], params=[(8, 4, 16)]),
    # the dK/dV kernel's query ranges per key tile (_interval_query_ranges: chunk scans, then a search of the chunk
    # totals and a binary search in one chunk) against their definitions in Python loops, and what they mean to
    # that kernel, on random layouts: 16-query chunks (runs, padding and empty intervals crossing chunk ends, up to
    # 19 chunks a row), the default chunk (one per row here), a row shorter than a key tile
    dict(kind="ranges", B=3, T=301, H=2, Hkv=1, D=16, seeds=[0, 1], range_chunk=16,
         params=[(8, 4, 16), (32, 16, 160), (4, 2, 64)]),
    dict(kind="ranges", B=3, T=400, H=2, Hkv=1, D=16, seeds=[2, 3], params=[(4, 2, 160), (8, 4, 512)]),
    dict(kind="ranges", B=2, T=61, H=2, Hkv=1, D=16, seeds=[4], range_chunk=32, params=[(8, 4, 16)]),
    # 4-key tiles: 76 tiles a row, so two search programs per row and branch (64 tiles each)
    dict(kind="ranges", B=3, T=301, H=2, Hkv=1, D=16, seeds=[5], range_chunk=16, block_n=4,
         params=[(8, 4, 16), (4, 2, 64)]),
    dict(kind="decode", B=2, T=60, H=4, Hkv=2, D=16, steps=[1, 8, 23, 60], Tw=16, layout="pad"),
    # the cache's tensors as NSACache passes them: views of larger buffers (read in place, batch strides),
    # the spare room NaN; split compressed slots and packed documents
    dict(kind="decode", B=3, T=90, H=6, Hkv=2, D=16, steps=[1, 17, 64, 90], Tw=16, layout="varlen",
         decode_split=16, cache_views=True),
    # 256 compressed slots per split (bench/tune_kernels.py variant decode_split256): a row's slots in one or
    # two splits
    dict(kind="decode", B=2, T=600, H=6, Hkv=2, D=16, steps=[1, 300, 600], Tw=16, layout="varlen",
         decode_split=256, cache_views=True),
    # the decode kernels: queries in later documents of packed rows (slots of earlier documents
    # before theirs), at and around compressed/selection block boundaries; fp16 with a window cache
    # longer than w
    dict(kind="decode", B=2, T=90, H=6, Hkv=1, D=16, steps=[1, 3, 4, 5, 17, 31, 64, 90], Tw=16, layout="varlen"),
    # split compressed slots (16 per program, 5 splits): the merge across splits, a document's slots
    # starting inside a later split, top-n chunks spanning two splits
    dict(kind="decode", B=2, T=300, H=6, Hkv=2, D=16, steps=[20, 150, 257, 300], Tw=16, layout="varlen",
         decode_split=16),
    # top-n over block ranges (3 blocks per program: up to 9 programs, each range's 3 blocks padded to 8 for the
    # tl.topk of n = 6), merged in the finish kernel; n = 6 with one local block leaves 4 blocks to the scores, so
    # the carry into each range's first block (from the block before it) decides picks
    # (the merges in steps of 2 splits and 2 lists: up to 7 splits and 9 lists, so several steps, one partial)
    dict(kind="decode", B=2, T=400, H=6, Hkv=2, D=16, steps=[1, 16, 33, 48, 49, 111, 250, 400], Tw=16,
         decode_split=16, decode_topn_blocks=3, decode_merge_splits=2, decode_merge_lists=2,
         param_overrides=dict(sel_num_blocks=6, sel_local_blocks=1)),
    # the scores one token offset per step (4 steps for l'/d = 4; the default takes a range's tokens in one step
    # up to 256 of them), over 3-block ranges in packed rows, 4 blocks of up to 18 picked by score
    dict(kind="decode", B=2, T=300, H=6, Hkv=2, D=16, steps=[1, 16, 33, 47, 48, 95, 210, 300], Tw=16,
         layout="varlen", decode_split=16, decode_topn_blocks=3, decode_topn_offsets=1,
         param_overrides=dict(sel_num_blocks=6, sel_local_blocks=1)),
    # the real parameters (l'=64, n=16, w=512) past 64 blocks: two top-n ranges, the second holding one block
    # at 4160; then five ranges of 16 blocks
    dict(kind="decode", B=1, T=4400, H=6, Hkv=2, D=16, steps=[4160, 4400], Tw=512, params="default"),
    dict(kind="decode", B=1, T=4400, H=6, Hkv=2, D=16, steps=[4400], Tw=512, params="default",
         decode_topn_blocks=16),
    dict(kind="decode", B=1, T=70, H=2, Hkv=2, D=32, steps=[1, 2, 16, 17, 33, 70], Tw=40, dtype="float16"),
    # the finish kernel's steps: 4 selected blocks per step over n = 6 (the second step half past the list's
    # n slots), a 40-key window in 16-key steps (the default takes each whole at these sizes); then the same steps
    # as parts side by side (a CUDA-graphed step's kernels): 2 selected parts, 3 window parts (the last of 8 keys)
    dict(kind="decode", B=2, T=400, H=6, Hkv=2, D=16, steps=[1, 20, 111, 400], Tw=40, layout="varlen",
         decode_sel_step=4, decode_win_tile=16, param_overrides=dict(sel_num_blocks=6, window_size=40)),
    dict(kind="decode", B=2, T=400, H=6, Hkv=2, D=16, steps=[1, 20, 111, 400], Tw=40, layout="varlen",
         decode_parts=True, decode_sel_step=4, decode_win_tile=16,
         param_overrides=dict(sel_num_blocks=6, window_size=40)),
    # parts of several steps: 2 selected blocks per step, 4 per part (parts of 2 steps and 1); 16 window keys per
    # step, 32 per part (2 steps, then 1 of 8 keys); then on a static cache's window ring (parts by default there),
    # and a static cache's step through the finish kernel
    dict(kind="decode", B=2, T=400, H=6, Hkv=2, D=16, steps=[1, 20, 111, 400], Tw=40, layout="varlen",
         decode_parts=True, decode_sel_step=2, decode_sel_part=4, decode_win_tile=16, decode_win_part=32,
         param_overrides=dict(sel_num_blocks=6, window_size=40)),
    dict(kind="decode", B=2, T=120, H=6, Hkv=2, D=16, steps=[1, 30, 41, 77, 119], layout="pad", static=True,
         decode_sel_step=2, decode_sel_part=4, decode_win_tile=16, decode_win_part=32,
         param_overrides=dict(sel_num_blocks=6, window_size=40)),
    # the parts combined by the last of each row and KV group's parts to finish (an atomic count), no combine launch
    dict(kind="decode", B=2, T=120, H=6, Hkv=2, D=16, steps=[1, 30, 41, 77, 119], layout="pad", static=True,
         decode_sel_step=2, decode_sel_part=4, decode_win_tile=16, decode_win_part=32, decode_fused_combine=1,
         param_overrides=dict(sel_num_blocks=6, window_size=40)),
    dict(kind="decode", B=2, T=90, H=6, Hkv=2, D=16, steps=[1, 16, 17, 50, 89], Tw=16, layout="varlen", static=True,
         decode_parts=False),

    # NSACache(static=True)'s layout: full-length key buffers (unwritten keys NaN), the window a ring (first
    # filling, then wrapped past w = 16), the query's key index a tensor; several documents per row, and
    # 16-slot splits and 3-block top-n ranges so that programs past the written keys exist and must find nothing
    dict(kind="decode", B=2, T=90, H=6, Hkv=2, D=16, steps=[1, 9, 16, 17, 50, 89], Tw=16, layout="varlen",
         decode_split=16, decode_topn_blocks=3, static=True),
    # decoding at G = 4, 8 and 16 (rows padded to 16 head rows: 16 the one with none padded), eager and static,
    # over split compressed slots, top-n ranges, parts and the fused combine
    dict(kind="decode", B=2, T=300, H=8, Hkv=2, D=16, steps=[1, 17, 150, 300], Tw=16, layout="varlen",
         decode_split=16, decode_topn_blocks=3),
    dict(kind="decode", B=2, T=120, H=8, Hkv=1, D=16, steps=[1, 30, 77, 119], layout="pad", static=True,
         decode_sel_step=2, decode_sel_part=4, decode_win_tile=16, decode_win_part=32, decode_fused_combine=1,
         param_overrides=dict(sel_num_blocks=6, window_size=40)),
    dict(kind="decode", B=2, T=400, H=16, Hkv=1, D=16, steps=[1, 20, 111, 400], Tw=40, layout="varlen",
         decode_parts=True, decode_sel_step=4, decode_win_tile=16,
         param_overrides=dict(sel_num_blocks=6, window_size=40)),
    dict(kind="decode", B=2, T=90, H=16, Hkv=1, D=16, steps=[1, 16, 17, 50, 89], Tw=16, layout="pad", static=True),
    dict(kind="decode", B=1, T=100, H=4, Hkv=1, D=32, steps=[1, 33, 100], Tw=16, dtype="float16"),
    # a chunk of queries after a cache (chunked prefill, speculative verification: nsa_decode_triton with Tq > 1
    # runs the training forward's kernels on the last Tq positions): G = 3 over documents, G = 16 over padding
    dict(kind="decode", B=2, T=90, H=6, Hkv=2, D=16, steps=[5, 17, 50, 90], Tw=16, layout="varlen", chunk=5),
    dict(kind="decode", B=2, T=100, H=16, Hkv=1, D=16, steps=[7, 40, 100], Tw=16, layout="pad", chunk=7),
    # ... with every key of the prefix in the window cache (a window K/V set of its own, an assisted-decoding crop)
    dict(kind="decode", B=2, T=91, H=6, Hkv=2, D=16, steps=[5, 17, 50, 91], Tw=91, layout="varlen", chunk=5),
    # the launchers never make the host wait for the GPU: training forward and backward, eager and static decoding,
    # over packed documents and over padding
    dict(kind="hostsync", B=2, T=90, H=6, Hkv=2, D=16, layout="varlen"),
    dict(kind="hostsync", B=2, T=90, H=6, Hkv=2, D=16, layout="pad"),
    # torch.compile(fullgraph=True) of the op, forward and backward through AOTAutograd, against eager; and with the
    # pair-wise dQ in fp16, whose backward op writes its fp32 dQ over the saved interval outputs (a declared
    # mutation, which AOTAutograd functionalizes)
    dict(kind="compile", B=2, T=40, H=4, Hkv=2, D=16, layout="varlen"),
    dict(kind="compile", B=2, T=40, H=4, Hkv=2, D=16, layout="varlen", dtype="float16", sel_dq_in_dkdv=True),
    # torch.library.opcheck of the custom ops (and of the pair-wise dQ's backward, which mutates o_cmp and o_win):
    # schema, autograd registration, fake implementations against
    # the real outputs (aot_eager above does not compare their shapes), AOT dispatch
    # (T = 24: the checks are of the ops' registration, which no length changes; 26 s under the interpreter, 47 at 40)
    dict(kind="opcheck", B=2, T=24, H=4, Hkv=2, D=16, layout="varlen"),
]


INTERPRETER_PROCESSES = 2  # CI's machine has 2 cores; the interpreter runs one thread per process
# Each case's seconds under the interpreter (one process per core, 2 cores), for splitting the cases between the
# processes by cost; a case not listed counts as the median. Refresh after adding or resizing cases:
# NSA_INTERPRETER_SECONDS=tests/data/interpreter_case_seconds.json pytest tests/test_triton_kernels.py -k interpreter
CASE_SECONDS_FILE = HERE / "data" / "interpreter_case_seconds.json"


def _interpreter_shares() -> list[list[int]]:
    """CPU_CASES' indices split into INTERPRETER_PROCESSES lists of about equal recorded cost (longest first, each
    to the least loaded process), so the processes finish together."""
    recorded = json.loads(CASE_SECONDS_FILE.read_text()) if CASE_SECONDS_FILE.is_file() else {}
    known = sorted(recorded.values())
    default = known[len(known) // 2] if known else 1.0
    cost = [recorded.get(_case_id(c), default) for c in CPU_CASES]
    shares, load = [[] for _ in range(INTERPRETER_PROCESSES)], [0.0] * INTERPRETER_PROCESSES
    for i in sorted(range(len(CPU_CASES)), key=lambda i: -cost[i]):
        k = load.index(min(load))
        shares[k].append(i)
        load[k] += cost[i]
    return [sorted(share) for share in shares]


def interpreter_commands() -> list:
    """The background job of the CPU cases (tests/background.py): INTERPRETER_PROCESSES processes side by side."""
    if not HAS_TRITON or common_module()._interpreter_reason():
        return []  # the fixture skips, naming why
    from background import Command

    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    return [Command([sys.executable, str(HERE / "triton_helpers.py"), json.dumps([CPU_CASES[i] for i in share])],
                    env=env, cwd=str(HERE.parent))
            for share in _interpreter_shares()]


@pytest.fixture(scope="module")
def interpreter_results():
    """Every CPU case's comparison, from the background job interpreter_commands."""
    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    if common_module()._interpreter_reason():  # an environment without a working interpreter, named
        pytest.skip(common_module()._interpreter_reason())
    import background

    shares = _interpreter_shares()
    results, seconds = [None] * len(CPU_CASES), {}
    # about 3.5 minutes of CPU per process; a loaded machine may take several times that (pytest-timeout: 900)
    for share, done in zip(shares, background.results(interpreter_commands, timeout=880)):
        if done.timed_out:  # said once, without the cases' JSON (the command line)
            pytest.fail(f"the interpreter run of {len(share)} kernel cases took over 880 s")
        lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULTS_JSON=")]
        assert lines, f"interpreter run failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        for i, result in zip(share, json.loads(lines[-1][len("RESULTS_JSON="):])):
            seconds[_case_id(CPU_CASES[i])] = result.pop("seconds")
            results[i] = result
    if os.environ.get("NSA_INTERPRETER_SECONDS"):
        Path(os.environ["NSA_INTERPRETER_SECONDS"]).write_text(json.dumps(dict(sorted(seconds.items())), indent=1))
    return results


BACKGROUND_JOBS = {"interpreter_results": interpreter_commands}  # started when collection ends (conftest.py)


def common_module():
    from triton_helpers import kernel_module

    return kernel_module("common")


def test_a_broken_interpreter_is_named(monkeypatch):
    """Triton < 3.7's interpreter with numpy >= 2.4 fails inside every kernel with a loop bound computed in the
    kernel; the backend check says so (and what to install) instead."""
    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    import numpy

    tri = common_module()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(tri.triton, "__version__", "3.6.0")
    monkeypatch.setattr(numpy, "__version__", "2.4.1")
    assert "install triton>=3.7 or numpy<2.4" in tri.triton_unusable_reason("cpu")
    monkeypatch.setattr(numpy, "__version__", "2.3.5")
    assert tri.triton_unusable_reason("cpu") is None
    monkeypatch.setattr(tri.triton, "__version__", "3.7.0")
    monkeypatch.setattr(numpy, "__version__", "2.4.1")
    assert tri.triton_unusable_reason("cpu") is None



def _interpreter_script_json(script: str, prefix: str):
    """Run tests/<script> in a process of its own under TRITON_INTERPRET=1 (skipping where the interpreter cannot
    run) and return the JSON of its last stdout line starting with prefix."""
    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    if common_module()._interpreter_reason():
        pytest.skip(common_module()._interpreter_reason())
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, str(HERE / script)], capture_output=True, text=True, env=env, timeout=300,
                          cwd=str(HERE.parent))
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(prefix)]
    assert lines, f"{script} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads(lines[-1][len(prefix):])

def test_vectorized_interpreter_reductions_equal_the_interpreters_own():
    """The kernel cases run tl.sort's xor reductions and the kernels' associative scans as whole-array steps
    (triton_helpers.vectorize_interpreter_reductions: minutes less of CI); each gives the arrays the interpreter's
    per-element path gives (tests/interpreter_reductions.py, in a process of its own: TRITON_INTERPRET=1)."""
    checks = _interpreter_script_json("interpreter_reductions.py", "REDUCTIONS_JSON=")
    assert checks.pop("installed"), "vectorize_interpreter_reductions found no interpreter methods to replace"
    assert len(checks) == 7 and all(checks.values()), checks



def test_interpreter_access_checks_catch_races_and_allow_reads_ordered_by_atomics():
    """The kernel cases' access checks (triton_helpers.check_memory_accesses) on toy kernels: a write past a
    tensor's end and a read of another program's write are errors; a read after an acquiring count of programs that
    counted themselves (releasing) after their writes is not (the decode parts' last-arriving combine), and a
    relaxed count orders nothing (tests/interpreter_access_checks.py, in a process of its own: TRITON_INTERPRET=1)."""
    assert _interpreter_script_json("interpreter_access_checks.py", "ACCESS_JSON=") == {
        "ordered_by_acq_rel_count": "ok", "relaxed_count": "MemoryAccessError", "no_count": "MemoryAccessError",
        "past_the_end": "MemoryAccessError"}

def _check(res, case, tol):
    assert "error" not in res, res.get("trace", res.get("error"))
    if case.get("kind") in ("decode", "compile"):
        assert res[case["kind"]] <= tol, res
        return
    if case.get("kind") == "layout":
        assert res["mismatches"] == 0 and res["checked"] > 0, res
        return
    if case.get("kind") == "ranges":
        assert res["mismatches"] == 0 and res["violations"] == 0 and res["checked"] > 0, res
        assert res["runs"] > 0 or case["T"] < 64, res  # whole tiles inside windows: unmasked runs exist
        return
    if case.get("kind") == "heavyplan":
        assert res["hpos"] == res["slot_rank"] == res["pieces"] == res["piece_start"] == 0, res
        assert res["split"] > 1 and res["n_pieces"] > res["split"], res  # several blocks, several pieces each
        return
    if case.get("kind") == "union":
        assert res["mismatches"] == 0 and res["mask_bits"] > 0, res
        assert res["max_count"] > 4 and res["max_past"] > 0, res  # tiles with repeats removed and causal-free blocks
        return
    if case.get("kind") == "opcheck":
        assert res and all(outcome == "SUCCESS" for outcome in res.values()), res
        return
    if case.get("kind") == "hostsync":
        assert res["syncs"] == [] and res["ops"] > 100, res  # (the launchers' ops were recorded)
        return
    if case.get("kind") == "seldq":
        assert not res["nan"] and res["dq"] <= tol, res
        return
    if case.get("kind") == "selfwd":
        assert not res["nan"] and res["out"] <= tol and res["lse"] <= tol and res["inf_rows_agree"], res
        assert res["rows_without_blocks"] > 0 or case.get("layout") != "pad", res  # padding rows: +inf, o = 0
        return
    if case.get("kind") != "select":
        assert not res["nan"]
        assert res["out"] <= tol, res
        for name in GRADS:  # (<name>_rounded: against the exact gradients plus the stored outputs' rounding, where
            # a case asks for that judgement: triton_helpers.flash_rounding_terms, bench/fuzz_kernels.py's second look)
            assert res[name] <= tol or res.get(f"{name}_rounded", float("inf")) <= tol, (name, res)
    assert res["idx_shape_ok"] and res["idx_sets_valid"], res
    assert res["idx_tie_gap"] <= 1e-4, res  # indices differ only at genuine near-ties
    assert res["idx_order_gap"] <= 1e-4, res  # and are listed in the reference's priority order


@pytest.mark.parametrize("i", range(len(CPU_CASES)), ids=[_case_id(c) for c in CPU_CASES])
def test_interpreter_kernels_match_reference(interpreter_results, i):
    case = CPU_CASES[i]
    tol = case.get("tol", 2e-3 if case.get("dtype") == "float16" else 1e-4)
    _check(interpreter_results[i], case, tol)


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton (its kernels are replaced, not run: no GPU or interpreter)")
def test_decode_parts_span_the_visible_window_and_fit_a_launch_grid(monkeypatch):
    """The decode step's launches, recorded host-side (kernels replaced: no GPU needed): a static cache whose window
    holds every key (a window sharing the selection keys: 200 here, w = 40) gets window parts over the w keys a
    query sees (3 of 16 keys, not 13: the rest were idle programs), and where the parts would pass a launch
    grid's second axis (65,535; lowered to 4 here) the step runs the finish kernel instead."""
    import triton_helpers

    layout, _, tri = triton_helpers.import_nsa()
    decode = triton_helpers.kernel_module("decode")
    launched = []

    class Recorded:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            launched.append((self.name, tuple(grid)))
            return lambda *args, **kwargs: None

    for name in [n for n in vars(decode) if n.startswith("_decode_") and n.endswith("_kernel")]:
        monkeypatch.setattr(decode, name, Recorded(name))
    case = dict(B=2, T=200, H=6, Hkv=2, D=16, layout="pad", param_overrides=dict(sel_num_blocks=6, window_size=40))
    t, cmp_end, doc_pos, p, _, _ = triton_helpers.case_setup(case)
    ends = layout.compressed_token_ends(doc_pos, p, num_slots=cmp_end.shape[1])
    cache, query_end = triton_helpers.static_layout(t, ends, doc_pos, 200, 200)  # (a 200-key window ring)

    def step():
        launched.clear()
        with tri.launch_overrides(decode_win_tile=16, decode_win_part=16, decode_sel_part=8):
            decode._decode_step(t["q"][:, -1:], *cache[:7], t["gates"][:, -1:], cache[7], p, 0.25, query_end=query_end)
        return dict(launched)

    assert cache[5].shape[1] == 200 and step()["_decode_parts_kernel"] == (4, 1 + 3 + 1)  # (B x Hkv, parts)
    monkeypatch.setattr(decode, "_GRID_AXIS_MAX", 4)
    grids = step()
    assert "_decode_parts_kernel" not in grids and grids["_decode_finish_kernel"] == (4,)


def test_case_ids_are_unique():
    """Each case's id names it in pytest and keys its recorded seconds (CASE_SECONDS_FILE): two cases with one id
    would share a cost and read as one case in a failure."""
    for cases in (CPU_CASES, GPU_CASES + _GPU_DECODE_CASES):
        ids = [_case_id(c) for c in cases]
        assert len(set(ids)) == len(ids), sorted(i for i in set(ids) if ids.count(i) > 1)


def test_triton_is_usable_reports_device():
    from triton_helpers import import_nsa

    _, _, tri = import_nsa()
    interpreter = HAS_TRITON and os.environ.get("TRITON_INTERPRET") == "1" and not common_module()._interpreter_reason()
    assert tri.triton_is_usable("cpu") == interpreter
    if not torch.cuda.is_available():
        assert not tri.triton_is_usable("cuda")


# ---------------------------------------------------------------- GPU: bf16 at real shapes
GPU = pytest.mark.skipif(not torch.cuda.is_available() or not HAS_TRITON, reason="needs CUDA and triton")

GPU_CASES = [
    dict(B=1, T=1, H=12, Hkv=2, D=64),
    dict(B=2, T=63, H=12, Hkv=2, D=64),
    dict(B=2, T=64, H=4, Hkv=2, D=128),
    dict(B=2, T=65, H=6, Hkv=6, D=64),
    # G = 3 (padded to 4 heads: the top-n's head-lane rows with a padded head) over packed documents
    dict(B=2, T=1000, H=6, Hkv=2, D=64, layout="varlen"),
    dict(B=2, T=1000, H=12, Hkv=2, D=64, layout="varlen"),
    dict(B=2, T=1000, H=8, Hkv=2, D=128, layout="pad"),
    dict(B=1, T=2048, H=16, Hkv=1, D=64),
    dict(B=1, T=2048, H=8, Hkv=1, D=128, layout="varlen"),
    dict(B=1, T=2048, H=4, Hkv=2, D=64, layout="pad"),
    dict(B=1, T=4097, H=12, Hkv=2, D=64),
    dict(B=1, T=4097, H=16, Hkv=2, D=64, layout="varlen"),
    dict(B=2, T=1000, H=12, Hkv=2, D=64, dtype="float16", layout="varlen"),
    # the selected dQ added by the selected dK/dV kernel (sel_dq_in_dkdv; its launches: 8 warps at d64, 16-row
    # tiles at d128)
    dict(B=1, T=4097, H=12, Hkv=2, D=64, sel_dq_in_dkdv=True),
    dict(B=2, T=1000, H=16, Hkv=1, D=64, layout="varlen", sel_dq_in_dkdv=True),
    dict(B=2, T=1000, H=6, Hkv=2, D=64, layout="pad", sel_dq_in_dkdv=True),  # G = 3, padding
    dict(B=1, T=2048, H=8, Hkv=1, D=128, layout="pad", sel_dq_in_dkdv=True),
    # ... with every block above 256 pairs cut into pieces (block 0: every query's initial block, 4,097 pairs), 64
    # partials: pieces far above the 20-pair smallest, the heavy pass adding its pairs' dQ too
    dict(B=1, T=4097, H=12, Hkv=2, D=64, sel_dq_in_dkdv=True, sel_pieces=[256, 16, 64, 32]),
    # the default selected dQ with block 0 (4,097 pairs) cut into pieces of 160 pairs (16 tiles) and more
    dict(B=1, T=4097, H=12, Hkv=2, D=64, sel_pieces=[2048, 160, 64, 32]),
    # the block-outer selected forward (sel_fwd_pairs) and dQ (sel_dq_pairs) at the real sizes, in their default
    # chunks
    dict(B=1, T=4097, H=12, Hkv=2, D=64, sel_fwd_pairs=True, sel_dq_pairs=True),
    dict(B=2, T=1000, H=16, Hkv=1, D=64, layout="varlen", sel_fwd_pairs=True, sel_dq_pairs=True),
    dict(B=1, T=2048, H=8, Hkv=1, D=128, layout="pad", sel_fwd_pairs=True, sel_dq_pairs=True),
    # ... and the block-outer forward with the dQ formed in the selected dK/dV (tune variant pairs_all)
    dict(B=1, T=4097, H=12, Hkv=2, D=64, sel_fwd_pairs=True, sel_dq_in_dkdv=True),
    # the union walk's per-query choice bits at real sizes: G = 1 (128-query tiles: four mask words) and G = 2 (two),
    # the int64 sort keys, and the selected forward and top-n under their 128-register caps (four programs per SM)
    dict(B=1, T=2048, H=4, Hkv=4, D=64, layout="varlen"),
    dict(B=2, T=1000, H=4, Hkv=2, D=64, layout="pad", sel_union_wide_keys=True),
    dict(B=1, T=4097, H=12, Hkv=2, D=64, sel_fwd_max_registers=128, topn_max_registers=128),
    # the int64 offsets of huge inputs (pair positions, K/V and q rows within a row), forced at a real size
    dict(B=2, T=1000, H=12, Hkv=2, D=64, layout="varlen", sel_pairs_int64=True, offsets_int64=True),
    # the selected dQ in a launch of its own (sel_dq_split, tune variant seldq_split): its compiled kernel and its
    # extra rounding of the interval dQ, at G = 6, 16 and 8 (head_dim 128)
    dict(B=1, T=4097, H=12, Hkv=2, D=64, sel_dq_split=True),
    dict(B=2, T=1000, H=16, Hkv=1, D=64, layout="varlen", sel_dq_split=True),
    dict(B=1, T=2048, H=8, Hkv=1, D=128, layout="pad", sel_dq_split=True),
    # the block-outer forward with the default (union) dQ, which reads its log-sum-exp, at G = 1 and 4
    dict(B=1, T=2048, H=4, Hkv=4, D=64, layout="varlen", sel_fwd_pairs=True),
    dict(B=2, T=1000, H=8, Hkv=2, D=64, layout="pad", sel_fwd_pairs=True),
]
for _c in GPU_CASES:
    _c.setdefault("dtype", "bfloat16")
    _c.update(device="cuda", params="default")


@GPU
@pytest.mark.parametrize("case", GPU_CASES, ids=[_case_id(c) for c in GPU_CASES])
def test_gpu_kernels_match_reference(case):
    from triton_helpers import run_case

    res = run_case(case)
    print(_case_id(case), json.dumps({k: (round(v, 6) if isinstance(v, float) else v) for k, v in res.items()}))
    _check(res, case, 1e-2)


# the decode cases on the GPU: G = 6 eagerly at three lengths (9000: top-n over three block ranges); a static
# cache's step (parts) with the separate combine launch and with the parts' last program combining them
# (decode_fused_combine), at G = 6 and 16; G = 4 and 8 eagerly; a chunk of 7 queries after a cache
_GPU_DECODE_CASES = [
    dict(dict(kind="decode", B=2, D=64, Tw=512, dtype="bfloat16", device="cuda", params="default", layout="pad"),
         steps=[7 if knobs.get("chunk") else 1, 31, 32, 33, knobs["T"] // 2, knobs["T"]], **knobs)
    for knobs in [
        *[dict(T=T, H=12, Hkv=2) for T in (100, 4097, 9000)],
        *[dict(T=9000, H=h, Hkv=hkv, static=True, decode_fused_combine=fused)
          for h, hkv in ((12, 2), (16, 1)) for fused in (0, 1)],
        dict(T=4097, H=8, Hkv=2, layout="varlen"),
        dict(T=4097, H=8, Hkv=1),
        dict(T=4097, H=12, Hkv=2, layout="varlen", chunk=7),
    ]
]


@GPU
@pytest.mark.parametrize("case", _GPU_DECODE_CASES, ids=[_case_id(c) for c in _GPU_DECODE_CASES])
def test_gpu_decode_matches_reference(case):
    from triton_helpers import run_decode_case

    res = run_decode_case(case)
    assert res["decode"] <= 1e-2, res


@GPU
@pytest.mark.parametrize("fused_combine", [0, 1], ids=["combinekernel", "fusedcombine"])
def test_gpu_decode_pdl_equals_the_default_eager_and_graphed(fused_combine):
    """decode_pdl=1 (each decode launch a programmatic dependent launch waiting for the one before) changes when
    programs start, never what they compute: bitwise the default's output, eager and from a static step captured
    in a CUDA graph and replayed at three positions (programmatic edges in the graph), over three block ranges,
    rows of packed documents. Bitwise equality is necessary, not sufficient: a wait in the wrong place could
    still pass by timing (tests/test_triton_compile.py checks where the wait is)."""
    from triton_helpers import import_nsa, kernel_module, pdl_decode_case

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("programmatic dependent launch needs sm_90 or later: before, decode_pdl changes nothing")
    _, _, tri = import_nsa()
    case = pdl_decode_case("cuda")
    eager, static_step, set_position, positions = case.eager, case.static_step, case.set_position, case.positions
    with tri.launch_overrides(decode_pdl=1):
        assert kernel_module("launch")._decode_launch(case.head_dim, case.params.sel_num_blocks, case.params, True,
                                                      case.device).pdl

    with tri.launch_overrides(decode_fused_combine=fused_combine):
        expected_eager = [eager(tk) for tk in positions]
        expected_static = []
        for tk in positions:
            set_position(tk)
            expected_static.append(static_step().clone())
    with tri.launch_overrides(decode_pdl=1, decode_fused_combine=fused_combine):
        for tk, want in zip(positions, expected_eager):
            assert torch.equal(eager(tk), want), tk
        set_position(positions[0])
        static_step()  # compiled before the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            graphed_out = static_step()
        for tk, want in zip(positions, expected_static):
            set_position(tk)
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(graphed_out, want), tk


def _gpu_memory_gib() -> float:
    return torch.cuda.get_device_properties(0).total_memory / 2**30 if torch.cuda.is_available() else 0.0


@GPU
@pytest.mark.parametrize(
    "case",
    [
        # q, the output and dq hold 2**31 + 2**20 elements: the last row starts past int32 (about 36 GiB in all)
        dict(kind="large_offset", B=2049, T=1024, H=16, Hkv=2, D=64, rows=[0, 2048], min_gib=60),
        # the selected K/V cache holds 2.1 * 2**31 elements (8.5 GiB); row 16 starts at 2**31
        dict(kind="large_offset_decode", B=17, T=2**20, H=12, Hkv=2, D=64, rows=[0, 16], min_gib=24),
    ],
    ids=["train-q-over-int32", "decode-kv-over-int32"],
)
def test_gpu_int64_addressing(case):
    if _gpu_memory_gib() < case["min_gib"]:
        pytest.skip(f"needs a GPU with {case['min_gib']} GiB (this one has {_gpu_memory_gib():.0f})")
    # in a process of its own: an int32 overflow would show as an illegal memory access, which leaves this
    # process's CUDA context unusable for every later test
    env = dict(os.environ, TRITON_INTERPRET="0")
    proc = subprocess.run(
        [sys.executable, str(HERE / "triton_helpers.py"), json.dumps([dict(case, device="cuda", dtype="bfloat16")])],
        capture_output=True, text=True, env=env, timeout=600, cwd=str(HERE.parent),
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS_JSON=")]
    assert lines, f"large-offset run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    res = json.loads(lines[-1][len("RESULTS_JSON="):])[0]
    print(case["kind"], json.dumps(res))
    assert "error" not in res, res.get("trace", res.get("error"))
    assert res["finite"] and res["out_equal_alone"], res
    if case["kind"] == "large_offset":
        assert res["idx_equal_alone"], res
        for name in ["out", *GRADS]:
            assert res[name] <= 1e-2, (name, res)


@GPU
def test_gpu_compile_fullgraph():
    from triton_helpers import DEFAULT, import_nsa, make_inputs

    _, _, tri = import_nsa()
    t, cmp_end, doc_pos, p = make_inputs(2, 300, 12, 2, 64, DEFAULT, torch.bfloat16, "cuda", "varlen")
    leaves = {n: x.clone().requires_grad_(True) for n, x in t.items()}

    def f(q, kc, vc, ks, vs, kw, vw, g):
        return tri.nsa_attention_triton(q, kc, vc, cmp_end, ks, vs, kw, vw, g, doc_pos, p).float().square().sum()

    order = ["q", "k_cmp", "v_cmp", "k_slc", "v_slc", "k_win", "v_win", "gates"]
    eager = f(*[leaves[n] for n in order])
    eager.backward()
    grads = [leaves[n].grad.clone() for n in order]
    for n in order:
        leaves[n].grad = None
    compiled = torch.compile(f, fullgraph=True)(*[leaves[n] for n in order])
    compiled.backward()
    torch.testing.assert_close(compiled, eager, rtol=1e-3, atol=1e-3)
    for n, g in zip(order, grads):
        torch.testing.assert_close(leaves[n].grad, g, rtol=1e-2, atol=1e-2)


@GPU
@pytest.mark.parametrize("sel_dq_pairs", [False, True], ids=["union-dq", "pair-kernel-dq"])
def test_gpu_selected_dkdv_deterministic(sel_dq_pairs):
    """Every gradient bitwise equal between two runs: the default, and with the selected dQ from the block-outer
    pair kernel's partials (summed in slot order, no atomics)."""
    from triton_helpers import DEFAULT, import_nsa, make_inputs

    _, _, tri = import_nsa()
    t, cmp_end, doc_pos, p = make_inputs(1, 2048, 12, 2, 64, DEFAULT, torch.bfloat16, "cuda", "varlen")
    runs = []
    with tri.launch_overrides(sel_dq_pairs=sel_dq_pairs):
        for _ in range(2):
            leaves = {n: x.clone().requires_grad_(True) for n, x in t.items()}
            out = tri.nsa_attention_triton(leaves["q"], leaves["k_cmp"], leaves["v_cmp"], cmp_end, leaves["k_slc"],
                                           leaves["v_slc"], leaves["k_win"], leaves["v_win"], leaves["gates"], doc_pos,
                                           p)
            out.float().sum().backward()
            runs.append([leaves[n].grad for n in leaves])
    for a, b in zip(*runs):
        assert torch.equal(a, b)
