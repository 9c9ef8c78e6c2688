"""Attention benchmark on a GPU: our NSA (Triton, three branches) vs dense causal SDPA vs fla's parallel_nsa.

    python bench/bench_attention.py [--json results.json] [--lengths 2048 8192 ...] [--tokens 65536]
                                    [--inputs random correlated captured --captured FILE] [--decode-batch 1 32]

Fixed B*T tokens per step; forward and forward+backward median milliseconds (CUDA events, warm-up,
fresh bf16 inputs per length), peak memory of the fwd+bwd step, ratios vs dense SDPA and fla. NSA and fla
are timed on two kinds of queries (see `queries`): independent random ones, the worst case for the
selected branch's shared block loads, and correlated ones, closer to a trained model's; with
`--inputs captured --captured FILE`, also a trained model's own q, K/V and gates (bench/capture_qkv.py writes
the file; each row is a crop of the captured tokens: capture_qkv.bench_inputs; layouts other than the capture's
are skipped).
Layouts: the 125M config (12 q heads, 2 kv heads, d64) and fla's (16 q, 1 kv, d64). Then decode:
per-token latency (--decode-batch rows of 1 query, cache of T keys) ours vs dense SDPA over a KV cache, called
eagerly and replayed from a CUDA graph (GPU time without Python and launch overhead; ours as a static cache's step, the
kernels generate() records in its graph).
Our NSA is the attention op only (q, per-branch k/v, compressed k/v, gates given); the compression
MLP and projections are outside the timed region, as they are outside SDPA's.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import capture_qkv  # noqa: E402
from triton_helpers import import_nsa  # noqa: E402

layout_mod, _, tri = import_nsa()
NSAParams = layout_mod.NSAParams
PARAMS = NSAParams(cmp_block_size=32, cmp_stride=16, sel_block_size=64, sel_num_blocks=16, sel_init_blocks=1,
                   sel_local_blocks=2, window_size=512)

try:
    from fla.ops.nsa import parallel_nsa

    HAS_FLA = True
except Exception:
    HAS_FLA = False


def time_ms(fn, warmup=2, reps=7):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e))
    return statistics.median(times)


def peak_mib(fn):
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def rnd(*shape, grad=True, device="cuda"):
    return torch.randn(*shape, device=device, dtype=torch.bfloat16).requires_grad_(grad)


QUERY_KINDS = ("random", "correlated")
INPUT_KINDS = QUERY_KINDS + ("captured",)
CAPTURED = {}  # the "captured" kind's tensors: use_captured


def use_captured(path):
    """Load bench/capture_qkv.py's file for the "captured" input kind."""
    if not path:
        raise SystemExit("--inputs captured needs --captured FILE (written by bench/capture_qkv.py)")
    CAPTURED["saved"] = capture_qkv.load_capture(path)


def queries(B, T, H, D, kind="random", grad=True, device="cuda"):
    """(B, T, H, D) bf16 queries. "random": independent Gaussian per position (consecutive queries choose
    nearly unrelated blocks: the selected tiles' block unions are largest). "correlated": one vector per
    head shared by every position plus 0.3 noise (as bench/selection_tiles.py), so neighbouring queries
    choose similar blocks, closer to a trained model."""
    if kind not in QUERY_KINDS:
        raise ValueError(f"query kind {kind!r}: use one of {QUERY_KINDS}")
    if kind == "random":
        return rnd(B, T, H, D, grad=grad, device=device)
    shared = torch.randn(1, 1, H, D, device=device)
    return (shared + 0.3 * torch.randn(B, T, H, D, device=device)).to(torch.bfloat16).requires_grad_(grad)


def nsa_inputs(B, T, H, Hkv, D, grad=True, kind="random", device="cuda"):
    """The op's inputs for B rows of one T-token document: fresh Gaussian keys, values and gate logits,
    queries of the given kind (see queries); "captured": a trained model's tensors, cropped (use_captured).
    device: "cpu" for bench/warm_kernel_cache.py, which records the launches these inputs get without a GPU."""
    if kind == "captured":
        return capture_qkv.bench_inputs(CAPTURED["saved"], B, T, H, Hkv, D, PARAMS, grad=grad)
    doc_pos = torch.arange(T, device=device).expand(B, T).contiguous()
    cmp_end = layout_mod.compressed_token_ends(doc_pos, PARAMS)
    Nc = cmp_end.shape[1]

    def r(*shape):
        return rnd(*shape, grad=grad, device=device)

    x = dict(q=queries(B, T, H, D, kind, grad, device), k_cmp=r(B, Nc, Hkv, D), v_cmp=r(B, Nc, Hkv, D),
             k_slc=r(B, T, Hkv, D), v_slc=r(B, T, Hkv, D), k_win=r(B, T, Hkv, D), v_win=r(B, T, Hkv, D))
    x["gates"] = torch.sigmoid(torch.randn(B, T, H, 3, device=device)).to(torch.bfloat16).requires_grad_(grad)
    return x, cmp_end, doc_pos


def fwd_fb_mem(name, step):
    """{name}_fwd and {name}_fb milliseconds and {name}_mem peak MiB of step(grad): a forward without
    gradients, and a forward + backward."""
    return {f"{name}_fwd": time_ms(lambda: step(False)), f"{name}_fb": time_ms(lambda: step(True)),
            f"{name}_mem": peak_mib(lambda: step(True))}


def nsa_step(x, cmp_end, doc_pos):
    """The timed call of our op on nsa_inputs' tensors: step(grad) runs the forward, and with grad the backward
    of a fixed output gradient too."""
    q = x["q"]
    do = torch.randn(q.shape, device=q.device, dtype=torch.bfloat16)

    def step(grad):
        with torch.set_grad_enabled(grad):
            o = tri.nsa_attention_triton(x["q"], x["k_cmp"], x["v_cmp"], cmp_end, x["k_slc"], x["v_slc"],
                                         x["k_win"], x["v_win"], x["gates"], doc_pos, PARAMS)
            if grad:
                torch.autograd.grad(o, list(x.values()), do)

    return step


def time_nsa(B, T, H, Hkv, D, kind):
    """Our op's forward ms, forward+backward ms and fwd+bwd peak MiB."""
    return fwd_fb_mem("nsa", nsa_step(*nsa_inputs(B, T, H, Hkv, D, kind=kind)))


def time_sdpa(B, T, H, Hkv, D):
    """Dense causal SDPA (GQA, same heads): forward ms, forward+backward ms, peak MiB. Its time does not
    depend on the values, so one measurement serves both input kinds."""
    q, k, v = rnd(B, H, T, D), rnd(B, Hkv, T, D), rnd(B, Hkv, T, D)
    do = torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16)

    def sdpa(grad):
        with torch.set_grad_enabled(grad):
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            if grad:
                torch.autograd.grad(o, (q, k, v), do)

    return fwd_fb_mem("sdpa", sdpa)


def time_fla(B, T, H, Hkv, D, kind):
    """fla-core's parallel_nsa (compression + selection, no window) on its own layout, same query kind."""
    try:
        qf, kf, vf = queries(B, T, H, D, kind), rnd(B, T, Hkv, D), rnd(B, T, Hkv, D)
        gc, gs = (torch.sigmoid(torch.randn(B, T, H, device="cuda")).bfloat16().requires_grad_(True) for _ in range(2))
        do = torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16)

        def fla(grad):
            with torch.set_grad_enabled(grad):
                o = parallel_nsa(qf, kf, vf, gc, gs, None, block_counts=16, block_size=64, window_size=0)
                if grad:
                    torch.autograd.grad(o, (qf, kf, vf, gc, gs), do)

        return fwd_fb_mem("fla", fla)
    except Exception as exc:  # report, keep going
        return dict(fla_error=f"{type(exc).__name__}: {exc}"[:200])


def bench_layout(H, Hkv, D, lengths, tokens, kinds, rows):
    for T in lengths:
        B = max(1, tokens // T)
        dense = time_sdpa(B, T, H, Hkv, D)
        for kind in kinds:
            if kind == "captured" and not capture_qkv.fits(CAPTURED["saved"], H, Hkv, D):
                print(f"# no captured inputs for {H}q/{Hkv}kv d{D}: the capture's layout is "
                      f"{capture_qkv.layout_of(CAPTURED['saved'])}", flush=True)
                continue
            row = dict(layout=f"{H}q/{Hkv}kv d{D}", heads=H, T=T, B=B, inputs=kind, **time_nsa(B, T, H, Hkv, D, kind), **dense)
            if HAS_FLA and (H // Hkv) >= 16:
                row.update(time_fla(B, T, H, Hkv, D, kind))
            rows.append(row)
            print(json.dumps(row), flush=True)
            torch.cuda.empty_cache()


def decode_step(B, T, H, Hkv, D, device="cuda"):
    """The timed decoding step: B rows of one query after a T-key cache. step() runs it eagerly (the window: the
    last w keys); step(query_end) as a static cache's step (the window a w-slot ring)."""
    x, cmp_end, doc_pos = nsa_inputs(B, T, H, Hkv, D, grad=False, device=device)
    w = PARAMS.window_size
    q1 = x["q"][:, -1:].contiguous()
    g1 = x["gates"][:, -1:].contiguous()
    kw, vw = x["k_win"][:, -w:].contiguous(), x["v_win"][:, -w:].contiguous()

    def step(query_end=None):
        return tri.nsa_decode_triton(q1, x["k_cmp"], x["v_cmp"], cmp_end, x["k_slc"], x["v_slc"], kw, vw, g1,
                                     doc_pos, PARAMS, query_end=query_end)

    return step


def bench_decode(H, Hkv, D, contexts, rows, batch=1):
    for T in contexts:
        B = batch
        ours = decode_step(B, T, H, Hkv, D)
        query_end = torch.tensor([T - 1], device="cuda")

        qd = rnd(B, H, 1, D, grad=False)
        kd, vd = rnd(B, Hkv, T, D, grad=False), rnd(B, Hkv, T, D, grad=False)

        def dense():
            return F.scaled_dot_product_attention(qd, kd, vd, enable_gqa=True)

        row = dict(layout=f"decode {H}q/{Hkv}kv d{D}", B=B, T=T, nsa_ms=time_ms(ours, 5, 50), sdpa_ms=time_ms(dense, 5, 50))
        try:
            # graphed as generate() runs it: a static cache's step (the kernels it takes for a CUDA graph)
            row["nsa_graph_ms"] = time_ms(cuda_graph(lambda: ours(query_end)), 5, 50)
            row["sdpa_graph_ms"] = time_ms(cuda_graph(dense), 5, 50)
        except Exception as exc:  # report, keep going
            row["graph_error"] = f"{type(exc).__name__}: {exc}"[:200]
        rows.append(row)
        print(json.dumps(row), flush=True)


def cuda_graph(fn):
    """fn captured in a CUDA graph (after a warm-up on a side stream); returns its replay. Decoding loops
    that matter replay graphs, so this is the per-token GPU time without Python and launch overhead."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def fmt(v, nd=2):
    return "-" if v is None else (f"{v:.{nd}f}" if isinstance(v, float) else str(v))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--lengths", type=int, nargs="*", default=[2048, 8192, 16384, 32768, 65536])
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--decode", type=int, nargs="*", default=[4096, 16384, 65536])
    ap.add_argument("--layouts", nargs="*", default=["12,2,64", "16,1,64"])
    ap.add_argument("--inputs", nargs="*", default=list(QUERY_KINDS), choices=INPUT_KINDS,
                    help="input kinds timed for NSA and fla (dense SDPA does not depend on the values)")
    ap.add_argument("--captured", default=None, help="bench/capture_qkv.py's file, for --inputs captured")
    ap.add_argument("--decode-batch", type=int, nargs="*", default=[1], help="rows per decoding step")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_attention.py needs a CUDA GPU (bench/memory_cpu.py predicts its memory column on CPU).")
    torch.manual_seed(0)
    if "captured" in args.inputs:
        use_captured(args.captured)
    rows, dec = [], []
    for spec in args.layouts:
        H, Hkv, D = (int(s) for s in spec.split(","))
        bench_layout(H, Hkv, D, args.lengths, args.tokens, args.inputs, rows)
    for batch in args.decode_batch if args.decode else []:
        bench_decode(12, 2, 64, args.decode, dec, batch)
    dev = torch.cuda.get_device_name()
    print(f"\n# NSA attention benchmark: {dev}, torch {torch.__version__}, {datetime.date.today()}, "
          f"B*T={args.tokens}, bf16, fla={'yes' if HAS_FLA else 'no'}")
    print("| layout | T | B | inputs | NSA fwd ms | NSA f+b ms | SDPA fwd | SDPA f+b | fla fwd | fla f+b | f+b NSA/SDPA "
          "| f+b NSA/fla | NSA f+b ms per q head | NSA mem MiB | SDPA mem MiB | fla mem MiB |")
    print("|---" * 17 + "|")
    for r in rows:
        ratio_s = r["nsa_fb"] / r["sdpa_fb"]
        ratio_f = r["nsa_fb"] / r["fla_fb"] if "fla_fb" in r else None
        print(f"| {r['layout']} | {r['T']} | {r['B']} | {r['inputs']} | {fmt(r['nsa_fwd'])} | {fmt(r['nsa_fb'])} | "
              f"{fmt(r['sdpa_fwd'])} | {fmt(r['sdpa_fb'])} | {fmt(r.get('fla_fwd'))} | {fmt(r.get('fla_fb'))} | "
              f"{ratio_s:.2f}x | {fmt(ratio_f)}{'x' if ratio_f else ''} | "
              f"{r['nsa_fb'] / r['heads']:.3f} | {r['nsa_mem']:.0f} | {r['sdpa_mem']:.0f} | "
              f"{fmt(r.get('fla_mem'), 0)} |")
    if dec:
        print("\n| decode (B rows) | context | NSA ms/token | SDPA ms/token | ratio | NSA graphed | SDPA graphed | ratio |")
        print("|---|---|---|---|---|---|---|---|")
        for r in dec:
            g_n, g_s = r.get("nsa_graph_ms"), r.get("sdpa_graph_ms")
            g_ratio = f"{g_n / g_s:.2f}x" if g_n and g_s else "-"
            print(f"| {r['layout']} B={r['B']} | {r['T']} | {r['nsa_ms']:.3f} | {r['sdpa_ms']:.3f} | {r['nsa_ms'] / r['sdpa_ms']:.2f}x "
                  f"| {fmt(g_n, 3)} | {fmt(g_s, 3)} | {g_ratio} |")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(dict(device=dev, date=str(datetime.date.today()), tokens=args.tokens,
                                                   rows=rows, decode=dec), indent=1))


if __name__ == "__main__":
    main()
