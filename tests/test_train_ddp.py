"""Real 2-process DDP on CPU (gloo) through `accelerate launch`, against a 1-process run with the same global batch.

`--data-shard rows` makes the global batch of a step the same rows whatever the process count, so the runs must
agree: to float tolerance without a comm hook, and closely (but not bit-exactly) with the fp16 compression hook.
The accumulation run reports to TensorBoard, the default, whose end_training destroys the process group: every
collective must come before it (the fp16 run keeps `--report-to none`).
"""

import json
import shutil

import pytest
from train_helpers import (
    accelerate_2proc,
    assert_same_weights,
    final_state,
    needs_shared,
    run_cli,
    run_main,
    tiny_args,
    train_losses,
)

pytestmark = [needs_shared, pytest.mark.slow]
CPU_DDP = {"ACCELERATE_USE_CPU": "true"}  # with the MULTI_GPU YAML: 2 gloo processes (see cpu_2proc.yaml)
STEPS = 3


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    out = tmp_path_factory.mktemp("one")
    run_main(tiny_args(out, micro_batch_size=4, max_steps=STEPS, data_shard="rows"))
    return out


def _two_processes(out, hook, report_to="none", flags=(), stdout=None, **extra):
    """Two processes of 2 rows each (or `extra`'s micro_batch_size x grad_accum): the one-process run's 4 rows a
    step. stdout: a list that receives the run's console output."""
    args = dict(micro_batch_size=2, max_steps=STEPS, data_shard="rows", ddp_comm_hook=hook, eval_every=STEPS,
                val_tokens=512, report_to=report_to) | extra  # fmt: skip
    proc = run_cli(tiny_args(out, **args) + list(flags), launcher=accelerate_2proc(), env=CPU_DDP,
                   timeout=400)  # exit status 0 checked
    if stdout is not None:
        stdout.append(proc.stdout)
    summary = json.loads((out / "summary.json").read_text())
    record = json.loads((out / "run.json").read_text())
    assert record["device"]["num_processes"] == 2 and "MULTI_CPU" in record["device"]["distributed_type"], proc.stdout
    # both ranks hold bit-identical weights after training
    assert len(summary["weight_digests"]) == 2 and len(set(summary["weight_digests"])) == 1, summary
    return summary


def test_ddp_fp16_comm_hook(tmp_path, one_process):
    import torch

    # with the long-context evaluation at the end: under DDP the two processes split its batches (8 prompts in
    # batches of 4: one each) and the main one writes the whole table
    quality = ["--eval-long-context", "--long-context-lengths", "64", "--long-context-depths", "0", "1",
               "--long-context-samples", "4"]  # fmt: skip
    _two_processes(tmp_path, "fp16", flags=quality)
    table = json.loads((tmp_path / "long_context" / "passkey_generate.json").read_text())
    assert table["processes"] == 2 and [c["samples"] for c in table["cells"]] == [4, 4], table
    l1, l2 = train_losses(one_process), train_losses(tmp_path)
    assert l2[1] == pytest.approx(l1[1], rel=1e-6)  # the first loss is computed before any update
    g1, g2 = train_losses(one_process, "grad_norm"), train_losses(tmp_path, "grad_norm")
    for s in l1:
        assert l2[s] == pytest.approx(l1[s], rel=2e-3), (s, l1, l2)
        assert g2[s] == pytest.approx(g1[s], rel=1e-2), (s, g1, g2)
    w1, w2 = final_state(one_process), final_state(tmp_path)
    # fp16 flushes the tiniest gradients (embedding rows of rare tokens) to zero, and Adam turns that into a
    # different update for those few elements: all but a handful of weights agree closely
    off = sum(int(((w1[k] - w2[k]).abs() > 1e-3).sum()) for k in w1)  # a third of one step at lr 3e-3
    assert off < 0.01 * sum(v.numel() for v in w1.values()), off
    # the hook really compressed the all-reduce: without it at most a few elements differ by > 1e-4 (float
    # summation order: the accumulation test below matches at atol 1e-4); fp16 rounding moves thousands
    assert sum(int(((w1[k] - w2[k]).abs() > 1e-4).sum()) for k in w1) > 1000
    assert all(torch.isfinite(v).all() for v in w2.values())


def test_ddp_with_gradient_accumulation_matches_one_process_and_resumes_on_one(tmp_path, one_process):
    """2 processes x 2 micro-batches of 1 row: the one-process run's 4-row steps, gradients accumulated under
    no_sync. DDP's static graph (on by default) is turned off for it, saying so: PyTorch crashes with it on the
    first backward (expect_autograd_hooks_ INTERNAL ASSERT) and then stops all-reducing. Reporting to TensorBoard,
    the default, whose end_training destroys the process group after the last collective. (DDP without
    accumulation: test_ddp_fp16_comm_hook, to the hook's rounding.)"""
    stdout = []
    _two_processes(tmp_path, "none", report_to=None, stdout=stdout, micro_batch_size=1, grad_accum=2, save_every=2)
    assert "DDP static_graph off: --grad-accum 2 accumulates under no_sync" in stdout[0]
    assert list((tmp_path / "logs").rglob("events.out.tfevents*"))
    l1, l2 = train_losses(one_process), train_losses(tmp_path)
    g1, g2 = train_losses(one_process, "grad_norm"), train_losses(tmp_path, "grad_norm")
    assert list(l2) == list(range(1, STEPS + 1))
    for s in l1:
        assert l2[s] == pytest.approx(l1[s], rel=1e-5, abs=1e-6), (s, l1, l2)
        # the all-reduced gradient, every step, weighted by the global token count
        assert g2[s] == pytest.approx(g1[s], rel=1e-5), (s, g1, g2)
    assert_same_weights(final_state(tmp_path), final_state(one_process), atol=1e-4, rtol=1e-3)
    # its step-2 checkpoint resumed on 1 process: under --data-shard rows every rank saved the same position in the
    # global row stream, so the run continues with the same rows (under docs another process count is refused)
    resumed = tmp_path / "resumed"
    shutil.copytree(tmp_path / "checkpoints" / "step_00000002", resumed / "checkpoints" / "step_00000002")
    run_main(tiny_args(resumed, micro_batch_size=4, max_steps=STEPS, data_shard="rows", resume="latest"))
    assert list(train_losses(resumed)) == [3] and train_losses(resumed)[3] == pytest.approx(l1[3], rel=1e-5)
    assert_same_weights(final_state(resumed), final_state(one_process), atol=1e-4, rtol=1e-3)


def test_powersgd_starts_compressing_at_the_same_step_after_a_resume(tmp_path):
    """--ddp-comm-hook powersgd: torch's hook counts its steps from 0 in each launch, so a resumed run sent whole
    gradients for another --powersgd-start-step steps; its start is now counted from the resumed step (at least
    torch's 2) and the launch says that the hook's error feedback restarts."""
    import torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook as powersgd

    import train_accelerate as ta

    said = []
    cfg = ta.parse_args(["--ddp-comm-hook", "powersgd", "--powersgd-start-step", "1000", "--powersgd-rank", "2"])
    for resumed, start in ((0, 1000), (400, 600), (999, 2), (5000, 2)):
        kwargs = ta.ddp_kwargs(cfg, 2, said.append, resumed_step=resumed)
        assert kwargs.comm_state_option == {"matrix_approximation_rank": 2, "start_powerSGD_iter": start}
        powersgd.PowerSGDState(None, **kwargs.comm_state_option)  # options torch's state takes
    assert len(said) == 3 and all("error feedback at zero" in line for line in said)
    # the step the launch resumes from is read before the Accelerator exists, from the checkpoint --resume names
    run_main(tiny_args(tmp_path / "run", max_steps=2, save_every=2))
    assert ta.resumed_step(ta.parse_args(tiny_args(tmp_path / "run", resume="latest")), tmp_path / "run") == 2
    assert ta.resumed_step(ta.parse_args(tiny_args(tmp_path / "new")), tmp_path / "new") == 0
    with pytest.raises(SystemExit):
        ta.parse_args(["--powersgd-start-step", "1"])
