"""bench/retrieval_anatomy.py: each branch's probability on the token to copy, checked against a query-by-query
recomputation from the layer's own inputs; dense mode's softmax; the copy positions; errors; the CLI."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch
from transformers import ByT5Tokenizer

from modeling_nsa import NSAConfig, NSAForCausalLM
from modeling_nsa.nsa_reference import nsa_attention_reference, reference_branches
from nsa_train import long_context as lc

REPO = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("retrieval_anatomy", REPO / "bench" / "retrieval_anatomy.py")
anatomy_tool = importlib.util.module_from_spec(spec)
sys.modules["retrieval_anatomy"] = anatomy_tool
spec.loader.exec_module(anatomy_tool)

LENGTH = 240  # tokens per case (prompt and answer; the passkey text needs 223 with ByT5): 15 selection blocks of 16


@pytest.fixture(scope="module")
def byt5():
    return ByT5Tokenizer()


def tiny_model(byt5, mode: str, seed: int = 0, window_size: int = 32) -> NSAForCausalLM:
    """A randomly initialized 2-layer model in `mode` (2 KV groups of 2 heads; 8 of 15 blocks selected, so a case's
    answer block is selected for some queries and not for others; a window of 32 keys sees no hidden item, one of
    128 sees some)."""
    config = NSAConfig(vocab_size=384, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, cmp_block_size=16, cmp_stride=8,
                       sel_block_size=16, sel_num_blocks=8, window_size=window_size, cmp_mlp_hidden_size=16,
                       max_position_embeddings=512, attention_mode=mode, eos_token_id=byt5.eos_token_id,
                       pad_token_id=byt5.pad_token_id)  # fmt: skip
    torch.manual_seed(seed)
    return NSAForCausalLM(config).eval()


def cases(byt5, samples: int = 2):
    built, _ = lc.build_cases(byt5, "passkey", [LENGTH], [0.0, 0.5, 1.0], samples, seed=3)
    return built


def test_reference_branches_are_what_the_reference_gates():
    """The gated sum of reference_branches' outputs is nsa_attention_reference's output (bitwise in the fused
    form the reference itself runs, to fp64 rounding in the written-out form whose probabilities a diagnosis
    reads), and each branch's probabilities sum to 1 over what it sees (the selected branch's only inside the
    chosen blocks)."""
    from modeling_nsa.nsa_layout import NSAParams

    torch.manual_seed(0)
    params = NSAParams(cmp_block_size=16, cmp_stride=8, sel_block_size=16, sel_num_blocks=4, sel_init_blocks=1,
                       sel_local_blocks=2, window_size=32)  # fmt: skip
    batch, num_keys, heads, kv_heads, dim = 2, 97, 4, 2, 8
    q = torch.randn(batch, num_keys, heads, dim, dtype=torch.float64)
    k_slc, v_slc, k_win, v_win = (torch.randn(batch, num_keys, kv_heads, dim, dtype=torch.float64) for _ in range(4))
    num_cmp = (num_keys - 16) // 8 + 1
    k_cmp, v_cmp = (torch.randn(batch, num_cmp, kv_heads, dim, dtype=torch.float64) for _ in range(2))
    cmp_end = (torch.arange(num_cmp) * 8 + 15).expand(batch, -1)
    doc_pos = torch.arange(num_keys).expand(batch, -1)
    gates = torch.rand(batch, num_keys, heads, 3, dtype=torch.float64)
    out, blocks = nsa_attention_reference(q, k_cmp, v_cmp, cmp_end, k_slc, v_slc, k_win, v_win, gates, doc_pos,
                                          params, return_block_indices=True)  # fmt: skip
    b = reference_branches(q, k_cmp, v_cmp, cmp_end, k_slc, v_slc, k_win, v_win, doc_pos, params)
    fused = reference_branches(q, k_cmp, v_cmp, cmp_end, k_slc, v_slc, k_win, v_win, doc_pos, params,
                               probabilities=False)  # fmt: skip
    assert fused.p_slc is None and fused.p_win is None

    def heads_last(o):
        return o.permute(0, 3, 1, 2, 4).reshape(batch, num_keys, heads, dim)

    for branches, tolerance in ((fused, 0.0), (b, 1e-12)):
        gated = (gates[..., 0:1] * heads_last(branches.o_cmp) + gates[..., 1:2] * heads_last(branches.o_slc)
                 + gates[..., 2:3] * heads_last(branches.o_win))  # fmt: skip
        torch.testing.assert_close(gated, out, rtol=0, atol=tolerance)
        assert torch.equal(branches.block_indices, blocks)
    torch.testing.assert_close(fused.p_cmp, b.p_cmp, rtol=0, atol=0)
    torch.testing.assert_close(b.p_slc.sum(-1), torch.ones_like(b.p_slc[..., 0]))
    torch.testing.assert_close(b.p_win.sum(-1), torch.ones_like(b.p_win[..., 0]))
    seen = b.p_cmp.sum(-1)[..., 15:]  # queries from the first compressed token's last key on see one
    torch.testing.assert_close(seen, torch.ones_like(seen))
    key_block = torch.arange(num_keys) // 16
    in_chosen = (key_block[None, None, None, :] == blocks[..., None]).any(-2)  # (B, Hkv, Tq, Tk)
    assert (b.p_slc * ~in_chosen[:, :, None]).abs().max() == 0


def test_copy_sources_are_each_mention_of_the_answer_token(byt5):
    for case in cases(byt5):
        sources = anatomy_tool.copy_sources(case)
        assert len(sources) == len(case.answer_ids)
        for i, positions in enumerate(sources):
            assert len(positions) == 2  # the passkey item names its key twice
            for p in positions:
                assert case.needle_start <= p < case.needle_start + case.needle_len
                assert case.prompt_ids[p] == case.answer_ids[i]
                assert p - i >= case.needle_start and case.prompt_ids[p - i : p - i + len(case.answer_ids)] == case.answer_ids


def test_copy_sources_fall_back_to_the_item_when_the_answer_was_merged(byt5):
    case = cases(byt5)[0]
    merged = lc.RetrievalCase(**{**case.__dict__, "answer_ids": [999, 998]})  # not among the item's tokens
    item = list(range(case.needle_start, case.needle_start + case.needle_len))
    assert anatomy_tool.copy_sources(merged) == [item, item]


def _selected_blocks(record: dict) -> torch.Tensor:
    """(B, Hkv, T, n') the reference's top-n on the layer's inputs."""
    return nsa_attention_reference(*(record[n] for n in ("q", "k_cmp", "v_cmp", "cmp_end", "k_slc", "v_slc", "k_win",
                                                          "v_win", "gates", "doc_pos", "params")),
                                   return_block_indices=True)[1]  # fmt: skip


def _oracle(record: dict, blocks: torch.Tensor, row: int, head: int, query: int, targets: set[int]) -> dict:
    """The three branches' probability on `targets` for one query, recomputed query by query from the layer's
    inputs: softmax over the keys each branch sees (NSA_SPEC), the selected blocks from the reference's top-n."""
    params = record["params"]
    q = record["q"][row, query, head].double()
    group = record["q"].shape[2] // record["k_slc"].shape[2]
    kv = head // group
    scale = 1 / math.sqrt(q.shape[0])
    chosen = {int(j) for j in blocks[row, kv, query] if j >= 0}

    def mass(keys, key_tensor, hits):
        scores = torch.stack([q @ key_tensor[k].double() * scale for k in keys])
        p = torch.softmax(scores, 0)
        return float(sum(p[i] for i, k in enumerate(keys) if hits(k)))

    ends = record["cmp_end"][row]
    visible = [c for c in range(ends.shape[0]) if 0 <= int(ends[c]) <= query]
    l = params.cmp_block_size
    p_cmp = mass(visible, record["k_cmp"][row, :, kv],
                 lambda c: any(int(ends[c]) - l < t <= int(ends[c]) for t in targets))  # fmt: skip
    slc_keys = [k for k in range(query + 1) if k // params.sel_block_size in chosen]
    p_slc = mass(slc_keys, record["k_slc"][row, :, kv], lambda k: k in targets)
    win_keys = [k for k in range(query + 1) if query - k < params.window_size]
    p_win = mass(win_keys, record["k_win"][row, :, kv], lambda k: k in targets)
    g = record["gates"][row, query, head].double()
    return {"p_cmp": p_cmp, "p_slc": p_slc, "p_win": p_win, "gated": float(g[0] * p_cmp + g[1] * p_slc + g[2] * p_win),
            "selected": float(any(t // params.sel_block_size in chosen for t in targets)),
            "gate_slc": float(g[1])}  # fmt: skip


@pytest.mark.parametrize("window_size", [32, 128], ids=["item-beyond-window", "item-in-window"])
def test_nsa_measures_match_a_query_by_query_recomputation(byt5, window_size):
    model = tiny_model(byt5, "nsa", window_size=window_size)
    chunk = cases(byt5)
    n = len(chunk[0].answer_ids)
    ids = torch.tensor([c.prompt_ids + c.answer_ids[:-1] for c in chunk])
    target_sets = anatomy_tool._target_sets(chunk, ids.shape[1])
    sink: dict = {}
    with anatomy_tool._recording(model, "nsa", sink), torch.no_grad():
        model(input_ids=ids, use_cache=False)
    assert sorted(sink) == [0, 1]
    selected_seen, window_seen = set(), set()
    for layer, record in sink.items():
        measures = anatomy_tool.nsa_layer_anatomy(record, target_sets, n)
        blocks = _selected_blocks(record)
        for row in range(len(chunk)):
            for head in range(4):
                for i in range(n):
                    query = ids.shape[1] - n + i
                    for name, targets in target_sets.items():
                        expected = _oracle(record, blocks, row, head, query, set(torch.nonzero(targets[row, i]).flatten().tolist()))
                        for measure in ("p_cmp", "p_slc", "p_win", "gated", "selected"):
                            got = float(measures[f"{measure}_{name}"][row, head, i])
                            assert got == pytest.approx(expected[measure], abs=1e-5), (layer, row, head, i, name, measure)
                        selected_seen.add(expected["selected"])
                        window_seen.add(expected["p_win"] > 0)
                    assert float(measures["gate_slc"][row, head, i]) == pytest.approx(expected["gate_slc"], abs=1e-6)
    assert selected_seen == {0.0, 1.0}  # both a selected and an unselected answer block were checked
    assert (True in window_seen) == (window_size == 128)  # the window's slots are checked where it sees the item


def test_kernels_selection_is_the_one_measured(byt5, monkeypatch):
    """Where the layers run the Triton kernels, the selected branch is measured on the kernels' top-n (recorded
    beside the layer's inputs), not the reference's: here a stand-in that selects only the forced blocks."""
    import modeling_nsa.nsa_triton as nsa_triton
    from modeling_nsa.nsa_reference import select_blocks

    def forced_only(q, k_cmp, cmp_end, doc_pos, params):  # scores 0 everywhere: the forced blocks, then the lowest
        num_blocks = (doc_pos.shape[1] + params.sel_block_size - 1) // params.sel_block_size
        scores = torch.zeros(q.shape[0], k_cmp.shape[2], q.shape[1], num_blocks)
        return select_blocks(scores, doc_pos, params)

    monkeypatch.setattr(anatomy_tool, "_kernels_select", lambda model: True)
    monkeypatch.setattr(nsa_triton, "select_blocks_triton", forced_only)
    model = tiny_model(byt5, "nsa")
    chunk = cases(byt5)
    n = len(chunk[0].answer_ids)
    ids = torch.tensor([c.prompt_ids + c.answer_ids[:-1] for c in chunk])
    sink: dict = {}
    with anatomy_tool._recording(model, "nsa", sink, last=n), torch.no_grad():
        model(input_ids=ids, use_cache=False)
    record = sink[1]
    assert torch.equal(record["block_indices"], forced_only(record["q"], record["k_cmp"], None, record["doc_pos"],
                                                            record["params"])[:, :, -n:])  # fmt: skip
    measures = anatomy_tool.nsa_layer_anatomy(record, anatomy_tool._target_sets(chunk, ids.shape[1]), n)
    for row, case in enumerate(chunk):  # the lowest blocks, the first and the query's own two: the item only at depth 0
        for i in range(n):
            query = ids.shape[1] - n + i
            blocks = {int(b) for b in record["block_indices"][row, 0, i] if b >= 0}
            holds = any(p // 16 in blocks for p in anatomy_tool.copy_sources(case)[i])
            assert float(measures["selected_token"][row, 0, i]) == float(holds)
            keys = [k for k in range(query + 1) if k // 16 in blocks]
            scores = torch.stack([record["q"][row, query, 0] @ record["k_slc"][row, k, 0] for k in keys]) / math.sqrt(8)
            p = torch.softmax(scores.double(), 0)
            expected = sum(float(p[j]) for j, k in enumerate(keys) if k in anatomy_tool.copy_sources(case)[i])
            assert float(measures["p_slc_token"][row, 0, i]) == pytest.approx(expected, abs=1e-5)


@pytest.mark.parametrize("mode", ["nsa", "dense"])
def test_recording_restores_the_model_when_the_forward_raises(byt5, mode):
    model = tiny_model(byt5, mode)
    code, _ = anatomy_tool._model_code(model)
    seam, eager, implementation = code.nsa_attention, code.eager_attention_forward, model.config._attn_implementation
    with pytest.raises(RuntimeError, match="stop"):
        with anatomy_tool._recording(model, mode, {}, last=2):
            raise RuntimeError("stop")
    assert code.nsa_attention is seam and code.eager_attention_forward is eager
    assert model.config._attn_implementation == implementation
    assert all(not m._forward_pre_hooks for m in anatomy_tool._attention_modules(model))


def test_the_answer_s_leading_space_is_not_averaged(byt5):
    """With the tokenizer, the means are over the answer's digits: a passkey answer's first token (its space) has
    weight 0; the result equals the per-token measures averaged over the digits."""
    chunk = cases(byt5)
    weights = anatomy_tool.answer_token_weights(chunk, byt5)
    assert weights[:, 0].eq(0).all() and weights[:, 1:].eq(1).all()
    assert anatomy_tool.answer_token_weights(chunk).eq(1).all()
    model = tiny_model(byt5, "nsa")
    n = len(chunk[0].answer_ids)
    ids = torch.tensor([c.prompt_ids + c.answer_ids[:-1] for c in chunk])
    sink: dict = {}
    with anatomy_tool._recording(model, "nsa", sink, last=n), torch.no_grad():
        model(input_ids=ids, use_cache=False)
    per_token = anatomy_tool.nsa_layer_anatomy(sink[1], anatomy_tool._target_sets(chunk, ids.shape[1]), n)
    result = anatomy_tool.anatomy(model, chunk, batch_size=len(chunk), tokenizer=byt5)
    assert result["answer_tokens_measured"] == len(chunk) * (n - 1)
    for name in ("p_slc_token", "p_cmp_item", "gate_slc"):
        expected = per_token[name][:, :, 1:].double().mean((0, 2))
        assert result["layers"][1]["heads"][name] == pytest.approx(expected.tolist(), abs=1e-9), name


def test_dense_measures_are_the_model_s_own_softmax(byt5):
    """Recording switches the model to eager attention for the call and back; the logits do not change, and the
    probability on the targets is the recorded softmax summed at the copy positions."""
    model = tiny_model(byt5, "dense")
    chunk = cases(byt5)
    n = len(chunk[0].answer_ids)
    ids = torch.tensor([c.prompt_ids + c.answer_ids[:-1] for c in chunk])
    with torch.no_grad():
        plain = model(input_ids=ids, use_cache=False).logits
    implementation = model.config._attn_implementation
    sink: dict = {}
    with anatomy_tool._recording(model, "dense", sink), torch.no_grad():
        recorded = model(input_ids=ids, use_cache=False).logits
    assert model.config._attn_implementation == implementation
    torch.testing.assert_close(recorded, plain, rtol=1e-5, atol=1e-5)
    weights = sink[1]  # (B, H, T, T): every query's row (no `last`)
    assert weights.shape == (len(chunk), 4, ids.shape[1], ids.shape[1])
    torch.testing.assert_close(weights.sum(-1), torch.ones(weights.shape[:-1]))
    assert weights.triu(1).abs().max() == 0  # causal
    kept: dict = {}
    with anatomy_tool._recording(model, "dense", kept, last=n), torch.no_grad():
        model(input_ids=ids, use_cache=False)
    assert torch.equal(kept[1], weights[:, :, -n:])  # the anatomy keeps the answer queries' rows
    target_sets = anatomy_tool._target_sets(chunk, ids.shape[1])
    measures = anatomy_tool.dense_layer_anatomy(weights, target_sets, n)
    for row, case in enumerate(chunk):
        for i, positions in enumerate(anatomy_tool.copy_sources(case)):
            query = ids.shape[1] - n + i
            expected = weights[row, 2, query, positions].sum()
            assert float(measures["p_token"][row, 2, i]) == pytest.approx(float(expected), abs=1e-6)
            item = weights[row, 2, query, case.needle_start : case.needle_start + case.needle_len].sum()
            assert float(measures["p_item"][row, 2, i]) == pytest.approx(float(item), abs=1e-6)


def test_exact_answers_count_the_argmax_at_every_answer_query(byt5, monkeypatch):
    """A model whose argmax is the answer at every answer query scores 100%, one wrong token makes a case wrong."""
    model = tiny_model(byt5, "dense")
    chunk = cases(byt5)
    forward = model.forward

    def scripted(input_ids, **kwargs):
        out = forward(input_ids=input_ids, **kwargs)
        logits = out.logits.clone()
        for row in range(input_ids.shape[0]):
            case = next(c for c in chunk if c.prompt_ids == input_ids[row, : len(c.prompt_ids)].tolist())
            n = len(case.answer_ids)
            for i, token in enumerate(case.answer_ids):
                logits[row, -n + i, token] += 1e3
            if case is chunk[0]:
                logits[row, -1, case.answer_ids[-1]] -= 2e3  # its last digit wrong
        out.logits = logits
        return out

    monkeypatch.setattr(model, "forward", scripted)
    result = anatomy_tool.anatomy(model, chunk, batch_size=4)
    assert result["exact_answers"] == pytest.approx((len(chunk) - 1) / len(chunk))
    assert [layer["layer"] for layer in result["layers"]] == [0, 1]


def test_cases_of_several_lengths_average_over_every_answer_token(byt5):
    """Cases of two lengths (or answers of differing tokens, as the needle's words) run in batches of one shape,
    and the result is the mean over all their answer tokens: the two lengths' results weighted by their tokens."""
    model = tiny_model(byt5, "nsa")
    short, long = cases(byt5), lc.build_cases(byt5, "passkey", [LENGTH + 16], [0.5], 3, seed=4)[0]
    both = anatomy_tool.anatomy(model, short + long, batch_size=4)
    apart = [anatomy_tool.anatomy(model, part, batch_size=4) for part in (short, long)]
    weights = [sum(len(c.answer_ids) for c in part) for part in (short, long)]
    assert both["exact_answers"] == pytest.approx((apart[0]["exact_answers"] * len(short)
                                                   + apart[1]["exact_answers"] * len(long)) / len(short + long))  # fmt: skip
    for layer in (0, 1):
        for name, values in both["layers"][layer]["heads"].items():
            expected = [(a * weights[0] + b * weights[1]) / sum(weights)
                        for a, b in zip(apart[0]["layers"][layer]["heads"][name], apart[1]["layers"][layer]["heads"][name])]
            assert values == pytest.approx(expected, abs=1e-9), name


def test_ablating_a_branch_zeroes_its_gate_in_every_layer(byt5):
    """--ablate cmp: every layer's seam gets the cmp gate at 0 and the other gates as computed (layer 0's inputs
    are the embeddings, so its other gates equal the unablated ones); the answers' logits change."""
    model = tiny_model(byt5, "nsa")
    chunk = cases(byt5)
    n = len(chunk[0].answer_ids)
    ids = torch.tensor([c.prompt_ids + c.answer_ids[:-1] for c in chunk])
    plain, ablated = {}, {}
    with anatomy_tool._recording(model, "nsa", plain, last=n), torch.no_grad():
        plain_logits = model(input_ids=ids, use_cache=False).logits
    with anatomy_tool._recording(model, "nsa", ablated, last=n, ablate="cmp"), torch.no_grad():
        ablated_logits = model(input_ids=ids, use_cache=False).logits
    for layer in (0, 1):
        assert ablated[layer]["gates"][..., 0].eq(0).all() and plain[layer]["gates"][..., 0].gt(0).all()
    torch.testing.assert_close(ablated[0]["gates"][..., 1:], plain[0]["gates"][..., 1:], rtol=0, atol=0)
    assert not torch.allclose(ablated_logits[:, -n:], plain_logits[:, -n:])
    result = anatomy_tool.anatomy(model, chunk, tokenizer=byt5, ablate="slc")
    assert result["ablated"] == "slc" and all(max(layer["heads"]["gate_slc"]) == 0 for layer in result["layers"])
    # one layer only: layer 0 as computed, layer 1's slc gate 0
    one = anatomy_tool.anatomy(model, chunk, tokenizer=byt5, ablate="slc", ablate_layers=[1])
    plain_result = anatomy_tool.anatomy(model, chunk, tokenizer=byt5)
    assert one["layers"][0]["heads"] == plain_result["layers"][0]["heads"]
    assert max(one["layers"][1]["heads"]["gate_slc"]) == 0
    with pytest.raises(ValueError, match="--ablate-layers \\[2\\]: this model's layers are \\[0, 1\\]"):
        anatomy_tool.anatomy(model, chunk, ablate="slc", ablate_layers=[2])
    with pytest.raises(ValueError, match="--ablate-layers \\[1\\]: give --ablate too"):
        anatomy_tool.anatomy(model, chunk, ablate_layers=[1])
    with pytest.raises(ValueError, match="--ablate slc: a model in attention_mode 'dense' has no NSA branches to "
                                         "ablate; give NSA models only with --ablate"):
        anatomy_tool.anatomy(tiny_model(byt5, "dense"), chunk, ablate="slc")
    with pytest.raises(ValueError, match="--ablate 'gate': one of"):
        anatomy_tool.anatomy(model, chunk, ablate="gate")


def test_selection_without_drops_the_hidden_blocks_from_the_last_queries_only():
    blocks = torch.tensor([[[[0, 3, 5, -1], [0, 2, 3, 4], [1, 3, 5, 6]]]])  # (B=1, Hkv=1, T=3, n'=4), blocks of 4
    hidden = torch.zeros(1, 28, dtype=torch.bool)
    hidden[0, 13:15] = True  # keys 13-14: block 3
    out = anatomy_tool._selection_without(blocks, hidden, last=2, block_size=4)
    assert out.tolist() == [[[[0, 3, 5, -1], [0, 2, -1, 4], [1, -1, 5, 6]]]]


def test_hiding_the_item_from_the_selected_branch(byt5):
    """--ablate slc-item: the answer queries' selected branch attends no block of the hidden item, in every layer;
    earlier queries are unchanged (so are their logits), and with nothing hidden the reference's gated sum that
    replaces the layer's output gives the model's own logits."""
    model = tiny_model(byt5, "nsa")
    chunk = cases(byt5)
    n = len(chunk[0].answer_ids)
    ids = torch.tensor([c.prompt_ids + c.answer_ids[:-1] for c in chunk])
    item = anatomy_tool._target_sets(chunk, ids.shape[1])["item"][:, 0]
    with torch.no_grad():
        plain = model(input_ids=ids, use_cache=False).logits
    sink: dict = {}
    with anatomy_tool._recording(model, "nsa", sink, last=n, ablate="slc-item", hidden=torch.zeros_like(item)), \
            torch.no_grad():  # fmt: skip
        nothing_hidden = model(input_ids=ids, use_cache=False).logits
    torch.testing.assert_close(nothing_hidden, plain, rtol=1e-5, atol=1e-5)
    sink = {}
    with anatomy_tool._recording(model, "nsa", sink, last=n, ablate="slc-item", hidden=item), torch.no_grad():
        hidden = model(input_ids=ids, use_cache=False).logits
    torch.testing.assert_close(hidden[:, :-n], plain[:, :-n], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(hidden[:, -n:], plain[:, -n:])
    target_sets = anatomy_tool._target_sets(chunk, ids.shape[1])
    for layer in (0, 1):
        measures = anatomy_tool.nsa_layer_anatomy(sink[layer], target_sets, n)
        assert measures["selected_item"].eq(0).all() and measures["p_slc_item"].eq(0).all()
    result = anatomy_tool.anatomy(model, chunk, tokenizer=byt5, ablate="slc-item")
    assert all(max(layer["heads"]["selected_item"]) == 0 for layer in result["layers"])


def test_bad_inputs_are_named(byt5, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    llama = LlamaForCausalLM(LlamaConfig(vocab_size=384, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))  # fmt: skip
    with pytest.raises(ValueError, match="long_context"):
        anatomy_tool.anatomy(llama, cases(byt5))
    with pytest.raises(ValueError, match="task"):
        anatomy_tool.main([str(tmp_path), "--task", "haystack"])


def test_cli_writes_a_table_with_both_modes(byt5, tmp_path):
    paths = []
    for mode in ("nsa", "dense"):
        path = tmp_path / f"{mode}-seed0" / "final"
        tiny_model(byt5, mode).save_pretrained(path)
        byt5.save_pretrained(path)
        paths.append(str(path))
    results = anatomy_tool.main(paths + ["--lengths", str(LENGTH), "--samples", "1", "--depths", "0.5",
                                         "--out", str(tmp_path / "out")])  # fmt: skip
    assert [r["mode"] for r in results] == ["nsa", "dense"]
    table = (tmp_path / "out" / "anatomy.md").read_text()
    assert "| nsa-seed0/final (nsa) | 240 |" in table and "| dense-seed0/final (dense) | 240 |" in table
    assert len([line for line in table.splitlines() if line.startswith("| ") and "seed0" in line]) == 4  # 2 x 2 layers
    assert (tmp_path / "out" / "anatomy.json").is_file()
