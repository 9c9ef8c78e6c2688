"""Launch-choice sweep on a GPU: NSA fwd+bwd (and a 64k decode step) under several settings of the Triton
launcher's knobs, with the time of every kernel, so a default is chosen from one run of the real op.

    python bench/tune_kernels.py [--json tune.json] [--variants base "sub64:sel_sub_rows=64" ...]

A variant is NAME or NAME:KNOB=VALUE,KNOB=VALUE (fields of the kernels' LaunchOverrides, e.g. sel_sub_rows,
topn_insert_max, topn_rows, topn_warps, topn_blocks_per_chunk, sel_rows; integers, 1/0 for a yes/no knob such as
decode_parts), run under launch_overrides(KNOB=VALUE, ...); knobs not named keep the launcher's
defaults. Each variant's top-n block indices must equal the first variant's on the same inputs (the knobs change
the schedule, never the selection); a mismatch is reported in the table.
Timings: median of 7 CUDA-event timed steps after warm-up; per-kernel CUDA time from torch.profiler.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_attention import PARAMS, cuda_graph, nsa_inputs, peak_mib, time_ms, time_sdpa, tri  # noqa: E402

KNOBS = [field.name for field in dataclasses.fields(tri.LaunchOverrides)]

# Each variant is the other side of a default. The sweeps (H100): 2026-11-22 set the selected tile (no
# sub-tiles), the dQ tile (128 rows), the top-n warps (4) and insertion; 2026-11-23 (the kernels changed in
# between: key-major dK/dV, pipelined loops, unsorted top-n lists, decode parts) kept dK/dV at 4 warps,
# 128-row dQ tiles and inserting every entering block in training, and set the decode step's warps (4), splits
# (256 compressed slots) and its top-n merge (whole chunks).
DEFAULT_VARIANTS = [
    "default",
    "dkdv8warps:dkdv_warps=8",
    # the compressed/window dK/dV splits each key tile's query range over 32 programs (the launcher takes 8 at
    # 64k, 1,024 programs of very unequal length): its 12.5 ms at 64k is several times what its instruction count
    # and dots suggest (bench/KERNELS.md), so whether more, shorter programs help says if it is latency-bound
    "dkdv_split32:dkdv_split=32",
    # the selected branch's dQ in the selected dK/dV kernel (each (query, block) pair once, atomics into an fp32
    # dQ) instead of the fused dQ kernel's walk over each tile's block union (~16x the pairs on random inputs
    # at 64k, G = 6): -17% f+b at 64k random, +8% to +27% at 2k-8k and +12% correlated (2026-11-26), so the union
    # walk stays the default
    "seldq_pairs:sel_dq_in_dkdv=1",
    # the same at 4 warps (the selected dK/dV spills 120-136 bytes there at G = 6 with the dQ tile; 8 warps do not)
    "seldq_pairs_4warps:sel_dq_in_dkdv=1,dkdv_warps=4",
    # The selected kernels ran at 0.09-0.14 of their floors on 2026-11-26 with every loop software-pipelined and
    # spill-free: how many stages they pipeline with (Triton's own 3 for the dK/dV kernels and the selected forward;
    # the fused dQ's 128-row tile 3 since that day's sweep, -10% to -16% of that kernel against 2)
    "dkdv_stages2:dkdv_stages=2",
    "dkdv_stages4:dkdv_stages=4",
    "dq_stages2:dq_stages=2",
    "sel_stages2:sel_stages=2",
    "sel_stages4:sel_stages=4",
    # the selected dK/dV's tile loop with each tile loading its own query indices, as before 2026-11-26 (the default
    # on sm_90 at head_dim 64 with an even G loads them in chunks, so the next tile's loads stay in flight during a
    # tile's dots: TTGIR waits num = 4 where they were num = 0; not yet timed)
    "sel_dkdv_pertile:sel_dkdv_chunk_pairs=0",
    # the block-outer selected forward (each (query, block) pair once, partial softmaxes merged per query) against
    # the union walk: its scheduled floor is about half the union walk's at 8k-64k on random queries and no lower
    # on correlated ones (bench/kernel_floors.py --scheduled-queries; bench/KERNELS.md); not yet timed
    "sel_fwd_pairs:sel_fwd_pairs=1",
    # the selected forward and the training top-n without the 128-register cap they take on sm_90 at head_dim 64
    # (three programs per SM where the cap fits four; the cap timed 5-7% and 13-15% faster on 2026-11-27)
    "sel_fwd_3_per_sm:sel_fwd_max_registers=0",
    "topn_3_per_sm:topn_max_registers=0",
    # ... and the selected dQ by the same walk in a kernel of its own (3 dots per pair tile, partials per chunk summed
    # per query), with the forward's pairs too: the whole block-outer selected branch but the dK/dV
    "sel_dq_pairs:sel_dq_pairs=1",
    "block_outer:sel_fwd_pairs=1,sel_dq_pairs=1",
    # the selected dK/dV's programs in the order timed until 2026-11-27 (key ranges first, key range fastest, heavy
    # pieces last, heavy above 8,192 pairs) against the default's (heavy pieces first, then every row's first key
    # ranges: its heaviest programs start first; bench/KERNELS.md, "2026-11-27 H100")
    "sel_dkdv_old_order:sel_dkdv_ranges_first=1,sel_pieces=8192/1280/1024/64",
    # the compressed/window dK/dV's split programs with the key tile fastest, as timed until 2026-11-27, against the
    # default's every row's first key tiles (the compressed branch's heaviest) first
    "dkdv_tiles_fast:dkdv_key_tiles_fast=1",
    # the query-tile launches (top-n, selected forward, fused dQ, compressed/window forward) with tile i on program i,
    # as timed until 2026-11-27, against the default's each row's last (heaviest) tile first (bench/schedule_model.py:
    # 1-4% of those kernels' time)
    "tiles_light_first:query_tiles_light_first=1",
    # the selected dK/dV's heavy blocks (default: the 256 heaviest above 1,024 pairs, in pieces of one size, at least
    # 32 tiles, within 1,024 partials; chosen with bench/schedule_model.py): above 2,048 pairs, and above 4,096 with
    # 512 slots (the model's best on random queries, its worst on correlated ones)
    "heavy2k:sel_pieces=2048/320/1024/256",
    "heavy4k:sel_pieces=4096/320/1024/512",
    # the selected dQ's union of a 128-row tile (21 queries at G = 6) is about twice a 64-row tile's at 64k on
    # random inputs (bench/selection_tiles.py): twice the math per query once the loop is pipelined
    "dq64rows:dq_rows=64",
    # 32-row selected tiles (5 queries at G = 6) for the forward and the dQ: on random inputs a 64-row tile's
    # rows do the math for ~123 union blocks at 64k where each query chose 16 (bench/selection_tiles.py); half
    # the union per tile, but mma.sync instead of 64-row wgmma on Hopper (spill-free, pipelined: triton_aot)
    "sel32rows:sel_rows=32",
    # whole selected tiles everywhere: on sm_90 only the head_dim 128 dQ changes (16-row sub-tiles, not
    # pipelined, spill-free -> one 64-row tile, pipelined, 56-72 B spilled: tests/triton_aot.py)
    "dq128whole:sel_sub_rows=128",
    # the training top-n inserts up to 2 entering blocks a chunk and merges above (a bitonic top-k, since 2026-11-28;
    # bench/topn_model.py): every entering block inserted (the default until then), every chunk merged, 4 inserted
    "insert_all:topn_insert_max=65536",
    "merge_only:topn_insert_max=0",
    "insert4:topn_insert_max=4",
    # the step's last launches: eager steps take the finish kernel (one program per row and KV group), CUDA-graphed
    # static-cache steps the parts and combine kernels; the kernels' sum below times the eager call, the graphed
    # column the static one. Each forced both ways:
    "decode_parts:decode_parts=1",
    "decode_finish:decode_parts=0",
    # one part per branch (all 16 selected blocks in one program, 4 per step; the whole window in another)
    "decode_three_parts:decode_parts=1,decode_sel_part=16,decode_win_part=512",
    # smaller parts: one selected block and 128 window keys each (16 + 4 + 1 programs per row and KV group)
    "decode_small_parts:decode_parts=1,decode_sel_step=1,decode_win_tile=128",
    "decode_8warps:decode_warps=8",
    # the decode top-n at 8 warps (one tl.topk per 64-block range: 40% fewer SASS instructions on sm_90, 58
    # barriers against 80; tests/triton_aot.py)
    "decode_topn_8warps:decode_topn_warps=8",
    # the parts' last program to finish (an atomic count per row and KV group) combines them: no combine launch
    "decode_fused_combine:decode_fused_combine=1",
    # each launch of the step placed on the SMs while the one before it runs, waiting there (Hopper's programmatic
    # dependent launch: no launch latency between the graphed step's links), alone and with the fused combine
    "decode_pdl:decode_pdl=1",
    "decode_pdl_fused_combine:decode_pdl=1,decode_fused_combine=1",
    # the finish kernel as timed on 2026-11-22 (one selected block, 64 window keys, 8 splits and 4 lists per step;
    # top-n: 8 splits per merge step)
    "decode_short_steps:decode_parts=0,decode_sel_step=1,decode_win_tile=64,decode_warps=4,"
    "decode_merge_splits=8,decode_merge_lists=4",
    # compressed keys per split program (default 256 to head_dim 64: 16 splits at 64k, whose partial outputs the
    # compressed merge takes 16 at a time; 64 was the default before): more, smaller splits
    "decode_split64:decode_split=64",
    "decode_split128:decode_split=128",
    # the step's launch choices before 2026-11-23: 8 warps, 64-slot splits (the top-n then inserted every entering
    # block into a list; since 2026-11-28 it has no list to insert into: one tl.topk per block range)
    "decode_before:decode_warps=8,decode_split=64",
]
# Variants named decode_* change only the decode kernels: they are timed in the decode section alone.
# (H, Hkv, head_dim, T, B, query kind, variants: None = all); the correlated 64k case: how the selected tiles'
# block unions (and so the dQ tile's cost) change when neighbouring queries choose alike, as in a trained model;
# the head_dim 128 case (G = 8) for the d128 launch choices. The two extra cases time only the variants they
# inform (each variant compiles its kernels anew for every shape: the sweep must fit a 10-minute slot).
# Cases run in this order, most informative first, and every row is saved as it comes: a sweep stopped at its
# time limit still leaves the rows it finished (the decode section runs before all of them).
CASES = [(12, 2, 64, 65536, 1, "random", None), (12, 2, 64, 2048, 32, "random", None),
         (16, 1, 64, 8192, 8, "random", None),
         (12, 2, 64, 65536, 1, "correlated", ("default", "dq64rows", "sel32rows", "insert_all", "merge_only",
                                              "seldq_pairs")),
         (16, 2, 128, 8192, 4, "random", ("default", "dkdv8warps", "dq128whole", "seldq_pairs"))]
KERNELS = ["_select_topn_kernel", "_sel_fwd_kernel", "_bwd_dq_kernel", "_sel_bwd_dkdv_kernel",
           "_interval_fwd_kernel", "_interval_bwd_dkdv_kernel", "_sel_dq_reduce_kernel", "_sel_fwd_pairs_kernel",
           "_sel_fwd_pairs_combine_kernel", "_sel_dq_pairs_kernel"]
DECODE = ["_decode_cmp_split_kernel", "_decode_topn_kernel", "_decode_finish_kernel", "_decode_parts_kernel",
          "_decode_combine_kernel"]


def parse_variant(text):
    name, _, knobs = text.partition(":")
    settings = {}
    for item in filter(None, knobs.split(",")):
        key, _, value = item.partition("=")
        if key not in KNOBS:
            raise SystemExit(f"unknown knob {key!r} in variant {text!r}; one of {KNOBS}")
        # a tuple knob (sel_pieces) as a/b/c
        settings[key] = tuple(int(v) for v in value.split("/")) if "/" in value else int(value)
    return name, settings


def parse_case(text):
    """'H,HKV,D,T,B,KIND' -> a CASES entry that runs every variant."""
    try:
        H, Hkv, D, T, B, kind = text.split(",")
        return int(H), int(Hkv), int(D), int(T), int(B), kind, None
    except ValueError:
        raise SystemExit(f"--cases {text!r}: expected H,HKV,D,T,B,KIND, e.g. 12,2,64,65536,1,random") from None


SHORT = {"_select_topn_kernel": "top-n", "_sel_fwd_kernel": "sel fwd", "_bwd_dq_kernel": "dQ",
         "_sel_bwd_dkdv_kernel": "sel dK/dV", "_interval_fwd_kernel": "intv fwd",
         "_interval_bwd_dkdv_kernel": "intv dK/dV", "_sel_dq_reduce_kernel": "dQ sum",
         "_sel_fwd_pairs_kernel": "sel fwd pairs", "_sel_fwd_pairs_combine_kernel": "sel fwd combine",
         "_sel_dq_pairs_kernel": "sel dQ pairs"}


def against_default(rows: list[dict], threshold: float = 0.02) -> list[str]:
    """Markdown rows: each variant against the first variant timed on the same case (the default), as f+b and
    each kernel's time in percent (+: the variant is slower), kernels moving by under `threshold` left out.
    What decides a launch default: a variant that beats the default in f+b where its kernels moved."""
    lines = ["| case | variant | f+b vs default | kernels vs default |", "|---|---|---|---|"]
    base = {}
    for r in rows:
        if r["case"] not in base:
            base[r["case"]] = r
            continue
        ref = base[r["case"]]
        moved = [f"{SHORT[k]} {100 * (r[k] / ref[k] - 1):+.1f}%" for k in KERNELS
                 if ref[k] > 0 and abs(r[k] / ref[k] - 1) >= threshold]
        lines.append(f"| {r['case']} | {r['variant']} | {100 * (r['fb_ms'] / ref['fb_ms'] - 1):+.1f}% | "
                     f"{', '.join(moved) or 'none moved'} |")
    return lines


DECODE_CONTEXT = 65536  # keys before the decode section's query


def decode_call(T, device="cuda"):
    """The decode section's step: one query after a T-key cache (125M layout), run eagerly (the window: the last w
    keys, views of the inputs), or with query_end as a static cache's step (a w-slot ring). bench/warm_kernel_cache.py
    records its launches on a CPU (device "cpu")."""
    x, cmp_end, doc_pos = nsa_inputs(1, T, 12, 2, 64, grad=False, device=device)
    w = PARAMS.window_size

    def decode(query_end=None):
        tri.nsa_decode_triton(x["q"][:, -1:], x["k_cmp"], x["v_cmp"], cmp_end, x["k_slc"], x["v_slc"],
                              x["k_win"][:, -w:], x["v_win"][:, -w:], x["gates"][:, -1:], doc_pos, PARAMS,
                              query_end=query_end)

    return decode


def fwd_bwd_call(x, cmp_end, doc_pos):
    """A case's timed step: the op's forward and backward on nsa_inputs' tensors, a fixed output gradient."""
    q = x["q"]
    do = torch.randn(q.shape, device=q.device, dtype=torch.bfloat16)

    def step():
        o = tri.nsa_attention_triton(x["q"], x["k_cmp"], x["v_cmp"], cmp_end, x["k_slc"], x["v_slc"],
                                     x["k_win"], x["v_win"], x["gates"], doc_pos, PARAMS)
        torch.autograd.grad(o, list(x.values()), do)

    return step


def kernel_ms(fn):
    """CUDA time per kernel name (ms) of one call, after two warm-up calls (compilation outside)."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    out = {}
    for ev in prof.key_averages():
        total = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0.0)
        out[ev.key] = out.get(ev.key, 0.0) + total / 1000.0
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", nargs="*", default=DEFAULT_VARIANTS)
    ap.add_argument("--json", default=None)
    ap.add_argument("--decode-only", action="store_true", help="the decode section alone")
    ap.add_argument("--no-decode", action="store_true", help="skip the decode section")
    ap.add_argument("--cases", nargs="*", default=None, metavar="H,HKV,D,T,B,KIND",
                    help="f+b cases instead of the built-in list (every variant on each), e.g. 12,2,64,65536,1,random")
    ap.add_argument("--dense", action="store_true",
                    help="also time dense causal SDPA f+b on each case's shapes (the ratio issue 18's table uses)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("tune_kernels.py needs a CUDA GPU (tests/triton_aot.py reports the launches' registers, "
                         "spills and shared memory on CPU).")
    variants = [parse_variant(v) for v in args.variants]
    rows, decode_rows = [], []

    def save():
        if args.json:
            Path(args.json).write_text(json.dumps(dict(fwd_bwd=rows, decode=decode_rows), indent=1))

    # decode: one token over a 64k cache, per-kernel time (the top-n knobs reach the decode top-n kernel)
    decode = decode_call(DECODE_CONTEXT)
    query_end = torch.tensor([DECODE_CONTEXT - 1], device="cuda")

    for name, settings in [] if args.no_decode else variants:
        with tri.launch_overrides(**settings):
            per_kernel = kernel_ms(decode)
            row = dict(variant=name, **{k: per_kernel.get(k, 0.0) * 1000 for k in DECODE})
            # the step replayed from a CUDA graph (as generate() with a static cache runs it): the kernels' times
            # and the gaps between them, without Python (a failed capture is reported, as bench_attention does, and
            # the sweep goes on)
            try:
                row["graphed"] = time_ms(cuda_graph(lambda: decode(query_end)), 5, 50) * 1000
            except Exception as exc:
                row["graphed"], row["graph_error"] = float("nan"), f"{type(exc).__name__}: {exc}"[:200]
        decode_rows.append(dict(row, total=sum(row[k] for k in DECODE)))
        save()
        print(json.dumps(decode_rows[-1]), flush=True)
    cases = CASES if args.cases is None else [parse_case(c) for c in args.cases]
    for H, Hkv, D, T, B, kind, only in [] if args.decode_only else cases:
        torch.manual_seed(0)
        dense = time_sdpa(B, T, H, Hkv, D) if args.dense else {}
        x, cmp_end, doc_pos = nsa_inputs(B, T, H, Hkv, D, kind=kind)
        step = fwd_bwd_call(x, cmp_end, doc_pos)

        ref_idx = None
        for name, settings in variants:
            if only and name not in only and name != variants[0][0]:  # the first variant is the reference
                continue
            if name.startswith("decode_"):
                continue
            with tri.launch_overrides(**settings):
                idx = tri.select_blocks_triton(x["q"].detach(), x["k_cmp"].detach(), cmp_end, doc_pos, PARAMS)
                per_kernel = kernel_ms(step)
                fb_ms = time_ms(step)
                peak = peak_mib(step)
            same = True if ref_idx is None else bool(torch.equal(idx, ref_idx))
            ref_idx = idx if ref_idx is None else ref_idx
            row = dict(case=f"{H}q/{Hkv}kv d{D} T={T} B={B} {kind}", variant=name, fb_ms=fb_ms, same_topn=same,
                       peak_mib=peak, **{k: per_kernel.get(k, 0.0) for k in KERNELS},
                       **{k: dense[k] for k in ("sdpa_fb", "sdpa_mem") if k in dense})
            rows.append(row)
            save()
            print(json.dumps(row), flush=True)

    print(f"\n# NSA launch sweep: {torch.cuda.get_device_name()}, torch {torch.__version__}, bf16 (ms)")
    print("| case | variant | f+b ms | / dense | peak MiB (dense) | " + " | ".join(SHORT[k] for k in KERNELS)
          + " | top-n equal |")
    print("|---" * (6 + len(KERNELS)) + "|")
    for r in rows:
        cells = " | ".join(f"{r[k]:.2f}" for k in KERNELS)
        ratio = f"{r['fb_ms'] / r['sdpa_fb']:.2f}x" if "sdpa_fb" in r else ""
        mem = f"{r['peak_mib']:.0f}" + (f" ({r['sdpa_mem']:.0f})" if "sdpa_mem" in r else "")
        print(f"| {r['case']} | {r['variant']} | {r['fb_ms']:.2f} | {ratio} | {mem} | {cells} | "
              f"{'yes' if r['same_topn'] else 'NO'} |")
    print("\n" + "\n".join(against_default(rows)))
    print("\n| decode 64k (us) | " + " | ".join(k.strip("_").replace("_kernel", "") for k in DECODE)
          + " | kernels' sum | CUDA-graphed step |")
    print("|---" * (3 + len(DECODE)) + "|")
    for r in decode_rows:
        print(f"| {r['variant']} | " + " | ".join(f"{r[k]:.1f}" for k in DECODE)
              + f" | {r['total']:.1f} | {r['graphed']:.1f} |")


if __name__ == "__main__":
    main()
