"""NSA against its dense twin: train both (same seed, data order, tokens and schedule) and compare them.

    python bench/ab_compare.py --out runs/ab --seeds 0 1 -- --dataset ../shared/data/wiki-summaries-en.parquet \\
        --tokenizer ../shared/data/gpt2-tokenizer --model tiny --seq-len 1024 --max-steps 2000 --eval-every 200
    python bench/ab_compare.py --out runs/ab_seed0 --runs runs/ab/nsa-seed0 runs/ab/dense-seed0  # finished runs only

Every flag after `--` goes to train_accelerate.py unchanged, for every run; this script adds `--attention-mode`,
`--seed` and `--output-dir <out>/<mode>-seed<S>`. The runs start in the directory this command runs in: a relative
path among those flags (`--dataset wiki.parquet`), and `--out`, is read from there. The dense twin is the same
NSAConfig with `attention_mode="dense"`: the same parameters except NSA's own (gate projection, compressor, the
extra K/V sets), starting from the same values (the trainer's build_model gives the dense model the NSA model's
weights under the same `--seed`; its K/V projection: the selection branch's set), the same data order (the
packer's shuffle is seeded by `--seed`) and the same schedule. A run already
finished in its directory is not trained again; one stopped with checkpoints continues (`--resume latest`), so a
long comparison can be split across sessions by running the same command again. With the trainer's
`--stop-at-step N` among the flags every run stops at step N (a checkpoint, the schedule still --max-steps') and the
runs are compared up to there, the table saying so; the command with a later N, or without it, continues them.

`--init-from-runs DIR` starts each twin from its own twin of an earlier comparison (DIR/<mode>-seed<S>/final, the
trainer's `--init-from`): pretrain both modes on text, then fine-tune both on retrieval rows, each pair still
sharing its seed. Runs that evaluated long-context retrieval (`--eval-long-context`) get a table of their
accuracy per length (mean over depths) beside the losses, and NSA runs the rate at which the last prompt token's
selection held the answer's block.

It reads what the trainer writes per run (run.json: config and device; metrics.jsonl: training logs and every
evaluation; summary.json) and writes `<out>/ab_compare.md` (tables), `ab_compare.png` (validation loss against
tokens, and NSA - dense) and `ab_compare.json`. Validation losses are compared at the token counts every run
evaluated at; with two or more seeds of a mode, the seed-to-seed spread (sample standard deviation, min-max) is
given beside the difference, with the gap's 95% interval (paired by seed where both modes ran it), so a gap can be
read against the noise; the 0.02-nat target is judged met or MISSED only when it lies outside that interval and each
mode has two seeds or more (one seed of a mode: "undecided"; two seeds rarely decide it: give three or more). Runs
without a twin of their seed in the other mode are named. At the last evaluation the loss is also compared by the
query's position (the trainer's `val_loss_pos<lo>to<hi>`: inside NSA's window, then ranges doubling beyond it),
NSA - dense per range with the same interval. NSA runs that logged selection statistics (the trainer's `stats.jsonl`,
written at every evaluation) get a table of each layer's gates and selection at the last one (mean ± std over
seeds). Needs matplotlib for the PNG (`pip install "nsa-transformers[plot]"`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from nsa_train.checkpoint import RUN_OUTPUTS, RUNTIME_FIELDS, latest_checkpoint  # noqa: E402
from nsa_train.evaluation import position_losses  # noqa: E402
from nsa_train.long_context import (SAME_EVALUATION, ended_inside_answer_rates, run_command,  # noqa: E402
                                    tells_more_than_accuracy)

MODES = ("nsa", "dense")
# what makes two retrieval evaluations one measurement (nsa_train.long_context refuses to replace an evaluation that
# differs in these): read_evaluation records them, and bench/seed_groups.py pools only runs that agree in them
EVALUATION_SETTINGS = ("task", "scoring", *SAME_EVALUATION, "haystack")
# train_accelerate.py flags this script sets per run
OWN_FLAGS = ("--attention-mode", "--seed", "--output-dir", "--resume")
# NSAConfig fields that only NSA uses: the one set of fields the two modes' models may differ in
NSA_FIELDS = {"attention_mode", "nsa_backend", "cmp_block_size", "cmp_stride", "sel_block_size", "sel_num_blocks",
              "sel_init_blocks", "sel_local_blocks", "window_size", "kv_per_branch", "compressor",
              "cmp_mlp_hidden_size"}  # fmt: skip
# run.json config entries that may differ between the runs of one comparison (attn_implementation: the dense twin's
# kernel, e.g. flex_attention with packed documents, which an NSA run refuses; the losses do not depend on it)
PER_RUN_CONFIG = {"attention_mode", "output_dir", "seed", "resume", "attn_implementation", "stop_at_step"}
# run.json config entries that do not change what a run trains or where its validation curve is taken: a run kept in
# --out from an earlier command may differ from this command's in these, and in nothing else
# (init_from is checked apart, check_kept_run_start: a path may be spelled two ways)
RUN_ONLY_CONFIG = {"output_dir", "resume", "init_from", "preset", "eval_only", "report_to", "log_every",
                   "stall_timeout", "peak_tflops", "sample_prompt", "stats_every", "eval_long_context",
                   "long_context_task", "long_context_lengths", "long_context_depths", "long_context_samples",
                   "save_every", "keep_last", "export_every_save", "push_to_hub", "hub_private", "hub_intermediate",
                   "nsa_backend", "compile", "gradient_checkpointing", "ddp_comm_hook", "ddp_bucket_cap_mb",
                   "ddp_static_graph", "powersgd_rank", "stop_at_step"}  # fmt: skip
TARGET_NATS = 0.02  # issue 19: NSA validation loss <= dense + 0.02 nats at equal tokens


# ----------------------------------------------------------------------------- training


def check_train_flags(train_flags: list[str], init_from_runs: Path | None = None) -> None:
    for flag in train_flags:
        name = flag.split("=")[0]
        if name.replace("_", "-") in OWN_FLAGS:
            raise ValueError(f"train flag {name}: ab_compare.py sets {', '.join(OWN_FLAGS)} for each run itself "
                             "(--seeds for the seeds, --out for the directories); drop it from the flags after --.")
        if init_from_runs is not None and name.replace("_", "-") in ("--init-from", "--model-overrides"):
            raise ValueError(f"train flag {name}: --init-from-runs {init_from_runs} starts each twin from its own "
                             "twin's final/ (its architecture too); drop it from the flags after --.")
    if _flag_value(train_flags, "--eval-every") == "0":
        raise ValueError("--eval-every 0: the comparison needs validation losses; give --eval-every N > 0.")


def _flag_value(flags: list[str], name: str) -> str | None:
    """The value the trainer will read for `name`: its last occurrence, as argparse takes it."""
    value = None
    for i, flag in enumerate(flags):
        if flag.replace("_", "-") == name and i + 1 < len(flags):
            value = flags[i + 1]
        elif flag.replace("_", "-").startswith(name + "="):
            value = flag.split("=", 1)[1]
    return value


def stopped_as_asked(run_dir: Path, stop_at_step: str | None) -> bool:
    """Whether a resumable run stopped at or past this command's --stop-at-step (the trainer's summary.json says
    where a --stop-at-step stopped it): done as far as the command asks, so neither trained nor refused."""
    summary = run_dir / "summary.json"
    if not stop_at_step or int(stop_at_step) <= 0 or not summary.is_file():
        return False
    record = json.loads(summary.read_text())
    return "stopped_at_step" in record and record.get("step", 0) >= int(stop_at_step)


def run_state(run_dir: Path) -> str:
    """'finished', 'resumable' (checkpoints, not finished), 'blocked' (other output, no checkpoint) or 'new'."""
    summary = run_dir / "summary.json"
    if summary.is_file() and json.loads(summary.read_text()).get("finished"):
        return "finished"
    if latest_checkpoint(run_dir / "checkpoints") is not None:  # as the trainer's --resume latest finds it
        return "resumable"
    if any((run_dir / name).exists() for name in RUN_OUTPUTS):  # what the trainer's check_output_dir refuses
        return "blocked"
    return "new"


def twin_path(init_from_runs: Path, mode: str, seed: int) -> Path:
    """Where a fine-tuning twin starts (--init-from-runs): the earlier comparison's run of its mode and seed, its
    final/ (the layout _started_from_twin reads back)."""
    return Path(init_from_runs) / f"{mode}-seed{seed}" / "final"


def twin_sources(init_from_runs: Path, pairs: list[tuple[str, int]]) -> dict[tuple[str, int], Path]:
    """The saved model each (mode, seed) fine-tuning twin starts from (twin_path), checked to be there: every
    missing one is named at once."""
    sources = {(mode, seed): twin_path(init_from_runs, mode, seed) for mode, seed in pairs}
    missing = [(mode, seed) for (mode, seed), source in sources.items() if not (source / "config.json").is_file()]
    if missing:
        names = ", ".join(f"{mode} seed {seed} ({sources[(mode, seed)]})" for mode, seed in missing)
        seeds = " ".join(sorted({str(seed) for _, seed in missing}, key=int))
        modes = " ".join(dict.fromkeys(mode for mode, _ in missing))
        raise ValueError(f"--init-from-runs {init_from_runs}: no saved model of {names}; train them there first, "
                         f"e.g. ab_compare.py --out {init_from_runs} --seeds {seeds} --modes {modes} -- <its flags>.")
    return sources


def _started_from_twin(run: dict) -> str | None:
    """The comparison a run started from when its --init-from was its own twin's final/ there (--init-from-runs),
    else None."""
    source = run["config"].get("init_from")
    path = Path(source) if source else None
    if path is not None and path.name == "final" and path.parent.name == f"{run['mode']}-seed{run['seed']}":
        return str(path.parent.parent)
    return None


def check_kept_run_start(run_dir: Path, expected: str | None) -> None:
    """A finished or resumable run in --out is reused only if it started where this command starts it (expected:
    its --init-from, a path or Hub id; None: random weights): otherwise a comparison of fine-tuned twins could
    silently read runs trained from scratch, or the reverse."""
    record_file = run_dir / "run.json"
    if not record_file.is_file():
        return
    started = json.loads(record_file.read_text()).get("config", {}).get("init_from")

    def where(source):  # the trainer runs in this command's working directory: a relative path is read from there
        return None if source is None else Path(source).resolve() if Path(source).exists() else str(source)

    if where(started) != where(expected):
        raise ValueError(f"{run_dir} holds a run that started from {started or 'random weights'}, not from "
                         f"{expected or 'random weights'} as this command's runs do; pass another --out.")


def check_kept_run_flags(run_dir: Path, run_flags: list[str]) -> None:
    """A finished or resumable run in --out is reused only if it was trained with this command's flags for it
    (run_flags: what the trainer would be given), up to RUN_ONLY_CONFIG: a run kept from a command with, say,
    another --max-steps or --lr would otherwise be compared as if trained with this one's."""
    record_file = run_dir / "run.json"
    if not record_file.is_file():
        return
    import dataclasses

    import train_accelerate

    wanted = json.loads(json.dumps(dataclasses.asdict(train_accelerate.parse_args(run_flags)), default=str))
    kept = json.loads(record_file.read_text()).get("config", {})

    def same(name):
        a, b = kept[name], wanted[name]
        if name == "model_overrides" and a and b:  # the same JSON however it is spaced
            try:
                return json.loads(a) == json.loads(b)
            except json.JSONDecodeError:
                pass
        return a == b

    differ = [name for name in wanted if name in kept and name not in RUN_ONLY_CONFIG and not same(name)]
    if differ:
        said = "; ".join(f"--{name.replace('_', '-')} {kept[name]!r} there, {wanted[name]!r} here" for name in differ)
        raise ValueError(f"{run_dir} holds a run trained with other flags than this command gives it ({said}); pass "
                         "another --out, or the flags it was trained with.")


def train_runs(out: Path, seeds: list[int], modes: list[str], train_flags: list[str], launcher: list[str],
               env: dict | None = None, jobs: int = 1, init_from_runs: Path | None = None) -> list[Path]:  # fmt: skip
    """Train every (seed, mode) not finished yet, `jobs` at a time (1: one after another, the output on this
    terminal; more: side by side, each run's output in <out>/<mode>-seed<S>.log, and on a CPU OMP_NUM_THREADS shared
    out among them unless set: thread_env); returns the run directories. env: variables added to the runs'.
    init_from_runs: each run starts from that comparison's run of the same mode and seed (its final/)."""
    check_train_flags(train_flags, init_from_runs)
    stop_at_step = _flag_value(train_flags, "--stop-at-step")
    planned = []  # (mode, seed, run_dir, state) of every run, in the order they train
    for seed in seeds:
        for mode in modes:
            run_dir = out / f"{mode}-seed{seed}"
            state = run_state(run_dir)
            if state != "new":  # a run kept from before must have started where this comparison's runs start
                expected = (twin_path(init_from_runs, mode, seed) if init_from_runs is not None
                            else _flag_value(train_flags, "--init-from"))  # fmt: skip
                check_kept_run_start(run_dir, None if expected is None else str(expected))
            if state in ("finished", "resumable"):  # ... and trained with this command's flags
                twin = ["--init-from", str(twin_path(init_from_runs, mode, seed))] if init_from_runs is not None else []
                check_kept_run_flags(run_dir, [*train_flags, *twin, "--attention-mode", mode, "--seed", str(seed),
                                               "--output-dir", str(run_dir)])
            if state == "finished":
                print(f"{run_dir}: finished already, not trained again")
            elif state == "resumable" and stopped_as_asked(run_dir, stop_at_step):
                print(f"{run_dir}: stopped at --stop-at-step {stop_at_step} already, not trained further")
                state = "finished"  # (as far as this command asks)
            planned.append((mode, seed, run_dir, state))
    to_train = [(mode, seed) for mode, seed, _, state in planned if state != "finished"]
    sources = twin_sources(init_from_runs, to_train) if init_from_runs is not None else {}
    commands = []
    for mode, seed, run_dir, state in planned:
        if state == "finished":
            continue
        if state == "blocked":
            raise ValueError(f"{run_dir} holds the output of an unfinished run without checkpoints, which cannot "
                             "continue; remove it (or pass another --out) and run again.")  # fmt: skip
        cmd = [*launcher, str(REPO / "train_accelerate.py"), *train_flags, "--attention-mode", mode,
               "--seed", str(seed), "--output-dir", str(run_dir)]  # fmt: skip
        if (mode, seed) in sources:
            cmd += ["--init-from", str(sources[(mode, seed)])]
        if state == "resumable":
            cmd += ["--resume", "latest"]
        commands.append((mode, seed, run_dir, cmd, state))
    runs = [run_dir for _, _, run_dir, _ in planned]
    env = {**thread_env(min(jobs, len(commands)), launcher), **(env or {})}
    running: list[dict] = []

    def launch(mode, seed, run_dir, cmd, state):
        print(("resuming: " if state == "resumable" else "training: ") + shlex.join(cmd), flush=True)
        log = None
        if jobs > 1:
            out.mkdir(parents=True, exist_ok=True)
            log = open(out / f"{mode}-seed{seed}.log", "a")
        # in this command's working directory (not the repository's): a relative path among the training flags
        # (--dataset wiki.parquet, --tokenizer ./tok) names the file the user sees there, not a same-named one in
        # the repository; the trainer's own path is absolute and python puts its folder (the repository) on
        # sys.path, so its imports hold wherever it starts
        try:  # a session of its own: stopping the run stops a launcher's workers too (accelerate launch)
            proc = subprocess.Popen(cmd, env={**os.environ, **(env or {})}, stdout=log,
                                    stderr=subprocess.STDOUT if log else None, start_new_session=True)  # fmt: skip
        except BaseException:
            if log:
                log.close()
            raise
        running.append(dict(mode=mode, seed=seed, run_dir=run_dir, cmd=cmd, proc=proc, log=log, started=time.time()))

    def finished(entry) -> bool:
        code = entry["proc"].poll()
        if code is None:
            return False
        running.remove(entry)
        if entry["log"]:
            entry["log"].close()
            for line in log_warnings(Path(entry["log"].name)):  # else seen only by those who open the log
                print(f"{entry['mode']}-seed{entry['seed']}: {line}", flush=True)
        if code != 0:
            log = Path(entry["log"].name) if entry["log"] else None
            raise RuntimeError(f"the {entry['mode']} run of seed {entry['seed']} failed (exit {code}); "
                               f"{failed_run_output(entry['run_dir'], log)}. Command: {shlex.join(entry['cmd'])}")
        done = run_state(entry["run_dir"]) == "finished" or stopped_as_asked(entry["run_dir"], stop_at_step)
        if not done:  # stopped (SIGTERM: a checkpoint, then exit 0), not done
            raise RuntimeError(f"the {entry['mode']} run of seed {entry['seed']} stopped before its last step (a "
                               f"SIGTERM saves a checkpoint and exits); {entry['run_dir']} is not compared. Run this "
                               "command again to resume it.")  # fmt: skip
        print(f"{entry['run_dir']}: done in {time.time() - entry['started']:.0f} s", flush=True)
        return True

    pending = list(commands)
    import signal

    def stop_on_sigterm(signum, frame):  # the runs sit in sessions of their own: SIGTERM here must reach them
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, stop_on_sigterm)
    try:
        while pending or running:
            while pending and len(running) < jobs:
                launch(*pending.pop(0))
            progressed = False
            for entry in list(running):
                progressed |= finished(entry)
            if not progressed:
                time.sleep(1.0 if jobs > 1 else 0.1)
    finally:  # a failed run (or Ctrl-C) stops the comparison: the other runs stop as the trainer stops on SIGTERM
        for entry in running:  # (a checkpoint where it saves them, which the same command resumes)
            stop_run(entry["proc"])
            if entry["log"]:
                entry["log"].close()
        signal.signal(signal.SIGTERM, previous)
    return runs


def usable_cores() -> int:
    """The cores this process may run on (its affinity where the system tells it: a container or taskset may
    give fewer than the machine has)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # (no affinity on macOS, Windows)
        return os.cpu_count() or 1


def runs_on_cpu(launcher: list[str]) -> bool:
    """Whether the runs will train on the CPU: accelerate told so (its --cpu, or ACCELERATE_USE_CPU, which the
    trainer reads), or no CUDA or MPS device here."""
    if "--cpu" in launcher or os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes"):
        return True
    import torch

    mps = getattr(torch.backends, "mps", None)
    return not (torch.cuda.is_available() or (mps is not None and mps.is_available()))


def processes_per_run(launcher: list[str]) -> int:
    """The processes a launcher starts for each run: accelerate launch's --num_processes, torchrun's
    --nproc_per_node (either spelling, either `--flag N` or `--flag=N`); 1 for a plain python or where none is
    given (a config file's count is not read: the figure is a thread share, not a check)."""
    names = ("--num_processes", "--num-processes", "--nproc_per_node", "--nproc-per-node")
    for i, arg in enumerate(launcher):
        name, _, value = arg.partition("=")
        if name in names:
            value = value or (launcher[i + 1] if i + 1 < len(launcher) else "")
            if value.isdigit() and int(value) > 0:
                return int(value)
    return 1


def thread_env(at_once: int, launcher: list[str]) -> dict:
    """OMP_NUM_THREADS for the runs where `at_once` of them train side by side on the CPU and the user has not set
    it: the usable cores shared out among their processes (a multi-process --launcher's count each, at least 1
    thread each), said on one line. Unset, each run's torch takes every core, and the runs' threads oversubscribe
    them (runs three or four times slower on two cores); a value the user set is kept, and one run at a time (or
    a GPU) needs none (a multi-process launcher sets its own, as torchrun and accelerate launch do)."""
    if at_once < 2 or os.environ.get("OMP_NUM_THREADS") or not runs_on_cpu(launcher):
        return {}
    cores, processes = usable_cores(), processes_per_run(launcher)
    threads = max(1, cores // (at_once * processes))
    sharing = f"{at_once} runs at once" if processes == 1 else f"{at_once} runs at once x {processes} processes each"
    print(f"OMP_NUM_THREADS is not set: each run gets OMP_NUM_THREADS={threads} ({cores} cores // {sharing}), so "
          "that their threads do not oversubscribe the CPU; set OMP_NUM_THREADS to choose another.",
          flush=True)  # fmt: skip
    return {"OMP_NUM_THREADS": str(threads)}


def failed_run_output(run_dir: Path, log: Path | None) -> str:
    """Where a failed run's output is: its log (--jobs > 1) or this console above (--jobs 1), and its directory
    only where the run wrote something there (a run refused at its flags, e.g. a typo, never creates it: naming it
    would send the user to a folder that is not there)."""
    where = f"its output is in its log, {log}" if log is not None else "its output is above, on this console"
    if run_dir.is_dir() and any(run_dir.iterdir()):
        where += f"; what it wrote is in {run_dir}"
    return where


def stop_run(proc: subprocess.Popen, grace_s: float = 60.0) -> None:
    """SIGTERM to the run's process group (the trainer saves a checkpoint and exits), SIGKILL after grace_s."""
    import signal

    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError, AttributeError):  # gone, or no process groups (Windows)
            if proc.poll() is None:
                proc.send_signal(sig)
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


# ----------------------------------------------------------------------------- reading runs


def read_run(run_dir: Path) -> dict:
    """One run's figures from the files the trainer writes."""
    run_dir = Path(run_dir)
    record_file, metrics_file = run_dir / "run.json", run_dir / "metrics.jsonl"
    if not record_file.is_file() or not metrics_file.is_file():
        raise ValueError(f"--runs {run_dir}: not a training run of train_accelerate.py (needs run.json and "
                         "metrics.jsonl); pass the --output-dir of a run.")  # fmt: skip
    record = json.loads(record_file.read_text())
    config, model_config = record.get("config", {}), record.get("model_config", {})
    tokens_per_step = (config.get("micro_batch_size", 0) * config.get("grad_accum", 1) * config.get("world_size", 1)
                       * config.get("seq_len", 0))  # fmt: skip
    train, evals = {}, {}
    for line in metrics_file.read_text().splitlines():
        if not line.strip():
            continue
        entry = json.loads(line)
        step = entry.get("step")
        if "val_loss" in entry:  # a resumed run may repeat a step: the last record wins
            evals[step] = entry
        elif "loss" in entry:
            train[step] = entry
    if not evals:
        raise ValueError(f"--runs {run_dir}: metrics.jsonl holds no validation loss; train with --eval-every N > 0.")
    summary_file = run_dir / "summary.json"
    summary = json.loads(summary_file.read_text()) if summary_file.is_file() else {}
    train_rows = [train[s] for s in sorted(train)]
    speeds = [r["tok_s"] for r in train_rows[1:] or train_rows if r.get("tok_s")]  # the first window compiles/warms up
    return {
        "dir": str(run_dir), "name": run_dir.name,
        "mode": model_config.get("attention_mode", config.get("attention_mode")), "seed": config.get("seed"),
        "config": config, "model_config": model_config, "num_parameters": record.get("num_parameters"),
        "device": (record.get("device") or {}).get("gpu") or (record.get("device") or {}).get("type"),
        "git_sha": record.get("git_sha"), "started": record.get("started"),
        "tokens_per_step": tokens_per_step,
        "val": [(s * tokens_per_step, evals[s]["val_loss"]) for s in sorted(evals)],  # (tokens, loss)
        "val_by_position": by_position(evals[max(evals)], max(evals) * tokens_per_step),
        "train": [(r.get("tokens_seen", r["step"] * tokens_per_step), r["loss"]) for r in train_rows],
        "tok_s": statistics.median(speeds) if speeds else None,
        "peak_mem_gb": max((r["peak_mem_gb"] for r in train_rows if r.get("peak_mem_gb")), default=None),
        "finished": summary.get("finished"), "steps": summary.get("step", max(train, default=None)),
        "long_context": read_long_context(run_dir),
        "selection": read_selection(run_dir, max(evals)),
    }  # fmt: skip


# the per-layer selection statistics (nsa_train.selection_stats.layer_statistics) that the tables carry
SELECTION_FIELDS = ("gate_cmp_mean", "gate_slc_mean", "gate_win_mean", "blocks_per_query", "distance_mean",
                    "beyond_window_share", "forced_share", "neighbour_overlap")  # fmt: skip
# (field, column head, format) of the selection tables, here and in bench/seed_groups.py
SELECTION_COLUMNS = (("gate_cmp_mean", "gate cmp", "{:.3f}"), ("gate_slc_mean", "gate slc", "{:.3f}"),
                     ("gate_win_mean", "gate win", "{:.3f}"), ("distance_mean", "mean distance (blocks)", "{:.2f}"),
                     ("beyond_window_share", "beyond the window", "{:.3f}"),
                     ("neighbour_overlap", "neighbour overlap", "{:.3f}"))  # fmt: skip


def read_selection(run_dir: Path, step: int) -> dict | None:
    """The run's selection statistics at evaluation step `step` (the trainer's stats.jsonl, one record per
    evaluation): {"step", "rows", "seq_len", "layers": [{"layer", SELECTION_FIELDS..., "distance_share": the
    selections' shares by distance bin, "0", "1", "2-3", "4-7", ... blocks back}]}; None where the run logged none at
    that step (a dense run, or one trained with --stats-every 0). A resumed run may repeat a step: the last record
    wins, as for the losses."""
    path = Path(run_dir) / "stats.jsonl"
    if not path.is_file():
        return None
    found = None
    for number, line in enumerate(path.read_text().splitlines(), 1):
        try:
            record = json.loads(line) if line.strip() else {}
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}, line {number}: not JSON ({e}); a run stopped mid-write leaves a cut last line: "
                             "remove that line.") from None
        if record.get("step") == step and record.get("layers"):
            found = record
    if found is None:
        return None
    try:
        layers = [{"layer": layer["layer"], **{key: layer[key] for key in SELECTION_FIELDS},
                   "distance_share": layer["distance_share"]} for layer in found["layers"]]  # fmt: skip
    except KeyError as e:
        raise ValueError(f"{path}: step {step}'s record lacks {e}; it was not written by nsa_train.selection_stats "
                         "(remove the file, or train the run again).") from None
    return {"step": step, "rows": found.get("rows"), "seq_len": found.get("seq_len"), "layers": layers}


def selection_layers(run: dict) -> list[int] | None:
    """The layer indices of a run's selection statistics, None where it has none."""
    return None if run.get("selection") is None else [layer["layer"] for layer in run["selection"]["layers"]]


def selection_summary(runs: list[dict]) -> list[dict]:
    """Per layer, each SELECTION_FIELDS' mean and sample std (None for one run) over the runs' selection
    statistics (NaN where some run's is: a layer that selected nothing); [] where some run has none or the runs'
    layers differ."""
    layers = [selection_layers(r) for r in runs]
    if not runs or None in layers or any(ids != layers[0] for ids in layers):
        return []
    summary = []
    for i, layer in enumerate(layers[0]):
        row = {"layer": layer}
        for key in SELECTION_FIELDS:
            values = [r["selection"]["layers"][i][key] for r in runs]
            if any(math.isnan(v) for v in values):
                row[key] = {"mean": math.nan, "std": None}
                continue
            row[key] = {"mean": statistics.fmean(values),
                        "std": statistics.stdev(values) if len(values) > 1 else None}  # fmt: skip
        summary.append(row)
    return summary


def selection_cell(stat: dict, spec: str) -> str:
    """'mean ± std' of a selection_summary entry, in `spec`'s format."""
    return spec.format(stat["mean"]) + (f" ± {spec.format(stat['std'])}" if stat["std"] is not None else "")


def selection_table(runs: list[dict]) -> list[str]:
    """Markdown lines: the NSA runs' gates and selection per layer at their last evaluation (selection_summary);
    empty where some NSA run logged none."""
    nsa = [r for r in runs if r["mode"] == "nsa"]
    summary = selection_summary(nsa)
    if not summary:
        missing = [r["name"] for r in nsa if r.get("selection") is None]
        if nsa and len(missing) < len(nsa):  # some logged them: say why there is no table
            return ["", f"Gates and selection: not tabled; {', '.join(missing) or 'the runs'} "
                        + ("logged none at the last evaluation (trained with --stats-every 0, or stopped on an "
                           "evaluation without statistics)." if missing else "differ in their layers.")]
        return []
    first = nsa[0]["selection"]
    lines = ["", f"Gates and selection of the NSA runs at the last evaluation (the trainer's stats.jsonl: "
                 f"{first['rows']} validation row(s) of {first['seq_len']:,} tokens; mean ± std over "
                 f"{len(nsa)} run(s)). Distance: from the query's own block, in selection blocks; beyond the "
                 "window: selections of blocks no key of which the window holds; neighbour overlap: the share of a "
                 "query's blocks its predecessor also chose:", "",
             "| layer | " + " | ".join(head for _, head, _ in SELECTION_COLUMNS) + " |",
             "|---|" + "---|" * len(SELECTION_COLUMNS)]  # fmt: skip
    for row in summary:
        lines.append(f"| {row['layer']} | " + " | ".join(selection_cell(row[key], spec)
                                                         for key, _, spec in SELECTION_COLUMNS) + " |")
    return lines


def by_position(evaluation: dict, tokens: int) -> dict | None:
    """An evaluation's validation loss by query position (the trainer's `val_loss_pos<lo>to<hi>`,
    nsa_train.evaluation.position_buckets): {"tokens": tokens, "ranges": [[lo, hi, loss], ...]} in position order;
    None for runs trained before the trainer reported it (or with a window that holds every query)."""
    ranges = [list(r) for r in position_losses(evaluation)]
    return {"tokens": tokens, "ranges": ranges} if ranges else None


def read_evaluation(path: Path) -> dict | None:
    """One retrieval evaluation as nsa_train.long_context writes it (<run>/long_context/<task>_<scoring>.json):
    task, scoring, case lengths, extrapolated lengths, and per length the accuracy, the shares of cases that ended
    inside the answer and that were right in every answer token but perhaps the last (generate scoring; None
    otherwise, the second also for files written before it: long_context.ending_summary) and the answer's-block
    selection rate (NSA; None otherwise), each the mean over depths, and its EVALUATION_SETTINGS ("settings", each
    None where the file does not record it). None for another tool's JSON (no accuracy or lengths); a file that
    names them but does not hold them as rows of numbers is an error naming the file."""
    try:
        result = json.loads(path.read_text())
        if not isinstance(result, dict) or "accuracy" not in result or "lengths" not in result:
            return None
        selected = result.get("needle_selected")
        ended, but_last = ended_inside_answer_rates(result), result.get("right_but_last_token")
        return {
            "task": result.get("task"), "scoring": result.get("scoring"), "lengths": list(result["lengths"]),
            "extrapolated": result.get("extrapolated_lengths") or [],
            "accuracy": [statistics.fmean(row) for row in result["accuracy"]],
            "ended": [statistics.fmean(row) for row in ended] if ended else None,
            "right_but_last": [statistics.fmean(row) for row in but_last] if but_last else None,
            "selected": [statistics.fmean(row) for row in selected] if selected else None,
            "settings": {key: result.get(key) for key in EVALUATION_SETTINGS},
        }  # fmt: skip
    except (json.JSONDecodeError, TypeError, statistics.StatisticsError) as e:
        raise ValueError(f"{path}: not a long-context evaluation as nsa_train.long_context writes it ({e}); "
                         "run the evaluation again or remove the file.") from None


def read_long_context(run_dir: Path) -> list[dict]:
    """The run's retrieval evaluations (<run>/long_context/*.json, written by --eval-long-context or
    nsa_train.long_context), each as read_evaluation reads it."""
    found = (read_evaluation(path) for path in sorted((run_dir / "long_context").glob("*.json")))
    return [evaluation for evaluation in found if evaluation is not None]


def _shared_overrides(overrides) -> dict | None:
    """A run's --model-overrides without NSA's own fields (the ones a dense twin ignores), or None where it is not
    a JSON object (compared as written then)."""
    try:
        fields = json.loads(overrides) if overrides else {}
    except (TypeError, json.JSONDecodeError):
        return None
    return {k: v for k, v in fields.items() if k not in NSA_FIELDS} if isinstance(fields, dict) else None


def sample_warnings(runs: list[dict], comparison: dict) -> list[str]:
    """What makes the runs' averages something other than a comparison of seeds at the runs' ends: two runs of one
    mode and seed (their spread is not seed-to-seed), one mode only (no NSA - dense), the last shared evaluation
    short of a run's last (their --eval-every or tokens per step differ) or at step 0 only."""
    warnings = []
    pairs = Counter((r["mode"], r["seed"]) for r in runs)
    for (mode, seed), count in sorted(pairs.items(), key=str):
        if count > 1:
            names = ", ".join(r["name"] for r in runs if (r["mode"], r["seed"]) == (mode, seed))
            warnings.append(f"{names}: {count} {mode} runs of seed {seed}, averaged as separate samples: their spread "
                            "is not seed-to-seed (to compare two variants of one mode, use bench/seed_groups.py)")
    if len(comparison["modes"]) == 1:
        warnings.append(f"only {comparison['modes'][0]} runs: the spread over them, no NSA - dense (give both modes' "
                        "runs to compare attention)")  # fmt: skip
    curve = comparison["curve"]
    if len(comparison["modes"]) == 2:
        twins = twin_seeds(runs)
        unpaired = [r["name"] for r in runs if r["seed"] not in twins]
        if not twins:  # (twins of a seed share their initial weights and data order: here no seed's luck cancels)
            ran = "; ".join(f"{m} seed{'s' if len(seeds) > 1 else ''} {', '.join(map(str, seeds))}" for m, seeds in
                            ((m, sorted({r["seed"] for r in runs if r["mode"] == m}, key=seed_order)) for m in MODES))
            warnings.append(f"no seed paired: no seed ran once in each mode ({ran}), so NSA - dense is the difference "
                            "of the modes' means over different seeds (other initial weights, other data order), not "
                            "a gap between twins; train each run's twin (ab_compare.py --seeds S --modes MODE) to "
                            "pair them")  # fmt: skip
        elif unpaired and curve and curve[-1].get("interval_kind") == "paired":
            warnings.append(f"runs without a twin of their seed in the other mode ({', '.join(unpaired)}): left out of "
                            "NSA - dense and its interval, which are paired by seed (the modes' means hold them)")
        elif unpaired:
            warnings.append(f"runs without a twin of their seed in the other mode ({', '.join(unpaired)}): NSA - dense "
                            "and its interval are taken from the modes' means and spreads, not paired by seed "
                            f"(paired: seed {', '.join(map(str, sorted(twins, key=seed_order)))} alone); train their "
                            "twins to pair them")  # fmt: skip
    shared = curve[-1]["tokens"] if curve else None
    if shared == 0:
        warnings.append("the runs share no evaluation after step 0 (their --eval-every or tokens per step differ): no "
                        "comparison at equal tokens, no verdict")  # fmt: skip
    elif shared is not None:
        beyond = [f"{r['name']} {r['val'][-1][0]:,}" for r in runs if r["val"][-1][0] > shared]
        if beyond:
            warnings.append(f"compared at {shared:,} tokens, the last count every run evaluated; runs evaluated "
                            f"later: {', '.join(beyond)}")
    return warnings


def config_differences(runs: list[dict]) -> list[str]:
    """What differs between the runs besides the attention mode, the seed and the directories: NSA's own model
    fields may differ (dense ignores them); anything else means the comparison is not like for like."""
    notes = []
    base = runs[0]
    for other in runs[1:]:
        for key in sorted(set(base["config"]) | set(other["config"])):
            if key in PER_RUN_CONFIG:
                continue
            if key == "init_from" and _started_from_twin(base) and _started_from_twin(base) == _started_from_twin(other):
                continue  # each started from its own twin of one earlier comparison (--init-from-runs)
            if key == "model_overrides":  # NSA's own fields may differ (the model configs below say the rest)
                if _shared_overrides(base["config"].get(key)) == _shared_overrides(other["config"].get(key)):
                    continue
            if base["config"].get(key) != other["config"].get(key):
                notes.append(f"{base['name']} / {other['name']}: train config {key} = {base['config'].get(key)!r} / "
                             f"{other['config'].get(key)!r}")  # fmt: skip
        for key in sorted(set(base["model_config"]) | set(other["model_config"])):
            if key in NSA_FIELDS or key in RUNTIME_FIELDS or key.startswith("_") or key == "transformers_version":
                continue
            if base["model_config"].get(key) != other["model_config"].get(key):
                notes.append(f"{base['name']} / {other['name']}: model config {key} = "
                             f"{base['model_config'].get(key)!r} / {other['model_config'].get(key)!r}")  # fmt: skip
    return notes


# ----------------------------------------------------------------------------- comparing


def _spread(values: list[float]) -> dict:
    out = {"mean": statistics.fmean(values), "n": len(values), "min": min(values), "max": max(values)}
    out["std"] = statistics.stdev(values) if len(values) >= 2 else None
    return out


# Two-sided 95% quantiles of Student's t by degrees of freedom, 1 to 30: the seed counts here are small, where the
# normal quantile would understate the uncertainty many times over (2 seeds: 12.7, not 1.96).
_T95 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042]


def t95(dof: int) -> float:
    """Two-sided 95% quantile of Student's t with `dof` degrees of freedom: the table to 30, then the
    Cornish-Fisher expansion of t about the normal quantile 1.95996 (Abramowitz & Stegun 26.7.5; within 1e-4 of
    the exact value from 30 degrees on, where 1.96 alone would be up to 4% short)."""
    if dof < 1:
        raise ValueError(f"Student's t needs at least 1 degree of freedom (2 samples), got {dof}")
    if dof <= len(_T95):
        return _T95[dof - 1]
    z, v = 1.959964, float(dof)
    return (z + (z**3 + z) / (4 * v) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * v**2)
            + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * v**3))


def paired_half_width(gaps: list[float]) -> float:
    """Student's t 95% half-width of the mean of per-seed gaps (two or more): t * std / sqrt(n)."""
    return t95(len(gaps) - 1) * statistics.stdev(gaps) / math.sqrt(len(gaps))


def gap_interval(row: dict) -> tuple[float | None, str]:
    """Half-width of the 95% interval of NSA - dense at one token count, and how it was formed. Paired by seed
    where 2 or more seeds ran both modes once each (twins of one seed share the initial weights of every shared
    parameter and the data order, so the seed's luck cancels in their difference): t * std / sqrt(n) of the
    per-seed gaps. Otherwise from the spread within each mode (Welch, the smaller sample's degrees of freedom),
    or one mode's spread for both. None: no spread measured."""
    gaps = list(row.get("paired_gaps", {}).values())
    if len(gaps) >= 2:
        return paired_half_width(gaps), "paired"
    spreads = [row[m] for m in MODES if row.get(m) and row[m]["std"] is not None]
    if not spreads:
        return None, "none"
    if len(spreads) == 2:
        se = math.sqrt(sum(s["std"] ** 2 / s["n"] for s in spreads))
        return t95(min(s["n"] for s in spreads) - 1) * se, "per-mode"
    s = spreads[0]
    return t95(s["n"] - 1) * s["std"] * math.sqrt(sum(1 / row[m]["n"] for m in MODES)), "per-mode"


def paired_gaps(by_mode: dict[str, list[dict]], loss_of) -> dict[str, float]:
    """NSA - dense per seed, of the figure `loss_of(run)` gives. A/B twins of one seed share the initial weights of
    every shared parameter and the data order, so the seed's luck is common to both: the spread of NSA - dense over
    seeds is the noise of the gap. Seeds that one mode ran twice are not paired (which of its runs is the twin is
    not known). Keys are str (JSON's)."""
    twins = twin_seeds(by_mode["nsa"] + by_mode["dense"])
    loss = {m: {r["seed"]: loss_of(r) for r in by_mode[m] if r["seed"] in twins} for m in MODES}
    return {str(seed): loss["nsa"][seed] - loss["dense"][seed] for seed in sorted(twins)}


def seed_order(seed) -> tuple:
    """Sort key of seeds: numbers in order (2 before 10), then anything else a record holds (None) as text."""
    return (0, seed, "") if isinstance(seed, int) else (1, 0, str(seed))


def twin_seeds(runs: list[dict]) -> set:
    """The seeds that each mode ran exactly once: the twins that paired_gaps pairs (a seed one mode ran twice is
    not paired: which of its runs is the twin is not known)."""
    once = [{seed for seed, n in Counter(r["seed"] for r in runs if r["mode"] == m).items() if n == 1} for m in MODES]
    return once[0] & once[1]


def set_gap(row: dict, by_mode: dict[str, list[dict]], loss_of) -> None:
    """NSA - dense in `row` (which holds each mode's spread), its per-seed gaps and its 95% interval, the gap centred
    where its interval is formed: on the paired seeds' mean gap where the interval is paired (runs without a twin of
    their seed are then left out of both; with every run paired it is the difference of the modes' means), else on
    the difference of the modes' means."""
    row["paired_gaps"] = paired_gaps(by_mode, loss_of)
    row["interval"], row["interval_kind"] = gap_interval(row)
    row["nsa_minus_dense"] = (statistics.fmean(row["paired_gaps"].values()) if row["interval_kind"] == "paired"
                              else row["nsa"]["mean"] - row["dense"]["mean"])  # fmt: skip


def compare(runs: list[dict]) -> dict:
    """Per mode, per evaluated token count (those every run of both modes reached): mean validation loss over
    seeds, its spread, NSA - dense, NSA - dense per seed both modes ran once, and the 95% interval of the gap
    (gap_interval). The verdict at the last count says met / MISSED only when the target lies outside it."""
    by_mode = {m: [r for r in runs if r["mode"] == m] for m in MODES}
    by_mode = {m: rs for m, rs in by_mode.items() if rs}
    common = None
    for r in runs:
        tokens = {t for t, _ in r["val"]}
        common = tokens if common is None else common & tokens
    curve = []
    for tokens in sorted(common or ()):
        row = {"tokens": tokens}
        for mode, rs in by_mode.items():
            row[mode] = _spread([dict(r["val"])[tokens] for r in rs])
        if "nsa" in row and "dense" in row:
            set_gap(row, by_mode, lambda run: dict(run["val"])[tokens])
        curve.append(row)
    final = curve[-1] if curve else None
    verdict = None
    # (a verdict at 0 tokens would judge the untrained models: runs that share no later evaluation get none)
    if final and "nsa_minus_dense" in final and final["tokens"] > 0:
        gap, half = final["nsa_minus_dense"], final["interval"]
        seed_std = max((final[m]["std"] or 0.0) for m in by_mode)
        paired = final["paired_gaps"]
        seeds = {m: sorted({r["seed"] for r in rs}, key=seed_order) for m, rs in by_mode.items()}
        # the interval the README describes rests on each mode's own seed-to-seed spread (paired by seed, or within
        # each mode: gap_interval); a mode of one seed leaves it to the other mode's spread alone (NSA's two seeds
        # against one dense run once read "met"), which says nothing of that mode's luck: no verdict then
        short = [f"{len(seeds[m])} {m} seed" + ("s" if len(seeds[m]) != 1 else "") for m in MODES if len(seeds[m]) < 2]
        verdict = {"tokens": final["tokens"], "nsa_minus_dense": gap, "target": TARGET_NATS,
                   "met": gap <= TARGET_NATS, "seed_std": seed_std or None, "paired_gaps": paired,
                   "paired_std": statistics.stdev(paired.values()) if len(paired) >= 2 else None,
                   "interval": half, "interval_kind": final["interval_kind"], "seeds": seeds,
                   "spread_from": [m for m in MODES if final[m]["std"] is not None],
                   "undecided": ", ".join(short) or None,
                   "beyond_noise": half is not None and abs(gap) > half,
                   # the runs tell "met" from "missed" only if the target lies outside the gap's 95% interval, and
                   # that interval is each mode's
                   "resolved": not short and half is not None and abs(gap - TARGET_NATS) > half}  # fmt: skip
    return {"curve": curve, "final": verdict, "modes": list(by_mode),
            "by_position": compare_by_position(by_mode, curve[-1]["tokens"]) if curve else []}


def compare_by_position(by_mode: dict[str, list[dict]], tokens: int) -> list[dict]:
    """At `tokens` (the last count every run evaluated at), per range of query positions that every run reported
    there: each mode's mean loss over seeds and its spread, and NSA - dense with its 95% interval (gap_interval:
    paired by seed where both modes ran it). Empty where some run did not report the loss by position there (runs
    trained before the trainer did, or evaluated last at other token counts)."""
    runs = [r for rs in by_mode.values() for r in rs]
    reported = [r.get("val_by_position") for r in runs]
    if not all(rep and rep["tokens"] == tokens for rep in reported):
        return []
    shared = set.intersection(*({(lo, hi) for lo, hi, _ in rep["ranges"]} for rep in reported))
    rows = []
    for lo, hi in sorted(shared):
        def at(run):  # the run's loss over positions lo..hi-1
            return next(x for a, b, x in run["val_by_position"]["ranges"] if (a, b) == (lo, hi))

        row = {"positions": [lo, hi]}
        for mode, rs in by_mode.items():
            row[mode] = _spread([at(r) for r in rs])
        if "nsa" in row and "dense" in row:
            set_gap(row, by_mode, at)
        rows.append(row)
    # beyond the window, the gap less the window's own, seed by seed: whether NSA loses (or gains) where the far
    # context reaches it only through its compressed and selected branches, with each seed's general lead taken out
    for row in rows[1:]:
        if len(row.get("paired_gaps", {})) >= 2:
            first = rows[0]["paired_gaps"]
            beyond = [gap - first[seed] for seed, gap in row["paired_gaps"].items()]
            row["beyond_window"] = {"mean": statistics.fmean(beyond), "n": len(beyond),
                                    "interval": paired_half_width(beyond)}
    return rows


def _fmt(x, spec="{:.4f}"):
    return "" if x is None else spec.format(x)


def markdown(runs: list[dict], comparison: dict, notes: list[str], warnings: list[str] = ()) -> str:
    lines = ["# NSA vs dense" if len(comparison["modes"]) == 2 else f"# {comparison['modes'][0]} runs", ""]
    if warnings:
        lines += ["**Read with care:**", "", *[f"- {w}" for w in warnings], ""]
    lines += ["| run | mode | seed | params | device | steps | tokens | val loss | val ppl | tok/s (median) | peak mem GB |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in runs:
        tokens, loss = r["val"][-1]
        # the attention kernel where the run chose one (a dense twin's sdpa / eager / flex_attention: tok/s depends on it)
        kernel = (r.get("config") or {}).get("attn_implementation")
        mode = f"{r['mode']} ({kernel})" if kernel else r["mode"]
        lines.append(f"| {r['name']} | {mode} | {r['seed']} | {r['num_parameters'] / 1e6:.2f}M | {r['device']} | "
                     f"{r['steps']} | {tokens:,} | {loss:.4f} | {math.exp(min(loss, 50)):.2f} | {_fmt(r['tok_s'], '{:,.0f}')} | "
                     f"{_fmt(r['peak_mem_gb'], '{:.2f}')} |")  # fmt: skip
    lines += long_context_table(runs)
    modes = comparison["modes"]
    lines += ["", "Validation loss at equal tokens (mean over seeds; ± sample std over seeds where >= 2):", "",
              "| tokens | " + " | ".join(modes) + (" | NSA - dense |" if len(modes) == 2 else " |"),
              "|---|" + "---|" * (len(modes) + (len(modes) == 2))]  # fmt: skip
    for row in comparison["curve"]:
        cells = []
        for m in modes:
            s = row[m]
            cells.append(f"{s['mean']:.4f}" + (f" ± {s['std']:.4f}" if s["std"] is not None else ""))
        diff = f" | {row['nsa_minus_dense']:+.4f}" if "nsa_minus_dense" in row else ""
        lines.append(f"| {row['tokens']:,} | " + " | ".join(cells) + diff + " |")
    final = comparison["final"]
    if final:
        half = final["interval"]
        how = {"paired": "paired by seed", "per-mode": "from the spread within each mode"}.get(final["interval_kind"])
        spread_from = final.get("spread_from") or []
        if final["interval_kind"] == "per-mode" and len(spread_from) == 1:  # the other mode ran one seed
            how = f"from {spread_from[0]}'s spread alone"
        spread = (f"; 95% interval of the gap +-{half:.4f} nats, {how} "
                  f"({'the gap is beyond it' if final['beyond_noise'] else 'it includes 0'})"
                  if half is not None else "; one seed per mode: no spread measured (give --seeds 0 1 2)")  # fmt: skip
        if final.get("undecided"):  # a mode without a spread of its own: the interval is not the README's
            status = (f"undecided: {final['undecided']}; the gap's 95% interval needs two seeds or more of each mode "
                      f"(three or more decide it: --seeds 0 1 2); {'met' if final['met'] else 'missed'} by the means")
        elif final["resolved"]:
            status = "met" if final["met"] else "MISSED"
        else:  # the target inside the gap's interval (or no spread measured) cannot be decided either way
            why = ("the target lies within the gap's 95% interval (more seeds narrow it)" if half is not None
                   else "no seed spread to judge it against")
            status = f"{'met' if final['met'] else 'missed'} by the means, NOT RESOLVED: {why}"
        paired = ", ".join(f"seed {seed} {gap:+.4f}" for seed, gap in final["paired_gaps"].items())
        lines += ["", f"At {final['tokens']:,} tokens NSA - dense = {final['nsa_minus_dense']:+.4f} nats "
                      f"(target <= +{TARGET_NATS}: {status}){spread}"
                      + (f"; per seed: {paired}" if paired else "")
                      + (f"; seed-to-seed std within a mode {final['seed_std']:.4f}" if final["seed_std"] else "")
                      + "."]  # fmt: skip
    lines += position_table(comparison)
    lines += selection_table(runs)
    started = {_started_from_twin(r) for r in runs if r.get("config")}
    if len(started) == 1 and None not in started:
        lines += ["", f"Each run started from its own twin's final/ in {started.pop()} (--init-from-runs)."]
    if notes:
        lines += ["", "**The runs differ beyond the attention mode** (not a like-for-like comparison):", ""]
        lines += [f"- {n}" for n in notes]
    else:
        lines += ["", "The runs' configs differ only in the attention mode, the seed and the output directory "
                      "(and NSA's own model fields, which dense does not use)." + unpaired_note(runs, comparison)]
    lines += ["", f"Peak memory: allocated GPU memory on CUDA, the process's resident set size on CPU. "
                  f"Written {time.strftime('%Y-%m-%d')}."]  # fmt: skip
    return "\n".join(lines) + "\n"


def unpaired_note(runs: list[dict], comparison: dict) -> str:
    """' But ...' where the runs of both modes are not all twins (twin_seeds): the closing line says the configs
    differ only in mode and seed, which read alone would pass runs of unrelated seeds for twins; '' otherwise."""
    if len(comparison["modes"]) != 2 or not runs:
        return ""
    twins = twin_seeds(runs)
    unpaired = [r["name"] for r in runs if r["seed"] not in twins]
    if not twins:
        return (f" But no seed is paired ({', '.join(unpaired)}: no seed ran once in each mode): NSA - dense compares "
                "runs of different seeds, not twins.")
    if unpaired:
        return f" Not paired (no twin of their seed in the other mode): {', '.join(unpaired)}."
    return ""


def position_table(comparison: dict) -> list[str]:
    """Markdown lines: the validation loss at the last evaluation by range of query positions (compare_by_position);
    empty where the runs did not report it."""
    rows, modes = comparison.get("by_position") or [], comparison["modes"]
    if not rows:
        return []
    both = "nsa_minus_dense" in rows[0]
    beyond = any("beyond_window" in row for row in rows)
    window = f"{rows[0]['positions'][0]:,}-{rows[0]['positions'][1] - 1:,}"
    lines = ["", f"Validation loss at {comparison['curve'][-1]['tokens']:,} tokens by the query's position in its "
                 "document's fragment of the row (the tokens it predicts from, less itself): NSA's window holds the "
                 "whole context of the first range; beyond it, what lies further back reaches NSA only through the "
                 "compressed and selected branches (mean over seeds; ± sample std over seeds where >= 2)"
             + (f"; the last column: NSA - dense there less NSA - dense at {window}, seed by seed (a seed's lead "
                "everywhere cancels): below 0, NSA gains more beyond its window than inside it" if beyond else "")
             + ":", "",
             "| positions | " + " | ".join(modes)
             + ((" | NSA - dense (95%)" if any(row["interval"] is not None for row in rows) else " | NSA - dense")
                if both else "")
             + (f" | less the gap at {window} (95%, paired) |" if beyond else " |"),
             "|---|" + "---|" * (len(modes) + both + beyond)]  # fmt: skip
    for row in rows:
        cells = [f"{row[m]['mean']:.4f}" + (f" ± {row[m]['std']:.4f}" if row[m]["std"] is not None else "")
                 for m in modes]  # fmt: skip
        if both:
            half = row["interval"]
            cells.append(f"{row['nsa_minus_dense']:+.4f}" + (f" ± {half:.4f} ({row['interval_kind']})"
                                                              if half is not None else ""))  # fmt: skip
        if beyond:
            rel = row.get("beyond_window")
            cells.append(f"{rel['mean']:+.4f} ± {rel['interval']:.4f}" if rel else "")
        lo, hi = row["positions"]
        lines.append(f"| {lo:,}-{hi - 1:,} | " + " | ".join(cells) + " |")
    return lines


def long_context_table(runs: list[dict]) -> list[str]:
    """Markdown lines: per (task, scoring) the runs' retrieval accuracy at each case length (mean over depths) and,
    for NSA runs, how often the last prompt token's selection held the answer's block; empty when no run has one."""
    evaluations = {}
    for r in runs:
        for ev in r.get("long_context") or ():
            evaluations.setdefault((ev["task"], ev["scoring"]), []).append((r, ev))
    lines = []
    for (task, scoring), found in evaluations.items():
        lengths = sorted({n for _, ev in found for n in ev["lengths"]})
        heads = [f"{n:,}" for n in lengths]
        with_selection = any(ev["selected"] for _, ev in found)
        endings = [_ending_cells(ev) for _, ev in found]
        with_endings = any(endings)  # (the column only where some answer failed on its last token)
        lines += ["", f"Long-context retrieval, {task} scored by {scoring}: accuracy per case length (prompt and "
                      "answer, tokens), mean over depths (* past the run's training length)"
                  + ("; per length where they tell more than the accuracy, the cases right in every answer token "
                     "but perhaps the last (right answers included) and those that ended inside the answer (its "
                     "right start, then end-of-text; scored wrong): a case one token longer than a training row "
                     "puts the answer's last token where the rows ended" if with_endings else "")
                  + ("; NSA: the share of the last prompt token's selections "
                      "(per layer and KV group) that held the answer's block, per length" if with_selection else "")
                  + ":", "",
                  "| run | " + " | ".join(heads) + (" | right but perhaps the last token (ended inside)" if with_endings else "")
                  + (" | answer's block selected |" if with_selection else " |"),
                  "|---|" + "---|" * (len(lengths) + with_endings + with_selection)]  # fmt: skip
        for (r, ev), ending in zip(found, endings):
            by_length = dict(zip(ev["lengths"], ev["accuracy"]))
            cells = [f"{by_length[n]:.0%}" + ("*" if n in ev["extrapolated"] else "") if n in by_length else ""
                     for n in lengths]  # fmt: skip
            if with_endings:
                cells.append(ending)
            if with_selection:
                chosen = dict(zip(ev["lengths"], ev["selected"] or ()))
                cells.append(" / ".join(f"{chosen[n]:.0%}" if n in chosen else "-" for n in lengths) if chosen else "")
            lines.append(f"| {r['name']} | " + " | ".join(cells) + " |")
    return lines


def log_warnings(log: Path) -> list[str]:
    """The trainer's 'warning: ...' lines in a run's log (under --jobs its output goes there), each once."""
    lines = log.read_text(errors="replace").splitlines() if log.is_file() else []
    return list(dict.fromkeys(line.strip() for line in lines if line.lstrip().lower().startswith("warning:")))


def _ending_cells(ev: dict) -> str:
    """'256: 94% (ended 69%)' for each length where the cases right in every answer token but perhaps the last
    (right answers included) differ from the accuracy or some answer ended inside itself ('256: ended 69%' for files
    without the first); '' where none."""
    accuracy = dict(zip(ev["lengths"], ev["accuracy"]))
    ended = dict(zip(ev["lengths"], ev.get("ended") or ()))
    but_last = dict(zip(ev["lengths"], ev.get("right_but_last") or ()))
    parts = []
    for n in ev["lengths"]:
        if not tells_more_than_accuracy(accuracy[n], but_last.get(n), ended.get(n)):
            continue
        if n in but_last:
            parts.append(f"{n:,}: {but_last[n]:.0%} (ended {ended.get(n, 0):.0%})")
        else:
            parts.append(f"{n:,}: ended {ended[n]:.0%}")
    return ", ".join(parts)


def plot(runs: list[dict], comparison: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"nsa": "tab:blue", "dense": "tab:orange"}
    with_gap = any("nsa_minus_dense" in r for r in comparison["curve"])
    by_position = [r for r in comparison.get("by_position") or () if "nsa_minus_dense" in r]
    panels = 1 + with_gap + bool(by_position)
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 4), squeeze=False)
    ax = axes[0][0]
    seeds = sorted({r["seed"] or 0 for r in runs})
    styles = ["-", "--", ":", "-."]  # one per seed (a mode's seeds told apart; the twins of a seed share one)
    for r in runs:
        tokens, losses = zip(*r["val"])
        ax.plot(tokens, losses, marker="o", markersize=3, color=colors.get(r["mode"], "gray"),
                linestyle=styles[seeds.index(r["seed"] or 0) % len(styles)], label=f"{r['mode']} seed {r['seed']}")
    ax.set_xlabel("tokens")
    ax.set_ylabel("validation loss (nats)")
    ax.set_title("validation loss")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    if with_gap:
        ax = axes[0][1]
        rows = [r for r in comparison["curve"] if "nsa_minus_dense" in r]
        tokens = [r["tokens"] for r in rows]
        gap = [r["nsa_minus_dense"] for r in rows]
        ax.plot(tokens, gap, marker="o", markersize=3, color="black", label="NSA - dense (mean over seeds)")
        halves = [r["interval"] or 0.0 for r in rows]
        if any(halves):
            ax.fill_between(tokens, [g - h for g, h in zip(gap, halves)], [g + h for g, h in zip(gap, halves)],
                            color="gray", alpha=0.25, label=f"95% interval ({rows[-1]['interval_kind']})")  # fmt: skip
        for seed in rows[-1]["paired_gaps"] if len(rows[-1]["paired_gaps"]) >= 2 else ():
            ax.plot(tokens, [r["paired_gaps"][seed] for r in rows], linewidth=0.8, alpha=0.7,
                    label=f"seed {seed}: NSA - dense")  # fmt: skip
        ax.axhline(TARGET_NATS, color="red", linestyle=":", label=f"target +{TARGET_NATS}")
        ax.axhline(0.0, color="gray", linewidth=0.8)
        ax.set_xlabel("tokens")
        ax.set_ylabel("nats")
        ax.set_title("NSA - dense validation loss")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    if by_position:  # the last evaluation's gap by the query's position (compare_by_position)
        ax = axes[0][-1]
        labels = [f"{lo}-{hi - 1}" for lo, hi in (r["positions"] for r in by_position)]
        gap = [r["nsa_minus_dense"] for r in by_position]
        halves = [r["interval"] or 0.0 for r in by_position]
        ax.errorbar(range(len(gap)), gap, yerr=halves if any(halves) else None, marker="o", color="black", capsize=3,
                    label="NSA - dense" + (f", 95% interval ({by_position[0]['interval_kind']})" if any(halves) else ""))
        ax.axhline(0.0, color="gray", linewidth=0.8)
        ax.axvline(0.5, color="tab:green", linestyle=":", label="end of NSA's window")
        ax.set_xticks(range(len(gap)), labels, fontsize=8)
        ax.set_xlabel("query position (tokens before it in its document)")
        ax.set_ylabel("nats")
        ax.set_title(f"NSA - dense by position, at {comparison['curve'][-1]['tokens']:,} tokens")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_comparison(run_dirs: list[Path], out: Path) -> dict:
    runs = [read_run(Path(d)) for d in run_dirs]
    modes = {r["mode"] for r in runs}
    if len(runs) < 2:
        raise ValueError(f"--runs: give at least two runs to compare (got {len(runs)}).")
    if not modes <= set(MODES):
        raise ValueError(f"--runs: attention modes {sorted(modes)}; the runs must be {' or '.join(MODES)} runs.")
    # runs of one name (a seed rerun in another --out) are told apart by their parent folder in every table
    named = Counter(r["name"] for r in runs)
    for r in runs:
        if named[r["name"]] > 1:
            r["name"] = f"{Path(r['dir']).parent.name}/{r['name']}"
    notes = config_differences(runs)
    stopped = sorted({r["steps"] for r in runs if not r["finished"]})
    if stopped:  # (training runs only: --runs compares finished ones)
        notes.append(f"a prefix: {'runs' if len(runs) > 1 else 'the run'} stopped at step "
                     f"{', '.join(map(str, stopped))} of --max-steps {runs[0]['config'].get('max_steps')} "
                     "(--stop-at-step), the learning rate not yet decayed as at the end; the same command with a "
                     "later --stop-at-step, or without it, trains them on")
    comparison = compare(runs)
    warnings = sample_warnings(runs, comparison)
    out.mkdir(parents=True, exist_ok=True)
    (out / "ab_compare.md").write_text(markdown(runs, comparison, notes, warnings))
    result = {"runs": [{k: v for k, v in r.items() if k not in ("config", "model_config")} for r in runs],
              "comparison": comparison, "config_differences": notes, "warnings": warnings,
              "date": time.strftime("%Y-%m-%d")}  # fmt: skip
    (out / "ab_compare.json").write_text(json.dumps(result, indent=2))
    try:
        plot(runs, comparison, out / "ab_compare.png")
    except ImportError:
        print('matplotlib is not installed: no PNG (pip install "nsa-transformers[plot]")', file=sys.stderr)
    print((out / "ab_compare.md").read_text())
    return result


class _Parser(argparse.ArgumentParser):
    """argparse, with the way out for its most likely unknown flag: a training flag given before the --."""

    def error(self, message):
        if message.startswith("unrecognized arguments: "):
            unknown = message.removeprefix("unrecognized arguments: ")
            message += f" (training flags go after --: ab_compare.py --out DIR -- {unknown} ...)"
        super().error(message)


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    train_flags = argv[argv.index("--") + 1 :] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    p = _Parser(prog="bench/ab_compare.py", allow_abbrev=False, description=__doc__.split("\n\n")[0],
                                usage="%(prog)s --out DIR [--seeds S ...] [--modes nsa dense] -- TRAIN_FLAGS  |  "
                                      "%(prog)s --out DIR --runs RUN_DIR RUN_DIR ...")  # fmt: skip
    p.add_argument("--out", required=True, help="directory of the runs and the comparison")
    p.add_argument("--seeds", type=int, nargs="+", default=[0],
                   help="seeds per mode (default 0: one run each, no spread; 0 1 2 lets the verdict decide)")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--runs", nargs="+", default=None, help="compare these finished runs (no training)")
    p.add_argument("--jobs", type=int, default=1,
                   help="runs trained at once (default 1; on a CPU with several cores, where OMP_NUM_THREADS is not "
                        "set, each run gets cores // jobs threads; each run's output then goes to "
                        "<out>/<mode>-seed<S>.log)")  # fmt: skip
    p.add_argument("--init-from-runs", type=Path, default=None, metavar="DIR",
                   help="start each run from DIR/<mode>-seed<S>/final, its twin in an earlier comparison's --out "
                        "(e.g. fine-tune pretrained twins); the flags after -- then take no --init-from or "
                        "--model-overrides")  # fmt: skip
    p.add_argument("--launcher", default=shlex.quote(sys.executable),
                   help="how to start train_accelerate.py, e.g. 'accelerate launch --config_file "
                        "accelerate_configs/single_gpu.yaml' from the repository (the runs start in this command's "
                        "directory: a relative path in it is read from there) (default: this Python)")  # fmt: skip
    args = p.parse_args(own)
    # absolute, read from this command's working directory (where the runs start too): the directories named in the
    # runs' commands, records and messages are then the same wherever they are read
    out = Path(args.out).resolve()
    if args.init_from_runs is not None:
        args.init_from_runs = args.init_from_runs.resolve()
    if args.runs:
        unused = ([f"--init-from-runs {args.init_from_runs}"] if args.init_from_runs else []) + (
            [f"the flags after -- ({shlex.join(train_flags)})"] if train_flags else [])
        if unused:
            p.error(f"--runs compares finished runs, training none: {' and '.join(unused)} would not be used; drop "
                    f"{'them' if len(unused) > 1 else 'it'}.")
        run_dirs = [Path(d) for d in args.runs]
        repeated = sorted({str(d) for d in run_dirs if run_dirs.count(d) > 1})
        if repeated:
            p.error(f"--runs {' '.join(repeated)}: given twice (it would count as two seeds).")
        unfinished = [str(d) for d in run_dirs if run_state(d) == "resumable"]  # (checkpoints, summary not done)
        if unfinished:
            raise ValueError(f"--runs {' '.join(unfinished)}: not finished (stopped before its last step, or still "
                             "training); resume it (the trainer's --resume latest, or the ab_compare command that "
                             "trained it) and compare it when it is done.")
    else:
        if not train_flags:
            p.error("give the training flags after --, e.g. -- --model tiny --max-steps 500 --eval-every 50.")
        if len(set(args.seeds)) != len(args.seeds):
            p.error(f"--seeds {' '.join(map(str, args.seeds))}: a seed is repeated.")
        # the trainer refuses these (numpy and torch take seeds in [0, 2**32)): refused here, before any run starts,
        # not after the runs of the good seeds before it have trained
        refused = [seed for seed in args.seeds if not 0 <= seed < 2**32]
        if refused:
            p.error(f"--seeds {' '.join(map(str, refused))}: the trainer takes seeds in [0, 2**32) (numpy's and "
                    "torch's); give seeds such as --seeds 0 1 2.")
        if args.jobs < 1:
            p.error(f"--jobs {args.jobs}: give at least 1.")
        run_dirs = train_runs(out, args.seeds, args.modes, train_flags, shlex.split(args.launcher), jobs=args.jobs,
                              init_from_runs=args.init_from_runs)
        if len(run_dirs) < 2:  # one mode and one seed: a run to compare later with --runs, nothing to compare now
            print(f"trained one run ({run_dirs[0]}); compare it with others: python bench/ab_compare.py --out DIR "
                  f"--runs {run_dirs[0]} OTHER_RUN ...")
            return {"runs": [str(d) for d in run_dirs]}
    return write_comparison(run_dirs, out)


if __name__ == "__main__":
    run_command(main)
