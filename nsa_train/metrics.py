"""FLOPs/MFU, the run record, and the heartbeat + stall watchdog.

FLOPs per trained token (forward + backward = 3 x forward, matmuls only, PaLM/nanoGPT style):

    6 * N  +  12 * L * H * head_dim * K

N is the parameter count (the NSA compressor MLPs run once per d tokens, so they are counted at 1/d), K the
keys one query attends to on average over positions 0..T-1:
- dense-equivalent: what the model's dense twin (`attention_mode="dense"`: NSA's own parameters, the gate
  projection, compressor and extra K/V sets, left out) would execute: its N, K = (T + 1) / 2 (causal attention
  over the full row); an NSA run and its dense twin at the same tokens/s then show the same MFU;
- NSA executed: K = window + selected blocks + compressed tokens, each capped by the causal prefix
  (NSA_SPEC "Cost per query"). At T=2048 NSA executes *more* attention FLOPs than dense; it pays from ~8k on.
MFU = FLOPs/s over the device's peak (bf16 dense tensor-core figure; `--peak-tflops` overrides).
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import platform
import subprocess
import sys
import threading
import time
from importlib import metadata
from pathlib import Path

PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 125.0, "L4": 121.0,
                    "4090": 165.0, "3090": 71.0, "V100": 125.0}  # fmt: skip


def compressor_params(model) -> int:
    return sum(p.numel() for n, p in model.named_parameters() if "compress" in n.lower())


def attention_keys(config, seq_len: int) -> tuple[float, float]:
    """(dense K, NSA K): average keys per query over positions 0..T-1 of a full row."""
    T = seq_len
    dense = (T + 1) / 2
    if config.attention_mode == "dense":
        return dense, dense
    l, d, lp, n, w = (config.cmp_block_size, config.cmp_stride, config.sel_block_size, config.sel_num_blocks,
                      config.window_size)  # fmt: skip
    total = 0.0
    for t in range(T):  # once per run: T iterations of arithmetic
        n_cmp = max(0, (t + 1 - l) // d + 1)
        total += min(t + 1, w) + min(t + 1, n * lp) + n_cmp
    return dense, total / T


def dense_twin_params(model) -> int:
    """The parameter count of the model's dense twin (its config with attention_mode "dense"), built on the meta
    device (no memory, no initialization)."""
    import torch

    cfg = model.config
    if getattr(cfg, "attention_mode", "dense") == "dense":
        return sum(p.numel() for p in model.parameters())
    dense = type(cfg)(**{**cfg.to_dict(), "attention_mode": "dense"})
    with torch.device("meta"):
        twin = type(model)(dense)
    return sum(p.numel() for p in twin.parameters())


def flops_per_token(model, seq_len: int) -> tuple[float, float]:
    """(dense-equivalent, NSA-executed) training FLOPs per token."""
    cfg = model.config
    n_all = sum(p.numel() for p in model.parameters())
    n_cmp = compressor_params(model)
    params = 6 * (n_all - n_cmp) + 6 * n_cmp / cfg.cmp_stride * (cfg.num_key_value_heads if n_cmp else 0)
    attn = 12 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim
    k_dense, k_nsa = attention_keys(cfg, seq_len)
    return 6 * dense_twin_params(model) + attn * k_dense, params + attn * k_nsa


def peak_flops(device, override_tflops: float | None = None) -> float | None:
    if override_tflops:
        return override_tflops * 1e12
    import torch

    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, tflops in PEAK_BF16_TFLOPS.items():
        if key in name:
            return tflops * 1e12
    return None


def weights_digest(model) -> str:
    """sha256 over every parameter's bytes (name order): equal digests = bit-identical weights."""
    import hashlib

    import torch

    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        if hasattr(p, "full_tensor"):  # an FSDP shard (DTensor): the whole tensor, gathered on every process
            p = p.full_tensor()
        h.update(name.encode())
        h.update(p.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def replica_digests(model, accelerator) -> list[str]:
    """Every process's `weights_digest` (a collective under several processes); a warning when they differ."""
    digests = [weights_digest(model)]
    if accelerator.num_processes > 1:
        from accelerate.utils import gather_object

        digests = gather_object(digests)
    if len(set(digests)) > 1:
        accelerator.print(f"WARNING: the {accelerator.num_processes} processes hold different weights: {digests}")
    return digests


def git_sha(repo: Path) -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=repo, capture_output=True, text=True, timeout=10)
        return out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "") if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def package_versions() -> dict[str, str | None]:
    names = ["torch", "transformers", "accelerate", "huggingface-hub", "tokenizers", "safetensors", "triton",
             "datasets", "pyarrow", "tensorboard"]  # fmt: skip
    out = {}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    # torch's own version names its build (2.11.0+cu130, 2.13.0+cpu); pip's metadata may not (PyPI's CUDA wheels)
    import torch

    out["torch"] = torch.__version__
    return out


def device_info(accelerator) -> dict:
    import torch

    info = {"type": accelerator.device.type, "num_processes": accelerator.num_processes,
            "distributed_type": str(accelerator.distributed_type), "mixed_precision": accelerator.mixed_precision,
            "host": platform.node(), "python": sys.version.split()[0], "cpu_count": os.cpu_count()}  # fmt: skip
    if accelerator.device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(accelerator.device)
        info["cuda"] = torch.version.cuda
    return info


def write_run_record(path: Path, config: dict, accelerator, model, extra: dict | None = None,
                     resumed_from: int | None = None):  # fmt: skip
    """run.json: this launch's config, model, code, packages and device at the top level, and `launches`, one entry
    per launch of the run (started, git_sha, argv, cwd: what relative paths in argv were relative to, from_step).
    resumed_from: the step this launch continues from (--resume; 0 when it found no checkpoint), whose record keeps
    the earlier launches; None: a new run."""
    sha, started = git_sha(Path(__file__).resolve().parents[1]), time.strftime("%Y-%m-%dT%H:%M:%S%z")
    earlier = []
    if resumed_from is not None and path.is_file():
        try:
            before = json.loads(path.read_text())
        except json.JSONDecodeError:
            before = {}
        if before.get("launches"):
            earlier = before["launches"]
        elif before:  # a record written before launches were kept: its one launch, step unknown
            earlier = [{"started": before.get("started"), "git_sha": before.get("git_sha"), "argv": before.get("argv"),
                        "from_step": None}]  # fmt: skip
    record = {
        "config": config,
        "model_config": model.config.to_dict(),
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "git_sha": sha,
        "packages": package_versions(),
        "device": device_info(accelerator),
        "started": started,
        "argv": sys.argv,
        **(extra or {}),
        "launches": [*earlier, {"started": started, "git_sha": sha, "argv": sys.argv, "cwd": os.getcwd(),
                                "from_step": resumed_from or 0,
                                "data_sha256": data_digests((extra or {}).get("data_files"))}],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2, default=str))
    return record


def data_digests(data_files: dict | None) -> dict | None:
    """{path: sha256} of run.json's data_files (nsa_train.data.file_fingerprints); None without local files."""
    return None if not data_files else {f["path"]: f["sha256"] for f in data_files["files"]}


def data_change(launches: list[dict]) -> str | None:
    """What differs between the data files the last launch read and those of the launch before it that recorded
    them (run.json's launches): a resumed run that trains on other bytes than it started with (a corpus rebuilt in
    between); None where they agree or either is unknown (streamed data, no record, sizes only)."""
    if not launches or not launches[-1].get("data_sha256"):
        return None
    now = launches[-1]["data_sha256"]
    before = next((launch for launch in reversed(launches[:-1]) if launch.get("data_sha256")), None)
    if before is None:
        return None
    differ = [f"{path}: sha256 {str(before['data_sha256'].get(path))[:12]} then, {str(digest)[:12]} now"
              for path, digest in now.items() if digest and before["data_sha256"].get(path) not in (None, digest)]
    added = sorted(set(now) - set(before["data_sha256"]))
    removed = sorted(set(before["data_sha256"]) - set(now))
    differ += [f"{path}: new since then" for path in added] + [f"{path}: gone since then" for path in removed]
    if not differ:
        return None
    return (f"the data files differ from those of the launch that started at step {before.get('from_step')} "
            f"({'; '.join(differ)}): this launch trains on other bytes than the run read before (a corpus rebuilt "
            "in between?), so it does not continue that run's data exactly.")


class Watchdog:
    """Heartbeat file + stall detector. If `beat()` is not called for `timeout` seconds, every thread's stack is
    dumped (stderr and `stacks_path`) and the process exits with code 3 (never a silent hang)."""

    EXIT_CODE = 3

    def __init__(self, timeout: float, heartbeat_path: Path | None = None, stacks_path: Path | None = None):
        self.timeout = timeout
        self.heartbeat_path, self.stacks_path = heartbeat_path, stacks_path
        self.last = time.monotonic()
        self.info: dict = {}
        self.wrote_heartbeat = False  # this launch's own: a refused one must not end another launch's heartbeat
        self._stop = threading.Event()
        self.thread = None
        if timeout and timeout > 0:
            self.thread = threading.Thread(target=self._watch, name="nsa-watchdog", daemon=True)
            self.thread.start()

    def beat(self, **info):
        self.last = time.monotonic()
        self.info = info
        if self.heartbeat_path is not None:
            tmp = self.heartbeat_path.with_name(self.heartbeat_path.name + ".part")
            tmp.write_text(json.dumps({"time": time.time(), "pid": os.getpid(), **info}))
            os.replace(tmp, self.heartbeat_path)
            self.wrote_heartbeat = True

    def _watch(self):
        while not self._stop.wait(min(1.0, self.timeout / 4)):
            idle = time.monotonic() - self.last
            if idle > self.timeout:
                msg = (f"\n[watchdog] no progress for {idle:.0f}s (> --stall-timeout {self.timeout:g}s); "
                       f"last: {self.info}. Stacks of every thread follow; exiting with code {self.EXIT_CODE}.\n")  # fmt: skip
                sys.stderr.write(msg)
                sys.stderr.flush()
                faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
                if self.stacks_path is not None:
                    self.stacks_path.parent.mkdir(parents=True, exist_ok=True)  # a stall in setup: not made yet
                    with open(self.stacks_path, "w") as fh:
                        fh.write(msg)
                        fh.flush()
                        faulthandler.dump_traceback(file=fh, all_threads=True)
                sys.stderr.flush()
                self._beat_end("stalled", idle_s=round(idle))  # what a monitor reads
                os._exit(self.EXIT_CODE)

    def stop(self):
        """End the watch. The heartbeat file then says the process left ("exited", with the phase it was in and its
        step), unless the run's end already said how ("done", "stopped"): a monitor never reads a run as starting or
        training after its process is gone."""
        self._stop.set()
        if self.info.get("phase") not in ("done", "stopped"):
            self._beat_end("exited")

    def _beat_end(self, phase: str, **extra) -> None:
        """The last heartbeat: how the process ended, with its last step and the phase it was in. Only where this
        process wrote the heartbeat (a launch refused before it claimed its output directory, e.g. one refused by a
        live launch's lock, must leave that launch's heartbeat alone), and never raising: this runs while the
        launch's own error propagates, or just before the watchdog ends the process."""
        if self.heartbeat_path is not None and self.wrote_heartbeat:
            last = {"step": self.info["step"]} if "step" in self.info else {}
            with contextlib.suppress(OSError):
                self.beat(**last, phase=phase, after=self.info.get("phase"), **extra)
