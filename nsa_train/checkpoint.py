"""Resumable checkpoints (atomic, keep-last) and the exported Hugging Face checkpoint.

Layout under `<output_dir>/checkpoints/`:

    step_00000200/            a complete checkpoint (accelerator.save_state + trainer_state.json + data states)
    .tmp-step_00000300/       being written; renamed to step_00000300 only once every rank has finished

A directory counts as a checkpoint only when its name is `step_<N>` *and* it holds `trainer_state.json`,
which is written last; a run killed mid-write leaves a `.tmp-*` directory that is never picked up (and is
removed by the next save).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

STATE_FILE = "trainer_state.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")


def checkpoint_dirs(ckpt_root: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    ckpt_root = Path(ckpt_root)
    if not ckpt_root.is_dir():
        return []
    found = []
    for d in ckpt_root.iterdir():
        m = _STEP_DIR.match(d.name)
        if m and d.is_dir() and (d / STATE_FILE).is_file():
            found.append((int(m.group(1)), d))
    return [d for _, d in sorted(found)]


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
        raise FileNotFoundError(f"--resume {resume!r} is not a complete checkpoint (no {STATE_FILE}).")
    return path


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


def load_checkpoint(accelerator, path: Path) -> tuple[dict, dict]:
    """Restores model/optimizer/RNG; returns (trainer_state, this rank's data state)."""
    path = Path(path)
    accelerator.load_state(str(path))
    trainer_state = json.loads((path / STATE_FILE).read_text())
    data_file = path / f"data_state_rank{accelerator.process_index}.json"
    if not data_file.is_file():
        raise FileNotFoundError(
            f"{data_file} is missing: the checkpoint was written with {trainer_state.get('world_size')} "
            f"process(es); resume with the same number (this run has {accelerator.num_processes})."
        )
    return trainer_state, json.loads(data_file.read_text())


def export_hf_checkpoint(model, tokenizer, out_dir: Path, max_new_tokens: int = 128) -> Path:
    """`save_pretrained` (weights + remote code + auto_map), tokenizer and generation config, written atomically."""
    from transformers import GenerationConfig

    out_dir = Path(out_dir)
    tmp = out_dir.with_name(f".tmp-{out_dir.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    GenerationConfig(
        bos_token_id=model.config.bos_token_id,
        eos_token_id=model.config.eos_token_id,
        pad_token_id=model.config.pad_token_id if model.config.pad_token_id is not None else model.config.eos_token_id,
        max_new_tokens=max_new_tokens,
        do_sample=False,
    ).save_pretrained(tmp)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
    return out_dir


def _write_json(path: Path, obj):
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".part")
    tmp.write_text(json.dumps(obj, indent=2, default=str))
    os.replace(tmp, path)
