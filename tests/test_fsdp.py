"""FSDP2 (fully_shard) through `accelerate launch` on 2 CPU processes (gloo), with accelerate_configs/fsdp_cpu_2proc.yaml.

accelerate turns an FSDP config into FSDP only on accelerators: with ACCELERATE_USE_CPU=true it silently runs DDP
(see tests/fsdp_cpu_shim.py, the launch target that lifts that one gate; torch's fully_shard itself runs on gloo).
Under `--data-shard rows` a step's global batch is the same rows whatever the process count, so the FSDP run must
match a 1-process run with the same global batch, which test_train_ddp.py matches with DDP to float tolerance.
"""

import json
import shutil
import sys
from pathlib import Path

import pytest
from train_helpers import REPO, assert_same_weights, final_state, free_port, needs_shared, run_cli, run_main, tiny_args
from train_helpers import train_losses

pytestmark = [needs_shared, pytest.mark.slow]
STEPS = 3
CPU = {"ACCELERATE_USE_CPU": "true"}  # gloo processes; the shim keeps the FSDP plugin


def fsdp_launch() -> list[str]:
    return [str(Path(sys.executable).with_name("accelerate")), "launch", "--config_file",
            str(REPO / "accelerate_configs" / "fsdp_cpu_2proc.yaml"), "--main_process_port", str(free_port()),
            str(REPO / "tests" / "fsdp_cpu_shim.py")]  # fmt: skip  (run_cli appends the trainer and its arguments)


def fsdp_args(out, **extra):
    return tiny_args(out, micro_batch_size=2, max_steps=STEPS, data_shard="rows", eval_every=STEPS, val_tokens=512,
                     **extra)  # fmt: skip


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    out = tmp_path_factory.mktemp("one")
    run_main(tiny_args(out, micro_batch_size=4, max_steps=STEPS, data_shard="rows"))
    return out


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp")
    quality = ["--eval-long-context", "--long-context-lengths", "64", "--long-context-depths", "0", "1",
               "--long-context-samples", "1"]  # fmt: skip  (tests/test_train_quality.py checks what it writes)
    proc = run_cli(fsdp_args(out, save_every=2, sample_prompt="The ") + quality, launcher=fsdp_launch(), env=CPU,
                   timeout=300)  # fmt: skip
    return out, proc


def test_fsdp_trains_like_one_process(fsdp_run, one_process):
    out, proc = fsdp_run
    device = json.loads((out / "run.json").read_text())["device"]
    assert device["num_processes"] == 2 and device["distributed_type"] == "DistributedType.FSDP", device
    l1, l2 = train_losses(one_process), train_losses(out)
    assert list(l2) == list(range(1, STEPS + 1))
    g1, g2 = train_losses(one_process, "grad_norm"), train_losses(out, "grad_norm")
    for s in l1:
        assert l2[s] == pytest.approx(l1[s], rel=1e-5, abs=1e-6), (s, l1, l2)
        # the norm of the sharded gradients (sum of squares per shard, all-reduced): float order differs from DDP's
        assert g2[s] == pytest.approx(g1[s], rel=1e-4), (s, g1, g2)
    summary = json.loads((out / "summary.json").read_text())
    assert len(summary["weight_digests"]) == 2 and len(set(summary["weight_digests"])) == 1, summary  # gathered
    assert "sample: " in proc.stdout  # generation with sharded weights: every process took part
    # the quality measurements' forwards, on every process too: the selection statistics at each evaluation and the
    # long-context evaluation at the end (on one process alone each would wait for the others' shards forever)
    assert [json.loads(line)["step"] for line in (out / "stats.jsonl").read_text().splitlines()] == [0, STEPS]
    assert (out / "long_context" / "passkey_generate.json").is_file() and "longctx_accuracy" in proc.stdout


def test_fsdp_checkpoint_is_sharded_and_resumes(fsdp_run, one_process, tmp_path):
    out, _ = fsdp_run
    saved = out / "checkpoints" / "step_00000002"
    assert sorted(p.name for p in (saved / "pytorch_model_fsdp_0").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    resumed = tmp_path / "resumed"
    shutil.copytree(saved, resumed / "checkpoints" / saved.name)
    run_cli(fsdp_args(resumed, resume="latest"), launcher=fsdp_launch(), env=CPU, timeout=300)
    assert list(train_losses(resumed)) == [3]
    assert train_losses(resumed)[3] == pytest.approx(train_losses(out)[3], rel=1e-6)
    assert_same_weights(final_state(resumed), final_state(out), atol=1e-6, rtol=1e-5)


# where this project is not importable (no .pth files, no checkout on sys.path): the checkpoint's own code is all there is
LOAD_IN_FRESH_PROCESS = """
import sys
sys.path[:] = [p for p in sys.path if p] + SITE_PACKAGES
import torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(CKPT, trust_remote_code=True)
assert type(model).__module__.startswith("transformers_modules."), type(model).__module__
assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)  # tied again after loading
with torch.no_grad():
    torch.save(model(torch.tensor([[464, 3290, 318, 257, 1332]])).logits, CKPT + "/../logits.pt")
"""


def test_fsdp_final_is_a_full_hf_checkpoint(fsdp_run, one_process):
    import site
    import subprocess

    import torch

    from modeling_nsa import NSAForCausalLM

    out, _ = fsdp_run
    full, gathered = final_state(one_process), final_state(out)
    assert gathered.keys() == full.keys()  # every weight once (the tied head is not written twice)
    for k in full:  # whole tensors, not one process's shard
        assert gathered[k].shape == full[k].shape, k
    assert_same_weights(gathered, full, atol=1e-4, rtol=1e-3)
    config = json.loads((out / "final" / "config.json").read_text())
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_nsa.NSAForCausalLM", config["auto_map"]
    assert (out / "final" / "modeling_nsa.py").is_file() and not list((out / "final").glob("_fsdp*.py"))  # not torch's
    prelude = f"CKPT = {str(out / 'final')!r}\nSITE_PACKAGES = {site.getsitepackages()!r}\n"
    child = subprocess.run([sys.executable, "-S", "-c", prelude + LOAD_IN_FRESH_PROCESS], cwd=out, capture_output=True,
                           text=True, timeout=120, env={"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1",
                                                        "HF_HOME": str(out / "hf_home"), "OMP_NUM_THREADS": "1"})  # fmt: skip
    assert child.returncode == 0, child.stderr[-3000:]
    reference = NSAForCausalLM.from_pretrained(one_process / "final").eval()
    with torch.no_grad():
        expected = reference(torch.tensor([[464, 3290, 318, 257, 1332]])).logits
    torch.testing.assert_close(torch.load(out / "logits.pt"), expected, atol=2e-3, rtol=1e-3)


def test_fsdp_eval_only_gives_the_one_process_loss(fsdp_run, tmp_path):
    """--eval-only under FSDP shards the --init-from model (FSDP2 shards a model only with an optimizer: a stand-in
    that never steps) and gives the loss one process gives; it stopped with accelerate's "a model and optimizer
    must be passed together" before."""
    out, _ = fsdp_run
    one = run_main(tiny_args(tmp_path / "one", init_from=out / "final", eval_only=True, data_shard="rows"))
    run_cli(tiny_args(tmp_path / "fsdp", init_from=out / "final", eval_only=True, data_shard="rows"),
            launcher=fsdp_launch(), env=CPU, timeout=300)  # fmt: skip
    sharded = json.loads((tmp_path / "fsdp" / "eval.json").read_text())
    assert sharded["num_processes"] == 2 and sharded["val_rows"] == one["val_rows"] > 0
    assert sharded["val_loss"] == pytest.approx(one["val_loss"], rel=1e-6)


def test_a_checkpoint_resumes_only_under_the_kind_of_launch_that_wrote_it(fsdp_run, tmp_path):
    """accelerate restores FSDP's sharded checkpoints only under FSDP and whole ones only outside it (across the two
    it failed on a missing pytorch_model.bin, or deep in torch.distributed.checkpoint): refused up front, naming
    the way on."""
    from nsa_train.checkpoint import check_checkpoint_kind, latest_checkpoint

    out, _ = fsdp_run
    sharded = tmp_path / "from_fsdp" / "checkpoints" / "step_00000002"
    shutil.copytree(out / "checkpoints" / "step_00000002", sharded)
    with pytest.raises(ValueError, match=r"written under FSDP and this launch runs DDP or one process.*--init-from"):
        run_main(tiny_args(tmp_path / "from_fsdp", data_shard="rows", max_steps=STEPS, resume="latest"))
    run_main(tiny_args(tmp_path / "whole", max_steps=1, save_every=1))
    whole = latest_checkpoint(tmp_path / "whole" / "checkpoints")
    with pytest.raises(ValueError, match=r"written under DDP or one process and this launch runs FSDP"):
        check_checkpoint_kind(whole, fsdp_now=True)
    check_checkpoint_kind(whole, fsdp_now=False)  # the kind that wrote each resumes it
    check_checkpoint_kind(sharded, fsdp_now=True)
