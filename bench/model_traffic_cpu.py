"""What NSA adds to a training step outside its attention op, counted on CPU (no GPU needed).

    python bench/model_traffic_cpu.py [--seq-lens 2048 8192] [--tokens-per-step 32768] [--top 12]

Builds the 125M NSA model (bench_model.py's size) and the same model in dense mode on the meta device (shapes
only, no memory, no arithmetic), runs one training step (forward, loss, backward; bf16 weights as
bench_model.py's `bf16` rows) under a dispatch mode that counts every aten op the step dispatches, and prints,
per op kind, NSA against dense mode: calls, bytes moved and matmul FLOPs. The attention itself is replaced by a
stand-in in both models (NSA's op and dense SDPA: `bench_attention.py` times those against each other), so the
difference is what NSA's own parts cost: the three K/V sets and the gate projection, the compressor's gather and
MLP, the extra RoPE, and the gradients flowing back through them.

Counting:
- bytes: each tensor an op reads or writes, at its footprint (elements along broadcast dimensions, stride 0,
  counted once); views (view, permute, expand, slicing, unbind ...) and allocations (empty*) move nothing;
- FLOPs: 2 m n k per matmul (mm, addmm, bmm);
- a time floor per step at the ceilings given (default: the H100's measured on 2026-11-27 by
  bench/kernel_floors.py, 773 TFLOP/s bf16 and 2,978 GB/s): FLOPs / peak + bytes / bandwidth, which no real
  kernel reaches (PyTorch's elementwise kernels and small matmuls run well below it), so read the difference
  as a lower bound of what NSA's parts add;
- calls: the aten ops that launch work (not views or allocations), as a proxy for the host's launches.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import modeling_nsa.modeling_nsa as modeling  # noqa: E402
from bench_model import SIZE_125M, build  # noqa: E402

# aten ops that return views or fresh uninitialized storage: no bytes move
NO_TRAFFIC = {
    "view", "_unsafe_view", "reshape", "_reshape_alias", "permute", "expand", "transpose", "t", "unsqueeze",
    "squeeze", "as_strided", "slice", "select", "unbind", "split", "split_with_sizes", "detach", "alias",
    "unflatten", "lift_fresh", "empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided",
}  # fmt: skip
MATMULS = {"mm", "addmm", "bmm"}
H100_TFLOPS, H100_GBPS = 773.0, 2978.0  # bench/kernel_floors.py's ceilings, H100 80GB HBM3, 2026-11-27


def footprint_bytes(x) -> int:
    """Bytes a kernel touches reading or writing x: its elements along dimensions with a nonzero stride
    (a broadcast dimension is one element wide in memory)."""
    if not isinstance(x, torch.Tensor):
        return 0
    elements = 1
    for size, stride in zip(x.shape, x.stride()):
        if stride != 0:
            elements *= size
    return elements * x.element_size()


def _tensors(values) -> list:
    out = []
    for v in values:
        if isinstance(v, (list, tuple)):
            out += _tensors(v)
        elif isinstance(v, torch.Tensor):
            out.append(v)
    return out


def matmul_flops(name: str, args) -> int:
    """2 m n k of an mm / addmm / bmm call."""
    a, b = (args[1], args[2]) if name == "addmm" else (args[0], args[1])
    return 2 * a.numel() * b.shape[-1]


class StepCounter(TorchDispatchMode):
    """Per aten op kind: calls, bytes (footprints of inputs and outputs) and matmul FLOPs."""

    def __init__(self):
        super().__init__()
        self.calls, self.bytes, self.flops = collections.Counter(), collections.Counter(), collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if name in NO_TRAFFIC:
            return out
        self.calls[name] += 1
        self.bytes[name] += sum(footprint_bytes(t) for t in _tensors([*args, *kwargs.values()]))
        self.bytes[name] += sum(footprint_bytes(t) for t in _tensors([out]))
        if name in MATMULS:
            self.flops[name] += matmul_flops(name, args)
        return out

    def total(self, counter: str) -> int:
        return sum(getattr(self, counter).values())


class AttentionStandIn(torch.autograd.Function):
    """The attention op's shapes without its work: output like q, gradients like every floating input."""

    @staticmethod
    def forward(ctx, q, *inputs):
        ctx.inputs = [(x.shape, x.dtype) if isinstance(x, torch.Tensor) else None for x in inputs]
        return torch.empty_like(q)

    @staticmethod
    def backward(ctx, grad):
        grads = [None if spec is None or not spec[1].is_floating_point else grad.new_empty(spec[0], dtype=spec[1])
                 for spec in ctx.inputs]  # fmt: skip
        return (torch.empty_like(grad), *grads)


def _nsa_stand_in(q, k_cmp, v_cmp, cmp_end, k_slc, v_slc, k_win, v_win, gates, doc_pos, params, backend="auto",
                  query_end=None):
    return AttentionStandIn.apply(q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, gates)


def _sdpa_stand_in(query, key, value, *args, **kwargs):
    return AttentionStandIn.apply(query, key, value)


@contextlib.contextmanager
def meta_model(model_name: str, batch: int, seq_len: int, size: dict = SIZE_125M):
    """bench_model.py's `model_name` (bf16) and input ids (batch, seq_len) on the meta device, with both attentions
    replaced by AttentionStandIn while the block runs."""
    saved = (modeling.nsa_attention, torch.nn.functional.scaled_dot_product_attention,
             modeling.NSAModel._check_inputs)  # fmt: skip
    modeling.nsa_attention = _nsa_stand_in
    torch.nn.functional.scaled_dot_product_attention = _sdpa_stand_in
    # the vocabulary check reads input_ids' values (a host sync on a GPU; no values on meta): shapes only here
    modeling.NSAModel._check_inputs = lambda self, ids, embeds, mask, positions, past: tuple(ids.shape)
    try:
        with torch.device("meta"):
            model = build(model_name, seq_len, size).to(torch.bfloat16)
            ids = torch.zeros(batch, seq_len, dtype=torch.long)
        yield model, ids
    finally:
        (modeling.nsa_attention, torch.nn.functional.scaled_dot_product_attention,
         modeling.NSAModel._check_inputs) = saved  # fmt: skip


def count_step(model_name: str, batch: int, seq_len: int, size: dict = SIZE_125M) -> StepCounter:
    """One training step (forward, loss, backward) of bench_model.py's `model_name` on the meta device, counted."""
    with meta_model(model_name, batch, seq_len, size) as (model, ids):
        counter = StepCounter()
        with counter:
            model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        return counter


def floor_ms(counter: StepCounter, tflops: float, gbps: float) -> float:
    return counter.total("flops") / (tflops * 1e9) + counter.total("bytes") / (gbps * 1e6)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--tokens-per-step", type=int, default=32768)
    parser.add_argument("--top", type=int, default=12, help="op kinds listed, largest NSA - dense bytes first")
    parser.add_argument("--tflops", type=float, default=H100_TFLOPS)
    parser.add_argument("--gbps", type=float, default=H100_GBPS)
    args = parser.parse_args()
    for seq_len in args.seq_lens:
        batch = max(1, args.tokens_per_step // seq_len)
        nsa, dense = count_step("nsa", batch, seq_len), count_step("nsa-dense", batch, seq_len)
        print(f"\nT = {seq_len}, B = {batch}: one training step outside the attention op (bf16 weights)\n")
        print("| op | calls NSA / dense | GB NSA / dense | TFLOP NSA / dense |")
        print("|---|---|---|---|")
        kinds = sorted(set(nsa.calls) | set(dense.calls), key=lambda k: -(nsa.bytes[k] - dense.bytes[k]))
        for kind in kinds[: args.top]:
            print(f"| {kind} | {nsa.calls[kind]} / {dense.calls[kind]} | {nsa.bytes[kind] / 1e9:.2f} / "
                  f"{dense.bytes[kind] / 1e9:.2f} | {nsa.flops[kind] / 1e12:.3f} / {dense.flops[kind] / 1e12:.3f} |")
        row = [(c.total("calls"), c.total("bytes") / 1e9, c.total("flops") / 1e12, floor_ms(c, args.tflops, args.gbps))
               for c in (nsa, dense)]  # fmt: skip
        print(f"| all | {row[0][0]} / {row[1][0]} | {row[0][1]:.2f} / {row[1][1]:.2f} | {row[0][2]:.3f} / "
              f"{row[1][2]:.3f} |")
        print(f"\nfloor at {args.tflops:.0f} TFLOP/s and {args.gbps:.0f} GB/s: NSA {row[0][3]:.1f} ms, dense mode "
              f"{row[1][3]:.1f} ms per step; NSA's parts outside the op add {row[0][3] - row[1][3]:.1f} ms "
              f"({row[0][0] - row[1][0]} more ops)")


if __name__ == "__main__":
    main()
