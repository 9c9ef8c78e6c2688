"""bench/position_shift.py: the trainer's loss by position on the held-out rows, and on the rows started later."""

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from modeling_nsa import NSAConfig, NSAForCausalLM
from nsa_train.data import load_tokenizer, make_source, validation_rows
from nsa_train.evaluation import OneProcess, validation_loss

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import position_shift  # noqa: E402


@pytest.fixture(scope="module")
def saved_model_and_data(tmp_path_factory):
    """A seeded tiny NSA model (window 8: ranges 0-7, 8-15, 16-31 at 32 tokens) saved as a checkpoint, and a
    JSONL file of three documents."""
    folder = tmp_path_factory.mktemp("shift")
    torch.manual_seed(0)
    model = NSAForCausalLM(NSAConfig(vocab_size=384, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=1, head_dim=16, cmp_block_size=4,
                                     cmp_stride=2, sel_block_size=4, sel_num_blocks=3, window_size=8,
                                     nsa_backend="reference"))  # fmt: skip
    model.save_pretrained(folder / "model")
    texts = ["The first document, long enough for several rows of thirty-two bytes each. " * 3,
             "A second one.", "And a third document that ends the held-out text."]  # fmt: skip
    (folder / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return folder / "model", folder / "docs.jsonl"


def test_shift_zero_is_the_trainers_validation_loss_and_a_shift_moves_the_text(saved_model_and_data, tmp_path, capsys):
    model_dir, docs = saved_model_and_data
    out = tmp_path / "shift.json"
    results = position_shift.main([str(model_dir), "--dataset", str(docs), "--tokenizer", "byt5", "--seq-len", "32",
                                   "--val-every-doc", "1", "--val-tokens", "1000000", "--shifts", "0", "5",
                                   "--out", str(out), "--device", "cpu"])  # fmt: skip
    assert json.loads(out.read_text()) == results
    by_shift = results[str(model_dir)]
    # shift 0: the rows the trainer evaluates (validation_rows without skip_tokens), the trainer's own function
    model = NSAForCausalLM.from_pretrained(model_dir).eval()
    tokenizer = load_tokenizer("byt5")
    rows = validation_rows(make_source(str(docs)), tokenizer, 32, 1, 10**6)
    expected = validation_loss(model, rows, 8, OneProcess())
    assert by_shift["0"] == pytest.approx(expected, rel=1e-6)
    assert set(by_shift["0"]) >= {"val_loss", "val_loss_pos0to8", "val_loss_pos8to16", "val_loss_pos16to32"}
    # shift 5: other text at each position, so other losses (the same model)
    assert by_shift["5"]["val_loss_pos0to8"] != pytest.approx(by_shift["0"]["val_loss_pos0to8"], rel=1e-4)
    printed = capsys.readouterr().out
    assert "| shift | every position | 0-7 | 8-15 | 16-31 |" in printed
    assert f"| 5 | {by_shift['5']['val_loss']:.4f} | {by_shift['5']['val_loss_pos0to8']:.4f} |" in printed


def test_bad_shifts_and_lengths_name_the_value(saved_model_and_data):
    model_dir, docs = saved_model_and_data
    common = [str(model_dir), "--dataset", str(docs), "--tokenizer", "byt5", "--val-every-doc", "1"]
    with pytest.raises(ValueError, match=r"--shifts \[0, -4\]"):
        position_shift.main([*common, "--seq-len", "32", "--shifts", "0", "-4"])
    with pytest.raises(ValueError, match="--seq-len 1"):
        position_shift.main([*common, "--seq-len", "1"])
    with pytest.raises(ValueError, match="skip_tokens 5000"):  # past the first held-out document
        position_shift.main([*common, "--seq-len", "32", "--shifts", "5000"])
    with pytest.raises(ValueError, match="--val-tokens 0: pass the run's values"):
        position_shift.main([*common, "--seq-len", "32", "--val-tokens", "0"])
    with pytest.raises(ValueError, match="MODEL given twice"):
        position_shift.main([str(model_dir), *common, "--seq-len", "32"])


def test_cross_doc_rows_and_repeated_shifts(saved_model_and_data):
    """--cross-doc evaluates the rows a --cross-doc run held out (positions run across the row), and a shift given
    twice is evaluated once."""
    model_dir, docs = saved_model_and_data
    results = position_shift.main([str(model_dir), "--dataset", str(docs), "--tokenizer", "byt5", "--seq-len", "32",
                                   "--val-every-doc", "1", "--cross-doc", "--shifts", "3", "0", "3"])  # fmt: skip
    by_shift = results[str(model_dir)]
    assert list(by_shift) == ["0", "3"]
    model = NSAForCausalLM.from_pretrained(model_dir).eval()
    rows = validation_rows(make_source(str(docs)), load_tokenizer("byt5"), 32, 1, 65536, cross_doc=True)
    assert by_shift["0"] == pytest.approx(validation_loss(model, rows, 8, OneProcess()), rel=1e-6)
    plain = validation_rows(make_source(str(docs)), load_tokenizer("byt5"), 32, 1, 65536)
    assert by_shift["0"]["val_loss"] != pytest.approx(validation_loss(model, plain, 8, OneProcess())["val_loss"], rel=1e-6)


def test_a_runs_relative_dataset_is_read_where_it_was_launched_and_must_hold_the_same_bytes(saved_model_and_data,
                                                                                             tmp_path):
    """run.json's --dataset as typed ("data/docs.jsonl") was relative to the launch's directory (run.json's
    launches record it), not this process's; and its files must hold the bytes the run read (their sha256 in
    run.json): a file replaced under the same name would give other rows without a word. A --dataset given is
    evaluated as given."""
    import hashlib

    model_dir, docs = saved_model_and_data
    launched = tmp_path / "elsewhere"
    (launched / "data").mkdir(parents=True)
    shutil.copy(docs, launched / "data" / "docs.jsonl")
    run = tmp_path / "nsa-seed0"
    shutil.copytree(model_dir, run / "final")
    digest = hashlib.sha256((launched / "data" / "docs.jsonl").read_bytes()).hexdigest()
    (run / "run.json").write_text(json.dumps({
        "config": {"seed": 0, "dataset": "data/docs.jsonl", "dataset_config": None, "text_column": "text",
                   "seq_len": 32, "val_every_doc": 2, "val_tokens": 10**6, "cross_doc_attention": False},
        "launches": [{"cwd": str(launched), "data_sha256": {"data/docs.jsonl": digest}}]}))  # fmt: skip
    model = NSAForCausalLM.from_pretrained(model_dir).eval()
    rows = validation_rows(make_source(str(docs)), load_tokenizer("byt5"), 32, 2, 10**6)
    expected = validation_loss(model, rows, 8, OneProcess())["val_loss"]
    results = position_shift.main([str(run), "--tokenizer", "byt5", "--shifts", "0"])
    assert results[str(run)]["0"]["val_loss"] == pytest.approx(expected, rel=1e-6)
    lines = (launched / "data" / "docs.jsonl").read_text().splitlines()
    (launched / "data" / "docs.jsonl").write_text("\n".join(reversed(lines)) + "\n")  # the same name, other bytes
    with pytest.raises(ValueError, match=r"--dataset \S*elsewhere/data/docs.jsonl: its files are not the ones \S*"
                                         r"nsa-seed0 read \(sha256 differs: docs.jsonl"):  # fmt: skip
        position_shift.main([str(run), "--tokenizer", "byt5", "--shifts", "0"])
    given = position_shift.main([str(run), "--tokenizer", "byt5", "--shifts", "0", "--dataset",
                                 str(launched / "data" / "docs.jsonl")])  # fmt: skip
    assert given[str(run)]["0"]["val_loss"] != pytest.approx(expected, rel=1e-6)  # other rows, as asked
    (launched / "data" / "docs.jsonl").unlink()
    with pytest.raises(FileNotFoundError, match=r"the --dataset of \S*nsa-seed0, from its run.json\); give --dataset"):
        position_shift.main([str(run), "--tokenizer", "byt5", "--shifts", "0"])


def test_a_runs_directory_or_final_gives_the_held_out_rows_flags(saved_model_and_data, tmp_path, capsys):
    """A MODEL inside a run (its directory or its final/) takes the rows' flags from the run's run.json, so shift
    0 is the run's own validation loss without retyping them; flags given still win."""
    model_dir, docs = saved_model_and_data
    run = tmp_path / "nsa-seed0"
    shutil.copytree(model_dir, run / "final")
    (run / "run.json").write_text(json.dumps({"config": {
        "seed": 0, "dataset": str(docs), "dataset_config": None, "text_column": "text", "seq_len": 32,
        "val_every_doc": 2, "val_tokens": 10**6, "cross_doc_attention": False}}))  # fmt: skip
    model = NSAForCausalLM.from_pretrained(model_dir).eval()
    rows = validation_rows(make_source(str(docs)), load_tokenizer("byt5"), 32, 2, 10**6)
    expected = validation_loss(model, rows, 8, OneProcess())["val_loss"]
    for spec in (run, run / "final"):
        results = position_shift.main([str(spec), "--tokenizer", "byt5", "--shifts", "0"])
        assert results[str(spec)]["0"]["val_loss"] == pytest.approx(expected, rel=1e-6)
    said = capsys.readouterr().err
    assert "held-out rows: --dataset " in said and "--seq-len 32 --val-every-doc 2 --val-tokens 1000000" in said
    every = position_shift.main([str(run), "--tokenizer", "byt5", "--shifts", "0", "--val-every-doc", "1"])
    assert every[str(run)]["0"]["val_loss"] != pytest.approx(expected, rel=1e-6)  # the given flag wins
    # --out: a JSON file, written and said; a folder there is refused before any model is evaluated
    position_shift.main([str(run), "--tokenizer", "byt5", "--shifts", "0", "--out", str(tmp_path / "shift.json")])
    assert str(json.loads((tmp_path / "shift.json").read_text())[str(run)]["0"]["val_loss"])
    assert f"wrote {tmp_path / 'shift.json'}" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"^--out '.*nsa-seed0' is a folder; this output is one file"):
        position_shift.main([str(run), "--tokenizer", "byt5", "--shifts", "0", "--out", str(run)])
