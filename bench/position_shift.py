"""Is a position's validation loss the position's or its text's? The trainer's loss by query position
(`val_loss_pos<lo>to<hi>`), on the held-out rows as the trainer builds them and on the same rows started later in
the text: a table.

    python bench/position_shift.py runs/pos_mean/nsa-seed0 runs/pos_dense473/dense-seed0 \
        --shifts 0 32 64 96 --out runs/position_shift.json

A MODEL is a run's directory or its final/ (the held-out rows' flags are then read from the run's run.json, as
bench/branch_ablation.py reads them) or a saved model directory (give the run's --dataset and --seq-len, and
the other data flags where the run did not use the trainer's defaults).

Every held-out row starts a fragment of a document at position 0, so positions 0-63 of every row hold the text at
offsets 0-63 of each 1,024-token piece of the held-out documents. With few documents (two in the smoke runs), a
range's loss mostly says how hard that text is. `--shifts s` drops the first s tokens of the first held-out
document (`nsa_train.data.validation_rows(skip_tokens=s)`), so the text at offset p of a row moves to position
p - s (a later document that starts inside a row moves with it; its own start, at position 0, does not): a loss
that moves with the shift is the text's, one that stays is the position's. The gap between two
models (twins that see the same rows) is what the trainer's ranges are for; this says how to read the ranges'
levels.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/: held_out (a run's data flags)

from nsa_train.data import make_source, validation_rows  # noqa: E402
from nsa_train.evaluation import OneProcess, position_losses, validation_loss  # noqa: E402
from nsa_train.long_context import check_output_path, load_model_and_tokenizer, run_command  # noqa: E402
from held_out import TRAINER_DEFAULTS, data_flags, describe_flags, read_model  # noqa: E402


def shifted_losses(model, tokenizer, dataset: str, seq_len: int, val_every: int, val_tokens: int, shifts,
                   micro_batch_size: int = 8, text_column: str = "text", cross_doc: bool = False,
                   dataset_config: str | None = None) -> dict[int, dict[str, float]]:  # fmt: skip
    """{shift: validation_loss's metrics on the held-out rows with the first held-out document's first `shift`
    tokens dropped}."""
    process = OneProcess(next(model.parameters()).device)
    results = {}
    for shift in shifts:
        rows = validation_rows(make_source(dataset, text_column, dataset_config), tokenizer, seq_len, val_every,
                               val_tokens, cross_doc=cross_doc, skip_tokens=shift)  # fmt: skip
        if not rows:
            raise ValueError(f"--dataset {dataset!r} gave no held-out rows with --val-every-doc {val_every} and "
                             f"--val-tokens {val_tokens}: pass the run's values (both above 0).")  # fmt: skip
        results[shift] = validation_loss(model, rows, micro_batch_size, process)
    return results


def shift_table(name: str, results: dict[int, dict[str, float]]) -> str:
    """Markdown: one line per shift, the loss over every position, then by range."""
    ranges = [(lo, hi) for lo, hi, _ in position_losses(results[min(results)])]
    lines = [f"{name}", "", "| shift | every position | " + " | ".join(f"{lo}-{hi - 1}" for lo, hi in ranges) + " |",
             "|---" * (2 + len(ranges)) + "|"]  # fmt: skip
    for shift, metrics in results.items():
        by_range = {(lo, hi): loss for lo, hi, loss in position_losses(metrics)}
        cells = [f"{by_range[r]:.4f}" if r in by_range else "" for r in ranges]
        lines.append(f"| {shift} | {metrics['val_loss']:.4f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("models", nargs="+", metavar="MODEL",
                        help="a run's directory or its final/ (data flags from its run.json), or a saved model directory")
    parser.add_argument("--dataset", default=None, help="default: the run's --dataset (run.json)")
    parser.add_argument("--dataset-config", default=None, help="default: the run's --dataset-config")
    parser.add_argument("--tokenizer", default=None, help="the run's --tokenizer (default: each MODEL's own)")
    parser.add_argument("--text-column", default=None, help="default: the run's (else text)")
    parser.add_argument("--seq-len", type=int, default=None, help="default: the run's --seq-len")
    parser.add_argument("--val-every-doc", type=int, default=None,
                        help=f"default: the run's (else the trainer's {TRAINER_DEFAULTS['val_every_doc']})")
    parser.add_argument("--val-tokens", type=int, default=None,
                        help=f"default: the run's (else the trainer's {TRAINER_DEFAULTS['val_tokens']})")
    parser.add_argument("--cross-doc-attention", "--cross-doc", dest="cross_doc_attention", action="store_true",
                        default=None, help="the run's --cross-doc-attention (positions run across the row; default: "
                                           "the run's)")  # fmt: skip
    parser.add_argument("--shifts", type=int, nargs="+", default=[0, 32, 64, 96],
                        help="tokens dropped from the first held-out document; 0 is the trainer's rows")
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--device", default=None, help="default: cuda where available, else cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "auto"],
                        help="the weights' dtype (default float32, as on CPU the trainer evaluates; on a GPU it "
                             "evaluates fp32 weights under bf16 autocast, so figures there differ slightly)")
    parser.add_argument("--out", type=Path, default=None, help="a JSON file for {model: {shift: metrics}}")
    args = parser.parse_args(argv)
    if any(s < 0 for s in args.shifts):
        raise ValueError(f"--shifts {args.shifts}: a shift is a number of tokens to drop, 0 or more.")
    if len(set(args.models)) != len(args.models):
        raise ValueError(f"MODEL given twice in {args.models}: each model's results are keyed by its path; give each "
                         "once.")  # fmt: skip
    shifts = sorted(set(args.shifts))
    if args.out is not None:
        check_output_path(args.out, "file")
    models = [read_model(spec) for spec in args.models]
    given = {key: getattr(args, key) for key in ("dataset", "dataset_config", "text_column", "seq_len",
                                                 "val_every_doc", "val_tokens", "cross_doc_attention")}  # fmt: skip
    flags = data_flags(models, given)  # the runs must agree: one set of rows for every model
    if flags["seq_len"] <= 1:
        raise ValueError(f"--seq-len {flags['seq_len']}: rows need at least 2 tokens; pass the run's --seq-len.")
    print(f"held-out rows: {describe_flags(flags)}", file=sys.stderr)
    everything = {}
    for spec, m in zip(args.models, models):
        model, tokenizer = load_model_and_tokenizer(m["path"], args.tokenizer, args.device, args.dtype)
        if tokenizer.eos_token_id is None:
            raise ValueError(f"the tokenizer of {spec!r} has no EOS token, which the held-out rows end each document "
                             "with; pass the run's --tokenizer.")  # fmt: skip
        results = shifted_losses(model.eval(), tokenizer, flags["dataset"], flags["seq_len"], flags["val_every_doc"],
                                 flags["val_tokens"], shifts, args.micro_batch_size, flags["text_column"],
                                 flags["cross_doc_attention"], flags["dataset_config"])  # fmt: skip
        print(shift_table(spec, results), end="\n\n")
        everything[spec] = {str(s): m for s, m in results.items()}
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(everything, indent=1) + "\n")
        print(f"wrote {args.out}", file=sys.stderr)
    return everything


if __name__ == "__main__":
    run_command(main)
