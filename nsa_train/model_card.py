"""Render `model_cards/nsa_model_card.md` (a `string.Template`: `${name}` fields) for an exported checkpoint. The
card may be pushed to the Hub, so it holds no local paths."""

from __future__ import annotations

import json
import time
from importlib import resources
from pathlib import Path
from string import Template

from .run_state import Schedule, lr_at


def _templates():
    """model_cards/ beside the package in a checkout; installed from a wheel it is nsa_train/model_cards/."""
    checkout = Path(__file__).resolve().parents[1] / "model_cards"
    return checkout if checkout.is_dir() else resources.files(f"{__package__}.model_cards")


TEMPLATE = _templates() / "nsa_model_card.md"


def without_local_path(name_or_path: str) -> str:
    """A Hub id as it is; a local file or directory by its name alone (the card may be pushed)."""
    return Path(name_or_path).name if Path(name_or_path).exists() else name_or_path


def model_source(init_from: str) -> str:
    """--init-from as the card names it: a Hub id as it is; a run's final/ as `<run>/final` (its name alone would
    read `final` for every run); another local directory by its name."""
    path = Path(init_from)
    if not path.exists():
        return init_from
    return f"{path.parent.name}/{path.name}" if path.name == "final" else path.name


def human(n: float) -> str:
    for unit, div in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.1f}{unit}"
    return f"{n:g}"


# accelerate's mixed_precision value -> what a card reader understands ("Precision: no" said nothing)
PRECISION_WORDS = {"no": "float32 (no mixed precision)", "bf16": "bf16 autocast, float32 weights",
                   "fp16": "fp16 autocast, float32 weights"}  # fmt: skip


def run_card_fields(cfg, config, run, *, n_params, world, mixed_precision, device, data_description, out_dir) -> dict:
    """Every `${field}` of the template, from the run's config (TrainConfig), the model config, where the run stands
    (a RunState) and the run's other figures."""
    from . import data, metrics

    last, val_loss, val_ppl = run.last_log, run.val_loss, run.val_ppl

    versions = metrics.package_versions()
    dataset_id = data.FINEWEB_EDU if cfg.dataset == "fineweb-edu" else cfg.dataset.removeprefix("hf://")
    on_hub = data.streams_from_hub(cfg.dataset)
    tokens_per_step = cfg.micro_batch_size * cfg.grad_accum * world * cfg.seq_len
    source = model_source(cfg.init_from) if getattr(cfg, "init_from", None) else None  # (--init-from's model)
    schedules = run.schedules or [Schedule.of(cfg)]  # (a run that trained no step: its flags')
    return {
        "model_name": Path(cfg.push_to_hub or Path(out_dir).name).name,
        "repo_or_path": cfg.push_to_hub or "path/to/checkpoint",
        "datasets_yaml": f"datasets:\n- {dataset_id}\n" if on_hub else "",
        "attention_mode": config.attention_mode,
        "steps": run.step, "tokens_seen": f"{run.tokens_seen:,}",
        "val_loss": None if val_loss is None else f"{val_loss:.4f}",
        "val_ppl": None if val_ppl is None else f"{val_ppl:.2f}",
        "val_step": "-" if run.val_step is None else run.val_step,
        "tokens_per_s": f"{last['tok_s']:,.0f}" if last.get("tok_s") else None,
        "mfu": f"{last['mfu_dense']:.1%} / {last['mfu_nsa']:.1%}" if last.get("mfu_dense") is not None else None,
        "peak_mem": f"{last['peak_mem_gb']:.2f} GB" if last.get("peak_mem_gb") else None,
        "wall_time": f"{(time.time() - run.started) / 60:.1f} min",
        "quality": quality_section(run, config.attention_mode),
        **{k: getattr(config, k) for k in (
            "num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
            "head_dim", "vocab_size")},
        "attention_structure": attention_structure(config),
        "tokenizer": without_local_path(cfg.tokenizer),
        "init_description": init_description(config, source),
        "model_description": model_description(config, human(n_params)),
        "tokens_trained": f"{run.tokens_seen:,} tokens" + (f" after the training of `{source}`" if source else ""),
        "schedule": schedule_words(schedules, run.step),
        "data_description": data_description, "seq_len": cfg.seq_len,
        "doc_masking": "documents packed with EOS between them, attention across documents (GPT-2 style)"
        if cfg.cross_doc_attention else "documents packed with EOS between them and never attended across",
        "global_batch": cfg.micro_batch_size * cfg.grad_accum * world, "micro_batch_size": cfg.micro_batch_size,
        "grad_accum": cfg.grad_accum, "num_processes": world, "tokens_per_step": f"{tokens_per_step:,}",
        "lr": schedules[0].lr, "betas": f"({cfg.beta1}, {cfg.beta2})", "weight_decay": cfg.weight_decay,
        "warmup_steps": schedules[0].warmup_steps, "grad_clip": cfg.grad_clip,
        "mixed_precision": PRECISION_WORDS.get(mixed_precision, mixed_precision),
        "device": device, "git_sha": code_versions(out_dir, metrics.git_sha(Path(__file__).resolve().parents[1])),
        "torch_version": versions["torch"], "transformers_version": versions["transformers"],
        "accelerate_version": versions["accelerate"],
    }  # fmt: skip


def code_versions(out_dir, current: str | None) -> str:
    """The card's commit: this launch's and, for a resumed run whose earlier launches ran other code (run.json's
    launches), theirs with the step each started from."""
    try:
        launches = json.loads((Path(out_dir) / "run.json").read_text()).get("launches", [])
    except (OSError, json.JSONDecodeError):
        launches = []
    earlier = [launch for launch in launches[:-1] if launch.get("git_sha") != current]
    if not earlier:
        return str(current)
    said = ", ".join(f"{launch.get('git_sha') or 'unknown'} from step "
                     f"{'?' if launch.get('from_step') is None else launch['from_step']}" for launch in earlier)  # fmt: skip
    return f"{current} (the launch that wrote this card; the run was resumed, and earlier launches ran {said})"


def schedule_words(schedules: list[Schedule], step: int) -> str:
    """What follows "lr L, W warm-up steps," in the card's optimizer line (run_state.lr_at's schedule): the first
    schedule's decay, then each one a resume switched to (other --max-steps, --lr, ...) from its step on; a
    schedule the run left before its end (a resume's switch, or a run stopped or exported early) with the step it
    was left at and the rate of that step."""
    words = []
    for i, schedule in enumerate(schedules):
        left_at = schedules[i + 1].from_step if i + 1 < len(schedules) else step
        decay = _decay_words(schedule, left_at)
        words.append(decay if i == 0 else f"from step {schedule.from_step:,} (resumed with other schedule flags) lr "
                                          f"{schedule.lr:g}, {schedule.warmup_steps:,} warm-up steps, {decay}")
    return "; ".join(words)


def _decay_words(schedule: Schedule, left_at: int) -> str:
    """A schedule's cosine decay (or, for one shorter than its warm-up, that it never left it), with where the run
    left it when that was before its end."""
    took = min(left_at, schedule.max_steps)
    if schedule.warmup_steps >= schedule.max_steps:  # (step s trains at lr * (s + 1) / warmup)
        return (f"of which the run took {took:,}: it ended inside the warm-up at lr {lr_at(took - 1, schedule):.3g}, "
                "with no cosine decay")
    words = f"then cosine decay to {schedule.lr * schedule.min_lr_ratio:.3g} at step {schedule.max_steps:,}"
    if 0 < left_at < schedule.max_steps:
        words += f", of which the run took {left_at:,} (its last step at lr {lr_at(left_at - 1, schedule):.3g})"
    return words


def init_description(config, source: str | None) -> str:
    """Where the weights started: `source` (--init-from's model), else at random; a dense-mode run's random start
    is its NSA twin's (the trainer copies every shared parameter from the NSA model of the same seed)."""
    if source:
        return f"initialized from `{source}` (its own training is not counted in this card's steps and tokens)"
    if config.attention_mode == "nsa":
        return "initialized at random"
    return ("initialized at random, from the weights of the NSA model of the same seed (every shared parameter "
            "copied: the dense twin of an A/B comparison)")


def model_description(config, parameters: str) -> str:
    """The card's first sentence: an NSA model, or a dense-mode one (the baseline NSA models are compared with)."""
    paper = "(Yuan et al., 2025, arXiv:2502.11089)"
    if config.attention_mode == "nsa":
        return f"A {parameters}-parameter decoder with **Native Sparse Attention** {paper}"
    return (f"A {parameters}-parameter decoder in the dense mode of this project's NSA model {paper}: full causal "
            "attention in place of NSA's three branches, the baseline that NSA models are compared with")


def attention_structure(config) -> str:
    """The card's attention row: NSA's block sizes, selection count, window and compressor, or, for a dense-mode
    checkpoint, that those fields of its config are not used (they are kept so the dense twin's config loads the
    same)."""
    if config.attention_mode != "nsa":
        return ("dense: causal attention over every earlier token of the document (the config's NSA fields are kept "
                "but not used)")
    kv_sets = {True: "one per branch", False: "one shared by the branches"}.get(
        config.kv_per_branch, f"`{config.kv_per_branch}`'s own, one shared by the other two")
    return (f"NSA: compression block l = {config.cmp_block_size}, stride d = {config.cmp_stride}; selection block "
            f"l' = {config.sel_block_size}, n = {config.sel_num_blocks} selected; window {config.window_size}; "
            f"compressor `{config.compressor}`; K/V sets: {kv_sets}")


def quality_section(run, attention_mode: str) -> str:
    """The card's quality figures: the latest evaluation's loss by query position, the end-of-run long-context
    retrieval evaluation and the latest selection and gate statistics, each where the run measured it."""
    from . import long_context, selection_stats

    parts = [position_section(run.val_by_position, run.val_step)] if run.val_by_position else []
    parts += [long_context.card_section(run.long_context) if run.long_context else
             "Long-context retrieval: not measured by the training run (its `--eval-long-context` puts the table "
             "here). `python -m nsa_train.long_context` measures this checkpoint and writes its own table and heatmap; "
             "this card stays as the run wrote it."]  # fmt: skip
    if attention_mode != "nsa":
        parts.append("Selection and gate statistics: none, the model uses dense attention.")
    elif run.selection_stats:
        parts.append(selection_stats.card_section(run.selection_stats))
    else:
        parts.append("Selection and gate statistics: not measured in this run (`--stats-every`).")
    return "\n\n".join(part.strip() for part in parts)


def position_section(by_position: dict[str, float], step: int | None) -> str:
    """Markdown: the validation loss by the query's position (`val_loss_pos<lo>to<hi>` metrics, in position order)."""
    from .evaluation import position_losses

    rows = "\n".join(f"| {lo:,}-{hi - 1:,} | {loss:.4f} |" for lo, hi, loss in position_losses(by_position))
    return (f"Validation loss by the query's position in its document (tokens before it; at step {step}): the first "
            "range lies inside NSA's sliding window; beyond it the far context reaches NSA only through its "
            f"compressed and selected branches.\n\n| positions | loss |\n|---|---|\n{rows}")


def data_description(source) -> str:
    """`source.describe()` without local paths: local files by their file names."""
    from .data import LocalFiles, file_names

    if not isinstance(source, LocalFiles):
        return source.describe()
    return f"local files {file_names(source.files)} (column {source.text_column!r})"


def render(fields: dict, template=TEMPLATE) -> str:
    """Every `${name}` in the template must be given: a missing figure is an error, not a blank card."""
    return Template(template.read_text()).substitute({k: ("n/a" if v is None else v) for k, v in fields.items()})


def write_model_card(out_dir: Path, fields: dict, template=TEMPLATE) -> Path:
    path = Path(out_dir) / "README.md"
    path.write_text(render(fields, template))
    return path
