"""Where a run's figures go: the console (a tqdm bar on a terminal, one line per log), `<output_dir>/metrics.jsonl`
(main process, one JSON object per log) and the trackers (TensorBoard or trackio, `--report-to`)."""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .evaluation import POSITION_METRIC, position_losses
from .run_state import RunState

# how the console line shows an evaluation metric (others: "<name> <value>")
EVAL_CONSOLE = {"val_loss": "val loss {:.4f}", "val_ppl": "ppl {:.2f}"}
PER_LAYER = re.compile(r"[a-z]+_l\d+_")
# the selection statistics' means over layers (nsa_train.selection_stats.flatten_stats, group "stats"): the console
# shows these few as one item; metrics.jsonl, stats.jsonl and the trackers keep every figure
SELECTION_MEANS = "stats_all_"
SELECTION_CONSOLE = (("distance_mean", "reach {:.1f} blocks"), ("beyond_window_share", "beyond window {:.0%}"),
                     ("forced_share", "forced {:.0%}"), ("neighbour_overlap", "overlap {:.2f}"))


def selection_console(metrics: dict[str, float]) -> str | None:
    """The selection statistics as one console item, `selection: gates cmp/slc/win 0.31/0.35/0.34, reach 4.2
    blocks, beyond window 41%, forced 22%, overlap 0.63` (means over layers), or None where none were measured."""
    means = {k[len(SELECTION_MEANS):]: v for k, v in metrics.items() if k.startswith(SELECTION_MEANS)}
    if not means:
        return None
    parts = []
    gates = [means.get(f"gate_{branch}_mean") for branch in ("cmp", "slc", "win")]
    if None not in gates:
        parts.append("gates cmp/slc/win " + "/".join(f"{g:.2f}" for g in gates))
    parts += [text.format(means[name]) for name, text in SELECTION_CONSOLE if name in means]
    return "selection: " + ", ".join(parts)


def transformers_bars_on_a_terminal_only() -> None:
    """transformers' own progress bars (`Writing model shards` at each export, `Loading weights` at each load, the
    Hub's downloads) shown on a terminal only, as the trainer's bar is: in a log file they would be the only tqdm
    lines, printed at every save and load."""
    if not sys.stderr.isatty():
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()


def peak_memory_gb(device) -> float:
    """The process's peak memory: allocated GPU memory on CUDA, the resident set size otherwise."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def keep_records_up_to(path: Path, step: int, source: Path | None = None) -> None:
    """Before a run continues from `step` (a checkpoint's; 0: from the start), metrics.jsonl (and stats.jsonl) drop
    the records of later steps, which the stopped launch logged after its last checkpoint and the run now trains
    again (and a line cut short by a kill). `source`: the file to read them from (a checkpoint of another run's
    directory: its history up to `step` starts this one's). Written to a temporary file and renamed: a kill here
    loses nothing."""
    source = path if source is None else source
    if not source.is_file():
        return
    kept = []
    for line in source.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if step > 0 and isinstance(record, dict) and record.get("step", step + 1) <= step:
            kept.append(line)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    tmp.replace(path)


def history_source(resume: str | None, out_dir: Path) -> Path | None:
    """The run directory whose records a new output directory starts from: that of a checkpoint given by path from
    another run (e.g. exporting an intermediate checkpoint: --resume RUN/checkpoints/step_N --output-dir NEW), when
    the new one has no records of its own; else None."""
    if resume in (None, "latest"):
        return None
    checkpoint_dir = Path(resume).expanduser().resolve()
    run_dir = checkpoint_dir.parent.parent  # RUN/checkpoints/step_N
    if run_dir == out_dir.resolve() or (out_dir / "metrics.jsonl").exists() or not (run_dir / "metrics.jsonl").is_file():
        return None
    return run_dir


class StepLog:
    """The training loss averaged over the `log_every` steps since the last log, tokens/s over the training time
    since then (evaluations and saves restart the clock, so they are not counted), MFU against `peak_flops`, and
    each evaluation's metrics. Every process calls every method (the loss is all-reduced); the main one writes."""

    def __init__(self, accelerator, out_dir: Path, cfg, run: RunState, flops_per_token: tuple[float, float],
                 peak_flops: float | None, run_config: dict):  # fmt: skip
        self.accelerator, self.cfg = accelerator, cfg
        self.flops_dense, self.flops_nsa = flops_per_token
        self.peak_flops = peak_flops
        self.main = accelerator.is_main_process
        self.trackers = cfg.report_to != "none"
        if self.trackers:  # TensorBoard events go to <output_dir>/logs; its hyperparameters are scalars: lists as text
            # A resume hides the events a stopped or rolled-back launch wrote after its checkpoint's step (TensorBoard's
            # purge_step), as metrics.jsonl drops their records: each step's curve point is there once.
            resumed = {"tensorboard": {"purge_step": run.step + 1}} if cfg.resume else {}
            accelerator.init_trackers("logs", config={k: " ".join(map(str, v)) if isinstance(v, list) else v
                                                      for k, v in run_config.items() if v is not None},
                                      init_kwargs=resumed)  # fmt: skip
        if self.main:
            history = history_source(cfg.resume, Path(out_dir))
            for name in ("metrics.jsonl", "stats.jsonl"):
                keep_records_up_to(Path(out_dir) / name, run.step, history / name if history else None)
        self.file = open(Path(out_dir) / "metrics.jsonl", "a") if self.main else None
        self.bar = tqdm(total=cfg.max_steps, initial=run.step, disable=not (self.main and sys.stderr.isatty()),
                        desc="train")  # fmt: skip
        self.loss_sum = torch.zeros((), device=accelerator.device)  # step losses since the last log, this process
        self.step_at_log, self.tokens_at_log = run.step, run.tokens_seen
        self.trained_s = 0.0  # training seconds since the last log, banked at each step's end (step_done)
        self.skipped_since_log = 0  # steps skipped with a non-finite gradient since the last log
        self.restart_clock()
        if accelerator.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(accelerator.device)

    def restart_clock(self) -> None:
        """Time from now on counts towards tokens/s (called after work that trains no tokens: the time since the
        last step ended, which that work took, is left out; the steps' time before it was banked by step_done)."""
        self.clock = time.time()

    def step_done(self, step_loss: torch.Tensor | None) -> None:
        """A step ended; `step_loss` None: it was skipped (--skip-nonfinite), and its non-finite loss stays out of
        the logged mean (the record's `skipped` counts it)."""
        if step_loss is None:
            self.skipped_since_log += 1
        else:
            self.loss_sum += step_loss
        self.bar.update(1)
        now = time.time()
        self.trained_s += now - self.clock  # the step's time (since the last step ended, or the clock restarted)
        self.clock = now

    def due(self, step: int) -> bool:
        return bool(self.cfg.log_every) and (step % self.cfg.log_every == 0 or step == self.cfg.max_steps)

    def log_training(self, run: RunState, lr: float, grad_norm: float) -> None:
        """The log record of `run.step` (kept as `run.last_log`): console, metrics.jsonl, trackers."""
        world = self.accelerator.num_processes
        # the mean over the steps since the last log: log_every, fewer in a run's last window or the first after a
        # resume between two logs
        steps = run.step - self.step_at_log - self.skipped_since_log  # (skips: the same on every process)
        loss = (self.accelerator.reduce(self.loss_sum, reduction="sum") / max(steps, 1)).item()
        loss = loss if steps > 0 or run.step == self.step_at_log else float("nan")  # every step skipped: no mean
        tok_s = (run.tokens_seen - self.tokens_at_log) / max(self.trained_s + time.time() - self.clock, 1e-9)
        peak = self.peak_flops
        record = {"step": run.step, "loss": loss, "lr": lr, "grad_norm": grad_norm, "tok_s": tok_s,
                  "mfu_dense": self.flops_dense * tok_s / (peak * world) if peak else None,
                  "mfu_nsa": self.flops_nsa * tok_s / (peak * world) if peak else None,
                  "peak_mem_gb": peak_memory_gb(self.accelerator.device), "tokens_seen": run.tokens_seen,
                  "skipped": run.skipped_steps}  # fmt: skip
        run.last_log = record
        self.bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tok_s:,.0f}")
        mfu = f" mfu {record['mfu_dense']:.1%}/{record['mfu_nsa']:.1%}" if peak else ""
        self._write(f"step {run.step}: loss {loss:.4f} lr {lr:.2e} grad_norm {grad_norm:.3f} tok/s {tok_s:,.0f}{mfu} "
                    f"mem {record['peak_mem_gb']:.2f}GB", record)  # fmt: skip
        if self.trackers:
            self.accelerator.log({f"train/{k}": v for k, v in record.items() if v is not None and k != "step"},
                                 step=run.step)  # fmt: skip
        self.loss_sum.zero_()
        self.step_at_log, self.tokens_at_log, self.trained_s = run.step, run.tokens_seen, 0.0
        self.skipped_since_log = 0
        self.restart_clock()

    def log_eval(self, step: int, metrics: dict[str, float]) -> None:
        """One evaluation's metrics (`<group>_<name>`; trackers: `<group>/<name>`). The console line leaves out
        per-layer figures (`<group>_l<N>_<name>`), shows the validation loss by query position as one item, `by
        position 0-63 1.9120 64-127 1.7340 ...`, and the selection statistics as one (`selection_console`)."""
        shown = [EVAL_CONSOLE[k].format(v) if k in EVAL_CONSOLE else f"{k} {v:.4g}" for k, v in metrics.items()
                 if not PER_LAYER.match(k) and not POSITION_METRIC.match(k) and not k.startswith(SELECTION_MEANS)]
        if by_position := position_losses(metrics):
            after = next((i + 1 for i, k in enumerate(metrics) if k == "val_ppl"), 0)  # (val_ppl is shown)
            shown.insert(after, "by position " + " ".join(f"{lo}-{hi - 1} {v:.4f}" for lo, hi, v in by_position))
        if selection := selection_console(metrics):
            shown.append(selection)
        shown = " ".join(shown)
        self._write(f"step {step}: {shown}", {"step": step, **metrics})
        if self.trackers:
            self.accelerator.log({k.replace("_", "/", 1): v for k, v in metrics.items()}, step=step)
        self.restart_clock()  # evaluation trains no tokens

    def _write(self, line: str, record: dict) -> None:
        if self.main:
            tqdm.write(line)
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()

    def close(self) -> None:
        self.bar.close()
        if self.file:
            self.file.close()
