"""Where a training run stands: the one record a checkpoint saves, a resume restores, and the summary and the model
card report."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from .data import DataState


# the flags lr_at's schedule is laid out with: a resume may change them (from its step on), and says so
SCHEDULE_FLAGS = ("max_steps", "lr", "warmup_steps", "min_lr_ratio")


def lr_at(step: int, schedule) -> float:
    """The learning rate of optimizer step `step` (from 0) under `schedule` (anything with SCHEDULE_FLAGS as
    attributes: the trainer's config): a linear warm-up to lr, then a cosine down to lr * min_lr_ratio at max_steps."""
    if step < schedule.warmup_steps:
        return schedule.lr * (step + 1) / schedule.warmup_steps
    progress = min(1.0, (step - schedule.warmup_steps) / max(1, schedule.max_steps - schedule.warmup_steps))
    return schedule.lr * (schedule.min_lr_ratio + (1 - schedule.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


@dataclass
class Schedule:
    """One learning-rate schedule a run trained under, from step `from_step` on (RunState.schedules)."""

    from_step: int
    max_steps: int
    lr: float
    warmup_steps: int
    min_lr_ratio: float

    @classmethod
    def of(cls, config, from_step: int = 0) -> Schedule:
        """The schedule of a config: an object with SCHEDULE_FLAGS as attributes, or a dict of them."""
        get = config.get if isinstance(config, dict) else lambda name: getattr(config, name)
        return cls(from_step, *(get(name) for name in SCHEDULE_FLAGS))

    def flags(self) -> tuple:
        return tuple(getattr(self, name) for name in SCHEDULE_FLAGS)


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
    of the end-of-run retrieval evaluation (`--eval-long-context`); empty when not measured. Also saved:
    `schedules`, the learning-rate schedules the weights trained under, each from its step on (a resume with other
    --max-steps, --lr, ... starts a new one), which the card describes.
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
    schedules: list[Schedule] = field(default_factory=list)

    def advance(self, tokens: int, data: DataState) -> None:
        """One optimizer step done: `tokens` trained on (all processes), the stream read up to `data`."""
        self.step += 1
        self.tokens_seen += tokens
        self.data = data

    def follow_schedule(self, config) -> None:
        """This launch trains from `step` on under `config`'s schedule: recorded where it is not the one the run
        trained under last (a new run's first; a resume with other schedule flags)."""
        schedule = Schedule.of(config, self.step)
        if self.schedules and self.schedules[-1].from_step == self.step:  # (no step trained under that one)
            self.schedules.pop()
        if not self.schedules or self.schedules[-1].flags() != schedule.flags():
            self.schedules.append(schedule)

    def trainer_state(self, world_size: int, run_config: dict, model_config: dict) -> dict:
        """trainer_state.json: the saved progress, with what a resume checks it against (process count, flags,
        model config)."""
        return {"step": self.step, "tokens_seen": self.tokens_seen, "skipped_steps": self.skipped_steps,
                "world_size": world_size, "val_loss": self.val_loss, "val_ppl": self.val_ppl, "val_step": self.val_step,
                "val_by_position": self.val_by_position, "selection_stats": self.selection_stats,
                "schedules": [vars(schedule) for schedule in self.schedules], "config": run_config,
                "model_config": model_config}  # fmt: skip

    @classmethod
    def from_checkpoint(cls, trainer_state: dict, data_state: dict, started: float) -> RunState:
        """The inverse of `trainer_state` (and the data state saved beside it). A checkpoint written before
        `schedules` was saved gives its own run's flags' schedule, from step 0."""
        saved = trainer_state.get("config", {})
        schedules = [Schedule(**schedule) for schedule in trainer_state.get("schedules") or []]
        if not schedules and all(name in saved for name in SCHEDULE_FLAGS):
            schedules = [Schedule.of(saved)]
        return cls(schedules=schedules, step=trainer_state["step"], tokens_seen=trainer_state["tokens_seen"],
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
