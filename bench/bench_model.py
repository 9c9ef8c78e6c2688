"""Whole-model training throughput: NSA vs the same model with dense attention vs a HF Llama of the same size.

One training step = forward + backward + fused AdamW at a fixed number of tokens per step (B * T), in two
precisions: "bf16" (bf16 weights, as a pure-bf16 run) and "autocast" (float32 weights under
torch.autocast(bf16): what the trainer's accelerate bf16 configs run). Prints one table
(tokens/s, peak memory, ratios against Llama measured in the same run; a row per precision and length)
and writes JSON with --json.

    python bench/bench_model.py                   # T in 2k, 8k, 32k; 32k tokens per step; both precisions
    python bench/bench_model.py --seq-lens 2048 --tokens-per-step 32768 --precision autocast --json results.json
    python bench/bench_model.py --seq-lens 32768 65536 --gradient-checkpointing   # long contexts, every model alike
    python bench/bench_model.py --models nsa-dense nsa-dense-flex --documents 1 8   # the dense baseline, packed
    python bench/bench_model.py --seq-lens 2048 8192 --precision bf16 --profile   # where each model's step goes
    python bench/bench_model.py --seq-lens 2048 8192 --precision bf16 --compile   # every model torch.compiled

--profile adds, per model and length, one profiled run of 3 steps after the timing: the GPU time per step by kind of
kernel (the NSA op's Triton kernels, dense attention, matmuls, the rest) and the GPU's idle time between kernels,
with the kernels the longest gaps follow. bench/model_traffic_cpu.py counts (on CPU) what NSA adds outside its op;
this says where the rest of the step goes.

--compile runs every model's training step through torch.compile (inductor, the trainer's --compile), so both sides of
each ratio fuse their elementwise work alike; the warm-up steps absorb the compile. NSA adds ~1,150 small ops per
step outside its kernels (bench/model_traffic_cpu.py), which the compiler can fuse and an eager step launches one by one.

--documents N packs N equal documents per row (position_ids restart at 0): the same tokens, attention confined to
each document. "nsa-dense" runs dense mode through SDPA (a boolean document mask when N > 1), "nsa-dense-flex"
through FlexAttention (the documents as a block mask), "nsa-dense-eager" written out.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from modeling_nsa import NSAConfig, NSAForCausalLM  # noqa: E402

SIZE_125M = dict(
    vocab_size=50304, hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
    num_key_value_heads=2, head_dim=64, tie_word_embeddings=True,
)  # fmt: skip


# the same model with dense attention, by the attention function transformers' interface runs (attn_implementation)
DENSE_MODELS = {"nsa-dense": "sdpa", "nsa-dense-flex": "flex_attention", "nsa-dense-eager": "eager"}


def build(name: str, seq_len: int, size: dict = SIZE_125M):
    """"nsa", a DENSE_MODELS name (the same model with dense attention) or "llama" (HF Llama, SDPA) of `size`."""
    if name == "llama":
        config = LlamaConfig(**size, max_position_embeddings=seq_len)
        config._attn_implementation = "sdpa"
        return LlamaForCausalLM(config)
    if name in DENSE_MODELS:
        return NSAForCausalLM(NSAConfig(**size, max_position_embeddings=seq_len, attention_mode="dense",
                                        attn_implementation=DENSE_MODELS[name]))
    if name != "nsa":
        raise ValueError(f"model {name!r}: use nsa, llama or one of {list(DENSE_MODELS)}")
    return NSAForCausalLM(NSAConfig(**size, max_position_embeddings=seq_len, attention_mode="nsa"))


def document_position_ids(batch: int, seq_len: int, documents: int, device) -> torch.Tensor | None:
    """(B, T) positions restarting at 0 every T / documents tokens (packed documents), None for one per row."""
    if documents == 1:
        return None
    if seq_len % documents:
        raise ValueError(f"--documents {documents}: must divide the sequence length {seq_len}")
    return (torch.arange(seq_len, device=device) % (seq_len // documents)).expand(batch, seq_len)


def llama_ratio_pairs(models) -> list[tuple[str, str]]:
    """(model, its Llama baseline) for the ratio columns: a "-static" model (bench_generate: compiled decoding)
    against "llama-static", the others against "llama"; each only where its baseline was run."""
    pairs = [(m, "llama-static" if m.endswith("-static") else "llama") for m in models if not m.startswith("llama")]
    return [(m, base) for m, base in pairs if base in models]


def llama_ratio_header(models, width: int) -> str:
    """The header of the model/baseline ratio columns (none without a Llama baseline among the models)."""
    return "".join(f" {m + '/' + base:>{width}}" for m, base in llama_ratio_pairs(models))


def llama_ratio_cells(row: dict, models, key: str, width: int) -> str:
    """row[model][key] / row[baseline][key] per pair, '-' where either is missing (out of memory)."""
    return "".join(
        f" {row[m][key] / row[base][key]:>{width}.2f}" if row[m] and row[base] else f" {'-':>{width}}"
        for m, base in llama_ratio_pairs(models)
    )


PRECISIONS = ("bf16", "autocast")

# kernel kinds of a profiled step, by name (first match wins): the NSA op's own Triton kernels are named
# _<what>_kernel in modeling_nsa/nsa_triton_*.py; cuBLAS on Hopper names its GEMMs nvjet_* (CUDA 12.8+), sm90_xmma*
# or *gemm*; SDPA's flash / cuDNN / memory-efficient kernels carry those words
KERNEL_KINDS = (
    ("NSA op (Triton)", re.compile(r"^_\w+_kernel$")),
    ("dense attention", re.compile(r"flash|fmha|cudnn|attention|mem_eff", re.IGNORECASE)),
    ("matmuls", re.compile(r"gemm|nvjet|xmma|cutlass|cublas|wgmma", re.IGNORECASE)),
)


def kernel_kind(name: str) -> str:
    return next((kind for kind, pattern in KERNEL_KINDS if pattern.search(name)), "other (elementwise, copies, ...)")


def step_breakdown(events, reps: int) -> dict:
    """From (name, start_us, duration_us) of every kernel of `reps` identical training steps: GPU ms per step by
    kernel kind, the kernels' sum, the GPU's idle ms per step between kernels, and the three kernels the longest
    gaps follow (kernel_floors.idle_gaps)."""
    from kernel_floors import idle_gaps

    kinds: dict[str, float] = {}
    for name, _, duration in events:
        kinds[kernel_kind(name)] = kinds.get(kernel_kind(name), 0.0) + duration / 1e3 / reps
    idle_ms, gaps = idle_gaps(events, reps)
    return {"kinds_ms": kinds, "kernels_ms": sum(kinds.values()), "idle_ms": idle_ms, "largest_gaps": gaps}


def time_training(model, batch: int, seq_len: int, steps: int, warmup: int, precision: str,
                  checkpointing: bool = False, documents: int = 1, profile: bool = False, compiled: bool = False):
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r}: use one of {PRECISIONS}")
    model = (model.to("cuda", torch.bfloat16) if precision == "bf16" else model.to("cuda")).train()
    if checkpointing:  # as the trainer's --gradient-checkpointing (non-reentrant), for NSA, dense mode and Llama
        from train_accelerate import enable_gradient_checkpointing

        enable_gradient_checkpointing(model)
    if compiled:  # as the trainer's --compile, one model per process: dynamo's cache (keyed by the code, not the
        # wrapper) would otherwise compile each later model or length with a dynamic sequence length
        torch._dynamo.reset()
    forward = torch.compile(model) if compiled else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    torch.cuda.reset_peak_memory_stats()
    times = []
    position_ids = document_position_ids(batch, seq_len, documents, "cuda")

    def step():
        ids = torch.randint(0, SIZE_125M["vocab_size"], (batch, seq_len), device="cuda")  # fresh every step
        with torch.autocast("cuda", dtype=torch.bfloat16) if precision == "autocast" else contextlib.nullcontext():
            loss = forward(input_ids=ids, labels=ids, position_ids=position_ids, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    for index in range(warmup + steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        loss = step()
        end.record()
        torch.cuda.synchronize()
        if not torch.isfinite(loss):
            raise RuntimeError(f"non-finite loss {loss.item()}")
        if index >= warmup:
            times.append(start.elapsed_time(end))
    ms = statistics.median(times)
    result = {"ms_per_step": ms, "tokens_per_s": batch * seq_len / ms * 1e3,
              "peak_gib": torch.cuda.max_memory_allocated() / 2**30}
    if profile:  # after the timing (warm), so the profiler's own overhead stays out of the figures above
        from kernel_floors import profile_events

        result["profile"] = step_breakdown(profile_events(step, reps=3), reps=3)
    return result


def print_profiles(rows, models):
    """One line per model and row: step ms, GPU ms by kernel kind, idle ms, the largest gaps."""
    from kernel_floors import describe_gaps

    print("\nProfiled steps (GPU ms per step by kernel kind; idle: GPU idle between kernels)")
    for row in rows:
        for name in models:
            result = row[name]
            if not result or "profile" not in result:
                continue
            profile = result["profile"]
            by_time = sorted(profile["kinds_ms"].items(), key=lambda kv: -kv[1])
            kinds = ", ".join(f"{kind} {ms:.1f}" for kind, ms in by_time)
            print(f"{row['precision']} T={row['seq_len']} B={row['batch']} docs={row['documents']} {name}: step "
                  f"{result['ms_per_step']:.1f} ms; kernels {profile['kernels_ms']:.1f} ms ({kinds}); idle "
                  f"{profile['idle_ms']:.1f} ms, most after {describe_gaps(profile['largest_gaps'])}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[2048, 8192, 32768])
    parser.add_argument("--tokens-per-step", type=int, default=32768)
    parser.add_argument("--models", nargs="+", default=["nsa", "nsa-dense", "llama"])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--precision", nargs="+", default=list(PRECISIONS), choices=PRECISIONS)
    parser.add_argument("--gradient-checkpointing", action="store_true",
                        help="recompute each decoder layer in the backward (every model), for 32k-64k tokens per row")
    parser.add_argument("--documents", type=int, nargs="+", default=[1],
                        help="documents packed per row (position_ids restart at 0); a row of the table each")
    parser.add_argument("--profile", action="store_true",
                        help="also profile 3 steps of each model: GPU ms per step by kernel kind, and the idle time")
    parser.add_argument("--compile", action="store_true",
                        help="torch.compile every model's training step (the trainer's --compile); warm-up absorbs it")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_model.py needs a CUDA GPU.")

    rows = []
    for precision in args.precision:
        for seq_len in args.seq_lens:
            batch = max(1, args.tokens_per_step // seq_len)
            for documents in args.documents:
                results = {}
                for name in args.models:
                    torch.manual_seed(0)
                    try:
                        results[name] = time_training(build(name, seq_len), batch, seq_len, args.steps, args.warmup,
                                                      precision, args.gradient_checkpointing, documents, args.profile,
                                                      args.compile)
                    except torch.OutOfMemoryError:
                        results[name] = None
                    torch.cuda.empty_cache()
                rows.append({"precision": precision, "seq_len": seq_len, "batch": batch, "documents": documents,
                             "gradient_checkpointing": args.gradient_checkpointing, "compile": args.compile,
                             **results})
                print(json.dumps(rows[-1]), flush=True)

    device = torch.cuda.get_device_name()
    print(f"\nTraining step (fwd+bwd+AdamW), 125M (12 q / 2 kv heads, d64), {args.tokens_per_step} tokens/step, {device}"
          + (", gradient checkpointing" if args.gradient_checkpointing else "") + (", torch.compile" if args.compile else ""))
    header = f"{'precision':>9} {'T':>6} {'B':>3} {'docs':>4} " + " ".join(f"{m + ' tok/s':>16} {'GiB':>6}" for m in args.models)
    header += llama_ratio_header(args.models, 14)
    print(header)
    for row in rows:
        line = f"{row['precision']:>9} {row['seq_len']:>6} {row['batch']:>3} {row['documents']:>4} "
        line += " ".join(
            f"{row[m]['tokens_per_s']:>16,.0f} {row[m]['peak_gib']:>6.1f}" if row[m] else f"{'OOM':>16} {'-':>6}"
            for m in args.models
        )
        print(line + llama_ratio_cells(row, args.models, "tokens_per_s", 14))
    if args.profile:
        print_profiles(rows, args.models)
    if args.json:
        args.json.write_text(json.dumps({"device": device, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
