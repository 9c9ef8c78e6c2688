"""bench/tune_kernels.py without a GPU: every default variant names real launch knobs (a typo would stop the
next GPU session's sweep), and the table of each variant against the default, which decides launch defaults."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import tune_kernels as tk  # noqa: E402
from test_gpu_session import SCRIPT, script_defaults  # noqa: E402


def _session_script() -> str:
    """bench/gpu_session.sh with its shared lists ($PENDING_VARIANTS, $PENDING_CASES, $DECODE_VARIANTS: the steps
    and the warm step read the same ones) written out where the steps use them, as the shell expands them."""
    text = SCRIPT.read_text()
    lists = {name: value for name, value in script_defaults().items() if name.endswith(("_VARIANTS", "_CASES"))}
    assert set(lists) >= {"PENDING_VARIANTS", "PENDING_CASES", "DECODE_VARIANTS"}, lists
    for name, value in lists.items():
        text = text.replace(f"${name}", " ".join(value.split()))
    return text


def test_every_variant_names_launch_knobs():
    for text in tk.DEFAULT_VARIANTS:
        name, settings = tk.parse_variant(text)
        assert name and set(settings) <= set(tk.KNOBS), text
    with pytest.raises(SystemExit, match="unknown knob 'topn_rowz'"):
        tk.parse_variant("typo:topn_rowz=1")


def test_every_session_step_names_launch_knobs():
    """Every bench/gpu_session.sh step that runs tune_kernels.py passes variants naming real knobs (a variant of a
    knob since removed would cost a device call: the step fails when it parses the list)."""
    script = _session_script().replace("\\\n", " ")
    lists = [line.split("--variants", 1)[1].split(" --", 1)[0].split(";;", 1)[0].split("&&", 1)[0].split()
             for line in script.splitlines() if "tune_kernels.py" in line and "--variants" in line]
    assert len(lists) >= 5, lists  # decode, seldq, pending, pending-d128, stages
    for variants in lists:
        assert variants[0] == "default", variants
        for text in variants:
            name, settings = tk.parse_variant(text)
            assert set(settings) <= set(tk.KNOBS), text


def test_the_session_seldq_step_parses():
    """bench/gpu_session.sh's `seldq` step: its variants name real knobs and reach the three selected-dQ modes, and
    its cases parse (a typo would cost a device call)."""
    from modeling_nsa.nsa_triton_launch import _sel_dq_mode, launch_overrides

    script = _session_script()
    step = script.split("    seldq)", 1)[1].split(";;", 1)[0].replace("\\\n", " ")
    variants = step.split("--variants", 1)[1].split("--cases", 1)[0].split()
    modes = []
    for text in variants:
        _, settings = tk.parse_variant(text)
        with launch_overrides(**settings):
            modes.append(_sel_dq_mode())
    assert modes == ["union", "atomic", "pairs"], modes
    cases = [tk.parse_case(c) for c in step.split("--cases", 1)[1].split()]
    assert {c[3] for c in cases} == {2048, 8192, 32768, 65536} and all(c[6] is None for c in cases), cases
    assert all(c[3] * c[4] == 65536 for c in cases)  # B*T fixed, as bench_attention's table
    with pytest.raises(SystemExit, match="expected H,HKV,D,T,B,KIND"):
        tk.parse_case("12,2,64,65536")


def test_the_session_stages_step_parses_and_reaches_the_launchers():
    """bench/gpu_session.sh's `stages` step: each variant names real knobs, the tuple knob (sel_pieces, a/b/c)
    parses to the launcher's tuple, and every variant but the default changes a launch choice."""
    from modeling_nsa import nsa_triton_launch as launch

    script = _session_script()
    step = script.split("    stages)", 1)[1].split(";;", 1)[0].replace("\\\n", " ")
    variants = [tk.parse_variant(v) for v in step.split("--variants", 1)[1].split("--cases", 1)[0].split()]
    assert variants[0] == ("default", {}) and len(variants) == 8, variants
    assert dict(variants)["heavy2k"] == {"sel_pieces": (2048, 320, 1024, 256)}

    def launches():
        return (launch._dkdv_launch(6, 64, "cpu"), launch._dq_launch(6, 64, 16, "cpu"), launch._sel_fwd_opts(64, "cpu"),
                launch._OVERRIDES.sel_pieces)

    default = launches()
    for name, settings in variants[1:]:
        with launch.launch_overrides(**settings):
            assert launches() != default, name
    cases = [tk.parse_case(c) for c in step.split("--cases", 1)[1].split()]
    assert {c[3] for c in cases} == {2048, 8192, 65536} and all(c[3] * c[4] == 65536 for c in cases), cases


def test_the_session_pending_step_times_the_heavy_pieces_int32_pairs_and_split_dq_against_their_other_sides():
    """bench/gpu_session.sh's `pending` step and the launch orders it times against: the default launches the
    selected dK/dV's heavy pass first (one program per partial piece) with batch x kv head on the main pass's fast
    axis (launch_overrides(sel_dkdv_ranges_first=True) restores the order timed until 2026-11-27), the
    compressed/window dK/dV's split programs with the key tile on the last axis (dkdv_key_tiles_fast: the old
    grid), the four query-tile kernels with each row's last tile first (query_tiles_light_first: tile i on program
    i), the top-n in tiles of 8 queries at 4 warps; the selected forward and the top-n with maxnreg = 128 (sm_90,
    head_dim 64) and no other launch capped. The step's variants: other heavy thresholds and slots (reaching the
    heavy pass's grid), int64 pair positions (reaching the kernel's pointers), the selected dQ split from the fused
    one, the selected dQ added pair by pair by the selected dK/dV kernel (alone, and with the block-outer forward:
    the whole selected branch pair by pair), and the top-n inserting every entering
    block (reaching its INSERT_MAX); its cases are issue 18's B*T = 64k shapes."""
    pytest.importorskip("triton")
    import triton_aot

    script = _session_script()
    step = script.split("    pending)", 1)[1].split(";;", 1)[0].replace("\\\n", " ")
    variants = [tk.parse_variant(v) for v in step.split("--variants", 1)[1].split("--cases", 1)[0].split()]
    assert [name for name, _ in variants] == ["default", "heavy2k", "heavy4k", "pairs_int64", "seldq_split",
                                              "seldq_pairs", "pairs_all", "topn_insert_all"], variants
    batch, num_kv, seq_len = 2, 2, 300

    def calls_of(settings):
        calls = []

        class Stand:
            def __init__(self, name, fn):
                self.name = name

            def __getitem__(self, grid):
                return lambda *args, **kwargs: calls.append((self.name, grid, dict(kwargs, _args=args)))

        run = triton_aot._scenario(batch, seq_len, 12, num_kv, 64, torch.bfloat16, overrides=settings)
        triton_aot.with_kernels_replaced(run, Stand)
        return calls

    default_calls, heavy2k, heavy4k, pairs_int64, seldq_split, seldq_pairs, pairs_all, insert_all = (
        calls_of(settings) for _, settings in variants)
    old_calls = calls_of(dict(sel_dkdv_ranges_first=True))
    tiles_fast_calls = calls_of(dict(dkdv_key_tiles_fast=True))
    light_calls = calls_of(dict(query_tiles_light_first=True))
    new, old = ([(grid, kw["HEAVY_PASS"], kw["RANGES_FAST"]) for name, grid, kw in calls
                 if name == "_sel_bwd_dkdv_kernel"] for calls in (default_calls, old_calls))
    key_ranges = -(-seq_len // 64)
    assert [heavy for _, heavy, _ in new] == [True, False] and not any(fast for _, _, fast in new), new
    assert new[0][0] == (1024, 1, 1) and new[1][0][:2] == (batch * num_kv, key_ranges), new  # rows on the fast axis
    assert [heavy for _, heavy, _ in old] == [False, True] and all(fast for _, _, fast in old), old
    assert old[0][0][:2] == (key_ranges, batch * num_kv), old

    def dkdv_args(calls):  # the heavy pass's pair offsets and pieces (the kernel's 4th and 7th arguments)
        kw = next(kw for name, _, kw in calls if name == "_sel_bwd_dkdv_kernel" and kw["HEAVY_PASS"])
        return kw["_args"][3], kw["_args"][6], kw["_args"][-3]  # PAIR_OFF, PIECES, heavy_min

    for calls, heavy_min in ((default_calls, 1024), (heavy2k, 2048), (heavy4k, 4096)):
        pair_off, pieces, seen_min = dkdv_args(calls)
        assert seen_min == heavy_min and pair_off.dtype == pieces.dtype == torch.int32, (seen_min, pair_off.dtype)
    pair_off, pieces, _ = dkdv_args(pairs_int64)
    assert pair_off.dtype == pieces.dtype == torch.int64
    # the split selected dQ: its own launch in the selected forward's 64-row tiles, then the fused dQ without the
    # selected branch adding to it; the default launches the fused dQ alone, its selected walk inside
    split_dq = [(name, kw.get("BLOCK_M"), kw.get("SEL_DQ"), kw.get("ADD_DQ")) for name, _, kw in seldq_split
                if name in ("_sel_dq_kernel", "_bwd_dq_kernel")]
    assert split_dq == [("_sel_dq_kernel", 64, None, None), ("_bwd_dq_kernel", split_dq[1][1], False, True)], split_dq
    assert [(name, kw["SEL_DQ"], kw["ADD_DQ"]) for name, _, kw in default_calls
            if name in ("_sel_dq_kernel", "_bwd_dq_kernel")] == [("_bwd_dq_kernel", True, False)]
    # the pair-wise selected dQ: the selected dK/dV adds it atomically (DQ_PAIRS on), the fused dQ leaves it out
    assert {kw["DQ_PAIRS"] for name, _, kw in seldq_pairs if name == "_sel_bwd_dkdv_kernel"} == {1}
    assert {kw["DQ_PAIRS"] for name, _, kw in default_calls if name == "_sel_bwd_dkdv_kernel"} == {0}
    assert [kw["SEL_DQ"] for name, _, kw in seldq_pairs if name == "_bwd_dq_kernel"] == [False]
    # the whole selected branch pair by pair: the block-outer forward (its pair walk and combine) in place of the
    # union walk, and the dQ in the selected dK/dV as above
    names = [name for name, _, _ in pairs_all]
    assert "_sel_fwd_pairs_kernel" in names and "_sel_fwd_pairs_combine_kernel" in names
    assert "_sel_fwd_kernel" not in names and "_sel_fwd_kernel" in [name for name, _, _ in default_calls]
    assert {kw["DQ_PAIRS"] for name, _, kw in pairs_all if name == "_sel_bwd_dkdv_kernel"} == {1}
    assert [kw["SEL_DQ"] for name, _, kw in pairs_all if name == "_bwd_dq_kernel"] == [False]
    intervals, old_intervals = ([(grid, kw["TILES_FAST"], kw["N_SPLIT"]) for name, grid, kw in calls
                                 if name == "_interval_bwd_dkdv_kernel"] for calls in (default_calls, tiles_fast_calls))
    # the compressed branch's query ranges are split at 300 queries: key tile on the last axis by default
    assert any(split > 1 and not fast and grid[0] == batch * num_kv for grid, fast, split in intervals), intervals
    assert all(fast and grid[1] == batch * num_kv for grid, fast, _ in old_intervals), old_intervals
    # the top-n's tile: 8 queries of 8 padded head rows at 4 warps, inserting up to 2 entering blocks a chunk and
    # merging above; the variant inserting every one
    topn = {(kw["QPB"], kw["num_warps"], kw["INSERT_MAX"]) for name, _, kw in default_calls
            if name == "_select_topn_kernel"}
    assert topn == {(8, 4, 2)}, topn
    assert {kw["INSERT_MAX"] for name, _, kw in insert_all if name == "_select_topn_kernel"} == {65536}
    # the query-tile kernels: each row's last tile first by default, tile i on program i in tiles_light_first
    query_tile_kernels = {"_select_topn_kernel", "_sel_fwd_kernel", "_bwd_dq_kernel", "_interval_fwd_kernel"}
    for calls, light in ((default_calls, False), (light_calls, True)):
        orders = {name: kw["LIGHT_FIRST"] for name, _, kw in calls if name in query_tile_kernels}
        assert orders == dict.fromkeys(query_tile_kernels, light), orders
    # the register caps: maxnreg = 128 reaches the selected forward and the top-n by default (the scenario compiles
    # for sm_90) and no other launch
    caps = {name: kw.get("maxnreg") for name, _, kw in default_calls}
    assert caps == {name: 128 if name in ("_sel_fwd_kernel", "_select_topn_kernel") else None for name in caps}, caps
    cases = [tk.parse_case(c) for c in step.split("--cases", 1)[1].split()]
    assert {c[3] for c in cases} == {2048, 8192, 32768, 65536} and all(c[3] * c[4] == 65536 for c in cases), cases


def row(case, variant, fb_ms, **kernel_ms):
    """A sweep row: every kernel 1 ms unless given (by kernel name)."""
    return dict(case=case, variant=variant, fb_ms=fb_ms, **{k: kernel_ms.get(k, 1.0) for k in tk.KERNELS})


def test_variants_against_the_default():
    rows = [row("64k", "default", 50.0, _select_topn_kernel=9.0, _bwd_dq_kernel=16.0),
            row("64k", "topn_3_per_sm", 52.0, _select_topn_kernel=10.8, _bwd_dq_kernel=16.1),  # dQ: under 2%
            row("2k", "default", 10.0),
            row("2k", "topn_3_per_sm", 10.0)]
    lines = tk.against_default(rows)
    assert lines[:2] == ["| case | variant | f+b vs default | kernels vs default |", "|---|---|---|---|"]
    assert lines[2] == "| 64k | topn_3_per_sm | +4.0% | top-n +20.0% |"
    assert lines[3] == "| 2k | topn_3_per_sm | +0.0% | none moved |"
    assert len(lines) == 4  # the defaults themselves are the reference, not rows


def test_a_sweep_variant_forcing_a_switch_off_reaches_the_launcher_off():
    """The sweeps write switches as 0/1 (parse_variant reads ints): 0 must turn a default-on switch off, or the
    variant silently times the default against itself (a sweep's dkdv_masked did, for a session, after the default
    flipped). The decode step's parts are on by default for a static cache's step."""
    from modeling_nsa.nsa_layout import NSAParams
    from modeling_nsa.nsa_triton_launch import _decode_launch, launch_overrides

    params = NSAParams(cmp_block_size=32, cmp_stride=16, sel_block_size=64, sel_num_blocks=16, sel_init_blocks=1,
                       sel_local_blocks=2, window_size=512)

    def parts():
        return _decode_launch(64, 16, params, True, torch.device("cpu")).parts

    assert parts()  # the default
    for text, expected in (("decode_finish:decode_parts=0", False), ("decode_parts:decode_parts=1", True)):
        _, settings = tk.parse_variant(text)
        with launch_overrides(**settings):
            assert parts() is expected, text


def test_the_session_d128_step_times_the_three_stages_against_two():
    """bench/gpu_session.sh's `pending-d128` step: its variant gives the fused dQ, the selected forward and both
    dK/dV kernels two stages, which is what head_dim 128 ran with before three on sm_90 (and the 64-row dQ tile)."""
    from modeling_nsa import nsa_triton_launch as launch

    script = _session_script()
    step = script.split("    pending-d128)", 1)[1].split(";;", 1)[0].replace("\\\n", " ")
    variants = [tk.parse_variant(v) for v in step.split("--variants", 1)[1].split("--cases", 1)[0].split()]
    assert [name for name, _ in variants] == ["default", "stages2", "dq_stages2"], variants
    cases = [tk.parse_case(c) for c in step.split("--cases", 1)[1].split()]
    assert {c[2] for c in cases} == {64, 128} and all(c[3] * c[4] == 65536 for c in cases), cases

    def stages():
        return (launch._dq_launch(8, 128, 16, "cpu")[2]["num_stages"], launch._dq_launch(6, 64, 8, "cpu")[2]["num_stages"],
                launch._sel_fwd_opts(128, "cpu")["num_stages"], launch._dkdv_launch(8, 128, "cpu")[2]["num_stages"])

    assert stages() == (3, 3, 3, 3)  # the default (the CPU counts as sm_90)
    launch_default_dkdv = launch._dkdv_launch(6, 64, "cpu")
    with launch.launch_overrides(**variants[1][1]):
        assert stages() == (2, 2, 2, 2)
    with launch.launch_overrides(**variants[2][1]):  # the 64-row dQ alone: head_dim 64's other kernels as default
        assert stages()[:2] == (2, 2) and launch._dkdv_launch(6, 64, "cpu") == launch_default_dkdv
