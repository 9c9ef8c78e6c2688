"""The interpreter's vectorized reductions and scans (triton_helpers.vectorize_interpreter_reductions) against its
own per-element path, on the combines the kernels use: tl.sort (xor_sum), _max_combine / _min_combine forward and
reverse, _or_within_block over (key, bits) pairs, in 1-D and along both axes of 2-D blocks.

Run as a script under TRITON_INTERPRET=1 (test_triton_kernels.py does, in a subprocess): prints one JSON line,
REDUCTIONS_JSON={check: true where both paths gave the same arrays}.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import triton_helpers  # noqa: E402
from modeling_nsa.nsa_triton_common import _max_combine, _min_combine  # noqa: E402
from modeling_nsa.nsa_triton_selected import _or_within_block  # noqa: E402


@triton.jit
def _xor_sums_kernel(X, XOR, A: tl.constexpr, B: tl.constexpr):
    x = tl.load(X + tl.arange(0, A * B))  # (A * B,)
    grid = tl.reshape(x, [A, B])  # (A, B)
    tl.store(XOR + tl.arange(0, A), tl.xor_sum(grid, 1))
    tl.store(XOR + A + tl.arange(0, B), tl.xor_sum(grid, 0))
    tl.store(XOR + A + B + tl.arange(0, 1), tl.xor_sum(x, 0, keep_dims=True))


@triton.jit
def _scans_kernel(X, KEY, OUT, A: tl.constexpr, B: tl.constexpr):
    ab = tl.arange(0, A)[:, None] * B + tl.arange(0, B)[None, :]
    x = tl.load(X + ab)  # (A, B)
    key = tl.load(KEY + ab)  # (A, B) sorted along both axes and flattened
    tl.store(OUT + 0 * A * B + ab, tl.associative_scan(x, 0, _max_combine))
    tl.store(OUT + 1 * A * B + ab, tl.associative_scan(x, 1, _min_combine, reverse=True))
    tl.store(OUT + 2 * A * B + ab, tl.associative_scan(x, 1, _max_combine, reverse=True))
    _, bits = tl.associative_scan((key, x), 1, _or_within_block)
    tl.store(OUT + 3 * A * B + ab, bits)
    _, bits = tl.associative_scan((key, x), 0, _or_within_block)
    tl.store(OUT + 4 * A * B + ab, bits)
    flat = tl.reshape(x, [A * B])  # (A * B,)
    flat_key = tl.reshape(key, [A * B])
    _, bits = tl.associative_scan((flat_key, flat), 0, _or_within_block, reverse=True)
    tl.store(OUT + 5 * A * B + tl.arange(0, A * B), bits)
    tl.store(OUT + 6 * A * B + tl.arange(0, A * B), tl.associative_scan(flat, 0, _min_combine))


@triton.jit
def _sort_kernel(X, SORTED, N: tl.constexpr):
    tl.store(SORTED + tl.arange(0, N), tl.sort(tl.load(X + tl.arange(0, N)), 0))


def _run_all(seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    outputs = {}
    for dtype in (torch.int32, torch.int64, torch.float32):
        x = torch.randint(-2**20, 2**20, (256,), generator=gen).to(dtype)
        outputs[f"sort-{dtype}"] = torch.empty_like(x)
        _sort_kernel[(1,)](x, outputs[f"sort-{dtype}"], N=256)
        if not dtype.is_floating_point:  # xor_sum takes integers only
            outputs[f"xor-{dtype}"] = torch.zeros(16 + 16 + 1, dtype=dtype)
            _xor_sums_kernel[(1,)](x, outputs[f"xor-{dtype}"], A=16, B=16)
    for dtype in (torch.int32, torch.int64):
        x = torch.randint(0, 2**30, (8, 32), generator=gen).to(dtype)
        # _or_within_block is associative where equal keys are contiguous (the kernel scans a sorted list): keys
        # sorted in row-major order are sorted along each row, each column and the flattened block
        key = torch.sort(torch.randint(0, 40, (256,), generator=gen)).values.reshape(8, 32).to(dtype)
        out = torch.empty(7, 8, 32, dtype=dtype)
        _scans_kernel[(1,)](x, key, out, A=8, B=32)
        outputs[f"scans-{dtype}"] = out
    return outputs


def main() -> None:
    per_element = _run_all(seed=0)
    vectorized_installed = triton_helpers.vectorize_interpreter_reductions()
    vectorized = _run_all(seed=0)
    checks = {name: bool(torch.equal(per_element[name], vectorized[name])) for name in per_element}
    checks["installed"] = bool(vectorized_installed)
    print("REDUCTIONS_JSON=" + json.dumps(checks))


if __name__ == "__main__":
    main()
