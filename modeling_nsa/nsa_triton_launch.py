"""Launch choices of the NSA kernels: query tiles, warps and pipeline stages per kernel and architecture (chosen
with tests/triton_aot.py's registers and spills and bench/tune_kernels.py's timings: bench/KERNELS.md), and the
overrides the tests and the launch sweep force them with (`launch_overrides`).
"""

from __future__ import annotations

import contextlib
import dataclasses

from .nsa_layout import NSAParams
from .nsa_triton_common import (_LARGE_SHARED_MEMORY, _has_programmatic_dependent_launch, _hopper_class, _is_sm90,
                                _next_pow2, _shared_memory_limit)


@dataclasses.dataclass
class LaunchOverrides:
    """Launch choices forced by the tests (to reach every path of the kernels at tiny sizes) and by
    bench/tune_kernels.py (to time the other side of a default). None: the launcher's own choice. They change
    how the work is scheduled (tiles, splits, warps), never the result. Set them with `launch_overrides`."""

    dkdv_split: int | None = None  # splits of the query range of the compressed/window dK/dV kernel
    # the compressed/window dK/dV's grid with the key tile fastest where its query ranges are split, as timed until
    # 2026-11-27 (the default starts every row's first key tiles, the heaviest, first: _interval_bwd_dkdv)
    dkdv_key_tiles_fast: bool | None = None
    topn_blocks_per_chunk: int | None = None  # selection blocks per top-n chunk (small: the multi-chunk merge)
    topn_insert_max: int | None = None  # the top-n insertion/merge threshold (0: always merge)
    topn_rows: int | None = None  # rows (queries x padded heads) per top-n program
    topn_warps: int | None = None  # warps of the top-n program
    # the training top-n's register cap (Triton's maxnreg; 0: none). Default 128 on sm_90 at head_dim 64 and below:
    # a fourth 4-warp program per SM where its 148 registers fit three (1-4 spill instructions in its list loops, none
    # in its dot loops); timed 2026-11-27 on an H100, 13-15% off the kernel at 2k-64k on both layouts
    # (bench/KERNELS.md, "2026-11-27, second H100 session")
    topn_max_registers: int | None = None
    dkdv_warps: int | None = None  # warps of the compressed/window and selected dK/dV kernels
    # software-pipeline stages of those two kernels (sm_90 at head_dim 64: Triton's own, 3; at 128: 3 for the
    # compressed/window one, 2 for the selected one), of the fused dQ (sm_90 to head_dim 128: 3, else 2) and of the
    # selected forward (sm_90 to head_dim 128: 3); first swept on 2026-11-26, when the selected kernels ran at
    # 0.09-0.14 of their floors (bench/KERNELS.md)
    dkdv_stages: int | None = None
    dq_stages: int | None = None
    sel_stages: int | None = None
    # the selected forward's register cap (Triton's maxnreg; 0: none). Default 128 on sm_90 at head_dim 64 and
    # below: a fourth 4-warp program per SM where its 134 registers fit three, spill-free (a 16-byte frame outside
    # the loop); its loop is latency-bound, so the fourth program hides latency: timed 2026-11-27 on an H100, 5-7%
    # off the kernel on the 125M layout at 2k-64k, even on fla's (bench/KERNELS.md, "2026-11-27, second H100
    # session")
    sel_fwd_max_registers: int | None = None
    # the selected branch's dQ in the selected dK/dV kernel, which meets each (query, block) pair once, added to
    # an fp32 dQ with atomics (True: not bitwise deterministic), or in the fused dQ kernel over each query tile's
    # union of blocks (False, and None: the default, _sel_dq_mode)
    sel_dq_in_dkdv: bool | None = None
    # the selected forward over (query, block) pairs, block-outer (True; _sel_fwd_pairs), instead of each query
    # tile's union of blocks (False, and None: the default); not yet timed (bench/KERNELS.md)
    sel_fwd_pairs: bool | None = None
    sel_fwd_pair_queries: int | None = None  # queries per chunk of that schedule (default: _sel_fwd_pair_queries)
    # the selected branch's dQ by the same block-outer walk in a kernel of its own (True: _sel_dq_pairs, each pair's
    # share stored at its (query, slot) in chunks as the forward's, summed per query in slot order: deterministic,
    # its partials within q's size); wins over sel_dq_in_dkdv; not yet timed (bench/KERNELS.md)
    sel_dq_pairs: bool | None = None
    # the tile unions' sort keys as int64 at any length (they are int32 below 2**(31 - log2 queries per tile) keys,
    # 2**27 at the 125M layout's forward): how the tests reach the int64 path (_tile_block_union)
    sel_union_wide_keys: bool | None = None
    # the query-tile launches (top-n, selected forward, fused dQ, compressed/window forward) with tile i on program
    # i, as timed until 2026-11-27 (the default puts a row's last, heaviest tiles first: _query_tile_id)
    query_tiles_light_first: bool | None = None
    dq_rows: int | None = None  # rows of the fused dQ query tile (sm_90)
    dq_warps: int | None = None  # warps of the fused dQ kernel (sm_90)
    sel_rows: int | None = None  # the selected-attention query tile (rows = queries x G)
    sel_sub_rows: int | None = None  # rows per sub-tile of that tile (= the tile's rows: no sub-tiles)
    # the selected dK/dV's heavy blocks: (heavy_min pairs, smallest piece in pairs, partial pieces, slots); the
    # `slots` heaviest blocks above heavy_min pairs are cut into pieces of one size for the launch, at least the
    # smallest, as small as lets them all fit the partial pieces (nsa_triton_selected._sel_heavy_pieces)
    sel_pieces: tuple[int, int, int, int] | None = None
    # the selected dK/dV's pair positions as int64 below 2**31 pairs too, as until 2026-11-27 (the default's int32
    # ones cut its masked pair tile 742 -> 634 SASS instructions on sm_90 at the 125M layout)
    sel_pairs_int64: bool | None = None
    # the selected branch's dQ in a launch of its own with the selected forward's query tiles (184 registers at 4
    # warps: two programs per SM on sm_90), before the fused dQ adds the interval branches' share (one rounding more of the selected share to q's
    # dtype; no extra memory); the default keeps the one fused dQ launch. Not yet timed
    sel_dq_split: bool | None = None
    # element offsets within a batch row as int64, as until 2026-11-27: K/V in the union walk and the interval tiles
    # (nsa_triton_common._kv_offsets), q/dO rows in the dK/dV kernels (_head_rows); the default's int32 ones, where
    # a row holds under 2**31 elements, take 4-14% off those loops' SASS on sm_90
    offsets_int64: bool | None = None
    # the selected dK/dV's programs in the order timed until 2026-11-27 (the main pass with the key range fastest,
    # then the heavy blocks' splits): the default runs the heavy splits first, then the main pass with every row's
    # first key ranges first (_sel_bwd_dkdv_kernel)
    sel_dkdv_ranges_first: bool | None = None
    # (query, block) pairs per chunk of the selected dK/dV's tile loop (a chunk's query indices loaded once;
    # _sel_dkdv_chunk_tiles); 0: no chunks, each tile loads its own indices (everywhere until 2026-11-26)
    sel_dkdv_chunk_pairs: int | None = None
    # queries per chunk of the dK/dV query ranges' scans (a power of two; _interval_query_ranges by default: at least 1,024, at
    # most 64 chunks per row); small ones give the tests many chunks per row at tiny lengths
    range_chunk: int | None = None
    decode_split: int | None = None  # compressed slots per decode split program
    decode_topn_blocks: int | None = None  # selection blocks per decode top-n program
    decode_topn_warps: int | None = None  # warps of the decode top-n kernel
    # compressed-token offsets per block per step of the decode top-n's scores (a power of two <= l'/d)
    decode_topn_offsets: int | None = None
    decode_sel_step: int | None = None  # selected blocks per step of a decode selected part
    decode_win_tile: int | None = None  # window keys per step of a decode window part
    decode_parts: int | None = None  # 1/0: the decode step's parts + combine kernels / the finish kernel
    decode_fused_combine: int | None = None  # 1: the decode parts' last program to finish combines them
    # 1: the decode step's launches as programmatic dependent launches on Hopper and datacenter Blackwell (each
    # placed on the SMs while the one before it runs, waiting there for its end; _after_previous_launch)
    decode_pdl: int | None = None
    decode_sel_part: int | None = None  # selected blocks per decode part program
    decode_win_part: int | None = None  # window keys per decode part program
    decode_warps: int | None = None  # warps of the decode finish and parts kernels
    decode_merge_splits: int | None = None  # compressed-key splits per step of the decode merges
    decode_merge_lists: int | None = None  # block ranges' top-n lists per step of the decode parts' list merge


_OVERRIDES = LaunchOverrides()  # what the launchers read; changed only through launch_overrides


@contextlib.contextmanager
def launch_overrides(**choices):
    """Force launch choices inside a `with` block: `with launch_overrides(topn_blocks_per_chunk=2): ...`. The
    choices not named keep their current value (the default, or an enclosing block's); all are restored on
    exit. A name that is not a LaunchOverrides field raises, naming the valid ones."""
    valid = [field.name for field in dataclasses.fields(LaunchOverrides)]
    unknown = sorted(set(choices) - set(valid))
    if unknown:
        raise TypeError(f"launch_overrides: unknown launch choice(s) {unknown}; valid: {valid}")
    saved = {name: getattr(_OVERRIDES, name) for name in choices}
    try:
        for name, value in choices.items():
            setattr(_OVERRIDES, name, value)
        yield _OVERRIDES
    finally:
        for name, value in saved.items():
            setattr(_OVERRIDES, name, value)


def _kv_offsets_fit_int32(num_keys: int, num_kv: int, head_dim: int) -> bool:
    """The kernels' KV32 (nsa_triton_common._kv_offsets): every element offset within one row of a (B, T, HKV, D)
    K/V (num_keys x num_kv x head_dim) fits int32 (16.7M keys at 2 kv heads x 64, 2M at 8 x 128), unless
    launch_overrides(offsets_int64=True) forces int64."""
    return num_keys * num_kv * head_dim < 2**31 and not _OVERRIDES.offsets_int64


def _rows_fit_int32(num_q: int, num_heads: int, head_dim: int) -> bool:
    """The dK/dV kernels' ROW32 (nsa_triton_common._head_rows): every element offset within one batch row of a
    (B, T, H, D) q or dO fits int32 (2.8M queries at 12 heads x 64), unless launch_overrides(offsets_int64=True)
    forces int64."""
    return num_q * num_heads * head_dim < 2**31 and not _OVERRIDES.offsets_int64


def _query_tile(group: int, rows: int) -> tuple[int, int]:
    """(BLOCK_M, queries per program) for (query x head) row packing: about `rows` rows, at least 16 (the
    smallest tl.dot) and at least one query's G heads."""
    block_m = max(16, _next_pow2(group), rows)
    return block_m, max(1, block_m // group)


def _query_tiles_light_first() -> bool:
    """The query-tile launches' program order: False (the default) puts each row's last tiles, which see the most
    keys, on the first programs (_query_tile_id)."""
    return bool(_OVERRIDES.query_tiles_light_first)


def _rows_per_program(group: int, head_dim: int) -> tuple[int, int]:
    """(BLOCK_M, queries per program) for the interval kernels."""
    return _query_tile(group, 64 if head_dim <= 128 else 32)


def _dkdv_launch(group: int, head_dim: int, device, pair_dq: bool = False,
                 selected: bool = False) -> tuple[int, int, dict]:
    """(BLOCK_M, queries per program, launch options) for the dK/dV kernels (selected: the selected dK/dV, else
    the compressed/window one), which hold fp32 dK and dV tiles across their query loop. Chosen with
    tests/triton_aot.py (registers and spills per variant) for the key-major update (_dkdv_update): on sm_90 at
    head_dim 64, 64-row query tiles at 4 warps, spill-free for both kernels and faster than 8 warps for both
    (variant dkdv8warps; bench/KERNELS.md). Elsewhere 32-row tiles at 8 warps, with pipeline stages on sm_90:
    three for the compressed/window kernel (with two its loops waited for every copy before each tile's dots,
    TTGIR async_wait num = 0, as the fused dQ's did before three stages made it 10-16% faster; spill-free,
    81 KiB of shared memory, one block per SM by registers either way), two for the selected kernel (its
    per-tile index load waits at num = 0 with any count; no spill inside the tile loops at head_dim 128: the
    main pass keeps an 88-104 byte frame reloaded per block; head_dim 256 spills about 300-700 bytes with or
    without them); none on sm_80, which keeps the stack frame there at 0-48 bytes at head_dim 64, outside the
    tile loops (64 rows, or pipelining, spill more). pair_dq (the selected kernel forming its dQ pair by pair:
    sel_dq_in_dkdv): on sm_90 at head_dim 64 the fp32 dQ tile beside dK and dV spills 120-136
    bytes at 4 warps at G = 6 (none at G = 16), at 8 warps nothing inside the tile loops (a 16-byte frame outside
    them), so 8 there (the variant seldq_pairs_4warps times the other side); at head_dim 128 the 32-row tile
    spills 8-40 bytes (sm_90 with its two stages, sm_80/86) and a 16-row one none inside its loops, pipelined on
    sm_90."""
    if head_dim <= 64 and _hopper_class(device):
        block_m, qpb = _rows_per_program(group, head_dim)
        opts = dict(num_warps=_OVERRIDES.dkdv_warps or (8 if pair_dq else 4))
        if _OVERRIDES.dkdv_stages:
            opts["num_stages"] = _OVERRIDES.dkdv_stages
        return block_m, qpb, opts
    hopper_stages = 3 if head_dim <= 128 and not selected else 2
    stages = _OVERRIDES.dkdv_stages or (hopper_stages if _hopper_class(device) else 1)
    rows = 16 if pair_dq and head_dim > 64 else 32
    return *_query_tile(group, rows), dict(num_warps=_OVERRIDES.dkdv_warps or 8, num_stages=stages)


def _dq_launch(group: int, head_dim: int, n_sel: int, device, sel_dq: bool = True) -> tuple[int, int, dict]:
    """(BLOCK_M, queries per program, launch options) for the fused dQ kernel. On sm_90 at head_dim 64 with
    16 or more selected blocks: 128-row tiles, 8 warps (faster than 64 and 32 rows at 2k, 8k and 64k, random
    and correlated queries: variants dq64rows, sel32rows, bench/KERNELS.md; the selected forward is slower with
    128 rows, so it keeps 64); with fewer blocks (T < 1024 at n = 16) the 128-row tile spills, and at
    head_dim 128 it does not fit: the selected attention's tile there. Before Hopper 64 rows spill whatever
    the warps, so the tile is 32 rows there (tests/triton_aot.py). Pipeline stages on sm_90 (the selected loop
    is free of branches, _sel_dq_sub WHOLE, so its block loads are software-pipelined): three to head_dim 128
    (the 128-row tile's dQ kernel 10-16% faster than with two at 2k, 8k and 64k and on fla's layout, 2026-11-26
    sweep; with two its loops waited for every copy before each tile's dots; the same 64-byte frame outside the
    loops, tests/triton_aot.py; variant dq_stages2 times the other side; the 64-row and head_dim 128 tiles showed
    the same wait with two and none with three, spill-free, one block per SM by registers either way: not yet
    timed), two at head_dim 256 and before Hopper.
    sel_dq=False (sel_dq_in_dkdv: the interval branches only): at head_dim 128 the 64-row tile spills 16 bytes on
    sm_90, 32 rows none (pipelined): 32 rows there."""
    if _hopper_class(device):
        wide = head_dim <= 64 and _next_pow2(n_sel) >= 16 and not _OVERRIDES.sel_rows
        rows = _OVERRIDES.dq_rows or (128 if wide else (None if sel_dq or head_dim <= 64 else 32))
        block_m, qpb = _query_tile(group, rows) if rows else _sel_rows_per_program(group, head_dim)
        stages = _OVERRIDES.dq_stages or (3 if head_dim <= 128 else 2)
        return block_m, qpb, dict(num_warps=_OVERRIDES.dq_warps or 8, num_stages=stages)
    return *_query_tile(group, 32), dict(num_warps=4 if head_dim <= 64 else 8, num_stages=_OVERRIDES.dq_stages or 2)


def _sel_dkdv_chunk_tiles(group: int, qpb: int, head_dim: int, device) -> int:
    """Pair tiles per chunk in the selected dK/dV's tile loop (_sel_pair_tiles), 0 for no chunks. With chunks a
    chunk's query indices are loaded once and each tile takes its rows from them in registers, so the loop's loads
    of q, dO, lse and delta depend on no load inside it and Triton's three stages keep the next tile's in flight
    during a tile's dots (TTGIR: the loop waits at num = 4; with a per-tile index load it waited at num = 0, every
    copy at the top of each tile). As many tiles as fit 256 pairs (25 at G = 6, 64 at G = 16): a 256-entry list, 2
    registers a thread. Used where that pipelining happens and the loop stays spill-free (tests/triton_aot.py):
    sm_90 at head_dim 64 with an even G (2-16); odd G spilled 16-80 instructions inside the tile loop there, and
    the other launches (2 stages at head_dim 128, 1 before Hopper) keep the per-tile load, which they wait on
    anyway. Chosen from the TTGIR and SASS; not yet timed (bench/KERNELS.md, "Next GPU session").
    launch_overrides(sel_dkdv_chunk_pairs=N): chunks of N pairs everywhere; 0: the per-tile load everywhere."""
    pairs = _OVERRIDES.sel_dkdv_chunk_pairs
    if pairs is None:
        pairs = 256 if head_dim <= 64 and _hopper_class(device) and group % 2 == 0 else 0
    return max(1, pairs // qpb) if pairs > 0 else 0


def _sel_fwd_opts(head_dim: int, device) -> dict:
    """Warps and stages of the selected forward: 4 warps and Triton's own stages (3) to head_dim 64; above, 8 warps
    and three pipeline stages on sm_90 to head_dim 128 (with two its block loop waited for every copy before each
    block's dots, TTGIR async_wait num = 0; with three it does not, spill-free, 113 KiB of shared memory, one block
    per SM by registers either way: not yet timed), two elsewhere (spill-free at 128; tests/triton_aot.py)."""
    wide_stages = 3 if head_dim <= 128 and _hopper_class(device) else 2
    opts = dict(num_warps=4) if head_dim <= 64 else dict(num_warps=8, num_stages=wide_stages)
    if _OVERRIDES.sel_stages:
        opts["num_stages"] = _OVERRIDES.sel_stages
    cap = _register_cap(_OVERRIDES.sel_fwd_max_registers, head_dim, device)
    if cap:
        opts["maxnreg"] = cap
    return opts


def _register_cap(override: int | None, head_dim: int, device) -> int:
    """Triton's maxnreg for the selected forward and the training top-n: the override where one is forced (0: none),
    else 128 on sm_90 at head_dim 64 and below (four 4-warp programs per SM where their 134 / 148 registers fit
    three; timed there only, so other architectures keep the compiler's own allocation)."""
    if override is not None:
        return override
    return 128 if head_dim <= 64 and _is_sm90(device) else 0


def _sel_fwd_pair_queries(num_q: int, n_sel: int, head_dim: int, element_size: int, q_sizes: float = 2.0) -> int:
    """Queries per chunk of the block-outer selected schedules: as many as keep the chunk's partials (per query, head
    and slot an output row in q's dtype and an fp32 log-sum-exp) within q_sizes times q's own size, so the extra
    memory stays that multiple of the input whatever n' is: q_sizes Tq D s / (n' (D s + 4)) queries, about Tq / 8
    at n' = 16 for the forward's 2 (its partials live below the backward's peak) and Tq / 16 for the dQ's 1 (they
    add to it: bench/memory_cpu.py). launch_overrides(sel_fwd_pair_queries=N) forces N for both."""
    if _OVERRIDES.sel_fwd_pair_queries:
        return max(1, min(num_q, _OVERRIDES.sel_fwd_pair_queries))
    per_query = n_sel * (head_dim * element_size + 4)  # partial bytes per (query, head)
    return max(1, min(num_q, int(q_sizes * num_q * head_dim * element_size) // per_query))


def _sel_fwd_pairs_launch(group: int, head_dim: int, device, dq: bool = False) -> tuple[int, int, int, dict]:
    """(BLOCK_M, queries per pair tile, pairs per program, launch options) of the block-outer selected forward and
    (dq) dQ: 64-row pair tiles (QPB queries x G heads, as the selected dK/dV's), a power of two of at least 8 tiles'
    pairs per program (its run is held in registers: _pair_run), 4 warps to head_dim 64 (8 above). Before Hopper the
    dQ's tile loop spills at 4 warps and 3 stages (16-144 B, tests/triton_aot.py): there it takes 8 warps and 2
    stages to head_dim 64, 32-row tiles unpipelined above. The pairs per program are not tuned (bench/KERNELS.md)."""
    slim = dq and not _hopper_class(device)
    block_m, qpb = _query_tile(group, 64 if head_dim <= (64 if slim else 128) else 32)
    if slim:
        opts = dict(num_warps=8, num_stages=2 if head_dim <= 64 else 1)
    elif head_dim > 64 and _shared_memory_limit(device) < _LARGE_SHARED_MEMORY:
        opts = dict(num_warps=8, num_stages=2)  # three stages of a head_dim 128 tile take 112 KiB, over 99 KiB (sm_86)
    else:
        opts = dict(num_warps=4 if head_dim <= 64 else 8)
    return block_m, qpb, _next_pow2(8 * qpb), opts


def _sel_dq_mode() -> str:
    """Where the backward forms the selected branch's dQ: "union" (the fused dQ kernel walks each query tile's
    union of chosen blocks, doing the math of every block of the union for every row), "pairs" (a kernel of its
    own walks the (query, block) pairs block-outer as the sel_fwd_pairs forward does) or "atomic" (the selected
    dK/dV kernel, which meets each (query, block) pair once, adds each pair's share to an fp32 dQ with atomics).
    (A third, each pair's share stored by the dK/dV kernel for all queries at once, was timed no faster than the
    atomics at 3.7x dense's peak memory at 64k, and retired: bench/KERNELS.md, 2026-12-03.) The union walk is the
    default: the pair-wise dQ costs the selected dK/dV kernel a fifth dot and 8 warps (its dQ tile spills at 4),
    which only pays where a tile's queries share few blocks (random queries at 32k and more); it loses at 2k-8k
    and on correlated queries, which trained models' neighbouring queries resemble (bench/KERNELS.md, 2026-11-26)."""
    if _OVERRIDES.sel_dq_pairs:
        return "pairs"
    if _OVERRIDES.sel_dq_in_dkdv:
        return "atomic"
    return "union"


def _sel_dq_reduce_rows(group: int) -> tuple[int, int]:
    """(rows, queries per program) of the pair dQ's reduce kernel: 64 rows of (query x head), memory-bound."""
    return _query_tile(group, 64)


def _sel_sub_tile(block_m: int, head_dim: int, device, dq: bool = False) -> int:
    """Rows per sub-tile of a selected-attention query tile (a sub-tile skips the union blocks none of its
    queries chose). Hopper's wgmma works on 64-row tiles, so there a 16-row tl.dot costs about a 64-row
    one and sub-tiles only add work: the whole 64-row tile was the fastest at head_dim 64 at every length and
    both layouts (bench/KERNELS.md); a whole tile also lets the block loop be
    software-pipelined (no per-block branch). At head_dim 128 the fused dQ (dq=True) keeps 16-row sub-tiles:
    its whole tile spills (tests/triton_aot.py); the forward's does not. Before Hopper mma works on 16 rows,
    so there the tile runs as 16-row sub-tiles (at most 4), which skip the blocks none of their queries
    chose (bench/selection_tiles.py counts the math saved; not timed on such a GPU)."""
    if _OVERRIDES.sel_sub_rows:
        return min(block_m, max(_OVERRIDES.sel_sub_rows, block_m // 4))
    if _hopper_class(device) and (head_dim <= 64 or not dq):
        return block_m
    return min(block_m, max(16, block_m // 4))


def _sel_rows_per_program(group: int, head_dim: int) -> tuple[int, int]:
    """(BLOCK_M, queries per program) for the selected-attention query tiles: as wide as registers allow.
    A tile loads each block of its queries' union once; its sub-tiles (_sel_sub_tile) do the math only for
    the blocks their own queries chose, so the math does not grow with the tile but the loads shared per
    query do (bench/selection_tiles.py)."""
    if _OVERRIDES.sel_rows:
        return _query_tile(group, _OVERRIDES.sel_rows)
    return _query_tile(group, 64 if head_dim <= 128 else 32)


def _topn_opts(head_dim: int, device) -> dict:
    """Launch options of the training top-n program: 4 warps on sm_90 (faster than 8 at 2k and 64k, bench/KERNELS.md,
    when it still spilled 8-16 bytes with 16 selected blocks; the unsorted lists made it spill-free,
    tests/triton_aot.py); 8 before Hopper (not timed there); 128 registers on sm_90 to head_dim 64
    (_register_cap) with the default head-lane rows."""
    opts = dict(num_warps=_OVERRIDES.topn_warps or (4 if _hopper_class(device) else 8))
    cap = _register_cap(_OVERRIDES.topn_max_registers, head_dim, device)
    if cap:
        opts["maxnreg"] = cap
    return opts


def _topn_head_lanes(g_pad: int) -> int:
    """Lanes holding a query's heads in the training top-n tile (nsa_triton_topn._topn_row_query_head): half the
    padded heads, the other half in the thread's second row, so the sum over heads is an add in the thread and
    log2(G_PAD / 2) shuffle rounds. 0 (query-major rows: log2(G_PAD) rounds on twice the values) for one head,
    for 16 or more (at 16 the two orders are the same rows, and the query-major sum compiles to fewer
    instructions). At G = 2-8 the chunk loop's SASS instructions per warp on sm_90 and sm_80 fell by 10-25% against
    query-major rows, registers by up to 70; query-major rows took the kernel 10-23% longer on the H100 (the
    2026-11-25 sweep, bench/KERNELS.md).
    Query-major rows at G = 2-8 also need twice the values per thread: a 264-byte stack frame under the 128-register
    cap (_topn_opts), which was sized for head-lane rows."""
    if not 2 <= g_pad <= 8:
        return 0
    return g_pad // 2


TOPN_INSERT_MAX = 2  # entering blocks a training top-n chunk inserts one at a time; above, it merges the chunk


def _topn_insert_max() -> int:
    """Entries of a chunk entering a query's list up to which the training top-n inserts them one at a time
    (_topn_insert: two independent reductions of int64 keys, 67 SASS instructions a step on sm_90, ~230 cycles
    latency-bound) rather than merging the chunk whole (_topn_merge: one bitonic top-k of the list beside the chunk,
    ~200 instructions, most of them ~15 dependent shuffle stages: about 2-3 steps' time). TOPN_INSERT_MAX = 2:
    bench/topn_model.py counts, on random queries, steps and merges per launch and puts the insertion work at
    0.33 / 0.32 / 0.55 / 0.66 of inserting every block at 2k / 8k / 32k / 64k with a merge worth 3 steps (untimed;
    bench/KERNELS.md). Tests and bench/tune_kernels.py force it (launch_overrides(topn_insert_max=...): 0 merges
    every chunk with an entering block but a list's first chunk where it is placed whole, 65536 inserts them
    all). The decode top-n has no chunk loop (nsa_triton_decode._decode_topn_kernel: one tl.topk per block
    range)."""
    if _OVERRIDES.topn_insert_max is not None:
        return _OVERRIDES.topn_insert_max
    return TOPN_INSERT_MAX


def _topn_chunk(params: NSAParams) -> int:
    """BJ selection blocks per top-n chunk: about 64 compressed tokens, at least 16 (the smallest tl.dot)."""
    ratio = params.sel_block_size // params.cmp_stride
    bj = max(1, 64 // ratio) if ratio <= 64 else 1
    bj = max(bj, 16 // min(ratio, 16))
    return _OVERRIDES.topn_blocks_per_chunk or bj


@dataclasses.dataclass(slots=True)
class DecodeLaunch:
    """The decoding step's launch choices (nsa_triton_decode._decode_step)."""

    split: int  # compressed slots per split program (CS)
    topn_blocks: int  # selection blocks per top-n program (TB)
    topn_offsets: int  # a block's compressed-token offsets per step of the top-n's scores (RC)
    topn_warps: int  # warps of the top-n kernel
    topn_merge_splits: int  # splits per vector load in the top-n kernel's merge (m, l only)
    sel_step: int  # selected blocks per step of the selected branch (SEL_STEP)
    win_tile: int  # window keys per step of the window branch (BLOCK_N)
    sel_part: int  # selected blocks per part program
    win_part: int  # window keys per part program
    part_splits: int  # compressed splits (with their outputs) per step of the last launch's merge
    lists: int  # block ranges' top-n lists per step of the list merge
    num_warps: int  # of the finish and parts kernels
    parts: bool  # the last launches: parts + combine kernels (else the finish kernel)
    fused_combine: bool  # with parts: the last part of a row and KV group to finish combines (no combine kernel)
    pdl: bool  # programmatic dependent launches (sm_90-103): no launch latency between the step's kernels


def _decode_launch(head_dim: int, n_sel: int, params: NSAParams, static: bool, device) -> DecodeLaunch:
    """The decoding step's launch choices for this head_dim, n' selected blocks and NSA parameters on device;
    static: a static cache's (CUDA-graphed) step."""
    o = _OVERRIDES
    sel_block_size = params.sel_block_size
    # The top-n: 64 selection blocks per program (16 programs per row and KV group at 64k: a range's list is one of
    # the lists the selected parts merge), all scored at once and cut to n by one tl.topk; a step of its scores
    # takes at most 256 tokens (4,096 probabilities at 16 padded heads: TB_PAD x RC, RC offsets of R = l'/d per
    # block; one step at the defaults, R = 4). 4 warps (8: 40% fewer SASS instructions and 28% fewer barriers on
    # sm_90, tests/triton_aot.py; untimed: variant decode_topn_8warps)
    topn_blocks = o.decode_topn_blocks or 64
    tb_pad = max(_next_pow2(topn_blocks), _next_pow2(n_sel))
    ratio = sel_block_size // params.cmp_stride
    # compressed slots per split program (a power of two >= 16): 256 at head_dim <= 64 (fewer splits for the
    # finish kernel to merge: faster than 128 and 64 at 64k, variants decode_split128/64, bench/KERNELS.md), 128
    # above (256 spills 96-104 B at head_dim 128: tests/triton_aot.py)
    split = o.decode_split or (256 if head_dim <= 64 else 128)
    # Steps of SEL_STEP selected blocks and BLOCK_N window keys, 256 keys (128 at head_dim 128, 64 at 256: each
    # step's K and V stay within shared memory), 4 warps to head_dim 64 (faster than 8 for the finish kernel and
    # the graphed static step, variant decode_8warps, bench/KERNELS.md; the finish kernel spills 8-104 B there
    # with triton 3.9, tests/test_triton_compile.py), 8 above (4 spill 200-264 B at head_dim 128).
    # With 99 KiB of shared memory per block (RTX 30xx/40xx, A10, L4) half as many keys per step: 256 keys at
    # head_dim 64 take 136 KiB there. In parts, a part is one step by default: at n = 16, l' = 64, w = 512 and
    # head_dim 64, 4 selected parts, 2 window parts and the compressed merge, 7 programs per (row, KV group)
    # where the finish kernel walks 12 steps (a graphed step is faster in parts: variants decode_parts/finish,
    # bench/KERNELS.md).
    budget = 16384 if _shared_memory_limit(device) >= _LARGE_SHARED_MEMORY else 8192  # keys x head_dim
    keys_per_step = min(256, budget // head_dim)
    sel_step = o.decode_sel_step or max(1, min(keys_per_step // sel_block_size, _next_pow2(n_sel)))
    win_tile = o.decode_win_tile or keys_per_step
    return DecodeLaunch(
        split=split,
        topn_blocks=topn_blocks,
        topn_offsets=min(ratio, o.decode_topn_offsets or max(1, 256 // tb_pad)),  # <= R: more would read the next block
        topn_warps=o.decode_topn_warps or 4,
        topn_merge_splits=o.decode_merge_splits or 32,
        sel_step=sel_step,
        win_tile=win_tile,
        sel_part=max(sel_step, o.decode_sel_part or sel_step),
        win_part=max(win_tile, o.decode_win_part or win_tile),
        # the compressed merge: 16 splits (with their outputs) per step; the list merge: 128 entries per step
        part_splits=o.decode_merge_splits or 16,
        lists=o.decode_merge_lists or max(1, 128 // _next_pow2(n_sel)),
        num_warps=o.decode_warps or (4 if head_dim <= 64 else 8),
        parts=bool(static if o.decode_parts is None else o.decode_parts),
        # off until timed: one launch fewer on a graphed step's chain against an atomic count per part (variant
        # decode_fused_combine, bench/KERNELS.md)
        fused_combine=bool(o.decode_fused_combine),
        # off until timed: each launch of the step's chain placed on the SMs while the one before it runs (Hopper's
        # programmatic dependent launch), where a CUDA-graphed step at B = 1 otherwise pays a launch's latency at
        # every link of its chain of short kernels (variant decode_pdl, bench/KERNELS.md)
        pdl=bool(o.decode_pdl) and _has_programmatic_dependent_launch(device),
    )
