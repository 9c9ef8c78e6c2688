"""Evaluation during training: the metrics of one evaluation, as a dict that the step log writes whole.

Metric names are `<group>_<name>` (`val_loss`): metrics.jsonl keeps the name, the trackers get `<group>/<name>`
(`val/loss`). A new measurement taken at each evaluation joins the dict that `evaluate` returns.

Every function here runs on every process: under FSDP each forward gathers the weight shards from all of them,
so a forward on one process alone would wait forever. The main process writes the files.
"""

from __future__ import annotations

import contextlib
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from .data import streams_from_hub, to_batch
from .run_state import RunState

STATS_ROWS = 2  # held-out rows the selection statistics are measured on: whole rows where the layers run the kernels,
# cut to selection_stats.REFERENCE_MAX_LEN tokens where they run the reference (its masks are T x T)


class OneProcess:
    """What `validation_loss` uses of the Accelerator, for a script that evaluates in one process on one device."""

    process_index, num_processes = 0, 1
    autocast = staticmethod(contextlib.nullcontext)
    reduce = staticmethod(lambda tensor, reduction: tensor)

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)


def position_buckets(window_size: int | None, seq_len: int) -> list[tuple[int, int]]:
    """The ranges [lo, hi) of query positions (tokens before the query in its document's fragment of the row: the
    context it predicts from, less itself) that the validation loss is also reported over: [0, w), then doubling
    ranges [w, 2w), [2w, 4w), ... up to `seq_len` (w: NSA's sliding window). A query in [0, w) sees its whole
    context through the window branch; beyond it, what lies further back reaches NSA only through the compressed
    and selected branches, and dense attention sees all of it. Empty where the window holds a whole row. A last
    range shorter than half the one before it joins that one (window 64, 1,025 tokens: [512, 1025), not a range
    of one position), unless the one before is the window's."""
    if not window_size or window_size >= seq_len:
        return []
    edges, edge = [0], window_size
    while edge < seq_len:
        edges.append(edge)
        edge *= 2
    if len(edges) >= 3 and seq_len - edges[-1] < (edges[-1] - edges[-2]) / 2:  # (two edges: the window, never joined)
        edges.pop()
    edges.append(seq_len)
    return list(zip(edges[:-1], edges[1:]))


def position_metric(lo: int, hi: int) -> str:
    """The metric name of the validation loss over query positions [lo, hi): `val_loss_pos<lo>to<hi>`."""
    return f"val_loss_pos{lo}to{hi}"


POSITION_METRIC = re.compile(r"val_loss_pos(\d+)to(\d+)$")


def position_losses(metrics: dict[str, float]) -> list[tuple[int, int, float]]:
    """The `val_loss_pos<lo>to<hi>` entries of a metrics dict as (lo, hi, loss), in position order."""
    return sorted((int(m[1]), int(m[2]), v) for k, v in metrics.items() if (m := POSITION_METRIC.match(k)))


@torch.no_grad()
def validation_loss(model, rows, micro_batch_size: int, accelerator) -> dict[str, float]:
    """`val_loss`, the mean loss over the label tokens of every process's share of the held-out rows, and its
    perplexity `val_ppl`; and the mean loss over the label tokens predicted from each range of positions of
    `position_buckets` (the model config's `window_size`, the rows' length), `val_loss_pos<lo>to<hi>`: where in the
    context a model gains or loses (a range without label tokens is left out). Every process calls this (the sums
    are all-reduced)."""
    model.eval()
    seq_len = len(rows[0][0]) if rows else 0
    buckets = position_buckets(getattr(model.config, "window_size", None), seq_len)
    inner_edges = torch.tensor([hi for _, hi in buckets[:-1]], device=accelerator.device)
    # row 0: loss sums, row 1: label tokens; column 0: every position, then one column per bucket
    sums = torch.zeros(2, 1 + len(buckets), dtype=torch.float64, device=accelerator.device)
    mine = rows[accelerator.process_index :: accelerator.num_processes]
    # every process runs the same number of forwards (under FSDP each is a collective): a process whose share
    # ends a batch early runs a row whose labels are all -100, which adds nothing to the sums
    per_process = math.ceil(len(rows) / accelerator.num_processes)
    filler = [(rows[0][0], rows[0][1], [-100] * seq_len)] if rows else []
    for i in range(0, per_process, micro_batch_size):
        batch = to_batch(mine[i : i + micro_batch_size] or filler, accelerator.device)
        labels = batch.pop("labels")
        with accelerator.autocast():
            logits = model(**batch).logits  # (B, T, V)
        # the model's loss_function token by token (transformers' ForCausalLMLoss: the prediction at t of the label
        # at t + 1, -100 none, in fp32 as its upcast); val_loss and the ranges sum the same token losses
        targets = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100)  # (B, T)
        token_loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten(),
                                                       ignore_index=-100, reduction="none")  # (B * T,)
        has_label = (targets.flatten() != -100).double()
        sums[0, 0] += token_loss.double().sum()
        sums[1, 0] += has_label.sum()
        if buckets:
            bucket = torch.bucketize(batch["position_ids"].flatten(), inner_edges, right=True)  # (B * T,)
            sums[0, 1:].index_add_(0, bucket, token_loss.double())
            sums[1, 1:].index_add_(0, bucket, has_label)
        del logits, token_loss  # (not held through the next micro-batch's forward)
    sums = accelerator.reduce(sums, reduction="sum")
    model.train()
    val_loss = (sums[0, 0] / sums[1, 0].clamp(min=1)).item()
    metrics = {"val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 50.0))}
    for (lo, hi), loss_sum, count in zip(buckets, sums[0, 1:].tolist(), sums[1, 1:].tolist()):
        if count > 0:
            metrics[position_metric(lo, hi)] = loss_sum / count
    return metrics


def selection_statistics(model, run: RunState, rows, accelerator, stats_file: Path) -> dict[str, float]:
    """NSA's gate and selection statistics (`nsa_train.selection_stats`, per layer) on the first STATS_ROWS
    held-out rows, the same rows on every process and at every step (so the figures of two steps compare). The
    whole record is appended to `stats_file` (main process) and kept as `run.selection_stats` for the model card;
    returned as flat `stats_*` metrics."""
    from .selection_stats import append_stats_jsonl, compute_selection_stats, flatten_stats

    batch = to_batch(rows[:STATS_ROWS], accelerator.device)
    with accelerator.autocast():  # the precision the model trains in
        stats = compute_selection_stats(model, batch, max_rows=STATS_ROWS)
    if accelerator.is_main_process:
        append_stats_jsonl(stats_file, run.step, stats)
    run.selection_stats = stats
    return flatten_stats(stats)


def evaluate(model, run: RunState, val_rows, micro_batch_size: int, accelerator, *, loss: bool = True,
             stats_file: Path | None = None) -> dict[str, float]:  # fmt: skip
    """The evaluation of the (unwrapped) model at `run.step`: every metric to log. The validation loss (`loss`) is
    also recorded in `run`, which checkpoints, the summary and the model card carry; with `stats_file`, the
    selection statistics join the metrics."""
    metrics = validation_loss(model, val_rows, micro_batch_size, accelerator) if loss else {}
    if loss:
        run.val_loss, run.val_ppl, run.val_step = metrics["val_loss"], metrics["val_ppl"], run.step
        run.val_by_position = {k: v for k, v in metrics.items() if POSITION_METRIC.match(k)}
    if stats_file is not None:
        metrics |= selection_statistics(model, run, val_rows, accelerator, stats_file)
    return metrics


@dataclass
class EvalSchedule:
    """When the trainer evaluates: the validation loss every `eval_every` steps, the selection statistics every
    `stats_every` steps (-1: at every validation loss), each also at step 0 and at `last_step` (0: never).
    `stats_file` is where the statistics go."""

    eval_every: int
    stats_every: int
    last_step: int
    stats_file: Path

    def _every(self, step: int, every: int) -> bool:
        return every > 0 and (step % every == 0 or step == self.last_step)

    def loss_due(self, step: int) -> bool:
        return self._every(step, self.eval_every)

    def stats_due(self, step: int) -> bool:
        return self.loss_due(step) if self.stats_every == -1 else self._every(step, self.stats_every)

    def due(self, step: int) -> bool:
        return self.loss_due(step) or self.stats_due(step)

    def what(self, step: int) -> dict:
        """`evaluate`'s keyword arguments at `step`."""
        return {"loss": self.loss_due(step), "stats_file": self.stats_file if self.stats_due(step) else None}


LONG_CONTEXT_LENGTH_FACTORS = (1, 2, 4)  # --long-context-lengths default: these multiples of --seq-len
LONG_CONTEXT_BATCH_SIZE = 4  # prompts per generate() call


def long_context_settings(cfg, tokenizer, vocab_size: int | None, say=print) -> dict:
    """`run_long_context_eval`'s keyword arguments for `--eval-long-context`, checked at the start of the run: a
    length too short for the task's fixed text, or a tokenizer the task cannot use, fails before the first step,
    not after the last. Cases of every length, depth and sample are built here, as the evaluation builds them (a
    default length alone: the needle's haystack pool is then sized for that length, so its draws differ from the
    final ones, but what can fail, the fixed text and the tokenizer, does not). Lengths default to --seq-len times
    LONG_CONTEXT_LENGTH_FACTORS (beyond 1: extrapolation), less the multiples too short for the task's fixed text
    (said with `say`: the smoke preset's 128 tokens cannot hold the passkey task's 223); given lengths are all kept
    or refused. The needle task hides its sentence in the run's own documents; for a streamed Hub dataset, in the
    shared wiki parquet when present, else in Python's documentation (offline)."""
    from . import long_context

    haystack = long_context.default_haystack() if streams_from_hub(cfg.dataset) else cfg.dataset
    settings = dict(task=cfg.long_context_task, depths=list(cfg.long_context_depths), samples=cfg.long_context_samples,
                    batch_size=LONG_CONTEXT_BATCH_SIZE, training_len=cfg.seq_len,
                    training_len_source="the run's --seq-len", haystack=haystack,
                    text_column=cfg.text_column)  # fmt: skip

    def error_of(lengths: list[int]) -> ValueError | None:
        """Why the cases of those lengths cannot be built (as run_long_context_eval builds them), in the trainer's
        flag names, or None."""
        try:
            long_context.build_cases(tokenizer, settings["task"], lengths, settings["depths"], settings["samples"],
                                     haystack=haystack, text_column=cfg.text_column, vocab_size=vocab_size,
                                     length_flag="--long-context-lengths")  # fmt: skip
        except ValueError as e:
            return e
        return None

    if cfg.long_context_lengths:
        settings["lengths"] = sorted(cfg.long_context_lengths)
        if error := error_of(settings["lengths"]):
            raise ValueError(f"--eval-long-context: {error}")
        return settings
    defaults = sorted(cfg.seq_len * f for f in LONG_CONTEXT_LENGTH_FACTORS)
    # the longest must fit: else every one is too short, or the tokenizer cannot serve the task
    if error := error_of(defaults[-1:]):
        raise ValueError(f"--eval-long-context (--long-context-lengths not given: --seq-len {cfg.seq_len} x "
                         f"{' '.join(map(str, LONG_CONTEXT_LENGTH_FACTORS))}): {error}")  # fmt: skip
    skipped = {length: error for length in defaults[:-1] if (error := error_of([length]))}
    if other := [e for e in skipped.values() if not isinstance(e, long_context.CaseTooShortError)]:
        raise ValueError(f"--eval-long-context: {other[0]}")  # not a length's fault: the longest would have failed too
    settings["lengths"] = [length for length in defaults if length not in skipped]
    for length, error in skipped.items():  # a note, not an error: the run goes on at the other default lengths
        say(f"note: --eval-long-context skips its default length {length} (--seq-len x {length // cfg.seq_len}), "
            f"{error.reason}; it evaluates {' '.join(map(str, settings['lengths']))} (--long-context-lengths sets "
            f"the lengths)")  # fmt: skip
    return settings


def evaluate_long_context(model, tokenizer, run: RunState, settings: dict, out_dir: Path, accelerator,
                          model_name: str | None = None) -> dict:
    """Long-context retrieval of the (unwrapped) model (`nsa_train.long_context`; `settings` from
    `long_context_settings`). Under DDP the processes split the cases (each holds the whole model; the results
    are gathered); under FSDP (and DeepSpeed) every process evaluates every case (each forward gathers the shards from all of
    them; generate() keeps the processes in step: transformers' synced_gpus). The main process writes
    `out_dir`/<task>_<scoring>.json and .png (titled `model_name`, default the run's final/) and prints the
    table. The result is kept as `run.long_context` for the model card (the haystack named without local paths);
    returned as metrics: the mean accuracy over every cell, `longctx_accuracy`, and each length's,
    `longctx_len<N>_accuracy`; scored by generate, `longctx_ended_inside_answer` and `longctx_right_but_last_token`,
    the mean shares of answers that stopped after their right start and of those right in every token but perhaps
    the last (`long_context.ending_summary`), and each length's (`longctx_len<N>_...`); for an NSA model also
    `longctx_needle_selected`, the mean over the cells of how often the last prompt token's selection held the
    answer's block (`long_context.needle_selection`)."""
    from . import data, long_context
    from .model_card import data_description

    from accelerate.utils import gather_object

    main = accelerator.is_main_process
    # data-parallel copies of the whole model (DDP: MULTI_GPU, MULTI_CPU, ...) split the cases; FSDP, DeepSpeed
    # and the rest shard the model, so every forward needs every process
    split = accelerator.num_processes > 1 and accelerator.distributed_type.name.startswith("MULTI_")
    shard = dict(shard=(accelerator.process_index, accelerator.num_processes), gather=gather_object) if split else {}
    result = long_context.run_long_context_eval(model, tokenizer, **settings, out_dir=out_dir if main else None,
                                                model_name=model_name or str(out_dir.parent / "final"),
                                                log=accelerator.print, **shard)  # fmt: skip
    run.long_context = result
    if result["task"] == "needle":  # the card may be pushed: the haystack's file names, not its paths
        haystack = data.make_source(settings["haystack"], settings["text_column"])
        run.long_context = {**result, "haystack": data_description(haystack)}
    per_length = {f"longctx_len{n}_accuracy": sum(row) / len(row)
                  for n, row in zip(result["lengths"], result["accuracy"])}  # fmt: skip
    logged = {"longctx_accuracy": sum(per_length.values()) / len(per_length), **per_length}
    if result.get("needle_selected"):  # NSA: how often the last prompt token's selection held the answer's block
        rates = [rate for row in result["needle_selected"] for rate in row]
        logged["longctx_needle_selected"] = sum(rates) / len(rates)
    # generate: the answers that failed on their last token alone (scored wrong; long_context.ending_summary), per
    # length too: they gather at the length one token longer than a training row
    for key in ("ended_inside_answer", "right_but_last_token"):
        if result.get(key):
            shares = {f"longctx_len{n}_{key}": sum(row) / len(row) for n, row in zip(result["lengths"], result[key])}
            logged |= {f"longctx_{key}": sum(shares.values()) / len(shares), **shares}
    return logged
