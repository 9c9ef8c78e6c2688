"""bench/branch_ablation.py: a trained NSA model's validation loss with each branch removed, checked against the same
branch removed another way (its gate pre-activation at -inf in the model's own gate projection), and the groups'
means and paired gaps."""

import json
import shutil
import statistics
import sys
from pathlib import Path

import pytest
import torch

from modeling_nsa import NSAConfig, NSAForCausalLM
from modeling_nsa.configuration_nsa import BRANCHES
from nsa_train.data import load_tokenizer, make_source, validation_rows
from nsa_train.evaluation import OneProcess, validation_loss

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import branch_ablation  # noqa: E402

DATA_FLAGS = ["--tokenizer", "byt5", "--seq-len", "32", "--val-every-doc", "1", "--val-tokens", "1000000"]


def tiny_config(**overrides) -> NSAConfig:
    """A tiny NSA config; initializer_range 0.5: weights large enough that removing any branch moves the loss by more
    than the comparisons' tolerance (at the default 0.02 removing the compressed branch moves it by about 1e-5)."""
    fields = dict(vocab_size=384, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=16, cmp_block_size=4, cmp_stride=2, sel_block_size=4,
                  sel_num_blocks=3, window_size=8, nsa_backend="reference", initializer_range=0.5)  # fmt: skip
    return NSAConfig(**{**fields, **overrides})


@pytest.fixture(scope="module")
def runs_and_data(tmp_path_factory):
    """Two runs' directories (run.json with seeds 0 and 1, final/ with seeded tiny NSA models, window 8 of 32-token
    rows, so the selected and compressed branches see keys the window does not), a saved model outside a run, and a
    JSONL file of three documents."""
    folder = tmp_path_factory.mktemp("ablation")
    for seed in (0, 1):
        torch.manual_seed(seed)
        NSAForCausalLM(tiny_config()).save_pretrained(folder / f"run{seed}" / "final")
        (folder / f"run{seed}" / "run.json").write_text(json.dumps({"config": {"seed": seed}}))
    shutil.copytree(folder / "run0" / "final", folder / "saved")
    texts = ["The first document, long enough for several rows of thirty-two bytes each. " * 3,
             "A second one.", "And a third document that ends the held-out text."]  # fmt: skip
    (folder / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return folder


def loss_with_gate_at_zero(model, rows, branch: str | None) -> float:
    """The validation loss with `branch`'s gate pre-activation set to -inf in every layer's gate projection (sigmoid:
    exactly 0): the branch removed without the attention seam the tool uses."""
    def hook(module, inputs, output):  # (B, T, H * 3) -> the branch's column of every head at -inf
        gates = output.view(*output.shape[:-1], -1, len(BRANCHES)).clone()
        gates[..., BRANCHES.index(branch)] = float("-inf")
        return gates.view(output.shape)

    handles = [layer.self_attn.g_proj.register_forward_hook(hook) for layer in model.model.layers] if branch else []
    try:
        with torch.no_grad():
            return validation_loss(model, rows, 8, OneProcess("cpu"))["val_loss"]
    finally:
        for h in handles:
            h.remove()


def test_each_branch_removed_is_its_gate_at_zero(runs_and_data, tmp_path, capsys):
    folder = runs_and_data
    out = tmp_path / "out"
    result = branch_ablation.main(["--dataset", str(folder / "docs.jsonl"), *DATA_FLAGS, "--group", "runs",
                                   str(folder / "run0"), str(folder / "run1"), "--group", "saved",
                                   str(folder / "saved"), "--out", str(out)])  # fmt: skip
    rows = validation_rows(make_source(str(folder / "docs.jsonl"), "text"), load_tokenizer("byt5"), 32, 1, 1000000)
    assert result["rows"] == len(rows) > 1
    for run in (*result["groups"]["runs"], *result["groups"]["saved"]):
        model = NSAForCausalLM.from_pretrained(branch_ablation.read_model(run["model"])["path"]).eval()
        assert run["losses"]["none"] == pytest.approx(loss_with_gate_at_zero(model, rows, None), rel=1e-6)
        for branch in BRANCHES:
            expected = loss_with_gate_at_zero(model, rows, branch)
            assert run["losses"][branch] == pytest.approx(expected, rel=1e-5)
            assert abs(expected - run["losses"]["none"]) > 1e-4  # each branch moves the loss: the check can fail
    # seeds come from the runs' run.json; a saved model outside a run has none and pairs with nothing
    assert [r["seed"] for r in result["groups"]["runs"]] == [0, 1] and result["groups"]["saved"][0]["seed"] is None
    (pair,) = result["pairs"]
    assert pair["none"]["seeds"] == [] and pair["none"]["gap"] is None
    # the saved model is run0's weights: the same losses
    assert result["groups"]["saved"][0]["losses"] == pytest.approx(result["groups"]["runs"][0]["losses"])
    text = (out / "branch_ablation.md").read_text()
    assert text == capsys.readouterr().out.rstrip("\n") + "\n"
    run0 = result["groups"]["runs"][0]["losses"]
    assert (f"| runs | {folder / 'run0'} | 0 | {run0['none']:.4f} | {run0['cmp'] - run0['none']:+.4f} | "
            f"{run0['slc'] - run0['none']:+.4f} | {run0['win'] - run0['none']:+.4f} |") in text
    assert json.loads((out / "branch_ablation.json").read_text())["groups"] == result["groups"]


def test_group_means_and_gaps_paired_by_seed():
    def run(seed, none, cmp, slc, win):
        return {"model": f"m{seed}", "seed": seed, "losses": {"none": none, "cmp": cmp, "slc": slc, "win": win}}

    first = [run(0, 2.0, 2.1, 2.5, 3.0), run(1, 2.2, 2.2, 2.4, 3.4), run(2, 2.1, 2.15, 2.6, 3.1)]
    second = [run(0, 1.9, 1.95, 2.2, 3.2), run(1, 2.0, 2.1, 2.3, 3.3), run(3, 1.0, 1.0, 1.0, 1.0)]
    summary = branch_ablation.group_summary(first)
    assert summary["none"]["mean"] == pytest.approx(2.1) and summary["slc"]["mean"] == pytest.approx(statistics.fmean([0.5, 0.2, 0.5]))
    assert summary["win"]["std"] == pytest.approx(statistics.stdev([1.0, 1.2, 1.0]))
    gaps = branch_ablation.pair_gaps(first, second)  # seeds 0 and 1 only
    assert gaps["none"]["seeds"] == [0, 1] and gaps["none"]["gap"] == pytest.approx(statistics.fmean([-0.1, -0.2]))
    rises = [(3.2 - 1.9) - (3.0 - 2.0), (3.3 - 2.0) - (3.4 - 2.2)]  # second's rise - first's, per seed
    assert gaps["win"]["gap"] == pytest.approx(statistics.fmean(rises))
    assert gaps["win"]["half_width"] == pytest.approx(12.706 * statistics.stdev(rises) / 2**0.5, rel=1e-4)
    text = branch_ablation.markdown({"first": first, "second": second}, {"first": summary,
                                    "second": branch_ablation.group_summary(second)}, {("first", "second"): gaps}, 4, 32)
    assert f"| second - first | 2 | {statistics.fmean([-0.1, -0.2]):+.4f} ± " in text
    assert f"| {statistics.fmean(rises):+.4f} ± {gaps['win']['half_width']:.4f} |" in text


def test_the_held_out_rows_follow_the_runs_data_flags(runs_and_data, tmp_path):
    """Without data flags the rows are the runs' own (run.json); runs that disagree on a flag are refused, naming
    them, unless the flag is given."""
    folder = runs_and_data
    for seed, every in ((0, 1), (1, 2)):
        run = tmp_path / f"run{seed}"
        shutil.copytree(folder / f"run{seed}" / "final", run / "final")
        (run / "run.json").write_text(json.dumps({"config": {
            "seed": seed, "dataset": str(folder / "docs.jsonl"), "dataset_config": None, "text_column": "text",
            "seq_len": 32, "val_every_doc": every, "val_tokens": 1000000, "cross_doc_attention": False}}))
    with pytest.raises(ValueError, match=r"the runs' --val-every-doc differ \(.*run0: 1, .*run1: 2\)"):
        branch_ablation.main(["--tokenizer", "byt5", "--group", "a", str(tmp_path / "run0"), "--group", "b",
                              str(tmp_path / "run1"), "--out", str(tmp_path / "out")])  # fmt: skip
    result = branch_ablation.main(["--tokenizer", "byt5", "--val-every-doc", "2", "--group", "a", str(tmp_path / "run0"), "--group", "b",
                                   str(tmp_path / "run1"), "--out", str(tmp_path / "out")])  # fmt: skip
    rows = validation_rows(make_source(str(folder / "docs.jsonl"), "text"), load_tokenizer("byt5"), 32, 2, 1000000)
    assert result["rows"] == len(rows) and result["data"]["val_every_doc"] == 2 and result["data"]["seq_len"] == 32
    model = NSAForCausalLM.from_pretrained(tmp_path / "run1" / "final").eval()
    assert result["groups"]["b"][0]["losses"]["none"] == pytest.approx(loss_with_gate_at_zero(model, rows, None), rel=1e-6)
    # second - first per seed where both groups ran it: here none (seeds 0 and 1), so the pair table has no gaps
    assert "| b - a | 0 | - | - | - | - |" in (tmp_path / "out" / "branch_ablation.md").read_text()


def test_bad_input_is_named(runs_and_data, tmp_path):
    folder = runs_and_data
    (tmp_path / "a-file").write_text("")
    with pytest.raises(ValueError, match=r"^--out '.*a-file' is a file; this output is a folder"):  # before any model
        branch_ablation.main(["--dataset", str(folder / "docs.jsonl"), *DATA_FLAGS, "--group", "nsa",
                              str(folder / "run0"), "--out", str(tmp_path / "a-file")])  # fmt: skip
    torch.manual_seed(0)
    NSAForCausalLM(tiny_config(attention_mode="dense")).save_pretrained(tmp_path / "dense")
    with pytest.raises(ValueError, match="dense: model_type 'nsa', attention_mode 'dense': only an NSA model"):
        branch_ablation.main(["--dataset", str(folder / "docs.jsonl"), *DATA_FLAGS, "--group", "nsa",
                              str(folder / "run0"), "--group", "dense", str(tmp_path / "dense"), "--out",
                              str(tmp_path / "out")])  # fmt: skip
    with pytest.raises(ValueError, match=r"--group twice: seed \[0\] appears more than once \(.*run0, .*run0/\)"):
        branch_ablation.main(["--dataset", str(folder / "docs.jsonl"), *DATA_FLAGS, "--group", "twice",
                              str(folder / "run0"), str(folder / "run0") + "/", "--out", str(tmp_path / "out")])  # fmt: skip
    (tmp_path / "nsa-seed0.log").write_text("a run's log beside it (ab_compare --jobs)")  # a glob DIR/nsa-seed* takes it
    with pytest.raises(ValueError, match=r"nsa-seed0.log: a file, not a model: .*DIR/nsa-seed\*/ matches directories"):
        branch_ablation.main([*DATA_FLAGS, "--dataset", str(folder / "docs.jsonl"), "--group", "a",
                              str(tmp_path / "nsa-seed0.log"), "--out", str(tmp_path / "out")])  # fmt: skip
    (tmp_path / "unfinished").mkdir()
    (tmp_path / "unfinished" / "run.json").write_text(json.dumps({"config": {"seed": 3}}))
    with pytest.raises(ValueError, match="unfinished: a run's directory without final/"):
        branch_ablation.main([*DATA_FLAGS, "--dataset", str(folder / "docs.jsonl"), "--group", "a",
                              str(tmp_path / "unfinished"), "--out", str(tmp_path / "out")])  # fmt: skip
    with pytest.raises(ValueError, match="no run.json gives --dataset"):
        branch_ablation.main(["--group", "saved", str(folder / "saved"), "--out", str(tmp_path / "out")])
    with pytest.raises(ValueError, match="gave no held-out rows with --val-every-doc 0"):
        branch_ablation.main(["--dataset", str(folder / "docs.jsonl"), "--tokenizer", "byt5", "--seq-len", "32",
                              "--val-every-doc", "0", "--group", "a", str(folder / "run0"), "--out", str(tmp_path / "o")])  # fmt: skip
    with pytest.raises(SystemExit):  # a group without models: argparse's error names the group
        branch_ablation.main(["--dataset", str(folder / "docs.jsonl"), *DATA_FLAGS, "--group", "empty",
                              "--out", str(tmp_path / "out")])  # fmt: skip
