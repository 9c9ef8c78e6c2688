"""bench/capture_qkv.py on CPU: capture two layers of a tiny saved NSA model (reference backend) over the shared
wiki text, then check the file's metadata and shapes, that the captured inputs give back each layer's attention
output (the layer's own forward, observed by a module hook, not by the capture), and that bench_inputs' crops
line the compressed tokens up with the keys they cover."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "bench"))

import capture_qkv  # noqa: E402

from modeling_nsa import NSAConfig, NSAForCausalLM  # noqa: E402
from modeling_nsa.nsa_layout import NSAParams  # noqa: E402
from modeling_nsa.nsa_reference import nsa_attention_reference  # noqa: E402
from nsa_train.data import LocalFiles, load_tokenizer  # noqa: E402

NSA = dict(cmp_block_size=8, cmp_stride=4, sel_block_size=16, sel_num_blocks=3, sel_init_blocks=1,
           sel_local_blocks=1, window_size=16)
SEQ_LEN = 96

needs_data = pytest.mark.skipif(not (capture_qkv.DEFAULT_DATA.is_file() and capture_qkv.DEFAULT_TOKENIZER.is_dir()),
                                reason=f"the shared text {capture_qkv.DEFAULT_DATA} and its tokenizer are not here")


@pytest.fixture(scope="module")
def captured(tmp_path_factory):
    """A tiny NSA model (GPT-2's vocabulary) saved, then layers 0 and 2 of 3 captured from it."""
    torch.manual_seed(0)
    config = NSAConfig(vocab_size=50304, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, cmp_mlp_hidden_size=16,
                       nsa_backend="reference", **NSA)
    checkpoint = tmp_path_factory.mktemp("tiny") / "final"
    NSAForCausalLM(config).save_pretrained(checkpoint)
    out = checkpoint.parent / "captured.pt"
    capture_qkv.main([str(checkpoint), "--out", str(out), "--seq-len", str(SEQ_LEN), "--layers", "2", "0",
                      "--device", "cpu", "--backend", "reference"])
    return checkpoint, capture_qkv.load_capture(out)


@needs_data
def test_metadata_and_shapes(captured):
    checkpoint, saved = captured
    meta = saved["meta"]
    assert meta["layers"] == [0, 2] and sorted(saved["layers"]) == [0, 2]
    assert (meta["seq_len"], meta["batch"], meta["checkpoint"]) == (SEQ_LEN, 1, str(checkpoint))
    assert capture_qkv.layout_of(saved) == (4, 2, 8) and meta["params"] == dict(NSA, window_size=16)
    assert meta["dtype"] == "float32" and meta["tokenizer"].endswith("gpt2-tokenizer")
    assert meta["commit"] is None or len(meta["commit"]) >= 7
    ids = saved["input_ids"]
    first_document = next(iter(LocalFiles(str(capture_qkv.DEFAULT_DATA))))  # the text starts with it
    expected = load_tokenizer(meta["tokenizer"]).encode(first_document)[:SEQ_LEN]
    assert ids.shape == (1, SEQ_LEN) and ids[0, :len(expected)].tolist() == expected
    n_slots = SEQ_LEN // NSA["cmp_stride"]
    shapes = dict(q=(1, SEQ_LEN, 4, 8), k_cmp=(1, n_slots, 2, 8), cmp_end=(1, n_slots), k_slc=(1, SEQ_LEN, 2, 8),
                  v_win=(1, SEQ_LEN, 2, 8), gates=(1, SEQ_LEN, 4, 3), doc_pos=(1, SEQ_LEN), out=(1, SEQ_LEN, 4, 8))
    for layer in (0, 2):
        tensors = saved["layers"][layer]
        assert {name: tuple(tensors[name].shape) for name in shapes} == shapes
        assert torch.equal(tensors["doc_pos"][0], torch.arange(SEQ_LEN))
    assert not torch.equal(saved["layers"][0]["q"], saved["layers"][2]["q"])


@needs_data
def test_captured_inputs_reproduce_each_layers_attention(captured):
    """The layer's own output (o_proj of the op), observed by a hook on the module in a fresh forward, equals
    o_proj of the reference op run on the captured tensors."""
    checkpoint, saved = captured
    model = NSAForCausalLM.from_pretrained(checkpoint).eval()
    seen = {}
    attention = [layer.self_attn for layer in model.model.layers]
    handles = [attention[i].register_forward_hook(lambda m, a, out, i=i: seen.update({i: out[0]})) for i in (0, 2)]
    with torch.no_grad():
        model(input_ids=saved["input_ids"], use_cache=False)
    for handle in handles:
        handle.remove()
    for layer in (0, 2):
        x = saved["layers"][layer]
        inputs = [x[name] for name in capture_qkv.INPUT_NAMES]
        with torch.no_grad():
            out = nsa_attention_reference(*inputs, NSAParams(**saved["meta"]["params"]))
            projected = attention[layer].o_proj(out.reshape(1, SEQ_LEN, -1))
        torch.testing.assert_close(out, x["out"])
        torch.testing.assert_close(projected, seen[layer], rtol=1e-5, atol=1e-6)


@needs_data
def test_bench_inputs_crop_the_capture(captured):
    _, saved = captured
    p = NSAParams(**saved["meta"]["params"])
    T = 48
    x, cmp_end, doc_pos = capture_qkv.bench_inputs(saved, 2, T, 4, 2, 8, p, layer=2, device="cpu",
                                                   dtype=torch.float32)
    source = saved["layers"][2]
    assert x["q"].shape == (2, T, 4, 8) and x["q"].requires_grad and doc_pos.tolist() == [list(range(T))] * 2
    torch.testing.assert_close(x["k_slc"][1], source["k_slc"][0, T:2 * T])
    real = int((cmp_end[0] >= 0).sum())
    # the second crop starts at key 48: its compressed token j is the captured token 48 / d + j
    torch.testing.assert_close(x["k_cmp"][1, :real], source["k_cmp"][0, T // 4:T // 4 + real])
    assert not x["k_cmp"][:, real:].any()
    # the first crop is the captured row's first T tokens, so (causal) its output is the captured output there
    args = [x[n].detach() if n in x else {"cmp_end": cmp_end, "doc_pos": doc_pos}[n] for n in capture_qkv.INPUT_NAMES]
    torch.testing.assert_close(nsa_attention_reference(*args, p)[0], source["out"][0, :T])
    # more rows than the capture holds wrap round it at multiples of the stride
    x, _, _ = capture_qkv.bench_inputs(saved, 3, T, 4, 2, 8, p, device="cpu", dtype=torch.float32, grad=False)
    assert x["q"].shape == (3, T, 4, 8)
    with pytest.raises(ValueError, match="exceeds the captured"):
        capture_qkv.bench_inputs(saved, 1, 2 * SEQ_LEN, 4, 2, 8, p, device="cpu")
    with pytest.raises(ValueError, match="capture from a model of that layout"):
        capture_qkv.bench_inputs(saved, 1, T, 16, 1, 8, p, device="cpu")
