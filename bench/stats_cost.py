"""What the trainer's selection statistics (`--stats-every`) cost: one measurement against one training step.

    OMP_NUM_THREADS=1 python bench/stats_cost.py                     # the smoke preset on CPU
    python bench/stats_cost.py --preset smoke --model-overrides '{"num_hidden_layers": 4}' --device cuda

The model is built by the trainer's own build path (any train_accelerate.py flags after the script's); a step
is forward, backward and AdamW on one micro-batch of random tokens; a measurement is
`compute_selection_stats` on STATS_ROWS rows of it, as `nsa_train.evaluation.selection_statistics` runs it.
Prints the medians, their ratio and the share of training time at every evaluation (`--eval-every`) and at
`--stats-every N` for a few N.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import train_accelerate  # noqa: E402
from nsa_train import data  # noqa: E402
from nsa_train.long_context import check_device  # noqa: E402
from nsa_train.evaluation import STATS_ROWS  # noqa: E402
from nsa_train.selection_stats import compute_selection_stats  # noqa: E402


def median_seconds(fn, device, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog="Every other flag is train_accelerate.py's (see its --help): they build the model and set the "
               "micro-batch (--micro-batch-size x --seq-len) a step trains on; none given: --preset smoke.")
    parser.add_argument("--device", default="cpu", help="where both are timed: cpu, cuda or cuda:N")
    parser.add_argument("--repeats", type=int, default=7, help="timed runs of each after one warm-up; medians taken")
    args, train_flags = parser.parse_known_args()
    cfg = train_accelerate.parse_args(train_flags or ["--preset", "smoke"])
    try:
        check_device(args.device)
    except ValueError as e:
        sys.exit(f"error: {e}")
    device = torch.device(args.device)
    torch.manual_seed(cfg.seed)
    model = train_accelerate.build_model(cfg, data.load_tokenizer(cfg.tokenizer)).to(device)
    if model.config.attention_mode != "nsa":
        sys.exit("error: a dense model has no selection to measure (the trainer skips the statistics); drop "
                 "--attention-mode dense.")  # fmt: skip
    optimizer = train_accelerate.make_optimizer(model, cfg, device)
    ids = torch.randint(0, model.config.vocab_size, (cfg.micro_batch_size, cfg.seq_len), device=device)
    positions = torch.arange(cfg.seq_len, device=device).expand_as(ids)
    batch = {"input_ids": ids, "position_ids": positions, "labels": ids}

    def step():
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    measured = {}

    def measure():
        measured.update(compute_selection_stats(model, {k: v[:STATS_ROWS] for k, v in batch.items()},
                                                max_rows=STATS_ROWS))

    step_s, stats_s = median_seconds(step, device, args.repeats), median_seconds(measure, device, args.repeats)
    ratio = stats_s / step_s
    params = sum(p.numel() for p in model.parameters()) / 1e6
    print(f"{params:.2f}M params, {device}: step ({cfg.micro_batch_size} x {cfg.seq_len}) "
          f"{step_s * 1e3:.1f} ms; statistics ({measured['rows']} x {measured['seq_len']}, selection by "
          f"{measured['selection_by']}) {stats_s * 1e3:.1f} ms = {ratio:.1%} of a step")  # fmt: skip
    every = [f"at every evaluation (--eval-every {cfg.eval_every}) {ratio / cfg.eval_every:.2%}"] if cfg.eval_every else []
    every += [f"--stats-every {n} {ratio / n:.2%}" for n in (1, 10, 100)]
    print("share of training time: " + "; ".join(every))


if __name__ == "__main__":
    main()
