"""What NSA adds to a training step outside its attention op, counted on CPU (no GPU needed).

    python bench/model_traffic_cpu.py [--seq-lens 2048 8192] [--tokens-per-step 32768] [--top 12]
    python bench/model_traffic_cpu.py --decode [--decode-batch 1] [--prompt-len 64]

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

--decode counts eager decoding steps instead (real CPU tensors, the attention stand-ins, no gradients), d of them
(one compression cycle: NSA's default cache runs its compressor only at the steps where a row completes a
compressed token): the ops NSA's default and static caches, dense mode and HF Llama dispatch per generated token,
and the same steps' host time on this CPU (the model narrowed to width 96, in float32). Eager `generate()` on a
GPU is host-bound at small batch: each op is a dispatch and a launch, so this is what its step costs the host.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import sys
import time
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


# the 125M model's layers, heads and NSA layout at a width where this CPU's arithmetic is negligible beside the
# host's work per op: what is left of a step's time is Python and the dispatcher
HOST_SIZE = dict(SIZE_125M, vocab_size=512, hidden_size=96, intermediate_size=192, head_dim=16)


@contextlib.contextmanager
def _decoding_model(model_name: str, prompt_len: int, num_steps: int, size: dict, dtype: torch.dtype):
    """bench_model's `model_name` on CPU in `dtype`, with the attention replaced by the stand-ins while it is used."""
    saved = modeling.nsa_attention, torch.nn.functional.scaled_dot_product_attention
    modeling.nsa_attention = _nsa_stand_in
    torch.nn.functional.scaled_dot_product_attention = _sdpa_stand_in
    try:
        yield build(model_name, prompt_len + num_steps + 1, size).to(dtype).eval()
    finally:
        modeling.nsa_attention, torch.nn.functional.scaled_dot_product_attention = saved


def _decode(model, batch: int, prompt_len: int, num_steps: int, static: bool, around_step) -> None:
    """A prompt of prompt_len tokens, then num_steps + 1 decoding steps; the last num_steps each run inside
    around_step(i) (a context manager: the first step may allocate)."""
    ids = torch.randint(0, model.config.vocab_size, (batch, prompt_len), generator=torch.Generator().manual_seed(0))
    name = modeling.CACHE_NAME  # (past_key_values before transformers 5.24, cache since)
    cache = modeling.NSACache(model.config, max_cache_len=prompt_len + num_steps + 1, static=True) if static else None
    with torch.no_grad():
        out = model(ids, use_cache=True, **{name: cache})
        for step in range(num_steps + 1):
            kwargs = dict(cache_position=torch.tensor([prompt_len + step])) if static else {}
            with around_step(step - 1) if step else contextlib.nullcontext():
                out = model(ids[:, -1:], use_cache=True, **{name: getattr(out, name)}, **kwargs)


def count_decode_steps(model_name: str, batch: int, prompt_len: int, num_steps: int, static: bool = False,
                       size: dict = SIZE_125M) -> list[StepCounter]:
    """The num_steps decoding steps after the first one that follows a prompt of prompt_len tokens, each counted:
    bench_model's `model_name` in bf16 on CPU, the attention replaced by the stand-ins."""
    counters = [StepCounter() for _ in range(num_steps)]
    with _decoding_model(model_name, prompt_len, num_steps, size, torch.bfloat16) as model:
        _decode(model, batch, prompt_len, num_steps, static, lambda i: counters[i])
    return counters


def time_decode_steps(model_name: str, batch: int, prompt_len: int, num_steps: int, static: bool = False,
                      size: dict = HOST_SIZE, repeats: int = 5) -> list[float]:
    """The same steps' wall times (seconds) on this CPU, each the least of `repeats` runs (what is left beside the
    machine's noise), at HOST_SIZE in float32: this CPU's bfloat16 matmuls are emulated and would time arithmetic,
    where float32 ones at that width take microseconds, so what is left is the host's work per op (Python,
    dispatch)."""
    runs = []

    @contextlib.contextmanager
    def timed(i):
        start = time.perf_counter()
        yield
        runs[-1].append(time.perf_counter() - start)

    with _decoding_model(model_name, prompt_len, num_steps, size, torch.float32) as model:
        for _ in range(repeats):
            runs.append([])
            _decode(model, batch, prompt_len, num_steps, static, timed)
    return [min(step) for step in zip(*runs)]


def count_decode_step(model_name: str, batch: int, prompt_len: int, static: bool = False,
                      size: dict = SIZE_125M) -> StepCounter:
    """The second decoding step after a prompt of prompt_len tokens, counted (count_decode_steps)."""
    return count_decode_steps(model_name, batch, prompt_len, 1, static, size)[0]


def print_decode_counts(batch: int, prompt_len: int) -> None:
    """Each model's eager decoding steps over one compression cycle (d steps: at batch 1 one of them completes a
    compressed token, and NSA's default cache runs its compressor at that step only)."""
    layers, stride = SIZE_125M["num_hidden_layers"], modeling.NSAConfig().cmp_stride
    print(f"\nEager decoding steps after a {prompt_len}-token prompt, B = {batch}, 125M ({layers} layers), attention "
          f"stand-ins; ops that launch work (views and allocations not counted), over {stride} steps (d: one "
          "compression cycle); host ms: the same steps' wall time on this CPU with the model at width 96 in "
          "float32, the least of 5 runs per step (what is left is the host's work per op)\n")
    print("| model | ops, mean per step | per layer | fewest / most in a step | host ms per step (CPU) |")
    print("|---|---|---|---|---|")
    for label, name, static in (("NSA, default cache", "nsa", False), ("NSA, static cache (eager)", "nsa", True),
                                ("NSA dense mode (SDPA)", "nsa-dense", False), ("HF Llama (SDPA)", "llama", False)):
        calls = [c.total("calls") for c in count_decode_steps(name, batch, prompt_len, stride, static)]
        seconds = time_decode_steps(name, batch, prompt_len, stride, static)
        mean, host_ms = sum(calls) / len(calls), 1e3 * sum(seconds) / len(seconds)
        print(f"| {label} | {mean:.0f} | {mean / layers:.1f} | {min(calls)} / {max(calls)} | {host_ms:.2f} |")


def floor_ms(counter: StepCounter, tflops: float, gbps: float) -> float:
    return counter.total("flops") / (tflops * 1e9) + counter.total("bytes") / (gbps * 1e6)


def main(argv: list[str] | None = None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--tokens-per-step", type=int, default=32768)
    parser.add_argument("--top", type=int, default=12, help="op kinds listed, largest NSA - dense bytes first")
    parser.add_argument("--tflops", type=float, default=H100_TFLOPS)
    parser.add_argument("--gbps", type=float, default=H100_GBPS)
    parser.add_argument("--decode", action="store_true", help="count and time eager decoding steps instead (see above)")
    parser.add_argument("--decode-batch", type=int, default=1, help="rows of the decoding steps (--decode)")
    parser.add_argument("--prompt-len", type=int, default=64, help="tokens in the cache before the steps (--decode)")
    args = parser.parse_args(argv)
    if args.decode:
        if args.decode_batch < 1 or args.prompt_len < 1:
            parser.error(f"--decode-batch ({args.decode_batch}) and --prompt-len ({args.prompt_len}) must be >= 1")
        print_decode_counts(args.decode_batch, args.prompt_len)
        return
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
