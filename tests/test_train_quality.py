"""The trainer's quality measurements: selection statistics at evaluations (--stats-every), the long-context retrieval
evaluation at the end (--eval-long-context), the model card's quality section, and the A/B twins' shared initial
weights. Tiny NSA runs on CPU (tests/train_helpers.py)."""

import json

import pytest
import torch
from train_helpers import GPT2, PARQUET, needs_shared, run_main, tiny_args

pytestmark = needs_shared

LONG_CONTEXT = ["--eval-long-context", "--long-context-lengths", "64", "96", "--long-context-depths", "0", "1",
                "--long-context-samples", "1"]  # fmt: skip


def jsonl(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def run_with_quality(tmp_path_factory):
    """Evaluations at steps 0 and 2 (statistics at each: the default --stats-every -1), then the retrieval eval; the
    run pushes to a stand-in for the Hub that records each push's message and model card."""
    from nsa_train import hub

    out = tmp_path_factory.mktemp("quality") / "run"
    pushes = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(hub, "preflight_on_main", lambda accelerator, repo_id, private: "api")
        patch.setattr(hub, "push_folder", lambda api, repo_id, folder, message, branch=None: pushes.append(
            (message, (folder / "README.md").read_text())))  # fmt: skip
        run_main(tiny_args(out, max_steps=2, eval_every=2, push_to_hub="tester/quality") + LONG_CONTEXT)
    return out, pushes


def test_statistics_at_every_evaluation(run_with_quality):
    from modeling_nsa import NSAForCausalLM
    from nsa_train import data
    from nsa_train.selection_stats import SCALARS, compute_selection_stats

    out, _ = run_with_quality
    records = jsonl(out / "stats.jsonl")
    assert [r["step"] for r in records] == [0, 2]
    assert [layer["layer"] for layer in records[-1]["layers"]] == [0, 1] and records[-1]["rows"] == 2
    assert set(SCALARS) <= set(records[-1]["layers"][0])
    evals = [r for r in jsonl(out / "metrics.jsonl") if "val_loss" in r]
    assert [r["step"] for r in evals] == [0, 2]
    for record in evals:
        assert {"stats_l0_gate_slc_mean", "stats_l1_forced_share", "stats_all_neighbour_overlap",
                "stats_l0_distance_0"} <= set(record)  # fmt: skip
    assert not any(k.startswith("stats_") for r in jsonl(out / "metrics.jsonl") if "loss" in r for k in r)
    # the last record is the exported model's statistics on the first two held-out rows
    tokenizer = data.load_tokenizer(str(GPT2))
    rows = data.validation_rows(data.make_source(str(PARQUET)), tokenizer, 64, 50, 1024, False)
    expected = compute_selection_stats(NSAForCausalLM.from_pretrained(out / "final"), data.to_batch(rows[:2]))
    for got, want in zip(records[-1]["layers"], expected["layers"]):
        for name in SCALARS:
            assert got[name] == pytest.approx(want[name], rel=1e-4, abs=1e-6), name
        assert got["distance_hist"] == want["distance_hist"]
    assert evals[-1]["stats_l1_gate_cmp_mean"] == records[-1]["layers"][1]["gate_cmp_mean"]


def test_long_context_evaluation_at_the_end(run_with_quality):
    out, pushes = run_with_quality
    result = json.loads((out / "long_context" / "passkey_generate.json").read_text())
    assert result["lengths"] == [64, 96] and result["depths"] == [0.0, 1.0] and result["samples"] == 1
    assert result["extrapolated_lengths"] == [96] and result["training_len"] == 64
    assert (out / "long_context" / "passkey_generate.png").stat().st_size > 0
    logged = [r for r in jsonl(out / "metrics.jsonl") if "longctx_accuracy" in r]
    assert len(logged) == 1 and logged[0]["step"] == 2
    cells = [a for row in result["accuracy"] for a in row]
    assert logged[0]["longctx_accuracy"] == pytest.approx(sum(cells) / len(cells))
    assert logged[0]["longctx_len96_accuracy"] == pytest.approx(sum(result["accuracy"][1]) / 2)
    rates = [rate for row in result["needle_selected"] for rate in row]  # NSA: where the last token's selection looks
    assert logged[0]["longctx_needle_selected"] == pytest.approx(sum(rates) / len(rates))
    for key in ("ended_inside_answer", "right_but_last_token"):  # answers that failed on their last token alone
        shares = [share for row in result[key] for share in row]
        assert logged[0][f"longctx_{key}"] == pytest.approx(sum(shares) / len(shares))
        assert logged[0][f"longctx_len96_{key}"] == pytest.approx(sum(result[key][1]) / 2)
    card = (out / "final" / "README.md").read_text()
    quality = card.split("## Quality")[1].split("## Model")[0]
    assert "### Long-context retrieval: passkey" in quality and "| 96* |" in quality
    assert "the answer's block in the last prompt token's selection" in quality
    assert "### Gates and selection" in quality and "| 1 | " in quality
    assert str(out.parent) not in card  # no local paths: the card may be pushed
    # final/ is pushed at the export, then its card again once the evaluation is in it
    assert [message for message, _ in pushes] == ["final", "model card: long-context retrieval"]
    assert "Long-context retrieval: not measured" in pushes[0][1] and pushes[1][1] == card


def test_needle_in_the_run_s_own_documents(tmp_path):
    out = tmp_path / "run"
    run_main(tiny_args(out, max_steps=1, stats_every=0) + LONG_CONTEXT + ["--long-context-task", "needle"])
    result = json.loads((out / "long_context" / "needle_generate.json").read_text())
    assert str(PARQUET) in result["haystack"]  # the run's --dataset
    card = (out / "final" / "README.md").read_text()
    assert "### Long-context retrieval: needle" in card and "Haystack: local files wiki-summaries-en.parquet" in card
    assert str(PARQUET.parent) not in card


def test_statistics_every_n_steps_without_validation_loss(tmp_path):
    out = tmp_path / "run"
    run_main(tiny_args(out, max_steps=2, eval_every=0, stats_every=1))
    assert [r["step"] for r in jsonl(out / "stats.jsonl")] == [0, 1, 2]
    evals = [r for r in jsonl(out / "metrics.jsonl") if "stats_all_forced_share" in r]
    assert [r["step"] for r in evals] == [0, 1, 2] and not any("val_loss" in r for r in evals)
    assert "not measured by the training run (its `--eval-long-context`" in (out / "final" / "README.md").read_text()


def test_statistics_off_and_dense(tmp_path, capsys):
    off, dense = tmp_path / "off", tmp_path / "dense"
    run_main(tiny_args(off, max_steps=1, eval_every=1, stats_every=0))
    assert not (off / "stats.jsonl").exists()
    assert not any(k.startswith("stats_") for r in jsonl(off / "metrics.jsonl") for k in r)
    assert "Selection and gate statistics: not measured" in (off / "final" / "README.md").read_text()
    run_main(tiny_args(dense, max_steps=1, eval_every=1, stats_every=1, attention_mode="dense"))
    assert "dense attention has no selection to measure" in capsys.readouterr().out
    assert not (dense / "stats.jsonl").exists()
    assert "statistics: none, the model uses dense attention" in (dense / "final" / "README.md").read_text()


def test_bad_quality_flags(tmp_path, capsys):
    for argv, message in [
        (["--long-context-task", "foo"], "invalid choice: 'foo'"),
        (["--stats-every", "-2"], "--stats-every -2: -1 (at every evaluation), 0 (off)"),
        (["--long-context-depths", "0", "1.5"], "--long-context-depths 1.5: a depth is the fraction"),
        (["--long-context-lengths", "64", "0"], "--long-context-lengths 0: a case length (prompt and answer) is a positive"),
        (["--long-context-samples", "0"], "--long-context-samples 0: must be a positive integer"),
    ]:  # fmt: skip
        with pytest.raises(SystemExit):
            run_main(tiny_args(tmp_path / "bad") + argv)
        assert message in capsys.readouterr().err, argv
    # what needs the tokenizer fails before the first step, and leaves no run directory behind
    with pytest.raises(ValueError, match="--long-context-lengths 16: too short for the passkey task's fixed text"):
        run_main(tiny_args(tmp_path / "short") + ["--eval-long-context", "--long-context-lengths", "16"])
    with pytest.raises(ValueError, match=r"not given: --seq-len 8 x 1 2 4\): --long-context-lengths 32: too short"):
        run_main(tiny_args(tmp_path / "short", seq_len=8) + ["--eval-long-context"])
    with pytest.raises(ValueError, match="--stats-every 5: the statistics are measured on held-out rows"):
        run_main(tiny_args(tmp_path / "norows", stats_every=5, val_tokens=0))
    assert not (tmp_path / "short").exists() and not (tmp_path / "norows").exists()


def test_default_long_context_lengths_leave_out_the_multiples_too_short_for_the_task():
    """--long-context-lengths not given: --seq-len x 1 2 4, less the multiples shorter than the task's fixed text
    (the smoke preset's 128 tokens against the passkey task's 223 with bytes), each named; given lengths are kept
    or refused as a whole; the longest default too short refuses the run."""
    from types import SimpleNamespace

    from nsa_train import data
    from nsa_train.evaluation import long_context_settings

    tokenizer = data.load_tokenizer("byt5")

    def cfg(seq_len, lengths=()):
        return SimpleNamespace(seq_len=seq_len, long_context_lengths=list(lengths), long_context_task="passkey",
                               long_context_depths=[0.0, 1.0], long_context_samples=2, dataset=str(PARQUET),
                               text_column="text")  # fmt: skip

    said = []
    assert long_context_settings(cfg(128), tokenizer, 384, said.append)["lengths"] == [256, 512]
    # a note that reads as one (not an error naming a flag the user did not pass), with what the run evaluates
    assert len(said) == 1 and said[0].startswith("note: --eval-long-context skips its default length 128 (--seq-len x "
                                                 "1), too short for the passkey task's fixed text (223 tokens")
    assert said[0].endswith("; it evaluates 256 512 (--long-context-lengths sets the lengths)"), said
    assert "use --long-context-lengths" not in said[0]
    said.clear()
    assert long_context_settings(cfg(256), tokenizer, 384, said.append)["lengths"] == [256, 512, 1024] and not said
    with pytest.raises(ValueError, match=r"^--eval-long-context: --long-context-lengths 128: too short"):
        long_context_settings(cfg(128, [512, 128]), tokenizer, 384, said.append)
    with pytest.raises(ValueError, match=r"not given: --seq-len 32 x 1 2 4\): --long-context-lengths 128: too short"):
        long_context_settings(cfg(32), tokenizer, 384, said.append)


@pytest.mark.parametrize("kv_per_branch", [True, False, "slc", "cmp", "win"])
def test_dense_twin_starts_from_the_nsa_weights(kv_per_branch):
    """Built by the trainer with one seed, the NSA model and its dense twin hold the same shared parameters (the
    dense K/V projection: the NSA selection branch's set), and the generator stands at the same place after."""
    from accelerate.utils import set_seed

    import train_accelerate
    from nsa_train import data

    tokenizer = data.load_tokenizer(str(GPT2))
    models, after = {}, {}
    for mode in ("nsa", "dense"):
        cfg = train_accelerate.parse_args(["--model", "tiny", "--seq-len", "64", "--attention-mode", mode,
                                           "--model-overrides", json.dumps({"kv_per_branch": kv_per_branch})])  # fmt: skip
        set_seed(7)
        models[mode] = train_accelerate.build_model(cfg, tokenizer)
        after[mode] = torch.rand(4)
    nsa, dense = dict(models["nsa"].named_parameters()), dict(models["dense"].named_parameters())
    assert set(dense) < set(nsa) and all(".g_proj." in k or ".compressor." in k for k in set(nsa) - set(dense))
    for name, param in dense.items():
        expected = nsa[name]
        if kv_per_branch is not False and name.endswith("kv_proj.weight"):
            # the NSA sets: (cmp, slc, win); (cmp+win, slc); (cmp, slc+win); (cmp+slc, win): the selection's set
            sets, slc_set = {True: (3, 1), "slc": (2, 1), "cmp": (2, 1), "win": (2, 0)}[kv_per_branch]
            expected = expected.view(sets, -1, expected.shape[-1])[slc_set]
        assert torch.equal(param, expected), name
    assert torch.equal(after["nsa"], after["dense"])
    assert models["dense"].lm_head.weight is models["dense"].model.embed_tokens.weight  # still tied


def test_attn_implementation_flag_reaches_the_dense_model_and_nsa_refuses_it(tmp_path):
    """--attn-implementation picks dense mode's attention function (transformers' interface); an NSA run names the
    flag and the fix rather than ignoring it."""
    import train_accelerate
    from nsa_train import data

    tokenizer = data.load_tokenizer(str(GPT2))
    for implementation in ("eager", "flex_attention"):
        cfg = train_accelerate.parse_args(["--model", "tiny", "--seq-len", "64", "--attention-mode", "dense",
                                           "--attn-implementation", implementation])  # fmt: skip
        assert train_accelerate.build_model(cfg, tokenizer).config._attn_implementation == implementation
    cfg = train_accelerate.parse_args(["--model", "tiny", "--seq-len", "64", "--attention-mode", "dense"])
    assert train_accelerate.build_model(cfg, tokenizer).config._attn_implementation in (None, "sdpa")
    with pytest.raises(ValueError, match="--attn-implementation flex_attention chooses dense attention's function"):
        run_main(tiny_args(tmp_path / "nsa", attn_implementation="flex_attention"))
    assert not (tmp_path / "nsa").exists()
    # a flash-attn choice where the package is missing: transformers' ImportError with the flag and the choices
    # that need nothing installed (built, and loaded with --init-from)
    from transformers.utils import is_flash_attn_2_available

    if not is_flash_attn_2_available():
        for flags in (dict(attention_mode="dense"), dict(init_from=tmp_path / "dense" / "final")):
            if "init_from" in flags:
                run_main(tiny_args(tmp_path / "dense", attention_mode="dense", max_steps=1))
            with pytest.raises(ValueError, match=r"^--attn-implementation flash_attention_2: FlashAttention2 has been "
                                                 r"toggled on.*or pass --attn-implementation sdpa"):  # fmt: skip
                run_main(tiny_args(tmp_path / "fa2", attn_implementation="flash_attention_2", **flags))
        assert not (tmp_path / "fa2").exists()


def test_flex_attention_training_on_cpu_fails_before_the_first_step(tmp_path, monkeypatch):
    """torch's FlexAttention has no backward on CPU: a dense flex_attention run there stops at startup with the flag
    and the way out, not with torch's traceback after the step-0 evaluation."""
    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")
    with pytest.raises(ValueError, match="--attn-implementation flex_attention cannot train on cpu .*sdpa"):
        run_main(tiny_args(tmp_path / "flex", attention_mode="dense", attn_implementation="flex_attention"))
    assert not (tmp_path / "flex").exists()


def test_eval_only_with_the_retrieval_evaluation(tmp_path):
    """--eval-only --eval-long-context evaluates an exported model's retrieval too (it was silently skipped):
    long_context/ beside eval.json, whose longctx_* fields are the JSON's mean accuracies, titled by the model."""
    first = tmp_path / "first"
    run_main(tiny_args(first, max_steps=1, stats_every=0))
    result = run_main(tiny_args(tmp_path / "eval", init_from=first / "final", eval_only=True) + LONG_CONTEXT)
    written = json.loads((tmp_path / "eval" / "long_context" / "passkey_generate.json").read_text())
    assert written["lengths"] == [64, 96] and written["model"] == str(first / "final")
    cells = [a for row in written["accuracy"] for a in row]
    assert result["longctx_accuracy"] == pytest.approx(sum(cells) / len(cells))
    assert json.loads((tmp_path / "eval" / "eval.json").read_text()) == result


def test_stats_cost_script_times_a_measurement_against_a_step():
    """bench/stats_cost.py (the GPU session's `stats-cost` step, issue 19's 2% budget): the statistics' share of a
    step and of the training time at each cadence follow from the two medians it prints; a dense model is refused
    with the fix."""
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    script = [sys.executable, str(root / "bench" / "stats_cost.py"), "--repeats", "1", "--preset", "smoke",
              "--seq-len", "96", "--micro-batch-size", "3", "--eval-every", "50"]  # fmt: skip
    proc = subprocess.run(script, cwd=root, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    found = re.search(r"step \(3 x 96\) ([\d.]+) ms; statistics \((\d+) x 96, selection by (\w+)\) ([\d.]+) ms = "
                      r"([\d.]+)% of a step", proc.stdout)  # fmt: skip
    assert found, proc.stdout
    step_ms, rows, selection_by, stats_ms, percent = found.groups()
    assert int(rows) == 2 and selection_by == "reference"  # STATS_ROWS of the micro-batch, on CPU the reference
    ratio = float(stats_ms) / float(step_ms)
    assert float(percent) == pytest.approx(100 * ratio, abs=0.2)
    shares = dict(re.findall(r"(--eval-every 50\)|--stats-every \d+) ([\d.]+)%", proc.stdout))
    assert float(shares["--eval-every 50)"]) == pytest.approx(100 * ratio / 50, abs=0.02)
    assert float(shares["--stats-every 10"]) == pytest.approx(100 * ratio / 10, abs=0.05)

    # a dense model is refused (in this process: the script's main reads sys.argv)
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(root / "bench"))
        import stats_cost

        patch.setattr(sys, "argv", ["stats_cost.py", "--preset", "smoke", "--attention-mode", "dense"])
        with pytest.raises(SystemExit, match="drop --attention-mode dense"):
            stats_cost.main()
