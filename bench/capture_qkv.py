"""Capture the attention op's real inputs from a trained NSA checkpoint, for bench/bench_attention.py's
`--inputs captured` (issue 18: random queries are the selected branch's worst case, "correlated" ones are
synthetic; these are a trained model's own).

    python bench/capture_qkv.py runs/nsa-125m/final --out bench/results/captured.pt --seq-len 65536 --layers 0 5 11

Loads the checkpoint (a run's final/ or any NSA checkpoint directory) with this checkout's model code, runs a
forward over real text (documents of a local parquet/jsonl/txt file joined with EOS into one row of --seq-len
tokens, one document: default the shared wiki-summaries parquet and its GPT-2 tokenizer) and saves, for each
asked layer, what enters the attention op: q, k_cmp, v_cmp, cmp_end, k_slc, v_slc, k_win, v_win, gates,
doc_pos, and the op's output. The op is hooked by name (`nsa_attention`, looked up where the model's
attention module calls it), so the capture follows the code wherever that function lives. The forward stops
after the last asked layer (no logits at 64k). The .pt file holds {"meta": ..., "input_ids": ..., "layers":
{layer: {name: tensor}}}; meta gives the layout (heads, KV heads, head_dim, NSA parameters), seq_len, layers,
checkpoint, data, tokenizer, dtype, device, backend and the commit.

`bench_inputs` turns a capture into a benchmark's B rows of T tokens: row b is the captured row's tokens
[s_b, s_b + T) (s_b = b*T while B*T fits the capture, else wrapping round it at multiples of the compressed
stride), each a document of its own; the compressed tokens are the captured ones that cover the crop's keys
(crops start at multiples of the stride d, so they line up). RoPE scores depend only on the distance between
positions, so a crop is the attention a document starting there would get, with the weights the model computed
at the captured positions. A benchmark length above the captured one is refused (capture at least the largest
length benchmarked).
"""

from __future__ import annotations

import argparse
import datetime
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from modeling_nsa.nsa_layout import NSAParams, compressed_token_ends  # noqa: E402

SHARED_DATA = ROOT.parent / "shared" / "data"
DEFAULT_DATA = SHARED_DATA / "wiki-summaries-en.parquet"
DEFAULT_TOKENIZER = SHARED_DATA / "gpt2-tokenizer"
INPUT_NAMES = ("q", "k_cmp", "v_cmp", "cmp_end", "k_slc", "v_slc", "k_win", "v_win", "gates", "doc_pos")
FLOAT_NAMES = ("q", "k_cmp", "v_cmp", "k_slc", "v_slc", "k_win", "v_win", "gates")
FORMAT = 1


class _CaptureDone(Exception):
    """Raised after the last asked layer: the rest of the forward is not needed."""


def read_tokens(data: str, tokenizer, seq_len: int, text_column: str = "text") -> torch.Tensor:
    """(1, seq_len) token ids: the data file's documents in order, each followed by EOS, cut at seq_len."""
    from nsa_train.data import LocalFiles

    ids: list[int] = []
    for text in LocalFiles(str(data), text_column):
        ids.extend(tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id])
        if len(ids) >= seq_len:
            return torch.tensor(ids[:seq_len])[None]
    raise ValueError(f"--data {data} holds {len(ids)} tokens, fewer than --seq-len {seq_len}: give a larger file "
                     "or a smaller --seq-len.")


def _snapshot(x: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU copy (the branch K/V are views of one projection: saving a view saves all of it)."""
    return x.detach().clone(memory_format=torch.contiguous_format).cpu()


def attention_modules(model) -> list:
    """The decoder layers' attention modules, in layer order."""
    return [layer.self_attn for layer in model.model.layers]


def capture_layers(model, input_ids: torch.Tensor, layers: list[int]) -> dict[int, dict[str, torch.Tensor]]:
    """Run the model on input_ids (no cache, no gradients) and return, per asked layer, the inputs of its
    `nsa_attention` call and the call's output ("out"), as CPU tensors."""
    modules = attention_modules(model)
    bad = [i for i in layers if not 0 <= i < len(modules)]
    if bad or not layers:
        raise ValueError(f"--layers {layers}: the model has layers 0..{len(modules) - 1}.")
    if getattr(model.config, "attention_mode", "nsa") != "nsa":
        raise ValueError(f"the checkpoint's attention_mode is {model.config.attention_mode!r}: it runs no NSA op; "
                         "capture from an NSA checkpoint.")
    # the name the attention module's forward looks up when it calls the op (its module's globals)
    scope = type(modules[0]).forward.__globals__
    if "nsa_attention" not in scope:
        raise RuntimeError(f"{type(modules[0]).__module__} calls no function named nsa_attention: update "
                           "bench/capture_qkv.py to the op's new name.")
    original = scope["nsa_attention"]
    current, captured = {"layer": None}, {}

    def hooked(q, k_cmp, v_cmp, cmp_end, k_slc, v_slc, k_win, v_win, gates, doc_pos, params, *args, **kwargs):
        out = original(q, k_cmp, v_cmp, cmp_end, k_slc, v_slc, k_win, v_win, gates, doc_pos, params, *args, **kwargs)
        layer = current["layer"]
        if layer in layers:
            tensors = dict(zip(INPUT_NAMES, (q, k_cmp, v_cmp, cmp_end, k_slc, v_slc, k_win, v_win, gates, doc_pos)))
            captured[layer] = {name: _snapshot(t) for name, t in tensors.items()} | {"out": _snapshot(out)}
            captured[layer]["params"] = asdict(params)
            if len(captured) == len(set(layers)):
                raise _CaptureDone
        return out

    handles = [m.register_forward_pre_hook(lambda mod, args, i=i: current.update(layer=i)) for i, m in
               enumerate(modules)]
    scope["nsa_attention"] = hooked
    try:
        with torch.no_grad():
            model.model(input_ids=input_ids.to(model.device), use_cache=False)
    except _CaptureDone:
        pass
    finally:
        scope["nsa_attention"] = original
        for handle in handles:
            handle.remove()
    missing = sorted(set(layers) - set(captured))
    if missing:
        raise RuntimeError(f"layers {missing} never called nsa_attention (is the model's attention hooked elsewhere?)")
    return captured


def _commit() -> str | None:
    """The checkout's short commit, "+dirty" where tracked files differ from it; None outside a checkout."""

    def git(*args):
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()

    try:
        return git("rev-parse", "--short", "HEAD") + ("+dirty" if git("status", "--porcelain", "-uno") else "")
    except Exception:  # noqa: BLE001 - not a checkout
        return None


def capture(checkpoint: str, out: str, seq_len: int, layers: list[int], data=DEFAULT_DATA, tokenizer=None,
            text_column: str = "text", device: str | None = None, dtype: str | None = None,
            backend: str = "auto") -> dict:
    """Capture `layers` of `checkpoint` on seq_len tokens of `data`, save to `out`; returns what was saved."""
    from modeling_nsa import NSAForCausalLM
    from nsa_train.data import load_tokenizer

    from nsa_train.long_context import check_device

    check_device(device)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    if tokenizer is None:  # the checkpoint's own tokenizer where it has one, else the shared GPT-2 one
        tokenizer = checkpoint if (Path(checkpoint) / "tokenizer_config.json").is_file() else str(DEFAULT_TOKENIZER)
    tok = load_tokenizer(str(tokenizer))
    input_ids = read_tokens(data, tok, seq_len, text_column)
    model = NSAForCausalLM.from_pretrained(checkpoint, nsa_backend=backend)
    if int(input_ids.max()) >= model.config.vocab_size:
        raise ValueError(f"--tokenizer {tokenizer} gives ids up to {int(input_ids.max())}, beyond the checkpoint's "
                         f"vocab_size {model.config.vocab_size}: pass the tokenizer the checkpoint was trained with.")
    model = model.to(device=device, dtype=getattr(torch, dtype)).eval()
    layers = sorted(set(layers))
    tensors = capture_layers(model, input_ids, layers)
    config = model.config
    meta = dict(format=FORMAT, checkpoint=str(checkpoint), data=str(data), tokenizer=str(tokenizer), seq_len=seq_len,
                batch=1, layers=layers, num_attention_heads=config.num_attention_heads,
                num_key_value_heads=config.num_key_value_heads, head_dim=config.head_dim,
                params=tensors[layers[0]]["params"], dtype=dtype, device=device, backend=backend, commit=_commit(),
                date=str(datetime.date.today()))
    saved = dict(meta=meta, input_ids=input_ids, layers=tensors)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    torch.save(saved, out)
    return saved


# ------------------------------------------------------------------------------------------------ benchmark side


def load_capture(path) -> dict:
    saved = torch.load(path, map_location="cpu", weights_only=True)
    if saved.get("meta", {}).get("format") != FORMAT:
        raise ValueError(f"{path}: not a bench/capture_qkv.py file of format {FORMAT} (re-capture it).")
    return saved


def layout_of(saved) -> tuple[int, int, int]:
    meta = saved["meta"]
    return meta["num_attention_heads"], meta["num_key_value_heads"], meta["head_dim"]


def fits(saved, num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether the capture has this head layout (a benchmark row of another layout cannot use it)."""
    return layout_of(saved) == (num_heads, num_kv_heads, head_dim)


def bench_inputs(saved, batch: int, seq_len: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 params: NSAParams, layer: int | None = None, device="cuda", dtype=torch.bfloat16, grad=True):
    """bench_attention.nsa_inputs' (inputs, cmp_end, doc_pos) from a capture: B rows of one T-token document,
    each a crop of the captured row (module docstring); `layer` defaults to the middle captured layer."""
    meta = saved["meta"]
    if not fits(saved, num_heads, num_kv_heads, head_dim):
        raise ValueError(f"the capture is {layout_of(saved)} (heads, KV heads, head_dim), the benchmark asks for "
                         f"{(num_heads, num_kv_heads, head_dim)}: capture from a model of that layout.")
    if NSAParams(**meta["params"]) != params:
        raise ValueError(f"the capture's NSA parameters {meta['params']} differ from the benchmark's {params}.")
    captured_len = meta["seq_len"]
    if seq_len > captured_len:
        raise ValueError(f"benchmark length {seq_len} exceeds the captured {captured_len} tokens: capture with "
                         f"--seq-len {seq_len} or more.")
    layer = meta["layers"][len(meta["layers"]) // 2] if layer is None else layer
    source = saved["layers"][layer]
    if not torch.equal(source["doc_pos"][0], torch.arange(captured_len)):
        raise ValueError("the captured row is not one document (doc_pos is not 0..T-1): re-capture it.")
    stride = params.cmp_stride
    room = captured_len - seq_len + 1  # crop starts that fit
    starts = [b * seq_len if batch * seq_len <= captured_len else (b * seq_len) % room // stride * stride
              for b in range(batch)]
    doc_pos = torch.arange(seq_len).expand(batch, seq_len).contiguous()
    cmp_end = compressed_token_ends(doc_pos, params)  # (B, T // d)
    slots, real = cmp_end.shape[1], int((cmp_end[0] >= 0).sum())

    def crop(name, s):
        return source[name][0, s:s + seq_len]

    def crop_cmp(name, s):  # the captured tokens covering the crop's keys, then empty (zero) slots
        tokens = source[name][0, s // stride:s // stride + real]
        return torch.cat([tokens, tokens.new_zeros(slots - real, *tokens.shape[1:])])

    x = {name: torch.stack([(crop_cmp if name in ("k_cmp", "v_cmp") else crop)(name, s) for s in starts])
         for name in FLOAT_NAMES}
    x = {name: t.to(device=device, dtype=dtype).requires_grad_(grad) for name, t in x.items()}
    return x, cmp_end.to(device), doc_pos.to(device)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", help="an NSA checkpoint directory (a run's final/)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--seq-len", type=int, default=65536)
    ap.add_argument("--layers", type=int, nargs="+", default=None, help="default: first, middle and last")
    ap.add_argument("--data", default=str(DEFAULT_DATA), help="parquet/jsonl/txt file(s) of documents")
    ap.add_argument("--text-column", default="text")
    ap.add_argument("--tokenizer", default=None, help="default: the checkpoint's, else the shared GPT-2 tokenizer")
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--backend", default="auto", choices=["auto", "reference", "triton"])
    args = ap.parse_args(argv)
    if args.layers is None:
        n = _num_layers(args.checkpoint)
        args.layers = sorted({0, n // 2, n - 1})
    saved = capture(args.checkpoint, args.out, args.seq_len, args.layers, args.data, args.tokenizer,
                    args.text_column, args.device, args.dtype, args.backend)
    meta = saved["meta"]
    q = saved["layers"][meta["layers"][0]]["q"]
    print(f"captured layers {meta['layers']} of {args.checkpoint} over {args.seq_len} tokens of {args.data}: q "
          f"{tuple(q.shape)} {q.dtype}, {meta['num_attention_heads']} q / {meta['num_key_value_heads']} kv heads, "
          f"commit {meta['commit']} -> {args.out}")


def _num_layers(checkpoint) -> int:
    from modeling_nsa import NSAConfig

    return NSAConfig.from_pretrained(checkpoint).num_hidden_layers


if __name__ == "__main__":
    main()
