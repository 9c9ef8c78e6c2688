"""Shared helpers for tests/test_train_*.py: the shared data, tiny-run arguments, in-process and CLI runs."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
PARQUET = SHARED / "wiki-summaries-en.parquet"
GPT2 = SHARED / "gpt2-tokenizer"
needs_shared = pytest.mark.skipif(
    not (PARQUET.is_file() and GPT2.is_dir()),
    reason=f"shared test data not found at {SHARED} (wiki-summaries-en.parquet, gpt2-tokenizer/)",
)


def tiny_args(out_dir, **overrides) -> list[str]:
    """A tiny NSA model on the wiki parquet with the GPT-2 tokenizer: fp32, deterministic, a few steps."""
    args = {
        "dataset": PARQUET, "tokenizer": GPT2, "model": "tiny", "seq_len": 64, "micro_batch_size": 4,
        "grad_accum": 1, "max_steps": 3, "lr": 3e-3, "warmup_steps": 2, "log_every": 1, "eval_every": 0,
        "save_every": 0, "report_to": "none", "mixed_precision": "no", "output_dir": out_dir,
        "val_tokens": 1024, "val_every_doc": 50, "shuffle_buffer": 64, "stall_timeout": 900, "seed": 1234,
    }  # fmt: skip
    args.update(overrides)
    out = []
    for k, v in args.items():
        if v is None:
            continue
        out += [f"--{k.replace('_', '-')}", str(v)]
    return out


def run_main(argv: list[str]) -> dict:
    """Run the trainer in this process (fresh accelerate state each time)."""
    from accelerate.state import AcceleratorState, GradientState

    import train_accelerate

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    try:
        return train_accelerate.main(train_accelerate.parse_args(argv))
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


def run_cli(args: list[str], *, launcher: list[str] | None = None, env: dict | None = None, timeout: float = 600,
            check: bool = True) -> subprocess.CompletedProcess:  # fmt: skip
    cmd = (launcher or [sys.executable]) + [str(REPO / "train_accelerate.py"), *args]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    proc = subprocess.run(cmd, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{cmd} exited {proc.returncode}\nSTDOUT:\n{proc.stdout[-4000:]}\nSTDERR:\n{proc.stderr[-6000:]}")
    return proc


def accelerate_2proc() -> list[str]:
    """Real 2-process DDP on CPU (gloo). `--cpu --num_processes 2` would silently run one process."""
    return [str(Path(sys.executable).with_name("accelerate")), "launch", "--config_file",
            str(REPO / "accelerate_configs" / "cpu_2proc.yaml"), "--main_process_port", str(free_port())]  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_losses(out_dir, key: str = "loss") -> dict[int, float]:
    """Per-step training figures from metrics.jsonl: the loss, or key="grad_norm" (the all-reduced gradient norm)."""
    rows = [json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r[key] for r in rows if key in r}


def val_losses(out_dir) -> dict[int, float]:
    rows = [json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["val_loss"] for r in rows if "val_loss" in r}


def final_state(out_dir) -> dict:
    from safetensors.torch import load_file

    return load_file(str(Path(out_dir) / "final" / "model.safetensors"))


def assert_same_weights(a: dict, b: dict, atol: float = 0.0, rtol: float = 0.0):
    import torch

    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=atol, rtol=rtol, msg=lambda m, k=k: f"{k}: {m}")
