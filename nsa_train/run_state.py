"""Where a training run stands: the one record a checkpoint saves, a resume restores, and the summary and the model
card report."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from .data import DataState


@dataclass
class RunState:
    """The run's progress after `step` optimizer steps.

    Saved in a checkpoint: `step`, `tokens_seen`, `skipped_steps`, `val_loss`, `val_ppl`, `val_step` and, for the
    card's quality section, `val_by_position`, the latest evaluation's loss by query position
    (`val_loss_pos<lo>to<hi>`, `nsa_train.evaluation.validation_loss`), and `selection_stats`, the latest selection
    statistics (`nsa_train.selection_stats`) (in trainer_state.json: a resumed or exported run's card reports the
    evaluation the checkpoint's run made last, as it reports its validation loss), and `data`, this process's
    position in its token stream (in data_state_rank<N>.json). Not saved, because they describe this process's own
    stretch of the run: `last_log`, the latest training-log record (loss, tokens/s, MFU, memory; the summary and
    the card quote it), `started`, when this process began (the card's wall time), and `long_context`, the result
    of the end-of-run retrieval evaluation (`--eval-long-context`); empty when not measured.
    """

    step: int = 0
    tokens_seen: int = 0
    skipped_steps: int = 0  # steps that left the weights as they were (--skip-nonfinite; fp16 grad-scaler overflows)
    val_loss: float | None = None  # from the latest evaluation
    val_ppl: float | None = None
    val_step: int | None = None  # the step of that evaluation (a run may stop or export between evaluations)
    data: DataState = field(default_factory=DataState)  # the next token this process reads
    last_log: dict = field(default_factory=dict)
    started: float = field(default_factory=time.time)
    val_by_position: dict = field(default_factory=dict)
    selection_stats: dict = field(default_factory=dict)
    long_context: dict = field(default_factory=dict)

    def advance(self, tokens: int, data: DataState) -> None:
        """One optimizer step done: `tokens` trained on (all processes), the stream read up to `data`."""
        self.step += 1
        self.tokens_seen += tokens
        self.data = data

    def trainer_state(self, world_size: int, run_config: dict, model_config: dict) -> dict:
        """trainer_state.json: the saved progress, with what a resume checks it against (process count, flags,
        model config)."""
        return {"step": self.step, "tokens_seen": self.tokens_seen, "skipped_steps": self.skipped_steps,
                "world_size": world_size, "val_loss": self.val_loss, "val_ppl": self.val_ppl, "val_step": self.val_step,
                "val_by_position": self.val_by_position, "selection_stats": self.selection_stats, "config": run_config,
                "model_config": model_config}  # fmt: skip

    @classmethod
    def from_checkpoint(cls, trainer_state: dict, data_state: dict, started: float) -> RunState:
        """The inverse of `trainer_state` (and the data state saved beside it)."""
        return cls(step=trainer_state["step"], tokens_seen=trainer_state["tokens_seen"],
                   skipped_steps=trainer_state["skipped_steps"], val_loss=trainer_state.get("val_loss"),
                   val_ppl=trainer_state.get("val_ppl"), val_step=trainer_state.get("val_step"),
                   val_by_position=trainer_state.get("val_by_position") or {},
                   selection_stats=trainer_state.get("selection_stats") or {},
                   data=DataState(**data_state), started=started)  # fmt: skip

    def summary(self, **extra) -> dict:
        """summary.json: the latest log record (its training loss, learning rate, speed: as of `logged_step`, which a
        run stopped between logs has passed) with the figures as they are now (not as of that log)."""
        logged = {"logged_step": self.last_log["step"]} if "step" in self.last_log else {}
        return {**self.last_log, **logged, "step": self.step, "tokens_seen": self.tokens_seen,
                "val_loss": self.val_loss, "val_ppl": self.val_ppl, "val_step": self.val_step, **extra}  # fmt: skip
