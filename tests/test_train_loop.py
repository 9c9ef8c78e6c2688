"""The training loop in one process: learning, gradient accumulation, resume, checkpoints, failures, bad input.

Every run is a tiny NSAForCausalLM (2 layers, hidden 64) in float32 on CPU with fixed seeds, so runs that should be
equal are compared with tight tolerances.
"""

import hashlib
import json
import os
import math
import re
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
from train_helpers import (
    GPT2,
    PARQUET,
    REPO,
    SHARED,
    assert_same_weights,
    final_state,
    needs_shared,
    run_cli,
    run_main,
    tiny_args,
    train_losses,
    val_losses,
)

from nsa_train import checkpoint

pytestmark = needs_shared


def test_validation_loss_falls(tmp_path):
    out = tmp_path / "run"
    summary = run_main(tiny_args(out, max_steps=40, eval_every=20, val_tokens=2048, lr=5e-3, warmup_steps=4))
    val = val_losses(out)
    assert set(val) == {0, 20, 40}
    assert val[0] > 10.0  # ln(50304) = 10.83: an untrained model
    assert val[40] < val[0] - 2.5, val  # well below the start
    assert summary["val_loss"] == pytest.approx(val[40])
    record = json.loads((out / "run.json").read_text())
    assert record["config"]["seq_len"] == 64 and record["packages"]["torch"] == torch.__version__
    assert "git_sha" in record and record["device"]["type"] == "cpu"
    heartbeat = json.loads((out / "heartbeat.json").read_text())
    assert heartbeat["step"] == 40 and heartbeat["phase"] == "done"  # a monitor reads the run as over


def test_grad_accumulation_equals_big_batch(tmp_path):
    """4 micro-batches of 2 rows == 1 micro-batch of 8 rows: same losses, same weights."""
    big, acc = tmp_path / "big", tmp_path / "acc"
    run_main(tiny_args(big, micro_batch_size=8, grad_accum=1, max_steps=3))
    run_main(tiny_args(acc, micro_batch_size=2, grad_accum=4, max_steps=3))
    lb, la = train_losses(big), train_losses(acc)
    assert list(lb) == [1, 2, 3]
    for s in lb:
        assert la[s] == pytest.approx(lb[s], rel=1e-5, abs=1e-6), (s, la, lb)
    # the gradient itself (Adam's update is nearly scale-invariant, so a mis-weighted loss shows here first)
    gb, ga = train_losses(big, "grad_norm"), train_losses(acc, "grad_norm")
    for s in gb:
        assert ga[s] == pytest.approx(gb[s], rel=1e-5), (s, ga, gb)
    assert_same_weights(final_state(acc), final_state(big), atol=1e-4, rtol=1e-3)


def test_resume_reproduces_uninterrupted_run(tmp_path):
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    run_main(tiny_args(full, max_steps=6, save_every=3, keep_last=5))
    assert [d.name for d in checkpoint.checkpoint_dirs(full / "checkpoints")] == ["step_00000003", "step_00000006"]
    # a run that stopped after step 3: only its checkpoint exists
    shutil.copytree(full / "checkpoints" / "step_00000003", resumed / "checkpoints" / "step_00000003")
    summary = run_main(tiny_args(resumed, max_steps=6, save_every=3, resume="latest"))
    lf, lr = train_losses(full), train_losses(resumed)
    assert list(lr) == [4, 5, 6]
    for s in lr:
        assert lr[s] == pytest.approx(lf[s], rel=1e-6, abs=1e-7), (s, lf, lr)
        assert train_losses(resumed, "grad_norm")[s] == pytest.approx(train_losses(full, "grad_norm")[s], rel=1e-6)
    assert_same_weights(final_state(resumed), final_state(full), atol=1e-6, rtol=1e-6)
    assert summary["tokens_seen"] == 6 * 4 * 64
    # a launch that logged steps 4-6 (and half a line) after its step-3 checkpoint, then stopped: the resume drops
    # those records and logs the steps again, so each step's record is there once
    stopped = tmp_path / "stopped"
    shutil.copytree(full / "checkpoints" / "step_00000003", stopped / "checkpoints" / "step_00000003")
    (stopped / "metrics.jsonl").write_text((full / "metrics.jsonl").read_text() + '{"step": 7, "lo')
    run_main(tiny_args(stopped, max_steps=6, save_every=3, resume="latest"))
    steps = [json.loads(line)["step"] for line in (stopped / "metrics.jsonl").read_text().splitlines()]
    assert steps == [json.loads(line)["step"] for line in (full / "metrics.jsonl").read_text().splitlines()]
    assert train_losses(stopped) == pytest.approx(lf, rel=1e-6)
    # logged every 2 steps from a resume at step 3: step 4's record is the mean of the one step trained since
    # (it was half of it), step 6's of steps 5 and 6
    every2 = tmp_path / "every2"
    shutil.copytree(full / "checkpoints" / "step_00000003", every2 / "checkpoints" / "step_00000003")
    run_main(tiny_args(every2, max_steps=6, save_every=3, resume="latest", log_every=2))
    assert train_losses(every2) == pytest.approx({4: lf[4], 6: (lf[5] + lf[6]) / 2}, rel=1e-6)


def test_stop_at_step_splits_a_run_that_resumes_as_if_uninterrupted(tmp_path, capsys):
    """--stop-at-step N: a checkpoint at step N and an exit (no final/, summary not finished, stopped_at_step N);
    the same flag again trains nothing; --resume latest then trains on under --max-steps' schedule, as the run
    would have gone without the stop."""
    full, split = tmp_path / "full", tmp_path / "split"
    run_main(tiny_args(full, max_steps=5))
    summary = run_main(tiny_args(split, max_steps=5, stop_at_step=2))
    assert summary["step"] == 2 and not summary["finished"] and summary["stopped_at_step"] == 2
    assert [d.name for d in checkpoint.checkpoint_dirs(split / "checkpoints")] == ["step_00000002"]
    assert not (split / "final").exists()
    assert json.loads((split / "heartbeat.json").read_text())["phase"] == "stopped"
    again = run_main(tiny_args(split, max_steps=5, stop_at_step=2, resume="latest"))
    assert again["step"] == 2 and again["stopped_at_step"] == 2
    assert "step 2 is at or past --stop-at-step 2: nothing to train" in capsys.readouterr().out
    summary = run_main(tiny_args(split, max_steps=5, resume="latest"))
    assert summary["finished"] and "stopped_at_step" not in summary
    assert train_losses(split) == pytest.approx(train_losses(full), rel=1e-6, abs=1e-7)
    assert_same_weights(final_state(split), final_state(full), atol=1e-6, rtol=1e-6)


def test_a_resume_that_reads_other_data_bytes_is_warned_about(tmp_path, capsys):
    """Each launch records its data files' sha256 in run.json; a resume whose files differ from the earlier
    launch's (a corpus rebuilt between sessions) says so, naming the file, and the earlier digests stay."""
    import pyarrow.parquet as pq

    data_file = tmp_path / "docs.parquet"
    shutil.copy(PARQUET, data_file)
    out = tmp_path / "run"
    run_main(tiny_args(out, dataset=data_file, max_steps=3, stop_at_step=1))
    run_main(tiny_args(out, dataset=data_file, max_steps=3, stop_at_step=2, resume="latest"))
    assert "data files differ" not in capsys.readouterr().out  # the same bytes: nothing said
    table = pq.read_table(data_file).to_pylist()
    table[-1]["text"] += " One more sentence."
    import pyarrow as pa

    pq.write_table(pa.Table.from_pylist(table), data_file)
    run_main(tiny_args(out, dataset=data_file, max_steps=3, resume="latest"))
    said = capsys.readouterr().out
    assert f"warning: the data files differ from those of the launch that started at step 1 ({data_file}: sha256" in said
    launches = json.loads((out / "run.json").read_text())["launches"]
    digests = [launch["data_sha256"][str(data_file)] for launch in launches]
    assert digests[0] == digests[1] != digests[2] == hashlib.sha256(data_file.read_bytes()).hexdigest()


def test_a_resume_with_another_grad_accum_trains_as_that_run_from_the_start(tmp_path):
    """A checkpoint restores accelerate's micro-batch count, which decides when the optimizer steps: resumed with
    another --grad-accum (the same rows per step, e.g. on half the processes), every step must still update the
    weights. 3 steps of 4 x 1, then 3 of 2 x 2, equal 6 steps of 2 x 2 (the same rows, the same token-weighted
    gradients); before the fix the resumed steps left the weights at step 3's."""
    out, whole = tmp_path / "run", tmp_path / "whole"
    run_main(tiny_args(out, max_steps=3, save_every=3, micro_batch_size=4, grad_accum=1))
    at_3 = final_state(out)
    run_main(tiny_args(out, max_steps=6, save_every=3, micro_batch_size=2, grad_accum=2, resume="latest"))
    run_main(tiny_args(whole, max_steps=6, save_every=3, micro_batch_size=2, grad_accum=2))
    resumed = final_state(out)
    assert any(not torch.equal(resumed[k], at_3[k]) for k in resumed)
    assert_same_weights(resumed, final_state(whole), atol=1e-5, rtol=1e-4)
    losses, expected = train_losses(out), train_losses(whole)
    assert [losses[s] for s in (4, 5, 6)] == pytest.approx([expected[s] for s in (4, 5, 6)], rel=1e-4)


def test_a_roll_back_sets_the_later_checkpoints_aside(tmp_path, capsys):
    """--resume PATH to an earlier checkpoint than the latest (a roll-back): the later ones move aside, so the new
    line's checkpoints are the latest (--resume latest continues it) and --keep-last prunes within it."""
    out = tmp_path / "run"
    run_main(tiny_args(out, max_steps=6, save_every=2, keep_last=5))
    ckpts = out / "checkpoints"
    capsys.readouterr()
    run_main(tiny_args(out, max_steps=4, save_every=2, keep_last=2, resume=str(ckpts / "step_00000002")))
    assert "step_00000004, step_00000006 moved to" in capsys.readouterr().out
    assert [d.name for d in checkpoint.checkpoint_dirs(ckpts)] == ["step_00000002", "step_00000004"]
    (aside,) = ckpts.glob("abandoned-after-00000002-*")
    assert sorted(d.name for d in aside.iterdir()) == ["step_00000004", "step_00000006"]
    rolled_back = json.loads((ckpts / "step_00000004" / checkpoint.STATE_FILE).read_text())
    assert rolled_back["config"]["max_steps"] == 4  # written by the roll-back, not the abandoned line
    summary = run_main(tiny_args(out, max_steps=4, save_every=2, keep_last=2, resume="latest"))
    assert summary["step"] == 4 and "the run is finished: step 4" in capsys.readouterr().out


def test_exporting_a_checkpoint_trains_nothing_and_the_export_trains_further(tmp_path, capsys, monkeypatch):
    """The README's export of an intermediate checkpoint (--resume PATH --max-steps <its step> into a new
    --output-dir): final/ holds that checkpoint's weights, no step trains, the schedule note (the rate follows this
    run's flags from here on) is not printed, since nothing follows, and the checkpoint is copied into the new
    folder, which --resume latest then trains further. Relaunched where its own latest checkpoint is at the end
    (final/ lost), nothing is saved again."""
    from safetensors.torch import load_file

    out = tmp_path / "run"
    run_main(tiny_args(out, max_steps=4, save_every=2, eval_every=2, stats_every=2))
    capsys.readouterr()
    exported = tmp_path / "at-2"
    summary = run_main(tiny_args(exported, max_steps=2, save_every=2, resume=str(out / "checkpoints" / "step_00000002")))
    assert summary["step"] == 2 and summary["finished"] and "schedule's flags differ" not in capsys.readouterr().out
    # the export starts with the run's history up to its step (the curve, the statistics), and its card reports the
    # evaluation the run made at that step, as the run's own card at step 2 did
    def steps(path):
        return [json.loads(line)["step"] for line in path.read_text().splitlines()]

    assert steps(exported / "metrics.jsonl") == [s for s in steps(out / "metrics.jsonl") if s <= 2] != []
    assert steps(exported / "stats.jsonl") == [0, 2] and steps(out / "stats.jsonl") == [0, 2, 4]
    card = (exported / "final" / "README.md").read_text()
    assert "| gate cmp |" in card and "validation loss, latest evaluation (at step 2)" in card
    weights = load_file(exported / "final" / "model.safetensors")
    saved = load_file(out / "checkpoints" / "step_00000002" / "model.safetensors")
    assert weights.keys() == saved.keys() and all(torch.equal(weights[k], saved[k]) for k in weights)
    assert [d.name for d in checkpoint.checkpoint_dirs(exported / "checkpoints")] == ["step_00000002"]
    assert run_main(tiny_args(exported, max_steps=3, save_every=2, resume="latest"))["step"] == 3
    assert "schedule's flags differ" in capsys.readouterr().out  # a step trains under the changed schedule: said

    shutil.rmtree(out / "final")
    (out / "summary.json").unlink()
    saves = []
    monkeypatch.setattr(checkpoint, "save_checkpoint", lambda *a, **k: saves.append(a) or pytest.fail("saved again"))
    assert run_main(tiny_args(out, max_steps=4, save_every=2, resume="latest"))["step"] == 4
    assert (out / "final" / "model.safetensors").is_file() and not saves


def test_tensorboard_after_a_roll_back_shows_each_step_once(tmp_path):
    """TensorBoard, as metrics.jsonl, keeps one point per step after a resume: the events the abandoned line wrote
    after the checkpoint are hidden (purge_step), also those of tags the new line does not log at the same steps
    (TensorBoard's own clean-up, when a tag's step goes back, covers only the tags logged again)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    run_main(tiny_args(out, max_steps=6, save_every=2, keep_last=5, eval_every=3, report_to="tensorboard"))
    run_main(tiny_args(out, max_steps=6, save_every=2, keep_last=5, eval_every=4, report_to="tensorboard", lr=1e-3,
                       resume=str(out / "checkpoints" / "step_00000002")))  # fmt: skip
    assert len(list((out / "logs").glob("events.out.tfevents.*"))) == 2  # one event file per launch
    # the reader TensorBoard itself uses (the subfolders hold each launch's hyperparameters)
    events = EventAccumulator(str(out / "logs"))
    events.Reload()
    for tag, key, loaded in (("train/loss", "loss", train_losses), ("train/lr", "lr", train_losses),
                             ("val/loss", None, lambda out, key: val_losses(out))):  # fmt: skip
        shown = {event.step: event.value for event in events.Scalars(tag)}
        assert shown == pytest.approx(loaded(out, key), rel=1e-6), tag  # metrics.jsonl: the new line from step 3
    assert sorted(val_losses(out)) == [0, 4, 6]  # (the abandoned line's evaluation at step 3 is gone from both)


def test_checkpoint_killed_mid_write_is_never_latest(tmp_path, monkeypatch):
    out = tmp_path / "run"
    real_write = checkpoint._write_json

    def dying_write(path, obj):
        if path.name == checkpoint.STATE_FILE and obj["step"] == 4:
            raise KeyboardInterrupt("killed while writing step 4")  # the process dies mid-checkpoint
        return real_write(path, obj)

    monkeypatch.setattr(checkpoint, "_write_json", dying_write)
    with pytest.raises(KeyboardInterrupt):
        run_main(tiny_args(out, max_steps=6, save_every=2, keep_last=5))
    ckpts = out / "checkpoints"
    assert (ckpts / ".tmp-step_00000004" / "model.safetensors").exists()  # the half-written one is there ...
    assert checkpoint.latest_checkpoint(ckpts).name == "step_00000002"  # ... and is not picked up
    assert checkpoint.resolve_resume("latest", ckpts).name == "step_00000002"
    (ckpts / "step_00000009").mkdir()  # a step directory without trainer_state.json is not complete either
    assert checkpoint.latest_checkpoint(ckpts).name == "step_00000002"
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint") as half_written:
        checkpoint.resolve_resume(str(ckpts / ".tmp-step_00000004"), ckpts)
    assert f"Checkpoints there: {ckpts / 'step_00000002'}; or --resume latest" in str(half_written.value)
    with pytest.raises(FileNotFoundError, match=r"step_00000099' does not exist\. Checkpoints there: .*step_00000002"):
        checkpoint.resolve_resume(str(ckpts / "step_00000099"), ckpts)  # a mistyped step: what exists is named
    with pytest.raises(FileNotFoundError, match=r"elsewhere' does not exist\.$"):
        checkpoint.resolve_resume(str(tmp_path / "elsewhere"), tmp_path / "no-run")  # nothing to suggest
    for given in (out, ckpts):  # the run's folder or its checkpoints/ for a checkpoint: the checkpoints in it
        with pytest.raises(FileNotFoundError, match="not a complete checkpoint") as info:
            checkpoint.resolve_resume(str(given), tmp_path / "new-run" / "checkpoints")
        assert f"Checkpoints there: {ckpts / 'step_00000002'}." in str(info.value)  # another run's: no "latest"
    monkeypatch.setattr(checkpoint, "_write_json", real_write)
    run_main(tiny_args(out, max_steps=6, save_every=2, keep_last=2, resume="latest"))
    assert [d.name for d in checkpoint.checkpoint_dirs(ckpts)] == ["step_00000004", "step_00000006"]  # keep-last 2
    assert not list(ckpts.glob(".tmp-*"))  # the stale temporary directory was cleaned


def _poison_loss_at(monkeypatch, bad_calls):
    """Make the model's loss NaN on the given forward calls (counting from 1)."""
    from modeling_nsa import NSAForCausalLM

    real_forward, calls = NSAForCausalLM.forward, {"n": 0}

    def forward(self, *args, **kwargs):
        out = real_forward(self, *args, **kwargs)
        if self.training:
            calls["n"] += 1
            if calls["n"] in bad_calls:
                out.loss = out.loss * float("nan")
        return out

    monkeypatch.setattr(NSAForCausalLM, "forward", forward)


def test_nonfinite_loss_stops_before_touching_weights(tmp_path, monkeypatch):
    _poison_loss_at(monkeypatch, {3})
    with pytest.raises(FloatingPointError, match=r"non-finite loss/gradient at step 2.*NOT updated.*--skip-nonfinite"):
        run_main(tiny_args(tmp_path / "run", max_steps=5, save_every=2))


def test_nonfinite_loss_skip_flag(tmp_path, monkeypatch):
    _poison_loss_at(monkeypatch, {3})
    summary = run_main(tiny_args(tmp_path / "run", max_steps=5, skip_nonfinite=True, log_every=5))
    assert summary["skipped"] == 1 and summary["finished"]
    assert all(torch.isfinite(v).all() for v in final_state(tmp_path / "run").values())
    # the logged loss is the mean over the four steps that trained, not NaN from the skipped one
    assert math.isfinite(train_losses(tmp_path / "run")[5])


def test_fp16_step_the_grad_scaler_skipped_is_not_counted_as_an_update(tmp_path, capsys):
    """Under fp16 the grad scaler, not the gradient norm, decides whether the weights moved: a step it skipped (its
    scale overflowed the gradients) is reported as not updated, counted and said without stopping the run; a
    non-finite loss, which no scale fixes, still stops it (accelerate gives CPUs no scaler: an SGD whose
    `step_was_skipped` is accelerate's stands in for a scaled optimizer)."""
    from types import SimpleNamespace

    from accelerate import Accelerator
    from model_helpers import tiny_config

    import train_accelerate as ta
    from modeling_nsa import NSAForCausalLM
    from nsa_train.run_state import RunState

    class ScaledSGD(torch.optim.SGD):
        step_was_skipped = False

        def step(self, closure=None):
            if not self.step_was_skipped:  # the scaler calls the inner step only when it does not skip
                super().step(closure)

    ids = torch.randint(0, 61, (2, 32), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids.clone()}
    cfg = ta.TrainConfig(grad_accum=1)
    for skipped in (True, False):
        model = NSAForCausalLM(tiny_config())
        before = [p.detach().clone() for p in model.parameters()]
        optimizer = ScaledSGD(model.parameters(), lr=1.0)
        optimizer.step_was_skipped = skipped
        loss, grad_norm, updated = ta.train_step(model, model, optimizer, [(batch, None)], cfg, Accelerator(cpu=True),
                                                 "fp16")  # fmt: skip
        moved = any(not torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before))
        assert math.isfinite(grad_norm) and updated is (not skipped) and moved is (not skipped)
    run = RunState(step=3)
    checkpoints = SimpleNamespace(accelerator=SimpleNamespace(print=print), root=None)
    ta.skip_nonfinite_step(cfg, run, checkpoints, loss, grad_norm, 1e-3, "fp16")
    assert run.skipped_steps == 1 and "grad scaler skipped the step" in capsys.readouterr().out
    with pytest.raises(FloatingPointError, match="non-finite loss/gradient at step 3"):
        ta.skip_nonfinite_step(cfg, run, SimpleNamespace(accelerator=None, root=tmp_path),
                               loss * float("nan"), float("nan"), 1e-3, "fp16")  # fmt: skip


def test_watchdog_dumps_stacks_and_exits(tmp_path):
    code = textwrap.dedent(f"""
        import time
        from pathlib import Path
        from nsa_train.metrics import Watchdog
        def stuck_in_collective():
            time.sleep(60)
        wd = Watchdog(1.0, Path({str(tmp_path)!r}) / "hb.json", Path({str(tmp_path)!r}) / "stacks.txt")
        wd.beat(step=7)
        stuck_in_collective()
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3
    assert "no progress" in proc.stderr and "stuck_in_collective" in proc.stderr
    assert "stuck_in_collective" in (tmp_path / "stacks.txt").read_text()
    beat = json.loads((tmp_path / "hb.json").read_text())  # a monitor sees the stall
    assert beat["step"] == 7 and beat["phase"] == "stalled" and beat["idle_s"] >= 1


def test_the_heartbeat_says_when_its_process_left(tmp_path):
    """A launch that ends without saying how (an error, a refused resume) leaves "exited" with the phase it was in;
    a run's own end ("done", "stopped") is kept."""
    from nsa_train.metrics import Watchdog

    watchdog = Watchdog(0, tmp_path / "hb.json")
    watchdog.beat(step=5, phase="eval")
    watchdog.stop()
    assert {k: v for k, v in json.loads((tmp_path / "hb.json").read_text()).items() if k not in ("time", "pid")} == \
        {"step": 5, "phase": "exited", "after": "eval"}
    watchdog = Watchdog(0, tmp_path / "hb.json")
    watchdog.beat(step=9, phase="done")
    watchdog.stop()
    assert json.loads((tmp_path / "hb.json").read_text())["phase"] == "done"


def test_sigterm_saves_and_resume_continues(tmp_path):
    """SIGTERM mid-run: a checkpoint at the current step, exit 0; resuming finishes like an uninterrupted run."""
    import signal
    import time

    out = tmp_path / "run"
    args = tiny_args(out, max_steps=400, save_every=0)
    proc = subprocess.Popen([sys.executable, "train_accelerate.py", *args], cwd=str(REPO),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    deadline = time.time() + 240
    while time.time() < deadline:
        hb = out / "heartbeat.json"
        if hb.exists() and json.loads(hb.read_text()).get("step", 0) >= 2:
            break
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    log, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, log[-3000:]
    assert "SIGTERM" in log
    ckpt = checkpoint.latest_checkpoint(out / "checkpoints")
    step = json.loads((ckpt / checkpoint.STATE_FILE).read_text())["step"]
    assert step >= 2 and not (out / "final").exists()
    stopped = json.loads((out / "summary.json").read_text())
    assert stopped["finished"] is False and stopped["step"] == step
    assert stopped["logged_step"] <= step  # its loss and speed are those of the last log, said as of which step
    assert json.loads((out / "heartbeat.json").read_text())["phase"] == "stopped"
    summary = run_main(tiny_args(out, max_steps=step + 1, save_every=0, resume="latest"))  # it resumes from there
    assert summary["finished"] and summary["step"] == step + 1 and step + 1 in train_losses(out)


def test_a_first_ctrl_c_asks_for_a_checkpoint_and_a_second_stops_at_once(capsys):
    """The loop's stop handler (the same branch as SIGTERM's, tested end to end above): a first Ctrl-C is a request
    the loop sees after its step, said at once; a second raises KeyboardInterrupt; after the loop Ctrl-C is Python's
    own again, and every handler is restored at the end."""
    import signal
    import time
    import types

    from nsa_train.preemption import GracefulStop

    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    one_process = types.SimpleNamespace(device=torch.device("cpu"), num_processes=1)
    stop = GracefulStop()
    try:
        assert not stop.requested(one_process)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)  # (the handler runs between bytecodes of the main thread)
        assert stop.requested(one_process) and stop.reason == "Ctrl-C (SIGINT)"
        assert "Ctrl-C again stops now, without one" in capsys.readouterr().err
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
        stop.stop_listening_for_interrupts()
        assert signal.getsignal(signal.SIGINT) is before[0]
    finally:
        stop.restore()
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before


def test_a_sigterm_while_the_run_cleans_up_does_not_kill_it_before_its_heartbeat(tmp_path):
    """When one process fails, the launcher sends SIGTERM to the others, which are then leaving through their
    clean-up: the SIGTERM handler stays in place until the heartbeat has said how the process ended (it was
    restored first, so the signal killed the process before its heartbeat left a training step behind)."""
    out = tmp_path / "run"
    code = textwrap.dedent(f"""
        import os, signal, sys
        from nsa_train import metrics
        say_how_it_ended = metrics.Watchdog.stop
        def stop(self):
            os.kill(os.getpid(), signal.SIGTERM)  # as torchrun does when another process has failed
            say_how_it_ended(self)
        metrics.Watchdog.stop = stop
        import train_accelerate as ta
        ta.main(ta.parse_args({tiny_args(out, max_steps=1)!r}))
    """)
    proc = subprocess.run([sys.executable, "-c", code], cwd=str(REPO), capture_output=True, text=True, timeout=240,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-3000:])
    assert json.loads((out / "heartbeat.json").read_text())["phase"] == "done"


def test_summary_counts_tokens_up_to_a_stop_between_log_steps(tmp_path, monkeypatch):
    """A SIGTERM during step 3 with --log-every 2: summary.json has the tokens of 3 steps, not the step-2 log's."""
    import signal

    from modeling_nsa import NSAForCausalLM

    real_forward, calls = NSAForCausalLM.forward, {"n": 0}

    def forward(self, *args, **kwargs):
        if self.training:
            calls["n"] += 1
            if calls["n"] == 3:
                signal.raise_signal(signal.SIGTERM)  # the trainer's handler: finish the step, save, stop
        return real_forward(self, *args, **kwargs)

    monkeypatch.setattr(NSAForCausalLM, "forward", forward)
    summary = run_main(tiny_args(tmp_path, max_steps=10, log_every=2))
    assert summary["step"] == 3 and not summary["finished"] and list(train_losses(tmp_path)) == [2]
    assert summary["tokens_seen"] == 3 * 4 * 64
    assert json.loads((tmp_path / "summary.json").read_text())["tokens_seen"] == 3 * 4 * 64


# ---------------------------------------------------------------- bad input: errors before any step


def test_seq_len_the_model_cannot_take(tmp_path):
    with pytest.raises(ValueError, match=r"--seq-len 9000 cannot be taken.*max_position_embeddings=8192"):
        run_main(tiny_args(tmp_path, seq_len=9000))
    assert not (tmp_path / "metrics.jsonl").exists()


def test_invalid_model_settings(tmp_path):
    with pytest.raises(ValueError, match="cmp_stride"):
        run_main(tiny_args(tmp_path, model_overrides='{"cmp_stride": 5}'))
    with pytest.raises(ValueError, match="--model 'huge'"):
        run_main(tiny_args(tmp_path, model="huge"))
    # a misspelt field is not silently dropped
    with pytest.raises(ValueError, match=r"'cmp_strid' is not an NSAConfig field; did you mean 'cmp_stride'"):
        run_main(tiny_args(tmp_path, model_overrides='{"cmp_strid": 6}'))
    with pytest.raises(ValueError, match=r"--model-overrides '\{cmp_stride: 6\}' is not valid JSON.*\{\"num_hidden_layers\": 6"):
        run_main(tiny_args(tmp_path, model_overrides="{cmp_stride: 6}"))
    with pytest.raises(ValueError, match=r"sets attention_mode from --attention-mode"):  # the flag would overwrite it
        run_main(tiny_args(tmp_path, model_overrides='{"attention_mode": "dense"}'))
    assert not (tmp_path / "metrics.jsonl").exists()


def test_bad_numbers_are_argument_errors(capsys):
    import train_accelerate

    for flag, value, says in (("--micro-batch-size", "0", "a positive integer"),
                              ("--grad-accum", "0", "a positive integer"), ("--log-every", "-1", "at least 0"),
                              ("--lr", "-1.0", "a positive learning rate"), ("--lr", "0.0", "a positive learning rate"),
                              ("--min-lr-ratio", "1.5", "in [0, 1]"), ("--warmup-steps", "-1", "at least 0"),
                              ("--weight-decay", "-0.1", "at least 0"), ("--beta1", "1.0", "in [0, 1)"),
                              ("--beta2", "-0.5", "in [0, 1)"), ("--grad-clip", "-1.0", "at least 0"),
                              ("--stop-at-step", "-1", "at least 0 (0: train to --max-steps)"),
                              ("--val-tokens", "-1", "at least 0"), ("--val-every-doc", "-5", "at least 0"),
                              ("--keep-last", "-1", "at least 0"), ("--shuffle-buffer", "-10", "at least 0"),
                              ("--stall-timeout", "-1.0", "at least 0 seconds"),
                              ("--peak-tflops", "-989.0", "a positive TFLOP/s figure"),
                              ("--peak-tflops", "0.0", "a positive TFLOP/s figure"),
                              ("--ddp-bucket-cap-mb", "0", "a positive integer"),
                              ("--seq-len", "0", "at least 2"), ("--seq-len", "1", "at least 2"),
                              ("--seed", "-1", "in [0, 2**32)"), ("--seed", str(2**32), "in [0, 2**32)")):  # fmt: skip
        with pytest.raises(SystemExit) as exit_info:
            train_accelerate.parse_args([flag, value])
        assert exit_info.value.code == 2
        assert f"error: {flag} {value}: must be {says}" in capsys.readouterr().err
    # the edges that are allowed: no clipping, no warm-up, no decay, a floor at the peak
    train_accelerate.parse_args(["--grad-clip", "0", "--warmup-steps", "0", "--weight-decay", "0", "--min-lr-ratio", "1",
                                 "--val-tokens", "0", "--val-every-doc", "0", "--keep-last", "0", "--shuffle-buffer", "0",
                                 "--stall-timeout", "0", "--seed", "0"])


def test_missing_tracker_is_said(tmp_path, capsys, monkeypatch):
    import train_accelerate

    monkeypatch.setattr(train_accelerate, "is_trackio_available", lambda: False)
    assert run_main(tiny_args(tmp_path, max_steps=1, report_to="trackio"))["finished"]
    assert "trackio is not installed: logging to stdout and metrics.jsonl only (pip install trackio)" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="fp16 autocast applies on a GPU")
def test_fp16_where_accelerate_applies_none_is_said_and_recorded_as_float32(tmp_path, capsys):
    run_main(tiny_args(tmp_path, max_steps=1, mixed_precision="fp16"))
    assert "--mixed-precision fp16 does nothing here" in capsys.readouterr().out
    assert "- Precision: float32 (no mixed precision);" in (tmp_path / "final" / "README.md").read_text()


def test_log_every_zero_logs_nothing(tmp_path):
    summary = run_main(tiny_args(tmp_path, max_steps=2, log_every=0))
    assert summary["finished"] and train_losses(tmp_path) == {} and summary["tokens_seen"] == 2 * 4 * 64


def test_wrong_types_and_backends_fail_before_training(tmp_path):
    out = tmp_path / "run"
    with pytest.raises(ValueError, match=r"^--model-overrides: .*'num_hidden_layers'.*expected int, got str"):
        run_main(tiny_args(out, model_overrides='{"num_hidden_layers": "2"}'))
    (tmp_path / "cfg.json").write_text(json.dumps({"hidden_size": "64"}))
    with pytest.raises(ValueError, match=r"^--model '.*cfg.json': .*'hidden_size'.*expected int, got str"):
        run_main(tiny_args(out, model=tmp_path / "cfg.json"))
    if not torch.cuda.is_available():  # the kernels need an NVIDIA GPU: an error at startup, not at the first step
        with pytest.raises(ValueError, match=r"--nsa-backend triton: nsa_backend='triton' but .*--nsa-backend auto"):
            run_main(tiny_args(out, nsa_backend="triton"))
    assert not out.exists()  # nothing ran, and no empty run directory is left


def test_model_from_a_config_file_or_directory(tmp_path):
    """--model takes a config.json or a directory holding one (the architecture; the weights start random). Its
    attention_mode is used unless --attention-mode is given; --nsa-backend is a runtime flag, never the file's."""
    import train_accelerate

    cfg_dir = tmp_path / "cfg"
    cfg_dir.mkdir()
    fields = dict(train_accelerate.MODEL_PRESETS["tiny"], attention_mode="dense", nsa_backend="triton", hidden_size=96)
    (cfg_dir / "config.json").write_text(json.dumps(fields))
    run_main(tiny_args(tmp_path / "a", model=cfg_dir, max_steps=1))
    record = json.loads((tmp_path / "a" / "run.json").read_text())
    assert record["model_config"]["attention_mode"] == "dense" and record["model_config"]["hidden_size"] == 96
    assert record["config"]["attention_mode"] == "dense" and record["model_config"]["nsa_backend"] == "auto"
    run_main(tiny_args(tmp_path / "b", model=cfg_dir / "config.json", attention_mode="nsa", max_steps=1))
    assert json.loads((tmp_path / "b" / "run.json").read_text())["model_config"]["attention_mode"] == "nsa"


def test_output_dir_of_another_run_and_resume_with_another_model(tmp_path):
    out = tmp_path / "run"
    run_main(tiny_args(out, max_steps=1, save_every=1))
    # without --resume, a second run would mix its checkpoints with the first's
    with pytest.raises(ValueError, match=r"already holds checkpoints of a run \(latest: step_00000001\)\. Pass "
                                         r"--resume latest.*new \(or empty\) --output-dir"):  # fmt: skip
        run_main(tiny_args(out, max_steps=2))
    # resuming with another model: the differing fields and the flags that built the checkpoint, not a size mismatch
    with pytest.raises(ValueError, match=r"another model.*\(checkpoint vs this run:.*hidden_size 64 vs 128.*\)\. "
                                         r"Resume with.*--model tiny"):  # fmt: skip
        run_main(tiny_args(out, max_steps=2, model="smoke", resume="latest"))
    assert set(train_losses(out)) == {1}  # the first run's metrics only
    # a run started with --init-from: the hint names where its model came from (it records no --model)
    tuned = tmp_path / "tuned"
    run_main(tiny_args(tuned, init_from=out / "final", max_steps=1, save_every=1))
    with pytest.raises(ValueError, match=r"another model.*Resume with.*--init-from \S*run/final"):
        run_main(tiny_args(tuned, max_steps=2, model="smoke", resume="latest"))


def test_output_dir_of_a_run_without_checkpoints(tmp_path, capsys):
    """A finished run saved without checkpoints is refused by a new run and by --resume latest for more steps
    (which would start again from step 0 over its final/); --resume latest for no more steps than it trained has
    nothing to do, as for a run with checkpoints; a run stopped before its first checkpoint (metrics.jsonl alone)
    starts again under --resume latest, as a job script relaunched after a crash expects."""
    out = tmp_path / "run"
    run_main(tiny_args(out, max_steps=1))  # --save-every 0: metrics.jsonl and final/, no checkpoint
    files = {p: p.read_bytes() for p in [out / "summary.json", out / "metrics.jsonl", *(out / "final").iterdir()]}
    with pytest.raises(ValueError, match=r"already holds the output of a run \(metrics.jsonl, final, summary.json\) "
                                         r"and no checkpoint\. Pass a new \(or empty\) --output-dir"):  # fmt: skip
        run_main(tiny_args(out, max_steps=1))
    with pytest.raises(ValueError, match=r"--resume latest: \S*run holds a run that ended without a checkpoint "
                                         r"\(metrics.jsonl, final, summary.json.*--init-from \S*run/final"):  # fmt: skip
        run_main(tiny_args(out, max_steps=2, model="smoke", resume="latest"))
    capsys.readouterr()
    assert run_main(tiny_args(out, max_steps=1, resume="latest"))["finished"]  # a relaunched job: nothing to do
    said = capsys.readouterr().out
    assert "the run is finished: step 1 >= --max-steps 1" in said and "training starts from step 0" not in said
    assert {p: p.read_bytes() for p in files} == files
    stopped = tmp_path / "stopped"
    stopped.mkdir()
    (stopped / "metrics.jsonl").write_text('{"step": 1, "loss": 10.0}\n')
    run_main(tiny_args(stopped, max_steps=1, resume="latest"))
    assert (stopped / "final" / "model.safetensors").is_file()


def test_resume_of_a_finished_run_changes_nothing(tmp_path, capsys):
    out = tmp_path / "run"
    run_main(tiny_args(out, max_steps=2, save_every=2))
    files = {p: p.read_bytes() for p in [out / "summary.json", out / "metrics.jsonl", *(out / "final").iterdir()]}
    mtimes = {p: p.stat().st_mtime_ns for p in files}
    summary = run_main(tiny_args(out, max_steps=2, save_every=2, resume="latest"))
    assert summary["finished"] and summary["step"] == 2
    assert "the run is finished: step 2 >= --max-steps 2" in capsys.readouterr().out
    assert json.loads((out / "heartbeat.json").read_text())["phase"] == "done"
    assert {p: p.read_bytes() for p in files} == files and {p: p.stat().st_mtime_ns for p in files} == mtimes
    # the model card names no local path: it may be pushed to the Hub
    card = (out / "final" / "README.md").read_text()
    assert str(tmp_path) not in card and str(SHARED) not in card
    assert 'from_pretrained("path/to/checkpoint"' in card and "tokenizer `gpt2-tokenizer`" in card
    assert f"Data: local files {PARQUET.name} (column 'text')" in card
    config = json.loads((out / "final" / "config.json").read_text())
    assert (f"| attention | NSA: compression block l = {config['cmp_block_size']}, stride d = {config['cmp_stride']}; "
            f"selection block l' = {config['sel_block_size']}, n = {config['sel_num_blocks']} selected; window "
            f"{config['window_size']}; compressor `mlp`; K/V sets: one per branch |") in card
    # raising --max-steps trains further, with the schedule laid over the new length: said, since the rate jumps
    capsys.readouterr()
    summary = run_main(tiny_args(out, max_steps=3, save_every=2, resume="latest"))
    assert summary["finished"] and summary["step"] == 3
    assert ("note: the learning-rate schedule's flags differ from the checkpoint's run (--max-steps 2 there, 3 "
            "here): from step 2 on") in capsys.readouterr().out


def test_resume_of_a_finished_run_whose_last_checkpoint_came_before_its_end(tmp_path, capsys):
    """A run that ended at step 3 with its last checkpoint at step 2 (as --save-every 0 leaves one written at a
    SIGTERM, then resumed to the end; here the end's checkpoint removed). --resume latest with the same --max-steps
    has nothing to do (it retrained step 3 and exported again); a higher one says which steps it trains again."""
    out = tmp_path / "run"
    run_main(tiny_args(out, max_steps=3, save_every=2))
    shutil.rmtree(out / "checkpoints" / "step_00000003")
    files = {p: p.read_bytes() for p in [out / "summary.json", out / "metrics.jsonl", *(out / "final").iterdir()]}
    capsys.readouterr()
    summary = run_main(tiny_args(out, max_steps=3, save_every=2, resume="latest"))
    assert summary["finished"] and summary["step"] == 3
    assert "the run is finished: step 3 >= --max-steps 3" in capsys.readouterr().out
    assert {p: p.read_bytes() for p in files} == files
    summary = run_main(tiny_args(out, max_steps=4, save_every=2, resume="latest"))
    assert summary["finished"] and summary["step"] == 4
    assert "steps 3-3 are trained again on the way to --max-steps 4" in capsys.readouterr().out
    # with --model another than the run's, the checkpoint's model check still runs first
    with pytest.raises(ValueError, match="holds another model than this run builds"):
        run_main(tiny_args(out, max_steps=4, save_every=2, resume="latest", model="smoke"))


def test_a_launch_that_trains_then_dies_leaves_no_finished_summary(tmp_path, monkeypatch):
    """A roll-back of a finished run that dies after its first new checkpoint: summary.json no longer says the run
    finished (it described the abandoned line), so --resume latest trains the new line to its end."""
    import train_accelerate

    out = tmp_path / "run"
    run_main(tiny_args(out, max_steps=4, save_every=2, keep_last=5))
    real_save = checkpoint.RunCheckpoints.save

    def save_then_die(self, run):
        path = real_save(self, run)
        raise KeyboardInterrupt(f"killed after saving {path.name}")

    monkeypatch.setattr(checkpoint.RunCheckpoints, "save", save_then_die)
    rolled_back = dict(max_steps=4, save_every=1, keep_last=5, lr=1e-3)
    with pytest.raises(KeyboardInterrupt, match="step_00000003"):
        run_main(tiny_args(out, resume=str(out / "checkpoints" / "step_00000002"), **rolled_back))
    monkeypatch.undo()
    assert not (out / "summary.json").exists()
    summary = run_main(tiny_args(out, resume="latest", **rolled_back))
    assert summary["finished"] and summary["step"] == 4
    cfg = train_accelerate.TrainConfig(lr=1e-3, warmup_steps=2, max_steps=4)
    assert train_losses(out, "lr")[4] == pytest.approx(train_accelerate.lr_at(3, cfg))  # the new line's step 4


def _fake_world_size(ckpt, world: int):
    """Make a 1-process checkpoint look written by `world` processes (every rank's data state file)."""
    state = json.loads((ckpt / checkpoint.STATE_FILE).read_text())
    state["world_size"] = world
    (ckpt / checkpoint.STATE_FILE).write_text(json.dumps(state))
    for rank in range(1, world):
        shutil.copy(ckpt / "data_state_rank0.json", ckpt / f"data_state_rank{rank}.json")


def test_resume_with_other_data_flags_or_process_count(tmp_path):
    out = tmp_path / "run"
    run_main(tiny_args(out, max_steps=1, save_every=1))
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"text": "another corpus"}) + "\n")
    # the saved data position belongs to the data flags: changed ones are named, checkpoint vs this run
    with pytest.raises(ValueError, match=r"data flags differ.*\(checkpoint vs this run: --dataset '.*parquet' vs "
                                         r"'.*other.jsonl', --cross-doc-attention False vs True, --seq-len 64 vs 32\)"):  # fmt: skip
        run_main(tiny_args(out, max_steps=2, resume="latest", dataset=other, seq_len=32, cross_doc_attention=True))
    with pytest.raises(ValueError, match=r"--seed 1234 vs 7, --data-shard 'docs' vs 'rows'"):
        run_main(tiny_args(out, max_steps=2, resume="latest", seed=7, data_shard="rows"))
    # --data-shard docs: each process saved its place in its own share of the documents
    _fake_world_size(checkpoint.latest_checkpoint(out / "checkpoints"), 2)
    with pytest.raises(ValueError, match=r"written by 2 process\(es\) under --data-shard docs.*this run has 1\. "
                                         r"Resume with 2 process\(es\)"):  # fmt: skip
        run_main(tiny_args(out, max_steps=2, resume="latest"))
    assert set(train_losses(out)) == {1}
    # --data-shard rows: one global position, so another process count continues it (tests/test_train_ddp.py
    # checks 2 processes -> 1 against an uninterrupted run)
    rows = tmp_path / "rows"
    run_main(tiny_args(rows, max_steps=1, save_every=1, data_shard="rows"))
    _fake_world_size(checkpoint.latest_checkpoint(rows / "checkpoints"), 2)
    assert run_main(tiny_args(rows, max_steps=2, resume="latest", data_shard="rows"))["step"] == 2


def test_resume_reads_the_same_files_however_named_and_flags_that_would_be_ignored_are_refused(tmp_path, capsys):
    """--dataset names files: the same ones through a symlink (or a relative path) are the same data, and a resume
    continues; --resume with --eval-only and --dataset-config with local data would be silently ignored: refused."""
    out = tmp_path / "run"
    run_main(tiny_args(out, max_steps=1, save_every=1))
    link = tmp_path / "link.parquet"
    link.symlink_to(PARQUET)
    assert run_main(tiny_args(out, max_steps=2, resume="latest", dataset=link))["step"] == 2
    for flags, says in ((dict(init_from=out / "final", eval_only=True, resume="latest"),
                         "--resume latest with --eval-only: --eval-only evaluates the exported model"),
                        (dict(dataset_config="sample-10BT"),
                         "--dataset-config 'sample-10BT': configs are a Hub dataset's (fineweb-edu, hf://NAME)")):  # fmt: skip
        with pytest.raises(SystemExit):
            run_main(tiny_args(tmp_path / "bad", **flags))
        assert says in capsys.readouterr().err
    # --stop-at-step at or past --max-steps does not stop the run: said
    summary = run_main(tiny_args(tmp_path / "past", max_steps=2, stop_at_step=5))
    assert summary["finished"] and (tmp_path / "past" / "final").is_dir()
    assert "note: --stop-at-step 5 is not before --max-steps 2: the run trains to --max-steps" in capsys.readouterr().out


def test_short_run_notes_and_exported_tokenizer(tmp_path, capsys):
    """`--resume latest` with nothing to resume and a warm-up longer than the run say so; the exported tokenizer
    pads on the left (batched generation) with a pad token."""
    from transformers import AutoTokenizer

    out = tmp_path / "run"
    run_main(tiny_args(out, max_steps=2, warmup_steps=5, resume="latest"))
    log = capsys.readouterr().out
    assert f"--resume latest: no checkpoint found in {out / 'checkpoints'}; training starts from step 0" in log
    assert "warning: --warmup-steps 5 >= --max-steps 2" in log
    tok = AutoTokenizer.from_pretrained(out / "final")
    assert tok.padding_side == "left" and tok.pad_token == tok.eos_token
    assert tok(["a b c", "a"], padding=True).input_ids[1][0] == tok.pad_token_id


def test_cli_errors_are_clear(tmp_path, capsys):
    """A bad flag is exit status 2 with the flag named, no traceback, and no empty output directory: from the
    command line once (the __main__ block turns main()'s errors into that), the other cases in this process (a
    process each cost 6 s of imports): a flag argparse refuses, and a value main() refuses."""
    proc = run_cli(tiny_args(tmp_path / "r", dataset=tmp_path / "missing.parquet"), check=False, timeout=120)
    assert proc.returncode == 2 and "error: --dataset" in proc.stderr and "no such file" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "r").exists()  # a run that fails its checks leaves no empty directory
    with pytest.raises(SystemExit) as exit_:
        run_main(["--preset", "nope"])
    assert exit_.value.code == 2 and "unknown --preset 'nope'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="^--model-overrides: "):
        run_main(tiny_args(tmp_path / "r", model_overrides='{"num_hidden_layers": "2"}'))
    assert not (tmp_path / "r").exists()


def test_push_without_token_fails_before_training(tmp_path, monkeypatch):
    from nsa_train import hub

    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr("huggingface_hub.get_token", lambda: None)
    with pytest.raises(hub.HubError, match="no Hugging Face token"):
        run_main(tiny_args(tmp_path, push_to_hub="me/nsa-test"))
    assert not (tmp_path / "metrics.jsonl").exists()


def test_trainer_feeds_document_boundaries_to_the_model(tmp_path, monkeypatch):
    """The loop passes position_ids that restart at document starts (NSA's packed-document input) and masked labels;
    with --cross-doc-attention it passes plain 0..T-1 positions and every label."""
    from modeling_nsa import NSAForCausalLM

    seen, real_forward = [], NSAForCausalLM.forward

    def spy(self, *args, **kwargs):
        if self.training:
            seen.append({k: kwargs.get(k) for k in ("input_ids", "position_ids", "labels", "num_items_in_batch")})
        return real_forward(self, *args, **kwargs)

    monkeypatch.setattr(NSAForCausalLM, "forward", spy)
    run_main(tiny_args(tmp_path / "docs", max_steps=2, micro_batch_size=8))
    pos, lab = seen[0]["position_ids"], seen[0]["labels"]
    starts = (pos[:, 1:] == 0)
    assert starts.any(), "a batch of 8 x 64 wiki tokens holds a document boundary"
    assert torch.equal(starts, lab[:, 1:] == -100)
    assert torch.equal(seen[0]["input_ids"][:, :-1][starts], torch.full_like(seen[0]["input_ids"][:, :-1][starts], 50256))
    assert int(seen[0]["num_items_in_batch"]) == int((lab[:, 1:] != -100).sum())
    seen.clear()
    run_main(tiny_args(tmp_path / "cross", max_steps=1, micro_batch_size=8, cross_doc_attention=True))
    assert torch.equal(seen[0]["position_ids"], torch.arange(64).expand(8, 64))
    assert torch.equal(seen[0]["labels"], seen[0]["input_ids"])


def test_gradient_checkpointing_and_dense_baseline(tmp_path):
    """--gradient-checkpointing changes memory, not the math; --attention-mode dense trains the A/B baseline."""
    plain, ckpt, dense = tmp_path / "plain", tmp_path / "ckpt", tmp_path / "dense"
    run_main(tiny_args(plain, max_steps=2))
    run_main(tiny_args(ckpt, max_steps=2, gradient_checkpointing=True))
    lp, lc = train_losses(plain), train_losses(ckpt)
    assert lc == pytest.approx(lp, rel=1e-6)
    assert train_losses(ckpt, "grad_norm") == pytest.approx(train_losses(plain, "grad_norm"), rel=1e-5)
    run_main(tiny_args(dense, max_steps=2, attention_mode="dense"))
    record = json.loads((dense / "run.json").read_text())
    assert record["model_config"]["attention_mode"] == "dense"
    assert record["flops_per_token"]["dense"] == record["flops_per_token"]["nsa"]
    assert json.loads((dense / "final" / "config.json").read_text())["attention_mode"] == "dense"


def test_compile_trains_as_uncompiled_and_resumes_without_it(tmp_path, monkeypatch):
    """--compile: the training steps run one compiled graph (no graph break) and train as the uncompiled loop does;
    its checkpoints resume without --compile (no "_orig_mod." names); evaluation runs the model uncompiled.
    (Inductor's code generation is torch's to test: AOTAutograd's eager backend keeps this test fast on a CPU.)"""
    from torch._dynamo.backends.registry import lookup_backend

    graphs = []

    def counting_aot_eager(gm, example_inputs):
        graphs.append(gm)
        return lookup_backend("aot_eager")(gm, example_inputs)

    compile_calls = []
    real_compile = torch.compile

    def compile_counting(model, **kwargs):
        compile_calls.append(kwargs)
        return real_compile(model, backend=counting_aot_eager, **kwargs)

    monkeypatch.setattr(torch, "compile", compile_counting)
    plain, compiled = tmp_path / "plain", tmp_path / "compiled"
    run_main(tiny_args(plain, max_steps=4, save_every=2, eval_every=2))
    assert not compile_calls and not graphs
    run_main(tiny_args(compiled, max_steps=4, save_every=2, eval_every=2, compile=True))
    assert len(compile_calls) == 1
    # one graph for the training forward (its backward is AOTAutograd's): a break would add one, an evaluation's
    # forward through the compiled model another
    assert len(graphs) == 1, [g.code[:200] for g in graphs]
    for key in ("loss", "grad_norm"):
        assert train_losses(compiled, key) == pytest.approx(train_losses(plain, key), rel=1e-5)
    assert val_losses(compiled) == pytest.approx(val_losses(plain), rel=1e-5)
    assert_same_weights(final_state(compiled), final_state(plain), atol=1e-5, rtol=1e-4)
    # (a compiled run's checkpoint holds what an uncompiled one does, so the other direction is the same files)
    resumed = tmp_path / "compiled_then_plain"
    shutil.copytree(compiled / "checkpoints" / "step_00000002", resumed / "checkpoints" / "step_00000002")
    run_main(tiny_args(resumed, max_steps=4, save_every=2, resume="latest"))
    assert train_losses(resumed) == pytest.approx({s: train_losses(plain)[s] for s in (3, 4)}, rel=1e-5)


def test_model_card_says_which_step_its_validation_loss_is_from(tmp_path):
    """A card written between evaluations (--export-every-save, or a step 7 export after the step 0 evaluation)
    quotes the latest validation loss with its step, not as the final one."""
    import train_accelerate
    from modeling_nsa import NSAConfig
    from nsa_train import model_card
    from nsa_train.run_state import RunState

    cfg = train_accelerate.parse_args(tiny_args(tmp_path / "run"))
    run = RunState(step=7, tokens_seen=7 * 256, val_loss=10.8441, val_ppl=51234.5, val_step=0)
    fields = model_card.run_card_fields(cfg, NSAConfig(), run, n_params=10**6, world=1, mixed_precision="no",
                                        device="cpu", data_description="d", out_dir=tmp_path / "run")  # fmt: skip
    card = model_card.render(fields)
    assert "| optimizer steps | 7 |" in card
    assert "| validation loss, latest evaluation (at step 0) | 10.8441 |" in card
    assert "by the query's position" not in card  # (not measured: no section)
    # saved with the run's progress: a resumed run's card still says where its loss came from
    state = run.trainer_state(1, {}, {})
    assert RunState.from_checkpoint(state, {}, started=0.0).val_step == 0
    # the loss by query position, as evaluate() records it, in position order (not the metrics' string order)
    run.val_by_position = {"val_loss_pos512to1024": 2.5, "val_loss_pos0to64": 3.25, "val_loss_pos64to512": 2.75}
    card = model_card.render(model_card.run_card_fields(cfg, NSAConfig(), run, n_params=10**6, world=1,
                                                        mixed_precision="no", device="cpu", data_description="d",
                                                        out_dir=tmp_path / "run"))  # fmt: skip
    assert "Validation loss by the query's position in its document (tokens before it; at step 0)" in card
    assert "| 0-63 | 3.2500 |\n| 64-511 | 2.7500 |\n| 512-1,023 | 2.5000 |" in card


def test_model_card_describes_the_batch_documents_schedule_and_an_init_from_run(tmp_path):
    import train_accelerate
    from modeling_nsa import NSAConfig
    from nsa_train import model_card
    from nsa_train.run_state import RunState

    def card(cross_doc=False, **flags):
        cfg = train_accelerate.parse_args(tiny_args(tmp_path / "run", **flags))
        cfg.cross_doc_attention = cross_doc
        fields = model_card.run_card_fields(cfg, NSAConfig(), RunState(step=10, tokens_seen=10_240), n_params=10**6,
                                            world=2, mixed_precision="no", device="cpu", data_description="d",
                                            out_dir=tmp_path / "run")  # fmt: skip
        return model_card.render(fields)

    text = card(micro_batch_size=4, grad_accum=3, max_steps=10, min_lr_ratio=0.1)
    assert "Global batch: 24 rows (4 per micro-batch x 3 accumulation x 2 processes) = 1,536 tokens per step." in text
    assert "documents packed with EOS between them and never attended across" in text
    assert "2 warm-up steps, then cosine decay to 0.0003 at step 10," in text  # lr 3e-3 x 0.1
    # a run shorter than its warm-up never decays: the card says where its learning rate stopped
    short = card(max_steps=3, warmup_steps=12)
    assert "12 warm-up steps, of which the run took 3: it ended inside the warm-up at lr 0.00075, with no" in short
    assert "cosine decay to" not in short
    assert "trained on 10,240 tokens:" in text and "initialized at random" in text
    assert "attention across documents (GPT-2 style)" in card(cross_doc=True)
    final = tmp_path / "first" / "final"
    final.mkdir(parents=True)  # (a local source is named by its run and folder: the card may be pushed)
    text = card(init_from=final)
    assert "trained on 10,240 tokens after the training of `first/final`:" in text
    assert "initialized from `first/final` (its own training is not counted" in text


def test_model_card_names_nsa_structure_only_for_an_nsa_checkpoint(tmp_path):
    """An NSA card's attention row gives l, d, l', n, the window and the compressor; a dense-mode card says the
    config's NSA fields are unused instead of listing them as if they shaped the model."""
    import train_accelerate
    from modeling_nsa import NSAConfig
    from nsa_train import model_card
    from nsa_train.run_state import RunState

    def attention_row(**config):
        cfg = train_accelerate.parse_args(tiny_args(tmp_path / "run"))
        fields = model_card.run_card_fields(cfg, NSAConfig(**config), RunState(step=1, tokens_seen=256), n_params=10**6,
                                            world=1, mixed_precision="no", device="cpu", data_description="d",
                                            out_dir=tmp_path / "run")  # fmt: skip
        return next(line for line in model_card.render(fields).splitlines() if line.startswith("| attention |"))

    nsa = attention_row(cmp_block_size=16, cmp_stride=8, sel_block_size=32, sel_num_blocks=4, window_size=64,
                        compressor="mean_mlp")
    assert "l = 16, stride d = 8; selection block l' = 32, n = 4 selected; window 64; compressor `mean_mlp`" in nsa
    assert "K/V sets: one per branch" in nsa
    assert "K/V sets: one shared by the branches |" in attention_row(kv_per_branch=False)
    assert "K/V sets: `win`'s own, one shared by the other two |" in attention_row(kv_per_branch="win")
    dense = attention_row(attention_mode="dense", compressor="mean_mlp")
    assert dense.startswith("| attention | dense:") and "not used" in dense
    assert "compressor" not in dense and "window" not in dense
    # the first sentence and the weights' start say which model it is too
    cfg = train_accelerate.parse_args(tiny_args(tmp_path / "run"))
    for mode, says, never in (("nsa", "decoder with **Native Sparse Attention**", "dense mode"),
                              ("dense", "decoder in the dense mode of this project's NSA model", "with **Native")):
        fields = model_card.run_card_fields(cfg, NSAConfig(attention_mode=mode), RunState(step=1, tokens_seen=256),
                                            n_params=10**6, world=1, mixed_precision="no", device="cpu",
                                            data_description="d", out_dir=tmp_path / "run")  # fmt: skip
        card = model_card.render(fields)
        assert f"A 1.0M-parameter {says}" in card and never not in card, mode
        assert ("every shared parameter copied" in card) == (mode == "dense"), mode


def test_help_lists_every_flag(capsys):
    import train_accelerate

    with pytest.raises(SystemExit) as exit_info:
        train_accelerate.parse_args(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--preset", "--dataset", "--seq-len", "--ddp-comm-hook", "--resume", "--push-to-hub", "--stall-timeout"):
        assert flag in text
    # every flag shows its default (argparse shows it only for flags with help text)
    assert all(a.help for a in train_accelerate.build_parser()._actions)
    for flag, default in (("--seq-len SEQ_LEN", 2048), ("--lr LR", 0.0006), ("--max-steps MAX_STEPS", 5000),
                          ("--micro-batch-size MICRO_BATCH_SIZE", 16)):  # fmt: skip
        assert re.search(rf"{flag}\s+\(default: {default}\)", text), flag
    with pytest.raises(SystemExit):  # with a preset, its defaults
        train_accelerate.parse_args(["--preset=smoke", "--help"])
    assert re.search(r"--seq-len SEQ_LEN\s+\(default: 128\)", capsys.readouterr().out)


def test_preset_and_unknown_flags(capsys):
    import train_accelerate

    for argv in (["--preset", "smoke"], ["--preset=smoke"]):
        cfg = train_accelerate.parse_args([*argv, "--max-steps", "20"])
        assert (cfg.dataset, cfg.seq_len, cfg.warmup_steps, cfg.max_steps) == ("python-docs", 128, 20, 20), argv
    with pytest.raises(SystemExit) as exit_info:  # argparse's error, not a ValueError traceback
        train_accelerate.parse_args(["--lr-rate", "3"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "error: unrecognized arguments: --lr-rate 3 (did you mean" in err and "--lr?" in err
    with pytest.raises(SystemExit):  # a prefix of a flag is not that flag (argparse would take it by default)
        train_accelerate.parse_args(["--max-step", "2"])
    assert "unrecognized arguments: --max-step 2 (did you mean --max-steps" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        train_accelerate.parse_args(["--preset", "tiny"])
    assert "unknown --preset 'tiny'; choose from ['smoke'] ('tiny' is a --model: --model tiny)" in capsys.readouterr().err


def test_run_state_is_what_a_checkpoint_holds():
    """RunState -> trainer_state.json (+ the data state) -> RunState gives the same progress; the file keeps the
    keys older checkpoints have, and a checkpoint without the validation figures still resumes."""
    import dataclasses

    from nsa_train.data import DataState
    from nsa_train.run_state import RunState, Schedule

    run = RunState(step=7, tokens_seen=7 * 256, skipped_steps=1, val_loss=3.5, val_ppl=33.1, val_step=6,
                   data=DataState(1, 2, 3), last_log={"loss": 3.4}, val_by_position={"val_loss_pos0to64": 3.7},
                   selection_stats={"layers": [{"layer": 0, "gate_cmp_mean": 0.3}]},
                   schedules=[Schedule(0, 10, 1e-3, 2, 0.1), Schedule(5, 20, 1e-3, 0, 0.1)])  # fmt: skip
    saved = json.loads(json.dumps(run.trainer_state(2, {"seed": 1}, {"hidden_size": 64})))
    assert set(saved) == {"step", "tokens_seen", "skipped_steps", "world_size", "val_loss", "val_ppl", "val_step",
                          "val_by_position", "selection_stats", "schedules", "config", "model_config"}  # fmt: skip
    assert (saved["world_size"], saved["config"], saved["model_config"]) == (2, {"seed": 1}, {"hidden_size": 64})
    back = RunState.from_checkpoint(saved, json.loads(json.dumps(run.data.to_dict())), started=run.started)
    assert back == dataclasses.replace(run, last_log={})  # the last log record belongs to the process that wrote it
    older = {k: saved[k] for k in ("step", "tokens_seen", "skipped_steps")}
    resumed_older = RunState.from_checkpoint(older, {"epoch": 0, "doc": 5, "offset": 0}, started=0.0)
    assert resumed_older.val_loss is None and resumed_older.val_step is None
    assert resumed_older.val_by_position == {} and resumed_older.selection_stats == {}
    # a checkpoint written before schedules were saved: its run's own flags' schedule, from step 0
    flags = {"max_steps": 10, "lr": 1e-3, "warmup_steps": 2, "min_lr_ratio": 0.1}
    assert RunState.from_checkpoint({**older, "config": flags}, {"epoch": 0, "doc": 5, "offset": 0},
                                    started=0.0).schedules == [Schedule(0, 10, 1e-3, 2, 0.1)]  # fmt: skip


def test_every_evaluation_metric_is_logged(tmp_path, capsys):
    """An evaluation's metrics dict is logged whole: metrics.jsonl keeps each name, the trackers get <group>/<name>,
    the console line shows each (a metric added to the dict needs no logging code)."""
    from types import SimpleNamespace

    from nsa_train.run_state import RunState
    from nsa_train.step_log import StepLog

    class Tracked:  # what StepLog uses of the Accelerator, recording what goes to the trackers
        is_main_process, num_processes, device = True, 1, torch.device("cpu")

        def __init__(self):
            self.logged = []

        def init_trackers(self, name, config, init_kwargs):
            self.logged.append(("init", name))
            self.init_kwargs = init_kwargs

        def log(self, values, step):
            self.logged.append((values, step))

    accelerator = Tracked()
    log = StepLog(accelerator, tmp_path, SimpleNamespace(report_to="tensorboard", max_steps=10, log_every=1,
                                                         resume=None),
                  RunState(), (1.0, 1.0), None, {"seed": 1})  # fmt: skip
    log.log_eval(5, {"val_loss": 2.0, "val_ppl": 7.389, "val_loss_pos0to64": 2.5, "val_loss_pos64to128": 1.75,
                     "sel_recall": 0.75, "sel_l1_recall": 0.5})  # fmt: skip
    log.close()
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == {"step": 5, "val_loss": 2.0, "val_ppl": 7.389,
                                                                     "val_loss_pos0to64": 2.5,
                                                                     "val_loss_pos64to128": 1.75,
                                                                     "sel_recall": 0.75, "sel_l1_recall": 0.5}  # fmt: skip
    assert accelerator.logged == [("init", "logs"), ({"val/loss": 2.0, "val/ppl": 7.389, "val/loss_pos0to64": 2.5,
                                                      "val/loss_pos64to128": 1.75, "sel/recall": 0.75,
                                                      "sel/l1_recall": 0.5}, 5)]  # fmt: skip
    # the console line: every metric but the per-layer ones (their mean over layers shows), the loss by position as
    # one item after the perplexity
    said = capsys.readouterr().out
    assert ("step 5: val loss 2.0000 ppl 7.39 by position 0-63 2.5000 64-127 1.7500 sel_recall 0.75\n" in said
            and "l1_recall" not in said)  # fmt: skip
    # the selection statistics: one console item of their means over layers; the file keeps every figure
    stats = {"stats_l0_gate_cmp_mean": 0.2, "stats_all_gate_cmp_mean": 0.31, "stats_all_gate_cmp_std": 0.05,
             "stats_all_gate_slc_mean": 0.354, "stats_all_gate_win_mean": 0.336, "stats_all_distance_mean": 4.25,
             "stats_all_beyond_window_share": 0.412, "stats_all_forced_share": 0.2249, "stats_all_neighbour_overlap":
             0.634, "stats_all_neighbour_jaccard": 0.5}  # fmt: skip
    (tmp_path / "stats").mkdir()
    log = StepLog(Tracked(), tmp_path / "stats", SimpleNamespace(report_to="none", max_steps=10, log_every=1,
                                                                 resume=None),
                  RunState(), (1.0, 1.0), None, {})  # fmt: skip
    log.log_eval(6, {"val_loss": 2.0, **stats})
    log.close()
    said = capsys.readouterr().out
    assert ("step 6: val loss 2.0000 selection: gates cmp/slc/win 0.31/0.35/0.34, reach 4.2 blocks, beyond window "
            "41%, forced 22%, overlap 0.63\n") in said and "stats_" not in said, said
    assert json.loads((tmp_path / "stats" / "metrics.jsonl").read_text()) == {"step": 6, "val_loss": 2.0, **stats}
    # a resume hides TensorBoard's events after its step, also from step 0 (a launch that died before its first
    # checkpoint), and a new run purges nothing
    for resume, step, expected in (("latest", 0, {"tensorboard": {"purge_step": 1}}),
                                   ("latest", 7, {"tensorboard": {"purge_step": 8}}), (None, 0, {})):  # fmt: skip
        accelerator = Tracked()
        StepLog(accelerator, tmp_path, SimpleNamespace(report_to="tensorboard", max_steps=10, log_every=1,
                                                       resume=resume),
                RunState(step=step), (1.0, 1.0), None, {}).close()  # fmt: skip
        assert accelerator.init_kwargs == expected, (resume, step)


def test_tokens_per_second_counts_the_tokens_trained_since_the_last_log(tmp_path, monkeypatch):
    """tok/s (and the MFU, the model card and ab_compare's speed column from it) is the tokens trained since the
    last log over the training time since then, also in a run resumed mid-way."""
    from types import SimpleNamespace

    from nsa_train import step_log
    from nsa_train.run_state import RunState

    clock = [100.0]
    monkeypatch.setattr(step_log.time, "time", lambda: clock[0])

    class OneProcess:  # what StepLog uses of the Accelerator
        is_main_process, num_processes, device = True, 1, torch.device("cpu")

        def reduce(self, tensor, reduction):
            return tensor

    run = RunState(step=10, tokens_seen=5_000)  # resumed at step 10
    log = step_log.StepLog(OneProcess(), tmp_path, SimpleNamespace(report_to="none", max_steps=20, log_every=2,
                                                                   resume="latest"), run,
                           (2.0, 1.0), 1e3, {})  # fmt: skip
    for loss in (1.0, 3.0):
        run.advance(256, data=None)
        log.step_done(torch.tensor(loss))
    clock[0] += 4.0
    log.log_training(run, lr=1e-3, grad_norm=1.0)
    assert run.last_log["tok_s"] == pytest.approx(512 / 4) and run.last_log["loss"] == pytest.approx(2.0)
    assert run.last_log["mfu_dense"] == pytest.approx(2.0 * 128 / 1e3)
    clock[0] += 10.0  # an evaluation, then two more steps in 2 s: the evaluation's time is not counted
    log.restart_clock()
    for _ in range(2):
        run.advance(256, data=None)
        log.step_done(torch.tensor(1.0))
    clock[0] += 2.0
    log.log_training(run, lr=1e-3, grad_norm=1.0)
    assert run.last_log["tok_s"] == pytest.approx(512 / 2)
    # an evaluation (or a save) between two logs: the steps before it count with their time, the evaluation's
    # time does not (four 1-s steps of 256 tokens, 10 s of evaluation after the second)
    for i in range(4):
        clock[0] += 1.0
        run.advance(256, data=None)
        log.step_done(torch.tensor(1.0))
        if i == 1:
            clock[0] += 10.0
            log.restart_clock()
    log.log_training(run, lr=1e-3, grad_norm=1.0)
    assert run.last_log["tok_s"] == pytest.approx(1024 / 4)


def test_metrics_records_kept_on_resume(tmp_path):
    """Resuming at step N keeps metrics.jsonl's records up to N; a relaunch from step 0 (no checkpoint yet) keeps
    none, not even the step-0 evaluation it logs again; a line cut short by a kill goes too."""
    from nsa_train.step_log import keep_records_up_to

    path = tmp_path / "metrics.jsonl"
    lines = [{"step": 0, "val_loss": 5.0}, {"step": 1, "loss": 4.0}, {"step": 2, "loss": 3.9}, {"step": 3, "loss": 3.8}]
    text = "".join(json.dumps(r) + "\n" for r in lines) + '{"step": 4, "lo'
    path.write_text(text)
    keep_records_up_to(path, 2)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [0, 1, 2]
    path.write_text(text)
    keep_records_up_to(path, 0)
    assert path.read_text() == ""


def test_checkpoints_do_not_warn_about_the_tied_head(tmp_path, caplog):
    # accelerate drops lm_head.weight (the embeddings' tied copy) from each checkpoint and warned about it at every
    # save; the tie is rebuilt with the model, so the warning only alarms (exact resume is tested above)
    import logging

    with caplog.at_level(logging.WARNING):
        run_main(tiny_args(tmp_path / "run", max_steps=1, save_every=1))
    assert (tmp_path / "run" / "checkpoints" / "step_00000001").is_dir()
    assert not [r.getMessage() for r in caplog.records if "Removed shared tensor" in r.getMessage()]


def test_init_from_a_saved_model_and_eval_only(tmp_path, capsys):
    """--init-from starts from a saved model's weights (its step-0 validation loss is the one it ended with), and
    --eval-only evaluates it on the same held-out rows, writes eval.json and trains nothing."""
    first = tmp_path / "first"
    run_main(tiny_args(first, max_steps=3, eval_every=3))
    ended_with = val_losses(first)[3]
    capsys.readouterr()
    result = run_main(tiny_args(tmp_path / "eval", init_from=first / "final", eval_only=True))
    assert "is not the tokenizer saved with --init-from" not in capsys.readouterr().out  # the same one
    assert json.loads((tmp_path / "eval" / "eval.json").read_text()) == result
    assert result["val_loss"] == pytest.approx(ended_with, rel=1e-6) and result["val_rows"] > 0
    assert not (tmp_path / "eval" / "metrics.jsonl").exists() and not (tmp_path / "eval" / "final").exists()
    run_main(tiny_args(tmp_path / "more", init_from=first / "final", max_steps=1, eval_every=1))
    assert val_losses(tmp_path / "more")[0] == pytest.approx(ended_with, rel=1e-6)
    # the run records where its architecture came from, not a --model it did not use
    recorded = json.loads((tmp_path / "more" / "run.json").read_text())["config"]
    assert recorded["model"] is None and recorded["init_from"] == str(first / "final")
    assert "initialized from `first/final`" in (tmp_path / "more" / "final" / "README.md").read_text()
    assert "initialized at random" in (first / "final" / "README.md").read_text()
    assert "| validation loss, latest evaluation (at step 3) |" in (first / "final" / "README.md").read_text()
    # without --tokenizer the model's own (saved in its final/) is the default, not the Hub's gpt2
    import train_accelerate

    assert train_accelerate.parse_args(["--init-from", str(first / "final")]).tokenizer == str(first / "final")
    assert train_accelerate.parse_args(["--init-from", str(tmp_path / "elsewhere")]).tokenizer == "gpt2"
    assert train_accelerate.parse_args([]).tokenizer == "gpt2"
    own = run_main(tiny_args(tmp_path / "eval-own", init_from=first / "final", eval_only=True, tokenizer=None))
    assert own["val_loss"] == pytest.approx(ended_with, rel=1e-6)
    assert "is not the tokenizer saved with --init-from" not in capsys.readouterr().out
    # another tokenizer than the one saved with the model reads its ids as other text: said
    run_main(tiny_args(tmp_path / "eval-bytes", init_from=first / "final", eval_only=True, tokenizer="byt5"))
    assert (f"warning: --tokenizer 'byt5' (ByT5Tokenizer, 384 tokens) is not the tokenizer saved with --init-from "
            f"{first / 'final'} (GPT2Tokenizer)") in capsys.readouterr().out
    # ... also one of the same class whose vocabulary differs (two tokens' ids swapped in the saved one)
    altered = tmp_path / "altered"
    shutil.copytree(first / "final", altered)
    saved = json.loads((altered / "tokenizer.json").read_text())
    vocab = saved["model"]["vocab"]
    vocab["the"], vocab["and"] = vocab["and"], vocab["the"]
    (altered / "tokenizer.json").write_text(json.dumps(saved))
    run_main(tiny_args(tmp_path / "eval-altered", init_from=altered, eval_only=True))
    assert "is not the tokenizer saved with --init-from" in capsys.readouterr().out
    # what cannot work fails before anything runs, naming the flag
    for args, message in [
        (dict(eval_only=True), "--eval-only evaluates the model given by --init-from"),
        (dict(init_from=first / "final", model_overrides='{"num_hidden_layers": 1}'), "not used with --init-from"),
    ]:  # fmt: skip
        with pytest.raises(SystemExit):
            run_main(tiny_args(tmp_path / "bad", **args))
        assert message in capsys.readouterr().err
    with pytest.raises(ValueError, match="--init-from .*cannot load an NSA model"):
        run_main(tiny_args(tmp_path / "bad", init_from=tmp_path / "nothing-here", eval_only=True))
    with pytest.raises(ValueError, match="--attention-mode dense: the --init-from model is 'nsa'"):
        run_main(tiny_args(tmp_path / "bad", init_from=first / "final", attention_mode="dense"))


def test_resume_keeps_where_the_run_began_and_init_from_takes_nsa_models_only(tmp_path, monkeypatch):
    """A resumed run's weights are its checkpoint's: an --init-from other than the run's own is refused (it would
    be recorded in run.json and the card, never used); the run's own is taken however spelt; resumed without it
    (the architecture from --model), the run still records and cards where it began. --init-from refuses a saved
    model of another model_type (from_pretrained would load a Llama with a warning, NSA's weights at random)."""
    first = tmp_path / "first"
    run_main(tiny_args(first, max_steps=1))
    begun_at_random = tmp_path / "random"
    run_main(tiny_args(begun_at_random, max_steps=2, stop_at_step=1, save_every=1))
    with pytest.raises(ValueError, match=r"--init-from \S*first/final with --resume latest: the run of \S*step_00000001 "
                                         r"began at random weights.*Drop --init-from; to start from"):  # fmt: skip
        run_main(tiny_args(begun_at_random, max_steps=2, resume="latest", init_from=first / "final"))
    tuned = tmp_path / "tuned"
    run_main(tiny_args(tuned, init_from=first / "final", max_steps=3, stop_at_step=1, save_every=1))
    other = tmp_path / "other"
    shutil.copytree(first / "final", other)
    with pytest.raises(ValueError, match=r"began from --init-from \S*first/final.*\(or pass the run's own"):
        run_main(tiny_args(tuned, init_from=other, resume="latest", max_steps=3, stop_at_step=2))
    run_main(tiny_args(tuned, init_from=f"{first / 'final'}/", resume="latest", max_steps=3, stop_at_step=2))
    # paths relative to the directory a launch ran in stay that run's from any other directory
    monkeypatch.chdir(tmp_path)
    shutil.copy(PARQUET, tmp_path / "wiki.parquet")
    relative = tmp_path / "relative"
    run_main(tiny_args("relative", init_from="first/final", dataset="wiki.parquet", max_steps=2, stop_at_step=1,
                       save_every=1))  # fmt: skip
    monkeypatch.chdir(tmp_path / "first")
    run_main(tiny_args(relative, init_from=tmp_path / "first" / "final", dataset=tmp_path / "wiki.parquet",
                       resume="latest", max_steps=2))  # fmt: skip
    monkeypatch.chdir(REPO)
    run_main(tiny_args(tuned, model=first / "final", resume="latest", max_steps=3))  # no --init-from
    recorded = json.loads((tuned / "run.json").read_text())["config"]
    assert recorded["init_from"] == str(first / "final") and recorded["model"] == str(first / "final")
    assert "initialized from `first/final`" in (tuned / "final" / "README.md").read_text()
    # a Llama checkpoint is not an NSA model to continue
    from transformers import LlamaConfig, LlamaForCausalLM

    LlamaForCausalLM(LlamaConfig(vocab_size=50304, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1)).save_pretrained(tmp_path / "llama")
    with pytest.raises(ValueError, match=r"--init-from \S*llama.*cannot load an NSA model from it \(it holds a "
                                         r"'llama' model, not an NSA one"):  # fmt: skip
        run_main(tiny_args(tmp_path / "from-llama", init_from=tmp_path / "llama", max_steps=1))
    assert not (tmp_path / "from-llama").exists()


def test_a_live_launch_holds_its_output_dir(tmp_path):
    """A second launch into a folder a live launch is writing (a new run, or a resume) is refused naming the
    holder; the lock goes with its process however that ends (SIGKILL here), and a run releases its own at the end."""
    out = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(REPO)!r})
        from nsa_train import checkpoint
        lock = checkpoint.lock_output_dir({str(out)!r})
        print("held", flush=True)
        time.sleep(600)
        """)], stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        heartbeat = '{"time": 1, "pid": %d, "step": 7, "phase": "eval"}' % holder.pid  # the live launch's
        (out / "heartbeat.json").write_text(heartbeat)
        for resume in (None, "latest"):
            with pytest.raises(ValueError, match=rf"--output-dir \S*run is in use by another launch \(pid {holder.pid} "
                                                 r"on .*\): two launches.*or pass another --output-dir"):  # fmt: skip
                run_main(tiny_args(out, max_steps=1, resume=resume))
        assert sorted(p.name for p in out.iterdir()) == ["heartbeat.json", "run.lock"]  # nothing written beside
        assert (out / "heartbeat.json").read_text() == heartbeat  # the refused launch did not end the live one's
    finally:
        holder.kill()
        holder.wait()
    run_main(tiny_args(out, max_steps=1, save_every=1))  # the killed launch's lock went with it
    assert run_main(tiny_args(out, max_steps=2, resume="latest"))["step"] == 2  # and this one released its own


def test_an_output_dir_that_cannot_be_created_is_a_clear_error(tmp_path, monkeypatch):
    """A folder the main process cannot create or lock (permissions, a full disk) is the same ValueError on every
    process (under DDP the others wait for the main process's verdict: an OSError there alone would hang them)."""
    def denied(out_dir):
        raise PermissionError(13, "Permission denied", str(out_dir))

    monkeypatch.setattr(checkpoint, "lock_output_dir", denied)
    with pytest.raises(ValueError, match=r"--output-dir \S*run: cannot create or lock it \(\[Errno 13\] Permission denied"):
        run_main(tiny_args(tmp_path / "run", max_steps=1))
    monkeypatch.undo()
    # a filesystem without locks (ENOLCK: NFS without its lock daemon) is not "another launch"
    import errno
    import fcntl

    def no_locks(handle, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    with pytest.raises(OSError, match=r"cannot lock \S*run.lock \(\[Errno 37\] No locks available\): this "
                                      r"filesystem may not support file locks"):  # fmt: skip
        checkpoint.lock_output_dir(tmp_path / "run")


def test_a_failing_sample_is_a_warning_after_the_export(tmp_path, capsys, monkeypatch):
    """--sample-prompt runs after the export: a sample that fails (here generation raises as a decoder that cannot
    decode an id would) is said as a warning, and the run ends as finished with its summary.json; one that works is
    printed."""
    import train_accelerate

    run_main(tiny_args(tmp_path / "ok", max_steps=1, sample_prompt="The "))
    assert "sample: 'The " in capsys.readouterr().out

    def fails(*args, **kwargs):
        raise ValueError("bytes must be in range(0, 256)")

    monkeypatch.setattr(train_accelerate, "generate_sample", fails)
    summary = run_main(tiny_args(tmp_path / "run", max_steps=1, sample_prompt="The "))
    assert summary["finished"] and json.loads((tmp_path / "run" / "summary.json").read_text())["finished"]
    assert (tmp_path / "run" / "final" / "model.safetensors").is_file()
    assert ("warning: the end-of-run sample (--sample-prompt 'The ') failed: ValueError: bytes must be in range(0, "
            "256). The run is trained and exported") in capsys.readouterr().out


def test_the_card_describes_the_schedules_the_weights_trained_under(tmp_path):
    """A run's card names the learning-rate schedule its weights trained under, not this launch's flags: an early
    checkpoint exported into a new folder (--max-steps its step) trained under its run's longer schedule, and
    stopped part-way down it; a resume with another --max-steps switches schedules from its step on."""
    from types import SimpleNamespace

    import train_accelerate
    from nsa_train.run_state import Schedule, lr_at

    out = tmp_path / "run"
    run_main(tiny_args(out, max_steps=6, stop_at_step=3, save_every=3, warmup_steps=2))
    exported = tmp_path / "at-3"
    run_main(tiny_args(exported, max_steps=3, warmup_steps=2, resume=out / "checkpoints" / "step_00000003"))
    card = (exported / "final" / "README.md").read_text()
    six = Schedule(0, 6, 3e-3, 2, 0.1)
    left = f"then cosine decay to 0.0003 at step 6, of which the run took 3 (its last step at lr {lr_at(2, six):.3g})"
    assert f"2 warm-up steps, {left}, gradient clipping" in card
    run_main(tiny_args(out, max_steps=8, warmup_steps=1, resume="latest"))
    card = (out / "final" / "README.md").read_text()
    assert (f"lr 0.003, betas (0.9, 0.95), weight decay 0.1 on matrices only), 2 warm-up steps, {left}; from step 3 "
            "(resumed with other schedule flags) lr 0.003, 1 warm-up steps, then cosine decay to 0.0003 at step 8, "
            "gradient clipping") in card
    # a schedule shorter than its warm-up, left early: the steps it took and the rate it ended at, not its plan's
    from nsa_train.model_card import schedule_words

    warm = Schedule(0, 6, 3e-3, 20, 0.1)
    assert schedule_words([warm], 3) == ("of which the run took 3: it ended inside the warm-up at lr 0.00045, with "
                                         "no cosine decay")
    # a resume that switched schedules and stopped before a step, then resumed with the first flags: one schedule
    from nsa_train.run_state import RunState

    run = RunState(step=3, schedules=[six])
    run.follow_schedule(SimpleNamespace(max_steps=8, lr=3e-3, warmup_steps=1, min_lr_ratio=0.1))
    run.follow_schedule(SimpleNamespace(max_steps=6, lr=3e-3, warmup_steps=2, min_lr_ratio=0.1))
    assert run.schedules == [six]
    assert train_accelerate.lr_at is lr_at  # the trainer's steps follow the schedule the card describes


def test_dense_sdpa_with_packed_documents_on_a_gpu_names_flex_attention():
    """The note fires for dense mode on SDPA (default or named) with document masking on a CUDA device, and only
    there: NSA mode, cross-document rows, flex_attention, and CPU runs stay silent."""
    import train_accelerate
    from modeling_nsa.configuration_nsa import NSAConfig

    def said(attention_mode="dense", implementation=None, cross_doc=False, device="cuda"):
        lines = []
        config = NSAConfig(attention_mode=attention_mode, **({"attn_implementation": implementation}
                                                             if implementation else {}))
        cfg = train_accelerate.TrainConfig(cross_doc_attention=cross_doc)
        train_accelerate.note_dense_document_mask(cfg, config, torch.device(device), lines.append)
        return lines

    for implementation in (None, "sdpa"):
        (line,) = said(implementation=implementation)
        assert "boolean (T x T) mask" in line and "--attn-implementation flex_attention" in line
    assert said(attention_mode="nsa") == []
    assert said(cross_doc=True) == []
    assert said(implementation="flex_attention") == []
    assert said(device="cpu") == []


def one_layer_nsa(sel_block_size: int, window_size: int):
    """A one-layer NSA model (vocabulary 64, hidden 32) with these selection blocks and window, seeded."""
    from modeling_nsa import NSAConfig, NSAForCausalLM

    torch.manual_seed(0)
    return NSAForCausalLM(NSAConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                    num_attention_heads=2, num_key_value_heads=1, head_dim=16, cmp_block_size=4,
                                    cmp_stride=2, sel_block_size=sel_block_size, sel_num_blocks=3,
                                    window_size=window_size))  # fmt: skip


def test_validation_loss_with_a_micro_batch_without_labels():
    """The last held-out row is padded and may hold a single token (no label after the shift); alone in a
    micro-batch it has no labels. Its micro-batch adds nothing: the loss is the same at every micro-batch size,
    where 0 / 0 made it NaN at size 1."""
    from nsa_train.evaluation import OneProcess, validation_loss

    model = one_layer_nsa(sel_block_size=8, window_size=8)
    full = (list(range(1, 17)), list(range(16)), list(range(1, 17)))
    lone = ([5] + [0] * 15, [0] * 16, [5] + [-100] * 15)  # one real token: nothing to predict
    rows = [full, lone]
    losses = [validation_loss(model, rows, size, OneProcess())["val_loss"] for size in (1, 2)]
    assert losses[0] == pytest.approx(losses[1], rel=1e-6) and math.isfinite(losses[0])
    expected = model(**{k: torch.tensor([v]) for k, v in zip(("input_ids", "position_ids", "labels"), full)}).loss
    assert losses[0] == pytest.approx(float(expected.detach()), rel=1e-6)


def test_every_process_runs_as_many_validation_forwards_whatever_its_share():
    """Under FSDP each forward gathers the weights from every process: a process whose share of the held-out rows
    ends a batch early still runs as many forwards (a row with no labels, adding nothing), or the other waits in
    its gather forever. Three rows on two processes at micro-batch 1: two forwards each; the sums over both
    processes are those of one process evaluating all three."""
    from nsa_train.evaluation import OneProcess, validation_loss

    model = one_layer_nsa(sel_block_size=8, window_size=8)
    rows = [(list(range(i, i + 16)), list(range(16)), list(range(i, i + 16))) for i in (1, 3, 5)]

    class Rank(OneProcess):  # process `rank` of two, its sums handed back unreduced
        num_processes = 2

        def __init__(self, rank):
            super().__init__()
            self.process_index, self.sums = rank, None

        def reduce(self, tensor, reduction):
            self.sums = tensor.clone()
            return tensor

    forwards, ranks = [], [Rank(0), Rank(1)]
    hook = model.register_forward_hook(lambda module, args, out: forwards[-1].append(1))
    for rank in ranks:
        forwards.append([])
        validation_loss(model, rows, 1, rank)
    hook.remove()
    assert [len(f) for f in forwards] == [2, 2]
    together = ranks[0].sums + ranks[1].sums
    one = Rank(0)
    one.num_processes = 1
    validation_loss(model, rows, 1, one)
    torch.testing.assert_close(together, one.sums)


def test_dense_equivalent_flops_are_the_dense_twins():
    """mfu_dense counts what the dense twin executes: its parameters (NSA's gate projection, compressor and extra
    K/V sets left out) and full causal attention; an NSA run and its twin at one tokens/s show one MFU."""
    import train_accelerate
    from modeling_nsa import NSAConfig
    from nsa_train import metrics

    nsa = one_layer_nsa(sel_block_size=8, window_size=8)
    twin = train_accelerate.dense_twin(NSAConfig(**{**nsa.config.to_dict(), "attention_mode": "dense"}), nsa)
    n_twin = sum(p.numel() for p in twin.parameters())
    assert metrics.dense_twin_params(nsa) == n_twin < sum(p.numel() for p in nsa.parameters())
    attention = 12 * 1 * 2 * 16 * (64 + 1) / 2  # 12 L H D x the causal mean of keys at T = 64
    assert metrics.flops_per_token(nsa, 64)[0] == metrics.flops_per_token(twin, 64)[0] == 6 * n_twin + attention


def test_a_process_that_cannot_read_its_data_stops_every_process():
    """Each process reads its first micro-batch before any collective; one whose data share fails raises its own
    error, and the others, told by one all-reduce, raise too (instead of waiting for it in the first step)."""
    import train_accelerate

    class Processes:  # what read_on_every_process uses of the Accelerator; `others` processes failed elsewhere
        num_processes, device = 2, torch.device("cpu")

        def __init__(self, others):
            self.others = others

        def reduce(self, tensor, reduction):
            return tensor + self.others

    def failing():
        raise ValueError("rank 1 of 2 got no training documents")
        yield

    with pytest.raises(ValueError, match="rank 1 of 2 got no training documents"):
        train_accelerate.read_on_every_process(failing(), Processes(0))
    with pytest.raises(ValueError, match="1 other process.* of 2 could not read their share"):
        train_accelerate.read_on_every_process(iter([("batch", "state")]), Processes(1))
    assert list(train_accelerate.read_on_every_process(iter([1, 2, 3]), Processes(0))) == [1, 2, 3]


def test_position_buckets_double_from_the_window():
    from nsa_train.evaluation import position_buckets

    assert position_buckets(64, 1024) == [(0, 64), (64, 128), (128, 256), (256, 512), (512, 1024)]
    assert position_buckets(64, 100) == [(0, 64), (64, 100)]  # the last range ends at the row's length
    # a last range under half the one before joins it, but never the window's own range
    assert position_buckets(64, 1025)[-1] == (512, 1025) and len(position_buckets(64, 1025)) == 5
    assert position_buckets(64, 1300)[-1] == (1024, 1300)  # 276 positions: at least half of 512, kept
    assert position_buckets(64, 640)[-2:] == [(256, 512), (512, 640)]  # exactly half of 256: kept
    assert position_buckets(64, 639)[-1] == (256, 639)  # one short of half: joined
    assert position_buckets(64, 70) == [(0, 64), (64, 70)]
    assert position_buckets(64, 129) == [(0, 64), (64, 129)]
    assert position_buckets(512, 512) == [] and position_buckets(None, 512) == []  # the window holds every query


def test_validation_loss_by_position_matches_each_token_loss():
    """val_loss_pos<lo>to<hi> is the mean loss of the label tokens predicted from positions lo..hi-1 of their
    document's fragment (position_ids, which restart at each document), computed here token by token from the
    model's logits: a row of two documents, a second row cut short by padding, window 4 (ranges 0-4, 4-8, 8-16).
    The ranges' label tokens add up to val_loss's."""
    from nsa_train.evaluation import OneProcess, validation_loss

    model = one_layer_nsa(sel_block_size=4, window_size=4)
    ids = torch.randint(1, 64, (2, 16)).tolist()
    two_docs = (ids[0], list(range(10)) + list(range(6)), ids[0][:10] + [-100] + ids[0][11:])  # doc B starts at 10
    padded = (ids[1][:9] + [0] * 7, list(range(9)) + [0] * 7, ids[1][:9] + [-100] * 7)
    rows = [two_docs, padded]
    metrics = validation_loss(model, rows, 2, OneProcess())

    losses = {lo: [] for lo in (0, 4, 8)}  # range start -> the losses of the label tokens predicted from it
    with torch.no_grad():
        for row_ids, positions, labels in rows:
            log_probs = model(input_ids=torch.tensor([row_ids]), position_ids=torch.tensor([positions])).logits[0]
            log_probs = log_probs.float().log_softmax(-1)
            for t in range(15):
                if labels[t + 1] != -100:
                    lo = 0 if positions[t] < 4 else 4 if positions[t] < 8 else 8
                    losses[lo].append(-float(log_probs[t, labels[t + 1]]))
    assert {k: len(v) for k, v in losses.items()} == {0: 12, 4: 9, 8: 1}  # (4 + 4 + 4, 4 + 1 + 4, 1)
    for lo, hi in ((0, 4), (4, 8), (8, 16)):
        assert metrics[f"val_loss_pos{lo}to{hi}"] == pytest.approx(sum(losses[lo]) / len(losses[lo]), rel=1e-5)
    every = [x for v in losses.values() for x in v]
    assert metrics["val_loss"] == pytest.approx(sum(every) / len(every), rel=1e-5)
    # a range no label token was predicted from is left out, not reported as 0 or NaN
    short = validation_loss(model, [padded], 2, OneProcess())
    assert "val_loss_pos8to16" not in short and "val_loss_pos4to8" in short


def test_learning_rate_schedule_and_weight_decay_groups():
    """Linear warm-up from lr / warmup (step 0 trains), cosine down to lr x min_lr_ratio at max_steps; no weight decay
    on embeddings, norms and biases."""
    from model_helpers import tiny_config

    import train_accelerate as ta
    from modeling_nsa import NSAForCausalLM

    cfg = ta.TrainConfig(lr=1e-3, warmup_steps=4, max_steps=20, min_lr_ratio=0.1)
    assert ta.lr_at(0, cfg) == pytest.approx(2.5e-4) and ta.lr_at(3, cfg) == pytest.approx(1e-3)
    assert ta.lr_at(12, cfg) == pytest.approx(1e-3 * (0.1 + 0.9 * 0.5))  # half way down the cosine
    assert ta.lr_at(20, cfg) == pytest.approx(1e-4) and ta.lr_at(25, cfg) == pytest.approx(1e-4)
    decaying = [ta.lr_at(step, cfg) for step in range(4, 21)]  # (step 4 is the peak again: progress 0)
    assert all(a > b for a, b in zip(decaying, decaying[1:]))
    model = NSAForCausalLM(tiny_config())
    optimizer = ta.make_optimizer(model, ta.TrainConfig(weight_decay=0.1), torch.device("cpu"))
    decay, no_decay = ({id(p) for p in group["params"]} for group in optimizer.param_groups)
    assert [group["weight_decay"] for group in optimizer.param_groups] == [0.1, 0.0]
    names = {id(p): name for name, p in model.named_parameters()}
    assert "model.embed_tokens.weight" in {names[i] for i in no_decay}
    assert all(names[i].endswith(("norm.weight", "bias", "embed_tokens.weight")) for i in no_decay)
    # the compressor's (l, D) position embeddings decay as matrices (the groups every checkpoint's optimizer holds)
    assert {"model.layers.0.self_attn.compressor.k_pos_emb", "model.layers.0.self_attn.compressor.v_pos_emb",
            "model.layers.0.self_attn.compressor.k_mlp.0.weight"} <= {names[i] for i in decay}
    assert "model.layers.0.self_attn.q_proj.weight" in {names[i] for i in decay}


def test_gradient_clipping_bounds_the_update():
    """train_step clips the gradient's global norm to --grad-clip (0: no clipping): with plain SGD at lr 1 the
    weights move by exactly the clipped gradient."""
    from accelerate import Accelerator
    from model_helpers import tiny_config

    import train_accelerate as ta
    from modeling_nsa import NSAForCausalLM

    ids = torch.randint(0, 61, (2, 32), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids.clone()}
    moved = {}
    for clip in (0.0, 1e-3):
        torch.manual_seed(0)
        model = NSAForCausalLM(tiny_config())
        before = [p.detach().clone() for p in model.parameters()]
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        cfg = ta.TrainConfig(grad_clip=clip, grad_accum=1)
        _, grad_norm, updated = ta.train_step(model, model, optimizer, [(batch, None)], cfg, Accelerator(cpu=True),
                                              "no")  # fmt: skip
        assert updated and grad_norm > 1e-2  # the norm before clipping
        moved[clip] = torch.cat([(p.detach() - b).flatten() for p, b in zip(model.parameters(), before)]).norm()
    assert float(moved[1e-3]) == pytest.approx(1e-3, rel=1e-3)
    assert float(moved[0.0]) == pytest.approx(grad_norm, rel=1e-3)  # unclipped: the whole gradient
    # a step whose rows hold no label (possible at --seq-len 2) adds a zero loss and gradient, not 0 / 0 = NaN
    unlabeled = {"input_ids": ids, "labels": torch.full_like(ids, -100)}
    loss, grad_norm, updated = ta.train_step(model, model, optimizer, [(unlabeled, None)], cfg, Accelerator(cpu=True),
                                             "no")  # fmt: skip
    assert float(loss) == 0.0 and grad_norm == 0.0 and updated


def test_log_and_evaluation_at_the_last_step_and_resume_with_accumulation(tmp_path):
    """A run whose --max-steps is no multiple of --log-every or --eval-every still logs and evaluates its last
    step; each record's lr is the schedule's at that step; and a resume with gradient accumulation reproduces the
    uninterrupted run (the data state saved is the one after the step's last micro-batch)."""
    import train_accelerate as ta

    flags = dict(max_steps=5, eval_every=2, log_every=2, save_every=2, keep_last=5, micro_batch_size=2, grad_accum=2)
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    run_main(tiny_args(full, **flags))
    records = [json.loads(line) for line in (full / "metrics.jsonl").read_text().splitlines()]
    assert sorted(val_losses(full)) == [0, 2, 4, 5]
    assert sorted(train_losses(full)) == [2, 4, 5]
    cfg = ta.TrainConfig(lr=3e-3, warmup_steps=2, max_steps=5)  # tiny_args' schedule
    for record in records:
        if "lr" in record:  # step N's record: the rate its N-th optimizer step ran at
            assert record["lr"] == pytest.approx(ta.lr_at(record["step"] - 1, cfg)), record
    # the export carries the training length, so a copy of final/ (or a Hub download) still marks extrapolation
    from nsa_train.long_context import training_length
    from transformers import AutoConfig

    shutil.copytree(full / "final", tmp_path / "copied")
    copied = AutoConfig.from_pretrained(tmp_path / "copied", trust_remote_code=True)
    assert training_length(copied, tmp_path / "copied") == (64, "config training_seq_len")
    shutil.copytree(full / "checkpoints" / "step_00000002", resumed / "checkpoints" / "step_00000002")
    run_main(tiny_args(resumed, resume="latest", **flags))
    assert train_losses(resumed) == pytest.approx({4: train_losses(full)[4], 5: train_losses(full)[5]}, rel=1e-6)
    assert_same_weights(final_state(resumed), final_state(full), atol=1e-6, rtol=1e-6)


def test_a_finished_run_missing_its_export_is_exported_on_resume_and_keep_last_one(tmp_path):
    """A run killed after its last checkpoint but before its export finished: --resume latest exports it. Also
    --keep-last 1 keeps one checkpoint, and --eval-only may write into an existing run's folder."""
    out = tmp_path / "run"
    run_main(tiny_args(out, max_steps=3, save_every=1, keep_last=1))
    assert [d.name for d in checkpoint.checkpoint_dirs(out / "checkpoints")] == ["step_00000003"]
    shutil.rmtree(out / "final")
    summary = run_main(tiny_args(out, max_steps=3, save_every=1, keep_last=1, resume="latest"))
    assert summary["finished"] and (out / "final" / "model.safetensors").is_file()
    result = run_main(tiny_args(out, init_from=out / "final", eval_only=True))
    assert result["val_rows"] > 0 and (out / "eval.json").is_file()
    # a checkpoint is not an exported model: --init-from says how to use it instead of loading a default config
    ckpt = out / "checkpoints" / "step_00000003"
    with pytest.raises(ValueError, match="is a training checkpoint, not an exported model"):
        run_main(tiny_args(tmp_path / "from_ckpt", init_from=ckpt, max_steps=1))
    with pytest.raises(ValueError, match=r"holds no config.json \(a run's folder: its export is final/\)"):
        run_main(tiny_args(tmp_path / "from_run", init_from=out, max_steps=1))
    # ... and the export the message names: resumed to its own step in another folder, nothing trained
    exported = run_main(tiny_args(tmp_path / "exported", resume=str(ckpt), max_steps=3))
    assert exported["finished"] and exported["step"] == 3
    assert_same_weights(final_state(tmp_path / "exported"), final_state(out))


def test_run_json_keeps_each_launch_and_the_card_names_earlier_code(tmp_path):
    """run.json's `launches`: one entry per launch of a run (commit, argv, the step it continued from); a new run
    starts the list. The model card of a run resumed under other code names that code with the step it ran from."""
    out = tmp_path / "run"
    run_main(tiny_args(out, max_steps=1, save_every=1))
    record = json.loads((out / "run.json").read_text())
    assert [launch["from_step"] for launch in record["launches"]] == [0]
    # which bytes the run read: the data file's size and sha256 (a corpus rebuilt from another version differs)
    assert record["data_files"]["files"] == [{"path": str(PARQUET), "bytes": PARQUET.stat().st_size,
                                              "sha256": hashlib.sha256(PARQUET.read_bytes()).hexdigest()}]
    assert record["launches"][0]["git_sha"] == record["git_sha"]
    assert record["launches"][0]["cwd"] == os.getcwd()  # (what relative paths in its argv and config are relative to)
    record["launches"][0]["git_sha"] = "0123abc"  # as if the first launch had run other code
    (out / "run.json").write_text(json.dumps(record))
    run_main(tiny_args(out, max_steps=2, save_every=1, resume="latest"))
    launches = json.loads((out / "run.json").read_text())["launches"]
    assert [(launch["git_sha"], launch["from_step"]) for launch in launches][0] == ("0123abc", 0)
    assert launches[1]["from_step"] == 1 and launches[1]["git_sha"] != "0123abc"
    card = (out / "final" / "README.md").read_text()
    assert "the run was resumed, and earlier launches ran 0123abc from step 0" in card
    # a record written before launches were kept: its one launch carried over, its start step unknown
    record = json.loads((out / "run.json").read_text())
    del record["launches"]
    (out / "run.json").write_text(json.dumps({**record, "git_sha": "4567def"}))
    run_main(tiny_args(out, max_steps=3, save_every=1, resume="latest"))
    launches = json.loads((out / "run.json").read_text())["launches"]
    assert [(launch["git_sha"], launch["from_step"]) for launch in launches[:1]] == [("4567def", None)]
    assert launches[1]["from_step"] == 2 and len(launches) == 2
    assert "earlier launches ran 4567def from step ?" in (out / "final" / "README.md").read_text()
    fresh = tmp_path / "fresh"  # a new run: its own launch only, and a card without the resumed note
    run_main(tiny_args(fresh, max_steps=1))
    assert len(json.loads((fresh / "run.json").read_text())["launches"]) == 1
    assert "the run was resumed" not in (fresh / "final" / "README.md").read_text()


def test_short_data_says_its_validation_rows_and_each_new_epoch(tmp_path, capsys):
    """Data too small for --val-tokens and for the run's tokens: the trainer says how many validation rows it has
    (instead of silently evaluating on fewer) and when the training stream starts over."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = [f"Document {i} says that the number {i} comes after {i - 1} and before {i + 1}." for i in range(12)]
    small = tmp_path / "small.parquet"
    pq.write_table(pa.table({"text": texts}), small)
    run_main(tiny_args(tmp_path / "run", dataset=small, val_every_doc=6, val_tokens=1024, max_steps=4))
    log = capsys.readouterr().out
    # the two held-out documents' tokens with their EOS, counted here: the row's padding is not text
    from nsa_train.data import load_tokenizer

    tokenizer = load_tokenizer(GPT2)
    held_out = sum(len(tokenizer(texts[i])["input_ids"]) + 1 for i in (0, 6))
    assert held_out < 64
    assert f"note: validation holds {held_out} tokens of text (1 row(s) of 64), fewer than --val-tokens 1,024" in log
    # 10 training documents of ~20 tokens (~200 in all): each step of 4 rows x 64 tokens reads them through once
    # or twice; the notes name every epoch that starts, in order
    epochs = [re.search(r"step (\d+): the training data was read through; epochs? (\d+)(?:-(\d+))? start", line)
              for line in log.splitlines() if "was read through" in line]
    named = [(int(m[1]), int(m[2]), int(m[3] or m[2])) for m in epochs]
    assert [step for step, _, _ in named] == [1, 2, 3, 4] and named[0][1] == 1, log
    assert all(b[1] == a[2] + 1 for a, b in zip(named, named[1:])) and any(lo < hi for _, lo, hi in named), log
    # a run whose data lasts says neither
    run_main(tiny_args(tmp_path / "long", max_steps=2))
    log = capsys.readouterr().out
    assert "note: validation holds" not in log and "read through" not in log
    # several processes: under --data-shard docs the note is process 0's share's; under rows, the one row stream's
    import train_accelerate as ta

    said = []
    ta.note_new_epoch(5, 0, 1, 2, "docs", said.append)
    ta.note_new_epoch(5, 0, 1, 2, "rows", said.append)
    assert "process 0's share of the training data (of 2) was read through" in said[0]
    assert "step 5: the training data was read through; epoch 1 starts" in said[1]
