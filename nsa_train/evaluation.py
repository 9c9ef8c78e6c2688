"""Evaluation during training: the metrics of one evaluation, as a dict that the step log writes whole.

Metric names are `<group>_<name>` (`val_loss`): metrics.jsonl keeps the name, the trackers get `<group>/<name>`
(`val/loss`). A new measurement taken at each evaluation joins the dict that `evaluate` returns.
"""

from __future__ import annotations

import math

import torch

from .data import num_label_tokens, to_batch
from .run_state import RunState


@torch.no_grad()
def validation_loss(model, rows, micro_batch_size: int, accelerator) -> dict[str, float]:
    """`val_loss`, the mean loss over the label tokens of every process's share of the held-out rows, and its
    perplexity `val_ppl`. Every process calls this (the sums are all-reduced)."""
    model.eval()
    sums = torch.zeros(2, dtype=torch.float64, device=accelerator.device)  # (loss sum, label tokens)
    mine = rows[accelerator.process_index :: accelerator.num_processes]
    for i in range(0, len(mine), micro_batch_size):
        batch = to_batch(mine[i : i + micro_batch_size], accelerator.device)
        n = num_label_tokens(batch["labels"])
        with accelerator.autocast():
            loss = model(**batch, num_items_in_batch=n).loss
        sums += torch.stack([loss.double() * n, n.double()])
    sums = accelerator.reduce(sums, reduction="sum")
    model.train()
    val_loss = (sums[0] / sums[1].clamp(min=1)).item()
    return {"val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 50.0))}


def evaluate(model, run: RunState, val_rows, micro_batch_size: int, accelerator) -> dict[str, float]:
    """The evaluation of the (unwrapped) model at `run.step`: every metric to log. The validation loss is also
    recorded in `run`, which checkpoints, the summary and the model card carry."""
    metrics = validation_loss(model, val_rows, micro_batch_size, accelerator)
    run.val_loss, run.val_ppl = metrics["val_loss"], metrics["val_ppl"]
    return metrics
