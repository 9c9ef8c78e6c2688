"""What NSA's gates and selection do in a model, per layer: numbers a researcher can read.

    stats = compute_selection_stats(model, batch)        # batch: the trainer's dict (input_ids, position_ids, ...)
    metrics = flatten_stats(stats)                       # {"stats_l0_gate_cmp_mean": ..., ...} for metrics/TensorBoard
    append_stats_jsonl(out_dir / "stats.jsonl", step, stats)

Per layer, over the valid (non-padding) queries of the batch:

- gates (NSA_SPEC "One layer", step 2; paper Eq. 5): mean and standard deviation of each branch's gate
  (cmp, slc, win) over queries and heads;
- selection (Eqs. 8-12), per query and KV group, from the selected block indices of the reference's top-n
  (`nsa_reference.select_blocks`): the distance in blocks from the query's own block to each block it selects
  (0: its own block) as a histogram with power-of-two bins, its mean, and the share of selected blocks that lie
  wholly before the sliding window (what selection adds beyond the window); the share of selections that are
  forced blocks (the sel_init_blocks first ones and the sel_local_blocks ending at the query's own); the mean
  number of blocks selected; and the overlap between neighbouring queries (t and t + 1 of one document, same
  KV group): |S_t ∩ S_t+1| / |S_t+1|, the share of a query's blocks that the query before it also chose, which
  is what the selected kernel's query tiles share, and the Jaccard index |S_t ∩ S_t+1| / |S_t ∪ S_t+1|.

How the indices are had: the model runs its own forward once (no cache, no gradient) while the layer seam
`nsa_attention` of the model's code records its inputs; the selection is then recomputed on those inputs. On a
CUDA device where the Triton kernels handle the parameters that is their top-n (`select_blocks_triton`: the
selection the kernel path trains with, O(T x n) memory), so whole rows are measured, at any training length.
Elsewhere it is the reference's (`nsa_reference.reference_block_indices`: the compression branch's probabilities
and the top-n, not the other two branches; the same selection as `nsa_attention_reference`'s). There the
layers' own forward runs the reference too, with (queries x keys) masks per layer, so rows are cut to
REFERENCE_MAX_LEN tokens (causal: the kept queries' selections do not change). The statistics name which one
ran (`selection_by`) and the row length measured.
"""

from __future__ import annotations

import importlib
import inspect
import json
import math
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from modeling_nsa.modeling_nsa import BRANCHES  # the gates' order (cmp, slc, win), paper Eq. 5

REFERENCE_MAX_LEN = 2048  # tokens per row where the reference runs the layers: its masks are (T x T)


@dataclass
class LayerSelection:
    """One layer's gates and selection for a batch, on the CPU."""

    layer: int
    gates: torch.Tensor  # (B, T, H, 3) in (cmp, slc, win) order, after the sigmoid
    block_indices: torch.Tensor  # (B, Hkv, T, n') in-document block indices, -1 for unused slots
    doc_pos: torch.Tensor  # (B, T) position in the document, -1 for padding
    params: object  # NSAParams


def _attention_modules(model):
    return [m for m in model.modules() if type(m).__name__ == "NSAAttention"]


def _model_code(model):
    """(the module defining the model's NSAAttention, its package): this project's modeling_nsa, or a checkpoint's
    remote copy, whose sibling modules (reference, kernels) are the ones to use."""
    code = sys.modules[type(_attention_modules(model)[0]).__module__]
    return code, code.__package__ or "modeling_nsa"


@contextmanager
def _recording_seam(model, sink: dict, selected_by: set, use_kernels: bool, last: int | None = None):
    """While active, every NSAAttention's call of its module's `nsa_attention` seam records (gates, block
    indices, doc_pos) in `sink[layer_idx]` and which selection ran ("triton" or "reference") in `selected_by`; the
    call itself runs unchanged. use_kernels: the selection by the Triton kernels' top-n, else (or where they
    refuse the parameters) by the reference. last: keep only the last `last` queries' records (all: None)."""
    modules = _attention_modules(model)
    code, package = _model_code(model)
    try:
        reference_module = importlib.import_module(".nsa_reference", package)
    except ImportError:
        from modeling_nsa import nsa_reference as reference_module
    # the selection alone (the compression branch's probabilities and the top-n); a checkpoint's remote copy
    # older than it has only the whole reference, whose selection is the same
    selection_only = getattr(reference_module, "reference_block_indices", None)
    try:
        kernels = importlib.import_module(".nsa_triton", package).select_blocks_triton
    except ImportError:  # a checkpoint's remote copy without the kernel files
        kernels = None
    seam = code.nsa_attention
    signature = inspect.signature(seam)
    current = {"layer": None}

    def select(a) -> torch.Tensor:
        if use_kernels and kernels is not None and a["q"].shape[1] == a["doc_pos"].shape[1]:
            try:
                indices = kernels(a["q"], a["k_cmp"], a["cmp_end"], a["doc_pos"], a["params"])
                selected_by.add("triton")
                return indices
            except ValueError:  # parameters the kernels do not handle (they say which): the reference
                pass
        if selection_only is not None:
            indices = selection_only(a["q"], a["k_cmp"], a["cmp_end"], a["doc_pos"], a["params"])
        else:
            _, indices = reference_module.nsa_attention_reference(
                a["q"], a["k_cmp"], a["v_cmp"], a["cmp_end"], a["k_slc"], a["v_slc"], a["k_win"], a["v_win"],
                a["gates"], a["doc_pos"], a["params"], return_block_indices=True)  # fmt: skip
        selected_by.add("reference")
        return indices

    def record(*args, **kwargs):
        out = seam(*args, **kwargs)
        a = signature.bind(*args, **kwargs).arguments
        if a.get("query_end") is None:  # a static cache's step is not a forward over the prompt
            cut = slice(-last, None) if last else slice(None)
            sink[current["layer"]] = LayerSelection(current["layer"], a["gates"].detach()[:, cut].float().cpu(),
                                                    select(a)[:, :, cut].cpu(), a["doc_pos"][:, cut].cpu(),
                                                    a["params"])  # fmt: skip
        return out

    handles = [m.register_forward_pre_hook(lambda mod, args: current.update(layer=mod.layer_idx)) for m in modules]
    code.nsa_attention = record
    try:
        yield
    finally:
        code.nsa_attention = seam
        for h in handles:
            h.remove()


def _kernels_select(model) -> bool:
    """Whether the statistics' selection runs on the Triton kernels (whole rows): where the model's own layers
    run them (its nsa_backend resolved on its device by the model's code: a CUDA GPU under 'auto') and they handle
    its NSA parameters (else the layers run the reference too, whose T x T scores need the cut rows)."""
    _, package = _model_code(model)
    try:
        backend = importlib.import_module(".nsa_backend", package)
        kernels = importlib.import_module(".nsa_triton", package)
        params = importlib.import_module(".nsa_layout", package).NSAParams.from_config(model.config)
    except ImportError:  # a checkpoint's remote copy without the kernel files
        return False
    device = next(model.parameters()).device
    try:
        runs_kernels = backend.resolve_nsa_backend(model.config.nsa_backend, device) == "triton"
    except RuntimeError:  # an explicit 'triton' where the kernels cannot run: the forward raises the same, named
        return False
    return runs_kernels and not kernels.triton_unsupported_reason(params, model.config.head_dim, device)


def capture_selections(model, batch: dict, max_rows: int = 2, max_len: int | None = None,
                       last: int | None = None) -> list[LayerSelection]:
    """Run the model once on (at most `max_rows` rows of) `batch` and return every NSA layer's gates and selected
    blocks. Rows are cut to `max_len` tokens (default: whole rows where the kernels select, REFERENCE_MAX_LEN
    where the reference does); `last`: only the last `last` queries' records are kept (their selections still come
    from the whole rows; the CPU copies of a long batch's records are large). A dense model has none: []."""
    return _capture(model, batch, max_rows, max_len, last)[0]


def _capture(model, batch: dict, max_rows: int, max_len: int | None,
             last: int | None = None) -> tuple[list[LayerSelection], str | None, int]:
    """(selections, which selection ran, tokens per row measured)."""
    if not _attention_modules(model) or getattr(model.config, "attention_mode", "nsa") != "nsa":
        return [], None, 0
    if "input_ids" not in batch:
        raise ValueError(f"compute_selection_stats: the batch needs input_ids (got keys {sorted(batch)}).")
    use_kernels = _kernels_select(model)
    if max_len is None:
        max_len = batch["input_ids"].shape[1] if use_kernels else REFERENCE_MAX_LEN
    device = next(model.parameters()).device
    inputs = {k: v[:max_rows, :max_len].to(device) for k, v in batch.items()
              if k in ("input_ids", "position_ids", "attention_mask") and v is not None}  # fmt: skip
    sink: dict = {}
    selected_by: set = set()
    was_training = model.training
    model.eval()
    with torch.no_grad():
        try:
            with _recording_seam(model, sink, selected_by, use_kernels, last):
                model(**inputs, use_cache=False)
        finally:
            model.train(was_training)
    by = "+".join(sorted(selected_by)) or None  # one name unless layers differed
    missing = [m.layer_idx for m in _attention_modules(model) if m.layer_idx not in sink]
    if missing:
        raise RuntimeError(f"compute_selection_stats: layers {missing} did not call the nsa_attention seam of "
                           f"{type(_attention_modules(model)[0]).__module__}; the seam moved, update "
                           "nsa_train/selection_stats.py.")  # fmt: skip
    return [sink[i] for i in sorted(sink)], by, inputs["input_ids"].shape[1]


def distance_bins(num_blocks: int) -> list[str]:
    """Histogram bin labels for distances 0 .. num_blocks - 1: 0, 1, 2-3, 4-7, ..."""
    labels = ["0"]
    low = 1
    while low < max(num_blocks, 2):
        high = 2 * low - 1
        labels.append(str(low) if low == high else f"{low}-{high}")
        low *= 2
    return labels


def distance_bin(distance: torch.Tensor) -> torch.Tensor:
    """Bin index of each distance: 0 -> 0, d >= 1 -> floor(log2(d)) + 1."""
    safe = distance.clamp(min=1).double()
    return torch.where(distance > 0, torch.floor(torch.log2(safe)).long() + 1, torch.zeros_like(distance))


def forced_blocks(block: torch.Tensor, own_block: torch.Tensor, params) -> torch.Tensor:
    """Whether selection block `block` is one a query in block `own_block` always selects (NSA_SPEC "Selection branch", as
    `nsa_reference.select_blocks` forces them): the sel_init_blocks first blocks and the sel_local_blocks ending at
    its own. Broadcasts."""
    return (block < params.sel_init_blocks) | ((block > own_block - params.sel_local_blocks) & (block <= own_block))


def layer_statistics(gates: torch.Tensor, block_indices: torch.Tensor, doc_pos: torch.Tensor, params) -> dict:
    """The statistics of one layer (see the module docstring) from its gates (B, T, H, 3), selected block indices
    (B, Hkv, T, n') and doc_pos (B, T), the queries being all T positions."""
    block = params.sel_block_size
    valid_q = doc_pos >= 0  # (B, T)
    out: dict = {"queries": int(valid_q.sum())}
    gate_values = gates.float()[valid_q]  # (Nq, H, 3)
    for b, name in enumerate(BRANCHES):
        values = gate_values[..., b].reshape(-1)
        out[f"gate_{name}_mean"] = float(values.mean()) if values.numel() else math.nan
        out[f"gate_{name}_std"] = float(values.std(unbiased=False)) if values.numel() else math.nan

    idx = block_indices.long()  # (B, Hkv, T, n)
    chosen = (idx >= 0) & valid_q[:, None, :, None]
    own = (doc_pos.clamp(min=0) // block)[:, None, :, None]  # (B, 1, T, 1)
    distance = own - idx
    forced = chosen & forced_blocks(idx, own, params)
    # a block lies wholly before the window when its last key is older than the window's first key t - w + 1
    beyond_window = chosen & ((idx + 1) * block <= doc_pos[:, None, :, None] - params.window_size + 1)
    total = int(chosen.sum())
    num_blocks = max(1, (doc_pos.shape[1] + block - 1) // block)
    labels = distance_bins(num_blocks)
    bins = torch.bincount(distance_bin(distance[chosen]), minlength=len(labels))[: len(labels)]
    out.update({
        "selections": total,
        "blocks_per_query": total / max(1, int(valid_q.sum()) * idx.shape[1]),
        "distance_mean": float(distance[chosen].double().mean()) if total else math.nan,
        "distance_hist": {label: int(n) for label, n in zip(labels, bins.tolist())},
        "distance_share": {label: int(n) / max(1, total) for label, n in zip(labels, bins.tolist())},
        "beyond_window_share": int(beyond_window.sum()) / max(1, total),
        "forced_share": int(forced.sum()) / max(1, total),
    })  # fmt: skip

    # neighbouring queries t, t + 1 of one document, per KV group: the blocks both chose, compared slot against slot
    # (a query's blocks are distinct), in chunks of queries: memory O(T n'^2 / chunks), not O(T x blocks), which
    # was about 270 MB of booleans per layer at 64k tokens
    start = torch.arange(doc_pos.shape[1])[None, :] - doc_pos  # a document's first index, per token
    pair = valid_q[:, :-1] & valid_q[:, 1:] & (start[:, :-1] == start[:, 1:])  # (B, T - 1)
    this = torch.where(chosen, idx, -1)[:, :, :-1]  # (B, Hkv, T - 1, n'), unused -1 ...
    after = torch.where(chosen, idx, -2)[:, :, 1:]  # ... and -2 here, so unused slots never match
    chunk = max(1, (1 << 22) // max(1, idx.shape[0] * idx.shape[1] * idx.shape[-1] ** 2))
    both = torch.cat([(this[:, :, i:i + chunk, :, None] == after[:, :, i:i + chunk, None, :]).any(-2).sum(-1)
                      for i in range(0, this.shape[2], chunk)], dim=2).double() if this.shape[2] else \
        this.new_zeros(this.shape[:3]).double()  # (B, Hkv, T - 1)
    count = chosen.sum(-1).double()  # (B, Hkv, T) blocks per query
    later = count[:, :, 1:]
    either = count[:, :, :-1] + later - both
    pair = pair[:, None, :].expand_as(both)
    out["neighbour_pairs"] = int(pair.sum())
    out["neighbour_overlap"] = float((both / later.clamp(min=1))[pair].mean()) if pair.any() else math.nan
    out["neighbour_jaccard"] = float((both / either.clamp(min=1))[pair].mean()) if pair.any() else math.nan
    return out


def compute_selection_stats(model, batch: dict, max_rows: int = 2, max_len: int | None = None) -> dict:
    """Per-layer gate and selection statistics of `model` (unwrapped, any device) on a batch of the trainer's
    rows (`input_ids` and optionally `position_ids` / `attention_mask`); rows cut as `capture_selections` cuts
    them. {"layers": []} for a dense model."""
    selections, by, length = _capture(model, batch, max_rows, max_len)
    layers = [{"layer": s.layer, **layer_statistics(s.gates, s.block_indices, s.doc_pos, s.params)} for s in selections]
    rows, row_len = tuple(batch["input_ids"].shape) if "input_ids" in batch else (0, 0)
    if not selections:  # a dense model: the rows it was given
        length = min(row_len, max_len or row_len)
    return {"attention_mode": getattr(model.config, "attention_mode", None), "rows": min(rows, max_rows),
            "seq_len": length, "selection_by": by, "layers": layers}  # fmt: skip


SCALARS = ("gate_cmp_mean", "gate_cmp_std", "gate_slc_mean", "gate_slc_std", "gate_win_mean", "gate_win_std",
           "blocks_per_query", "distance_mean", "beyond_window_share", "forced_share", "neighbour_overlap",
           "neighbour_jaccard")  # fmt: skip


def flatten_stats(stats: dict, group: str = "stats") -> dict[str, float]:
    """Scalars named `<group>_l<layer>_<name>` (the trainer's `<group>_<name>` metric convention: TensorBoard shows
    `<group>/l<layer>_<name>`), plus the mean over layers as `<group>_all_<name>`; the histogram as shares."""
    flat: dict[str, float] = {}
    for layer in stats["layers"]:
        for name in SCALARS:
            flat[f"{group}_l{layer['layer']}_{name}"] = layer[name]
        for label, share in layer["distance_share"].items():
            flat[f"{group}_l{layer['layer']}_distance_{label}"] = share
    if stats["layers"]:
        for name in SCALARS:
            values = [layer[name] for layer in stats["layers"] if not math.isnan(layer[name])]
            flat[f"{group}_all_{name}"] = sum(values) / len(values) if values else math.nan
    return flat


def append_stats_jsonl(path: str | Path, step: int, stats: dict) -> None:
    """One line per measurement: {"step": ..., **stats} (the whole per-layer record, histograms included)."""
    with open(path, "a") as f:
        f.write(json.dumps({"step": step, **stats}) + "\n")


def format_stats(stats: dict) -> str:
    """A Markdown table, one row per layer (for the console and the model card)."""
    if not stats["layers"]:
        return "No selection statistics: the model uses dense attention."
    head = ("| layer | gate cmp | gate slc | gate win | blocks/query | forced | mean distance (blocks) | beyond window | "
            "neighbour overlap |")  # fmt: skip
    lines = [head, "|---" * 9 + "|"]
    for layer in stats["layers"]:
        gates = " | ".join(f"{layer[f'gate_{b}_mean']:.3f} ± {layer[f'gate_{b}_std']:.3f}" for b in BRANCHES)
        lines.append(f"| {layer['layer']} | {gates} | {layer['blocks_per_query']:.2f} | {layer['forced_share']:.1%} | "
                     f"{layer['distance_mean']:.2f} | {layer['beyond_window_share']:.1%} | "
                     f"{layer['neighbour_overlap']:.1%} |")  # fmt: skip
    return "\n".join(lines)


def card_section(stats: dict) -> str:
    """A model card's summary: the per-layer table and what it was measured on."""
    by = {"triton": ", selection by the Triton kernels' top-n", "reference": ", selection by the reference",
          "reference+triton": ", selection by the Triton kernels' top-n in some layers and the reference in others",
          }.get(stats.get("selection_by"), "")
    return (f"### Gates and selection\n\nMeasured on {stats['rows']} row(s) of {stats['seq_len']} tokens{by} "
            f"(`nsa_train.selection_stats`).\n\n{format_stats(stats)}\n")  # fmt: skip


__all__ = ["REFERENCE_MAX_LEN", "LayerSelection", "append_stats_jsonl", "capture_selections", "card_section",
           "compute_selection_stats", "flatten_stats", "forced_blocks", "format_stats", "layer_statistics"]  # fmt: skip
