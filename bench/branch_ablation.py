"""How much a trained NSA model leans on each branch: its validation loss with one branch's output removed (that
branch's gate set to 0 in every layer), against its loss with all three, on the held-out rows as the trainer builds
them; for groups of seeds, each group's mean and the gaps between groups paired by seed.

    python bench/branch_ablation.py --dataset runs/data/linux-docs-en.parquet --seq-len 1024 --val-every-doc 20 \
        --val-tokens 65536 --group three-sets runs/pos_mean/nsa-seed* --group one-set runs/pos_mean_sharedkv_*/nsa-seed* \
        --out runs/branch_ablation

A MODEL is a run's directory (its final/ is loaded; its seed is read from its run.json) or a saved NSA model
directory (then it has no seed and is left out of the paired gaps). Removing a branch changes what the next layer
sees in a way training never did, so the rise in loss measures how much the trained model's output depends on that
branch, not what the branch would be worth to a model trained without it. Gates are removed through the attention
seam (`bench/retrieval_anatomy.py`'s `--ablate`, which reads retrieval answers instead of the validation loss).
Writes `<out>/branch_ablation.md` and `branch_ablation.json`, and prints the Markdown.
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
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/: retrieval_anatomy, seed_groups

from modeling_nsa.configuration_nsa import BRANCHES  # noqa: E402
from nsa_train.data import make_source, validation_rows  # noqa: E402
from nsa_train.evaluation import OneProcess, validation_loss  # noqa: E402
from nsa_train.long_context import load_model_and_tokenizer, run_command  # noqa: E402
from retrieval_anatomy import _recording  # noqa: E402  (the seam that zeroes a branch's gate)
from seed_groups import paired_gap  # noqa: E402


def ablation_losses(model, rows, micro_batch_size: int = 8) -> dict[str, float]:
    """{"none": the validation loss, and per branch of BRANCHES: the loss with that branch's gate 0 in every layer}
    on `rows` (nsa_train.data.validation_rows)."""
    if getattr(model.config, "attention_mode", None) != "nsa":
        raise ValueError(f"attention_mode {getattr(model.config, 'attention_mode', None)!r}: a model without NSA's "
                         "branches has none to remove; give NSA models only.")  # fmt: skip
    process = OneProcess(next(model.parameters()).device)
    losses = {"none": validation_loss(model, rows, micro_batch_size, process)["val_loss"]}
    for branch in BRANCHES:
        with _recording(model, "nsa", {}, ablate=branch):
            losses[branch] = validation_loss(model, rows, micro_batch_size, process)["val_loss"]
    return losses


def model_and_seed(spec: str) -> tuple[str, int | None]:
    """A run's directory -> (its final/, the seed in its run.json); any other path -> (itself, None)."""
    run = Path(spec)
    record = run / "run.json"
    if record.is_file() and (run / "final").is_dir():
        seed = json.loads(record.read_text()).get("config", {}).get("seed")
        return str(run / "final"), seed if isinstance(seed, int) else None
    return spec, None


def group_summary(runs: list[dict]) -> dict[str, dict]:
    """Per key ("none", then each branch's rise over "none"): mean and sample std (None for one run) over runs."""
    summary = {}
    for key in ("none", *BRANCHES):
        values = [r["losses"][key] - (r["losses"]["none"] if key != "none" else 0.0) for r in runs]
        summary[key] = {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else None}
    return summary


def pair_gaps(first: list[dict], second: list[dict]) -> dict[str, dict]:
    """Per key as group_summary's: second - first over the seeds both groups ran (mean, Student's t 95% half-width)."""
    gaps = {}
    for key in ("none", *BRANCHES):
        def by_seed(runs):
            return {r["seed"]: r["losses"][key] - (r["losses"]["none"] if key != "none" else 0.0)
                    for r in runs if r["seed"] is not None}  # fmt: skip

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
            rises = [f"{r['losses'][b] - r['losses']['none']:+.4f}" for b in BRANCHES]
            seed = "" if r["seed"] is None else str(r["seed"])
            lines.append(f"| {name} | {r['model']} | {seed} | {r['losses']['none']:.4f} | " + " | ".join(rises) + " |")

    def cell(stat, sign=""):
        spec = "{:" + sign + ".4f}"
        return spec.format(stat["mean"]) + (f" ± {stat['std']:.4f}" if stat["std"] is not None else "")

    lines += ["", "Mean ± std over each group's models:", "", "| group | models | " + " | ".join(heads) + " |",
              "|---|---|" + "---|" * len(heads)]  # fmt: skip
    for name, summary in summaries.items():
        lines.append(f"| {name} | {len(groups[name])} | {cell(summary['none'])} | "
                     + " | ".join(cell(summary[b], "+") for b in BRANCHES) + " |")  # fmt: skip
    if pairs:
        lines += ["", "Second - first, paired by seed (95%):", "", "| second - first | paired seeds | " + " | ".join(heads) + " |",
                  "|---|---|" + "---|" * len(heads)]  # fmt: skip
        for (first, second), gaps in pairs.items():
            cells = [("-" if g["gap"] is None else f"{g['gap']:+.4f}" + (f" ± {g['half_width']:.4f}"
                                                                          if g["half_width"] is not None else ""))
                     for g in (gaps[k] for k in ("none", *BRANCHES))]  # fmt: skip
            lines.append(f"| {second} - {first} | {len(gaps['none']['seeds'])} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="bench/branch_ablation.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--group", nargs="+", action="append", required=True, metavar=("NAME", "MODEL"),
                   help="a name, then models (a run's directory, or a saved NSA model); give --group once per group")
    p.add_argument("--dataset", required=True, help="the runs' --dataset (a local file or folder)")
    p.add_argument("--tokenizer", default=None, help="the runs' --tokenizer (default: each model's own)")
    p.add_argument("--text-column", default="text")
    p.add_argument("--seq-len", type=int, required=True, help="the runs' --seq-len")
    p.add_argument("--val-every-doc", type=int, default=100, help="the runs' --val-every-doc (trainer default 100)")
    p.add_argument("--val-tokens", type=int, default=65536, help="the runs' --val-tokens (trainer default 65536)")
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--device", default=None, help="default: cuda where available, else cpu")
    p.add_argument("--out", type=Path, required=True, help="folder for branch_ablation.md and branch_ablation.json")
    args = p.parse_args(argv)
    short = [g[0] for g in args.group if len(g) < 2]
    if short:
        p.error(f"--group {short[0]}: give the group's models after its name.")
    names = [g[0] for g in args.group]
    if len(set(names)) != len(names):
        p.error(f"--group names repeat: {names}; give each group its own name.")
    if args.seq_len <= 1:
        p.error(f"--seq-len {args.seq_len}: rows need at least 2 tokens; pass the runs' --seq-len.")
    groups, rows = {}, None
    for name, *specs in args.group:
        runs = []
        for spec in specs:
            path, seed = model_and_seed(spec)
            model, tokenizer = load_model_and_tokenizer(path, args.tokenizer, args.device, "float32")
            if rows is None:  # every model is evaluated on the same rows (one tokenizer across the groups)
                rows = validation_rows(make_source(args.dataset, args.text_column), tokenizer, args.seq_len,
                                       args.val_every_doc, args.val_tokens)  # fmt: skip
                if not rows:
                    raise ValueError(f"--dataset {args.dataset!r} gave no held-out rows with --val-every-doc "
                                     f"{args.val_every_doc} and --val-tokens {args.val_tokens}: pass the runs' values "
                                     "(both above 0).")  # fmt: skip
            with torch.no_grad():
                losses = ablation_losses(model.eval(), rows, args.micro_batch_size)
            runs.append({"model": spec, "seed": seed, "losses": losses})
            print(f"{name} {spec}: " + ", ".join(f"{k} {v:.4f}" for k, v in losses.items()), file=sys.stderr, flush=True)
        seeds = [r["seed"] for r in runs if r["seed"] is not None]
        if len(set(seeds)) != len(seeds):
            raise ValueError(f"--group {name}: a seed appears twice ({sorted(seeds)}); a group holds one model per seed.")
        groups[name] = runs
    summaries = {name: group_summary(runs) for name, runs in groups.items()}
    pairs = {(a, b): pair_gaps(groups[a], groups[b]) for a, b in combinations(names, 2)}
    text = markdown(groups, summaries, pairs, len(rows), args.seq_len)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "branch_ablation.md").write_text(text)
    result = {"date": time.strftime("%Y-%m-%d"), "dataset": args.dataset, "seq_len": args.seq_len, "rows": len(rows),
              "val_every_doc": args.val_every_doc, "val_tokens": args.val_tokens, "groups": groups,
              "summaries": summaries, "pairs": [{"first": a, "second": b, **g} for (a, b), g in pairs.items()]}  # fmt: skip
    (args.out / "branch_ablation.json").write_text(json.dumps(result, indent=2))
    print(text)
    return result


if __name__ == "__main__":
    run_command(main)
