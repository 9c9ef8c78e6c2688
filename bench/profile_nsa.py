"""Per-kernel CUDA time (torch.profiler) of one NSA fwd+bwd step at 2k and 64k, and of one decode step at
64k context: where the time goes. Then the decode step's host time (eager calls are launch-bound: 0.35 ms
per call against 0.08 ms of GPU time on the H100, 2026-11-22), split into our Python around the kernels
and the Triton launches themselves. Dev tool: `python bench/profile_nsa.py`."""
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_attention import PARAMS, nsa_inputs, tri  # noqa: E402
from memory_cpu import _NoKernel  # noqa: E402
from triton_aot import with_kernels_replaced  # noqa: E402

if not torch.cuda.is_available():
    raise SystemExit("profile_nsa.py needs a CUDA GPU.")


def profile(title, fn, rows=30):
    for _ in range(2):  # warm-up: kernel compilation stays outside the trace
        fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    print(f"== {title}")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows, max_name_column_width=40))


for B, T in [(32, 2048), (1, 65536)]:
    x, cmp_end, doc_pos = nsa_inputs(B, T, 12, 2, 64)
    do = torch.randn(B, T, 12, 64, device="cuda", dtype=torch.bfloat16)

    def step():
        o = tri.nsa_attention_triton(x["q"], x["k_cmp"], x["v_cmp"], cmp_end, x["k_slc"], x["v_slc"],
                                     x["k_win"], x["v_win"], x["gates"], doc_pos, PARAMS)
        torch.autograd.grad(o, list(x.values()), do)

    profile(f"fwd+bwd B={B} T={T}", step)
    del x

# decode: one new token over a 64k cache (the three kernels of an eager step)
T = 65536
x, cmp_end, doc_pos = nsa_inputs(1, T, 12, 2, 64, grad=False)
w = PARAMS.window_size


def decode():
    tri.nsa_decode_triton(x["q"][:, -1:], x["k_cmp"], x["v_cmp"], cmp_end, x["k_slc"], x["v_slc"], x["k_win"][:, -w:],
                          x["v_win"][:, -w:], x["gates"][:, -1:], doc_pos, PARAMS)


profile(f"decode B=1 context={T}", decode, rows=8)


def host_us(fn, calls=200):
    """Mean host wall time of one call (µs), no synchronization inside: what an eager decoding loop pays
    per layer before the GPU can run."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - t0
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


total = host_us(decode)
without = []
with_kernels_replaced(lambda: without.append(host_us(decode)), lambda name, fn: _NoKernel())
print(f"== decode host time per call at context {T}: {total:.1f} us; without the 3 Triton launches {without[0]:.1f} "
      f"us (launches: {(total - without[0]) / 3:.1f} us each)")
