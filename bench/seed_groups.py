"""Groups of seeds compared: how many learned a retrieval task, and their validation loss, with the tests behind
the claims in bench/QUALITY.md (Fisher's exact test on the counts, the loss gap paired by seed).

    python bench/seed_groups.py --out runs/groups \\
        --group dense "bench/results/2026-11-*-cpu-retrieval-varied-rows*:dense" \\
        --group nsa-mlp "bench/results/2026-11-*-cpu-retrieval-varied-rows*:nsa" \\
        --group nsa-mean bench/results/2026-11-29-cpu-retrieval-mean-compressor bench/results/2026-11-29-cpu-retrieval-mean-compressor/seeds34 \\
            "bench/results/2026-11-30-cpu-retrieval-mean-compressor-seeds*"

`bench/ab_compare.py` compares NSA with its dense twin; this compares any named groups of finished runs, e.g. NSA
with two compressors and dense, each over its own seeds. A SOURCE is a folder holding an `ab_compare.json` (an
`ab_compare.py --out`, or its copy under `bench/results/`); `SOURCE:MODE` keeps its runs of that attention mode
only; a pattern is expanded (quote it). Per run it reads the seed and the last validation loss from `ab_compare.json`, and the passkey (or needle)
evaluation from `<SOURCE>/<run>/long_context/<task>_<scoring>.json` (the trainer's `--eval-long-context`) or, in a
results copy, `<SOURCE>/<run>-<task>.json`. `--task none` compares the validation loss alone (runs trained
without a retrieval evaluation, e.g. language-model A/Bs).

A run "learned" the task where its accuracy (mean over depths) at `--learned-length` is at least
`--learned-accuracy` (defaults: the shortest length evaluated, 0.98: the README's rule); a run that did not
evaluate that length is left out of the counts (said in the table). Runs evaluated with other settings (task,
scoring, lengths, depths, samples per cell, case seed, haystack) are named with them, on stderr and atop the report
("Read with care"): their accuracies are pooled as one measurement. For every two groups:
- the counts, with Fisher's exact test, two-sided (the probability, with the margins fixed, of a table at most as
  likely as the one observed);
- the accuracy at that length, second minus first, paired by the seeds both evaluated (mean and Student's t 95%
  half-width): where few runs of either group reach the threshold, the counts say little and this says how far
  apart the groups are;
- where some run's greedy answers at that length failed at their last token alone, the shares of cases right in
  every answer token but perhaps the last (right answers included) and of answers that ended inside themselves
  (the right start, then end-of-text),
  each second minus first, paired (`nsa_train.long_context.ending_summary`): a model can learn to end its text
  where its training rows ended, and a case one token longer than a row puts the answer's last token there;
- validation loss, second minus first, paired by the seeds both ran (mean and Student's t 95% half-width), and
  unpaired (Welch's t); where every run recorded it (ab_compare's `val_by_position`, from the trainer's
  `val_loss_pos<lo>to<hi>`), also each group's loss by the query's position and the paired gap per range;
- where every run of a group recorded them (ab_compare's `selection`, from the trainer's `stats.jsonl`), each
  layer's gates and selection at the last evaluation (mean ± std over seeds) and their gaps, paired by seed.
Runs of one seed share their data order; whether they share initial weights depends on the pair: ab_compare's
dense twin takes its NSA twin's weights, and compressors "mlp" and "mean_mlp" draw the same weights (but φ's zeroed
output layer), whereas "mean" draws none for φ, which shifts every later draw.
Writes `<out>/seed_groups.md` and `seed_groups.json`, and prints the Markdown.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import statistics
import sys
import time
from itertools import combinations
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: nsa_train
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/: ab_compare

from ab_compare import (EVALUATION_SETTINGS, MODES, SELECTION_COLUMNS, read_evaluation, selection_cell,  # noqa: E402
                        selection_layers, selection_summary, t95)  # (one reader of evaluations, one t table, one selection table for both tools)
from nsa_train.long_context import run_command, tells_more_than_accuracy  # noqa: E402


def fisher_exact_two_sided(a: int, b: int, c: int, d: int) -> float:
    """p of the 2x2 table [[a, b], [c, d]] (rows: groups; columns: learned, not): the sum of the hypergeometric
    probabilities of every table with the same margins that is at most as likely as this one."""
    row1, col1, total = a + b, a + c, a + b + c + d

    def probability(x):  # x in the top-left cell
        return math.comb(col1, x) * math.comb(total - col1, row1 - x) / math.comb(total, row1)

    observed = probability(a)
    cells = range(max(0, row1 + col1 - total), min(row1, col1) + 1)
    # (the relative slack keeps tables exactly as likely as the observed one from being lost to rounding)
    return min(1.0, sum(p for p in map(probability, cells) if p <= observed * (1 + 1e-9)))


# ----------------------------------------------------------------------------- reading runs


def parse_source(spec: str) -> tuple[list[Path], str | None]:
    """'FOLDER[:MODE]' -> the folders it names (a glob pattern is expanded) and the mode kept (None: every run).
    A folder that exists under the whole spec is taken as it is, colons and brackets included."""
    mode = None
    if not Path(spec).is_dir() and ":" in spec:
        head, tail = spec.rsplit(":", 1)
        if tail not in MODES:
            raise ValueError(f"--group source {spec!r}: no such folder, and after ':' give an attention mode, "
                             f"{' or '.join(MODES)}.")
        spec, mode = head, tail
    if Path(spec).is_dir() or not glob.has_magic(spec):
        folders = [Path(spec)]
    else:
        folders = sorted(f for f in map(Path, glob.glob(spec)) if (f / "ab_compare.json").is_file())
        if not folders:
            raise ValueError(f"--group source {spec!r}: no folder holding an ab_compare.json matches it (a path "
                             "with [ or ] in its name: pass the folder itself, or glob.escape it).")
    for folder in folders:
        if not (folder / "ab_compare.json").is_file():
            raise ValueError(f"--group source {folder}: no ab_compare.json there; give the --out folder of "
                             "bench/ab_compare.py (or its copy under bench/results/).")
    return folders, mode


def _evaluation_file(folder: Path, run: dict, task: str, scoring: str) -> Path | None:
    """The run's evaluation file: in the comparison's folder (its training, or a results copy `<run>-<task>.json`),
    else in the run's own directory (a comparison made with ab_compare --runs of runs trained elsewhere)."""
    name, where = run["name"], [folder / run["name"]] + ([Path(run["dir"])] if run.get("dir") else [])
    for path in [d / "long_context" / f"{task}_{scoring}.json" for d in where] + [folder / f"{name}-{task}.json"]:
        if path.is_file():
            return path
    return None


def _by_length(evaluation: dict, key: str) -> dict[int, float] | None:
    """One per-length figure of an evaluation as ab_compare.read_evaluation reads it (None where it has none)."""
    values = evaluation.get(key)
    return None if values is None else {int(n): float(v) for n, v in zip(evaluation["lengths"], values)}


def _recorded_evaluation(run: dict, task: str, scoring: str) -> dict | None:
    """The evaluation summary (per length, mean over depths) that ab_compare recorded in its JSON for the run, where
    no evaluation file is found (the run's directory moved or deleted since)."""
    for record in run.get("long_context") or ():
        if record.get("task") == task and record.get("scoring", scoring) == scoring:
            return record
    return None


def read_group(name: str, specs: list[str], task: str, scoring: str) -> list[dict]:
    """The runs of one group: seed, mode, folder, final validation loss and tokens, and the retrieval accuracy per
    case length (mean over depths; None where the run has no evaluation of `task`) with the settings it was
    evaluated with (ab_compare.EVALUATION_SETTINGS, each None where the file or record does not hold it; compared
    across the runs by evaluation_differences)."""
    runs, seen = [], set()
    for spec in specs:
        folders, mode = parse_source(spec)
        for folder in folders:
            if (folder.resolve(), mode) in seen:  # named twice (a folder and a pattern that matches it): once
                continue
            seen.add((folder.resolve(), mode))
            record = json.loads((folder / "ab_compare.json").read_text())
            for run in record.get("runs", []):
                if mode is not None and run.get("mode") != mode:
                    continue
                if not isinstance(run.get("seed"), int) or not run.get("name") or not run.get("val"):
                    raise ValueError(f"{folder}/ab_compare.json: run {run.get('name')!r} lacks its name, integer "
                                     "seed or validation losses; write the file again with bench/ab_compare.py "
                                     "--runs <its runs>.")  # fmt: skip
                path = _evaluation_file(folder, run, task, scoring) if task is not None else None
                evaluation = _recorded_evaluation(run, task, scoring) if task is not None and path is None else None
                if path is not None:
                    result = read_evaluation(path)
                    if result is None:
                        raise ValueError(f"{path}: not an evaluation as nsa_train.long_context writes it (no lengths "
                                         "or accuracy); run the evaluation again or remove the file.")
                    if result["task"] == task and (result["scoring"] or scoring) == scoring:
                        evaluation = result
                tokens, loss = run["val"][-1]
                reported = run.get("val_by_position")  # (ab_compare.by_position; None in older files)
                by_position = reported["ranges"] if reported and reported.get("tokens") == tokens else None
                # (a record ab_compare wrote before it kept the settings holds the task, scoring and lengths alone)
                settings = (evaluation.get("settings") or {key: evaluation.get(key) for key in EVALUATION_SETTINGS}
                            if evaluation else None)  # fmt: skip
                runs.append({"group": name, "source": str(folder), "name": run["name"], "mode": run.get("mode"),
                             "seed": run.get("seed"), "tokens": tokens, "val_loss": loss, "by_position": by_position,
                             "evaluation_settings": settings,
                             "accuracy": _by_length(evaluation, "accuracy") if evaluation else None,
                             "ended": _by_length(evaluation, "ended") if evaluation else None,
                             "right_but_last": _by_length(evaluation, "right_but_last") if evaluation else None,
                             "selection": run.get("selection")})  # fmt: skip
    if not runs:
        raise ValueError(f"--group {name}: its sources ({' '.join(specs)}) hold no runs of the mode asked for.")
    seeds = [r["seed"] for r in runs]
    repeated = sorted({s for s in seeds if seeds.count(s) > 1})
    if repeated:
        where = "; ".join(f"seed {s}: " + ", ".join(f"{r['source']}/{r['name']}" for r in runs if r["seed"] == s)
                          for s in repeated)
        raise ValueError(f"--group {name}: more than one run of a seed ({where}); a group holds one run per seed "
                         "(name the sources so that each seed appears once, e.g. with ':nsa' or ':dense').")
    return sorted(runs, key=lambda r: r["seed"])


def evaluation_differences(groups: dict[str, list[dict]]) -> str | None:
    """What the runs' retrieval evaluations differ in (ab_compare.EVALUATION_SETTINGS: task, scoring, lengths,
    depths, samples per cell, seed, haystack), each value with the runs evaluated so; None where they agree. The
    learned counts, Fisher's test and the paired accuracy pool the runs' accuracies as one measurement: other depths
    or another case seed are other cases, and fewer samples a coarser accuracy. A setting a file or record does not
    hold (written before it was recorded) is not compared."""
    evaluated = [r for runs in groups.values() for r in runs if r.get("evaluation_settings")]
    differ = []
    for key in EVALUATION_SETTINGS:
        by_value: dict[str, list[dict]] = {}
        for run in evaluated:
            value = run["evaluation_settings"].get(key)
            if value is not None:
                by_value.setdefault(json.dumps(value), []).append(run)
        if len(by_value) > 1:
            differ.append(f"{key} " + ", ".join(f"{value} ({_run_names(runs)})" for value, runs in by_value.items()))
    return "; ".join(differ) or None


def _run_names(runs: list[dict]) -> str:
    """'dense seeds 0, 1; nsa seed 2': the runs by group (a group holds one run per seed)."""
    names = []
    for group in dict.fromkeys(r["group"] for r in runs):
        seeds = [str(r["seed"]) for r in runs if r["group"] == group]
        names.append(f"{group} seed{'s' if len(seeds) > 1 else ''} {', '.join(seeds)}")
    return "; ".join(names)


# ----------------------------------------------------------------------------- comparing


def learned(run: dict, length: int, threshold: float) -> bool | None:
    if run["accuracy"] is None or length not in run["accuracy"]:
        return None
    return run["accuracy"][length] >= threshold


def summarize(groups: dict[str, list[dict]], length: int, threshold: float) -> dict:
    summary = {}
    for name, runs in groups.items():
        flags = [learned(r, length, threshold) for r in runs]
        losses = [r["val_loss"] for r in runs]
        summary[name] = {
            "seeds": [r["seed"] for r in runs], "evaluated": sum(f is not None for f in flags),
            "learned": sum(bool(f) for f in flags),
            "val_loss_mean": statistics.fmean(losses), "val_loss_std": statistics.stdev(losses) if len(losses) > 1 else None,
        }  # fmt: skip
    return summary


def paired_gap(first: dict[int, float], second: dict[int, float]) -> tuple[list[int], float | None, float | None]:
    """Second - first over the seeds both have: (those seeds, mean gap, Student's t 95% half-width)."""
    shared = sorted(set(first) & set(second))
    gaps = [second[s] - first[s] for s in shared]
    mean = statistics.fmean(gaps) if gaps else None
    half = t95(len(gaps) - 1) * statistics.stdev(gaps) / math.sqrt(len(gaps)) if len(gaps) > 1 else None
    return shared, mean, half


def position_ranges(runs: list[dict]) -> list[tuple[int, int]]:
    """The ranges of query positions whose validation loss every one of `runs` reported at its last evaluation (in
    position order); none where one of them did not (trained before the trainer reported it)."""
    if not runs or any(r.get("by_position") is None for r in runs):
        return []
    return sorted(set.intersection(*({(lo, hi) for lo, hi, _ in r["by_position"]} for r in runs)))


def position_loss(run: dict, lo: int, hi: int) -> float:
    """The run's validation loss over query positions lo..hi-1 (its `by_position`: [[lo, hi, loss], ...])."""
    return next(x for a, b, x in run["by_position"] if (a, b) == (lo, hi))


def compare_pair(first: list[dict], second: list[dict], length: int | None, threshold: float) -> dict:
    """Second group against the first: counts and Fisher's p over the runs each evaluated; the accuracy at the
    learned length (second - first, paired by the seeds both evaluated: where few runs of either group reach the
    threshold, the counts say little and this says how far apart they are); the validation-loss gap (second -
    first), paired by shared seeds and unpaired."""
    counts = []
    for runs in (first, second):
        flags = [f for f in (learned(r, length, threshold) for r in runs) if f is not None]
        counts.append((sum(flags), len(flags) - sum(flags)))
    out = {"learned": [c[0] for c in counts], "evaluated": [sum(c) for c in counts]}
    out["fisher_p"] = fisher_exact_two_sided(*counts[0], *counts[1]) if all(sum(c) for c in counts) else None
    accuracy = [{r["seed"]: r["accuracy"][length] for r in runs if r["accuracy"] and length in r["accuracy"]}
                for runs in (first, second)]
    out["accuracy_seeds"], out["accuracy_gap"], out["accuracy_half_width"] = paired_gap(*accuracy)
    # a greedy answer that stopped after its right start, or that was wrong at its last token alone, is scored
    # wrong; where the case's last answer token sits where the training rows ended, that is the ending a model
    # learned from its rows, not the lookup (long_context.ending_summary); right_but_last includes right answers
    for key in ("ended", "right_but_last"):
        shares = [{r["seed"]: r[key][length] for r in runs if r.get(key) and length in r[key]} for runs in (first, second)]
        out[f"{key}_seeds"], out[f"{key}_gap"], out[f"{key}_half_width"] = paired_gap(*shares)
    losses = [{r["seed"]: r["val_loss"] for r in runs} for runs in (first, second)]
    out["paired_seeds"], out["paired_gap"], out["paired_half_width"] = paired_gap(*losses)
    # the loss by query position (the trainer's val_loss_pos<lo>to<hi>), per range every run of both reported
    # and beyond the window, that gap less the window's, seed by seed (each seed's lead everywhere cancels)
    out["by_position"] = []
    ranges = position_ranges(first + second)
    for lo, hi in ranges:
        seeds, gap, half = paired_gap(*({r["seed"]: position_loss(r, lo, hi) for r in runs} for runs in (first, second)))
        row = {"positions": [lo, hi], "seeds": seeds, "gap": gap, "half_width": half}
        if (lo, hi) != ranges[0]:  # (the first range is NSA's window)
            _, row["beyond_window_gap"], row["beyond_window_half_width"] = paired_gap(
                *({r["seed"]: position_loss(r, lo, hi) - position_loss(r, *ranges[0]) for r in runs}
                  for runs in (first, second)))  # fmt: skip
        out["by_position"].append(row)
    a, b = ([r["val_loss"] for r in runs] for runs in (first, second))
    out["unpaired_gap"] = statistics.fmean(b) - statistics.fmean(a)
    if len(a) > 1 and len(b) > 1:
        se = math.sqrt(statistics.variance(a) / len(a) + statistics.variance(b) / len(b))
        out["welch_t"] = out["unpaired_gap"] / se if se > 0 else None
    else:
        out["welch_t"] = None
    return out


def _fmt(x, spec="{:+.4f}"):
    return "-" if x is None else spec.format(x)


def share_gap(gap: float | None, half: float | None, seeds: list[int]) -> str:
    """'+25% ± 30% (4 seeds)': a paired gap between two shares and its 95% half-width; where the interval runs past
    the ±100% a difference of shares can take (few seeds), it says so rather than let the figure pass as a bound."""
    if gap is None:
        return "-"
    text = f"{gap:+.0%} ± {_fmt(half, '{:.0%}')} ({len(seeds)} seeds"
    if half is not None and (gap - half < -1 or gap + half > 1):
        text += "; the interval runs past ±100%: more seeds narrow it"
    return text + ")"


def markdown(groups: dict[str, list[dict]], summary: dict, pairs: dict, length: int | None, threshold: float,
             task: str | None) -> str:
    """The tables; task None: validation loss only (no retrieval columns)."""
    names = list(groups)
    lengths = sorted({n for runs in groups.values() for r in runs if r["accuracy"] for n in r["accuracy"]})
    seeds = sorted({r["seed"] for runs in groups.values() for r in runs})
    if task is None:
        lines = ["# Seed groups: validation loss", "", "Per seed: the validation loss at the run's last evaluation "
                 "(tokens: " + ", ".join(sorted({f"{r['tokens']:,}" for runs in groups.values() for r in runs})) + ").",
                 "", "| seed | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]  # fmt: skip
    else:
        lines = [f"# Seed groups: {task} learned (at least {threshold:.0%} at {length} tokens) and validation loss",
                 "", f"Per seed: {task} accuracy at " + " / ".join(map(str, lengths)) + " tokens (mean over depths), "
                 "then the validation loss at the run's last evaluation; **bold**: not learned.", "",
                 "| seed | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]  # fmt: skip
    for seed in seeds:
        cells = []
        for name in names:
            run = next((r for r in groups[name] if r["seed"] == seed), None)
            if run is None:
                cells.append("")
                continue
            accuracy = " / ".join(f"{run['accuracy'][n]:.0%}" if n in run["accuracy"] else "-" for n in lengths) \
                if run["accuracy"] else "no evaluation"
            text = f"{run['val_loss']:.4f}" if task is None else f"{accuracy}, {run['val_loss']:.4f}"
            verdict = learned(run, length, threshold)
            if task is not None and verdict is None and run["accuracy"]:  # neither bold nor plain: not judged
                text += f" (not evaluated at {length})"
            cells.append(f"**{text}**" if verdict is False else text)
        lines.append(f"| {seed} | " + " | ".join(cells) + " |")
    learned_heads = [] if task is None else ["learned, of the runs evaluated at that length"]
    lines += ["", "| " + " | ".join(["group", "seeds", *learned_heads, "val loss, mean ± std over seeds"]) + " |",
              "|---|---|" + "---|" * (len(learned_heads) + 1)]
    for name in names:
        s = summary[name]
        counts = [] if task is None else [f"{s['learned']} of {s['evaluated']}"]
        lines.append("| " + " | ".join([name, str(len(s["seeds"])), *counts,
                                        f"{s['val_loss_mean']:.4f} ± {_fmt(s['val_loss_std'], '{:.4f}')}"]) + " |")
    fisher_heads = [] if task is None else ["learned", "Fisher's exact p (two-sided)",
                                            f"accuracy at {length}, second - first, paired by seed (95%)"]
    heads = ["second vs first", *fisher_heads, "val loss, second - first, paired by seed (95%)", "paired seeds",
             "unpaired gap, Welch's t"]  # fmt: skip
    lines += ["", "| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    for (first, second), c in pairs.items():
        paired = f"{_fmt(c['paired_gap'])} ± {_fmt(c['paired_half_width'], '{:.4f}')}" if c["paired_gap"] is not None else "-"
        accuracy = share_gap(c["accuracy_gap"], c["accuracy_half_width"], c["accuracy_seeds"])
        fisher = [] if task is None else [f"{c['learned'][1]}/{c['evaluated'][1]} vs {c['learned'][0]}/{c['evaluated'][0]}",
                                          _fmt(c["fisher_p"], "{:.3f}"), accuracy]  # fmt: skip
        lines.append("| " + " | ".join([f"{second} vs {first}", *fisher, paired, str(len(c["paired_seeds"])),
                                        f"{_fmt(c['unpaired_gap'])}, t = {_fmt(c['welch_t'], '{:.1f}')}"]) + " |")
    lines += position_lines(groups, pairs)
    lines += selection_lines(groups)

    def tells_more(run):  # some answer at the learned length failed on its last token only
        accuracy = (run["accuracy"] or {}).get(length)
        return accuracy is not None and tells_more_than_accuracy(
            accuracy, (run.get("right_but_last") or {}).get(length), (run.get("ended") or {}).get(length))

    if task is not None and any(tells_more(r) for runs in groups.values() for r in runs):
        def shares(runs, key):
            return ", ".join(f"seed {r['seed']}: " + (f"{r[key][length]:.0%}" if r.get(key) and length in r[key]
                                                       else "-") for r in runs)  # fmt: skip

        lines += ["", f"At {length} tokens, some answers failed at their last token alone: a model can learn to end "
                  "its text where its training rows ended, and a case one token longer than a row puts the answer's "
                  "last token there. Per seed, the cases right in every answer token but perhaps the last (right "
                  "answers included): "
                  + "; ".join(f"{name} {shares(groups[name], 'right_but_last')}" for name in names)
                  + ". Those that ended inside the answer (its right start, then end-of-text): "
                  + "; ".join(f"{name} {shares(groups[name], 'ended')}" for name in names) + ".", "",
                  "| second vs first | right but perhaps the last token, second - first, paired (95%) | ended inside "
                  "the answer, second - first, paired (95%) |", "|---|---|---|"]  # fmt: skip
        for (first, second), c in pairs.items():
            gaps = [share_gap(c[f"{k}_gap"], c[f"{k}_half_width"], c[f"{k}_seeds"]) for k in ("right_but_last", "ended")]
            lines.append(f"| {second} vs {first} | " + " | ".join(gaps) + " |")
    return "\n".join(lines) + "\n"


def position_lines(groups: dict[str, list[dict]], pairs: dict) -> list[str]:
    """Markdown lines: the validation loss by range of query positions (mean ± std over seeds) of each group whose
    every run reported it, and the gap per range of each pair of such groups, paired by seed; the other groups are
    named as left out (trained before the trainer reported it); empty where fewer than one group reported it."""
    reporting = [name for name, runs in groups.items() if position_ranges(runs)]
    ranges = position_ranges([r for name in reporting for r in groups[name]])
    if not ranges:
        return []
    heads = [f"{lo:,}-{hi - 1:,}" for lo, hi in ranges]
    left_out = [name for name in groups if name not in reporting]
    lines = ["", "Validation loss at the last evaluation by the query's position in its document's fragment of the "
                 "row (the tokens it predicts from, less itself; the first range is NSA's window), mean ± std over "
                 "seeds, then second - first, paired by seed (95%)"
             + (f"; {', '.join(left_out)}: not reported by every run (trained before the trainer logged it)"
                if left_out else "") + ":", "",
             "| group | " + " | ".join(heads) + " |", "|---|" + "---|" * len(ranges)]  # fmt: skip
    for name in reporting:
        cells = []
        for key in ranges:
            values = [position_loss(r, *key) for r in groups[name]]
            std = f" ± {statistics.stdev(values):.4f}" if len(values) > 1 else ""
            cells.append(f"{statistics.fmean(values):.4f}{std}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    def cell(gap, half):
        return _fmt(gap) + (f" ± {half:.4f}" if half is not None else "")

    shown = [(first, second, {tuple(row["positions"]): row for row in c["by_position"]}) for (first, second), c in
             pairs.items() if first in reporting and second in reporting and c["by_position"]]  # fmt: skip
    for first, second, gaps in shown:
        lines.append(f"| {second} - {first} | " + " | ".join(
            cell(gaps[key]["gap"], gaps[key]["half_width"]) if key in gaps else "-" for key in ranges) + " |")
    if shown and len(ranges) > 1:
        lines += ["", f"Beyond the window: second - first there, less second - first at {heads[0]}, seed by seed "
                      "(each seed's lead everywhere cancels; below 0, the second group gains more beyond NSA's window "
                      "than inside it), 95% paired:", "",
                  "| pair | " + " | ".join(heads[1:]) + " |", "|---|" + "---|" * (len(ranges) - 1)]  # fmt: skip
        for first, second, gaps in shown:
            lines.append(f"| {second} - {first} | " + " | ".join(
                cell(gaps[key].get("beyond_window_gap"), gaps[key].get("beyond_window_half_width")) if key in gaps
                else "-" for key in ranges[1:]) + " |")  # fmt: skip
    return lines


def selection_lines(groups: dict[str, list[dict]]) -> list[str]:
    """Markdown lines: each layer's gates and selection at the last evaluation (ab_compare's `selection`: the trainer's
    stats.jsonl) of every group whose runs all logged them, mean ± std over seeds, then for each two such groups the
    difference per layer, second - first, paired by seed (95%); the other groups are named as left out; empty where
    no group logged them."""
    summaries = {name: selection_summary(runs) for name, runs in groups.items()}
    reporting = [name for name, summary in summaries.items() if summary]
    if not reporting:
        return []
    left_out = [name for name in groups if name not in reporting]
    heads = [head for _, head, _ in SELECTION_COLUMNS]
    record = groups[reporting[0]][0]["selection"]
    lines = ["", f"Gates and selection at the last evaluation (the trainer's stats.jsonl: {record['rows']} validation "
                 f"row(s) of {record['seq_len']:,} tokens), per layer, mean ± std over seeds, then second - first, "
                 "paired by seed (95%)" + (f"; {', '.join(left_out)}: not logged by every run (dense runs log "
                                           "none)" if left_out else "")
             + ":", "", "| group | layer | " + " | ".join(heads) + " |", "|---|---|" + "---|" * len(heads)]  # fmt: skip
    for name in reporting:
        for row in summaries[name]:
            lines.append(f"| {name} | {row['layer']} | " + " | ".join(selection_cell(row[key], spec)
                                                                      for key, _, spec in SELECTION_COLUMNS) + " |")
    for first, second in combinations(reporting, 2):
        if selection_layers(groups[first][0]) != selection_layers(groups[second][0]):
            lines.append(f"| {second} - {first} | their layers differ: not compared | " + " | ".join(["-"] * len(heads))
                         + " |")  # fmt: skip
            continue
        for i, row in enumerate(summaries[first]):
            cells, seeds = [], []
            for key, _, spec in SELECTION_COLUMNS:
                by_seed = [{r["seed"]: r["selection"]["layers"][i][key] for r in groups[name]} for name in (first, second)]
                seeds, gap, half = paired_gap(*by_seed)
                sign = spec.replace("{:", "{:+")
                cells.append("-" if gap is None else sign.format(gap) + (f" ± {spec.format(half)}" if half is not None
                                                                         else ""))  # fmt: skip
            lines.append(f"| {second} - {first} ({len(seeds)} seeds) | {row['layer']} | " + " | ".join(cells) + " |")
    return lines


def check_groups(parser: argparse.ArgumentParser, groups: list[list[str]], members: str, at_least: int = 2) -> None:
    """--group NAME MEMBER... as given (`groups`): at least `at_least` groups, each with members (named `members` in
    the error), names distinct; else the parser's error with the fix. Shared with bench/branch_ablation.py."""
    if len(groups) < at_least:  # (argparse's required=True already asks for one)
        parser.error("give --group at least twice: a comparison needs two groups." if at_least == 2 else
                     f"give --group at least {at_least} times.")  # fmt: skip
    short = [g[0] for g in groups if len(g) < 2]
    if short:
        parser.error(f"--group {short[0]}: give the group's {members} after its name.")
    names = [g[0] for g in groups]
    if len(set(names)) != len(names):
        parser.error(f"--group names repeat: {names}; give each group its own name.")


def write_report(out: Path, stem: str, text: str, result: dict) -> None:
    """<out>/<stem>.md (text) and <stem>.json (result), then the Markdown printed. Shared with
    bench/branch_ablation.py."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.md").write_text(text)
    (out / f"{stem}.json").write_text(json.dumps(result, indent=2))
    print(text)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="bench/seed_groups.py", description=__doc__.split("\n\n")[0],
                                allow_abbrev=False)
    p.add_argument("--out", required=True, type=Path, help="folder for seed_groups.md and seed_groups.json")
    p.add_argument("--group", nargs="+", action="append", required=True, metavar=("NAME", "SOURCE"),
                   help="a name, then folders holding ab_compare.json (glob patterns allowed), each optionally "
                        "':nsa' or ':dense' to keep that mode's runs; give --group once per group (two or more)")
    p.add_argument("--task", default="passkey",
                   help="the evaluation to count (default passkey); 'none': compare validation loss only")
    p.add_argument("--scoring", default="generate", help="its scoring (default generate)")
    p.add_argument("--learned-length", type=int, default=None,
                   help="case length (tokens) where learning is judged (default: the shortest length evaluated)")
    p.add_argument("--learned-accuracy", type=float, default=0.98,
                   help="accuracy at that length that counts as learned (default 0.98)")
    args = p.parse_args(argv)
    check_groups(p, args.group, "sources")
    names = [g[0] for g in args.group]
    if not 0 < args.learned_accuracy <= 1:
        p.error(f"--learned-accuracy {args.learned_accuracy}: give a fraction in (0, 1], e.g. 0.98.")
    task = None if args.task == "none" else args.task
    if task is None and args.learned_length is not None:
        p.error(f"--learned-length {args.learned_length} with --task none: no retrieval is counted; drop one.")
    groups = {g[0]: read_group(g[0], g[1:], task, args.scoring) for g in args.group}
    evaluated = sorted({n for runs in groups.values() for r in runs if r["accuracy"] for n in r["accuracy"]})
    if task is not None and not evaluated:
        raise ValueError(f"no run of these groups has a {task} evaluation scored by {args.scoring} (looked for "
                         f"<run>/long_context/{task}_{args.scoring}.json in each comparison folder and in each run's "
                         f"own directory, <run>-{task}.json beside them, and the comparison's ab_compare.json): train "
                         "with --eval-long-context, or run python -m nsa_train.long_context on each run's final/; "
                         "--task none compares validation loss only.")
    length = None if task is None else args.learned_length if args.learned_length is not None else evaluated[0]
    if task is not None and length not in evaluated:
        raise ValueError(f"--learned-length {length}: no run evaluated that length; they evaluated {evaluated}.")
    # the validation losses compared are each run's last: runs that stopped at other token counts are not at
    # equal tokens (said on stderr and in the report's JSON)
    tokens = sorted({r["tokens"] for runs in groups.values() for r in runs})
    unequal = None
    if len(tokens) > 1:
        unequal = (f"the runs' last evaluations are at different token counts ({', '.join(f'{t:,}' for t in tokens)}): "
                   "their validation losses are not at equal tokens")
        print(f"warning: {unequal}", file=sys.stderr)
    # likewise the retrieval evaluations pooled in the counts: said, as the tokens are, where their settings differ
    differ = evaluation_differences(groups) if task is not None else None
    unlike = None
    if differ:
        unlike = (f"evaluations differ in {differ}: the {task} accuracies pooled in the learned counts, Fisher's test "
                  "and the paired accuracy are not one measurement; evaluate the runs alike (python -m "
                  "nsa_train.long_context <run>/final with the same --lengths, --depths, --samples and --seed)")
        print(f"warning: {unlike}", file=sys.stderr)
    summary = summarize(groups, length, args.learned_accuracy)
    pairs = {(a, b): compare_pair(groups[a], groups[b], length, args.learned_accuracy) for a, b in combinations(names, 2)}
    text = markdown(groups, summary, pairs, length, args.learned_accuracy, task)
    for caution in (unlike, unequal):
        if caution:
            text = f"**Read with care:** {caution}.\n\n" + text
    result = {"task": task, "scoring": args.scoring, "learned_length": length, "unequal_tokens": unequal,
              "unequal_evaluations": unlike,
              "learned_accuracy": args.learned_accuracy, "date": time.strftime("%Y-%m-%d"), "groups": groups,
              "summary": summary, "pairs": [{"first": a, "second": b, **c} for (a, b), c in pairs.items()]}  # fmt: skip
    write_report(args.out, "seed_groups", text, result)
    return result


if __name__ == "__main__":
    run_command(main)
