"""What the Triton op keeps in memory at its fwd+bwd peak (CPU allocation accounting, bench/memory_cpu.py).

The step runs the op's host code with no-op kernels; every shape is static, so the tensors alive at the
peak are those a GPU run allocates. The query-sized ones must be exactly: the gated output, the three
saved branch outputs and dQ, all in the input dtype. Zero gradients materialized for the saved-only
outputs (three more) or an fp32 dQ accumulator would show here; so would a heavy-block partial buffer
sized by the worst case instead of its cap.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

try:
    import triton  # noqa: F401

    HAS_TRITON = True
except Exception:
    HAS_TRITON = False


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_peak_holds_only_output_branch_outputs_and_dq():
    import memory_cpu

    # enough key tiles that the window dK/dV needs no split partials (those are capped in absolute size:
    # at most 1024 programs' fp32 tiles, 32 MiB at d64, which dominates only at small B*T)
    batch, seq_len, heads, head_dim = 8, 4096, 12, 64
    mode = memory_cpu.step_peak(batch, seq_len, heads, 2, head_dim)
    q_shape = (batch, seq_len, heads, head_dim)
    q_bytes = batch * seq_len * heads * head_dim * 2
    query_sized = [row for row in mode.at_peak if row[2] >= q_bytes]
    assert len(query_sized) == 5, query_sized
    assert all(shape == q_shape and dtype == torch.bfloat16 for shape, dtype, _ in query_sized), query_sized
    # everything else together stays below two query-sized tensors at this shape
    rest = sum(nbytes for _, _, nbytes in mode.at_peak) - 5 * q_bytes
    assert rest < 2 * q_bytes, (rest / q_bytes, sorted(mode.at_peak, key=lambda r: -r[2])[:8])


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_block_outer_schedules_memory():
    """The block-outer selected forward (sel_fwd_pairs) keeps the op's peak where it is: its partials (at most twice
    q's size per chunk) live in the forward, below the backward's peak. The block-outer dQ (sel_dq_pairs) adds,
    at the backward's peak, its fp32 interval dQ in place of the default's dQ (one q-sized more) and one chunk of
    partials (at most q's size): bench/KERNELS.md states the resulting peak against dense's."""
    import memory_cpu
    from memory_cpu import tri

    batch, seq_len, heads, head_dim = 2, 4096, 12, 64
    q_bytes = batch * seq_len * heads * head_dim * 2
    default = memory_cpu.step_peak(batch, seq_len, heads, 2, head_dim).peak
    with tri.launch_overrides(sel_fwd_pairs=True):
        assert memory_cpu.step_peak(batch, seq_len, heads, 2, head_dim).peak == default
    with tri.launch_overrides(sel_fwd_pairs=True, sel_dq_pairs=True):
        mode = memory_cpu.step_peak(batch, seq_len, heads, 2, head_dim)
    fp32_dq = [row for row in mode.at_peak if row[0] == (batch, seq_len, heads, head_dim) and row[1] == torch.float32]
    assert len(fp32_dq) == 1, sorted(mode.at_peak, key=lambda r: -r[2])[:8]
    assert default < mode.peak <= default + 2 * q_bytes + 2**20, (default, mode.peak, q_bytes)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("qpb", [10, 4], ids=["125M-G6", "fla-G16"])
def test_selected_dkdv_heavy_split_defaults_balance_within_fixed_partials(qpb):
    """The selected dK/dV's heavy-block split (_sel_heavy_split): block 0 of an 8k row (8,192 pairs, every query
    chose it) is split, each split holds about 128 pair tiles or fewer up to 64k queries (the heavy pass runs
    first and alone: its longest split is its time), and the fp32 partials stay at 1,024 tiles (16 MiB each
    for dK and dV at head_dim 64) at every length."""
    from modeling_nsa.nsa_triton_selected import _sel_heavy_split

    for num_q in (2048, 8192, 32768, 65536, 262144):
        heavy_min, n_split, slots = _sel_heavy_split(num_q, qpb)
        assert heavy_min < 8192 <= num_q or num_q < 8192
        assert n_split * slots <= 1024 and slots >= 4
        if num_q <= 65536:
            assert -(-num_q // n_split) <= 128 * qpb, (num_q, n_split)  # a block holds at most num_q pairs
