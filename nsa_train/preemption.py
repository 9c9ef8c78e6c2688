"""Stopping a run cleanly: on SIGTERM (preemption, scancel) or a first Ctrl-C (SIGINT) the run finishes its step,
saves a checkpoint and exits with status 0, for --resume latest to continue; a second Ctrl-C stops at once,
without one (KeyboardInterrupt)."""

from __future__ import annotations

import signal
import sys

import torch


class GracefulStop:
    """Records SIGTERM and a first SIGINT instead of dying of them; the loop asks `requested` once per step. Install
    it with the training loop, `stop_listening_for_interrupts` when the loop ends (a Ctrl-C during the export or
    the final evaluation then stops at once, as it does before the loop), and `restore` the previous handlers
    after."""

    def __init__(self):
        self.signal: int | None = None  # the first stop signal this process received
        self.interrupts = 0  # Ctrl-Cs received: the second stops at once
        self.stopped = False  # the loop was told to stop (the same answer on every process)
        self._previous = {signum: signal.signal(signum, self._record) for signum in (signal.SIGTERM, signal.SIGINT)}

    def _record(self, signum, frame) -> None:
        if signum == signal.SIGINT:
            self.interrupts += 1
            if self.interrupts > 1:
                raise KeyboardInterrupt
            print("Ctrl-C: the run saves a checkpoint after this step and exits (--resume latest continues it); "
                  "Ctrl-C again stops now, without one.", file=sys.stderr, flush=True)
        if self.signal is None:
            self.signal = signum

    @property
    def reason(self) -> str:
        """What asked this process to stop, as the log says it."""
        if self.signal == signal.SIGINT:
            return "Ctrl-C (SIGINT)"
        return "SIGTERM" if self.signal == signal.SIGTERM else "a stop signal to another process"

    def requested(self, accelerator) -> bool:
        """Whether any process has received a stop signal (a collective under several processes: all stop together)."""
        received = torch.tensor(float(self.signal is not None), device=accelerator.device)
        if accelerator.num_processes > 1:
            received = accelerator.reduce(received, reduction="sum")
        self.stopped = received.item() > 0
        return self.stopped

    def stop_listening_for_interrupts(self) -> None:
        signal.signal(signal.SIGINT, self._previous[signal.SIGINT])

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
