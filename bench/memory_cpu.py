"""Peak memory of the Triton NSA op's forward + backward, by allocation accounting on CPU (no GPU needed).

    python bench/memory_cpu.py [--lengths 2048 65536] [--tokens 65536] [--layouts 12,2,64 16,1,64]
                               [--variants default block_outer:sel_fwd_pairs=1,sel_dq_pairs=1]

Runs the op's host code exactly as bench_attention.py's training step does (B*T tokens, bf16, the 125M
and fla head layouts; autograd.grad of the output) with every Triton kernel replaced by a no-op that
keeps no reference to its arguments, and tracks the bytes of every tensor storage the step allocates
and keeps alive (the custom ops' bodies run inside the tracker, so their temporaries count). The
peak over the step, minus what existed before it, is what `torch.cuda.max_memory_allocated` reports on a
GPU up to the caching allocator's rounding (kernels allocate nothing themselves; all shapes are static,
so sizes do not depend on the values the no-op kernels leave behind). Checked against the GPU: on the
kernels of commit 9b9991f this accounting gives 1262 MiB for the 125M layout at 2k and 64k, where
bench_attention.py measured 1262 / 1263 MiB on an H100. Compare with the dense SDPA peak that
bench_attention.py measures on a GPU.
"""

from __future__ import annotations

import argparse
import sys
import weakref
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from triton_aot import tri, with_kernels_replaced  # noqa: E402
from triton_helpers import DEFAULT, make_inputs  # noqa: E402


_OP_IMPLS = {
    torch.ops.nsa_triton.fwd.default: tri._nsa_fwd_op._init_fn,
    torch.ops.nsa_triton.bwd.default: tri._nsa_bwd_op._init_fn,
    torch.ops.nsa_triton.bwd_reusing_outputs.default: tri._nsa_bwd_reusing_op._init_fn,
}


class LiveBytes(TorchDispatchMode):
    """Tracks the storages of tensors created inside the mode; peak of their total live bytes."""

    def __init__(self, existing=()):
        super().__init__()
        self.tensors: list[weakref.ref] = []
        self.peak = 0
        self.at_peak: list = []
        self.existing = {t.untyped_storage().data_ptr() for t in existing}  # allocated before the step

    def live(self, describe: bool = False):
        """Bytes of the live storages (or, with describe, one (shape, dtype, bytes) per storage)."""
        seen, total, rows = set(), 0, []
        alive = []
        for ref in self.tensors:
            t = ref()
            if t is None:
                continue
            alive.append(ref)
            storage = t.untyped_storage()
            if storage.data_ptr() not in seen and storage.data_ptr() not in self.existing:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
                rows.append((tuple(t.shape), t.dtype, storage.nbytes()))
        self.tensors = alive
        return rows if describe else total

    def update_peak(self):
        total = self.live()
        if total > self.peak:
            self.peak, self.at_peak = total, self.live(describe=True)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        impl = _OP_IMPLS.get(func)
        if impl is not None:  # the NSA custom ops: run their Python bodies inside the mode (temporaries count)
            with self:
                out = impl(*args, **(kwargs or {}))
        else:
            out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() > 0:
                self.tensors.append(weakref.ref(t))
        self.update_peak()
        return out


class _NoKernel:
    """Stands in for a @triton.jit kernel: a launch does nothing and keeps no reference to its arguments."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def step_peak(batch: int, seq_len: int, heads=12, kv_heads=2, head_dim=64) -> "LiveBytes":
    """The tracker after one fwd+bwd step of the op: .peak bytes and .at_peak (shape, dtype, bytes) rows."""
    t, cmp_end, doc_pos, params = make_inputs(batch, seq_len, heads, kv_heads, head_dim, DEFAULT, torch.bfloat16,
                                              "cpu", "single")
    leaves = {n: x.requires_grad_(True) for n, x in t.items()}
    dout = torch.randn_like(t["q"])
    mode = LiveBytes(existing=[*leaves.values(), dout, cmp_end, doc_pos])

    def step():
        with mode:
            out = tri.nsa_attention_triton(leaves["q"], leaves["k_cmp"], leaves["v_cmp"], cmp_end, leaves["k_slc"],
                                           leaves["v_slc"], leaves["k_win"], leaves["v_win"], leaves["gates"],
                                           doc_pos, params)
            grads = torch.autograd.grad(out, list(leaves.values()), dout)
            del grads
            mode.update_peak()

    with_kernels_replaced(step, lambda name, fn: _NoKernel())
    return mode


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="*", default=[2048, 65536])
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--layouts", nargs="*", default=["12,2,64", "16,1,64"], help="q heads,kv heads,head_dim")
    ap.add_argument("--variants", nargs="*", default=["default"],
                    help="launch variants as bench/tune_kernels.py names them (name:knob=value,...; 'default': none)")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT / "bench"))
    from tune_kernels import parse_variant

    variants = [parse_variant(v) for v in args.variants]
    print("| layout | T | B | variant | NSA fwd+bwd peak MiB (CPU allocation accounting) |")
    print("|---|---|---|---|---|")
    for spec in args.layouts:
        heads, kv_heads, head_dim = (int(x) for x in spec.split(","))
        for seq_len in args.lengths:
            batch = max(1, args.tokens // seq_len)
            for name, settings in variants:
                with tri.launch_overrides(**settings):
                    mib = step_peak(batch, seq_len, heads, kv_heads, head_dim).peak / 2**20
                print(f"| {heads} q / {kv_heads} kv, d{head_dim} | {seq_len} | {batch} | {name} | {mib:.0f} |",
                      flush=True)


if __name__ == "__main__":
    main()
