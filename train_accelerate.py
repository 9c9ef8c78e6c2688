"""Train an NSA language model with Hugging Face Accelerate. Read it top to bottom.

    python train_accelerate.py --preset smoke                                  # CPU, no network, a few minutes
    accelerate launch --config_file accelerate_configs/single_gpu.yaml train_accelerate.py --dataset fineweb-edu
    accelerate launch --config_file accelerate_configs/ddp_2gpu_bf16.yaml train_accelerate.py --dataset fineweb-edu

One optimizer step = `grad_accum` micro-batches of `micro_batch_size` rows of `seq_len` tokens on every process.
The loss is a sum over label tokens divided by the number of label tokens in the whole step (all micro-batches,
all processes), so any split of the same global batch gives the same update.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import itertools
import json
import logging
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import torch
from accelerate import Accelerator, PartialState
from accelerate.utils import (
    DDPCommunicationHookType,
    DistributedDataParallelKwargs,
    DistributedType,
    ProjectConfiguration,
    broadcast_object_list,
    is_tensorboard_available,
    is_trackio_available,
    parse_flag_from_env,
    set_seed,
)
from transformers import HfArgumentParser, PretrainedConfig

from nsa_train import checkpoint, data, hub, metrics, model_card
from nsa_train.evaluation import (
    LONG_CONTEXT_LENGTH_FACTORS,
    EvalSchedule,
    evaluate,
    evaluate_long_context,
    long_context_settings,
    validation_loss,
)
from nsa_train.export import Exporter, generate_sample
from nsa_train.long_context import DEFAULT_DEPTHS, check_depths, check_lengths
from nsa_train.preemption import GracefulStop
from nsa_train.run_state import RunState, lr_at
from nsa_train.step_log import StepLog, transformers_bars_on_a_terminal_only

MODEL_PRESETS = {
    "125m": {},  # NSAConfig defaults: 12 layers, hidden 768, 12 q / 2 kv heads, paper NSA sizes
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, cmp_block_size=16, cmp_stride=8, sel_block_size=16,
                 sel_num_blocks=4, window_size=32, cmp_mlp_hidden_size=32),
    "smoke": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, cmp_block_size=16, cmp_stride=8, sel_block_size=16,
                  sel_num_blocks=4, window_size=64, cmp_mlp_hidden_size=64),
}  # fmt: skip

PRESETS = {  # defaults a preset sets; flags given on the command line still win
    "smoke": dict(dataset="python-docs", tokenizer="byt5", model="smoke", seq_len=128, micro_batch_size=8,
                  max_steps=400, lr=3e-3, warmup_steps=20, eval_every=100, save_every=200, val_tokens=8192,
                  val_every_doc=50, shuffle_buffer=500, log_every=10, mixed_precision="no",
                  sample_prompt="The Python "),
}  # fmt: skip


DEFAULT_TOKENIZER = "gpt2"  # --tokenizer's default without --init-from (from the Hub: offline, give a saved one)


@dataclass
class TrainConfig:
    preset: str | None = field(default=None, metadata={"help": f"Defaults for a named setup: {list(PRESETS)}."})
    # data
    dataset: str = field(default="fineweb-edu", metadata={"help": "fineweb-edu | python-docs | hf://NAME (a Hub dataset, streamed) | parquet:PATH (local parquet shards, e.g. of FineWeb-Edu, streamed the same way) | PATH (file, dir, glob of parquet/jsonl/txt)."})
    dataset_config: str | None = field(default=None, metadata={"help": "Hub dataset config; when not given: sample-10BT for fineweb-edu (or sample-100BT, ...), the dataset's own default for hf://NAME."})
    text_column: str = "text"
    tokenizer: str | None = field(default=None, metadata={"help": f"AutoTokenizer name or path, or 'byt5' (byte-level, no files); default: the --init-from model's own where one is saved beside it (a run's final/), else {DEFAULT_TOKENIZER}."})
    seq_len: int = 2048
    cross_doc_attention: bool = field(default=False, metadata={"help": "GPT-2 style rows: attend across documents."})
    data_shard: Literal["docs", "rows"] = field(default="docs", metadata={"help": "docs: each rank tokenizes its own documents; rows: every rank packs the global stream (results independent of the process count)."})
    shuffle_buffer: int = 10_000
    val_every_doc: int = field(default=100, metadata={"help": "Document i is held out for validation when i %% N == 0 (0: none held out, no validation loss). A .txt file is one document."})
    val_tokens: int = field(default=1 << 18, metadata={"help": "Validation set size in tokens (split across processes)."})
    # model
    model: str = field(default="125m", metadata={"help": f"The architecture (weights start random): {list(MODEL_PRESETS)}, a config.json or a directory holding one (e.g. a run's final/)."})
    model_overrides: str = field(default="", metadata={"help": 'JSON of NSAConfig fields, e.g. \'{"num_hidden_layers": 6}\'.'})
    init_from: str | None = field(default=None, metadata={"help": "Start from a saved model's weights (a run's final/ or a Hub id): its architecture, so --model and --model-overrides are not used."})
    attention_mode: Literal["nsa", "dense"] | None = field(default=None, metadata={"help": "nsa | dense; when not given: the --model config.json's, else nsa."})
    nsa_backend: Literal["auto", "reference", "triton"] = field(default="auto", metadata={"help": "A runtime choice: a --model config.json's value is not used."})
    attn_implementation: Literal["sdpa", "eager", "flex_attention", "flash_attention_2", "flash_attention_3"] | None = field(default=None, metadata={"help": "Dense mode's attention function, through transformers' attention interface: sdpa (the default), eager, flex_attention (documents as a block mask), flash_attention_2/3 (documents as varlen; needs flash-attn). NSA mode runs its own kernels and takes none."})
    gradient_checkpointing: bool = False
    compile: bool = field(default=False, metadata={"help": "torch.compile the training forward and backward (evaluation, generation, checkpoints and the export use the model uncompiled, so a run resumes with or without it)."})
    # optimization
    micro_batch_size: int = 16
    grad_accum: int = 1
    max_steps: int = 5000
    stop_at_step: int = field(default=0, metadata={"help": "stop after this step with a checkpoint, as a SIGTERM would, and leave the run to continue with --resume latest; the learning-rate schedule and evaluations stay those of --max-steps (0: train to --max-steps). Splits a run over sessions of fixed length at steps chosen in advance."})
    lr: float = 6e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = 200
    weight_decay: float = field(default=0.1, metadata={"help": "AdamW's decoupled weight decay, on weight matrices only (the compressor's position embeddings among them); none on norms, biases and the token embeddings (tied to the LM head)."})
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    seed: int = 1337
    mixed_precision: Literal["no", "bf16", "fp16"] | None = field(default=None, metadata={"help": "Default: the accelerate config's (bf16 in the GPU YAMLs)."})
    skip_nonfinite: bool = field(default=False, metadata={"help": "Skip a step with a non-finite loss/grad instead of stopping."})
    # DDP (ignored on one process)
    ddp_comm_hook: Literal["auto", "bf16", "fp16", "powersgd", "none"] = field(default="auto", metadata={"help": "Gradient all-reduce compression. auto: bf16 on multi-GPU NCCL, none otherwise."})
    ddp_bucket_cap_mb: int = 25
    ddp_static_graph: bool = field(default=True, metadata={"help": "DDP static_graph (off: --no-ddp-static-graph); off with --grad-accum > 1, which PyTorch's static graph does not support (said when so)."})
    powersgd_rank: int = field(default=4, metadata={"help": "With --ddp-comm-hook powersgd: the rank of its low-rank gradient approximation."})
    powersgd_start_step: int = field(default=1000, metadata={"help": "With --ddp-comm-hook powersgd: the optimizer step from which gradients are compressed; before it they are all-reduced whole (PowerSGD's warm-up; torch's default 1000). At least 2."})
    # logging, eval, watchdog
    output_dir: str | None = field(default=None, metadata={"help": "Default runs/<date-time>."})
    log_every: int = field(default=10, metadata={"help": "Log the training loss every N steps (0: never)."})
    eval_every: int = field(default=250, metadata={"help": "Validation loss every N steps, at step 0 and at the last step (0: never)."})
    eval_only: bool = field(default=False, metadata={"help": "Evaluate the --init-from model on the held-out rows, write eval.json and exit (no training)."})
    report_to: Literal["tensorboard", "trackio", "none"] = "tensorboard"
    stall_timeout: float = field(default=1800.0, metadata={"help": "Seconds without progress before the watchdog dumps stacks and exits (0: off)."})
    peak_tflops: float | None = field(default=None, metadata={"help": "Peak TFLOPS per device for MFU (default: known GPUs, bf16)."})
    sample_prompt: str | None = field(default=None, metadata={"help": "Generate from this prompt with the exported model at the end."})
    # quality measurements (nsa_train.selection_stats, nsa_train.long_context)
    stats_every: int = field(default=-1, metadata={"help": "NSA's selection and gate statistics (stats.jsonl, metrics.jsonl, trackers, the card) on held-out rows every N steps; -1: at every evaluation; 0: off. Dense attention has none."})
    eval_long_context: bool = field(default=False, metadata={"help": "After the export (with --eval-only: after the loss), evaluate long-context retrieval (<output_dir>/long_context/: JSON and heatmap PNG; the card reports it)."})
    long_context_task: Literal["passkey", "needle"] = field(default="passkey", metadata={"help": "passkey: a number in filler text; needle: a sentence in the run's documents."})
    long_context_lengths: list[int] = field(default_factory=list, metadata={"help": f"Case lengths in tokens (prompt and answer, as nsa_train.long_context counts them); none given: --seq-len times {' '.join(map(str, LONG_CONTEXT_LENGTH_FACTORS))}, less the multiples too short for the task's fixed text (longer than --seq-len is extrapolation)."})
    long_context_depths: list[float] = field(default_factory=lambda: list(DEFAULT_DEPTHS), metadata={"help": "Where the hidden item sits: the fraction of the haystack before it, in [0, 1]."})
    long_context_samples: int = field(default=10, metadata={"help": "Prompts per (length, depth)."})
    # checkpoints and the Hub
    save_every: int = field(default=1000, metadata={"help": "A checkpoint every N steps and at the end (0: none; SIGTERM still saves one)."})
    keep_last: int = field(default=3, metadata={"help": "Checkpoints kept, the latest ones (0: every one)."})
    resume: str | None = field(default=None, metadata={"help": "'latest' (in --output-dir) or a checkpoint path."})
    export_every_save: bool = field(default=False, metadata={"help": "Also write the HF checkpoint (and push, with --push-to-hub) at each save."})
    push_to_hub: str | None = field(default=None, metadata={"help": "REPO_ID to upload final/ to (token and repo checked before training)."})
    hub_private: bool = False
    hub_intermediate: Literal["commit", "branch"] = field(default="commit", metadata={"help": "Intermediate pushes as commits on main or as branches step-N."})

    def __post_init__(self):
        if self.tokenizer is None:  # the one the --init-from model was trained with, where it is saved beside it
            saved = self.init_from and (Path(self.init_from).expanduser() / "tokenizer_config.json").is_file()
            self.tokenizer = self.init_from if saved else DEFAULT_TOKENIZER


def build_parser() -> HfArgumentParser:
    # allow_abbrev=False: a prefix of a flag (--max-step) is an error naming the flag, not silently that flag; a
    # prefix that is unique today would change meaning when a flag sharing it is added
    parser = HfArgumentParser(TrainConfig, usage="%(prog)s [--preset smoke] [--FLAG VALUE ...]  (--help lists every flag)",
                              allow_abbrev=False)  # fmt: skip
    for action in parser._actions:
        if action.option_strings[0].startswith("--no_"):  # its default would read False; the flag's own help says it
            action.help = argparse.SUPPRESS
        elif not action.help:  # the formatter appends "(default: ...)" to help text, but only if there is some
            action.help = "(default: %(default)s)"
    return parser


def parse_args(argv=None) -> TrainConfig:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    # a first pass finds the preset however it is spelled (--preset smoke, --preset=smoke); --help waits for the
    # second pass so that it shows the preset's defaults
    preset = parser.parse_known_args([a for a in argv if a not in ("-h", "--help")])[0].preset
    if preset is not None:
        if preset not in PRESETS:
            model = f" ({preset!r} is a --model: --model {preset})" if preset in MODEL_PRESETS else ""
            parser.error(f"unknown --preset {preset!r}; choose from {list(PRESETS)}{model}.")
        parser.set_defaults(**PRESETS[preset])
    cfg, unknown = parser.parse_args_into_dataclasses(args=argv, return_remaining_strings=True)
    if unknown:
        flags = [s for a in parser._actions for s in a.option_strings if "_" not in s]  # the --dash-spelling
        close = [m for u in unknown if u.startswith("-") for m in difflib.get_close_matches(u.split("=")[0], flags, 3)]
        hint = f" (did you mean {' or '.join(dict.fromkeys(close))}?)" if close else ""
        parser.error(f"unrecognized arguments: {' '.join(unknown)}{hint}")
    if cfg.eval_only and not cfg.init_from:
        parser.error("--eval-only evaluates the model given by --init-from (a run's final/ or a Hub id); pass it.")
    if cfg.eval_only and cfg.resume:
        parser.error(f"--resume {cfg.resume} with --eval-only: --eval-only evaluates the exported model --init-from "
                     "names and reads no checkpoint. To evaluate a checkpoint, export it first (--resume CHECKPOINT "
                     "--max-steps <its step> --output-dir NEW writes NEW/final/) and pass --init-from NEW/final.")
    if cfg.dataset_config and not (cfg.dataset == "fineweb-edu" or cfg.dataset.startswith("hf://")):
        parser.error(f"--dataset-config {cfg.dataset_config!r}: configs are a Hub dataset's (fineweb-edu, hf://NAME); "
                     f"--dataset {cfg.dataset} is read as it is. Drop --dataset-config, or point --dataset at the "
                     "files of the config you want.")
    if cfg.init_from and cfg.model_overrides:
        parser.error(f"--model-overrides {cfg.model_overrides!r}: not used with --init-from {cfg.init_from!r}, whose "
                     "architecture is the saved model's; drop one of them.")
    if cfg.init_from:
        cfg.model = None  # the saved architecture is used: run.json names no --model (a preset's) it did not use
    positive, at_least_0 = (lambda v: v >= 1, "a positive integer"), (lambda v: v >= 0, "at least 0")
    adam_beta = (lambda v: 0 <= v < 1, "in [0, 1): AdamW's moment decay")
    for name, (valid, fix) in (("seq_len", (lambda v: v >= 2, "at least 2: a row holds tokens and their next "
                                                          "tokens as labels")),
                               ("micro_batch_size", positive), ("grad_accum", positive), ("max_steps", at_least_0),
                               ("log_every", at_least_0), ("eval_every", at_least_0), ("save_every", at_least_0),
                               ("long_context_samples", positive), ("warmup_steps", at_least_0),
                               ("stop_at_step", (lambda v: v >= 0, "at least 0 (0: train to --max-steps)")),
                               ("weight_decay", at_least_0), ("beta1", adam_beta), ("beta2", adam_beta),
                               ("lr", (lambda v: v > 0, "a positive learning rate, e.g. 6e-4")),
                               ("min_lr_ratio", (lambda v: 0 <= v <= 1, "in [0, 1]: the cosine's floor as a fraction of --lr")),
                               ("grad_clip", (lambda v: v >= 0, "at least 0 (0: no clipping)")),
                               ("powersgd_rank", positive), ("ddp_bucket_cap_mb", positive),
                               ("val_tokens", (lambda v: v >= 0, "at least 0 (0: no validation rows)")),
                               ("val_every_doc", (lambda v: v >= 0, "at least 0 (0: no document held out)")),
                               ("keep_last", (lambda v: v >= 0, "at least 0 (0: keep every checkpoint)")),
                               ("shuffle_buffer", (lambda v: v >= 0, "at least 0 (0 or 1: no shuffle)")),
                               ("stall_timeout", (lambda v: v >= 0, "at least 0 seconds (0: no watchdog)")),
                               ("peak_tflops", (lambda v: v is None or v > 0, "a positive TFLOP/s figure per "
                                                                              "device (MFU's denominator)")),
                               ("seed", (lambda v: 0 <= v < 2**32, "in [0, 2**32): the seed numpy and torch take")),
                               ("powersgd_start_step", (lambda v: v >= 2, "at least 2: DDP compresses no gradient "
                                                                         "before its second step"))):  # fmt: skip
        if not valid(getattr(cfg, name)):  # before torch's own "Invalid learning rate: -1.0", which names no flag
            parser.error(f"--{name.replace('_', '-')} {getattr(cfg, name)}: must be {fix}.")
    if cfg.stats_every < -1:
        parser.error(f"--stats-every {cfg.stats_every}: -1 (at every evaluation), 0 (off) or a number of steps.")
    try:  # the evaluation's own checks, its flags named as the trainer spells them
        check_depths(cfg.long_context_depths)
        if cfg.long_context_lengths:
            check_lengths(cfg.long_context_lengths, None)
    except ValueError as e:
        parser.error(str(e).replace("--depths", "--long-context-depths").replace("--lengths", "--long-context-lengths"))
    return cfg


def build_model(cfg: TrainConfig, tokenizer):
    from huggingface_hub.errors import StrictDataclassError

    from modeling_nsa import NSAConfig, NSAForCausalLM

    if cfg.init_from:
        return load_model(cfg, tokenizer)
    config_file = Path(cfg.model) / "config.json" if Path(cfg.model).is_dir() else Path(cfg.model)
    if cfg.model in MODEL_PRESETS:
        fields = dict(MODEL_PRESETS[cfg.model])
    elif config_file.is_file():  # the architecture only: the weights start random
        fields = json.loads(config_file.read_text())
        fields = {k: v for k, v in fields.items() if k in NSAConfig.__dataclass_fields__}
    else:
        raise ValueError(f"--model {cfg.model!r}: not one of {list(MODEL_PRESETS)}, a config.json file or a directory "
                         "holding one.")  # fmt: skip
    overrides = parse_model_overrides(cfg.model_overrides, NSAConfig)
    fields.update(overrides)
    fields.update(
        vocab_size=math.ceil(len(tokenizer) / 64) * 64,  # padded for tensor cores (GPT-2: 50257 -> 50304)
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
        attention_mode=cfg.attention_mode or fields.get("attention_mode", "nsa"),  # the flag, else the file's
        nsa_backend=cfg.nsa_backend,  # a runtime choice, never the file's
    )  # fmt: skip
    check_attn_implementation_flag(cfg, fields["attention_mode"])
    dense_kwargs = {"attn_implementation": cfg.attn_implementation} if cfg.attn_implementation else {}
    try:
        config = NSAConfig(**fields, **dense_kwargs)  # raises ValueError on invalid NSA settings
    except (TypeError, StrictDataclassError) as e:  # a value of the wrong type, e.g. "2" for 2
        source = "--model-overrides" if any(repr(k) in str(e) for k in overrides) else f"--model {cfg.model!r}"
        raise ValueError(f"{source}: {' '.join(str(e).split())}") from None
    check_seq_len(cfg, config)
    with attn_implementation_named(cfg):
        if config.attention_mode == "nsa":
            return NSAForCausalLM(config)
        nsa_fields = {**fields, "attention_mode": "nsa", "nsa_backend": "reference"}  # never run: any backend builds
        return dense_twin(config, NSAForCausalLM(NSAConfig(**nsa_fields)))


@contextlib.contextmanager
def attn_implementation_named(cfg: TrainConfig):
    """transformers checks --attn-implementation's package when the model is built; its ImportError ("FlashAttention2
    has been toggled on, but ...") names neither the flag nor the choices that need nothing installed."""
    try:
        yield
    except ImportError as e:
        if not cfg.attn_implementation:
            raise
        raise ValueError(f"--attn-implementation {cfg.attn_implementation}: {' '.join(str(e).split())} Install it "
                         "(flash-attn runs on CUDA GPUs: pip install flash-attn), or pass --attn-implementation sdpa "
                         "(the default) or flex_attention, which compute the same attention.") from None


def check_attn_implementation_flag(cfg: TrainConfig, attention_mode: str) -> None:
    if cfg.attn_implementation not in (None, "sdpa") and attention_mode == "nsa":
        raise ValueError(f"--attn-implementation {cfg.attn_implementation} chooses dense attention's function; this run's "
                         "attention mode is nsa, which runs its own kernels (--nsa-backend). Drop the flag, or add "
                         "--attention-mode dense for the dense baseline.")


def dense_twin(config, nsa_model):
    """A dense model whose weights are `nsa_model`'s, NSA's own modules (gate projection, compressor) left out, so
    that an A/B pair with one --seed starts from the same weights: built at random, two layouts draw the random
    numbers in different orders (the NSA-only modules sit between the shared ones). `nsa_model` is built first,
    from the seeded generator; the dense model is built on a fork of it, so the generator then stands where an NSA
    run's does. With kv_per_branch the NSA K/V projection holds three sets (cmp, slc, win; paper Sec. 3.3.3), or
    two with one branch's own, and the dense one a single set: it takes the selection branch's (full-resolution
    keys, as dense attention reads)."""
    from modeling_nsa import NSAForCausalLM

    with torch.random.fork_rng(devices=[]):  # the build's own draws are overwritten below
        model = NSAForCausalLM(config)
    source = dict(nsa_model.named_parameters())
    with torch.no_grad():
        for name, param in model.named_parameters():  # the tied lm_head is the embeddings: listed once
            value = source[name]
            if name.endswith("kv_proj.weight") and value.shape != param.shape:  # (sets * 2 * Hkv * D, hidden)
                nsa_config = nsa_model.config  # (the NSA model's sets: the dense config has one)
                value = value.view(nsa_config.num_kv_sets, -1, value.shape[-1])[nsa_config.kv_set_of_branch["slc"]]
            param.copy_(value)
    return model


def check_seq_len(cfg: TrainConfig, config) -> None:
    if cfg.seq_len < 2 or cfg.seq_len > config.max_position_embeddings:
        fix = ("a --seq-len the saved model takes" if cfg.init_from else
               f'--model-overrides \'{{"max_position_embeddings": {max(cfg.seq_len, 2)}}}\'')
        raise ValueError(
            f"--seq-len {cfg.seq_len} cannot be taken by this model (max_position_embeddings="
            f"{config.max_position_embeddings}); use 2..{config.max_position_embeddings} or {fix}."
        )


def saved_tokenizer(model_dir: str) -> tuple[str, dict] | None:
    """(class name without "Fast", its tokenizer.json vocabulary or {}) of the tokenizer saved in a local model
    directory, read from its files (AutoTokenizer would read the model's config too); None where none is saved."""
    files = Path(model_dir) / "tokenizer_config.json", Path(model_dir) / "tokenizer.json"
    if not files[0].is_file():
        return None
    name = json.loads(files[0].read_text()).get("tokenizer_class") or ""
    vocab = json.loads(files[1].read_text()).get("model", {}).get("vocab", {}) if files[1].is_file() else {}
    return name.removesuffix("Fast"), vocab if isinstance(vocab, dict) else {}


def load_model(cfg: TrainConfig, tokenizer):
    """--init-from: a saved NSAForCausalLM (directory or Hub id), in float32 (the trainer's master weights; autocast
    computes in bf16), with this run's --nsa-backend. Its tokenizer must fit its vocabulary."""
    from modeling_nsa import NSAForCausalLM

    local = Path(cfg.init_from).expanduser()
    if local.is_dir() and not (local / "config.json").is_file():  # (from_pretrained would build a default config)
        if (local / checkpoint.STATE_FILE).is_file():
            raise ValueError(f"--init-from {cfg.init_from!r} is a training checkpoint, not an exported model (no "
                             f"config.json). Continue its run with --resume {cfg.init_from}, or export it first: "
                             f"--resume {cfg.init_from} --max-steps <its step> --output-dir NEW writes NEW/final/, "
                             "which --init-from takes.")
        final = " (a run's folder: its export is final/)" if (local / "final" / "config.json").is_file() else ""
        raise ValueError(f"--init-from {cfg.init_from!r}: the folder holds no config.json{final}; pass an exported "
                         "model (a run's final/) or a Hub id.")
    with attn_implementation_named(cfg):  # (its ImportError passes the except below)
        try:
            saved_type = PretrainedConfig.get_config_dict(cfg.init_from)[0].get("model_type")
            # from_pretrained would load another model_type with a warning only, every weight of another name (all
            # of NSA's own, more where the layouts differ) left at random
            if saved_type != NSAForCausalLM.config_class.model_type:
                raise ValueError(f"it holds a {saved_type!r} model, not an NSA one (model_type 'nsa'): --init-from "
                                 "continues an NSA model's training. Pass an NSA export (a run's final/) or Hub id; for "
                                 "the dense baseline, train with --attention-mode dense.")
            model = NSAForCausalLM.from_pretrained(cfg.init_from, dtype=torch.float32, nsa_backend=cfg.nsa_backend,
                                                   **({"attn_implementation": cfg.attn_implementation}
                                                      if cfg.attn_implementation else {}))
        except (OSError, ValueError) as e:
            raise ValueError(f"--init-from {cfg.init_from!r}: cannot load an NSA model from it "
                             f"({' '.join(str(e).split())})") from None
    config = model.config
    if cfg.attention_mode and cfg.attention_mode != config.attention_mode:
        raise ValueError(f"--attention-mode {cfg.attention_mode}: the --init-from model is {config.attention_mode!r} "
                         "(its weights fit that mode only); drop the flag.")
    if len(tokenizer) > config.vocab_size:
        raise ValueError(f"--tokenizer {cfg.tokenizer!r} has {len(tokenizer)} tokens, more than the --init-from model's "
                         f"vocab_size {config.vocab_size}; pass the tokenizer it was trained with (e.g. --tokenizer "
                         f"{cfg.init_from}).")
    saved = saved_tokenizer(cfg.init_from)
    this = (type(tokenizer).__name__.removesuffix("Fast"), tokenizer.get_vocab())
    if saved is not None and (saved[0] != this[0] or any(this[1].get(t) != i for t, i in saved[1].items())):
        # a run's final/ carries its tokenizer: another one reads the model's ids as other text
        PartialState().print(
            f"warning: --tokenizer {cfg.tokenizer!r} ({this[0]}, {len(tokenizer)} tokens) is not the tokenizer saved "
            f"with --init-from {cfg.init_from} ({saved[0]}): the model reads its ids as other text. Pass --tokenizer "
            f"{cfg.init_from} to use its own.")
    check_seq_len(cfg, config)
    return model


# NSAConfig fields the trainer sets from other flags after the overrides (an override of them would be lost)
SET_BY_FLAGS = {"vocab_size": "--tokenizer", "bos_token_id": "--tokenizer", "eos_token_id": "--tokenizer",
                "pad_token_id": "--tokenizer", "attention_mode": "--attention-mode", "nsa_backend": "--nsa-backend"}  # fmt: skip


def parse_model_overrides(text: str, config_class) -> dict:
    example = 'e.g. --model-overrides \'{"num_hidden_layers": 6, "cmp_stride": 8}\''
    try:
        overrides = json.loads(text) if text else {}
    except json.JSONDecodeError as e:
        raise ValueError(f"--model-overrides {text!r} is not valid JSON ({e}); keys need double quotes, {example}.") from None
    if not isinstance(overrides, dict):
        raise ValueError(f"--model-overrides {text!r} must be a JSON object of NSAConfig fields, {example}.")
    known = config_class.__dataclass_fields__
    for key in overrides:
        if key in SET_BY_FLAGS:
            raise ValueError(f"--model-overrides {key!r}: this run sets {key} from {SET_BY_FLAGS[key]}; use that flag.")
        if key not in known:
            close = difflib.get_close_matches(key, known, 3)
            hint = f"did you mean {' or '.join(map(repr, close))}? " if close else ""
            raise ValueError(f"--model-overrides: {key!r} is not an NSAConfig field; {hint}The fields are listed in "
                             "modeling_nsa/configuration_nsa.py (NSAConfig).")  # fmt: skip
    return overrides


def make_optimizer(model, cfg: TrainConfig, device):
    """AdamW; weight decay on matrices: none on norms, biases and the token embeddings (tied to the LM head). The
    compressor's intra-block position embeddings (k_pos_emb, v_pos_emb: (l, D)) decay as matrices, as GPT-2's
    position table does in nanoGPT; a checkpoint's optimizer state holds these groups, so changing them breaks
    --resume of every earlier checkpoint."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if p.ndim < 2 or name.endswith("embed_tokens.weight") else decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), fused=device.type == "cuda")


def set_learning_rate(optimizer, lr: float) -> float:
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr


def announce_run(cfg: TrainConfig, say, n_params: int, source, world: int, out_dir: Path) -> int:
    """Says what is about to train; returns the tokens each optimizer step takes."""
    tokens_per_step = cfg.micro_batch_size * cfg.grad_accum * world * cfg.seq_len
    say(f"model: {n_params / 1e6:.2f}M params, attention {cfg.attention_mode}; data: {source.describe()}; "
        f"{world} process(es) x {cfg.grad_accum} x {cfg.micro_batch_size} rows x {cfg.seq_len} = "
        f"{tokens_per_step:,} tokens/step; output {out_dir}")  # fmt: skip
    return tokens_per_step


def note_short_validation(cfg: TrainConfig, val_rows: list, eos_token_id: int, say) -> None:
    """Said where the held-out documents (one in every --val-every-doc) hold fewer tokens than --val-tokens asks:
    the validation loss then rests on those alone (data.validation_rows stops at the data's end)."""
    text_tokens = data.validation_text_tokens(val_rows, eos_token_id)
    if val_rows and text_tokens < cfg.val_tokens:
        say(f"note: validation holds {text_tokens:,} tokens of text ({len(val_rows)} row(s) of {cfg.seq_len}), fewer "
            f"than --val-tokens {cfg.val_tokens:,}: the data's held-out documents (one in every {cfg.val_every_doc}, "
            "--val-every-doc) end there; a smaller --val-every-doc or more data holds out more.")


def note_new_epoch(step: int, epoch_before: int, epoch_now: int, world: int, shard: str, say) -> None:
    """Said each step in which the main process's training stream starts over (under --data-shard docs each process
    reads its own share of the documents and wraps at its own steps; under rows every process reads the one row
    stream): later steps read documents again."""
    if epoch_now > epoch_before:
        epochs = f"epoch {epoch_now} starts" if epoch_now == epoch_before + 1 else \
            f"epochs {epoch_before + 1}-{epoch_now} start"
        stream = "the training data" if world == 1 or shard == "rows" else \
            f"process 0's share of the training data (of {world})"
        say(f"note: step {step}: {stream} was read through; {epochs} (the same documents again, in another order): "
            "from here the training loss is on documents the model has seen.")


def ddp_static_graph(cfg: TrainConfig, num_processes: int, say=print) -> bool:
    """--ddp-static-graph, except with gradient accumulation: DDP's static graph and no_sync (accelerate's
    accumulate) crash on the first backward (expect_autograd_hooks_ INTERNAL ASSERT) and, once past that, stop
    all-reducing from the second step (pytorch/pytorch PR #187732, open; accelerate issue #3679). Said when it
    turns the flag off."""
    if cfg.ddp_static_graph and cfg.grad_accum > 1 and num_processes > 1:
        say(f"DDP static_graph off: --grad-accum {cfg.grad_accum} accumulates under no_sync, which PyTorch's static "
            "graph does not support (a crash on the first backward); pass --no-ddp-static-graph to silence this.")
        return False
    return cfg.ddp_static_graph


def powersgd_options(cfg: TrainConfig, resumed_step: int, say=print) -> dict:
    """torch's PowerSGDState options. Its step counter starts at 0 in each launch and its error feedback is not in
    checkpoints: a resumed run starts compressing where the uninterrupted one would (--powersgd-start-step less the
    steps done, at least torch's 2) and says that its error feedback restarts from zero."""
    if resumed_step:
        say(f"note: --ddp-comm-hook powersgd resumes at step {resumed_step} with its error feedback at zero (the "
            "hook's state is not in checkpoints): the run continues close to the uninterrupted one, not bit for bit.")
    return {"matrix_approximation_rank": cfg.powersgd_rank,
            "start_powerSGD_iter": max(2, cfg.powersgd_start_step - resumed_step)}


def ddp_kwargs(cfg: TrainConfig, num_processes: int, say=print, resumed_step: int = 0) -> DistributedDataParallelKwargs:
    """accelerate's DDP settings from the --ddp-* flags; `resumed_step`: the step the launch continues from."""
    hook = cfg.ddp_comm_hook
    if hook == "auto":  # bf16 compression needs NCCL: multi-GPU only
        hook = "bf16" if torch.cuda.is_available() and num_processes > 1 else "none"
    hooks = {"bf16": DDPCommunicationHookType.BF16, "fp16": DDPCommunicationHookType.FP16,
             "powersgd": DDPCommunicationHookType.POWER_SGD, "none": DDPCommunicationHookType.NO}  # fmt: skip
    return DistributedDataParallelKwargs(
        comm_hook=hooks[hook],
        comm_state_option=powersgd_options(cfg, resumed_step, say) if hook == "powersgd" else {},
        bucket_cap_mb=cfg.ddp_bucket_cap_mb,
        static_graph=ddp_static_graph(cfg, num_processes, say),
        find_unused_parameters=False,
        gradient_as_bucket_view=True,
    )


def output_dir(cfg: TrainConfig, state: PartialState) -> Path:
    """The run's directory, the same on every process (a default's time stamp is the main process's). A new run
    refuses one that holds another run's output. Not created yet: a run that fails its checks leaves none."""
    out = [cfg.output_dir or f"runs/{time.strftime('%Y%m%d-%H%M%S')}"]
    broadcast_object_list(out) if state.num_processes > 1 else None
    out_dir = Path(out[0])
    checkpoint.check_output_dir(out_dir, cfg.resume, cfg.eval_only, cfg.max_steps)
    return out_dir


def claim_output_dir(cfg: TrainConfig, out_dir: Path, accelerator):
    """The main process creates the run's directory and takes its lock for this launch (checkpoint.lock_output_dir:
    another live launch there is refused), then checks the directory again under the lock (a launch that ended
    there since the first check left its output). Every process raises the main process's error. Returns the
    lock's open file on the main process (closing it releases the lock), else None."""
    lock, error = None, None
    if accelerator.is_main_process:
        try:
            lock = checkpoint.lock_output_dir(out_dir)
            checkpoint.check_output_dir(out_dir, cfg.resume, cfg.eval_only, cfg.max_steps)
        except (ValueError, OSError) as e:  # (any error: the other processes wait below for the verdict)
            error = str(e) if isinstance(e, ValueError) else f"--output-dir {out_dir}: cannot create or lock it ({e})"
            if lock is not None:
                lock.close()
    if accelerator.num_processes > 1:
        verdict = [error]
        broadcast_object_list(verdict)
        error = verdict[0]
    if error is not None:
        raise ValueError(error)
    return lock


def run_began_from(cfg: TrainConfig, out_dir: Path) -> str | None:
    """Where the run's weights began: --init-from for a new run; for a resumed one, the --init-from of the launch
    that started it (its checkpoint's record; None: at random). A resumed run's weights are its checkpoint's, so
    an --init-from other than the run's own would be recorded (run.json, the model card) but never used: refused.
    The run's own may be given (it builds the architecture, whose weights the checkpoint then replaces)."""
    path = checkpoint.resolve_resume(cfg.resume, out_dir / "checkpoints") if cfg.resume and not cfg.eval_only else None
    if path is None:  # a new run (also --resume latest before the run's first checkpoint)
        return cfg.init_from
    saved = json.loads((path / checkpoint.STATE_FILE).read_text()).get("config", {})
    began = saved.get("init_from")
    if began is not None and (here := checkpoint.local_path(began, saved.get("cwd"))) is not None:
        began = str(here)  # (a path relative to the directory that launch ran in: usable from any other)
    if cfg.init_from and not same_model_source(cfg.init_from, began):
        start = f"from --init-from {began}" if began else "at random weights"
        own = f" (or pass the run's own, --init-from {began})" if began else ""
        raise ValueError(
            f"--init-from {cfg.init_from} with --resume {cfg.resume}: the run of {path} began {start}, and a resumed "
            f"run's weights are its checkpoint's, so --init-from would be recorded but not used. Drop --init-from"
            f"{own}; to start from {cfg.init_from} instead, give a new --output-dir without --resume."
        )
    return began


def same_model_source(a: str | None, b: str | None) -> bool:
    """Two --init-from values naming one model: the same local folder however spelt, or the same Hub id."""
    if a is None or b is None:
        return a == b
    local = [checkpoint.local_path(x, None) for x in (a, b)]
    if None not in local:
        return local[0] == local[1]
    return a == b


def resumed_step(cfg: TrainConfig, out_dir: Path) -> int:
    """The step of the checkpoint --resume names (0 for a new run), read before the Accelerator exists: the PowerSGD
    hook's options, which the Accelerator takes, depend on it."""
    path = checkpoint.resolve_resume(cfg.resume, out_dir / "checkpoints") if not cfg.eval_only else None
    return json.loads((path / checkpoint.STATE_FILE).read_text())["step"] if path else 0


def make_accelerator(cfg: TrainConfig, out_dir: Path, state: PartialState) -> Accelerator:
    for tracker, available in (("tensorboard", is_tensorboard_available), ("trackio", is_trackio_available)):
        if cfg.report_to == tracker and not available():
            state.print(f"{tracker} is not installed: logging to stdout and metrics.jsonl only (pip install {tracker})")
            cfg.report_to = "none"
    return Accelerator(
        gradient_accumulation_steps=cfg.grad_accum,
        mixed_precision=cfg.mixed_precision,
        log_with=None if cfg.report_to == "none" else cfg.report_to,
        project_config=ProjectConfiguration(project_dir=str(out_dir), logging_dir=str(out_dir)),
        kwargs_handlers=[ddp_kwargs(cfg, state.num_processes, state.print,
                                    resumed_step(cfg, out_dir) if cfg.ddp_comm_hook == "powersgd" else 0)],
    )


def run_precision(accelerator) -> str:
    """The precision the steps run in: accelerate keeps "fp16" where it applies none (no fp16 autocast on CPU)."""
    return "no" if accelerator.mixed_precision == "fp16" and not accelerator.native_amp else accelerator.mixed_precision


def warn_about_settings(cfg: TrainConfig, accelerator, precision: str) -> None:
    if precision != accelerator.mixed_precision:
        accelerator.print("warning: --mixed-precision fp16 does nothing here (accelerate autocasts to fp16 on GPUs "
                          "only): the steps run in float32 and the card says so; --mixed-precision bf16 autocasts on "
                          "CPU too.")  # fmt: skip
    if cfg.stop_at_step >= cfg.max_steps > 0:
        accelerator.print(f"note: --stop-at-step {cfg.stop_at_step} is not before --max-steps {cfg.max_steps}: the run "
                          "trains to --max-steps and finishes (exports final/) without stopping for a resume.")
    if cfg.warmup_steps >= cfg.max_steps > 0:
        accelerator.print(f"warning: --warmup-steps {cfg.warmup_steps} >= --max-steps {cfg.max_steps}: the whole run "
                          "is warm-up and the cosine decay never starts; lower --warmup-steps (e.g. to a tenth of "
                          "--max-steps).")  # fmt: skip


def check_backend(cfg: TrainConfig, device) -> None:
    """An explicit --nsa-backend triton where the kernels cannot run fails at startup, not at the first step."""
    if cfg.attention_mode != "nsa":
        return
    from modeling_nsa.modeling_nsa import resolve_nsa_backend

    try:
        resolve_nsa_backend(cfg.nsa_backend, device)
    except RuntimeError as e:
        raise ValueError(f"--nsa-backend {cfg.nsa_backend}: {e} (--nsa-backend auto picks what runs here)") from None


def check_dense_attention_trains(cfg: TrainConfig, config, device) -> None:
    """A dense run on flex_attention where torch's FlexAttention has no backward (CPU) would fail at the first
    step's backward, after the step-0 evaluation: probe it on a tiny input and fail at startup instead. Evaluation
    (--eval-only) runs forward only, which works there."""
    if cfg.eval_only or device.type == "cuda" or config.attention_mode != "dense":
        return
    if config._attn_implementation != "flex_attention":
        return
    from torch.nn.attention.flex_attention import flex_attention

    probe = torch.zeros(1, 1, 16, 16, device=device, requires_grad=True)  # (B, H, T, D)
    try:
        flex_attention(probe, probe, probe).sum().backward()
    except NotImplementedError as e:
        raise ValueError(f"--attn-implementation flex_attention cannot train on {device.type} ({e}). Train it on a GPU, "
                         "or use --attn-implementation sdpa (the default) or eager here.") from None


def note_dense_document_mask(cfg: TrainConfig, config, device, say) -> None:
    """Dense mode on SDPA with packed documents on a GPU runs a boolean (T x T) document mask, which SDPA's flash
    kernel does not take: say so once, with the other choice for the same math (README, "Dense mode with packed
    documents": with 8 documents per row at 8k on an H100, SDPA 0.61x of unpacked rows, FlexAttention 1.05x; at
    2,048 tokens of short documents in the trainer, FlexAttention was 5% slower), so users time both."""
    if config.attention_mode != "dense" or cfg.cross_doc_attention or device.type != "cuda":
        return
    if config._attn_implementation not in (None, "sdpa"):
        return
    say("note: dense mode on SDPA with packed documents masks them with a boolean (T x T) mask, which has no flash "
        "kernel (0.61x the tokens/s of unpacked rows at 8k, 8 documents per row, on an H100); "
        "--attn-implementation flex_attention computes the same attention with a block mask (1.05x there, 5% "
        "slower than SDPA at 2k with short documents): time both at your shape. The losses are equal.")


def enable_gradient_checkpointing(model) -> None:
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.23
        model.activation_checkpointing_enable({"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def train_step(model, forward, optimizer, micro_batches, cfg: TrainConfig, accelerator, precision: str):
    """One optimizer step over the step's micro-batches, each through `forward` (the prepared model, or with
    --compile its compiled wrapper). Returns (loss summed over them, gradient norm, whether the weights were updated:
    not when the gradient is non-finite, or under fp16 when the grad scaler skipped the step)."""
    world = accelerator.num_processes
    n_items = sum(data.num_label_tokens(b["labels"]) for b, _ in micro_batches).to(accelerator.device)
    n_items = accelerator.reduce(n_items, reduction="sum")  # label tokens in the whole step, all processes
    n_items = n_items.clamp(min=1)  # a step without labels (possible at --seq-len 2) adds 0 / 1, not 0 / 0 = NaN
    step_loss = torch.zeros((), device=accelerator.device)
    # accelerate's micro-batch count decides when gradients sync and the optimizer steps; a checkpoint restores it,
    # so a resume with another --grad-accum would put its windows out of step with these (the optimizer then skips
    # its step and the gradients pile up, silently): each optimizer step is one window, counted from 0
    accelerator.step = 0
    for batch, _ in micro_batches:
        batch = {k: v.to(accelerator.device, non_blocking=True) for k, v in batch.items()}
        with accelerator.accumulate(model):
            loss = forward(**batch, num_items_in_batch=n_items).loss  # local token sum / global token count
            # accelerate divides by grad_accum and DDP averages over processes: undo both
            accelerator.backward(loss * cfg.grad_accum * world)
            step_loss += loss.detach()
    if not accelerator.sync_gradients:  # (the window above ends with this step's last micro-batch)
        raise RuntimeError(f"the step's {len(micro_batches)} micro-batches did not end a gradient-accumulation window "
                           f"of {accelerator.gradient_accumulation_steps}: the optimizer would skip its step.")
    grad_norm = accelerator.clip_grad_norm_(model.parameters(), cfg.grad_clip if cfg.grad_clip > 0 else float("inf"))
    grad_norm = float(grad_norm)  # one host sync per step; identical on every process after the all-reduce
    if precision == "fp16":
        # the grad scaler decides: it skips a step whose scaled gradients overflowed and lowers its scale (normal in
        # the first steps, as the scale falls from 2^16 to what fits); accelerate says whether it did
        optimizer.step()
        updated = not optimizer.step_was_skipped
    else:
        updated = math.isfinite(grad_norm)
        if updated:
            optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return step_loss, grad_norm, updated


def read_on_every_process(loader, accelerator):
    """The loader with its first micro-batch read here, on every process, before any collective: a process whose
    share of the data fails (no training documents in its --data-shard docs share) raises its error, and the others,
    told by one all-reduce, raise too instead of waiting for it in the first step's."""
    try:
        first, error = next(loader), None
    except ValueError as e:
        first, error = None, e
    failed = int(accelerator.reduce(torch.tensor([error is not None], device=accelerator.device).int(), reduction="sum"))
    if error is not None:
        raise error
    if failed:
        raise ValueError(f"{failed} other process(es) of {accelerator.num_processes} could not read their share of the "
                         "training data (their error is in their log): every process stops.")
    return itertools.chain([first], loader)


def skip_nonfinite_step(cfg: TrainConfig, run: RunState, checkpoints: checkpoint.RunCheckpoints, step_loss,
                        grad_norm: float, lr: float, precision: str) -> None:  # fmt: skip
    """A step that left the weights as they were: an error, or with --skip-nonfinite counted and said. Under fp16 a
    step the grad scaler skipped with a finite loss is its normal working (its scale was too high): counted and
    said, never an error."""
    scaler_overflow = precision == "fp16" and math.isfinite(float(step_loss))
    if scaler_overflow:
        run.skipped_steps += 1
        checkpoints.accelerator.print(f"step {run.step}: fp16 gradients overflowed, the grad scaler skipped the step "
                                      f"and lowered its scale ({run.skipped_steps} skipped so far)")  # fmt: skip
        return
    if not cfg.skip_nonfinite:
        latest = checkpoint.latest_checkpoint(checkpoints.root)
        raise FloatingPointError(
            f"non-finite loss/gradient at step {run.step} (loss {float(step_loss):.4g}, grad norm {grad_norm}, "
            f"lr {lr:.3g}); the weights were NOT updated. Last checkpoint: {latest}. Lower --lr, raise "
            "--warmup-steps or pass --skip-nonfinite to skip such steps."
        )
    run.skipped_steps += 1
    checkpoints.accelerator.print(f"step {run.step}: non-finite gradient, step skipped ({run.skipped_steps} so far)")


def save(model, run: RunState, checkpoints: checkpoint.RunCheckpoints, exporter: Exporter, cfg: TrainConfig) -> None:
    """A checkpoint of the run (every process); with --export-every-save also final/ (and its push)."""
    path = checkpoints.save(run)
    checkpoints.accelerator.print(f"saved {path}")
    if cfg.export_every_save:
        branch = f"step-{run.step}" if cfg.hub_intermediate == "branch" else None
        exporter.export(model, run, f"step {run.step}", branch=branch)


def evaluate_only(cfg: TrainConfig, accelerator, model, val_rows, source, out_dir: Path, tokenizer,
                  long_context: dict | None, watchdog) -> dict:
    """--eval-only: the --init-from model's loss on this run's held-out rows (the rows training would hold out with
    the same data flags), written to <output_dir>/eval.json; with --eval-long-context (`long_context`: its
    settings) also its retrieval, in <output_dir>/long_context/ and as eval.json's `longctx_*` fields."""
    if not val_rows:
        raise ValueError(f"--eval-only: no validation rows (--val-every-doc {cfg.val_every_doc}, --val-tokens "
                         f"{cfg.val_tokens}); both must be > 0.")
    if accelerator.distributed_type == DistributedType.FSDP:
        # FSDP2 shards a model only together with its optimizer (accelerate maps the optimizer's parameters to the
        # shards); one that never steps and holds no state stands in
        model, _ = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.0))
    else:
        model = accelerator.prepare(model)
    unwrapped = accelerator.unwrap_model(model)
    metrics = validation_loss(unwrapped, val_rows, cfg.micro_batch_size, accelerator)
    if long_context:  # on every process: split under DDP, whole under FSDP (see evaluate_long_context)
        with beating(watchdog, unwrapped, phase="long_context"):
            metrics |= evaluate_long_context(unwrapped, tokenizer, RunState(), long_context, out_dir / "long_context",
                                             accelerator, str(cfg.init_from))  # fmt: skip
    result = {"init_from": cfg.init_from, "data": model_card.data_description(source), "seq_len": cfg.seq_len,
              "val_rows": len(val_rows), **metrics, "mixed_precision": run_precision(accelerator),
              "num_processes": accelerator.num_processes}  # fmt: skip
    if accelerator.is_main_process:
        (out_dir / "eval.json").write_text(json.dumps(result, indent=2))
    accelerator.print(f"eval: {cfg.init_from}: val loss {result['val_loss']:.4f} ppl {result['val_ppl']:.2f} on "
                      f"{len(val_rows)} rows of {cfg.seq_len} tokens ({result['data']}); written to "
                      f"{out_dir / 'eval.json'}")  # fmt: skip
    watchdog.beat(phase="done")
    return result


def say_sample(model, tokenizer, prompt: str, accelerator) -> None:
    """--sample-prompt's greedy continuation, printed. A sample that fails (a tokenizer that cannot decode every id
    of a larger vocabulary, say) is a warning: the run is trained and exported by then, and its summary still due."""
    try:
        sample = generate_sample(model, tokenizer, prompt, accelerator)
    except Exception as e:  # noqa: BLE001 - whatever fails in generation or decoding, the run's outputs stand
        accelerator.print(f"warning: the end-of-run sample (--sample-prompt {prompt!r}) failed: {type(e).__name__}: "
                          f"{' '.join(str(e).split())[:300]}. The run is trained and exported; generate from its final/ "
                          "to look into it.")  # fmt: skip
        return
    accelerator.print(f"sample: {sample!r}")


class TiedHeadSaveNotice(logging.Filter):
    """accelerate drops lm_head.weight, the tied copy of the input embeddings, from every checkpoint and warns that
    this "should be OK, but check": the model ties it again when it is built, and resume is tested bit-exact, so the
    warning at every save only alarms. Other shared tensors are still reported."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Removed shared tensor {'lm_head.weight'}" not in record.getMessage()


def quiet_tied_head_notice() -> None:
    saver_log = logging.getLogger("accelerate.utils.other")
    if not any(isinstance(f, TiedHeadSaveNotice) for f in saver_log.filters):
        saver_log.addFilter(TiedHeadSaveNotice())


def stats_every(cfg: TrainConfig, val_rows, say) -> int:
    """--stats-every as the run applies it: 0 where there is nothing to measure. Dense attention selects no blocks
    (compute_selection_stats would return no layers: the trainer does not run it); the statistics are measured on
    held-out rows."""
    if cfg.stats_every and cfg.attention_mode != "nsa":
        if cfg.stats_every > 0:
            say(f"note: --stats-every {cfg.stats_every}: dense attention has no selection to measure; no statistics.")
        return 0
    if cfg.stats_every > 0 and not val_rows:
        raise ValueError(f"--stats-every {cfg.stats_every}: the statistics are measured on held-out rows and this run "
                         f"has none (--val-every-doc {cfg.val_every_doc}, --val-tokens {cfg.val_tokens}); both must "
                         "be > 0.")  # fmt: skip
    return cfg.stats_every


@contextlib.contextmanager
def beating(watchdog, model, every_s: float = 10.0, **info):
    """While a long evaluation runs, each forward of `model` is progress: it beats the watchdog (at most every
    `every_s` seconds), so --stall-timeout bounds one forward, not the whole evaluation."""

    def beat(module, args):
        if time.monotonic() - watchdog.last > every_s:
            watchdog.beat(**info)

    handle = model.register_forward_pre_hook(beat)
    try:
        yield
    finally:
        handle.remove()


def main(cfg: TrainConfig) -> dict:
    cleanup: list = []  # background threads (data prefetch, watchdog) and the SIGTERM handler, however the run ends
    try:
        return train(cfg, cleanup)
    finally:
        for close in reversed(cleanup):
            close()


def train(cfg: TrainConfig, cleanup: list) -> dict:
    started = time.time()
    quiet_tied_head_notice()
    transformers_bars_on_a_terminal_only()
    # the process group before the Accelerator (whose TensorBoard logger needs the output dir, the same on every process)
    state = PartialState(cpu=parse_flag_from_env("ACCELERATE_USE_CPU"))
    out_dir = output_dir(cfg, state)
    accelerator = make_accelerator(cfg, out_dir, state)
    main_proc, world, say = accelerator.is_main_process, accelerator.num_processes, accelerator.print
    precision = run_precision(accelerator)
    warn_about_settings(cfg, accelerator, precision)
    watchdog = metrics.Watchdog(cfg.stall_timeout, out_dir / "heartbeat.json" if main_proc else None,
                                out_dir / f"stacks_rank{accelerator.process_index}.txt")  # fmt: skip
    cleanup.append(watchdog.stop)
    set_seed(cfg.seed)

    # --- everything that can fail fails here, before the first step
    began_from = run_began_from(cfg, out_dir)
    tokenizer = data.load_tokenizer(cfg.tokenizer)
    source = data.make_source(cfg.dataset, cfg.text_column, cfg.dataset_config)
    model = build_model(cfg, tokenizer)
    cfg.init_from = began_from  # (resumed without the flag: the run's own, for run.json and the model card)
    tokenizer.model_max_length = model.config.max_position_embeddings  # long documents are packed, not truncated
    cfg.attention_mode = model.config.attention_mode  # the flag's or the --model file's: run.json records it
    check_backend(cfg, accelerator.device)
    check_dense_attention_trains(cfg, model.config, accelerator.device)
    note_dense_document_mask(cfg, model.config, accelerator.device, accelerator.print)
    hub_api = hub.preflight_on_main(accelerator, cfg.push_to_hub, private=cfg.hub_private)
    val_rows = data.validation_rows(source, tokenizer, cfg.seq_len, cfg.val_every_doc, cfg.val_tokens,
                                    cfg.cross_doc_attention)  # fmt: skip
    note_short_validation(cfg, val_rows, tokenizer.eos_token_id, say)
    schedule = EvalSchedule(cfg.eval_every if val_rows else 0, stats_every(cfg, val_rows, say), cfg.max_steps,
                            out_dir / "stats.jsonl")  # fmt: skip
    long_context = long_context_settings(cfg, tokenizer, model.config.vocab_size, say) if cfg.eval_long_context else None
    # only now: a run that fails in its checks above leaves no empty directory behind
    lock = claim_output_dir(cfg, out_dir, accelerator)
    cleanup.insert(0, lock.close if lock else lambda: None)  # released after the watchdog's last heartbeat
    watchdog.beat(phase="setup")
    if cfg.eval_only:
        return evaluate_only(cfg, accelerator, model, val_rows, source, out_dir, tokenizer, long_context, watchdog)

    # --- the model, its optimizer, and where the run stands
    if cfg.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    n_params = sum(p.numel() for p in model.parameters())
    flops = metrics.flops_per_token(model, cfg.seq_len)  # (dense-equivalent, NSA-executed)
    optimizer = make_optimizer(model, cfg, accelerator.device)
    model, optimizer = accelerator.prepare(model, optimizer)
    unwrapped = accelerator.unwrap_model(model)  # without DDP: evaluation, export, digests
    # --compile: the training steps call a compiled wrapper of the prepared model; checkpoints, evaluation,
    # generation and the export use the model itself, so no parameter is renamed ("_orig_mod.") and evaluation's
    # other shapes never recompile
    forward = torch.compile(model) if cfg.compile else model
    # cwd: what relative paths among the flags are relative to (a resume from another directory compares them so)
    run_config = asdict(cfg) | {"output_dir": str(out_dir), "world_size": world, "cwd": os.getcwd()}
    checkpoints = checkpoint.RunCheckpoints(accelerator, out_dir / "checkpoints", run_config,
                                            checkpoint.model_fields(unwrapped.config), cfg.keep_last)  # fmt: skip
    # A finished run whose last checkpoint came before its end (--save-every 0 with a SIGTERM checkpoint) is finished
    # too: its end is in final/ and summary.json, not in a checkpoint. (Every launch that trains removes
    # summary.json first, below, so one left here was written by the last launch that trained, at its end.)
    ended = checkpoint.finished_step(out_dir) if cfg.resume == "latest" else None
    run = checkpoints.resume(cfg.resume, started, ended)  # (checks its model and data flags against this run's)
    resumed_at, last = run.step, max(run.step, ended or 0)
    if last >= cfg.max_steps and (out_dir / "final").is_dir():  # final/, its card and summary.json stay as they are
        say(f"the run is finished: step {last} >= --max-steps {cfg.max_steps} and {out_dir / 'final'} is "
            "exported; nothing to do (raise --max-steps to train further).")
        watchdog.beat(step=last, phase="done")
        return json.loads((out_dir / "summary.json").read_text()) if last > run.step else \
            run.summary(finished=True, output_dir=str(out_dir))
    if ended is not None and run.step < ended:
        say(f"note: the latest checkpoint is at step {run.step}, before the run's end at step {ended} (kept in "
            f"final/, not in a checkpoint): steps {run.step + 1}-{min(ended, cfg.max_steps)} are trained again on "
            f"the way to --max-steps {cfg.max_steps}.")
    if main_proc:  # this launch trains: the summary of an earlier one no longer describes the run
        (out_dir / "summary.json").unlink(missing_ok=True)
    packer = data.Packer(source, tokenizer, cfg.seq_len, rank=accelerator.process_index, world_size=world,
                         seed=cfg.seed, shuffle_buffer=cfg.shuffle_buffer, val_every=cfg.val_every_doc,
                         cross_doc=cfg.cross_doc_attention, state=run.data, shard=cfg.data_shard)  # fmt: skip
    loader = data.BatchLoader(packer, cfg.micro_batch_size)
    cleanup.append(loader.close)
    loader = read_on_every_process(loader, accelerator)
    exporter = Exporter(cfg, accelerator, tokenizer, out_dir, hub_api, n_params=n_params, precision=precision,
                        source=source)  # fmt: skip
    if main_proc:
        extra = {"data": source.describe(), "flops_per_token": dict(zip(("dense", "nsa"), flops))}
        if isinstance(source, data.LocalFiles):  # (streamed and built-in sources have no local files to name)
            extra["data_files"] = data.file_fingerprints(source.files)
        record = metrics.write_run_record(out_dir / "run.json", run_config, accelerator, unwrapped, extra,
                                          resumed_from=run.step if cfg.resume else None)  # fmt: skip
        if change := metrics.data_change(record["launches"]):
            say(f"warning: {change}")
    tokens_per_step = announce_run(cfg, say, n_params, source, world, out_dir)

    # --- the loop
    stop = GracefulStop()  # SIGTERM, and a first Ctrl-C: a checkpoint after the step, then exit
    # restored last, after the heartbeat says the process exited: a SIGTERM that the launcher sends when another
    # process fails would otherwise kill this one between the two and leave the heartbeat showing a training step
    cleanup.insert(0, stop.restore)
    model.train()
    log = StepLog(accelerator, out_dir, cfg, run, flops, metrics.peak_flops(accelerator.device, cfg.peak_tflops),
                  run_config)  # fmt: skip
    if run.step == 0 and schedule.due(0):  # the starting point of the validation curve
        log.log_eval(0, evaluate(unwrapped, run, val_rows, cfg.micro_batch_size, accelerator, **schedule.what(0)))
    stop_at = min(cfg.max_steps, cfg.stop_at_step or cfg.max_steps)  # the step this launch trains to
    if run.step < stop_at:  # (the card describes the schedules the weights trained under)
        run.follow_schedule(cfg)
    if run.step >= stop_at and run.step < cfg.max_steps:
        say(f"step {run.step} is at or past --stop-at-step {cfg.stop_at_step}: nothing to train in this launch "
            f"(raise --stop-at-step, or drop it to train to --max-steps {cfg.max_steps}).")
    while run.step < stop_at:
        lr = set_learning_rate(optimizer, lr_at(run.step, cfg))
        micro_batches = [next(loader) for _ in range(cfg.grad_accum)]  # (batch, DataState after it)
        step_loss, grad_norm, updated = train_step(model, forward, optimizer, micro_batches, cfg, accelerator, precision)
        if not updated:
            skip_nonfinite_step(cfg, run, checkpoints, step_loss, grad_norm, lr, precision)
        epoch_before = run.data.epoch
        run.advance(tokens_per_step, data=micro_batches[-1][1])
        note_new_epoch(run.step, epoch_before, run.data.epoch, world, cfg.data_shard, say)
        log.step_done(step_loss if updated else None)
        watchdog.beat(step=run.step, tokens_seen=run.tokens_seen)
        if log.due(run.step):
            log.log_training(run, lr, grad_norm)
        if schedule.due(run.step):
            log.log_eval(run.step, evaluate(unwrapped, run, val_rows, cfg.micro_batch_size, accelerator,
                                            **schedule.what(run.step)))  # fmt: skip
            watchdog.beat(step=run.step, phase="eval")
        signalled = stop.requested(accelerator)  # (a collective under DDP: asked at every step on every process)
        if signalled or run.step == stop_at < cfg.max_steps:
            say(f"{stop.reason} at step {run.step}: saving a checkpoint and exiting" if signalled else
                f"--stop-at-step {cfg.stop_at_step}: saving a checkpoint and exiting; --resume latest continues the "
                f"run to --max-steps {cfg.max_steps}")  # fmt: skip
            save(model, run, checkpoints, exporter, cfg)
            break
        if cfg.save_every and run.step % cfg.save_every == 0 and run.step < cfg.max_steps:
            save(model, run, checkpoints, exporter, cfg)
            watchdog.beat(step=run.step, phase="save")
            log.restart_clock()

    # --- the end: final checkpoint and export, then the summary
    stop.stop_listening_for_interrupts()  # (from here a Ctrl-C stops at once: no step is left to end cleanly)
    finished = run.step >= cfg.max_steps and not stop.stopped
    if finished:
        # (none trained since resuming one of this run's checkpoints: that one is this step's; resumed from another
        # run's, e.g. the README's export of a checkpoint into a new --output-dir, it is copied here, so that the
        # new folder can train further with --resume latest)
        if cfg.save_every and (run.step > resumed_at or not checkpoints.holds(checkpoints.resumed_from)):
            save(model, run, checkpoints, exporter, cfg)
        exporter.export(model, run, "final" if cfg.push_to_hub else "")
        if cfg.sample_prompt:  # on every process: under FSDP each forward gathers the shards from all of them
            say_sample(unwrapped, tokenizer, cfg.sample_prompt, accelerator)
        if long_context:  # on every process too (split under DDP); after the export, which it cannot lose by failing
            with beating(watchdog, unwrapped, step=run.step, phase="long_context"):
                log.log_eval(run.step, evaluate_long_context(unwrapped, tokenizer, run, long_context,
                                                             out_dir / "long_context", accelerator))  # fmt: skip
            exporter.update_card(model, run, "model card: long-context retrieval")
    log.close()
    digests = metrics.replica_digests(unwrapped, accelerator)  # DDP replicas must hold bit-identical weights
    summary = run.summary(finished=finished, output_dir=str(out_dir), weight_digests=digests)
    if not finished and run.step >= stop_at:  # (ab_compare reads it: stopped as asked, with a SIGTERM there too)
        summary["stopped_at_step"] = cfg.stop_at_step
    if main_proc:
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        say(f"done: {json.dumps(summary)}")
    watchdog.beat(step=run.step, phase="done" if finished else "stopped")  # (by SIGTERM or --stop-at-step: resumable)
    if cfg.report_to != "none":  # last: it also destroys the process group, so no collective may follow it
        accelerator.end_training()
    return summary


if __name__ == "__main__":
    config = parse_args()
    try:
        main(config)
    except (ValueError, FileNotFoundError, ConnectionError, ImportError, hub.HubError, FloatingPointError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
