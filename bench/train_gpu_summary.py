"""Summarize train_accelerate.py runs (metrics.jsonl + summary.json + run.json) as one markdown table.

    python bench/train_gpu_summary.py RUN_DIR [RUN_DIR ...]

tokens/s and MFU are medians over the logging windows after the first (which holds start-up and compilation).
"""

import json
import statistics
from pathlib import Path


def summarize(run: Path) -> dict:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "loss" in r]
    val = {r["step"]: r["val_loss"] for r in rows if "val_loss" in r}
    steady = train[1:] or train
    med = lambda key: statistics.median(r[key] for r in steady) if steady and steady[0].get(key) is not None else None  # noqa: E731
    record = json.loads((run / "run.json").read_text())
    return {
        "run": run.name,
        "attention": record["config"]["attention_mode"]
        + (f" ({record['config']['attn_implementation']})" if record["config"].get("attn_implementation") else ""),
        "device": record["device"].get("gpu", record["device"]["type"]),
        "params": f"{record['num_parameters'] / 1e6:.1f}M",
        "tok/s": f"{med('tok_s'):,.0f}",
        "MFU dense-eq": f"{med('mfu_dense'):.1%}" if med("mfu_dense") is not None else "n/a",
        "MFU NSA-exec": f"{med('mfu_nsa'):.1%}" if med("mfu_nsa") is not None else "n/a",
        "peak GB": f"{max(r['peak_mem_gb'] for r in train):.1f}",
        "loss curve": " ".join(f"{r['step']}:{r['loss']:.2f}" for r in train),
        "val loss": " ".join(f"{s}:{v:.3f}" for s, v in sorted(val.items())),
    }


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, metavar="RUN_DIR", help="a train_accelerate.py --output-dir")
    args = parser.parse_args()
    missing = [str(run) for run in args.runs if not (run / "metrics.jsonl").is_file()]
    if missing:
        parser.error(f"no metrics.jsonl in {', '.join(missing)}: pass train_accelerate.py output directories.")
    results = [summarize(run) for run in args.runs]
    cols = list(results[0])
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in results:
        print("| " + " | ".join(str(r[c]) for c in cols) + " |")
