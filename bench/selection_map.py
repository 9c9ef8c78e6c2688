"""Which blocks each query selected, for one prompt, one layer and one KV head group: a PNG.

    python bench/selection_map.py runs/nsa/final --prompt-file some.txt --layer 3 --group 0 --out map.png
    python bench/selection_map.py runs/nsa/final --prompt "The Python language ..." --layer 0
    python bench/selection_map.py runs/ft_passkey/nsa-seed0/final --task passkey --length 1024 --depth 0.5 --layer 1

Rows are the prompt's queries (top: the first token), columns the selection blocks of l' keys. A cell is
dark blue where the query selected the block by its score (paper Eqs. 9-11), orange where the block was forced
(the first sel_init_blocks and the sel_local_blocks ending at the query's own), light green where the sliding
window covers part of the block (it is attended whether selected or not) and light grey where the block is
eligible but was not chosen; white is the future. The block indices are the reference's top-n
(`nsa_train.selection_stats.capture_selections`), so the picture is what the model computes on any backend.
The layer's statistics (`nsa_train.selection_stats`) are printed beside it.

`--task passkey|needle` builds the prompt as `nsa_train.long_context` does (`--length` tokens with the answer,
the hidden item at `--depth`; `--sample` picks which case of that cell) and maps the prompt with its answer: red
lines mark the selection blocks that hold the hidden item, black ones the queries that predict the answer's
tokens (the last prompt token's and the answer's own, as the model reads the answer), and it prints how often
those queries' selections held an item block. Where they did not, the answer came from the compressed branch or
not at all (`bench/retrieval_anatomy.py` tells which).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nsa_train.long_context import run_command  # noqa: E402
from nsa_train.selection_stats import capture_selections, forced_blocks, format_stats, layer_statistics  # noqa: E402

FUTURE, ELIGIBLE, WINDOW, SELECTED, FORCED = 0, 1, 2, 3, 4
COLORS = ["white", "#d9d9d9", "#c7e9c0", "#2b5ca8", "#f28e2b"]


def selection_map(selection, row: int = 0, group: int = 0) -> torch.Tensor:
    """(T, Nb) int8 codes (FUTURE, ELIGIBLE, WINDOW, SELECTED, FORCED) for one row and KV group."""
    params = selection.params
    block = params.sel_block_size
    doc_pos = selection.doc_pos[row]  # (T,)
    indices = selection.block_indices[row, group]  # (T, n')
    num_queries = doc_pos.shape[0]
    num_blocks = (num_queries + block - 1) // block
    j = torch.arange(num_blocks)[None, :]  # (1, Nb)
    pos = doc_pos[:, None]  # (T, 1)
    valid = pos >= 0
    codes = torch.full((num_queries, num_blocks), FUTURE, dtype=torch.int8)
    codes[valid & (j * block <= pos)] = ELIGIBLE
    in_window = valid & ((j + 1) * block > pos - params.window_size + 1) & (j * block <= pos)
    codes[in_window] = WINDOW
    chosen = torch.zeros(num_queries, num_blocks + 1, dtype=torch.bool)
    chosen.scatter_(1, torch.where(indices >= 0, indices, num_blocks), True)
    chosen = chosen[:, :num_blocks] & valid
    own = pos.clamp(min=0) // block
    forced = forced_blocks(j, own, params)
    codes[chosen] = SELECTED
    codes[chosen & forced] = FORCED
    return codes


def case_marks(case, block_size: int) -> dict:
    """Where a retrieval case's hidden item and answer queries lie in its map (prompt and answer as one row):
    `item_blocks`, the selection blocks holding any token of the item; `answer_queries`, the positions of the
    queries that predict the answer's tokens (the last prompt token's, then each answer token's but the last)."""
    first, last = case.needle_start, case.needle_start + case.needle_len - 1
    start = len(case.prompt_ids) - 1
    return {"item_blocks": list(range(first // block_size, last // block_size + 1)),
            "answer_queries": list(range(start, start + len(case.answer_ids)))}


def item_selected_share(codes: torch.Tensor, marks: dict) -> float:
    """The share of the answer queries whose selection (chosen or forced) held an item block."""
    rows = codes[marks["answer_queries"]][:, marks["item_blocks"]]  # (answer queries, item blocks)
    return float(((rows == SELECTED) | (rows == FORCED)).any(dim=1).float().mean())


def plot_map(codes: torch.Tensor, path: str | Path, title: str, marks: dict | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    num_queries, num_blocks = codes.shape
    fig, ax = plt.subplots(figsize=(min(12, 2 + 0.12 * num_blocks + 3), min(12, 2 + 0.01 * num_queries + 3)))
    ax.imshow(codes.numpy(), cmap=ListedColormap(COLORS), vmin=0, vmax=len(COLORS) - 1, aspect="auto",
              interpolation="nearest")  # fmt: skip
    ax.set_xlabel("key block (l' keys each)")
    ax.set_ylabel("query position")
    ax.set_title(title, fontsize=9)
    legend = [Patch(color=COLORS[c], label=label) for c, label in
              ((SELECTED, "selected (top-n)"), (FORCED, "forced"), (WINDOW, "in the window"), (ELIGIBLE, "not chosen"))]  # fmt: skip
    if marks:  # a retrieval case: the item's blocks (columns) and the answer's queries (rows)
        ax.axvline(marks["item_blocks"][0] - 0.5, color="red", linewidth=0.8)
        ax.axvline(marks["item_blocks"][-1] + 0.5, color="red", linewidth=0.8)
        ax.axhline(marks["answer_queries"][0] - 0.5, color="black", linewidth=0.8)
        ax.axhline(marks["answer_queries"][-1] + 0.5, color="black", linewidth=0.8)
        legend += [Patch(edgecolor="red", facecolor="none", label="hidden item's blocks"),
                   Patch(edgecolor="black", facecolor="none", label="queries predicting the answer")]  # fmt: skip
    ax.legend(handles=legend, fontsize=7, loc="upper right")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="bench/selection_map.py", description=__doc__.split("\n\n")[0])
    p.add_argument("model", metavar="MODEL", help="a run's final/ directory, a saved NSA model or a Hub id")
    text = p.add_mutually_exclusive_group(required=True)
    text.add_argument("--prompt", help="the prompt text")
    text.add_argument("--prompt-file", type=Path, help="a text file holding the prompt")
    text.add_argument("--task", choices=("passkey", "needle"),
                      help="a retrieval case as nsa_train.long_context builds it (with --length, --depth, --sample)")
    p.add_argument("--length", type=int, default=None, help="--task: the case's tokens, prompt and answer")
    p.add_argument("--depth", type=float, default=None, help="--task: where the item is hidden, 0..1 (default 0.5)")
    p.add_argument("--sample", type=int, default=None, help="--task: which case of that length and depth (default 0)")
    p.add_argument("--haystack", default=None,
                   help="--task needle: the documents to hide it in (default: long_context's default haystack)")
    p.add_argument("--layer", type=int, default=0)
    p.add_argument("--group", type=int, default=0, help="KV head group (0 .. num_key_value_heads - 1)")
    p.add_argument("--max-len", type=int, default=2048, help="tokens of the prompt kept")
    p.add_argument("--tokenizer", default=None, help="a tokenizer directory, a Hub id or byt5, as the trainer's "
                   "--tokenizer (default: MODEL's own; a model saved without one needs it)")
    p.add_argument("--out", default=None,
                   help="the PNG, or a folder for layer<L>_group<G>.png (default: <run>/selection_map/ for a run's "
                        "final/, else ./selection_map.png)")
    p.add_argument("--device", default=None)
    args = p.parse_args(argv)
    if args.out is None:  # beside a run's other evaluations (long_context's rule), not in the working directory
        run_dir = Path(args.model).resolve().parent
        args.out = (run_dir / "selection_map" / f"layer{args.layer}_group{args.group}.png"
                    if (run_dir / "run.json").is_file() else Path("selection_map.png"))  # fmt: skip
    elif Path(args.out).is_dir() or args.out.endswith(("/", os.sep)):  # a folder (new: its trailing /): its own name
        args.out = Path(args.out) / f"layer{args.layer}_group{args.group}.png"
    elif not Path(args.out).suffix:  # (matplotlib would write <out>.png and the message name <out>)
        args.out = Path(args.out + ".png")
    args.out = Path(args.out)
    given = [f"--{name} {value}" for name, value in (("depth", args.depth), ("sample", args.sample)) if value is not None]
    if args.task is None and given:
        raise ValueError(f"{' '.join(given)}: these place a retrieval case's item; they take --task passkey|needle "
                         "(and --length), not a --prompt or --prompt-file.")
    args.depth = 0.5 if args.depth is None else args.depth
    args.sample = 0 if args.sample is None else args.sample
    if args.prompt_file is not None and not args.prompt_file.is_file():
        raise ValueError(f"--prompt-file {str(args.prompt_file)!r}: no such file; pass a text file, or the prompt "
                         "itself with --prompt.")
    if (args.task is None) != (args.length is None):
        raise ValueError(f"--length {args.length} and --task {args.task}: give both (a retrieval case of that "
                         "many tokens) or neither (with --prompt or --prompt-file).")
    if args.task is not None and (not 0 <= args.depth <= 1 or args.sample < 0):
        raise ValueError(f"--depth {args.depth} / --sample {args.sample}: give a depth in 0..1 and a sample >= 0.")

    from nsa_train.long_context import load_model_and_tokenizer

    def nsa_only(config):
        if getattr(config, "attention_mode", None) != "nsa":
            raise ValueError(f"MODEL {args.model!r}: not an NSA model (model_type {config.model_type!r}, attention_mode "
                             f"{getattr(config, 'attention_mode', None)!r}); a selection map needs NSA's selection.")  # fmt: skip

    model, tokenizer = load_model_and_tokenizer(args.model, args.tokenizer, device=args.device, dtype="float32",
                                                check_config=nsa_only)  # fmt: skip
    config = model.config
    if not 0 <= args.layer < config.num_hidden_layers:
        raise ValueError(f"--layer {args.layer}: the model has layers 0..{config.num_hidden_layers - 1}.")
    if not 0 <= args.group < config.num_key_value_heads:
        raise ValueError(f"--group {args.group}: the model has KV head groups 0..{config.num_key_value_heads - 1}.")
    marks = None
    if args.task is not None:  # the case's prompt and answer, as the evaluation builds them (errors name the fix)
        from nsa_train.long_context import build_cases, default_haystack

        haystack = args.haystack or default_haystack()
        cases, _ = build_cases(tokenizer, args.task, [args.length], [args.depth], args.sample + 1, haystack=haystack,
                               vocab_size=config.vocab_size, length_flag="--length")  # fmt: skip
        case = cases[args.sample]
        ids = torch.tensor([case.prompt_ids + case.answer_ids])
        marks = case_marks(case, config.sel_block_size)
        max_len = ids.shape[1]
    else:
        prompt = args.prompt if args.prompt is not None else args.prompt_file.read_text(encoding="utf-8")
        # tokenized once, whole (verbose=False: the tokenizer otherwise warns that it is longer than the model
        # takes), then cut to --max-len: a causal LM's special tokens (a BOS) lead the prompt and survive the cut
        prompt_ids = tokenizer(prompt, verbose=False).input_ids
        ids = torch.tensor([prompt_ids[: args.max_len]])
        max_len = args.max_len
        total = len(prompt_ids)
        if total > ids.shape[1]:
            print(f"the prompt cut to {ids.shape[1]} of its {total} tokens (--max-len {args.max_len})")
    if ids.shape[1] < 2:
        raise ValueError("--prompt: give a prompt of at least 2 tokens.")
    selection = capture_selections(model, {"input_ids": ids}, max_rows=1, max_len=max_len)[args.layer]
    stats = {"layers": [{"layer": args.layer, **layer_statistics(selection.gates, selection.block_indices,
                                                                   selection.doc_pos, selection.params)}]}  # fmt: skip
    codes = selection_map(selection, row=0, group=args.group)
    name = "/".join(Path(args.model).parts[-2:])
    what = f"{args.task} at depth {args.depth:g}, " if marks else ""
    plot_map(codes, args.out, f"{name}: {what}layer {args.layer}, KV group {args.group}, {ids.shape[1]} tokens "
                              f"(l'={config.sel_block_size}, n={config.sel_num_blocks}, w={config.window_size})",
             marks)  # fmt: skip
    print(format_stats(stats))
    result = {"codes": codes, "stats": stats}
    if marks:
        result |= {"marks": marks, "item_selected": item_selected_share(codes, marks), "answer": case.answer}
        print(f"the hidden item: selection blocks {marks['item_blocks'][0]}-{marks['item_blocks'][-1]}; the queries "
              f"predicting the answer ({case.answer!r}, positions {marks['answer_queries'][0]}-"
              f"{marks['answer_queries'][-1]}): {result['item_selected']:.0%} of them selected one "
              f"(layer {args.layer}, KV group {args.group})")  # fmt: skip
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    run_command(main)
