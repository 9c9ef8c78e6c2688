"""The held-out rows a trained run was evaluated on, as the bench tools that re-evaluate runs read them
(branch_ablation.py, position_shift.py): a MODEL argument read as a run (its final/, its seed and data flags from
its run.json) or as a saved model, the data flags every run of one call agrees on, and those flags as the
trainer's command line spells them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: train_accelerate

import train_accelerate  # noqa: E402  (the trainer's data flag defaults)

# the trainer's data flags that decide its held-out rows: (run.json config key, this script's option)
DATA_FLAGS = (("dataset", "--dataset"), ("dataset_config", "--dataset-config"), ("text_column", "--text-column"),
              ("seq_len", "--seq-len"), ("val_every_doc", "--val-every-doc"), ("val_tokens", "--val-tokens"),
              ("cross_doc_attention", "--cross-doc-attention"))  # fmt: skip
# the trainer's defaults of those flags (what a run whose run.json lacks one used)
TRAINER_DEFAULTS = {key: train_accelerate.TrainConfig.__dataclass_fields__[key].default
                    for key in ("text_column", "val_every_doc", "val_tokens", "cross_doc_attention")}  # fmt: skip


def read_model(spec: str) -> dict:
    """A MODEL argument -> {"spec", "path" (the directory to load), "seed" (None outside a run), "data" (the run's
    data flags from its run.json, {} outside a run)}. A run's directory needs its final/; a run's final/ is read
    as its run (the run.json beside it)."""
    run = Path(spec)
    if run.is_file():  # (a shell glob such as runs/ab/nsa-seed* also matches ab_compare's nsa-seed0.log)
        raise ValueError(f"{spec}: a file, not a model: give a run's directory or a saved model directory (a glob "
                         "such as DIR/nsa-seed*/ matches directories only).")  # fmt: skip
    if not (run / "run.json").is_file() and run.name == "final" and (run.parent / "run.json").is_file():
        run = run.parent
    record = run / "run.json"
    if not record.is_file():
        return {"spec": spec, "path": spec, "seed": None, "data": {}}
    if not (run / "final").is_dir():
        raise ValueError(f"{spec}: a run's directory without final/ (the trainer exports it when the run ends); "
                         "finish the run, or give a saved model directory.")  # fmt: skip
    config = json.loads(record.read_text()).get("config", {})
    seed = config.get("seed")
    return {"spec": spec, "path": str(run / "final"), "seed": seed if isinstance(seed, int) else None,
            "data": {key: config.get(key) for key, _ in DATA_FLAGS if key in config}}  # fmt: skip


def data_flags(models: list[dict], given: dict) -> dict:
    """The held-out rows' flags: each given flag, else the value every run's run.json agrees on; an error naming the
    runs where they disagree, and the flags needed where no run records one."""
    flags = {}
    for key, option in DATA_FLAGS:
        if given.get(key) is not None:
            flags[key] = given[key]
            continue
        recorded = {m["spec"]: m["data"][key] for m in models if key in m["data"]}
        values = {json.dumps(v) for v in recorded.values()}
        if len(values) > 1:
            raise ValueError(f"the runs' {option} differ ({', '.join(f'{s}: {v!r}' for s, v in recorded.items())}): "
                             f"their held-out rows differ; compare runs of one data set, or give {option} to "
                             "evaluate all of them on the same rows.")  # fmt: skip
        flags[key] = next(iter(recorded.values())) if recorded else None
    for key, option in (("dataset", "--dataset"), ("seq_len", "--seq-len")):
        if flags[key] is None:
            raise ValueError(f"no run.json gives {option} (saved models only): pass the runs' {option}.")
    return {key: TRAINER_DEFAULTS.get(key) if flags[key] is None else flags[key] for key, _ in DATA_FLAGS}


def describe_flags(flags: dict) -> str:
    """The held-out rows' flags as the trainer's command line spells them."""
    words = []
    for key, option in DATA_FLAGS:
        value = flags.get(key)
        if key == "cross_doc_attention":
            words += [option] if value else []
        elif value is not None:
            words += [option, str(value)]
    return " ".join(words)
