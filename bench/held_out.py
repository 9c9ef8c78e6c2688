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
from nsa_train import checkpoint  # noqa: E402

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
    saved = json.loads(record.read_text())
    config = saved.get("config", {})
    seed = config.get("seed")
    data = {key: config.get(key) for key, _ in DATA_FLAGS if key in config}
    launches = saved.get("launches") or [{}]
    if "dataset" in data:  # a relative path was relative to where the run was launched, not to this process
        data["dataset"] = checkpoint.dataset_as_launched(data["dataset"], launches[-1].get("cwd"))
    return {"spec": spec, "path": str(run / "final"), "seed": seed if isinstance(seed, int) else None, "data": data,
            "data_sha256": launches[-1].get("data_sha256"), "record": str(record)}  # fmt: skip


def check_same_data_files(models: list[dict], dataset: str, text_column: str) -> None:
    """The run's own --dataset must still hold the bytes the run read (run.json's sha256 of each file): a file
    rebuilt or replaced since, under the same name, gives other held-out rows without a word. An error naming the
    run and the files; runs that recorded no digests (streamed data, large corpora) are taken as they are."""
    from nsa_train.data import PARQUET_STREAM, LocalFiles, file_fingerprints, names_local_files

    recorded = {}
    for m in models:
        if m["data"].get("dataset") == dataset and m.get("data_sha256"):
            recorded[m["spec"]] = m["data_sha256"]  # {path as that launch named it: sha256}
    if not recorded or not names_local_files(dataset) or dataset.startswith(PARQUET_STREAM):
        return
    try:
        files = LocalFiles(dataset, text_column).files
    except FileNotFoundError as e:
        spec = next(iter(recorded))
        raise FileNotFoundError(f"{e} (the --dataset of {spec}, from its run.json); give --dataset PATH where that "
                                "data is now.") from None
    fingerprints = file_fingerprints(files)
    if not fingerprints["hashed"]:
        return  # (too large to hash here as in the trainer: sizes only)
    now = {f["path"]: f["sha256"] for f in fingerprints["files"]}
    for spec, then in recorded.items():
        if None in then.values():
            continue  # (the run recorded sizes only)
        # compared as contents (the paths are spelt from other directories): each file's digest, with its count
        if sorted(then.values()) != sorted(now.values()):
            differ = sorted({Path(path).name for path, digest in then.items() if digest not in now.values()} |
                            {Path(path).name for path, digest in now.items() if digest not in then.values()})  # fmt: skip
            raise ValueError(f"--dataset {dataset}: its files are not the ones {spec} read (sha256 differs: "
                             f"{', '.join(differ)}; run.json records what it read), so its held-out rows would be "
                             "other text. Give --dataset PATH of the run's data, or pass --dataset explicitly to "
                             "evaluate on these files knowingly.")


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
    flags = {key: TRAINER_DEFAULTS.get(key) if flags[key] is None else flags[key] for key, _ in DATA_FLAGS}
    if given.get("dataset") is None:  # (a --dataset given is evaluated as given)
        check_same_data_files(models, flags["dataset"], flags["text_column"])
    return flags


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
