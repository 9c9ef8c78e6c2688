"""Where a trained model's attention goes when it answers a retrieval prompt, per layer and head: a table.

    python bench/retrieval_anatomy.py runs/ft_passkey/nsa-seed1/final runs/ft_passkey/dense-seed1/final \
        --lengths 224 --samples 20 --out runs/anatomy

`nsa_train.long_context` says whether a model answers and whether NSA's selection holds the answer's block. This
says what happens between the two. Each case (the long-context evaluation's own, seeded the same way) runs once,
teacher-forced: the prompt and the answer but its last token. At each query that predicts an answer token (the
prompt's last token for the first, then each answer token for the next), for every layer and query head, it
measures the attention probability on the token to be copied: the position in the hidden item holding that answer
token (each mention of the key, summed; where the tokenizer merged the answer with its neighbours, the whole item),
and on the whole hidden item. The means are over the cases and their answer tokens, less those that are
whitespace alone (a passkey answer's leading space, which the question's last words predict).

- NSA mode, per branch (the reference's branches on the layer's own inputs, `nsa_reference.reference_branches`,
  attending the blocks the model's own layers selected: the Triton kernels' top-n where they run): the selected
  branch's probability on the token (0 when its block is not selected); the compressed branch's on the compressed
  tokens whose l keys hold it; the window's (0 beyond w keys back); the three gates (paper Eq. 5); the share of
  queries whose KV group selected the token's block; and the gated sum g_cmp p_cmp + g_slc p_slc + g_win p_win,
  the weight the layer's output gives the token's values (the gates are independent sigmoids: it can pass 1).
- Dense mode (this project's model with `--attention-mode dense`): the softmax probability on the token.
- Both: whether the model's argmax at every answer query is the answer's token (teacher-forced exact answer).

Per layer the table shows the head whose selected branch (NSA: the window cannot see the item and a compressed
token mixes l keys) or softmax (dense) puts the most probability on the hidden item: retrieval in a small model is
one head's work; the JSON holds every head. A failure with the block selected and little selected-branch
probability on the token points at the selected branch's queries and keys; one with the probability there but a
small slc gate at the gate; one with both there at the layers after.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from modeling_nsa.nsa_reference import reference_branches  # noqa: E402
from nsa_train.long_context import (  # noqa: E402
    DEFAULT_DEPTHS, RetrievalCase, answer_mentions, build_cases, check_depths, check_task, load_model_and_tokenizer, run_command,
)  # fmt: skip
from modeling_nsa.modeling_nsa import BRANCHES  # noqa: E402  (the gates' order: cmp, slc, win)
from nsa_train.selection_stats import _attention_modules, _kernels_select, _model_code  # noqa: E402

def copy_sources(case: RetrievalCase) -> list[list[int]]:
    """For answer token i, the prompt positions holding it inside the hidden item (every mention of the whole
    answer there); where the item's tokens do not hold the answer's (a tokenizer that merged them with their
    neighbours), every position of the item."""
    starts = answer_mentions(case)
    if not starts:
        whole_item = list(range(case.needle_start, case.needle_start + case.needle_len))
        return [whole_item for _ in case.answer_ids]
    return [[start + i for start in starts] for i in range(len(case.answer_ids))]


def check_model(model) -> str:
    """"nsa" or "dense": the attention mode of this project's model; anything else is refused with the fix."""
    config = model.config
    if getattr(config, "model_type", None) != "nsa" or not _attention_modules(model):
        raise ValueError(f"MODEL is a {getattr(config, 'model_type', type(model).__name__)!r} model: the anatomy reads "
                         "this project's NSA models (attention_mode 'nsa' or 'dense'); for another causal LM use "
                         "python -m nsa_train.long_context, which scores any model.")  # fmt: skip
    return config.attention_mode


ABLATIONS = (*BRANCHES, "slc-item")  # a branch's gate at 0; the selected branch without the item's blocks


def _selection_without(blocks: torch.Tensor, hidden: torch.Tensor, last: int, block_size: int) -> torch.Tensor:
    """blocks (B, Hkv, T, n') selected blocks (in-document = key index // l': one document per row) with every block
    holding a `hidden` key (B, Tk) bool dropped (-1) from the last `last` queries' selections."""
    batch, num_keys = hidden.shape
    num_blocks = (num_keys + block_size - 1) // block_size
    padded = torch.zeros(batch, num_blocks * block_size, dtype=torch.bool, device=hidden.device)
    padded[:, :num_keys] = hidden
    held = torch.zeros(batch, num_blocks + 1, dtype=torch.bool, device=hidden.device)  # the last: unused slots
    held[:, :num_blocks] = padded.view(batch, num_blocks, block_size).any(-1)  # (B, Nb + 1)
    index = torch.where(blocks >= 0, blocks, num_blocks)
    drop = held[:, None, None, :].expand(-1, blocks.shape[1], blocks.shape[2], -1).gather(-1, index)
    drop[:, :, : blocks.shape[2] - last] = False  # earlier queries keep their selection
    return torch.where(drop, torch.full_like(blocks, -1), blocks)


def _without_gate(gates: torch.Tensor, branch: str) -> torch.Tensor:
    """gates (B, T, H, 3) with `branch`'s gate at 0 (a copy): that branch's output scaled to 0."""
    gates = gates.clone()
    gates[..., BRANCHES.index(branch)] = 0
    return gates


@contextmanager
def gate_removed(model, branch: str):
    """While active, `branch`'s gate (one of BRANCHES) is 0 in every NSA layer of `model`, so that branch's output
    never reaches the model; nothing is recorded (`_recording`'s ablations also keep each layer's inputs)."""
    if branch not in BRANCHES:
        raise ValueError(f"branch {branch!r}: one of {list(BRANCHES)}.")
    code, _ = _model_code(model)
    seam = code.nsa_attention

    def without_branch(q, k_cmp, v_cmp, cmp_end, k_slc, v_slc, k_win, v_win, gates, doc_pos, params, **kwargs):
        return seam(q, k_cmp, v_cmp, cmp_end, k_slc, v_slc, k_win, v_win, _without_gate(gates, branch), doc_pos, params,
                    **kwargs)

    code.nsa_attention = without_branch
    try:
        yield
    finally:
        code.nsa_attention = seam


@contextmanager
def _recording(model, mode: str, sink: dict, last: int | None = None, ablate: str | None = None,
               hidden: torch.Tensor | None = None, ablate_layers=None):  # fmt: skip
    """While active, each layer's attention inputs land in sink[layer]. NSA: the nsa_attention seam's arguments,
    and where the model's layers run the Triton kernels their top-n for the last `last` queries ("block_indices";
    the model attends those blocks, and the reference's fp32 top-n on bf16 inputs may break a near tie otherwise).
    `ablate` (ABLATIONS): a branch's gate is 0 in every layer, so its output never reaches the model; or
    "slc-item": in every layer the last `last` queries' selected branch attends its selection less the blocks
    holding a `hidden` key (B, Tk) bool (the hidden item), computed by the reference with those blocks; the
    other branches, and the other queries, unchanged. Does the answer need the selected branch to read the item?
    ablate_layers: the layer indices ablated (default: every layer).
    Dense: the eager attention's probabilities (B, H, Tq, Tk), only the last `last` queries' rows (at 4k tokens a
    layer's whole (T x T) per head is gigabytes), the model switched to eager attention for the while."""
    code, package = _model_code(model)
    current = {"layer": None}
    handles, restore, implementation = [], None, model.config._attn_implementation
    try:
        for m in _attention_modules(model):
            handles.append(m.register_forward_pre_hook(lambda mod, args: current.update(layer=mod.layer_idx)))
        if mode == "nsa":
            seam = code.nsa_attention
            kernels = importlib.import_module(".nsa_triton", package).select_blocks_triton if _kernels_select(model) else None

            def record(q, k_cmp, v_cmp, cmp_end, k_slc, v_slc, k_win, v_win, gates, doc_pos, params, **kwargs):
                ablated = ablate if ablate_layers is None or current["layer"] in ablate_layers else None
                if ablated in BRANCHES:
                    gates = _without_gate(gates, ablated)
                entry = dict(q=q, k_cmp=k_cmp, v_cmp=v_cmp, cmp_end=cmp_end, k_slc=k_slc, v_slc=v_slc, k_win=k_win,
                             v_win=v_win, gates=gates, doc_pos=doc_pos, params=params)  # fmt: skip
                kept = slice(-last, None) if last else slice(None)
                blocks = kernels(q, k_cmp, cmp_end, doc_pos, params) if kernels is not None else None  # (B, Hkv, T, n')
                if ablated == "slc-item":
                    if blocks is None:  # the reference's own top-n
                        blocks = reference_branches(q, k_cmp, v_cmp, cmp_end, k_slc, v_slc, k_win, v_win, doc_pos,
                                                    params).block_indices  # fmt: skip
                    blocks = _selection_without(blocks, hidden.to(blocks.device), last, params.sel_block_size)
                if blocks is not None:
                    entry["block_indices"] = blocks[:, :, kept]  # (B, Hkv, n, n')
                sink[current["layer"]] = entry
                if ablated == "slc-item":
                    branches = reference_branches(q, k_cmp, v_cmp, cmp_end, k_slc, v_slc, k_win, v_win, doc_pos, params,
                                                  block_indices=blocks)  # fmt: skip
                    return branches.gated(gates).to(q.dtype)
                return seam(q, k_cmp, v_cmp, cmp_end, k_slc, v_slc, k_win, v_win, gates, doc_pos, params, **kwargs)

            restore = ("nsa_attention", seam)
        else:
            eager = code.eager_attention_forward

            def record(*args, **kwargs):
                out, weights = eager(*args, **kwargs)
                rows = weights if last is None else weights[:, :, -last:]
                sink[current["layer"]] = rows.detach().float()  # (B, H, Tq or last, Tk)
                return out, weights

            restore = ("eager_attention_forward", eager)
            model.config._attn_implementation = "eager"
        setattr(code, restore[0], record)
        yield
    finally:
        if restore is not None:
            setattr(code, *restore)
        model.config._attn_implementation = implementation
        for h in handles:
            h.remove()


def _masses_on(probs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """probs (B, H, n, K) over K positions, targets (B, n, K) bool -> (B, H, n) the probability on the targets."""
    return (probs * targets[:, None].to(probs.dtype)).sum(-1)


def nsa_layer_anatomy(record: dict, target_sets: dict, num_answer: int) -> dict:
    """One NSA layer at the last num_answer queries. target_sets: {"token": ..., "item": ...}, each (B, n, Tk) bool,
    the key positions each query should copy from and the hidden item's. Returns (B, H, n) tensors: the gates and,
    per target set S, selected_S, p_cmp_S, p_slc_S, p_win_S and gated_S."""
    params = record["params"]
    doc_pos = record["doc_pos"].cpu()
    if not torch.equal(doc_pos, torch.arange(doc_pos.shape[1]).expand_as(doc_pos)):
        raise ValueError("anatomy: a row is not one document from position 0 (padding or a second document); the "
                         "cases must be whole prompts of one length.")  # fmt: skip
    q = record["q"][:, -num_answer:].float()  # (B, n, H, D)
    batch, _, num_heads, _ = q.shape
    branches = reference_branches(q, record["k_cmp"].float(), record["v_cmp"].float(), record["cmp_end"],
                                  record["k_slc"].float(), record["v_slc"].float(), record["k_win"].float(),
                                  record["v_win"].float(), record["doc_pos"], params,
                                  block_indices=record.get("block_indices"))  # fmt: skip

    def per_head(p):  # (B, Hkv, G, n, K) -> (B, H, n, K): head h = kv * G + g, as q's (H,) splits into (Hkv, G)
        return p.reshape(batch, num_heads, num_answer, p.shape[-1]).cpu()

    num_keys = doc_pos.shape[1]
    key_index = torch.arange(num_keys)
    # compressed token c holds keys (cmp_end[c] - l, cmp_end[c]]: it covers a target if any of those is one
    end = record["cmp_end"].cpu()  # (B, Nc)
    covers = (key_index[None, None] <= end[:, :, None]) & (key_index[None, None] > end[:, :, None] - params.cmp_block_size)
    covers = (covers & (end >= 0)[:, :, None]).float()  # (B, Nc, Tk)
    win_index = branches.win_index.cpu()  # (B, Tw)
    in_block = torch.nn.functional.one_hot(key_index // params.sel_block_size).float()  # (Tk, Nb)
    chosen = branches.block_indices.cpu()  # (B, Hkv, n, n') in-document = key index // l' (one document)
    gates = record["gates"][:, -num_answer:].float().cpu().permute(0, 2, 1, 3)  # (B, H, n, 3) in (cmp, slc, win)
    p_cmp, p_slc, p_win = per_head(branches.p_cmp), per_head(branches.p_slc), per_head(branches.p_win)
    out = dict(gate_cmp=gates[..., 0], gate_slc=gates[..., 1], gate_win=gates[..., 2])
    for name, targets in target_sets.items():
        cmp_targets = torch.einsum("bnk,bck->bnc", targets.float(), covers) > 0  # (B, n, Nc)
        win_targets = targets.gather(-1, win_index.clamp(min=0)[:, None].expand(-1, num_answer, -1))
        win_targets &= (win_index >= 0)[:, None]  # (B, n, Tw)
        target_block = torch.einsum("bnk,kj->bnj", targets.float(), in_block) > 0  # (B, n, Nb): j holds a target
        hit = target_block[:, None].expand(-1, chosen.shape[1], -1, -1).gather(-1, chosen.clamp(min=0)) & (chosen >= 0)
        selected = hit.any(-1).repeat_interleave(num_heads // chosen.shape[1], dim=1).float()  # (B, H, n)
        masses = (_masses_on(p_cmp, cmp_targets), _masses_on(p_slc, targets), _masses_on(p_win, win_targets))
        out[f"selected_{name}"] = selected
        out[f"p_cmp_{name}"], out[f"p_slc_{name}"], out[f"p_win_{name}"] = masses
        out[f"gated_{name}"] = sum(gates[..., b] * mass for b, mass in enumerate(masses))
    return out


def dense_layer_anatomy(weights: torch.Tensor, target_sets: dict, num_answer: int) -> dict:
    """One dense layer's eager probabilities (B, H, Tq, Tk) at the last num_answer queries -> {"p_S": (B, H, n)}
    per target set S."""
    at_answer = weights[:, :, -num_answer:].cpu()
    return {f"p_{name}": _masses_on(at_answer, targets) for name, targets in target_sets.items()}


def _target_sets(chunk: list[RetrievalCase], num_keys: int) -> dict:
    """{"token": the positions each answer query should copy (copy_sources), "item": the hidden item's}, each
    (B, n, Tk) bool."""
    n = len(chunk[0].answer_ids)
    token = torch.zeros(len(chunk), n, num_keys, dtype=torch.bool)
    item = torch.zeros(len(chunk), n, num_keys, dtype=torch.bool)
    for row, case in enumerate(chunk):
        item[row, :, case.needle_start : case.needle_start + case.needle_len] = True
        for i, positions in enumerate(copy_sources(case)):
            token[row, i, positions] = True
    return {"token": token, "item": item}


def _best_head(mode: str, heads: dict) -> int:
    """The head that retrieves: the largest probability on the item through the path that reaches it token by
    token (NSA's selected branch: the window cannot see it and a compressed token mixes l keys; dense's softmax)."""
    key = "p_slc_item" if mode == "nsa" else "p_item"
    return max(range(len(heads[key])), key=lambda h: heads[key][h])


def answer_token_weights(chunk: list[RetrievalCase], tokenizer=None) -> torch.Tensor:
    """(B, n): 1 for the answer tokens the measures average over, 0 for whitespace alone (a passkey answer's
    leading space: the text before it predicts it, and its copy positions are the spaces before the key). Without
    a tokenizer every token counts."""
    weights = torch.ones(len(chunk), len(chunk[0].answer_ids))
    if tokenizer is not None:
        for row, case in enumerate(chunk):
            for i, token in enumerate(case.answer_ids):
                weights[row, i] = float(tokenizer.decode([token]).strip() != "")
    return weights


@torch.no_grad()
def anatomy(model, cases: list[RetrievalCase], batch_size: int = 20, tokenizer=None, ablate: str | None = None,
            ablate_layers=None) -> dict:  # fmt: skip
    """Every layer's measures per head, averaged over the cases and their answer tokens (with `tokenizer`: those
    that are not whitespace alone, answer_token_weights), and the teacher-forced exact answers (every token).
    Cases run in batches of one (prompt, answer) length (a needle's answer words differ in tokens). ablate: an NSA
    branch whose gate is set to 0 in every layer (does the model still answer without it?)."""
    mode = check_model(model)
    if ablate is not None and ablate not in ABLATIONS:
        raise ValueError(f"--ablate {ablate!r}: one of {list(ABLATIONS)}.")
    if ablate is not None and mode != "nsa":
        raise ValueError(f"--ablate {ablate}: a model in attention_mode {mode!r} has no NSA branches to ablate; give "
                         "NSA models only with --ablate (the dense twin's anatomy runs without it).")  # fmt: skip
    layers = [m.layer_idx for m in _attention_modules(model)]
    if ablate_layers is not None and ablate is None:
        raise ValueError(f"--ablate-layers {list(ablate_layers)}: give --ablate too (which branch to ablate there).")
    if ablate_layers is not None and not set(ablate_layers) <= set(layers):
        raise ValueError(f"--ablate-layers {list(ablate_layers)}: this model's layers are {layers}.")
    device = next(model.parameters()).device
    model.eval()
    by_shape: dict = {}
    for case in cases:
        by_shape.setdefault((len(case.prompt_ids), len(case.answer_ids)), []).append(case)
    batches = [group[i : i + batch_size] for group in by_shape.values() for i in range(0, len(group), batch_size)]
    sums: dict = {}
    count, correct = 0, []
    for chunk in batches:
        n = len(chunk[0].answer_ids)
        ids = torch.tensor([c.prompt_ids + c.answer_ids[:-1] for c in chunk], device=device)  # (B, T)
        target_sets = _target_sets(chunk, ids.shape[1])
        sink: dict = {}
        hidden = target_sets["item"][:, 0]  # (B, Tk) the hidden item's keys
        with _recording(model, mode, sink, last=n, ablate=ablate, hidden=hidden, ablate_layers=ablate_layers):
            logits = model(input_ids=ids, use_cache=False).logits[:, -n:]  # (B, n, V)
        answers = torch.tensor([c.answer_ids for c in chunk], device=device)
        correct += (logits.argmax(-1) == answers).all(-1).tolist()
        weights = answer_token_weights(chunk, tokenizer).double()[:, None]  # (B, 1, n)
        for layer in sorted(sink):
            measures = (nsa_layer_anatomy(sink[layer], target_sets, n) if mode == "nsa"
                        else dense_layer_anatomy(sink[layer], target_sets, n))  # fmt: skip
            for name, value in measures.items():  # (B, H, n): summed over cases and answer tokens, per head
                total = sums.setdefault(layer, {}).setdefault(name, torch.zeros(value.shape[1], dtype=torch.float64))
                total += (value.double() * weights).sum((0, 2))
        count += float(weights.sum())
    layers = []
    for layer in sorted(sums):
        heads = {name: (total / count).tolist() for name, total in sums[layer].items()}
        layers.append({"layer": layer, "best_head": _best_head(mode, heads), "heads": heads})
    selection_by = "triton" if mode == "nsa" and _kernels_select(model) else ("reference" if mode == "nsa" else None)
    return {"mode": mode, "ablated": ablate, "ablated_layers": ablate_layers, "cases": len(cases),
            "answer_tokens_measured": count, "selection_by": selection_by, "exact_answers": sum(correct) / len(correct),
            "layers": layers}  # fmt: skip


def format_table(results: list[dict]) -> str:
    """One Markdown table for all models: per layer, the head with the largest probability on the item."""
    lines = ["| model | length | exact answers (teacher-forced) | layer | head | token's block selected at the answer "
             "queries (long_context: at the last prompt token) | gates cmp / "
             "slc / win | NSA p on the answer's token: cmp / slc / win | p on the answer's token: gated (NSA), softmax "
             "(dense) | p on the item: slc (NSA), softmax (dense) |",
             "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for result in results:
        for entry in result["layers"]:
            h, heads = entry["best_head"], entry["heads"]
            if result["mode"] == "nsa":
                cells = [f"{heads['selected_token'][h]:.0%}",
                         " / ".join(f"{heads[g][h]:.2f}" for g in ("gate_cmp", "gate_slc", "gate_win")),
                         " / ".join(f"{heads[f'p_{b}_token'][h]:.3f}" for b in ("cmp", "slc", "win")),
                         f"{heads['gated_token'][h]:.3f}", f"{heads['p_slc_item'][h]:.3f}"]  # fmt: skip
            else:
                cells = ["", "", "", f"{heads['p_token'][h]:.3f}", f"{heads['p_item'][h]:.3f}"]
            ablated = result.get("ablated")
            where = "" if result.get("ablated_layers") is None else f" in layers {result['ablated_layers']}"
            mode = result["mode"] + ("" if not ablated else ", slc without the item" + where if ablated == "slc-item"
                                     else f", {ablated} gate 0" + where)  # fmt: skip
            lines.append(f"| {result['name']} ({mode}) | {result['length']} | {result['exact_answers']:.0%} | "
                         f"{entry['layer']} | {h} | " + " | ".join(cells) + " |")  # fmt: skip
    lines += ["", "Per layer, the head whose selected branch (NSA) or softmax (dense) puts the most probability on "
              "the hidden item; anatomy.json holds every head."]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("models", nargs="+", metavar="MODEL", help="runs' final/ directories or saved NSA models (either mode)")
    p.add_argument("--task", default="passkey", help="passkey or needle (as nsa_train.long_context)")
    p.add_argument("--lengths", type=int, nargs="+", default=[224], help="case lengths in tokens (prompt and answer)")
    p.add_argument("--depths", type=float, nargs="+", default=list(DEFAULT_DEPTHS), help="where the item sits")
    p.add_argument("--samples", type=int, default=20, help="cases per (length, depth)")
    p.add_argument("--seed", type=int, default=0, help="the cases' seed (the long-context evaluation's default)")
    p.add_argument("--haystack", default=None, help="needle task: the text source (as nsa_train.long_context)")
    p.add_argument("--batch-size", type=int, default=20, help="cases per forward")
    p.add_argument("--tokenizer", default=None, help="a tokenizer directory, a Hub id or byt5, as the trainer's "
                   "--tokenizer (default: each MODEL's own)")
    p.add_argument("--device", default=None, help="default: cuda where there is one, else cpu")
    p.add_argument("--dtype", default="auto", help="the weights' dtype: auto is bfloat16 on cuda, float32 on cpu")
    p.add_argument("--ablate", default=None, choices=ABLATIONS,
                   help="cmp, slc or win: that NSA branch's gate set to 0 in every layer; slc-item: the answer queries' "
                        "selected branch without the blocks holding the hidden item (do the answers survive?)")
    p.add_argument("--ablate-layers", type=int, nargs="+", default=None, metavar="L",
                   help="the layers --ablate acts in (default: every layer)")
    p.add_argument("--out", type=Path, default=None, help="write anatomy.md and anatomy.json here")
    return p


def main(argv=None) -> list[dict]:
    args = build_parser().parse_args(argv)
    check_task(args.task)
    check_depths(args.depths)
    results = []
    for spec in args.models:
        model, tokenizer = load_model_and_tokenizer(spec, args.tokenizer, device=args.device, dtype=args.dtype)
        for length in args.lengths:
            cases, _ = build_cases(tokenizer, args.task, [length], args.depths, args.samples, seed=args.seed,
                                   haystack=args.haystack, vocab_size=model.config.vocab_size)  # fmt: skip
            result = anatomy(model, cases, args.batch_size, tokenizer, args.ablate, args.ablate_layers)
            result.update(name="/".join(Path(spec).parts[-2:]), model=spec, length=length, task=args.task)
            results.append(result)
    table = format_table(results)
    print(table)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "anatomy.md").write_text(table + "\n")
        (args.out / "anatomy.json").write_text(json.dumps(results, indent=1) + "\n")
        print(f"wrote {args.out / 'anatomy.md'} and {args.out / 'anatomy.json'}")
    return results


if __name__ == "__main__":
    run_command(main)
