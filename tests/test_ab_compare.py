"""bench/ab_compare.py: two tiny runs (NSA and its dense twin) trained through train_accelerate.py and compared."""

from __future__ import annotations

import hashlib
import json
import math
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import ab_compare  # noqa: E402
from test_gpu_session import script_defaults  # noqa: E402


def train_flags(data_file: Path) -> list[str]:
    return ["--dataset", str(data_file), "--tokenizer", "byt5", "--model", "tiny", "--seq-len", "64",
            "--micro-batch-size", "2", "--max-steps", "2", "--warmup-steps", "1", "--eval-every", "1",
            "--val-tokens", "256", "--val-every-doc", "5", "--log-every", "1", "--save-every", "0",
            "--report-to", "none", "--mixed-precision", "no", "--shuffle-buffer", "16"]  # fmt: skip


@pytest.fixture(scope="module")
def ab(tmp_path_factory):
    """Both modes, one seed, two steps each, on a small JSON-lines corpus (the README's paragraphs)."""
    root = tmp_path_factory.mktemp("ab")
    paragraphs = [p for p in (ROOT / "README.md").read_text().split("\n\n") if len(p) > 80]
    data_file = root / "docs.jsonl"
    data_file.write_text("\n".join(json.dumps({"text": p}) for p in paragraphs))
    out = root / "out"
    result = ab_compare.main(["--out", str(out), "--seeds", "3", "--", *train_flags(data_file)])
    return out, data_file, result


def test_trains_both_modes_and_writes_table_plot_and_json(ab):
    out, _, result = ab
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["nsa-seed3", "dense-seed3", "ab_compare.md", "ab_compare.png", "ab_compare.json"])
    assert (out / "ab_compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = (out / "ab_compare.md").read_text()
    assert "| nsa-seed3 | nsa | 3 |" in table and "| dense-seed3 | dense | 3 |" in table
    assert "differ only in the attention mode" in table and "Each run started from" not in table
    # the curve is the evaluations at steps 0, 1, 2 (128 tokens per step), NSA - dense from the runs' own logs
    curve = result["comparison"]["curve"]
    assert [row["tokens"] for row in curve] == [0, 128, 256]
    for run_name, mode in (("nsa-seed3", "nsa"), ("dense-seed3", "dense")):
        logged = [json.loads(line) for line in (out / run_name / "metrics.jsonl").read_text().splitlines()]
        val = [entry["val_loss"] for entry in logged if "val_loss" in entry]
        assert [row[mode]["mean"] for row in curve] == val
    assert curve[-1]["nsa_minus_dense"] == pytest.approx(curve[-1]["nsa"]["mean"] - curve[-1]["dense"]["mean"])
    # the loss by query position at the last evaluation (tiny: window 32 of 64-token rows), from the runs' logs
    by_position = result["comparison"]["by_position"]
    assert [row["positions"] for row in by_position] == [[0, 32], [32, 64]]
    for run_name, mode in (("nsa-seed3", "nsa"), ("dense-seed3", "dense")):
        last = [json.loads(line) for line in (out / run_name / "metrics.jsonl").read_text().splitlines()
                if "val_loss" in line][-1]  # fmt: skip
        assert [row[mode]["mean"] for row in by_position] == [last["val_loss_pos0to32"], last["val_loss_pos32to64"]]
    gap = by_position[1]["nsa"]["mean"] - by_position[1]["dense"]["mean"]
    assert f"| 32-63 | {by_position[1]['nsa']['mean']:.4f} | {by_position[1]['dense']['mean']:.4f} | {gap:+.4f} |" in table
    assert json.loads((out / "ab_compare.json").read_text())["comparison"] == result["comparison"]


def test_the_nsa_runs_selection_at_the_last_evaluation_is_tabled(ab, tmp_path):
    """The NSA run's gates and selection per layer at its last evaluation, as its stats.jsonl logged them, in the
    JSON and the Markdown; the dense run has none; a record without a field is an error naming the file."""
    out, _, result = ab
    runs = {r["mode"]: r for r in result["runs"]}
    assert runs["dense"]["selection"] is None
    logged = [json.loads(line) for line in (out / "nsa-seed3" / "stats.jsonl").read_text().splitlines()]
    last = [record for record in logged if record["step"] == 2][-1]
    selection = runs["nsa"]["selection"]
    assert (selection["step"], selection["rows"], selection["seq_len"]) == (2, last["rows"], 64)
    assert len(selection["layers"]) == len(last["layers"]) == 2  # the tiny model's layers
    for read, layer in zip(selection["layers"], last["layers"]):
        assert read == {"layer": layer["layer"], **{key: layer[key] for key in ab_compare.SELECTION_FIELDS},
                        "distance_share": layer["distance_share"]}  # fmt: skip
    table = (out / "ab_compare.md").read_text()
    assert "Gates and selection of the NSA runs at the last evaluation" in table
    layer = last["layers"][1]
    assert (f"| 1 | {layer['gate_cmp_mean']:.3f} | {layer['gate_slc_mean']:.3f} | {layer['gate_win_mean']:.3f} | "
            f"{layer['distance_mean']:.2f} | {layer['beyond_window_share']:.3f} | {layer['neighbour_overlap']:.3f} |") in table
    # two runs: mean ± sample std per field
    twin = {**runs["nsa"], "selection": {**selection, "layers": [{**selection["layers"][0], "distance_mean": 3.0},
                                                                 selection["layers"][1]]}}  # fmt: skip
    first = {**runs["nsa"], "selection": {**selection, "layers": [{**selection["layers"][0], "distance_mean": 1.0},
                                                                  selection["layers"][1]]}}  # fmt: skip
    summary = ab_compare.selection_summary([first, twin])
    assert summary[0]["distance_mean"] == {"mean": 2.0, "std": statistics.stdev([1.0, 3.0])}
    assert ab_compare.selection_summary([first, runs["dense"]]) == []  # a run without statistics: no table
    # a NaN statistic (a layer that selected nothing) gives NaN, not an error
    nan_run = {**first, "selection": {**selection, "layers": [{**selection["layers"][0], "distance_mean": math.nan},
                                                              selection["layers"][1]]}}  # fmt: skip
    assert math.isnan(ab_compare.selection_summary([nan_run, twin])[0]["distance_mean"]["mean"])
    # an NSA run without statistics: no table, a line saying which run and why
    lines = ab_compare.selection_table([first, {**twin, "name": "nsa-seed9", "selection": None}])
    assert lines[-1].startswith("Gates and selection: not tabled; nsa-seed9 logged none at the last evaluation")
    # a record at another step is not this evaluation's; a resumed run's repeated step: the last record wins; a
    # record without a field, or a cut line, names the file
    run_dir = tmp_path / "nsa-seed0"
    run_dir.mkdir()
    layer = {key: 0.5 for key in ab_compare.SELECTION_FIELDS}
    records = [{"step": 4, "layers": [{"layer": 0, **layer, "distance_mean": d, "distance_share": {}}]} for d in (1.0, 2.0)]
    (run_dir / "stats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert ab_compare.read_selection(run_dir, 2) is None
    assert ab_compare.read_selection(run_dir, 4)["layers"][0]["distance_mean"] == 2.0
    (run_dir / "stats.jsonl").write_text(json.dumps({"step": 4, "layers": [{"layer": 0}]}) + "\n")
    with pytest.raises(ValueError, match=r"stats.jsonl: step 4's record lacks 'gate_cmp_mean'"):
        ab_compare.read_selection(run_dir, 4)
    (run_dir / "stats.jsonl").write_text(json.dumps(records[0]) + "\n" + json.dumps(records[1])[:20])
    with pytest.raises(ValueError, match=r"stats.jsonl, line 2: not JSON"):
        ab_compare.read_selection(run_dir, 4)


def test_the_two_runs_differ_only_in_attention_mode(ab):
    out, _, _ = ab
    nsa, dense = (json.loads((out / name / "run.json").read_text()) for name in ("nsa-seed3", "dense-seed3"))
    differing = {k for k in nsa["config"].keys() | dense["config"].keys() if nsa["config"].get(k) != dense["config"].get(k)}
    assert differing == {"attention_mode", "output_dir"}
    assert (nsa["config"]["attention_mode"], dense["config"]["attention_mode"]) == ("nsa", "dense")
    assert nsa["config"]["seed"] == dense["config"]["seed"] == 3
    model_diff = {k for k in nsa["model_config"] if nsa["model_config"][k] != dense["model_config"].get(k)}
    assert model_diff == {"attention_mode"}
    # same schedule and tokens: the same tokens seen at every log
    tokens = [[json.loads(line).get("tokens_seen") for line in (out / n / "metrics.jsonl").read_text().splitlines()]
              for n in ("nsa-seed3", "dense-seed3")]  # fmt: skip
    assert tokens[0] == tokens[1]


def test_finished_runs_are_compared_again_without_training(ab, tmp_path, capsys):
    out, data_file, result = ab
    stamps = {n: (out / n / "summary.json").stat().st_mtime_ns for n in ("nsa-seed3", "dense-seed3")}
    again = ab_compare.main(["--out", str(out), "--seeds", "3", "--", *train_flags(data_file)])
    assert "finished already, not trained again" in capsys.readouterr().out
    assert {n: (out / n / "summary.json").stat().st_mtime_ns for n in stamps} == stamps
    assert again["comparison"] == result["comparison"]
    # kept runs must have trained with this command's flags: another --max-steps or --lr is an error naming it (it
    # would be compared as if trained with them); a flag that changes only the run's logging or reports is not
    flags = train_flags(data_file)
    for name, value in (("--max-steps", "3"), ("--lr", "1e-3")):
        changed = [*flags, name, value]
        with pytest.raises(ValueError, match=rf"nsa-seed3 holds a run trained with other flags.*{name} \S+ there, "
                                             rf"\S+ here\); pass another --out"):  # fmt: skip
            ab_compare.main(["--out", str(out), "--seeds", "3", "--", *changed])
    relogged = ab_compare.main(["--out", str(out), "--seeds", "3", "--", *flags, "--log-every", "2"])
    assert relogged["comparison"] == result["comparison"]
    assert {n: (out / n / "summary.json").stat().st_mtime_ns for n in stamps} == stamps
    # --runs: finished runs from anywhere; a run whose training config differs is reported as not like for like
    other = tmp_path / "dense-other-lr"
    shutil.copytree(out / "dense-seed3", other)
    record = json.loads((other / "run.json").read_text())
    record["config"]["lr"] = 1.0
    (other / "run.json").write_text(json.dumps(record))
    compared = ab_compare.main(["--out", str(tmp_path / "cmp"), "--runs", str(out / "nsa-seed3"), str(other)])
    assert [n for n in compared["config_differences"] if "train config lr = 0.0006 / 1.0" in n]
    assert "**The runs differ beyond the attention mode**" in (tmp_path / "cmp" / "ab_compare.md").read_text()
    # the dense twin's attention kernel (e.g. FlexAttention with packed documents, trained apart) is its own choice
    flex = tmp_path / "dense-flex"
    shutil.copytree(out / "dense-seed3", flex)
    record = json.loads((flex / "run.json").read_text())
    record["config"]["attn_implementation"] = "flex_attention"
    (flex / "run.json").write_text(json.dumps(record))
    assert ab_compare.main(["--out", str(tmp_path / "cmp-flex"), "--runs", str(out / "nsa-seed3"),
                            str(flex)])["config_differences"] == []


def test_init_from_runs_starts_each_twin_from_its_own_twin(ab, tmp_path, capsys):
    """--init-from-runs: each fine-tuning run loads its own mode's and seed's final/ from the earlier comparison
    (its first evaluation, before any step, is that run's last one on the same rows), and the comparison treats
    the differing --init-from paths as the twins' own, not as a difference."""
    out, data_file, result = ab
    tuned_out = tmp_path / "tuned"
    tuned = ab_compare.main(["--out", str(tuned_out), "--seeds", "3", "--init-from-runs", str(out), "--",
                             *train_flags(data_file)])
    for mode in ("nsa", "dense"):
        record = json.loads((tuned_out / f"{mode}-seed3" / "run.json").read_text())
        assert record["config"]["init_from"] == str(out / f"{mode}-seed3" / "final")
        assert record["model_config"]["attention_mode"] == mode
    first, last = tuned["comparison"]["curve"][0], result["comparison"]["curve"][-1]
    assert last["nsa"]["mean"] != last["dense"]["mean"]  # (the twins' losses tell them apart)
    assert first["nsa"]["mean"] == pytest.approx(last["nsa"]["mean"], abs=1e-5)
    assert first["dense"]["mean"] == pytest.approx(last["dense"]["mean"], abs=1e-5)
    assert tuned["config_differences"] == []
    assert f"Each run started from its own twin's final/ in {out} (--init-from-runs)" in (
        tuned_out / "ab_compare.md").read_text()
    # the same command again reuses the finished runs; runs kept from another start are refused, both ways
    capsys.readouterr()
    ab_compare.main(["--out", str(tuned_out), "--seeds", "3", "--init-from-runs", str(out), "--",
                     *train_flags(data_file)])
    assert "finished already, not trained again" in capsys.readouterr().out
    with pytest.raises(ValueError, match=r"nsa-seed3 holds a run that started from .*nsa-seed3/final, not from random "
                                         r"weights as this command's runs do; pass another --out"):
        ab_compare.main(["--out", str(tuned_out), "--seeds", "3", "--", *train_flags(data_file)])
    with pytest.raises(ValueError, match=r"nsa-seed3 holds a run that started from random weights, not from "
                                         r".*tuned/nsa-seed3/final"):
        ab_compare.main(["--out", str(out), "--seeds", "3", "--init-from-runs", str(tuned_out), "--",
                         *train_flags(data_file)])
    # a twin started from another seed's run is a difference, not a twin
    stray = tmp_path / "dense-seed3"
    shutil.copytree(tuned_out / "dense-seed3", stray)
    record = json.loads((stray / "run.json").read_text())
    record["config"]["init_from"] = str(out / "dense-seed4" / "final")
    (stray / "run.json").write_text(json.dumps(record))
    mixed = ab_compare.main(["--out", str(tmp_path / "mixed"), "--runs", str(tuned_out / "nsa-seed3"), str(stray)])
    assert [n for n in mixed["config_differences"] if "train config init_from" in n]
    assert "Each run started from" not in (tmp_path / "mixed" / "ab_compare.md").read_text()
    for flag in ("--init-from", "--model-overrides"):
        with pytest.raises(ValueError, match=rf"train flag {flag}: --init-from-runs .* starts each twin from its own"):
            ab_compare.main(["--out", str(tmp_path / "x"), "--init-from-runs", str(out), "--",
                             *train_flags(data_file), flag, "{}"])
    with pytest.raises(ValueError, match=r"no saved model of nsa seed 7 \(.*nsa-seed7/final\), dense seed 7 "
                                         r"\(.*dense-seed7/final\); train them there first, e.g. ab_compare.py "
                                         r"--out .* --seeds 7 --modes nsa dense"):
        ab_compare.main(["--out", str(tmp_path / "y"), "--seeds", "7", "--init-from-runs", str(out), "--",
                         *train_flags(data_file)])
    with pytest.raises(SystemExit):  # --runs trains nothing: a start to train from is a mistake
        ab_compare.main(["--out", str(tmp_path / "z"), "--init-from-runs", str(out), "--runs",
                         str(out / "nsa-seed3"), str(out / "dense-seed3")])
    assert "--init-from-runs" in capsys.readouterr().err


def test_long_context_evaluations_are_tabled_per_run(ab, tmp_path):
    """A run's long_context/<task>_<scoring>.json, as nsa_train.long_context writes it, becomes a row: accuracy per
    length as the mean over depths, a length past that run's training length starred, NSA's answer's-block
    selection per length; runs evaluated at different lengths share the columns."""
    from nsa_train import long_context

    out, _, _ = ab
    runs = {}
    for mode in ("nsa", "dense"):
        runs[mode] = tmp_path / f"{mode}-seed3"
        shutil.copytree(out / f"{mode}-seed3", runs[mode])
        shutil.rmtree(runs[mode] / "long_context", ignore_errors=True)
    # the NSA twin evaluated for real (as if trained at 224 tokens: 256 is past it), then its accuracies replaced by
    # known values in the file the evaluation wrote
    long_context.main([str(runs["nsa"] / "final"), "--task", "passkey", "--lengths", "224", "256", "--depths", "0",
                       "0.5", "1", "--samples", "1", "--training-len", "224", "--device", "cpu"])
    written = runs["nsa"] / "long_context" / "passkey_generate.json"
    result = json.loads(written.read_text())
    assert result["extrapolated_lengths"] == [256] and len(result["needle_selected"]) == 2
    result.update(accuracy=[[1.0, 0.5, 0.0], [0.25, 0.25, 0.1]], needle_selected=[[1.0, 1.0, 0.7], [0.0, 0.3, 0.0]],
                  ended_inside_answer=[[0.0, 0.0, 0.0], [0.5, 0.25, 0.0]],
                  right_but_last_token=[[1.0, 0.5, 0.0], [1.0, 0.5, 0.4]])
    written.write_text(json.dumps(result))
    (runs["dense"] / "long_context").mkdir()
    # a file written before the ended-inside-the-answer matrix existed: its share comes from the cases' predictions
    # (at 224 tokens, depth 0.5: '123' for '1234', the text ended one token early)
    cells = [{"length": n, "depth": d, "cases": [{"answer": "1234", "prediction": "123" if (n, d) == (224, 0.5)
                                                  else "1234"}]} for n in (200, 224) for d in (0.0, 0.5, 1.0)]  # fmt: skip
    (runs["dense"] / "long_context" / "passkey_generate.json").write_text(json.dumps(
        {"task": "passkey", "scoring": "generate", "lengths": [200, 224], "depths": [0.0, 0.5, 1.0],
         "extrapolated_lengths": [], "accuracy": [[0.0, 0.0, 0.0], [1.0, 1.0, 0.4]], "needle_selected": None,
         "cells": cells}))
    (runs["dense"] / "long_context" / "notes.json").write_text(json.dumps(["not an evaluation"]))
    ab_compare.main(["--out", str(tmp_path / "cmp"), "--runs", str(runs["nsa"]), str(runs["dense"])])
    table = (tmp_path / "cmp" / "ab_compare.md").read_text()
    assert "| run | 200 | 224 | 256 | right but perhaps the last token (ended inside) | answer's block selected |" in table
    assert "| nsa-seed3 |  | 50% | 20%* | 256: 63% (ended 25%) | - / 90% / 10% |" in table
    assert "| dense-seed3 | 0% | 80% |  | 224: ended 33% |  |" in table  # (an older file: no right-but-last)
    (runs["dense"] / "long_context" / "passkey_loglik.json").write_text('{"accuracy": ')
    with pytest.raises(ValueError, match=r"passkey_loglik.json: not a long-context evaluation as "
                                         r"nsa_train.long_context writes it"):
        ab_compare.main(["--out", str(tmp_path / "cmp2"), "--runs", str(runs["nsa"]), str(runs["dense"])])


def test_the_last_token_column_leaves_runs_without_it_blank():
    """A run whose evaluation has no last-token shares (a file from before them, without cases) gets an empty cell
    in that column, beside a run that has them; a table where no answer failed on its last token alone has no
    such column."""
    def run(name, ended, but_last):
        return {"name": name, "long_context": [{"task": "passkey", "scoring": "generate", "lengths": [224, 256],
                                                "extrapolated": [], "accuracy": [1.0, 0.5], "ended": ended,
                                                "right_but_last": but_last, "selected": None}]}  # fmt: skip

    table = "\n".join(ab_compare.long_context_table([run("nsa-seed0", [0.0, 0.25], [1.0, 0.9]),
                                                     run("dense-seed0", None, None)]))  # fmt: skip
    assert "| run | 224 | 256 | right but perhaps the last token (ended inside) |" in table
    assert "| nsa-seed0 | 100% | 50% | 256: 90% (ended 25%) |" in table and "| dense-seed0 | 100% | 50% |  |" in table
    table = "\n".join(ab_compare.long_context_table([run("nsa-seed0", [0.0, 0.0], [1.0, 0.5]),
                                                     run("dense-seed0", None, None)]))  # fmt: skip
    assert "last token" not in table and "| dense-seed0 | 100% | 50% |" in table
    # wrong at the last token alone without ending inside the answer ('7008y'): the column, no ended share
    table = "\n".join(ab_compare.long_context_table([run("nsa-seed0", [0.0, 0.0], [1.0, 0.8])]))
    assert "| nsa-seed0 | 100% | 50% | 256: 80% (ended 0%) |" in table


def fake_run(mode, seed, losses, tokens_per_step=100):
    return {"name": f"{mode}-seed{seed}", "mode": mode, "seed": seed,
            "val": [(i * tokens_per_step, loss) for i, loss in enumerate(losses)]}  # fmt: skip


def with_positions(run, ranges):
    """A fake run that reported its last evaluation's loss by query position: [[lo, hi, loss], ...]."""
    return {**run, "val_by_position": {"tokens": run["val"][-1][0], "ranges": ranges}}


def test_loss_by_position_gap_and_interval():
    """Per range of query positions: each mode's mean over seeds, NSA - dense, and its interval paired by seed; a
    run without the figures (trained before the trainer logged them) or last evaluated at another count: none."""
    runs = [with_positions(fake_run("nsa", 0, [5.0, 3.0]), [[0, 64, 3.5], [64, 128, 2.50]]),
            with_positions(fake_run("nsa", 1, [5.0, 3.0]), [[0, 64, 3.6], [64, 128, 2.54]]),
            with_positions(fake_run("dense", 0, [5.0, 3.0]), [[0, 64, 3.5], [64, 128, 2.60]]),
            with_positions(fake_run("dense", 1, [5.0, 3.0]), [[0, 64, 3.6], [64, 128, 2.70]])]  # fmt: skip
    rows = ab_compare.compare(runs)["by_position"]
    assert [row["positions"] for row in rows] == [[0, 64], [64, 128]]
    shifted = [with_positions(r, [[0, 64, x + 0.05 * (r["mode"] == "nsa") * (r["seed"] + 1)], [64, 128, y]])
               for r, ((_, _, x), (_, _, y)) in zip(runs, (r["val_by_position"]["ranges"] for r in runs))]
    # a seed whose NSA is worse inside the window by 0.05 (0.10) and as good beyond: the relative gap counts it
    relative = ab_compare.compare(shifted)["by_position"][1]["beyond_window"]["mean"]
    assert relative == pytest.approx(statistics.fmean([-0.10 - 0.05, -0.16 - 0.10]))
    assert rows[0]["nsa_minus_dense"] == pytest.approx(0.0)
    assert rows[1]["nsa"]["mean"] == pytest.approx(2.52) and rows[1]["dense"]["mean"] == pytest.approx(2.65)
    assert rows[1]["paired_gaps"] == {"0": pytest.approx(-0.10), "1": pytest.approx(-0.16)}
    assert rows[1]["interval"] == pytest.approx(12.706 * statistics.stdev([-0.10, -0.16]) / 2 ** 0.5)
    # beyond the window, the gap less the window's gap, seed by seed: -0.10 - 0 and -0.16 - 0
    assert rows[1]["beyond_window"]["mean"] == pytest.approx(-0.13) and "beyond_window" not in rows[0]
    assert rows[1]["beyond_window"]["interval"] == pytest.approx(rows[1]["interval"])
    text = ab_compare.markdown([], ab_compare.compare(runs), [])
    assert f"| 64-127 | 2.5200 ± {statistics.stdev([2.50, 2.54]):.4f} | 2.6500 ± {statistics.stdev([2.6, 2.7]):.4f} | " \
           f"-0.1300 ± {rows[1]['interval']:.4f} (paired) | -0.1300 ± {rows[1]['interval']:.4f} |" in text
    assert "| less the gap at 0-63 (95%, paired) |" in text
    assert "Validation loss at 100 tokens by the query's position" in text
    # NSA alone (--modes nsa): its means, no gap
    alone = ab_compare.compare(runs[:2])["by_position"]
    assert alone[1]["nsa"]["mean"] == pytest.approx(2.52) and "nsa_minus_dense" not in alone[1]
    older = runs[:3] + [fake_run("dense", 1, [5.0, 3.0])]
    assert ab_compare.compare(older)["by_position"] == []
    assert "by the query's position" not in ab_compare.markdown([], ab_compare.compare(older), [])
    # a seed NSA ran twice (a rerun in another --out): both runs in NSA's mean, the seed left out of the pairing
    rerun = with_positions(fake_run("nsa", 1, [5.0, 3.0]), [[0, 64, 3.7], [64, 128, 2.90]])
    twice = ab_compare.compare(runs + [rerun])["by_position"][1]
    assert twice["nsa"]["mean"] == pytest.approx((2.50 + 2.54 + 2.90) / 3) and twice["nsa"]["n"] == 3
    assert twice["paired_gaps"] == {"0": pytest.approx(-0.10)} and twice["interval_kind"] == "per-mode"
    elsewhere = runs[:3] + [with_positions(fake_run("dense", 1, [5.0, 3.0, 2.9]), [[0, 64, 3.0], [64, 128, 2.0]])]
    assert ab_compare.compare(elsewhere)["by_position"] == []  # its figures are at 200 tokens, the others' at 100


def test_jobs_train_side_by_side_with_the_same_results(ab, tmp_path):
    """--jobs 2: both modes at once, each run's output in <out>/<mode>-seed<S>.log; the runs are the sequential
    ones (the same seed, flags and data: the same validation losses)."""
    out, data_file, result = ab
    side = ab_compare.main(["--out", str(tmp_path), "--seeds", "3", "--jobs", "2", "--", *train_flags(data_file)])
    assert {p.name for p in tmp_path.glob("*.log")} == {"nsa-seed3.log", "dense-seed3.log"}
    assert "val loss" in (tmp_path / "nsa-seed3.log").read_text()
    for row, again in zip(result["comparison"]["curve"], side["comparison"]["curve"]):
        assert row["nsa"]["mean"] == again["nsa"]["mean"] and row["dense"]["mean"] == again["dense"]["mean"]
    with pytest.raises(SystemExit):
        ab_compare.main(["--out", str(tmp_path / "x"), "--jobs", "0", "--", *train_flags(data_file)])


def test_log_warnings_finds_each_warning_line_once(tmp_path):
    """Under --jobs a run's output goes to its log; ab_compare prints the 'warning:' lines found there, each once."""
    log = tmp_path / "nsa-seed0.log"
    log.write_text("step 10: loss 2.0\nwarning: --warmup-steps 200 >= --max-steps 150: the whole run is warm-up\n"
                   "step 20: loss 1.9\nwarning: --warmup-steps 200 >= --max-steps 150: the whole run is warm-up\n"
                   "  Warning: another\n")  # (a resumed run appends to its log: the same line again)
    assert ab_compare.log_warnings(log) == ["warning: --warmup-steps 200 >= --max-steps 150: the whole run is warm-up",
                                            "Warning: another"]  # fmt: skip
    assert ab_compare.log_warnings(tmp_path / "missing.log") == []


def test_one_run_trains_without_a_comparison_and_compares_later(ab, tmp_path, capsys):
    """--modes nsa with one seed (a seed added to a finished comparison): the run trains and the command says how to
    compare it, instead of failing after the training; then --runs compares it with the earlier runs."""
    out, data_file, _ = ab
    one = ab_compare.main(["--out", str(tmp_path / "one"), "--seeds", "4", "--modes", "nsa", "--",
                           *train_flags(data_file)])
    assert one == {"runs": [str(tmp_path / "one" / "nsa-seed4")]} and "--runs" in capsys.readouterr().out
    assert not (tmp_path / "one" / "ab_compare.md").exists()
    again = ab_compare.main(["--out", str(tmp_path / "all"), "--runs", str(out / "nsa-seed3"), str(out / "dense-seed3"),
                             one["runs"][0]])
    assert sorted(r["seed"] for r in again["runs"] if r["mode"] == "nsa") == [3, 4]
    # a seed trained again elsewhere: both runs listed, told apart by their folders, and left out of the pairing
    rerun = tmp_path / "rerun" / "nsa-seed3"
    shutil.copytree(out / "nsa-seed3", rerun)
    both = ab_compare.main(["--out", str(tmp_path / "both"), "--runs", str(out / "nsa-seed3"), str(rerun),
                            str(out / "dense-seed3")])  # fmt: skip
    table = (tmp_path / "both" / "ab_compare.md").read_text()
    assert f"| {out.name}/nsa-seed3 | nsa | 3 |" in table and "| rerun/nsa-seed3 | nsa | 3 |" in table
    assert "| dense-seed3 | dense | 3 |" in table
    assert both["comparison"]["final"]["paired_gaps"] == {}


def test_seed_spread_and_the_verdict():
    runs = [fake_run("nsa", 0, [5.0, 4.0, 3.10]), fake_run("nsa", 1, [5.1, 4.1, 3.14]),
            fake_run("dense", 0, [5.0, 3.9, 3.00]), fake_run("dense", 1, [5.2, 4.0, 3.06])]  # fmt: skip
    comparison = ab_compare.compare(runs)
    last = comparison["curve"][-1]
    assert last["tokens"] == 200
    assert last["nsa"]["mean"] == pytest.approx(3.12) and last["dense"]["mean"] == pytest.approx(3.03)
    assert last["nsa"]["std"] == pytest.approx(statistics.stdev([3.10, 3.14]))
    assert last["dense"]["std"] == pytest.approx(statistics.stdev([3.00, 3.06]))
    final = comparison["final"]
    assert final["nsa_minus_dense"] == pytest.approx(0.09) and not final["met"]
    assert final["seed_std"] == pytest.approx(statistics.stdev([3.00, 3.06]))
    # each seed's twins differ by 0.10 and 0.08: the gap's interval is paired by seed, t(1) * std / sqrt(2)
    assert final["paired_gaps"] == {"0": pytest.approx(0.10), "1": pytest.approx(0.08)}
    assert final["interval_kind"] == "paired"
    assert final["interval"] == pytest.approx(12.706 * statistics.stdev([0.10, 0.08]) / 2 ** 0.5)
    # two seeds cannot place a 0.07-nat distance to the target (their interval is +-0.13): "NOT RESOLVED"
    assert not final["resolved"] and not final["beyond_noise"]
    text = ab_compare.markdown([], comparison, [])
    assert "target <= +0.02: missed by the means, NOT RESOLVED: the target lies within the gap's 95% interval" in text
    assert "MISSED" not in text and "per seed: seed 0 +0.1000, seed 1 +0.0800" in text
    # a third seed that agrees: t(2) * 0.01 / sqrt(3) = +-0.025, and the target lies outside it
    runs += [fake_run("nsa", 2, [5.0, 4.0, 3.12]), fake_run("dense", 2, [5.0, 4.0, 3.03])]
    final = ab_compare.compare(runs)["final"]
    assert final["interval"] == pytest.approx(4.303 * statistics.stdev([0.10, 0.08, 0.09]) / 3 ** 0.5)
    assert final["resolved"] and final["beyond_noise"] and not final["met"]
    assert "(target <= +0.02: MISSED)" in ab_compare.markdown([], ab_compare.compare(runs), [])
    # seeds whose gaps disagree cannot decide it
    runs[-1]["val"][-1] = (200, 3.12)
    assert not ab_compare.compare(runs)["final"]["resolved"]
    # no seed in both modes: the spread within each mode (Welch); one seed per mode: nothing measured
    solo = [fake_run("nsa", 0, [5.0, 3.100]), fake_run("nsa", 1, [5.0, 3.101]), fake_run("dense", 2, [5.0, 3.000]),
            fake_run("dense", 3, [5.0, 3.002])]
    final = ab_compare.compare(solo)["final"]
    assert final["interval_kind"] == "per-mode" and final["paired_gaps"] == {}
    assert final["interval"] == pytest.approx(
        12.706 * (statistics.variance([3.100, 3.101]) / 2 + statistics.variance([3.000, 3.002]) / 2) ** 0.5)
    assert final["resolved"] and not final["met"]  # 0.0995 is 0.08 past the target; the interval is +-0.02
    single = ab_compare.compare(solo[::2])["final"]
    assert single["interval"] is None and not single["resolved"]
    assert single["undecided"] == "1 nsa seed, 1 dense seed"
    assert "undecided: 1 nsa seed, 1 dense seed" in ab_compare.markdown([], ab_compare.compare(solo[::2]), [])
    # a seed one mode ran twice is not paired (which run is the twin is unknown)
    twice = [fake_run("nsa", 0, [5.0, 3.1]), fake_run("nsa", 0, [5.0, 3.2]), fake_run("dense", 0, [5.0, 3.0])]
    assert ab_compare.compare(twice)["final"]["paired_gaps"] == {}
    # only the token counts every run evaluated at are compared
    runs[0]["val"] = runs[0]["val"][:2]
    assert [row["tokens"] for row in ab_compare.compare(runs)["curve"]] == [0, 100]


def test_runs_that_are_not_a_seed_by_seed_comparison_are_said_to_be():
    """Runs compared with --runs that share no evaluation after step 0 get no verdict (it would judge the untrained
    models); two runs of one mode and seed, one mode only, and runs evaluated past the shared count are named
    above the tables."""
    # NSA evaluated every 100 tokens, dense at other counts: only step 0 is shared
    runs = [fake_run("nsa", 0, [5.0, 4.0, 3.0]), {**fake_run("dense", 0, [5.1, 3.9]), "val": [(0, 5.1), (150, 3.9)]}]
    comparison = ab_compare.compare(runs)
    assert [row["tokens"] for row in comparison["curve"]] == [0] and comparison["final"] is None
    warnings = ab_compare.sample_warnings(runs, comparison)
    assert any("share no evaluation after step 0" in w and "no verdict" in w for w in warnings)
    text = ab_compare.markdown([], comparison, [], warnings)
    assert "Read with care" in text and "target <=" not in text
    # evaluated past the shared count: named with their last counts
    runs = [fake_run("nsa", 0, [5.0, 4.0, 3.0]), fake_run("dense", 0, [5.0, 3.9])]
    warnings = ab_compare.sample_warnings(runs, ab_compare.compare(runs))
    assert warnings == ["compared at 100 tokens, the last count every run evaluated; runs evaluated later: "
                        "nsa-seed0 200"]
    # two NSA runs of one seed (e.g. two schedules), no dense run: not seeds, and no NSA - dense
    runs = [fake_run("nsa", 0, [5.0, 3.1]), {**fake_run("nsa", 0, [5.0, 3.2]), "name": "other/nsa-seed0"}]
    comparison = ab_compare.compare(runs)
    warnings = ab_compare.sample_warnings(runs, comparison)
    assert any("2 nsa runs of seed 0, averaged as separate samples" in w and "seed_groups" in w for w in warnings)
    assert any("only nsa runs" in w for w in warnings)
    assert ab_compare.markdown([], comparison, [], warnings).startswith("# nsa runs")
    # seeds one mode ran and the other did not: the gap is centred on the paired seeds, where its interval is
    # formed, and the runs left out are named (a centre from every run once read "MISSED" beside a paired +0.002)
    runs = [fake_run("nsa", s, [5.0, v]) for s, v in ((0, 3.000), (1, 3.104), (2, 3.002), (3, 3.105))]
    runs += [fake_run("dense", s, [5.0, v]) for s, v in ((0, 3.000), (1, 3.100), (2, 3.000), (4, 2.950))]
    comparison = ab_compare.compare(runs)
    final = comparison["final"]
    assert final["interval_kind"] == "paired" and final["nsa_minus_dense"] == pytest.approx(0.002)
    assert final["met"] and final["resolved"]
    warnings = ab_compare.sample_warnings(runs, comparison)
    assert any("nsa-seed3, dense-seed4): left out of NSA - dense" in w for w in warnings)
    # a like-for-like pair: nothing to say
    runs = [fake_run("nsa", 0, [5.0, 3.1]), fake_run("dense", 0, [5.0, 3.0])]
    assert ab_compare.sample_warnings(runs, ab_compare.compare(runs)) == []


def test_students_t_past_the_table():
    """Past 30 degrees of freedom t95 follows Student's t, not the normal 1.96 (which is 4% short at 31): the
    published two-sided 95% quantiles at 40, 60 and 120, continuous with the table at 30, falling towards 1.96."""
    for dof, published in ((40, 2.0211), (60, 2.0003), (120, 1.9799), (1000, 1.9623)):
        assert ab_compare.t95(dof) == pytest.approx(published, abs=2e-4), dof
    values = [ab_compare.t95(d) for d in range(1, 400)]
    assert all(a > b for a, b in zip(values, values[1:])) and values[-1] > 1.96
    with pytest.raises(ValueError, match="at least 1 degree of freedom"):
        ab_compare.t95(0)


def test_verdict_edges_run_states_and_the_token_axis(tmp_path):
    """The verdict's "resolved" is the target's distance from the gap (not the gap's from 0); one mode's spread
    stands in for both with both modes' run counts; a stopped run is resumed, not compared; tokens per step count
    gradient accumulation."""
    # paired gaps 0.025 +- (t(2) 4.303 x 0.001 / sqrt 3 = 0.0025): beyond noise, but the target 0.02 lies within 0.005
    # of the gap, outside the interval: resolved (missed) ...
    runs = [fake_run(m, seed, [5.0, 3.0 + (0.025 + d if m == "nsa" else 0)]) for seed, d in enumerate((-0.001, 0, 0.001))
            for m in ("nsa", "dense")]  # fmt: skip
    final = ab_compare.compare(runs)["final"]
    assert final["beyond_noise"] and final["resolved"] and not final["met"]
    # ... and a gap of 0.021 with the same spread is beyond noise yet not resolved (the target is inside)
    runs = [fake_run(m, seed, [5.0, 3.0 + (0.021 + d if m == "nsa" else 0)]) for seed, d in enumerate((-0.001, 0, 0.001))
            for m in ("nsa", "dense")]  # fmt: skip
    final = ab_compare.compare(runs)["final"]
    assert final["beyond_noise"] and not final["resolved"]
    # two NSA seeds, one dense seed, no seed both: NSA's spread for both, sqrt(1/2 + 1/1)
    runs = [fake_run("nsa", 0, [5.0, 3.10]), fake_run("nsa", 1, [5.0, 3.12]), fake_run("dense", 2, [5.0, 3.0])]
    final = ab_compare.compare(runs)["final"]
    assert final["interval_kind"] == "per-mode"
    assert final["interval"] == pytest.approx(12.706 * statistics.stdev([3.10, 3.12]) * (1 / 2 + 1 / 1) ** 0.5)
    assert final["undecided"] == "1 dense seed" and not final["resolved"]  # (dense's own spread is not measured)
    # run states: finished (summary says so), resumable (checkpoint, summary says not finished), new
    run_dir = tmp_path / "nsa-seed0"
    (run_dir / "checkpoints" / "step_00000002").mkdir(parents=True)
    (run_dir / "checkpoints" / "step_00000002" / "trainer_state.json").write_text("{}")
    (run_dir / "summary.json").write_text(json.dumps({"finished": False, "step": 2}))  # stopped by SIGTERM
    assert ab_compare.run_state(run_dir) == "resumable"
    (run_dir / "summary.json").write_text(json.dumps({"finished": True, "step": 4}))
    assert ab_compare.run_state(run_dir) == "finished"
    assert ab_compare.run_state(tmp_path / "dense-seed0") == "new"
    # the token axis: micro-batch x accumulation x processes x sequence length per step
    (run_dir / "run.json").write_text(json.dumps({"config": {"micro_batch_size": 2, "grad_accum": 3, "world_size": 2,
                                                             "seq_len": 64, "seed": 0},
                                                  "model_config": {"attention_mode": "nsa"}}))  # fmt: skip
    (run_dir / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in (
        {"step": 0, "val_loss": 5.0}, {"step": 4, "loss": 4.2, "tok_s": 10.0}, {"step": 4, "val_loss": 4.0})))
    read = ab_compare.read_run(run_dir)
    assert read["tokens_per_step"] == 2 * 3 * 2 * 64 and read["val"] == [(0, 5.0), (4 * 768, 4.0)]
    # runtime model fields (the training length an export records) are not differences between twins
    twins = [{"name": n, "config": {}, "model_config": {"training_seq_len": t, "hidden_size": 8}}
             for n, t in (("a", None), ("b", 2048))]
    assert ab_compare.config_differences(twins) == []
    twins[1]["model_config"]["hidden_size"] = 16
    assert ab_compare.config_differences(twins) == ["a / b: model config hidden_size = 8 / 16"]
    # --model-overrides that differ only in NSA's own fields (an NSA variant against the dense runs of another
    # comparison) are not differences; any other field is
    twins = [{"name": n, "config": {"model_overrides": o}, "model_config": {}}
             for n, o in (("a", '{"sel_num_blocks": 8, "compressor": "mean"}'), ("b", '{"sel_num_blocks": 8}'))]
    assert ab_compare.config_differences(twins) == []
    twins[1]["config"]["model_overrides"] = '{"sel_num_blocks": 8, "intermediate_size": 656}'
    assert ab_compare.config_differences(twins) == [
        "a / b: train config model_overrides = '{\"sel_num_blocks\": 8, \"compressor\": \"mean\"}' / "
        "'{\"sel_num_blocks\": 8, \"intermediate_size\": 656}'"]


def test_kept_runs_compare_model_overrides_as_json(tmp_path):
    """A kept run's --model-overrides is the same however its JSON is spaced; another value is a difference."""
    import dataclasses

    import train_accelerate

    def flags(overrides):
        return ["--model", "tiny", "--model-overrides", overrides, "--output-dir", str(tmp_path / "run")]

    kept = dataclasses.asdict(train_accelerate.parse_args(flags('{"window_size":16}')))
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "run.json").write_text(json.dumps({"config": kept}, default=str))
    ab_compare.check_kept_run_flags(tmp_path / "run", flags('{"window_size": 16}'))  # spaced otherwise: the same
    with pytest.raises(ValueError, match="--model-overrides"):
        ab_compare.check_kept_run_flags(tmp_path / "run", flags('{"window_size": 32}'))


def test_bad_inputs(tmp_path, ab):
    out, data_file, _ = ab
    for flag in ("--seed", "--output-dir", "--attention-mode", "--attention_mode"):
        with pytest.raises(ValueError, match=f"train flag {flag}: ab_compare.py sets"):
            ab_compare.main(["--out", str(tmp_path), "--", *train_flags(data_file), flag, "1"])
    with pytest.raises(ValueError, match=r"--eval-every 0: the comparison needs validation losses"):
        ab_compare.main(["--out", str(tmp_path), "--", *train_flags(data_file), "--eval-every", "0"])
    with pytest.raises(ValueError, match=r"--runs .*nothing: not a training run of train_accelerate.py"):
        ab_compare.main(["--out", str(tmp_path), "--runs", str(out / "nsa-seed3"), str(tmp_path / "nothing")])
    with pytest.raises(ValueError, match=r"give at least two runs"):
        ab_compare.main(["--out", str(tmp_path), "--runs", str(out / "nsa-seed3")])
    blocked = tmp_path / "blocked"
    (blocked / "nsa-seed0").mkdir(parents=True)
    (blocked / "nsa-seed0" / "metrics.jsonl").write_text("")
    with pytest.raises(ValueError, match=r"nsa-seed0 holds the output of an unfinished run without checkpoints"):
        ab_compare.main(["--out", str(blocked), "--seeds", "0", "--", *train_flags(data_file)])
    with pytest.raises(SystemExit):
        ab_compare.main(["--out", str(tmp_path), "--seeds", "1", "1", "--", *train_flags(data_file)])


def test_a_training_flag_before_the_separator_is_told_where_it_goes(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        ab_compare.main(["--out", str(tmp_path), "--preset", "smoke", "--max-steps", "5"])
    assert exit_info.value.code == 2
    assert ("unrecognized arguments: --preset smoke --max-steps 5 (training flags go after --: ab_compare.py --out DIR "
            "-- --preset smoke --max-steps 5 ...)") in capsys.readouterr().err
    assert not any(tmp_path.iterdir())
    # the trainer's --seed is not read as this command's --seeds (no abbreviations): it is told where it goes
    with pytest.raises(SystemExit):
        ab_compare.main(["--out", str(tmp_path), "--seed", "1"])
    assert "unrecognized arguments: --seed 1 (training flags go after --" in capsys.readouterr().err


def test_relative_paths_are_read_from_the_directory_the_command_runs_in(ab, tmp_path, monkeypatch):
    """A relative --dataset after -- and a relative --out name what the user sees where the command runs (the runs
    once started in the repository root: `--dataset docs.jsonl` failed there, or read a same-named file of the
    repository); a kept run's relative --init-from is read from there too."""
    _, data_file, _ = ab
    shutil.copy(data_file, tmp_path / "docs.jsonl")
    monkeypatch.chdir(tmp_path)
    one = ab_compare.main(["--out", "relout", "--seeds", "0", "--modes", "nsa", "--", *train_flags(Path("docs.jsonl"))])
    assert one == {"runs": [str(tmp_path / "relout" / "nsa-seed0")]}
    record = json.loads((tmp_path / "relout" / "nsa-seed0" / "run.json").read_text())
    assert record["config"]["dataset"] == "docs.jsonl"
    assert json.loads((tmp_path / "relout" / "nsa-seed0" / "summary.json").read_text())["finished"]
    # a run kept in --out that started from a relative path here is the run this command starts from its absolute form
    kept = tmp_path / "kept"
    kept.mkdir()
    (tmp_path / "start" / "final").mkdir(parents=True)
    (kept / "run.json").write_text(json.dumps({"config": {"init_from": "start/final"}}))
    ab_compare.check_kept_run_start(kept, str(tmp_path / "start" / "final"))
    with pytest.raises(ValueError, match=r"started from start/final, not from random weights"):
        ab_compare.check_kept_run_start(kept, None)


def test_a_failed_run_says_where_its_output_is_and_bad_seeds_are_refused_first(tmp_path, capfd):
    """A run that fails at once (a typoed training flag) never creates its directory: the error names where its
    output went, this console (--jobs 1) or its log (--jobs 2), and its directory only where the run wrote there;
    seeds the trainer refuses (negative, >= 2**32) are refused before any run starts."""
    failing = tmp_path / "failing_trainer.py"  # the launcher: stands in for a trainer refusing its flags
    failing.write_text("import pathlib, sys\n"
                       "run = pathlib.Path(sys.argv[sys.argv.index('--output-dir') + 1])\n"
                       "if '--write-first' in sys.argv:\n"
                       "    run.mkdir(parents=True)\n"
                       "    (run / 'metrics.jsonl').write_text('')\n"
                       "print('train_accelerate.py: error: unrecognized arguments: --max-stepz 3', file=sys.stderr)\n"
                       "sys.exit(2)\n")  # fmt: skip
    launcher = f"{sys.executable} {failing}"
    out = tmp_path / "ab"
    with pytest.raises(RuntimeError) as failed:
        ab_compare.main(["--out", str(out), "--seeds", "0", "--launcher", launcher, "--", "--max-stepz", "3"])
    said = str(failed.value).split(" Command: ")[0]
    assert said == "the nsa run of seed 0 failed (exit 2); its output is above, on this console."
    # where it says: the console (capfd: the child's own stderr)
    assert "unrecognized arguments: --max-stepz 3" in capfd.readouterr().err
    with pytest.raises(RuntimeError) as failed:
        ab_compare.main(["--out", str(out), "--seeds", "0", "--jobs", "2", "--launcher", launcher, "--", "--max-stepz",
                         "3"])  # fmt: skip
    found = re.match(r"the (nsa|dense) run of seed 0 failed \(exit 2\); its output is in its log, (\S+)\. Command: ",
                     str(failed.value))  # fmt: skip
    assert found, str(failed.value)
    assert Path(found.group(2)) == out / f"{found.group(1)}-seed0.log"
    assert "unrecognized arguments: --max-stepz 3" in Path(found.group(2)).read_text()
    assert not (out / "nsa-seed0").exists() and not (out / "dense-seed0").exists()
    # a run that wrote something before failing: its directory is named too
    with pytest.raises(RuntimeError, match=rf"its output is above, on this console; what it wrote is in "
                                           rf"{re.escape(str(tmp_path / 'wrote' / 'nsa-seed0'))}\. Command: "):
        ab_compare.main(["--out", str(tmp_path / "wrote"), "--seeds", "0", "--launcher", launcher, "--",
                         "--write-first"])  # fmt: skip
    for seeds in (["0", "-1"], ["4294967296"]):
        with pytest.raises(SystemExit) as refused:
            ab_compare.main(["--out", str(tmp_path / "seeds"), "--seeds", *seeds, "--launcher", launcher, "--",
                             "--max-steps", "3"])  # fmt: skip
        assert refused.value.code == 2
        assert (f"--seeds {seeds[-1]}: the trainer takes seeds in [0, 2**32) (numpy's and torch's); give seeds such "
                "as --seeds 0 1 2.") in capfd.readouterr().err
        assert not (tmp_path / "seeds").exists()  # no run started


def test_jobs_on_a_cpu_share_the_cores_unless_omp_num_threads_is_set(tmp_path, monkeypatch, capsys):
    """--jobs 2 on a CPU without OMP_NUM_THREADS: each run gets cores // 2 threads (unset, each run's torch takes
    every core and the runs oversubscribe them), said on one line; a value the user set is kept; one run at a time
    gets none."""
    recorder = tmp_path / "recording_trainer.py"  # the launcher: a finished run recording the threads it was given
    recorder.write_text("import json, os, pathlib, sys\n"
                        "flag = lambda name: sys.argv[sys.argv.index(name) + 1]\n"
                        "run = pathlib.Path(flag('--output-dir'))\n"
                        "run.mkdir(parents=True)\n"
                        "(run / 'threads').write_text(os.environ.get('OMP_NUM_THREADS', 'unset'))\n"
                        "(run / 'run.json').write_text(json.dumps({'config': {'seed': int(flag('--seed')), "
                        "'micro_batch_size': 1, 'seq_len': 8}, 'model_config': {'attention_mode': "
                        "flag('--attention-mode')}, 'num_parameters': 1}))\n"
                        "(run / 'metrics.jsonl').write_text(json.dumps({'step': 1, 'val_loss': 3.0}) + '\\n')\n"
                        "(run / 'summary.json').write_text(json.dumps({'finished': True, 'step': 1}))\n")  # fmt: skip
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(ab_compare, "usable_cores", lambda: 8)
    monkeypatch.setattr(ab_compare, "runs_on_cpu", lambda launcher: True)

    def threads(out, jobs):
        ab_compare.main(["--out", str(out), "--seeds", "0", "--jobs", str(jobs), "--launcher",
                         f"{sys.executable} {recorder}", "--", "--max-steps", "1"])  # fmt: skip
        return {(out / f"{m}-seed0" / "threads").read_text() for m in ("nsa", "dense")}

    assert threads(tmp_path / "two", 2) == {"4"}
    assert ("OMP_NUM_THREADS is not set: each run gets OMP_NUM_THREADS=4 (8 cores // 2 runs at once), so that their "
            "threads do not oversubscribe the CPU") in capsys.readouterr().out
    assert threads(tmp_path / "one", 1) == {"unset"} and "OMP_NUM_THREADS" not in capsys.readouterr().out
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert threads(tmp_path / "set", 2) == {"3"} and "OMP_NUM_THREADS is not set" not in capsys.readouterr().out
    monkeypatch.delenv("OMP_NUM_THREADS")
    # at least one thread each; none on a GPU; never more runs counted than train at once
    monkeypatch.setattr(ab_compare, "usable_cores", lambda: 1)
    assert ab_compare.thread_env(2, []) == {"OMP_NUM_THREADS": "1"}
    assert ab_compare.thread_env(1, []) == {}
    # a launcher of several processes a run shares the cores among all of them
    monkeypatch.setattr(ab_compare, "usable_cores", lambda: 8)
    accelerate = ["accelerate", "launch", "--cpu", "--num_processes", "2"]
    assert ab_compare.thread_env(2, accelerate) == {"OMP_NUM_THREADS": "2"}
    assert "(8 cores // 2 runs at once x 2 processes each)" in capsys.readouterr().out
    assert ab_compare.thread_env(2, ["torchrun", "--nproc-per-node=4"]) == {"OMP_NUM_THREADS": "1"}
    assert ab_compare.processes_per_run(["accelerate", "launch", "--config_file", "c.yaml"]) == 1
    monkeypatch.setattr(ab_compare, "runs_on_cpu", lambda launcher: False)
    assert ab_compare.thread_env(4, []) == {}


def test_runs_that_are_not_twins_and_modes_of_one_seed_get_no_verdict(ab, tmp_path):
    """--runs nsa-seed3 dense-seed1 (no seed in common): the comparison says no seed is paired and which seeds ran,
    instead of passing them for twins; NSA's two seeds against one dense run: no met / missed from NSA's spread
    alone, "undecided: 1 dense seed"."""
    out, _, _ = ab
    other = tmp_path / "elsewhere" / "dense-seed1"
    shutil.copytree(out / "dense-seed3", other)
    record = json.loads((other / "run.json").read_text())
    record["config"]["seed"] = 1
    (other / "run.json").write_text(json.dumps(record))
    compared = ab_compare.main(["--out", str(tmp_path / "cmp"), "--runs", str(out / "nsa-seed3"), str(other)])
    table = (tmp_path / "cmp" / "ab_compare.md").read_text()
    assert "- no seed paired: no seed ran once in each mode (nsa seed 3; dense seed 1), so NSA - dense is the " \
           "difference of the modes' means over different seeds" in table
    assert "But no seed is paired (nsa-seed3, dense-seed1: no seed ran once in each mode)" in table
    assert "target <= +0.02: undecided: 1 nsa seed, 1 dense seed;" in table
    assert compared["comparison"]["final"]["undecided"] == "1 nsa seed, 1 dense seed"
    # two NSA seeds close together, one dense seed: the interval would be NSA's spread alone (+-0.0011), and the
    # target far outside it once read "met"
    runs = [fake_run("nsa", 0, [5.0, 3.1000]), fake_run("nsa", 1, [5.0, 3.1001]), fake_run("dense", 0, [5.0, 3.2])]
    comparison = ab_compare.compare(runs)
    final = comparison["final"]
    assert final["interval"] < 0.01 and final["met"] and final["spread_from"] == ["nsa"]
    assert final["undecided"] == "1 dense seed" and not final["resolved"]
    warnings = ab_compare.sample_warnings(runs, comparison)
    text = ab_compare.markdown([], comparison, [], warnings)
    assert "(target <= +0.02: undecided: 1 dense seed; the gap's 95% interval needs two seeds or more of each mode" in text
    assert "met by the means" in text and "from nsa's spread alone" in text and ": met)" not in text
    assert any("runs without a twin of their seed in the other mode (nsa-seed1): NSA - dense and its interval are "
               "taken from the modes' means and spreads, not paired by seed (paired: seed 0 alone)" in w
               for w in warnings)
    assert ab_compare.unpaired_note(runs, comparison) == " Not paired (no twin of their seed in the other mode): nsa-seed1."
    # a second dense seed: each mode's spread, a verdict
    runs.append(fake_run("dense", 1, [5.0, 3.2001]))
    final = ab_compare.compare(runs)["final"]
    assert final["undecided"] is None and final["resolved"] and final["met"]


# ----------------------------------------------------------------------------- bench/build_corpus.py


def fake_linux_doc_deb(path: Path) -> Path:
    """A .deb laid out as linux-doc's: an ar archive whose data.tar.xz holds html/_sources/**/*.txt pages."""
    import io
    import tarfile

    prose = "The scheduler picks the next task to run on each processor. " * 12
    pages = {
        "process/howto.rst.txt": (".. SPDX-License-Identifier: GPL-2.0\n\n.. _howto:\n\nHOWTO\n=====\n\n"
                                  f"{prose}\nSee :ref:`the rules <rules>` and ``make htmldocs``.\n"),
        "hwmon/table.rst.txt": "+----+----+\n| 0x | 1f |\n+----+----+\n" * 40,  # mostly not letters: dropped
        "short.rst.txt": "Too short.\n",  # under --min-chars: dropped
        "translations/it_IT/howto.rst.txt": prose,  # a translation: dropped
    }  # fmt: skip

    def xz_tar(files: dict[str, str]) -> bytes:
        data = io.BytesIO()
        with tarfile.open(fileobj=data, mode="w:xz") as tar:
            for name, text in files.items():
                blob = text.encode()
                info = tarfile.TarInfo(name)
                info.size = len(blob)
                tar.addfile(info, io.BytesIO(blob))
        return data.getvalue()

    control = "Package: linux-doc-6.12\nSource: linux\nVersion: 6.12.117-1~deb12u1\nArchitecture: all\n"
    data = xz_tar({f"./usr/share/doc/linux-doc-6.12/html/_sources/{name}": text for name, text in pages.items()})
    members = [("debian-binary", b"2.0\n"), ("control.tar.xz", xz_tar({"./control": control})), ("data.tar.xz", data)]
    out = b"!<arch>\n"
    for name, blob in members:
        out += f"{name + '/':<16}{0:<12}{0:<6}{0:<6}{100644:<8}{len(blob):<10}`\n".encode() + blob
        out += b"\n" if len(blob) % 2 else b""
    path.write_bytes(out)
    return path


def test_build_corpus_from_a_deb(tmp_path):
    import pyarrow.parquet as pq

    import build_corpus

    out = tmp_path / "corpus.parquet"
    stats = build_corpus.main(["--deb", str(fake_linux_doc_deb(tmp_path / "linux-doc.deb")), "--out", str(out),
                               "--min-chars", "200"])  # fmt: skip
    rows = pq.read_table(out).to_pylist()
    assert stats["documents"] == 1 and stats["pages_read"] == 4
    assert [r["id"] for r in rows] == ["process/howto.rst"] and rows[0]["license"] == "GPL-2.0"
    text = rows[0]["text"]
    assert text.startswith("HOWTO\n\nThe scheduler picks") and "=====" not in text and "SPDX" not in text
    assert text.endswith("See the rules and make htmldocs.")
    with pytest.raises(ValueError, match=r"--deb .*: not a Debian package"):
        build_corpus.main(["--deb", str(out), "--out", str(tmp_path / "x.parquet")])
    # which corpus this is, beside it: the package and version from the .deb's control file, both files' sha256
    record = json.loads((tmp_path / "corpus.parquet.source").read_text())
    assert (record["package"], record["version"]) == ("linux-doc-6.12", "6.12.117-1~deb12u1")
    assert record["parquet_sha256"] == hashlib.sha256(out.read_bytes()).hexdigest() == stats["source"]["parquet_sha256"]
    assert record["deb_sha256"] == hashlib.sha256((tmp_path / "linux-doc.deb").read_bytes()).hexdigest()
    assert record["documents"] == 1 and record["min_chars"] == 200
    # the folder, record beside the corpus, is still a --dataset the trainer reads: one data file in it
    sys.path.insert(0, str(ROOT))
    from nsa_train.data import LocalFiles

    assert LocalFiles(str(tmp_path)).files == [out]


def test_build_corpus_downloads_a_pinned_version(tmp_path, monkeypatch):
    """--package NAME=VERSION: apt-get download names the file NAME_VERSION_ARCH.deb, which is found; a version
    the mirror does not serve is said with the command that lists those it does."""
    import build_corpus

    calls = []

    def fake_apt(command, cwd, **kwargs):
        calls.append(command)
        name, _, version = command[2].partition("=")
        if version == "0.0-gone":
            return subprocess.CompletedProcess(command, 100, "", f"E: Version '{version}' for '{name}' was not found")
        fake_linux_doc_deb(Path(cwd) / f"{name}_{version or '6.12.118-1~deb12u1'}_all.deb")
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(build_corpus.subprocess, "run", fake_apt)
    stats = build_corpus.main(["--package", "linux-doc-6.12=6.12.117-1~deb12u1", "--out",
                               str(tmp_path / "c.parquet"), "--min-chars", "200"])  # fmt: skip
    assert calls[-1] == ["apt-get", "download", "linux-doc-6.12=6.12.117-1~deb12u1"]
    assert stats["documents"] == 1 and stats["source"]["version"] == "6.12.117-1~deb12u1"
    with pytest.raises(RuntimeError, match=r"does not serve version 0.0-gone.*apt-cache policy linux-doc-6.12"):
        build_corpus.main(["--package", "linux-doc-6.12=0.0-gone", "--out", str(tmp_path / "d.parquet")])


def _session_step_flags(step_name, tmp_path):
    """The train flags bench/gpu_session.sh's step hands ab_compare, with the script's defaults (NAME=${NAME:-x})
    and its data paths filled in; also the step's ab_compare command line and the defaults."""
    script = (ROOT / "bench" / "gpu_session.sh").read_text()
    step = script.split(f"    {step_name})", 1)[1].split(";;", 1)[0]
    command = re.split(r"(?<!\\)\n", step.split("bench/ab_compare.py", 1)[1], maxsplit=1)[0]  # up to its last line
    command = command.replace("\\\n", " ")
    defaults = script_defaults()  # AB_STEPS=${AB_STEPS:-300} -> {"AB_STEPS": "300"}
    # ${NAME:+...} of a variable empty by default (RT_OVERRIDES) adds nothing
    command = re.sub(r"\$\{(\w+):\+[^}]*\}", lambda m: "" if not defaults.get(m.group(1)) else m.group(0), command)
    values = {f'"${name}"': value for name, value in defaults.items()}
    values |= {'"$LONG_DOCS"': str(tmp_path / "docs.parquet"), '"$RETRIEVAL_ROWS"': str(tmp_path / "rows.parquet"),
               '"$DATA/gpt2-tokenizer"': str(tmp_path / "tok")}
    flags = []
    for f in command.split(" -- ", 1)[1].split():  # an unquoted $NAME: its default's words (RT_LENGTHS)
        flags += defaults[f[1:]].split() if f.startswith("$") and f[1:] in defaults else [values.get(f, f)]
    return flags, command, defaults


def test_the_gpu_sessions_long_document_ab_passes_flags_the_trainer_takes(tmp_path):
    """bench/gpu_session.sh's ab-long step (one device call of a session) hands ab_compare training flags: a typo or
    a removed flag must fail here, on CPU, not after the machine has started."""
    import train_accelerate

    flags, command, defaults = _session_step_flags("ab-long", tmp_path)
    assert "--dataset" in flags and "--seq-len" in flags and "--max-steps" in flags, flags
    ab_compare.check_train_flags(flags)
    cfg = train_accelerate.parse_args(flags + ["--output-dir", str(tmp_path / "run")])
    assert (cfg.model, cfg.seq_len, cfg.max_steps, cfg.eval_every) == ("125m", 4096, 300, 100)
    assert "--seeds $AB_SEEDS" in command and defaults["AB_SEEDS"] == "0 1 2"  # the verdict's interval needs three


def test_the_gpu_sessions_retrieval_step_passes_flags_the_trainer_takes(tmp_path):
    """The retrieval step (both twins trained on passkey rows at 8x the window, then the passkey evaluation): its
    flags parse, the rows are 8x NSA's window, and the evaluation runs on each twin at lengths up to 2x the rows."""
    import train_accelerate

    from modeling_nsa import NSAConfig

    flags, command, defaults = _session_step_flags("retrieval", tmp_path)
    ab_compare.check_train_flags(flags)
    cfg = train_accelerate.parse_args(flags + ["--output-dir", str(tmp_path / "run")])
    assert (cfg.model, cfg.seq_len, cfg.max_steps) == ("125m", 4096, int(defaults["RT_STEPS"]))
    assert cfg.eval_long_context and cfg.long_context_task == "passkey"
    assert cfg.long_context_lengths == [1024, 2048, 4096, 8192] and cfg.eval_every == cfg.max_steps
    assert cfg.seq_len == 8 * NSAConfig().window_size
    assert "--seeds 0" in command
    # then each twin's answer log-probability (graded where greedy answers are all wrong)
    script = (ROOT / "bench" / "gpu_session.sh").read_text().split("    retrieval)", 1)[1].split(";;", 1)[0]
    assert "for mode in dense nsa" in script and "--scoring loglik" in script


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads the process table from /proc (Linux)")
def test_a_stopped_comparison_stops_its_runs(tmp_path):
    """SIGTERM to ab_compare (a scheduler's stop) reaches the runs, which sit in sessions of their own: none is left
    running after the comparison exits. The runs are a stand-in launcher that writes its first metrics line and
    waits (the trainer's own SIGTERM handling: test_train_loop.py's test_sigterm_saves_and_resume_continues)."""
    import os
    import signal
    import subprocess
    import time

    data_file = tmp_path / "docs.jsonl"
    data_file.write_text("\n".join(json.dumps({"text": "word " * 60}) for _ in range(40)))
    waiting_trainer = tmp_path / "waiting_trainer.py"  # the launcher: a run that never ends by itself
    waiting_trainer.write_text(
        "import pathlib, sys, time\n"
        "run = pathlib.Path(sys.argv[sys.argv.index('--output-dir') + 1])\n"
        "run.mkdir(parents=True, exist_ok=True)\n"
        "(run / 'metrics.jsonl').write_text('{\"step\": 1}\\n')\n"
        "time.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, str(ROOT / "bench" / "ab_compare.py"), "--out", str(tmp_path / "out"),
                             "--jobs", "2", "--launcher", f"{sys.executable} {waiting_trainer}", "--",
                             *train_flags(data_file)], cwd=ROOT)  # fmt: skip
    deadline = time.time() + 120
    while time.time() < deadline and not all((tmp_path / "out" / f"{m}-seed0" / "metrics.jsonl").exists()
                                              for m in ("nsa", "dense")):
        time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) != 0
    time.sleep(1)

    def command_line(pid):
        try:
            return (Path("/proc") / pid / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:  # exited meanwhile
            return ""

    left = [pid for pid in os.listdir("/proc") if pid.isdigit() and str(tmp_path / "out") in command_line(pid)]
    assert not left, [command_line(pid) for pid in left]


def test_a_run_stopped_before_its_last_step_is_not_compared(tmp_path, ab):
    """A run the trainer stopped on SIGTERM exits 0 with a checkpoint and an unfinished summary: the comparison
    says so and compares nothing (it compared the partial curve before); --runs refuses such a run, and a run
    given twice (it would count as two seeds)."""
    out, _, _ = ab
    stopping_trainer = tmp_path / "stopping_trainer.py"  # the launcher: stands in for a trainer stopped at step 2
    stopping_trainer.write_text(
        "import json, pathlib, sys\n"
        "run = pathlib.Path(sys.argv[sys.argv.index('--output-dir') + 1])\n"
        "(run / 'checkpoints' / 'step_00000002').mkdir(parents=True)\n"
        "(run / 'checkpoints' / 'step_00000002' / 'trainer_state.json').write_text('{}')\n"
        "(run / 'summary.json').write_text(json.dumps({'finished': False, 'step': 2}))\n")
    with pytest.raises(RuntimeError, match=r"the nsa run of seed 0 stopped before its last step .* Run this command "
                                           r"again to resume it"):  # fmt: skip
        ab_compare.main(["--out", str(tmp_path / "ab"), "--seeds", "0", "--launcher",
                         f"{sys.executable} {stopping_trainer}", "--", "--max-steps", "4", "--eval-every", "2"])
    assert not (tmp_path / "ab" / "ab_compare.md").exists()
    with pytest.raises(ValueError, match=r"--runs \S*nsa-seed0: not finished"):
        ab_compare.main(["--out", str(tmp_path / "cmp"), "--runs", str(tmp_path / "ab" / "nsa-seed0"),
                         str(out / "dense-seed0")])  # fmt: skip
    with pytest.raises(SystemExit):
        ab_compare.main(["--out", str(tmp_path / "cmp"), "--runs", str(out / "nsa-seed0"), str(out / "nsa-seed0")])


def test_stop_at_step_compares_a_prefix_and_the_same_command_without_it_trains_on(tmp_path, capsys, ab):
    """The trainer's --stop-at-step among the flags: every run stops there (a checkpoint) and the runs are compared
    up to it, the notes saying it is a prefix; the command again skips them; without the flag they resume and
    finish, compared as any finished runs."""
    _, data_file, _ = ab
    flags = [*train_flags(data_file), "--max-steps", "3"]
    out = tmp_path / "ab"
    first = ab_compare.main(["--out", str(out), "--seeds", "0", "--", *flags, "--stop-at-step", "2"])
    assert [(r["finished"], r["steps"]) for r in first["runs"]] == [(False, 2), (False, 2)]
    assert [n for n in first["config_differences"] if n.startswith("a prefix: runs stopped at step 2 of --max-steps 3")]
    assert first["comparison"]["curve"][-1]["tokens"] == 2 * 2 * 64  # the last evaluation both runs made: step 2
    again = ab_compare.main(["--out", str(out), "--seeds", "0", "--", *flags, "--stop-at-step", "2"])
    assert capsys.readouterr().out.count("stopped at --stop-at-step 2 already, not trained further") == 2
    assert again["comparison"] == first["comparison"]
    done = ab_compare.main(["--out", str(out), "--seeds", "0", "--", *flags])
    assert capsys.readouterr().out.count("resuming: ") == 2
    assert [(r["finished"], r["steps"]) for r in done["runs"]] == [(True, 3), (True, 3)]
    assert done["config_differences"] == [] and done["comparison"]["curve"][-1]["tokens"] == 3 * 2 * 64


def test_train_gpu_summary_names_a_directory_that_is_not_a_run(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "train_gpu_summary.py"), str(tmp_path)],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 2 and f"no metrics.jsonl in {tmp_path}: pass train_accelerate.py output" in proc.stderr
