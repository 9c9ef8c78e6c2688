"""Selected-attention query tiles: what each tile width costs on given selections (CPU, a model, not a timing).

    python bench/selection_tiles.py [--lengths 2048 8192 65536] [--queries 1024]

The selected-attention kernels (forward and the fused dQ) give one program a tile of QPB consecutive queries
x the G heads of a KV group (BLOCK_M rows) and walk the union of the tile's selected blocks, loading each
block once for the whole tile. Without sub-tiles every union block costs BLOCK_M rows of QK^T, softmax and
PV, and the union grows with the tile. With sub-tiles (16 rows each; what the kernels do before Hopper and
at head_dim 128) a sub-tile does the math only for the blocks one of its own rows' queries chose, so a wider
tile shares more loads while the math stays that of the sub-tile. This script counts both on real
selections (the reference's top-n for the last --queries queries of a sequence) for several tile widths.
A count is not a timing: on the H100 a 16-row tl.dot costs about a 64-row one (wgmma), and the whole
64-row tile was the fastest there (bench/tune_kernels.py, README):

- blocks/tile: distinct blocks in a tile's union (n = 16 per query);
- loads/query: union / QPB, K/V blocks each query's tile reads (a query alone reads n);
- rows/query-head: block-rows of math per query head (n = 16 with no waste).

Two input kinds: "random" is what bench/bench_attention.py times (fresh Gaussian q and keys: consecutive
queries choose nearly unrelated blocks, the worst case for a union), "correlated" makes consecutive queries
similar (q = shared + 0.3 noise), closer to a trained model where neighbouring queries attend alike. Which
resource binds (L2 block loads or math) is what `bench/tune_kernels.py` measures on a GPU (variants with
sel_rows and sel_sub_rows). The "launcher" column marks the sm_90 launcher's tile.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from triton_helpers import DEFAULT, import_nsa, kernel_module  # noqa: E402

layout_mod, reference, _ = import_nsa()
launch = kernel_module("launch")  # the launchers' tile choices
PARAMS = layout_mod.NSAParams(**DEFAULT)


def selections(T: int, H: int, Hkv: int, D: int, num_queries: int, kind: str, gen: torch.Generator):
    """Top-n block indices (Hkv, Tq, n) of the last num_queries queries of one sequence of T tokens."""
    doc_pos = torch.arange(T).view(1, T)
    cmp_end = layout_mod.compressed_token_ends(doc_pos, PARAMS)
    num_slots, group = cmp_end.shape[1], H // Hkv
    if kind == "random":
        q = torch.randn(1, num_queries, H, D, generator=gen)
    else:
        q = torch.randn(1, 1, H, D, generator=gen) + 0.3 * torch.randn(1, num_queries, H, D, generator=gen)
    k_cmp = torch.randn(1, num_slots, Hkv, D, generator=gen)
    t = torch.arange(T - num_queries, T)
    visible = (cmp_end[0][None, :] >= 0) & (cmp_end[0][None, :] <= t[:, None])  # (Tq, Nc)
    q_grouped = q.view(1, num_queries, Hkv, group, D).permute(0, 2, 3, 1, 4)  # (1, Hkv, G, Tq, D)
    logits = torch.einsum("bkgtd,bnkd->bkgtn", q_grouped, k_cmp) / math.sqrt(D)
    p_cmp = logits.masked_fill(~visible, float("-inf")).softmax(-1).reshape(1, H, num_queries, num_slots)
    num_blocks = -(-T // PARAMS.sel_block_size)
    scores = reference.selection_block_scores(p_cmp, cmp_end, doc_pos, num_blocks, PARAMS, Hkv)
    return reference.select_blocks(scores, doc_pos[:, T - num_queries:], PARAMS)[0]


def tile_costs(idx: torch.Tensor, group: int, rows: int, sub_rows: int | None = None) -> dict:
    """Mean union, loads and math of one tile width; sub_rows: the math done per sub-tile of that many rows,
    only for the blocks one of its rows' queries chose (the loads stay the tile's)."""
    block_m, qpb = launch._query_tile(group, rows)
    sub_rows = sub_rows or block_m
    num_kv, num_q, n_sel = idx.shape
    n_tiles = num_q // qpb
    tiles = idx[:, : n_tiles * qpb].reshape(num_kv, n_tiles, qpb, n_sel)
    union, math_rows = [], []
    for per_kv in tiles:
        for tile in per_kv:
            union.append(len(set(tile.flatten().tolist()) - {-1}))
            subs = 0
            for r0 in range(0, qpb * group, sub_rows):  # sub-tile rows r0 .. r0 + sub_rows - 1 (query = row // G)
                queries = tile[r0 // group: min(qpb, (r0 + sub_rows - 1) // group + 1)]
                subs += len(set(queries.flatten().tolist()) - {-1}) * sub_rows
            math_rows.append(subs)
    u = sum(union) / len(union)
    return dict(block_m=block_m, qpb=qpb, union=u, loads=u / qpb, rows=sum(math_rows) / len(math_rows) / (qpb * group))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="*", default=[2048, 8192, 65536])
    ap.add_argument("--queries", type=int, default=1024, help="queries sampled at the end of each sequence")
    ap.add_argument("--layouts", nargs="*", default=["12,2,64", "16,1,64"])
    args = ap.parse_args()
    print("| layout | T | inputs | tile rows (QPB) | blocks/tile | loads/query | rows/query-head | launcher |")
    print("|---|---|---|---|---|---|---|---|")
    for spec in args.layouts:
        H, Hkv, D = (int(s) for s in spec.split(","))
        for T in args.lengths:
            picked = launch._sel_rows_per_program(H // Hkv, D)[0]
            picked_sub = launch._sel_sub_tile(picked, D, "cpu")  # what the launcher picks on sm_90
            for kind in ("random", "correlated"):
                idx = selections(T, H, Hkv, D, min(T, args.queries), kind, torch.Generator().manual_seed(0))
                for rows, sub_rows in ((16, None), (32, None), (64, None), (32, 16), (64, 16)):
                    c = tile_costs(idx, H // Hkv, rows, sub_rows)
                    mark = "<-" if (c["block_m"], sub_rows or c["block_m"]) == (picked, picked_sub) else ""
                    width = f"{c['block_m']} ({c['qpb']})" + (f", math per {sub_rows}-row sub-tile" if sub_rows else "")
                    print(f"| {H}q/{Hkv}kv d{D} | {T} | {kind} | {width} | {c['union']:.1f} | "
                          f"{c['loads']:.1f} | {c['rows']:.1f} | {mark} |", flush=True)


if __name__ == "__main__":
    main()
