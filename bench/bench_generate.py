"""Generation speed with `model.generate()`: NSA vs the same model with dense attention vs a HF Llama of the
same size (125M, bf16, greedy). What a user who generates from a checkpoint sees, host overhead included: the
prompt's prefill and the per-token latency of the cached steps after it, at several prompt lengths, with the
ratios against Llama measured in the same run.

Timed inside generate(): a logits processor notes when each token's logits are ready. Prefill = start to
the first token; per-token = first to last token over N - 1 steps; medians of --repeats runs. NSA's steps run the three Triton decode kernels per layer on
a GPU; the cache is sized once for generate()'s max_length (no step copies it).

"-static" models generate with cache_implementation="static": fixed-size caches, and generate() compiles the
decoding forward (transformers' default compile_config: inductor with CUDA graphs), so the steps pay no
per-op host dispatch. The compilation happens in the warm-up run (same prompt and length: the cache's size
is part of the compiled shapes) and is reported as compile_s, not timed in the steps.

    python bench/bench_generate.py                               # prompts 4k, 16k, 64k; B = 1; 64 new tokens
    python bench/bench_generate.py --prompt-lens 8192 --batch 8 --json gen.json
    python bench/bench_generate.py --device cpu --size tiny --prompt-lens 512 --new-tokens 8   # a CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_model import DENSE_MODELS, SIZE_125M, build, llama_ratio_cells, llama_ratio_header  # noqa: E402
from transformers import LogitsProcessor, LogitsProcessorList  # noqa: E402

SIZES = {
    "125m": SIZE_125M,
    # a CPU smoke run of the script itself (the reference path), not a measurement
    "tiny": dict(vocab_size=512, hidden_size=96, intermediate_size=128, num_hidden_layers=2, num_attention_heads=6,
                 num_key_value_heads=2, head_dim=16, tie_word_embeddings=True),
}  # fmt: skip


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


class StepClock(LogitsProcessor):
    """Records the time each generated token's logits are ready (generate() calls it once per token; it
    waits for the GPU, as generate() itself does every step for its stopping check)."""

    def __init__(self):
        self.times = []

    def __call__(self, input_ids, scores):
        _sync(scores.device)
        self.times.append(time.perf_counter())
        return scores


def measure(model, batch: int, prompt_len: int, new_tokens: int, repeats: int, device, static=False) -> dict:
    """Median over repeats of the prefill (generate() start to the first token's logits) and of the time per
    cached step (first to last token's logits over new_tokens - 1 steps)."""
    prompt = torch.randint(1, model.config.vocab_size, (batch, prompt_len), device=device)
    kwargs = dict(attention_mask=torch.ones_like(prompt), do_sample=False, pad_token_id=0)
    if static:
        kwargs["cache_implementation"] = "static"
        torch._dynamo.reset()
    start = time.perf_counter()
    warm_tokens = new_tokens if static else 2  # a static cache's size is part of what is compiled
    model.generate(prompt, max_new_tokens=warm_tokens, min_new_tokens=warm_tokens, **kwargs)  # warm-up: compilation
    compile_s = time.perf_counter() - start
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    prefill, per_token = [], []
    for _ in range(repeats):
        clock = StepClock()
        _sync(device)
        start = time.perf_counter()
        out = model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             logits_processor=LogitsProcessorList([clock]), **kwargs)
        assert out.shape[1] == prompt_len + new_tokens and len(clock.times) == new_tokens
        prefill.append(clock.times[0] - start)
        per_token.append((clock.times[-1] - clock.times[0]) / (new_tokens - 1))
    ms = statistics.median(per_token) * 1e3
    row = {"prefill_ms": statistics.median(prefill) * 1e3, "ms_per_token": ms, "tokens_per_s": batch / ms * 1e3,
           "compile_s": compile_s}
    if device.type == "cuda":
        row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=[4096, 16384, 65536])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--new-tokens", type=int, default=64, help="at least 2")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--models", nargs="+", default=["nsa", "nsa-static", "nsa-dense", "llama", "llama-static"],
                        help="nsa, nsa-dense (-flex, -eager), llama; a -static suffix: cache_implementation='static' (compiled steps)")
    parser.add_argument("--size", choices=list(SIZES), default="125m")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    known = ("nsa", *DENSE_MODELS, "llama")  # what bench_model.build makes
    unknown = [m for m in args.models if m.removesuffix("-static") not in known]
    if unknown:
        parser.error(f"--models {' '.join(unknown)}: each is one of {', '.join(known)}, optionally with -static.")
    if args.new_tokens < 2:  # the per-token latency is measured between the first and the last token
        parser.error(f"--new-tokens {args.new_tokens}: give at least 2.")
    if min(args.prompt_lens) < 1 or args.batch < 1 or args.repeats < 1:
        parser.error(f"--prompt-lens {args.prompt_lens}, --batch {args.batch}, --repeats {args.repeats}: each at least 1.")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_generate.py needs a CUDA GPU (or, a smoke run: --device cpu --size tiny --prompt-lens 512 --new-tokens 8).")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    rows = []
    for prompt_len in args.prompt_lens:
        row = {"prompt_len": prompt_len, "batch": args.batch}
        for name in args.models:
            torch.manual_seed(0)
            static = name.endswith("-static")
            model = build(name.removesuffix("-static"), prompt_len + args.new_tokens + 8, SIZES[args.size])
            model = model.to(device, dtype).eval()
            try:
                with torch.no_grad():
                    row[name] = measure(model, args.batch, prompt_len, args.new_tokens, args.repeats, device, static)
            except torch.OutOfMemoryError:
                row[name] = None
            del model
            if device.type == "cuda":
                torch.cuda.empty_cache()
        rows.append(row)
        print(json.dumps(row), flush=True)

    where = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"\ngenerate(): {args.size}, B = {args.batch}, {args.new_tokens} new tokens (greedy), {dtype}, {where}")
    print(f"{'prompt':>7} " + " ".join(f"{m + ' ms/token':>18} {'prefill ms':>10}" for m in args.models)
          + llama_ratio_header(args.models, 24))
    for row in rows:
        line = f"{row['prompt_len']:>7} " + " ".join(
            f"{row[m]['ms_per_token']:>18.3f} {row[m]['prefill_ms']:>10.1f}" if row[m] else f"{'OOM':>18} {'-':>10}"
            for m in args.models
        )
        print(line + llama_ratio_cells(row, args.models, "ms_per_token", 24))
    if args.json:
        args.json.write_text(json.dumps({"device": where, "size": args.size, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
