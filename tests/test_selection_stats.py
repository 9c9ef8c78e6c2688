"""nsa_train.selection_stats against a plain-loop computation from the reference's selected indices, and
bench/selection_map.py."""

from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path

import pytest
import torch

from modeling_nsa import NSAConfig, NSAForCausalLM
from nsa_train import selection_stats as ss

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import selection_map  # noqa: E402

CONFIG = dict(vocab_size=384, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, cmp_block_size=8, cmp_stride=4, sel_block_size=8, sel_num_blocks=4,
              window_size=16, cmp_mlp_hidden_size=16, nsa_backend="reference")  # fmt: skip


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return NSAForCausalLM(NSAConfig(**CONFIG)).eval()


@pytest.fixture(scope="module")
def batch():
    """Row 0: two packed documents (position_ids restart at 0); row 1: left padding, then one document."""
    torch.manual_seed(1)
    T = 80
    input_ids = torch.randint(0, 384, (2, T))
    position_ids = torch.stack([torch.cat([torch.arange(35), torch.arange(T - 35)]),
                                torch.cat([torch.zeros(9, dtype=torch.long), torch.arange(T - 9)])])  # fmt: skip
    attention_mask = torch.ones(2, T, dtype=torch.long)
    attention_mask[1, :9] = 0
    return {"input_ids": input_ids, "position_ids": position_ids, "attention_mask": attention_mask, "labels": input_ids}


def loop_statistics(gates, indices, doc_pos, cfg) -> dict:
    """The statistics written out query by query from NSA_SPEC's definitions (no tensors ops beyond indexing)."""
    B, Hkv, T, _ = indices.shape
    block, window = cfg["sel_block_size"], cfg["window_size"]
    gate_values = {b: [] for b in ss.BRANCHES}
    distances, forced, beyond, overlaps, jaccards, queries = [], 0, 0, [], [], 0
    sets = {}
    for b in range(B):
        for t in range(T):
            p = int(doc_pos[b, t])
            if p < 0:
                continue
            queries += 1
            for h in range(gates.shape[2]):
                for k, name in enumerate(ss.BRANCHES):
                    gate_values[name].append(float(gates[b, t, h, k]))
            own = p // block
            for g in range(Hkv):
                chosen = {int(j) for j in indices[b, g, t] if j >= 0}
                sets[b, g, t] = chosen
                for j in chosen:
                    distances.append(own - j)
                    forced += j < 1 or own - 2 < j <= own  # sel_init_blocks 1, sel_local_blocks 2 (the defaults)
                    beyond += (j + 1) * block - 1 < p - window + 1
    for (b, g, t), chosen in sets.items():
        following = sets.get((b, g, t + 1))
        if following is not None and int(doc_pos[b, t + 1]) == int(doc_pos[b, t]) + 1:  # same document
            overlaps.append(len(chosen & following) / len(following))
            jaccards.append(len(chosen & following) / len(chosen | following))
    hist = {}
    for d in distances:
        label = "0" if d == 0 else next(f"{lo}-{2 * lo - 1}" if lo > 1 else "1"
                                        for lo in (2**k for k in range(20)) if lo <= d < 2 * lo)  # fmt: skip
        hist[label] = hist.get(label, 0) + 1
    out = {"queries": queries, "selections": len(distances), "blocks_per_query": len(distances) / (queries * Hkv),
           "distance_mean": sum(distances) / len(distances), "forced_share": forced / len(distances),
           "beyond_window_share": beyond / len(distances), "neighbour_pairs": len(overlaps),
           "neighbour_overlap": sum(overlaps) / len(overlaps), "neighbour_jaccard": sum(jaccards) / len(jaccards),
           "distance_hist": hist}  # fmt: skip
    for name, values in gate_values.items():
        out[f"gate_{name}_mean"] = statistics.fmean(values)
        out[f"gate_{name}_std"] = statistics.pstdev(values)
    return out


def test_statistics_equal_a_plain_loop_over_the_reference_selection(model, batch):
    selections = ss.capture_selections(model, batch)
    assert [s.layer for s in selections] == [0, 1]
    stats = ss.compute_selection_stats(model, batch)
    assert stats["rows"] == 2 and stats["seq_len"] == 80 and len(stats["layers"]) == 2
    for selection, layer in zip(selections, stats["layers"]):
        expected = loop_statistics(selection.gates, selection.block_indices, selection.doc_pos, CONFIG)
        assert expected["queries"] == 80 + 71
        for key, value in expected.items():
            if key == "distance_hist":
                assert {k: v for k, v in layer[key].items() if v} == value
            else:
                assert layer[key] == pytest.approx(value, rel=1e-6, abs=1e-9), key
        assert sum(layer["distance_share"].values()) == pytest.approx(1.0)


def test_the_captured_selection_is_the_one_the_layers_compute(model, batch):
    """The gates are the layer's own (sigmoid of g_proj on the normalized layer input) and the selection obeys
    NSA_SPEC's rules for every query: forced blocks in, only eligible blocks, min(n, eligible) of them."""
    out = model(**{k: batch[k] for k in ("input_ids", "position_ids", "attention_mask")}, output_hidden_states=True)
    for selection in ss.capture_selections(model, batch):
        layer = model.model.layers[selection.layer]
        hidden = layer.input_layernorm(out.hidden_states[selection.layer])
        gates = torch.sigmoid(layer.self_attn.g_proj(hidden)).view(2, 80, 4, 3)
        valid = selection.doc_pos >= 0
        torch.testing.assert_close(selection.gates[valid], gates[valid].float())
        for b in range(2):
            for t in range(80):
                p = int(selection.doc_pos[b, t])
                if p < 0:
                    continue
                own = p // 8
                eligible = own + 1
                for g in range(2):
                    chosen = [int(j) for j in selection.block_indices[b, g, t] if j >= 0]
                    assert len(set(chosen)) == len(chosen) == min(4, eligible)
                    assert all(0 <= j <= own for j in chosen)
                    assert {0, own, max(own - 1, 0)} <= set(chosen)


def test_a_different_selection_gives_different_statistics(model, batch):
    """The statistics read the indices: shifting every selection one block back changes distance and forced share."""
    selection = ss.capture_selections(model, batch)[0]
    base = ss.layer_statistics(selection.gates, selection.block_indices, selection.doc_pos, selection.params)
    shifted = torch.where(selection.block_indices > 0, selection.block_indices - 1, selection.block_indices)
    moved = ss.layer_statistics(selection.gates, shifted, selection.doc_pos, selection.params)
    assert moved["distance_mean"] > base["distance_mean"]
    assert moved["forced_share"] != base["forced_share"]


def test_flat_metrics_jsonl_and_table(model, batch, tmp_path):
    stats = ss.compute_selection_stats(model, batch)
    flat = ss.flatten_stats(stats)
    assert flat["stats_l1_forced_share"] == stats["layers"][1]["forced_share"]
    assert flat["stats_all_gate_slc_mean"] == pytest.approx(
        (stats["layers"][0]["gate_slc_mean"] + stats["layers"][1]["gate_slc_mean"]) / 2)
    assert flat["stats_l0_distance_0"] == stats["layers"][0]["distance_share"]["0"]
    assert all(isinstance(v, float) and not math.isnan(v) for v in flat.values())
    path = tmp_path / "stats.jsonl"
    ss.append_stats_jsonl(path, 7, stats)
    ss.append_stats_jsonl(path, 14, stats)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["step"] for line in lines] == [7, 14] and lines[0]["layers"] == stats["layers"]
    table = ss.format_stats(stats)
    assert table.count("\n") == 3 and "| 1 |" in table


def test_dense_model_and_bad_batch():
    torch.manual_seed(0)
    dense = NSAForCausalLM(NSAConfig(**{**CONFIG, "attention_mode": "dense"}))
    stats = ss.compute_selection_stats(dense, {"input_ids": torch.randint(0, 384, (1, 20))})
    assert stats["layers"] == [] and ss.flatten_stats(stats) == {}
    assert "dense attention" in ss.format_stats(stats)
    nsa = NSAForCausalLM(NSAConfig(**CONFIG))
    with pytest.raises(ValueError, match=r"the batch needs input_ids \(got keys \['labels'\]\)"):
        ss.compute_selection_stats(nsa, {"labels": torch.zeros(1, 4, dtype=torch.long)})


def test_selection_map_missing_prompt_file_is_named_before_loading(tmp_path):
    missing = tmp_path / "nope.txt"
    with pytest.raises(ValueError, match=r"--prompt-file '.*nope.txt': no such file; pass a text file, or the prompt"):
        selection_map.main([str(tmp_path / "no-model"), "--prompt-file", str(missing)])  # (no model is loaded first)


def test_selection_map_codes_and_png(model, batch, tmp_path):
    selection = ss.capture_selections(model, batch)[1]
    codes = selection_map.selection_map(selection, row=1, group=1)
    assert codes.shape == (80, 10)
    for t in range(80):
        p = int(selection.doc_pos[1, t])
        chosen = {int(j) for j in selection.block_indices[1, 1, t] if j >= 0}
        for j in range(10):
            code = int(codes[t, j])
            if p < 0 or j * 8 > p:
                assert code == selection_map.FUTURE
            elif j in chosen:
                forced = j < 1 or p // 8 - 2 < j <= p // 8
                assert code == (selection_map.FORCED if forced else selection_map.SELECTED)
            else:
                assert code == (selection_map.WINDOW if (j + 1) * 8 > p - 16 + 1 else selection_map.ELIGIBLE)
    png = selection_map.plot_map(codes, tmp_path / "map.png", "test")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_selection_map_cli(model, tmp_path, capsys):
    from transformers import ByT5Tokenizer

    model.save_pretrained(tmp_path / "final")
    ByT5Tokenizer().save_pretrained(tmp_path / "final")
    result = selection_map.main([str(tmp_path / "final"), "--prompt", "A prompt of a few dozen bytes, long enough.",
                                 "--layer", "1", "--group", "0", "--out", str(tmp_path / "map.png")])  # fmt: skip
    assert (tmp_path / "map.png").is_file() and result["codes"].shape[0] == 44
    # a prompt longer than --max-len is cut, and said (ByT5 ends it with its EOS: 51 tokens)
    capsys.readouterr()
    result = selection_map.main([str(tmp_path / "final"), "--prompt", "x" * 50, "--max-len", "30", "--out",
                                 str(tmp_path / "cut.png")])  # fmt: skip
    assert result["codes"].shape[0] == 30 and "the prompt cut to 30 of its 51 tokens (--max-len 30)" in capsys.readouterr().out
    with pytest.raises(ValueError, match=r"--layer 5: the model has layers 0..1"):
        selection_map.main([str(tmp_path / "final"), "--prompt", "abc", "--layer", "5"])
    # --out a folder: the map takes its default name there; a name without a suffix gets .png (said as written)
    capsys.readouterr()
    result = selection_map.main([str(tmp_path / "final"), "--prompt", "abcdef", "--layer", "1", "--out",
                                 f"{tmp_path}/"])  # fmt: skip
    assert (tmp_path / "layer1_group0.png").is_file() and f"wrote {tmp_path / 'layer1_group0.png'}" in capsys.readouterr().out
    selection_map.main([str(tmp_path / "final"), "--prompt", "abcdef", "--out", f"{tmp_path / 'new'}/"])
    assert (tmp_path / "new" / "layer0_group0.png").is_file()  # a new folder, named by its trailing /
    selection_map.main([str(tmp_path / "final"), "--prompt", "abcdef", "--out", str(tmp_path / "bare")])
    assert (tmp_path / "bare.png").is_file() and f"wrote {tmp_path / 'bare.png'}" in capsys.readouterr().out
    with pytest.raises(ValueError, match=r"--depth 0.3: these place a retrieval case's item; they take --task"):
        selection_map.main([str(tmp_path / "final"), "--prompt", "abcdef", "--depth", "0.3"])
    # a run's final/ without --out: the map goes beside the run's other evaluations, not into the working directory
    (tmp_path / "run.json").write_text("{}")
    result = selection_map.main([str(tmp_path / "final"), "--prompt", "abcdef", "--layer", "1"])
    assert (tmp_path / "selection_map" / "layer1_group0.png").is_file()
    # a model saved without a tokenizer (as the README's Python example saves one): --tokenizer gives it
    model.save_pretrained(tmp_path / "bare")
    with pytest.raises(ValueError, match="cannot load its tokenizer"):
        selection_map.main([str(tmp_path / "bare"), "--prompt", "abc", "--out", str(tmp_path / "bare.png")])
    result = selection_map.main([str(tmp_path / "bare"), "--prompt", "A prompt of a few dozen bytes, long enough.",
                                 "--tokenizer", "byt5", "--layer", "1", "--out", str(tmp_path / "bare.png")])  # fmt: skip
    assert result["codes"].shape[0] == 44
    # a model that is not NSA is named as such before its (missing) tokenizer is looked for
    dense = type(model)(type(model.config)(**{**model.config.to_dict(), "attention_mode": "dense"}))
    dense.save_pretrained(tmp_path / "dense")
    with pytest.raises(ValueError, match="not an NSA model .*attention_mode 'dense'"):
        selection_map.main([str(tmp_path / "dense"), "--prompt", "abc"])


def test_selection_map_of_a_retrieval_case_marks_the_item_and_the_answer_queries(model, tmp_path, capsys):
    """--task passkey: the map of a case's prompt and answer as long_context builds it; the item's blocks and the
    answer's queries as the case places them, and the share of those queries whose selection held an item block,
    recomputed here from the selected block indices."""
    from transformers import ByT5Tokenizer

    from nsa_train.long_context import build_cases

    model.save_pretrained(tmp_path / "final")
    ByT5Tokenizer().save_pretrained(tmp_path / "final")
    result = selection_map.main([str(tmp_path / "final"), "--task", "passkey", "--length", "256", "--depth", "0.25",
                                 "--sample", "1", "--layer", "1", "--group", "1", "--out", str(tmp_path / "map.png")])  # fmt: skip
    case = build_cases(ByT5Tokenizer(), "passkey", [256], [0.25], 2, vocab_size=384)[0][1]
    assert result["answer"] == case.answer and result["codes"].shape == (256, 32)
    item = ByT5Tokenizer().decode(case.prompt_ids[case.needle_start : case.needle_start + case.needle_len])
    assert case.answer in item
    first, last = case.needle_start // 8, (case.needle_start + case.needle_len - 1) // 8
    assert result["marks"]["item_blocks"] == list(range(first, last + 1))
    queries = list(range(len(case.prompt_ids) - 1, 255))  # the last prompt token, then every answer token but the last
    assert result["marks"]["answer_queries"] == queries
    ids = torch.tensor([case.prompt_ids + case.answer_ids])
    indices = ss.capture_selections(model, {"input_ids": ids}, max_len=256)[1].block_indices[0, 1]  # (T, n)
    held = [bool(set(indices[q].tolist()) & set(range(first, last + 1))) for q in queries]
    assert result["item_selected"] == pytest.approx(sum(held) / len(held))
    assert f"{result['item_selected']:.0%} of them selected one" in capsys.readouterr().out
    assert (tmp_path / "map.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match=r"--length None and --task passkey: give both"):
        selection_map.main([str(tmp_path / "final"), "--task", "passkey"])
    with pytest.raises(ValueError, match=r"--depth 1.5 / --sample 0: give a depth in 0..1"):
        selection_map.main([str(tmp_path / "final"), "--task", "passkey", "--length", "256", "--depth", "1.5"])
    with pytest.raises(ValueError, match=r"^--length 20: .*too short") as raised:  # this script's flag, not --lengths
        selection_map.main([str(tmp_path / "final"), "--task", "passkey", "--length", "20"])
    assert "--lengths" not in str(raised.value)


def test_the_reference_selects_on_rows_cut_to_its_length(model, batch, monkeypatch):
    """Where the layers run the reference (here: CPU), the statistics' selection is the reference's, on rows cut
    to REFERENCE_MAX_LEN tokens (its scores are T x T per head); max_len overrides the cut."""
    monkeypatch.setattr(ss, "REFERENCE_MAX_LEN", 50)
    stats = ss.compute_selection_stats(model, batch)
    assert (stats["selection_by"], stats["rows"], stats["seq_len"]) == ("reference", 2, 50)
    assert [s.block_indices.shape[2] for s in ss.capture_selections(model, batch)] == [50, 50]
    assert ss.compute_selection_stats(model, batch, max_len=80)["seq_len"] == 80
    assert "selection by the reference" in ss.card_section(stats)


def test_the_kernels_select_on_whole_rows_where_the_layers_run_them(model, batch, monkeypatch):
    """Where the layers run the Triton kernels (a CUDA GPU; stood in here), the selection is the kernels' top-n
    (select_blocks_triton: O(T x n) memory) on whole rows, whatever REFERENCE_MAX_LEN says, and the statistics say
    so; parameters the kernels refuse (ValueError) fall back to the reference."""
    from modeling_nsa import nsa_triton

    calls = []

    def kernels(q, k_cmp, cmp_end, doc_pos, params):  # the reference's selection, through the kernels' entry point
        calls.append(q.shape[1])
        return model_selection_by_reference(q, k_cmp, cmp_end, doc_pos, params).flip(-1)  # a visible difference

    def model_selection_by_reference(q, k_cmp, cmp_end, doc_pos, params):
        from modeling_nsa.nsa_reference import nsa_attention_reference

        zeros = torch.zeros(q.shape[0], doc_pos.shape[1], k_cmp.shape[2], q.shape[-1])
        gates = torch.ones(*q.shape[:3], 3)
        return nsa_attention_reference(q, k_cmp, k_cmp, cmp_end, zeros, zeros, zeros, zeros, gates, doc_pos, params,
                                       return_block_indices=True)[1]

    monkeypatch.setattr(ss, "_kernels_select", lambda model: True)
    monkeypatch.setattr(ss, "REFERENCE_MAX_LEN", 50)
    monkeypatch.setattr(nsa_triton, "select_blocks_triton", kernels)
    stats = ss.compute_selection_stats(model, batch)
    assert (stats["selection_by"], stats["seq_len"]) == ("triton", 80) and calls == [80, 80]
    by_kernels = ss.capture_selections(model, batch)
    monkeypatch.setattr(ss, "_kernels_select", lambda model: False)
    by_reference = ss.capture_selections(model, batch, max_len=80)
    for k, r in zip(by_kernels, by_reference):
        assert torch.equal(k.block_indices, r.block_indices.flip(-1))  # the kernels' indices, not the reference's

    def refusing(*args):
        raise ValueError("sel_block_size=8: the kernels take multiples of 16")

    monkeypatch.setattr(ss, "_kernels_select", lambda model: True)
    monkeypatch.setattr(nsa_triton, "select_blocks_triton", refusing)
    fallback = ss.compute_selection_stats(model, batch)
    assert fallback["selection_by"] == "reference" and fallback["seq_len"] == 80
    assert "selection by the Triton kernels" in ss.card_section(stats)


def test_the_reference_selects_without_the_other_branches(model, batch, monkeypatch):
    """On the reference, the statistics' selection is `reference_block_indices` (the compression branch and the
    top-n, once per layer), not a second run of the whole layer; a checkpoint's code without it (an older remote
    copy) falls back to the whole reference, and both give the same statistics."""
    from modeling_nsa import nsa_reference

    calls = []
    alone = nsa_reference.reference_block_indices

    def counted(*args):
        calls.append(args[0].shape[1])
        return alone(*args)

    monkeypatch.setattr(nsa_reference, "reference_block_indices", counted)
    by_selection_alone = ss.compute_selection_stats(model, batch)
    assert calls == [80, 80]
    monkeypatch.delattr(nsa_reference, "reference_block_indices")
    by_whole_reference = ss.compute_selection_stats(model, batch)
    assert by_selection_alone == by_whole_reference and by_selection_alone["selection_by"] == "reference"


def test_kernels_select_follows_the_layers_backend(model):
    """The choice is the model's own: its nsa_backend resolved on its device (CPU: the reference)."""
    assert ss._kernels_select(model) is False


def test_kernels_select_only_parameters_they_handle(monkeypatch):
    """Where the layers would run the kernels but the kernels refuse the parameters (sel_block_size 8 here: they take
    powers of two from 16), the layers run the reference, so the statistics cut rows for it as well."""
    from modeling_nsa import nsa_backend

    monkeypatch.setattr(nsa_backend, "resolve_nsa_backend", lambda requested, device: "triton")
    torch.manual_seed(0)
    refused = NSAForCausalLM(NSAConfig(**CONFIG))  # sel_block_size=8
    handled = NSAForCausalLM(NSAConfig(**{**CONFIG, "sel_block_size": 16, "head_dim": 16}))
    assert ss._kernels_select(refused) is False and ss._kernels_select(handled) is True


def test_capture_keeps_the_last_queries_of_whole_rows(model, batch):
    """capture_selections(last=k): the last k queries' gates, selections and positions of the whole-row capture
    (selected on the whole rows, then cut), for every layer."""
    whole = ss.capture_selections(model, batch)
    tail = ss.capture_selections(model, batch, last=3)
    for full, cut in zip(whole, tail):
        assert cut.block_indices.shape[2] == 3 and cut.gates.shape[1] == 3
        assert torch.equal(cut.block_indices, full.block_indices[:, :, -3:])
        assert torch.equal(cut.gates, full.gates[:, -3:]) and torch.equal(cut.doc_pos, full.doc_pos[:, -3:])
