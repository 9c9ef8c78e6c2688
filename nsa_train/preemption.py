"""SIGTERM (preemption, scancel): the run finishes its step, saves a checkpoint and exits with status 0."""

from __future__ import annotations

import signal

import torch


class SigtermStop:
    """Records a SIGTERM instead of dying of it; the loop asks `requested` once per step. Install it with the
    training loop and `restore` the previous handler after."""

    def __init__(self):
        self.signal: int | None = None
        self.stopped = False  # the loop was told to stop (the same answer on every process)
        self._previous = signal.signal(signal.SIGTERM, self._record)

    def _record(self, signum, frame) -> None:
        self.signal = signum

    def requested(self, accelerator) -> bool:
        """Whether any process has received SIGTERM (a collective under several processes: all stop together)."""
        received = torch.tensor(float(self.signal is not None), device=accelerator.device)
        if accelerator.num_processes > 1:
            received = accelerator.reduce(received, reduction="sum")
        self.stopped = received.item() > 0
        return self.stopped

    def restore(self) -> None:
        signal.signal(signal.SIGTERM, self._previous)
