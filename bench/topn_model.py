"""What the training top-n's time is made of: chunk passes, insertion steps and programs (bench/KERNELS.md,
"2026-11-27, second session (CPU): the top-n's insertion steps").

`_select_topn_kernel` walks a tile's selection blocks in chunks of BJ = 16 (one compressed-key dot, the exps, the
block scores: a fixed cost per chunk) and inserts the chunk's entering blocks into the queries' lists one step at a
time, as many steps as the tile's query with the most entering blocks needs (`n_enter`, each step a few
dependent reductions). Random queries make every block's priority an independent draw, so a list of 16 takes
about 16 (1 + ln(blocks / 16)) entries in all, and the first chunk (an empty list) takes 16 steps. This script
counts, per launch of bench_attention's shapes (B x T = 65,536), the chunks, the insertion steps (with the
kernel's rule, and with the first chunk placed whole as the kernel does since 2026-11-27), and the programs;
then fits time = a x chunks + b x steps + c x programs to the measured top-n times of 2026-11-27 and gives what
the fit predicts for the new step counts (the per-step and per-chunk costs held: the shorter reduction chain
and the lower register count of the int64-key lists are not in it).

    python bench/topn_model.py [--samples 400]
"""

from __future__ import annotations

import argparse

import numpy as np

from schedule_model import BLOCK, INIT, LOCAL, N_SEL, TOKENS  # the NSA_SPEC defaults and bench_attention's B x T

BJ = 16  # selection blocks per top-n chunk at those defaults (nsa_triton_launch._topn_chunk)
LENGTHS = (2048, 8192, 32768, 65536)
# layout: (kv heads, queries per top-n program (64 rows / padded G), measured top-n ms at LENGTHS: bench/KERNELS.md,
# "2026-11-27 H100", kernels of c94a9b8, random queries)
LAYOUTS = {"12q/2kv": (2, 8, (0.60, 1.27, 2.75, 4.25)), "16q/1kv": (1, 4, (0.43, 0.86, 1.90, 2.94))}


def tile_work(positions: np.ndarray, rng, first_placed: bool, insert_max: int | None = None) -> tuple[int, int, int]:
    """(chunks, insertion steps, merges) of one top-n program over queries at `positions` (consecutive, one
    document): priorities uniform at random, forced blocks +inf; each chunk inserts max over queries of the blocks
    beating the query's worst kept entry at the chunk's start (the kernel's n_enter), none for the first chunk if
    placed; a chunk whose n_enter is above insert_max (None: no limit) is one merge instead (a bitonic top-k)."""
    n_blocks = positions // BLOCK + 1
    own = positions // BLOCK
    n_chunks = -(-int(n_blocks.max()) // BJ)
    j = np.arange(n_chunks * BJ)
    eligible = j[None, :] < n_blocks[:, None]
    forced = eligible & ((j[None, :] < INIT) | ((j[None, :] > (own - LOCAL)[:, None]) & (j[None, :] <= own[:, None])))
    prio = np.where(eligible, rng.random((len(positions), j.size)), -np.inf)
    prio = np.where(forced, np.inf, prio)
    top = np.full((len(positions), N_SEL), -np.inf)
    steps = merges = 0
    for c in range(n_chunks):
        chunk = prio[:, c * BJ:(c + 1) * BJ]
        if not (first_placed and c == 0):
            worst = top.min(1)
            n_enter = int(((chunk > worst[:, None]) & (chunk > -np.inf)).sum(1).max())
            if insert_max is not None and n_enter > insert_max:
                merges += 1
            else:
                steps += n_enter
        top = -np.sort(-np.concatenate([top, chunk], 1), 1)[:, :N_SEL]
    return n_chunks, steps, merges


def tile_steps(positions: np.ndarray, rng, first_placed: bool) -> tuple[int, int]:
    """(chunks, insertion steps) of one top-n program inserting every entering block (tile_work)."""
    return tile_work(positions, rng, first_placed)[:2]


def launch_counts(seq_len: int, num_kv: int, qpb: int, samples: int, rng, first_placed: bool,
                  insert_max: int | None = None):
    """(chunks, insertion steps, programs, merges) of one launch at B = TOKENS / seq_len, from `samples` sampled
    tiles."""
    batch = TOKENS // seq_len
    n_tiles = seq_len // qpb
    tiles = rng.choice(n_tiles, size=min(samples, n_tiles), replace=False)
    chunks = steps = merges = 0
    for t in tiles:
        c, s, m = tile_work(t * qpb + np.arange(qpb), rng, first_placed, insert_max)
        chunks += c
        steps += s
        merges += m
    scale = n_tiles / len(tiles) * batch * num_kv
    return chunks * scale, steps * scale, n_tiles * batch * num_kv, merges * scale


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=400, help="tiles sampled per launch")
    ap.add_argument("--insert-max", type=int, nargs="*", default=[1, 2, 3, 4],
                    help="entering blocks up to which a chunk inserts them, above which it merges (the merge table)")
    ap.add_argument("--merge-steps", type=float, nargs="*", default=[2.0, 3.0],
                    help="a merge's cost in insertion steps (sm_90 SASS: ~200 instructions, 88 of them shuffles, "
                         "against 67 a step)")
    args = ap.parse_args()
    for name, (num_kv, qpb, measured) in LAYOUTS.items():
        before = np.array([launch_counts(T, num_kv, qpb, args.samples, np.random.default_rng(0), False)[:3]
                           for T in LENGTHS])
        after = np.array([launch_counts(T, num_kv, qpb, args.samples, np.random.default_rng(0), True)[:3]
                          for T in LENGTHS])
        coef, *_ = np.linalg.lstsq(before, np.array(measured), rcond=None)
        print(f"{name}: fit ns per chunk / insertion step / program (whole GPU): "
              + " / ".join(f"{c * 1e6:.2f}" for c in coef))
        print("| T | chunks | insertion steps | steps, first chunk placed | measured ms | fit ms | "
              "steps' share | predicted ms |")
        print("|---|---|---|---|---|---|---|---|")
        for T, b, a, m in zip(LENGTHS, before, after, measured):
            fit = b @ coef
            print(f"| {T:,} | {b[0]:,.0f} | {b[1]:,.0f} | {a[1]:,.0f} ({a[1] / b[1]:.2f}) | {m:.2f} | {fit:.2f} | "
                  f"{b[1] * coef[1] / fit:.2f} | {a @ coef:.2f} |")
        # insert up to k entering blocks, merge above (first chunk placed): steps and merges against inserting all
        print(f"\n{name}: inserting at most k entering blocks a chunk, merging above; the steps' time against "
              "inserting every one, per merge cost (in steps)")
        print("| T | steps, insert all | " + " | ".join(f"k = {k}: steps, merges" for k in args.insert_max) + " | "
              + " | ".join(f"steps' time k = {k} (merge = {c:g} steps)" for k in args.insert_max
                           for c in args.merge_steps) + " |")
        print("|---|---|" + "---|" * (len(args.insert_max) * (1 + len(args.merge_steps))))
        for i, T in enumerate(LENGTHS):
            cells, ratios = [], []
            for k in args.insert_max:
                _, steps, _, merges = launch_counts(T, num_kv, qpb, args.samples, np.random.default_rng(0), True, k)
                cells.append(f"{steps:,.0f}, {merges:,.0f}")
                ratios += [f"{(steps + c * merges) / after[i][1]:.2f}" for c in args.merge_steps]
            print(f"| {T:,} | {after[i][1]:,.0f} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")


if __name__ == "__main__":
    main()
