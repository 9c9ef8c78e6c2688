"""Per-kernel CUDA time of one NSA fwd+bwd step (torch.profiler): where the time goes. Dev tool."""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_attention import PARAMS, nsa_inputs, tri  # noqa: E402

for B, T in [(32, 2048), (1, 65536)]:
    x, cmp_end, doc_pos = nsa_inputs(B, T, 12, 2, 64)
    do = torch.randn(B, T, 12, 64, device="cuda", dtype=torch.bfloat16)

    def step():
        o = tri.nsa_attention_triton(x["q"], x["k_cmp"], x["v_cmp"], cmp_end, x["k_slc"], x["v_slc"],
                                     x["k_win"], x["v_win"], x["gates"], doc_pos, PARAMS)
        torch.autograd.grad(o, list(x.values()), do)

    step(); step(); torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step(); torch.cuda.synchronize()
    print(f"== B={B} T={T}")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=40))
