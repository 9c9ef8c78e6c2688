"""bench/kernel_floors.py: the per-kernel work counts against a brute-force enumeration by the naive oracle's
rules (tests/naive_nsa.py picks the selected blocks on random inputs), the byte counts against the tensors the
op really takes, the profiler-to-row mapping, and the CPU command line. No GPU."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "bench"))

import kernel_floors as kf  # noqa: E402
import naive_nsa  # noqa: E402
from triton_helpers import TINY, make_inputs  # noqa: E402

from modeling_nsa import NSAConfig  # noqa: E402
from modeling_nsa.nsa_layout import NSAParams  # noqa: E402
from modeling_nsa.nsa_reference import nsa_attention_reference  # noqa: E402

NO_LOCAL = dict(TINY, sel_local_blocks=0)  # the own block is not forced: the selected count is a lower bound
ODD = dict(cmp_block_size=12, cmp_stride=4, sel_block_size=8, sel_num_blocks=3, sel_init_blocks=1,
           sel_local_blocks=1, window_size=5)  # l > l', w < l'


def brute_pairs(params: dict, T: int, H: int = 2, Hkv: int = 1, seed: int = 0):
    """Per-row (query, key) pairs of each branch for one T-token document, enumerated query by query: the
    compressed tokens whose last key is at or before t (cmp_end from the layout code), the keys s <= t of the
    blocks the naive oracle selects on random inputs (per KV group), the window and causal keys. Returns
    per-head totals and, for the selected branch, the per-(KV group, query) key counts."""
    x, cmp_end, doc_pos, p = make_inputs(1, T, H, Hkv, 8, params, torch.float32, "cpu", seed=seed)
    _, blocks = naive_nsa.naive_nsa_attention(x["q"], x["k_cmp"], x["v_cmp"], cmp_end, x["k_slc"], x["v_slc"],
                                              x["k_win"], x["v_win"], x["gates"], doc_pos, p,
                                              return_block_indices=True)
    ends = [e for e in cmp_end[0].tolist() if e >= 0]
    lb, w = params["sel_block_size"], params["window_size"]
    counts = dict(cmp=0, sel=0, win=0, dense=0, sel_blocks=0)
    sel_per_group = []
    for t in range(T):
        counts["cmp"] += sum(1 for e in ends if e <= t)
        counts["win"] += sum(1 for s in range(T) if t - w < s <= t)
        counts["dense"] += sum(1 for s in range(T) if s <= t)
        per_group = [sum(1 for j in blocks[0][g][t] for s in range(j * lb, (j + 1) * lb) if s <= t)
                     for g in range(Hkv)]
        sel_per_group.append(per_group)
        counts["sel"] += per_group[0]
        counts["sel_blocks"] += len(blocks[0][0][t])
    return counts, sel_per_group


@pytest.mark.parametrize("params", [TINY, ODD], ids=["tiny", "odd"])
@pytest.mark.parametrize("T", [1, 7, 37, 100])
def test_pair_counts_match_enumeration(params, T):
    counts, per_group = brute_pairs(params, T, H=4, Hkv=2)
    p = NSAParams(**params)
    assert kf.compressed_pairs(T, p) == counts["cmp"]
    assert kf.selected_pairs(T, p) == counts["sel"]
    assert kf.selected_block_pairs(T, p) == counts["sel_blocks"]
    assert kf.window_pairs(T, p) == counts["win"]
    assert kf.dense_pairs(T) == counts["dense"]
    # every KV group's queries attend to as many selected keys as the closed form says for each query
    assert all(g == [kf.selected_keys(t, p)] * 2 for t, g in enumerate(per_group))


def test_selected_count_is_a_lower_bound_without_local_blocks():
    T = 100
    counts, per_group = brute_pairs(NO_LOCAL, T, seed=3)
    p = NSAParams(**NO_LOCAL)
    assert all(g[0] >= kf.selected_keys(t, p) for t, g in enumerate(per_group))
    assert kf.selected_pairs(T, p) <= counts["sel"]


def test_kernel_work_flops_follow_the_pairs():
    """Matmul FLOPs per pair: 4*D forward, 2*D top-n, 6*D dQ (three branches), 8*D dK/dV; 4*D / 10*D dense."""
    B, T, H, Hkv, D = 3, 100, 4, 2, 8
    counts, _ = brute_pairs(TINY, T, H=H, Hkv=Hkv)
    work = {w.name: w for w in kf.kernel_work(TINY, B, T, H, Hkv, D)}
    assert list(work) == ["cmp_fwd", "topn", "sel_fwd", "win_fwd", "dq", "cmp_dkdv", "sel_dkdv", "win_dkdv"]
    per_pair = dict(cmp_fwd=("cmp", 4), topn=("cmp", 2), sel_fwd=("sel", 4), win_fwd=("win", 4),
                    cmp_dkdv=("cmp", 8), sel_dkdv=("sel", 8), win_dkdv=("win", 8))
    for name, (branch, factor) in per_pair.items():
        assert work[name].pairs == work[name].exps == B * H * counts[branch], name
        assert work[name].flops == factor * D * B * H * counts[branch], name
    assert work["dq"].flops == 6 * D * B * H * (counts["cmp"] + counts["sel"] + counts["win"])
    fwd, bwd = kf.dense_work(B, T, H, Hkv, D)
    assert (fwd.flops, bwd.flops) == (4 * D * B * H * counts["dense"], 10 * D * B * H * counts["dense"])


def test_kernel_work_bytes_match_the_tensors():
    """Bytes read and written against the nbytes of the tensors the op takes and returns at bf16 (the compressed
    K/V counted over the row's real tokens, not its empty slots)."""
    B, T, H, Hkv, D = 2, 100, 4, 2, 8
    x, cmp_end, doc_pos, p = make_inputs(B, T, H, Hkv, D, TINY, torch.bfloat16, "cpu")
    n_cmp = int((cmp_end[0] >= 0).sum())
    out, idx = nsa_attention_reference(x["q"], x["k_cmp"], x["v_cmp"], cmp_end, x["k_slc"], x["v_slc"],
                                       x["k_win"], x["v_win"], x["gates"], doc_pos, p, return_block_indices=True)
    idx32 = idx.to(torch.int32)  # (B, Hkv, T, n') as the kernels store it
    q, kv = x["q"].nbytes, x["k_slc"].nbytes
    kv_cmp = x["k_cmp"][:, :n_cmp].nbytes
    lse = torch.empty(B, T, H, dtype=torch.float32).nbytes
    ranges = 2 * torch.empty(B, T, dtype=torch.int32).nbytes
    work = {w.name: w for w in kf.kernel_work(p, B, T, H, Hkv, D)}
    assert (work["cmp_fwd"].bytes_read, work["cmp_fwd"].bytes_written) == (q + 2 * kv_cmp + ranges, out.nbytes + lse)
    assert work["topn"].bytes_written == idx32.nbytes
    assert work["sel_fwd"].bytes_read == q + 2 * kv + idx32.nbytes + doc_pos.nbytes
    assert work["win_fwd"].bytes_read == 3 * q + 2 * kv + ranges + x["gates"].nbytes
    assert work["win_fwd"].bytes_written == 2 * out.nbytes + lse
    assert work["dq"].bytes_written == q + x["gates"].nbytes + 3 * lse
    assert work["sel_dkdv"].bytes_written == x["k_slc"].nbytes + x["v_slc"].nbytes
    assert work["cmp_dkdv"].bytes_written == 2 * kv_cmp


def test_parameters_from_config_params_or_dict_agree():
    config = NSAConfig()
    by_config = kf.kernel_work(config, 1, 4096, 12, 2, 64)
    assert by_config == kf.kernel_work(NSAParams.from_config(config), 1, 4096, 12, 2, 64)
    assert by_config == kf.kernel_work({f: getattr(config, f) for f in TINY}, 1, 4096, 12, 2, 64)
    with pytest.raises(ValueError, match="window_size"):
        kf.kernel_work({k: v for k, v in TINY.items() if k != "window_size"}, 1, 64, 2, 1, 8)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        kf.kernel_work(TINY, 1, 64, 3, 2, 8)


def test_floors_and_bound():
    w = kf.KernelWork("k", "fwd", pairs=10, flops=2e12, exps=1e9, bytes_read=2e9, bytes_written=1e9)
    f = w.floors(1000.0, 3000.0)
    assert f["flop_ms"] == pytest.approx(2.0) and f["byte_ms"] == pytest.approx(1.0)
    assert (f["floor_ms"], f["bound"]) == (pytest.approx(2.0), "compute")
    f = w.floors(1000.0, 1000.0, gexps=250.0)  # 1e9 exponentials at 250 G/s: 4 ms
    assert (f["floor_ms"], f["bound"]) == (pytest.approx(4.0), "exp")


def test_profiler_events_map_to_rows():
    """Two identical steps: the interval kernels' first launch is the compressed branch, the second the window;
    a kernel no row names lands in `other`; a changed launch count leaves those rows empty, not wrong."""
    step = [("_interval_fwd_kernel", 1.0), ("_select_topn_kernel", 2.0), ("_sel_fwd_kernel", 3.0),
            ("_interval_fwd_kernel", 4.0), ("_bwd_dq_kernel", 5.0), ("_interval_bwd_dkdv_kernel", 6.0),
            ("_sel_bwd_dkdv_kernel", 7.0), ("_sel_bwd_dkdv_kernel", 0.5), ("_sel_dkdv_reduce_kernel", 0.25),
            ("_interval_bwd_dkdv_kernel", 8.0), ("void at::native::sort_kernel", 9.0)]
    events, clock = [], 0.0
    for rep in range(3):
        for name, us in step:
            events.append((name, clock, us * 1000 * (1 + 0.01 * rep)))  # durations in us; ms in the table
            clock += 1e4
    rows, other = kf.assign_rows(kf.group_kernel_times(events, 3), kf.TRAINING_KERNELS)
    expected = dict(cmp_fwd=1.0, topn=2.0, sel_fwd=3.0, win_fwd=4.0, dq=5.0, cmp_dkdv=6.0, sel_dkdv=7.75, win_dkdv=8.0)
    assert rows == pytest.approx({k: v * 1.01 for k, v in expected.items()})
    assert other == pytest.approx({"void at::native::sort_kernel": 9.0 * 1.01})
    three = [e for e in events if e[0] != "_interval_fwd_kernel"] + [("_interval_fwd_kernel", i * 7.0, 1000.0)
                                                                     for i in range(9)]
    rows, other = kf.assign_rows(kf.group_kernel_times(three, 3), kf.TRAINING_KERNELS)
    assert rows["cmp_fwd"] is None and rows["win_fwd"] is None and other["_interval_fwd_kernel"] == pytest.approx(3.0)


def test_idle_gaps_sum_the_time_between_kernels_per_step():
    """Two steps of three kernels (us): gaps of 5 and 20 us after "a" and "b" in each, an overlapping kernel that
    hides part of a gap, time before the first kernel not counted; per step in ms, the largest pair first."""
    events = []
    for step_start in (100.0, 1000.0):
        events += [("a", step_start, 10.0), ("b", step_start + 15.0, 10.0), ("c", step_start + 45.0, 10.0)]
    events.append(("overlap", 1020.0, 20.0))  # runs 1020-1040: hides the second step's b -> c gap but 5 us
    idle, gaps = kf.idle_gaps(events, reps=2)
    # step 1: 5 (a->b) + 20 (b->c); step 2: 5 (a->b) + 5 (overlap->c); between the steps: 1000 - 155 = 845
    assert idle == pytest.approx((5 + 20 + 845 + 5 + 5) / 2 / 1e3)
    assert gaps[0] == {"after": "c", "before": "a", "ms": pytest.approx(845 / 2 / 1e3)}
    assert [(g["after"], g["before"]) for g in gaps[1:]] == [("b", "c"), ("a", "b")]
    assert gaps[1]["ms"] == pytest.approx(20 / 2 / 1e3) and gaps[2]["ms"] == pytest.approx(10 / 2 / 1e3)
    assert kf.idle_gaps([], reps=1) == (0.0, [])
    assert kf.describe_gaps(gaps[1:2]) == "b (0.01 ms)"


def test_other_kernels_are_named_short_and_summed():
    """The log line's unclaimed torch kernels: demangled names cut to the function's own name (no return type,
    namespaces, template arguments or parameters), launches of one short name summed, the longest first, the rest
    counted."""
    long_name = ("void at::native::(anonymous namespace)::radixSortKVInPlace<-2, -1, 128, 4, long, int, "
                 "unsigned int>(at::cuda::detail::TensorInfo<long, unsigned int>, unsigned int)")
    assert kf.short_kernel_name(long_name) == "radixSortKVInPlace"
    assert kf.short_kernel_name("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<int>>("
                                "int, at::native::FillFunctor<int>)") == "vectorized_elementwise_kernel"
    assert kf.short_kernel_name("_tile_union_kernel") == "_tile_union_kernel"
    assert kf.short_kernel_name("Memset (Device)") == "Memset"
    other = {long_name: 0.10, "void at::native::elementwise_kernel<128, 2>(int)": 0.02,
             "void at::native::elementwise_kernel<128, 4>(int)": 0.05, "_tile_union_kernel": 0.08}
    assert kf.describe_other(other) == "radixSortKVInPlace 0.10, _tile_union_kernel 0.08, elementwise_kernel 0.07"
    assert kf.describe_other(other, top=1) == "radixSortKVInPlace 0.10, 2 more"
    assert kf.describe_other({}) == "none"
    assert kf.describe_gaps([{"after": long_name, "before": "b", "ms": 0.01}]) == "radixSortKVInPlace (0.01 ms)"


def test_command_line_without_gpu(tmp_path, capsys):
    out = tmp_path / "floors.json"
    kf.main(["--analytic", "--ceilings", "800,3000,4000", "--lengths", "2048", "65536", "--layouts", "12,2,64",
             "--decode-batch", "1", "32", "--decode-lengths", "65536", "--json", str(out)])
    data = json.loads(out.read_text())
    assert data["ceilings"] == dict(tflops=800.0, gbps=3000.0, gexps=4000.0, measured=False)
    assert [(c["T"], c["B"]) for c in data["training"]] == [(2048, 32), (65536, 1)]
    assert [(c["B"], c["T"]) for c in data["decode"]] == [(1, 65536), (32, 65536)]
    for case in data["training"] + data["decode"]:
        for r in case["rows"]:
            assert r["floor_ms"] == max(r["flop_ms"], r["byte_ms"], r["exp_ms"])
    long = {r["kernel"]: r for r in data["training"][1]["rows"]}
    # at 64k a query attends ~2,047 compressed + ~1,024 selected + 512 window keys on average (NSA_SPEC, cost per
    # query), dense causal 32,768: about 9x the forward's matmul work
    nsa_fwd = sum(long[k]["flops"] for k in ("cmp_fwd", "sel_fwd", "win_fwd"))
    assert long["dense_fwd"]["flops"] / nsa_fwd == pytest.approx(32768.5 / (2047 + 1024 + 512), rel=0.02)
    text = capsys.readouterr().out
    assert "| fused dQ (3 branches) + dgates |" in text and "decode B=32 context 65536" in text
    with pytest.raises(SystemExit):
        kf.main(["--ceilings", "800"])


# ------------------------------------------------------------------------------------------------ scheduled work


def test_union_visits_and_pair_tiles_count_blocks_by_document():
    """Hand-made choices over two 3-token documents (l' = 4): the same in-document block j of two documents is two
    blocks (different first keys), repeats within a tile count once, unused slots never."""
    doc_pos = torch.tensor([[0, 1, 2, 0, 1, 2]])  # documents start at keys 0 and 3
    idx = torch.tensor([[[[0, -1], [0, 1], [1, 0], [0, -1], [0, -1], [1, -1]]]])  # (B=1, Hkv=1, Tq=6, n'=2)
    # first keys: q0 {0}, q1 {0, 4}, q2 {4, 0}, q3 {3}, q4 {3}, q5 {7}
    assert kf.union_block_visits(idx, doc_pos, 4, 2) == 2 + 3 + 2  # tiles {q0,q1} {q2,q3} {q4,q5}
    assert kf.union_block_visits(idx, doc_pos, 4, 3) == 2 + 2  # {q0..q2}: 0, 4; {q3..q5}: 3, 7
    assert kf.union_block_visits(idx, doc_pos, 4, 4) == 3 + 2  # {q0..q3}: 0, 4, 3; padded {q4, q5}: 3, 7
    # pairs per block: 0 -> 3 (q0, q1, q2), 4 -> 2, 3 -> 2, 7 -> 1
    assert kf.pair_tiles(idx, doc_pos, 4, 2) == 2 + 1 + 1 + 1
    assert kf.pair_tiles(idx, doc_pos, 4, 3) == 4
    two_heads = torch.cat([idx, idx.flip(2)], dim=1)  # a second KV head: its blocks are its own
    assert kf.pair_tiles(two_heads, doc_pos, 4, 3) == 8


def test_union_visits_equal_the_launchers_tile_unions():
    """On random choices over packed documents and padding, the union visits are the sum of the counts the
    launcher's oracle of the tile-union kernel gives (tests/triton_helpers.tile_block_union_torch)."""
    from triton_helpers import random_doc_positions, tile_block_union_torch

    doc_pos = random_doc_positions(3, 157, seed=4)
    lb, n_sel = 8, 5
    gen = torch.Generator().manual_seed(0)
    n_blocks = torch.where(doc_pos >= 0, doc_pos // lb + 1, 0)[:, None, :, None]
    shape = (3, 2, 157, n_sel)
    j = (torch.rand(shape, generator=gen) * n_blocks).long()
    idx = torch.where((torch.rand(shape, generator=gen) < 0.2) | (n_blocks == 0), -1, j)
    for qpb in (1, 4, 10, 21):
        _, _, counts, _ = tile_block_union_torch(idx, doc_pos, qpb, lb)
        assert kf.union_block_visits(idx, doc_pos, lb, qpb) == int(counts.sum()), qpb


def test_scheduled_work_counts_the_tiles_math_and_loads():
    """sel_fwd: every union block costs the whole tile's 2 dots and exps and one K/V block load; dq: 3 dots plus the
    interval branches' ideal share; sel_dkdv: 4 dots per pair tile and its rows' q, dO, lse and delta. Then the
    floors with loads at the L2 rate, and the table's fraction of the scheduled floor."""
    p = NSAParams(**TINY)
    B, T, H, Hkv, D = 1, 6, 2, 1, 8
    doc_pos = torch.tensor([[0, 1, 2, 0, 1, 2]])
    idx = torch.tensor([[[[0, -1], [0, 1], [1, 0], [0, -1], [0, -1], [1, -1]]]])
    lb = p.sel_block_size
    ideal = kf.kernel_work(p, B, T, H, Hkv, D)
    by_name = {w.name: w for w in ideal}
    schedule = kf.Schedule(sel_fwd=(16, 2), dq=(32, 3), sel_dkdv=(16, 3))
    work = kf.scheduled_work(p, idx, doc_pos, (B, T, H, Hkv, D), schedule, ideal)
    # first keys in units of l' = 16 here: q0 {0}, q1 {0, 16}, q2 {16, 0}, q3 {3}, q4 {3}, q5 {19}
    fwd_visits, dq_visits = 2 + 3 + 2, 2 + 2
    assert work["sel_fwd"].flops == fwd_visits * 2 * 2 * 16 * lb * D
    assert work["sel_fwd"].exps == fwd_visits * 16 * lb
    kv_once = 2 * B * T * Hkv * D * 2  # k_slc, v_slc read once in the ideal count, per visit as scheduled
    assert work["sel_fwd"].bytes_read == by_name["sel_fwd"].bytes_read - kv_once + fwd_visits * 2 * lb * D * 2
    sel_pairs = by_name["sel_fwd"].pairs
    assert work["dq"].flops == dq_visits * 3 * 2 * 32 * lb * D + by_name["dq"].flops - 6 * D * sel_pairs
    assert work["dq"].exps == dq_visits * 32 * lb + by_name["dq"].exps - sel_pairs
    tiles = 4  # blocks 0 (3 pairs), 16 (2), 3 (2), 19 (1) in tiles of 3 queries
    assert work["sel_dkdv"].flops == tiles * 4 * 2 * 16 * lb * D
    rows_once = B * T * H * (2 * D * 2 + 2 * 4)  # q, dO, lse, delta once (ideal), per pair tile row (scheduled)
    assert work["sel_dkdv"].bytes_read == by_name["sel_dkdv"].bytes_read - rows_once + tiles * 16 * (2 * D * 2 + 2 * 4)
    assert kf.scheduled_work(p, idx, doc_pos, (B, T, H, Hkv, D), schedule, ideal, repeat=2.0)["sel_fwd"].flops == \
        2 * work["sel_fwd"].flops
    rows = kf.table_rows(ideal, (1e-6, 1e-3, 1e-6), dict(sel_fwd=2.0), scheduled=work, l2_gbps=2e-3)
    row = {r["kernel"]: r for r in rows}["sel_fwd"]
    floors = work["sel_fwd"].floors(1e-6, 2e-3, 1e-6)
    assert row["scheduled_floor_ms"] == floors["floor_ms"] and row["scheduled_bound"] == floors["bound"]
    assert row["achieved_scheduled"] == pytest.approx(floors["floor_ms"] / 2.0)
    assert "scheduled_floor_ms" not in {r["kernel"]: r for r in rows}["win_fwd"]


def test_launcher_schedule_is_sm90s_whole_tiles_and_none_with_sub_tiles():
    """On sm_90 at head_dim 64 (what a CPU device reports) the forward takes 64-row tiles, the fused dQ 128 rows
    with 16 selected blocks, the pair tiles 64 rows; with sub-tiles (launch_overrides) there is no schedule the
    counts describe."""
    from modeling_nsa.nsa_triton_launch import launch_overrides

    assert kf.launcher_schedule(6, 64, 16, "cpu") == kf.Schedule(sel_fwd=(64, 10), dq=(128, 21), sel_dkdv=(64, 10))
    with launch_overrides(sel_sub_rows=16):
        assert kf.launcher_schedule(6, 64, 16, "cpu") is None


def test_command_line_scheduled_counts_without_gpu(capsys):
    kf.main(["--analytic", "--ceilings", "800,3000,4000", "--l2-gbps", "6000", "--lengths", "2048", "--layouts",
             "6,1,64", "--decode-batch", "--scheduled-queries", "256"])
    text = capsys.readouterr().out
    assert "scheduled floor ms" in text and "256 random queries" in text
    sel_row = next(line for line in text.splitlines() if line.startswith("| selected attention fwd"))
    assert sel_row.split("|")[-2].strip() in ("memory", "compute", "exp")
