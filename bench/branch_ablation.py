"""How much a trained NSA model leans on each branch: its validation loss with one branch's output removed (that
branch's gate set to 0 in every layer), against its loss with all three, on the run's held-out rows; for groups of
seeds, each group's mean and the gaps between groups paired by seed.

    python bench/branch_ablation.py --group three-sets runs/pos_mean/nsa-seed*/ \
        --group one-set runs/pos_mean_sharedkv_*/nsa-seed*/ --out runs/branch_ablation

A MODEL is a run's directory (its final/ is loaded, its seed and data flags read from its run.json) or a saved NSA
model directory (no seed: it is left out of the paired gaps). The held-out rows are the trainer's
(`nsa_train.data.validation_rows` with the run's --dataset, --dataset-config, --text-column, --seq-len,
--val-every-doc, --val-tokens and --cross-doc-attention), built with each model's own tokenizer; the runs of one
call must agree on those flags (the flags given here override run.json, and are required for saved models). Losses
are computed in float32 without autocast, as the trainer evaluates on a CPU: there the "none" column is the run's
last validation loss; a run trained on a GPU under bf16 autocast differs from its logged loss slightly.

Removing a branch changes what the next layer sees in a way training never did, so the rise in loss measures how
much the trained model's output depends on that branch, not what the branch would be worth to a model trained
without it. Gates are removed through the attention seam (`bench/retrieval_anatomy.py`'s `gate_removed`; its
`--ablate` reads retrieval answers instead of the validation loss). Writes `<out>/branch_ablation.md` and
`branch_ablation.json`, and prints the Markdown.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from itertools import combinations
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: nsa_train, modeling_nsa
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/: held_out, retrieval_anatomy, seed_groups

from modeling_nsa.configuration_nsa import BRANCHES  # noqa: E402
from nsa_train.data import make_source, validation_rows  # noqa: E402
from nsa_train.evaluation import OneProcess, validation_loss  # noqa: E402
from nsa_train.long_context import check_output_path, load_model_and_tokenizer, run_command  # noqa: E402
from held_out import TRAINER_DEFAULTS, data_flags, describe_flags, read_model  # noqa: E402
from retrieval_anatomy import gate_removed  # noqa: E402
from seed_groups import check_groups, paired_gap, write_report  # noqa: E402

RISES = ("none", *BRANCHES)  # the "none" column is the loss itself, the others its rise with that branch removed


def ablation_losses(model, rows, micro_batch_size: int = 8) -> dict[str, float]:
    """{"none": the validation loss, and per branch of BRANCHES: the loss with that branch's gate 0 in every layer}
    on `rows` (nsa_train.data.validation_rows)."""
    process = OneProcess(next(model.parameters()).device)
    losses = {"none": validation_loss(model, rows, micro_batch_size, process)["val_loss"]}
    for branch in BRANCHES:
        with gate_removed(model, branch):
            losses[branch] = validation_loss(model, rows, micro_batch_size, process)["val_loss"]
    return losses


def group_summary(runs: list[dict]) -> dict[str, dict]:
    """Per key of RISES (the loss, then each branch's rise over it): mean and sample std (None for one run)."""
    summary = {}
    for key in RISES:
        values = [rise(r, key) for r in runs]
        summary[key] = {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else None}
    return summary


def rise(run: dict, key: str) -> float:
    """The run's loss ("none") or the rise in it with `key`'s branch removed."""
    return run["losses"][key] - (run["losses"]["none"] if key != "none" else 0.0)


def pair_gaps(first: list[dict], second: list[dict]) -> dict[str, dict]:
    """Per key of RISES: second - first over the seeds both groups ran (mean, Student's t 95% half-width)."""
    gaps = {}
    for key in RISES:
        def by_seed(runs):
            return {r["seed"]: rise(r, key) for r in runs if r["seed"] is not None}

        seeds, gap, half = paired_gap(by_seed(first), by_seed(second))
        gaps[key] = {"seeds": seeds, "gap": gap, "half_width": half}
    return gaps


def markdown(groups: dict[str, list[dict]], summaries: dict, pairs: dict, rows: int, seq_len: int) -> str:
    heads = ["validation loss", *(f"{b} removed, rise" for b in BRANCHES)]
    lines = ["# Each branch removed: the rise in validation loss", "",
             f"{rows} held-out rows of {seq_len:,} tokens; a branch removed: its gate 0 in every layer.", "",
             "| group | model | seed | " + " | ".join(heads) + " |", "|---|---|---|" + "---|" * len(heads)]  # fmt: skip
    for name, runs in groups.items():
        for r in runs:
            seed = "" if r["seed"] is None else str(r["seed"])
            lines.append(f"| {name} | {r['model']} | {seed} | {r['losses']['none']:.4f} | "
                         + " | ".join(f"{rise(r, b):+.4f}" for b in BRANCHES) + " |")  # fmt: skip

    def cell(stat, sign=""):
        spec = "{:" + sign + ".4f}"
        return spec.format(stat["mean"]) + (f" ± {stat['std']:.4f}" if stat["std"] is not None else "")

    lines += ["", "Mean ± std over each group's models:", "", "| group | models | " + " | ".join(heads) + " |",
              "|---|---|" + "---|" * len(heads)]  # fmt: skip
    for name, summary in summaries.items():
        lines.append(f"| {name} | {len(groups[name])} | {cell(summary['none'])} | "
                     + " | ".join(cell(summary[b], "+") for b in BRANCHES) + " |")  # fmt: skip
    if pairs:
        lines += ["", "Second - first, paired by seed (95%):", "",
                  "| second - first | paired seeds | " + " | ".join(heads) + " |", "|---|---|" + "---|" * len(heads)]
        for (first, second), gaps in pairs.items():
            cells = [("-" if g["gap"] is None else f"{g['gap']:+.4f}" + (f" ± {g['half_width']:.4f}"
                                                                          if g["half_width"] is not None else ""))
                     for g in (gaps[k] for k in RISES)]  # fmt: skip
            lines.append(f"| {second} - {first} | {len(gaps['none']['seeds'])} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="bench/branch_ablation.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--group", nargs="+", action="append", required=True, metavar=("NAME", "MODEL"),
                   help="a name, then models (a run's directory, or a saved NSA model); give --group once per group")
    p.add_argument("--dataset", default=None, help="default: the runs' --dataset (run.json)")
    p.add_argument("--dataset-config", default=None, help="default: the runs' --dataset-config")
    p.add_argument("--text-column", default=None, help="default: the runs' --text-column (else text)")
    p.add_argument("--seq-len", type=int, default=None, help="default: the runs' --seq-len")
    p.add_argument("--val-every-doc", type=int, default=None, help="default: the runs' (else the trainer's "
                   f"{TRAINER_DEFAULTS['val_every_doc']})")
    p.add_argument("--val-tokens", type=int, default=None, help="default: the runs' (else the trainer's "
                   f"{TRAINER_DEFAULTS['val_tokens']})")
    p.add_argument("--cross-doc-attention", action="store_true", default=None,
                   help="default: the runs' --cross-doc-attention (rows whose positions run across documents)")
    p.add_argument("--tokenizer", default=None, help="default: each model's own (its final/ holds the run's)")
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--device", default=None, help="default: cuda where available, else cpu")
    p.add_argument("--out", type=Path, required=True, help="folder for branch_ablation.md and branch_ablation.json")
    args = p.parse_args(argv)
    check_groups(p, args.group, "models", at_least=1)
    names = [g[0] for g in args.group]
    # everything that can be refused is checked before the first model is evaluated
    check_output_path(args.out, "folder")
    models = {name: [read_model(spec) for spec in specs] for name, *specs in args.group}
    for name, group in models.items():
        seeds = [m["seed"] for m in group if m["seed"] is not None]
        repeated = sorted({s for s in seeds if seeds.count(s) > 1})
        if repeated:
            where = ", ".join(m["spec"] for m in group if m["seed"] in repeated)
            raise ValueError(f"--group {name}: seed {repeated} appears more than once ({where}); a group holds one "
                             "model per seed.")  # fmt: skip
        for m in group:
            config_file = Path(m["path"]) / "config.json"
            config = json.loads(config_file.read_text()) if config_file.is_file() else {}
            if config.get("model_type") != "nsa" or config.get("attention_mode", "nsa") != "nsa":
                raise ValueError(f"{m['spec']}: model_type {config.get('model_type')!r}, attention_mode "
                                 f"{config.get('attention_mode')!r}: only an NSA model (attention_mode 'nsa') has "
                                 "branches to remove; give NSA models only.")  # fmt: skip
    given = {"dataset": args.dataset, "dataset_config": args.dataset_config, "text_column": args.text_column,
             "seq_len": args.seq_len, "val_every_doc": args.val_every_doc, "val_tokens": args.val_tokens,
             "cross_doc_attention": args.cross_doc_attention}  # fmt: skip
    flags = data_flags([m for group in models.values() for m in group], given)
    if flags["seq_len"] <= 1:
        p.error(f"--seq-len {flags['seq_len']}: rows need at least 2 tokens; pass the runs' --seq-len.")
    groups, num_rows = {}, None
    for name, group in models.items():
        runs = []
        for m in group:
            model, tokenizer = load_model_and_tokenizer(m["path"], args.tokenizer, args.device, "float32")
            rows = validation_rows(make_source(flags["dataset"], flags["text_column"], flags["dataset_config"]),
                                   tokenizer, flags["seq_len"], flags["val_every_doc"], flags["val_tokens"],
                                   flags["cross_doc_attention"])  # fmt: skip
            if not rows:
                raise ValueError(f"--dataset {flags['dataset']!r} gave no held-out rows with --val-every-doc "
                                 f"{flags['val_every_doc']} and --val-tokens {flags['val_tokens']}: pass the runs' "
                                 "values (both above 0).")  # fmt: skip
            num_rows = len(rows)
            with torch.no_grad():
                losses = ablation_losses(model.eval(), rows, args.micro_batch_size)
            runs.append({"model": m["spec"], "seed": m["seed"], "losses": losses})
            print(f"{name} {m['spec']}: " + ", ".join(f"{k} {v:.4f}" for k, v in losses.items()), file=sys.stderr,
                  flush=True)  # fmt: skip
        groups[name] = runs
    summaries = {name: group_summary(runs) for name, runs in groups.items()}
    pairs = {(a, b): pair_gaps(groups[a], groups[b]) for a, b in combinations(names, 2)}
    text = markdown(groups, summaries, pairs, num_rows, flags["seq_len"])
    result = {"date": time.strftime("%Y-%m-%d"), "data": flags, "rows": num_rows, "groups": groups,
              "summaries": summaries, "pairs": [{"first": a, "second": b, **g} for (a, b), g in pairs.items()]}  # fmt: skip
    write_report(args.out, "branch_ablation", text, result)
    return result


if __name__ == "__main__":
    run_command(main)
