"""The interpreter's access checks (triton_helpers.check_memory_accesses) on toy kernels: an access outside every
tensor and a read of another program's write are caught; a read ordered by atomics (a release after the writes,
an acquire before the read, at GPU scope) is not; a relaxed count orders nothing.

Run as a script under TRITON_INTERPRET=1 (test_triton_kernels.py does, in a subprocess): prints one JSON line,
ACCESS_JSON={check: the error class raised, or "ok"}.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import triton_helpers  # noqa: E402


@triton.jit
def _last_sums_kernel(PART, ARRIVED, OUT, N: tl.constexpr, SEM: tl.constexpr, COUNT: tl.constexpr):
    """Program p writes PART[p]; with COUNT it then counts itself in ARRIVED, and the program that arrives last
    sums every PART into OUT (the decode parts' last-arriving combine); without, program N - 1 does (a race)."""
    p = tl.program_id(0)
    tl.store(PART + p, p + 1.0)
    if COUNT:
        tl.debug_barrier()
        last = tl.atomic_add(ARRIVED, 1, sem=SEM, scope="gpu") == N - 1
    else:
        last = p == N - 1
    if last:
        tl.store(OUT, tl.sum(tl.load(PART + tl.arange(0, N)), 0))


@triton.jit
def _past_the_end_kernel(X, N: tl.constexpr):
    tl.store(X + tl.arange(0, 2 * N), tl.zeros([2 * N], tl.float32))


def run(fn) -> str:
    try:
        fn()
    except Exception as exc:  # the check's error reaches here, possibly wrapped by the interpreter
        return "MemoryAccessError" if "MemoryAccessError" in repr(exc) else f"{type(exc).__name__}: {exc}"[:300]
    return "ok"


def main():
    triton_helpers.check_memory_accesses()
    n = 8

    def last_sums(sem, count):
        part, out = torch.zeros(n), torch.zeros(1)
        arrived = torch.zeros(1, dtype=torch.int32)
        _last_sums_kernel[(n,)](part, arrived, out, N=n, SEM=sem, COUNT=count)
        assert out.item() == n * (n + 1) / 2, out  # the last program saw every write

    checks = {
        "ordered_by_acq_rel_count": run(lambda: last_sums("acq_rel", True)),
        "relaxed_count": run(lambda: last_sums("relaxed", True)),
        "no_count": run(lambda: last_sums("acq_rel", False)),
        "past_the_end": run(lambda: _past_the_end_kernel[(1,)](torch.zeros(n), N=n)),
    }
    print("ACCESS_JSON=" + json.dumps(checks))


if __name__ == "__main__":
    main()
