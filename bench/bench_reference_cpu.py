"""CPU training step of a small NSA model: the reference's training form against its written-out form and dense mode.

The CPU path is `nsa_reference.nsa_attention_reference`. Since 2026-11-29 it hands each branch's boolean mask to
F.scaled_dot_product_attention (the fused form); before, it wrote the softmax out as `reference_branches` still does
for the probabilities a diagnosis reads (the written-out form). Since 2026-11-30 the fused form gives the window
branch in chunks of w queries with the 2w - 1 slots each can reach (`_banded_window_output`) and the selected
branch in 8 chunks of queries with the keys up to each chunk's last query (`_causal_chunks_output`). This times
one training step (forward, backward, AdamW) of the same model and batch with each form, the fused form with one
SDPA call per branch over all its keys (as before 2026-11-30), and the model's dense twin
(`attention_mode="dense"`, SDPA), in one process, on the threads given:

    python bench/bench_reference_cpu.py                                    # smoke model, 8 x 1,024 tokens, 1 thread
    python bench/bench_reference_cpu.py --preset tiny --seq-len 512 --threads 2

The model is `train_accelerate.py`'s preset with `--model-overrides` applied as the trainer applies them. Prints
seconds per step and tokens/s per variant and the ratios; --json writes them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import train_accelerate  # noqa: E402  (the presets the trainer builds its models from)
from modeling_nsa import NSAConfig, NSAForCausalLM  # noqa: E402
from modeling_nsa import nsa_reference  # noqa: E402

VOCAB_SIZE = 384  # ByT5's byte vocabulary, what the CPU runs in bench/QUALITY.md train on


def written_out_reference(*args, return_block_indices=False, query_end=None, **kwargs):
    """nsa_attention_reference with the softmax written out (its form before 2026-11-29)."""
    names = ("q", "k_cmp", "v_cmp", "cmp_end", "k_slc", "v_slc", "k_win", "v_win", "gates", "doc_pos", "params")
    bound = dict(zip(names, args), **kwargs)
    gates = bound.pop("gates")
    branches = nsa_reference.reference_branches(**bound, query_end=query_end, probabilities=True)
    out = branches.gated(gates).to(bound["q"].dtype)
    return (out, branches.block_indices) if return_block_indices else out


def time_steps(model, ids, steps: int, warmup: int) -> list[float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    seconds = []
    for step in range(warmup + steps):
        start = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step >= warmup:
            seconds.append(time.perf_counter() - start)
    return seconds


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="smoke", choices=[p for p in train_accelerate.MODEL_PRESETS if p != "125m"])
    parser.add_argument("--model-overrides", default='{"sel_num_blocks": 8}',
                        help="JSON of NSAConfig fields over the preset (default: the 1,024-byte A/B's)")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    fields = dict(train_accelerate.MODEL_PRESETS[args.preset], **json.loads(args.model_overrides))
    ids = torch.randint(0, VOCAB_SIZE, (args.batch, args.seq_len), generator=torch.Generator().manual_seed(0))
    fused = nsa_reference.nsa_attention_reference
    rows = {}
    banded_fraction, query_chunks = nsa_reference.BANDED_WINDOW_MAX_PAIR_FRACTION, nsa_reference.SELECTED_QUERY_CHUNKS
    variants = (  # name, attention mode, the reference function, the fused form's (window threshold, chunks)
        ("nsa, fused", "nsa", fused, (banded_fraction, query_chunks)),
        # one SDPA call per branch over all its keys (before 2026-11-30): a pair fraction of 0 never bands
        ("nsa, fused, one call per branch", "nsa", fused, (0.0, 1)),
        ("nsa, written out", "nsa", written_out_reference, (banded_fraction, query_chunks)),
        ("dense mode", "dense", fused, (banded_fraction, query_chunks)),
    )
    for name, mode, reference, (max_pair_fraction, chunks) in variants:
        config = NSAConfig(vocab_size=VOCAB_SIZE, max_position_embeddings=args.seq_len, attention_mode=mode,
                           nsa_backend="reference", **fields)  # fmt: skip
        torch.manual_seed(0)
        model = NSAForCausalLM(config).train()
        nsa_reference.nsa_attention_reference = reference
        nsa_reference.BANDED_WINDOW_MAX_PAIR_FRACTION, nsa_reference.SELECTED_QUERY_CHUNKS = max_pair_fraction, chunks
        try:  # the backend module bound the function at import: patch the name it calls
            from modeling_nsa import nsa_backend

            nsa_backend.nsa_attention_reference = reference
            seconds = statistics.median(time_steps(model, ids, args.steps, args.warmup))
        finally:
            nsa_reference.nsa_attention_reference = fused
            nsa_backend.nsa_attention_reference = fused
            nsa_reference.BANDED_WINDOW_MAX_PAIR_FRACTION = banded_fraction
            nsa_reference.SELECTED_QUERY_CHUNKS = query_chunks
        rows[name] = {"s_per_step": seconds, "tok_s": args.batch * args.seq_len / seconds}

    base = rows["nsa, fused"]["s_per_step"]
    print(f"{args.preset} model {fields}, {args.batch} x {args.seq_len} tokens, {args.threads} thread(s), "
          f"median of {args.steps} steps")
    print("| variant | s / step | tok/s | time / NSA fused |\n|---|---|---|---|")
    for name, row in rows.items():
        print(f"| {name} | {row['s_per_step']:.3f} | {row['tok_s']:,.0f} | {row['s_per_step'] / base:.2f}x |")
    result = {"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
