"""Resumable checkpoints (atomic, keep-last) and the exported Hugging Face checkpoint.

Layout under `<output_dir>/checkpoints/`:

    step_00000200/            a complete checkpoint (accelerator.save_state + trainer_state.json + data states)
    .tmp-step_00000300/       being written; renamed to step_00000300 only once every rank has finished

A directory counts as a checkpoint only when its name is `step_<N>` *and* it holds `trainer_state.json`,
which is written last; a run killed mid-write leaves a `.tmp-*` directory that is never picked up (and is
removed by the next save).
"""

from __future__ import annotations

import contextlib
import copy
import fcntl
import itertools
import json
import os
import re
import shlex
import shutil
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .run_state import SCHEDULE_FLAGS, RunState

STATE_FILE = "trainer_state.json"
LOCK_FILE = "run.lock"  # held (flock) by the launch writing into an output dir; names it for the one refused
RUN_OUTPUTS = ("metrics.jsonl", "final", "summary.json")  # what a run writes besides its checkpoints
_STEP_DIR = re.compile(r"^step_(\d+)$")
RUNTIME_FIELDS = {"nsa_backend", "use_cache", "training_seq_len"}  # chosen per run: the weights do not depend on them
MODEL_FLAGS = ("model", "model_overrides", "tokenizer", "attention_mode")  # the flags that build the model
# the flags that decide which token a saved data position points at: a resume must keep them
DATA_FLAGS = ("dataset", "dataset_config", "text_column", "tokenizer", "seed", "shuffle_buffer", "val_every_doc",
              "data_shard", "cross_doc_attention", "seq_len")  # fmt: skip


def model_fields(config) -> dict:
    """The model config a checkpoint's weights belong to: the config class's own fields, less runtime choices."""
    return {k: getattr(config, k) for k in type(config).__annotations__ if k not in RUNTIME_FIELDS}


def data_fields(run_config: dict) -> dict:
    """The DATA_FLAGS of a run's config, with the Hub config it actually reads (None for local data)."""
    from .data import hub_config

    fields = {k: run_config.get(k) for k in DATA_FLAGS}
    fields["dataset_config"] = hub_config(str(fields["dataset"]), fields["dataset_config"])
    fields["dataset"] = dataset_as_launched(fields["dataset"], run_config.get("cwd"))
    return fields


def _as_launched(name: str, cwd: str | None) -> Path:
    """A flag's path as the launch that recorded it meant it: relative to `cwd`, the directory it was launched from,
    where its config records one (else this process's), ~ expanded."""
    path = Path(name).expanduser()
    return Path(cwd) / path if cwd and not path.is_absolute() else path


def local_path(name: str, cwd: str | None) -> Path | None:
    """A flag's local path as its launch meant it (_as_launched), resolved; None where it names nothing here (a Hub
    id, a path gone)."""
    path = _as_launched(name, cwd)
    return path.resolve() if path.exists() else None


def dataset_as_launched(dataset, cwd: str | None):
    """A run's --dataset as the files it named when launched from `cwd` (recorded in its config and run.json): a
    local path (or parquet:PATH) that exists, as its real absolute path, so a path relative to the launch's
    directory, or one through a symlink, reads the same as the resolved one; a relative path gone, or a glob,
    joined to `cwd`; python-docs and Hub names as given."""
    from .data import PARQUET_STREAM, names_local_files

    if not names_local_files(dataset):
        return dataset
    prefix = PARQUET_STREAM if dataset.startswith(PARQUET_STREAM) else ""
    name = dataset[len(prefix) :]
    path = _as_launched(name, cwd)
    if not any(ch in name for ch in "*?[") and path.exists():
        return prefix + str(path.resolve())
    return prefix + str(path) if path != Path(name).expanduser() else dataset  # (joined to cwd, else as given)


def checkpoint_steps(ckpt_root: Path) -> list[tuple[int, Path]]:
    """(step, directory) of every complete checkpoint, oldest first."""
    ckpt_root = Path(ckpt_root)
    if not ckpt_root.is_dir():
        return []
    found = []
    for d in ckpt_root.iterdir():
        m = _STEP_DIR.match(d.name)
        if m and d.is_dir() and (d / STATE_FILE).is_file():
            found.append((int(m.group(1)), d))
    return sorted(found)


def checkpoint_dirs(ckpt_root: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    return [d for _, d in checkpoint_steps(ckpt_root)]


def latest_checkpoint(ckpt_root: Path) -> Path | None:
    dirs = checkpoint_dirs(ckpt_root)
    return dirs[-1] if dirs else None


def resolve_resume(resume: str | None, ckpt_root: Path) -> Path | None:
    """`--resume latest` (None if there is none yet: a fresh start) or a path to one checkpoint."""
    if not resume:
        return None
    if resume == "latest":
        return latest_checkpoint(ckpt_root)
    path = Path(resume)
    if not (path / STATE_FILE).is_file():
        # the checkpoints that do exist, what to pass instead: in the path itself (a run's folder or its
        # checkpoints/), beside it (a mistyped step), or in this run's folder
        found, where = [], None
        for folder in (path / "checkpoints", path, path.parent, ckpt_root):
            found, where = checkpoint_dirs(folder), folder
            if found:
                break
        latest = "; or --resume latest" if found and Path(where).resolve() == Path(ckpt_root).resolve() else ""
        choices = (f" Checkpoints there: {', '.join(str(d) for d in found[-5:])}"
                   f"{f' (and {len(found) - 5} older)' if len(found) > 5 else ''}{latest}.") if found else ""
        what = "is not a complete checkpoint (no " + STATE_FILE + ")" if path.is_dir() else "does not exist"
        raise FileNotFoundError(f"--resume {resume!r} {what}.{choices}")
    return path


def check_output_dir(out_dir: Path, resume: str | None, eval_only: bool = False, max_steps: int | None = None) -> None:
    """A new run (no --resume) refuses a directory that holds another run's output, which it would mix or replace;
    so does `--resume latest` where a finished run left no checkpoint to continue from (it would start again from
    step 0 over that run's final/), unless it asks for no more steps than the run trained (nothing to do: the
    trainer says so). --eval-only writes eval.json only."""
    if eval_only:
        return
    out_dir = Path(out_dir)
    existing = latest_checkpoint(out_dir / "checkpoints")
    if existing is not None:
        if not resume:  # a new run here would mix its checkpoints with the old run's
            raise ValueError(
                f"--output-dir {out_dir} already holds checkpoints of a run (latest: {existing.name}). Pass --resume "
                "latest to continue that run, or a new (or empty) --output-dir to start a new one."
            )
        return
    leftovers = [name for name in RUN_OUTPUTS if (out_dir / name).exists()]
    if leftovers and not resume:  # a run without checkpoints: its metrics and final/ would be mixed or replaced
        raise ValueError(
            f"--output-dir {out_dir} already holds the output of a run ({', '.join(leftovers)}) and no checkpoint. "
            "Pass a new (or empty) --output-dir to start a new run."
        )
    ended = finished_step(out_dir)
    if resume == "latest" and ended is not None and max_steps is not None and ended >= max_steps and "final" in leftovers:
        return  # a job relaunched after its run finished: nothing to train
    if resume == "latest" and {"final", "summary.json"} & set(leftovers):
        # (a run stopped before its first checkpoint, metrics.jsonl alone, starts again: nothing of it was kept)
        raise ValueError(
            f"--resume latest: {out_dir} holds a run that ended without a checkpoint ({', '.join(leftovers)}; "
            "--save-every 0 saves none), so there is nothing to continue from, and training here would start "
            f"again from step 0 over its final/. To train further from its weights: --init-from {out_dir / 'final'} "
            "with a new --output-dir; to start anew: a new --output-dir."
        )


def lock_output_dir(out_dir: Path):
    """Creates `out_dir` and takes its lock for this launch: an open file holding an exclusive flock, released by
    the kernel when the process ends however it ends (no stale lock after a crash or SIGKILL); close it to release
    earlier. A folder another live launch holds is an error naming that launch: two launches in one folder would
    mix their checkpoints and metrics, and a resume would read checkpoints the other is writing (and both write
    heartbeat.json). Main process only."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    handle = open(out_dir / LOCK_FILE, "a+")  # (not "w": truncating would erase the holder's name)
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if not isinstance(e, BlockingIOError):  # (EWOULDBLOCK: held) e.g. ENOLCK, a network filesystem without locks
            handle.close()
            raise OSError(f"cannot lock {out_dir / LOCK_FILE} ({e}): this filesystem may not support file locks, "
                          "which keep two launches out of one --output-dir; use an --output-dir on a local or "
                          "lock-supporting filesystem.") from None
        handle.seek(0)
        holder = handle.read().strip() or "one that has not yet written its name"
        handle.close()
        raise ValueError(
            f"--output-dir {out_dir} is in use by another launch ({holder}): two launches in one folder would mix "
            "their checkpoints and metrics. Wait for that launch to end (or stop it: SIGTERM saves a checkpoint "
            "that --resume latest continues), or pass another --output-dir."
        ) from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    handle.flush()
    return handle


def finished_step(out_dir: Path) -> int | None:
    """The step a finished run ended at, from its summary.json; None where the run has not finished."""
    summary = Path(out_dir) / "summary.json"
    try:
        record = json.loads(summary.read_text()) if summary.is_file() else {}
    except json.JSONDecodeError:
        return None
    return int(record["step"]) if record.get("finished") and record.get("step") is not None else None


@dataclass
class RunCheckpoints:
    """A run's checkpoints under `root`: `save` writes a RunState with the accelerate state (model, optimizer, RNG)
    and `resume` restores both, after checking that the checkpoint belongs to this run's model and data."""

    accelerator: Any
    root: Path
    run_config: dict  # this run's flags (saved; DATA_FLAGS compared on resume)
    model_config: dict  # model_fields of this run's model (saved; compared on resume)
    keep_last: int = 3
    resumed_from: Path | None = None  # the checkpoint `resume` restored, if any

    def holds(self, path: Path | None) -> bool:
        """Whether `path` is one of this run's checkpoints (under `root`), decided from the paths alone, so that
        every process answers alike."""
        return path is not None and path.resolve().parent == self.root.resolve()

    def save(self, run: RunState) -> Path:
        """Every process calls this."""
        trainer_state = run.trainer_state(self.accelerator.num_processes, self.run_config, self.model_config)
        return save_checkpoint(self.accelerator, self.root, run.step, trainer_state, run.data.to_dict(), self.keep_last)

    def resume(self, resume: str | None, started: float, finished_at: int | None = None) -> RunState:
        """`--resume`'s checkpoint restored, or a fresh RunState when there is none (none given, or `latest` in a
        directory without one yet). finished_at: the step the run in this directory finished at (finished_step),
        None if it has not: a finished run without a checkpoint is not news here (the trainer says what it does)."""
        path = resolve_resume(resume, self.root)
        if path is None:
            if resume == "latest" and finished_at is None:
                self.accelerator.print(f"--resume latest: no checkpoint found in {self.root}; training starts from "
                                       "step 0")  # fmt: skip
            return RunState(started=started)
        trainer_state, data_state = load_checkpoint(self.accelerator, path, self.model_config, self.run_config)
        run = RunState.from_checkpoint(trainer_state, data_state, started)
        self.resumed_from = path
        self.accelerator.print(f"resumed from {path} at step {run.step} ({run.tokens_seen:,} tokens)")
        self.set_aside_checkpoints_after(run.step)
        # the schedule the checkpoint's weights trained under last (its config's flags where none was recorded)
        saved = vars(run.schedules[-1]) if run.schedules else trainer_state.get("config", {})
        changed = [k for k in SCHEDULE_FLAGS if k in saved and saved[k] != self.run_config.get(k)]
        # allowed (e.g. raising --max-steps to train further), but the rate jumps: say so, where a step will train
        if changed and run.step < self.run_config["max_steps"]:
            diff = ", ".join(f"--{k.replace('_', '-')} {saved[k]!r} there, {self.run_config.get(k)!r} here"
                             for k in changed)
            self.accelerator.print(f"note: the learning-rate schedule's flags differ from the checkpoint's run ({diff}): "
                                   f"from step {run.step} on, the rate follows this run's schedule, not the one "
                                   "the run began with.")
        return run

    def set_aside_checkpoints_after(self, step: int) -> None:
        """A run resumed from an earlier checkpoint than its latest (a roll-back: --resume PATH) continues from
        `step`: its later checkpoints belong to the abandoned stretch. They move to `abandoned-after-<step>-<time>/`
        beside the others (kept, never deleted), so that --resume latest and --keep-last see only this run's line."""
        later = [d for saved_step, d in checkpoint_steps(self.root) if saved_step > step]
        if later and self.accelerator.is_main_process:
            aside = self.root / f"abandoned-after-{step:08d}-{time.strftime('%Y%m%d-%H%M%S')}"
            aside.mkdir()
            for d in later:
                os.replace(d, aside / d.name)
            self.accelerator.print(f"resumed before the run's latest checkpoint: {', '.join(d.name for d in later)} "
                                   f"moved to {aside} (--resume latest would otherwise continue from them)")
        self.accelerator.wait_for_everyone()


def save_checkpoint(accelerator, ckpt_root: Path, step: int, trainer_state: dict, data_state: dict,
                    keep_last: int = 3) -> Path:  # fmt: skip
    """Every rank calls this. Writes into a temporary directory, then renames it (atomic on one filesystem)."""
    ckpt_root = Path(ckpt_root)
    final = ckpt_root / f"step_{step:08d}"
    tmp = ckpt_root / f".tmp-{final.name}"
    if accelerator.is_main_process:
        ckpt_root.mkdir(parents=True, exist_ok=True)
        for stale in ckpt_root.glob(".tmp-*"):  # left by a run killed mid-write
            shutil.rmtree(stale, ignore_errors=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))  # model, optimizer, RNG states of every rank
    _write_json(tmp / f"data_state_rank{accelerator.process_index}.json", data_state)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        _write_json(tmp / STATE_FILE, trainer_state)  # last file: marks the checkpoint complete
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        for old in checkpoint_dirs(ckpt_root)[:-keep_last] if keep_last > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def check_checkpoint_kind(path: Path, fsdp_now: bool) -> None:
    """accelerate restores a checkpoint only under the kind of launch that wrote it: FSDP saves each rank's shards
    (pytorch_model_fsdp_*, optimizer_*), DDP and one process the whole model (model.safetensors); across the two
    load_state fails on a missing file or deep in torch.distributed.checkpoint. Refused here, naming both ways on."""
    fsdp_then = any(path.glob("pytorch_model_fsdp*"))
    if fsdp_then == fsdp_now:
        return
    kinds = ("FSDP", "DDP or one process")
    then, now = (kinds if fsdp_then else kinds[::-1])
    raise ValueError(
        f"--resume {path}: the checkpoint was written under {then} and this launch runs {now}; accelerate restores "
        f"a checkpoint only under the kind of launch that wrote it. Resume it under {then} (the accelerate config "
        f"it was trained with), or export it there (--resume {path} --max-steps <its step> --output-dir NEW writes "
        "NEW/final/) and start this launch from the export with --init-from NEW/final (weights only: a new "
        "optimizer and data order)."
    )


def load_checkpoint(accelerator, path: Path, model_config: dict | None = None,
                    run_config: dict | None = None) -> tuple[dict, dict]:  # fmt: skip
    """Restores model/optimizer/RNG; returns (trainer_state, this rank's data state).

    With `model_config` (`model_fields` of this run's model), a checkpoint of another model is an error naming the
    differing fields, instead of load_state's size mismatch (checked only if the checkpoint recorded its own).
    With `run_config` (this run's flags), changed DATA_FLAGS are an error naming them: the saved data position
    would point into another token stream. So is another process count under --data-shard docs, where each
    rank's position is in its own share of the documents. Under `rows` every rank holds the same position in the
    one global row stream, so any process count continues it exactly (rank 0's state is used).
    """
    path = Path(path)
    trainer_state = json.loads((path / STATE_FILE).read_text())
    run = trainer_state.get("config", {})
    saved = trainer_state.get("model_config")
    if model_config is not None and saved is not None and saved != model_config:
        diff = ", ".join(f"{k} {saved.get(k)!r} vs {model_config.get(k)!r}"
                         for k in sorted(saved.keys() | model_config.keys()) if saved.get(k) != model_config.get(k))  # fmt: skip
        flags = " ".join(f"--{k.replace('_', '-')} {shlex.quote(str(run[k]))}"
                         for k in (*MODEL_FLAGS, "init_from") if run.get(k))  # an --init-from run's model is its source's
        raise ValueError(
            f"--resume {path}: the checkpoint holds another model than this run builds (checkpoint vs this run: "
            f"{diff}). Resume with the model flags of the run that wrote it ({flags}), or start a new run in a new "
            "--output-dir."
        )
    if run_config is not None and run:
        saved_data, given = data_fields(run), data_fields(run_config)
        changed = [k for k in DATA_FLAGS if saved_data[k] != given[k]]
        if changed:
            diff = ", ".join(f"--{k.replace('_', '-')} {saved_data[k]!r} vs {given[k]!r}" for k in changed)
            raise ValueError(
                f"--resume {path}: the data flags differ from the run that wrote the checkpoint (checkpoint vs this "
                f"run: {diff}), so its saved data position would point into other data. Resume with the "
                "checkpoint's values, or start a new run in a new --output-dir."
            )
    saved_world, world = trainer_state.get("world_size"), accelerator.num_processes
    shard = run.get("data_shard", "docs")
    if saved_world is not None and saved_world != world and shard != "rows":
        raise ValueError(
            f"--resume {path}: the checkpoint was written by {saved_world} process(es) under --data-shard {shard} "
            f"(each process saved its position in its own share of the documents); this run has {world}. Resume "
            f"with {saved_world} process(es)."
        )
    check_checkpoint_kind(path, accelerator.distributed_type == "FSDP")  # (DistributedType is a str enum)
    accelerator.load_state(str(path))
    rank = 0 if shard == "rows" else accelerator.process_index  # rows: the same global position on every rank
    data_file = path / f"data_state_rank{rank}.json"
    if not data_file.is_file():
        raise FileNotFoundError(
            f"{data_file} is missing: the checkpoint was written with {trainer_state.get('world_size')} "
            f"process(es); resume with the same number (this run has {accelerator.num_processes})."
        )
    return trainer_state, json.loads(data_file.read_text())


def export_hf_checkpoint(model, tokenizer, out_dir: Path, state_dict=None) -> Path:
    """`save_pretrained` (weights + remote code + auto_map), tokenizer and generation config, written atomically.
    `state_dict`: the full weights when the model's own are shards (FSDP: `accelerator.get_state_dict`)."""
    from transformers import GenerationConfig

    out_dir = Path(out_dir)
    tmp = out_dir.with_name(f".tmp-{out_dir.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    if state_dict is not None:  # gathered copies: a tied weight (lm_head = the embeddings) no longer shares storage
        own = {name for name, _ in itertools.chain(model.named_parameters(), model.named_buffers())}  # one name each
        state_dict = {name: tensor for name, tensor in state_dict.items() if name in own}
    with _own_class(model):
        model.save_pretrained(tmp, state_dict=state_dict)
    # batched generation pads prompts on the left (a decoder continues from the last position of each row), and
    # padding needs a pad token: the model's (EOS when the tokenizer has none). Training packs rows, never pads.
    tokenizer = copy.deepcopy(tokenizer)  # the run's own tokenizer stays as it was
    tokenizer.padding_side = tokenizer.init_kwargs["padding_side"] = "left"  # init_kwargs: what save_pretrained writes
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.save_pretrained(tmp)
    # no length: a saved max_new_tokens would win over the max_length that callers such as lm-evaluation-harness pass
    # (every generation task would run to that many tokens, whatever its max_gen_toks); pipelines set their own
    GenerationConfig(
        bos_token_id=model.config.bos_token_id,
        eos_token_id=model.config.eos_token_id,
        pad_token_id=model.config.pad_token_id if model.config.pad_token_id is not None else model.config.eos_token_id,
        do_sample=False,
    ).save_pretrained(tmp)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
    return out_dir


@contextlib.contextmanager
def _own_class(model):
    """The model as an instance of its own class while it is saved. fully_shard (FSDP2) gives a module a class made
    in torch, FSDP<Name>: save_pretrained would copy torch's FSDP files into the checkpoint as its code, point
    auto_map at them and leave modeling_nsa.py out, and the checkpoint would load nowhere."""
    from torch.distributed.fsdp import FSDPModule

    sharded_class = type(model)
    if not isinstance(model, FSDPModule):
        yield model
        return
    model.__class__ = next(c for c in sharded_class.__mro__ if not issubclass(c, FSDPModule))  # NSAForCausalLM
    try:
        yield model
    finally:
        model.__class__ = sharded_class


def _write_json(path: Path, obj):
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".part")
    tmp.write_text(json.dumps(obj, indent=2, default=str))
    os.replace(tmp, path)
