"""How long a launch of programs with unequal work takes, against a balanced one: a list-scheduling model of the
two backward kernels whose programs' work is skewed (bench/KERNELS.md, "2026-11-27 H100").

- The selected dK/dV: a program's work is its block's (query, block) pairs, in pair tiles of QPB queries. Block 0
  is forced for every query of its row, the last LOCAL blocks for the queries in them, and the top-n's free picks
  (modelled as uniform among a query's other visible blocks: random queries) favour early blocks.
- The compressed dK/dV: key tile t (64 compressed keys) is seen by the queries after it, in n_split query splits.
- The query-tile kernels (top-n, selected forward, fused dQ, compressed/window forward): a tile's work grows with
  its position in the row (more compressed keys to score and attend, more blocks to choose among, a larger union of
  chosen blocks), so launching each row's tiles from its start ends the launch on the longest tiles.

Programs start in grid order (the fastest axis first) on SLOTS identical slots (132 SMs x programs per SM), each
taking the next program when it frees: the makespan over the balanced time (total work / slots) says what the
order costs. The same per-tile time then explains the measured kernel times (KERNELS.md's table).

    python bench/schedule_model.py [--lengths 2048 8192 32768 65536] [--slots 264] [--picks uniform concentrated]
"""

from __future__ import annotations

import argparse
import heapq
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from modeling_nsa.nsa_triton_selected import _sel_heavy_split  # noqa: E402  (plain Python: no triton needed)
from modeling_nsa.nsa_triton_interval import _dkdv_query_splits  # noqa: E402

BLOCK = 64  # selection block and compressed-key tile (NSA_SPEC defaults: l' = 64)
N_SEL, INIT, LOCAL = 16, 1, 2  # selected blocks per query, forced initial and local blocks
CMP_STRIDE = 16  # d: one compressed key per 16 keys
TOKENS = 65536  # B x T, as bench_attention's table


def makespan(costs, slots: int) -> float:
    """Time until the last program ends when programs start in list order on `slots` slots."""
    free = [0.0] * slots
    end = 0.0
    for cost in costs:
        start = heapq.heappop(free)
        end = max(end, start + cost)
        heapq.heappush(free, start + cost)
    return end


def selected_pair_counts(seq_len: int, rng, picks: str = "uniform") -> np.ndarray:
    """Pairs per selection block of one row: forced blocks plus N_SEL - forced picks per query among its other
    visible blocks, uniform (random queries) or concentrated (correlated queries: every query favours the same
    blocks, a block's weight 1 / rank**1.2 over a random ranking of the row's blocks)."""
    n_blocks = -(-seq_len // BLOCK)
    counts = np.zeros(n_blocks, np.int64)
    log_weight = np.zeros(n_blocks)  # uniform: equal weights
    if picks == "concentrated":
        log_weight[rng.permutation(n_blocks)] = -1.2 * np.log(np.arange(1, n_blocks + 1))
    # the queries of one block share their visible and forced blocks: each block's queries draw their picks at once
    # (draw_without_replacement), where a draw per query took a minute at 64k
    for own in range(n_blocks):
        n_queries = min(BLOCK, seq_len - own * BLOCK)
        forced = np.array(sorted(set(range(min(INIT, own + 1))) | set(range(max(0, own - LOCAL + 1), own + 1))),
                          dtype=np.int64)
        free = np.setdiff1d(np.arange(own + 1), forced)
        n_free = min(N_SEL - forced.size, free.size)
        counts[forced] += n_queries
        if n_free == free.size:  # every free block chosen
            counts[free] += n_queries
        elif n_free > 0:
            chosen = draw_without_replacement(rng, log_weight[free], n_queries, n_free)
            counts += np.bincount(free[chosen.ravel()], minlength=n_blocks)
    return counts


def draw_without_replacement(rng, log_weight: np.ndarray, draws: int, n: int) -> np.ndarray:
    """`draws` independent draws of n distinct indices of log_weight, each as n successive picks with probability
    weight / weight not yet picked (numpy's choice(replace=False, p=...)), by the Gumbel-top-k trick: the n
    largest log-weight + Gumbel noise. (draws, n) indices, in no order."""
    keys = log_weight + rng.gumbel(size=(draws, log_weight.size))  # (draws, len(log_weight))
    return np.argpartition(-keys, n - 1, axis=1)[:, :n]


SCHEMES = ("old", "fixed", "pieces")


def selected_dkdv(seq_len: int, num_kv: int, qpb: int, slots: int, rng, scheme: str = "pieces",
                  picks: str = "uniform", program_overhead: float = 1.0) -> float:
    """Makespan / balanced time of the selected dK/dV, each program costing its pair tiles plus program_overhead
    tiles (its block's loads, its partial's store). Schemes: old = the order timed until 2026-11-27 (main pass with
    the key range fastest, then blocks above 8,192 pairs in 16 splits, 64 slots in flat order); fixed = the
    27e2931 default (blocks above 4,096 pairs first, ~128-tile splits, 16-256 a block, 1,024 partials, the
    heaviest blocks taking the slots, then the main pass with the row fastest); pieces = the default since
    (_sel_heavy_pieces: every slotted block cut into pieces of one size, at least 32 tiles, as small as fits the
    1,024 partials)."""
    rows = (TOKENS // seq_len) * num_kv
    per_row = [selected_pair_counts(seq_len, rng, picks) for _ in range(rows)] if picks != "uniform" else \
        [selected_pair_counts(seq_len, rng)] * rows  # uniform picks: every row alike (the same statistics)
    blocks = [(row, block, int(pairs)) for row in range(rows) for block, pairs in enumerate(per_row[row]) if pairs]
    if scheme == "old":
        heavy_min, n_split, n_slots = 8192, 16, 64
    elif scheme == "fixed":
        n_split = min(256, max(16, 1 << max(0, math.ceil(math.log2(max(1, seq_len / (qpb * 128)))))))
        heavy_min, n_slots = 4096, max(4, 1024 // n_split)
    else:
        heavy_min, min_piece, max_pieces, max_slots = _sel_heavy_split(qpb)
        n_slots = max(1, min(len(blocks), max_slots, sum(b[2] for b in blocks) // (heavy_min + 1)))
    candidates = [b for b in blocks if b[2] > heavy_min]
    slotted = candidates[:n_slots] if scheme == "old" else sorted(candidates, key=lambda b: -b[2])[:n_slots]
    if scheme == "pieces":
        span = max(min_piece, math.ceil(sum(b[2] for b in slotted) / (max_pieces - n_slots)))
        span = math.ceil(span / qpb) * qpb
        heavy = [math.ceil(min(span, pairs - s) / qpb) + program_overhead
                 for _, _, pairs in slotted for s in range(0, pairs, span)]
    else:
        heavy = []
        for _, _, pairs in slotted:
            piece = math.ceil(math.ceil(pairs / n_split) / qpb) * qpb
            heavy += [math.ceil(max(0, min(piece, pairs - s * piece)) / qpb) + program_overhead for s in range(n_split)]
    slotted = set(slotted)
    main = [(row, block, math.ceil(pairs / qpb) + program_overhead) for row, block, pairs in blocks
            if (row, block, pairs) not in slotted]
    order = (lambda m: (m[0], m[1])) if scheme == "old" else (lambda m: (m[1], m[0]))  # fastest axis last in the key
    main_costs = [m[2] for m in sorted(main, key=order)]
    work = sum(math.ceil(pairs / qpb) for _, _, pairs in blocks)  # the pair tiles alone: the balanced time's work
    passes = [main_costs, heavy] if scheme == "old" else [heavy, main_costs]
    return sum(makespan(p, slots) for p in passes if p) / (work / slots)


def compressed_dkdv(seq_len: int, num_kv: int, qpb: int, slots: int, old: bool) -> float:
    """Makespan / balanced time of the compressed dK/dV: old = key tile fastest, else the key tile slowest."""
    rows = (TOKENS // seq_len) * num_kv
    n_tiles = max(1, seq_len // CMP_STRIDE // BLOCK)
    n_split = _dkdv_query_splits(n_tiles * rows, seq_len, qpb)
    cost = [(n_tiles - t) / n_tiles * seq_len / n_split + BLOCK for t in range(n_tiles)]  # queries seeing tile t
    if old:
        costs = [cost[t] for _ in range(n_split) for _ in range(rows) for t in range(n_tiles)]
    else:
        costs = [cost[t] for t in range(n_tiles) for _ in range(n_split) for _ in range(rows)]
    return makespan(costs, slots) / (sum(costs) / slots)


WINDOW = 512  # w


def tile_union(position: int, queries: float) -> float:
    """Expected union of the blocks chosen by `queries` random queries at one position: the INIT + LOCAL forced
    blocks, and each query's free picks uniform among the other visible blocks."""
    visible = position // BLOCK + 1
    forced = min(visible, INIT + LOCAL)
    free = visible - forced
    picks = min(N_SEL - forced, free)
    if free <= 0 or picks <= 0:
        return float(forced)
    return forced + free * (1.0 - (1.0 - picks / free) ** queries)


QUERY_TILE_KERNELS = {  # kernel: (rows per tile at the 125M layout on sm_90, a tile's cost in 64-key steps at t)
    "top-n": (64, lambda t, q: 1 + t / CMP_STRIDE / (N_SEL * BLOCK)),  # chunks of 16 blocks' compressed keys
    "selected forward": (64, lambda t, q: 1 + tile_union(t, q)),
    "fused dQ": (128, lambda t, q: 1 + tile_union(t, q) + t / CMP_STRIDE / BLOCK + WINDOW / BLOCK),
    "compressed/window forward": (64, lambda t, q: 1 + t / CMP_STRIDE / BLOCK + WINDOW / BLOCK),
}


def query_tiles(seq_len: int, group: int, num_kv: int, kernel: str, slots: int, light_first: bool) -> float:
    """Makespan / balanced time of a query-tile launch (grid: query tile fastest, then batch x KV head): tile i on
    program i (light_first, as timed until 2026-11-27) or each row's last tile first (the default,
    _query_tile_id)."""
    rows_per_tile, cost = QUERY_TILE_KERNELS[kernel]
    # the top-n's rows are queries x G padded to a power of two; the others' pack queries x G
    queries = rows_per_tile // (1 << (group - 1).bit_length() if kernel == "top-n" else group)
    n_tiles = -(-seq_len // queries)
    row = [cost(min(seq_len - 1, i * queries + queries // 2), queries) for i in range(n_tiles)]
    costs = (row if light_first else row[::-1]) * ((TOKENS // seq_len) * num_kv)
    return makespan(costs, slots) / (sum(costs) / slots)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="*", default=[2048, 8192, 32768, 65536])
    ap.add_argument("--slots", type=int, default=264, help="programs running at once (132 SMs x 2 on an H100)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--picks", nargs="*", default=["uniform", "concentrated"], choices=["uniform", "concentrated"],
                    help="the top-n's free picks: uniform (random queries) or concentrated (correlated ones)")
    args = ap.parse_args(argv)
    rows = []
    print(f"# selected dK/dV: makespan / balanced time (pair tiles alone; each program 1 tile more), {args.slots} "
          f"slots, B x T = {TOKENS:,}; schemes: {', '.join(SCHEMES)} (selected_dkdv)")
    print("| layout | T | picks | " + " | ".join(SCHEMES) + " | compressed dK/dV, old order | default |")
    print("|---|---|---|" + "---|" * (len(SCHEMES) + 2))
    for layout, num_kv, qpb in (("12q/2kv", 2, 10), ("16q/1kv", 1, 4)):
        for seq_len in args.lengths:
            for picks in args.picks:
                row = dict(layout=layout, T=seq_len, picks=picks)
                for scheme in SCHEMES:
                    row[f"selected_{scheme}"] = selected_dkdv(seq_len, num_kv, qpb, args.slots,
                                                              np.random.default_rng(args.seed), scheme, picks)
                for old in (True, False):
                    row["compressed_" + ("old" if old else "default")] = compressed_dkdv(seq_len, num_kv, qpb,
                                                                                        args.slots, old)
                rows.append(row)
                print(f"| {layout} | {seq_len:,} | {picks} | "
                      + " | ".join(f"{row[f'selected_{s}']:.2f}x" for s in SCHEMES)
                      + f" | {row['compressed_old']:.2f}x | {row['compressed_default']:.2f}x |")
    print(f"\n# query-tile launches (125M layout: G = 6, 2 KV heads): makespan / balanced, tile i on program i "
          f"(timed until 2026-11-27) / each row's last tile first (default)")
    print("| kernel | " + " | ".join(f"{t:,}" for t in args.lengths) + " |")
    print("|---|" + "---|" * len(args.lengths))
    for kernel in QUERY_TILE_KERNELS:
        cells = []
        for seq_len in args.lengths:
            old, new = (query_tiles(seq_len, 6, 2, kernel, args.slots, light) for light in (True, False))
            rows.append(dict(kernel=kernel, T=seq_len, light_first=old, default=new))
            cells.append(f"{old:.3f} / {new:.3f}")
        print(f"| {kernel} | " + " | ".join(cells) + " |")
    return rows


if __name__ == "__main__":
    main()
