"""nsa_train.long_context: passkey / needle prompts, both scorings, the CLI on an NSA run and a HF Llama, errors."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import ByT5Tokenizer

from nsa_train import long_context as lc
from nsa_train.data import looks_like_a_path

REPO = Path(__file__).resolve().parents[1]
GPT2 = REPO.parent / "shared" / "data" / "gpt2-tokenizer"


@pytest.fixture(scope="module")
def byt5():
    return ByT5Tokenizer()


@pytest.fixture(scope="module")
def nsa_run(tmp_path_factory, byt5):
    """A tiny NSA model saved as a run's final/, with the run.json the trainer writes beside it (seq_len 256)."""
    run = tmp_path_factory.mktemp("nsa-run")
    save_tiny_nsa(run / "final", byt5, sel_num_blocks=3, seed=0)
    (run / "run.json").write_text(json.dumps({"config": {"seq_len": 256}}))
    return run


def save_tiny_nsa(path, byt5, sel_num_blocks: int, seed: int) -> None:
    """A randomly initialized 1-layer NSA model (blocks of 16, a 32-token window, ByT5's vocabulary) and the
    tokenizer, saved to `path`."""
    from modeling_nsa import NSAConfig, NSAForCausalLM

    config = NSAConfig(vocab_size=384, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=16, cmp_block_size=16, cmp_stride=8,
                       sel_block_size=16, sel_num_blocks=sel_num_blocks, window_size=32, cmp_mlp_hidden_size=16,
                       max_position_embeddings=1024, eos_token_id=byt5.eos_token_id, pad_token_id=byt5.pad_token_id)  # fmt: skip
    torch.manual_seed(seed)
    NSAForCausalLM(config).save_pretrained(path)
    byt5.save_pretrained(path)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory, byt5):
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("llama")
    config = LlamaConfig(vocab_size=384, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                         eos_token_id=byt5.eos_token_id, pad_token_id=byt5.pad_token_id)  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    byt5.save_pretrained(path)
    return path


def tokenizers():
    out = [pytest.param("byt5", id="byt5")]
    out.append(pytest.param("gpt2", id="gpt2", marks=pytest.mark.skipif(not GPT2.is_dir(), reason=f"no {GPT2}")))
    return out


def load_tokenizer(name):
    from transformers import AutoTokenizer

    return ByT5Tokenizer() if name == "byt5" else AutoTokenizer.from_pretrained(GPT2)


def find(sequence, part):
    return [i for i in range(len(sequence) - len(part) + 1) if sequence[i : i + len(part)] == part]


# ----------------------------------------------------------------------------- prompts


@pytest.mark.parametrize("name", tokenizers())
@pytest.mark.parametrize("task", ["passkey", "needle"])
def test_case_has_exact_length_and_the_item_at_the_asked_depth(name, task):
    tokenizer = load_tokenizer(name)
    depths = [0.0, 0.3, 0.5, 0.75, 1.0]
    cases, _ = lc.build_cases(tokenizer, task, [400, 900], depths, samples=2, seed=3, haystack="python-docs")
    assert len(cases) == 2 * len(depths) * 2
    for case in cases:
        assert len(case.prompt_ids) + len(case.answer_ids) == case.length  # the answer ends at position length - 1
        item = case.prompt_ids[case.needle_start : case.needle_start + case.needle_len]
        item_text = tokenizer.decode(item)
        assert case.answer in item_text and ("pass key" if task == "passkey" else "secret word") in item_text
        # the item is where the case says, once, and that place is the asked fraction of the haystack
        assert find(case.prompt_ids, item) == [case.needle_start]
        where = (case.needle_start - case.haystack_start) / case.haystack_len
        assert abs(where - case.depth) <= 0.05, (case.depth, where)
        assert abs(where - case.actual_depth) < 1e-9
        # the question closes the prompt and the answer appears nowhere else in the haystack
        text = tokenizer.decode(case.prompt_ids)
        assert text.rstrip().endswith("The pass key is" if task == "passkey" else "is")
        assert text.count(case.answer) == (2 if task == "passkey" else 1)
        assert case.answer in tokenizer.decode(case.answer_ids)


class WithBOS:
    """A byte-level tokenizer that puts a BOS before every text, as Llama's does (ByT5 and GPT-2 put none)."""

    BOS = 2

    def __init__(self, tokenizer):
        self.inner = tokenizer

    def __call__(self, text, add_special_tokens=True, **kwargs):
        encoded = self.inner(text, add_special_tokens=False, **kwargs)
        if add_special_tokens:
            encoded["input_ids"] = [self.BOS] + encoded["input_ids"]
        return encoded

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.mark.parametrize("task", ["passkey", "needle"])
def test_a_tokenizers_bos_goes_first_and_the_item_stays_where_the_case_says(byt5, task):
    cases, _ = lc.build_cases(WithBOS(byt5), task, [400], [0.0, 0.5, 1.0], samples=1, seed=3, haystack="python-docs")
    header = lc.PASSKEY_HEADER if task == "passkey" else lc.NEEDLE_HEADER
    for case in cases:
        assert case.prompt_ids[0] == WithBOS.BOS and case.prompt_ids.count(WithBOS.BOS) == 1
        assert len(case.prompt_ids) + len(case.answer_ids) == case.length
        # the BOS, the instruction, then the haystack from haystack_start, the hidden item exactly at needle_start
        assert byt5.decode(case.prompt_ids[1 : case.haystack_start]) == header
        expected_item = (lc.PASSKEY_NEEDLE.format(answer=case.answer) if task == "passkey" else None)
        item = byt5.decode(case.prompt_ids[case.needle_start : case.needle_start + case.needle_len])
        if expected_item is not None:
            assert item == expected_item
        else:
            assert item.startswith(lc.NEEDLE_SENTENCE.split("{")[0]) and case.answer in item
        assert abs((case.needle_start - case.haystack_start) / case.haystack_len - case.depth) <= 0.05


@pytest.mark.skipif(not GPT2.is_dir(), reason=f"no {GPT2}")
def test_retrieval_rows_with_a_bpe_tokenizer_are_whole_documents(tmp_path):
    """GPT-2 reads some decoded needle documents back a token longer or shorter; the packer would split those
    across rows and shift every row after them. They are replaced, so every document fills its row exactly."""
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    sys.path.insert(0, str(REPO / "bench"))
    import build_retrieval_data

    out = tmp_path / "needle.parquet"
    summary = build_retrieval_data.main(["--task", "needle", "--tokenizer", str(GPT2), "--seq-len", "256", "--rows",
                                         "200", "--haystack", "python-docs", "--out", str(out)])  # fmt: skip
    assert summary["documents_replaced"] > 0, summary  # (about 4% of them with this tokenizer and length)
    tokenizer = AutoTokenizer.from_pretrained(GPT2)
    texts = pq.read_table(out).column("text").to_pylist()
    assert len(texts) == 200
    assert all(len(tokenizer(t, add_special_tokens=False).input_ids) == 255 for t in texts)


def test_cases_are_seeded_per_cell(byt5):
    one, _ = lc.build_cases(byt5, "passkey", [300], [0.5], samples=3, seed=7)
    again, _ = lc.build_cases(byt5, "passkey", [300, 600], [0.0, 0.5], samples=3, seed=7)
    assert [c.prompt_ids for c in one] == [c.prompt_ids for c in again if c.length == 300 and c.depth == 0.5]
    other, _ = lc.build_cases(byt5, "passkey", [300], [0.5], samples=3, seed=8)
    assert [c.answer for c in one] != [c.answer for c in other]


@pytest.mark.parametrize("name", tokenizers())
@pytest.mark.parametrize("task", ["passkey", "needle"])
def test_training_documents_fill_one_row_each_and_end_with_their_answer(name, task):
    from nsa_train.data import Packer

    tokenizer = load_tokenizer(name)
    row_len = 320
    texts, filled, _ = lc.training_documents(tokenizer, task, row_len, count=6, seed=1, haystack="python-docs")
    assert len(texts) == 6 and len(set(texts)) == 6 and filled == [row_len] * 6
    for text in texts:
        assert len(tokenizer(text, add_special_tokens=False).input_ids) == row_len - 1
        # the answer closes the document and is the one hidden in it
        question = lc.PASSKEY_QUESTION if task == "passkey" else "? The secret word of the "
        body, answer = text.rsplit(" ", 1)
        assert question.strip() in body and answer.isdigit() == (task == "passkey")
        hidden = lc.PASSKEY_NEEDLE.format(answer=answer) if task == "passkey" else f" is {answer}."
        assert hidden.strip() in body
    # the trainer's packer makes one row of each document: every row starts with the instruction
    header = lc.PASSKEY_HEADER if task == "passkey" else lc.NEEDLE_HEADER
    rows = Packer(texts, tokenizer, row_len, shuffle_buffer=1, val_every=0)
    for (ids, pos, labels, _), _ in zip(rows, range(6)):
        assert pos == list(range(row_len)) and tokenizer.decode(ids).startswith(header.strip()[:30])


def test_training_documents_are_not_the_evaluation_prompts(byt5):
    texts, _, _ = lc.training_documents(byt5, "passkey", 300, count=40, seed=0)
    cases, _ = lc.build_cases(byt5, "passkey", [300 - 7], [0.0, 0.5, 1.0], samples=10, seed=0)
    evaluation = {byt5.decode(c.prompt_ids) for c in cases}
    assert not evaluation & {t.rsplit(" ", 1)[0] for t in texts}
    assert len({t.rsplit(" ", 1)[1] for t in texts} & {c.answer for c in cases}) <= 2  # 5-digit keys: chance only


def test_build_retrieval_data_script(tmp_path, capsys):
    import pyarrow.parquet as pq

    # in this process, the script's main (each run of the script costs seconds of imports; its exit status on a bad
    # value is checked in a process of its own below)
    sys.path.insert(0, str(REPO / "bench"))
    import build_retrieval_data

    out = tmp_path / "passkey.parquet"
    script = [sys.executable, str(REPO / "bench" / "build_retrieval_data.py")]
    build_retrieval_data.main(["--tokenizer", "byt5", "--seq-len", "256", "--rows", "5", "--out", str(out)])
    said = capsys.readouterr().out
    assert "5 passkey documents of 256 tokens with end-of-text, 1 per 256-token row" in said
    assert "0 that re-tokenized to another length were replaced" in said
    assert len(pq.read_table(out).column("text")) == 5
    # several shorter documents per row: each re-tokenizes to exactly its share (with the end-of-text token), so
    # the trainer's packer fills every row with whole documents, the answer ending each
    summary = build_retrieval_data.main(["--tokenizer", "byt5", "--seq-len", "512", "--doc-len", "256", "--rows", "3",
                                         "--out", str(out)])
    assert (summary["documents"], summary["documents_per_row"], summary["doc_len"]) == (6, 2, 256), summary
    from nsa_train.data import load_tokenizer

    texts = pq.read_table(out).column("text").to_pylist()
    tokenizer = load_tokenizer("byt5")
    assert len(texts) == 6 and all(len(tokenizer(t, add_special_tokens=False).input_ids) == 255 for t in texts)
    assert all(t.rstrip().split()[-1].rstrip(".").isdigit() for t in texts)  # each ends with its passkey
    # --min-doc-len: cases of varied lengths, haystack text after each answer completing its 256-token document (one
    # document per share: the trainer shuffles documents), so the answers end at varied positions
    summary = build_retrieval_data.main(["--tokenizer", "byt5", "--seq-len", "512", "--doc-len", "256", "--min-doc-len",
                                         "230", "--rows", "4", "--out", str(out)])  # fmt: skip
    assert summary["documents_replaced"] == 0 and summary["documents"] == 8, summary
    texts = pq.read_table(out).column("text").to_pylist()
    assert all(len(tokenizer(t, add_special_tokens=False).input_ids) == 255 for t in texts)
    question = lc.PASSKEY_QUESTION
    answer_ends = []
    for t in texts:
        assert t.count(question) == 1
        answer = t.split(question, 1)[1].split()[0]
        assert answer.isdigit() and answer in t.split(question, 1)[0]  # the answer is the hidden key
        answer_ends.append(len(tokenizer(t.split(question, 1)[0] + question + " " + answer).input_ids))
    assert len(set(answer_ends)) > 2 and min(answer_ends) >= 229 and max(answer_ends) <= 255, answer_ends
    assert any(len(t) > e + 2 for t, e in zip(texts, answer_ends))  # text after the answer
    # every drawn length fills its row, those too near the row's end for a blank line and filler too
    _, filled, _ = lc.training_documents(tokenizer, "passkey", 256, 300, min_len=224)
    assert filled == [256] * 300
    with pytest.raises(ValueError, match="--min-doc-len 100: too short for the passkey task"):
        build_retrieval_data.main(["--tokenizer", "byt5", "--seq-len", "256", "--min-doc-len", "100", "--rows", "1",
                                   "--out", str(out)])
    for bad in ("0", "-5"):  # the least length named is the task's, not a generic 2
        with pytest.raises(ValueError, match=f"--min-doc-len {bad}: too short .* use --min-doc-len >= 224"):
            build_retrieval_data.main(["--tokenizer", "byt5", "--seq-len", "256", "--min-doc-len", bad, "--rows", "1",
                                       "--out", str(out)])
    with pytest.raises(ValueError, match="--min-doc-len 300: give a length up to --seq-len 256"):
        build_retrieval_data.main(["--tokenizer", "byt5", "--seq-len", "256", "--min-doc-len", "300", "--rows", "1",
                                   "--out", str(out)])
    # a bad value: the script exits 2 with the message (run_command), which names the value and the fix
    proc = subprocess.run([*script, "--tokenizer", "byt5", "--seq-len", "512", "--doc-len", "100", "--rows", "1",
                           "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 2 and "error: --doc-len 100: give a divisor of --seq-len 512" in proc.stderr
    for bad in ("1024", "1"):
        with pytest.raises(ValueError, match=f"--doc-len {bad}: give a divisor of --seq-len 512"):
            build_retrieval_data.main(["--tokenizer", "byt5", "--seq-len", "512", "--doc-len", bad, "--rows", "1",
                                       "--out", str(out)])
    with pytest.raises(ValueError, match="--doc-len 128: too short for the passkey task"):
        build_retrieval_data.main(["--tokenizer", "byt5", "--seq-len", "512", "--doc-len", "128", "--rows", "1",
                                   "--out", str(out)])
    with pytest.raises(ValueError, match="--rows 0"):
        build_retrieval_data.main(["--tokenizer", "byt5", "--seq-len", "256", "--rows", "0", "--out", str(out)])
    with pytest.raises(ValueError, match="--seq-len.*too short for the passkey task"):
        build_retrieval_data.main(["--tokenizer", "byt5", "--seq-len", "64", "--rows", "1", "--out", str(out)])


# ----------------------------------------------------------------------------- scoring on hand-made models


class ScriptedLM(nn.Module):
    """A causal LM whose answers are scripted: `right(prompt_ids)` says whether it knows the answer of that prompt.
    Its logits put all mass on the true next token (or on another one) and its generate() writes the answer (or
    another number)."""

    def __init__(self, cases, right, vocab_size=384, stops=lambda prompt: False):
        super().__init__()
        self.config = type("Config", (), {"vocab_size": vocab_size, "max_position_embeddings": 4096,
                                          "model_type": "scripted", "rope_theta": 1e4})()  # fmt: skip
        self.anchor = nn.Parameter(torch.zeros(1))
        self.answers = {tuple(c.prompt_ids): c.answer_ids for c in cases}
        self.right = right
        # generate() writes all but the answer's last token, then "end": ends the text (token 1, ByT5's </s>),
        # "spaces": goes on with spaces (no stop), or "wrong-last": another byte in the last token's place, then ends
        self.stops = stops

    def forward(self, input_ids, attention_mask, logits_to_keep=0):
        assert attention_mask.shape == input_ids.shape
        batch, length = input_ids.shape
        next_ids = torch.cat([input_ids[:, 1:], torch.zeros_like(input_ids[:, :1])], dim=1)
        for row in range(batch):
            tokens = input_ids[row][attention_mask[row].bool()].tolist()
            prompt = next(p for p in self.answers if tuple(tokens[: len(p)]) == p)
            if not self.right(prompt):
                next_ids[row] = (next_ids[row] + 1) % self.config.vocab_size
        logits = 10.0 * nn.functional.one_hot(next_ids, self.config.vocab_size).float()
        return type("Out", (), {"logits": logits[:, -logits_to_keep:] if logits_to_keep else logits})()

    def generate(self, input_ids, attention_mask, max_new_tokens, do_sample, pad_token_id):
        rows = []
        for row in range(input_ids.shape[0]):
            prompt = tuple(input_ids[row][attention_mask[row].bool()].tolist())
            if self.right(prompt):
                answer = self.answers[prompt]
            elif self.stops(prompt):
                tail = {"end": [], "spaces": [ord(" ") + 3] * 9, "wrong-last": [ord("y") + 3]}[self.stops(prompt)]
                answer = self.answers[prompt][:-1] + tail
            else:
                answer = [ord(c) + 3 for c in " 00000"]
            rows.append(input_ids[row].tolist() + (answer + [1] * max_new_tokens)[:max_new_tokens])
        return torch.tensor(rows)


@pytest.mark.parametrize("task", ["passkey", "needle"])
@pytest.mark.parametrize("scoring", ["generate", "loglik"])
def test_scoring_on_scripted_answers(byt5, task, scoring):
    lengths, depths = [300, 420], [0.0, 0.5, 1.0]
    kw = dict(samples=3, seed=1, haystack="python-docs")
    cases, _ = lc.build_cases(byt5, task, lengths, depths, **kw)
    depth_of = {tuple(c.prompt_ids): c.depth for c in cases}
    length_of = {tuple(c.prompt_ids): c.length for c in cases}
    # right at depth 0 always, at depth 0.5 for the 420-token cases only, never at depth 1
    model = ScriptedLM(cases, lambda p: depth_of[p] == 0.0 or (depth_of[p] == 0.5 and length_of[p] == 420))
    result = lc.run_long_context_eval(model, byt5, task, lengths, depths, batch_size=4, scoring=scoring,
                                      training_len=300, log=lambda s: None, **kw)  # fmt: skip
    assert result["accuracy"] == [[1.0, 0.0, 0.0], [1.0, 1.0, 0.0]]
    assert result["extrapolated_lengths"] == [420]
    if scoring == "loglik":  # a right answer has log-prob ~0 (-0.017: 383 other logits at 0), a wrong one ~ -10
        by_cell = {(c["length"], c["depth"]): c["answer_logprob_mean"] for c in result["cells"]}
        assert by_cell[(300, 0.0)] > -0.02 and by_cell[(300, 1.0)] < -9


def test_answers_that_end_inside_themselves_are_counted_apart(byt5, tmp_path):
    """A greedy answer that stops after its right start (the ending a model learned from rows of one length) is
    scored wrong, and counted per cell, in the result's matrix and in the printed table; for a file written
    before the matrix existed, from its cases' predictions."""
    lengths, depths = [300, 420], [0.0, 1.0]
    cases, _ = lc.build_cases(byt5, "passkey", lengths, depths, samples=2, seed=3)
    length_of = {tuple(c.prompt_ids): c.length for c in cases}
    depth_of = {tuple(c.prompt_ids): c.depth for c in cases}
    # right at 300 tokens; at 420 one token short, then the end of the text at depth 0 and spaces at depth 1
    model = ScriptedLM(cases, lambda p: length_of[p] == 300, stops=lambda p: "end" if depth_of[p] == 0.0 else "spaces")
    # ('wrong-last' below: '7008y' for '70087', then the end: right but for the last token, not ended inside it)
    lines = []
    result = lc.run_long_context_eval(model, byt5, "passkey", lengths, depths, samples=2, seed=3, batch_size=3,
                                      log=lines.append, out_dir=tmp_path)  # fmt: skip
    assert result["accuracy"] == [[1.0, 1.0], [0.0, 0.0]]
    assert result["ended_inside_answer"] == [[0.0, 0.0], [1.0, 0.0]]
    stopped = next(c for c in result["cells"] if (c["length"], c["depth"]) == (420, 0.0))["cases"]
    assert all(x["ended_inside_answer"] and x["stopped"] and x["answer"].startswith(x["prediction"]) and
               len(x["prediction"]) == len(x["answer"]) - 1 for x in stopped)  # fmt: skip
    went_on = next(c for c in result["cells"] if (c["length"], c["depth"]) == (420, 1.0))["cases"]
    assert all(not x["stopped"] and not x["ended_inside_answer"] for x in went_on)  # the same text, no stop
    # both the depth-0 stops and the depth-1 spaces had every token but the last right
    assert result["right_but_last_token"] == [[1.0, 1.0], [1.0, 1.0]]
    summary = lines[0].split("\n\n")[-1]
    assert summary.startswith("right in every answer token but perhaps the last (the accuracy plus the answers wrong "
                              "at that token alone), % of cases: 420: 100; ended inside the answer")
    assert "end-of-text; scored wrong), % of cases: 420: 50." in summary and "300:" not in summary
    saved = json.loads((tmp_path / "passkey_generate.json").read_text())
    del saved["ended_inside_answer"]  # a file written before the matrix existed: derived from its cases' texts,
    assert lc.ended_inside_answer_rates(saved) == [[0.0, 0.0], [1.0, 1.0]]  # where no stop was recorded
    del saved["depths"]
    assert lc.ended_inside_answer_rates(saved) is None
    loglik = lc.run_long_context_eval(model, byt5, "passkey", lengths, depths, samples=2, seed=3, scoring="loglik",
                                      log=lambda s: None)  # fmt: skip
    assert loglik["ended_inside_answer"] is None and lc.ended_inside_answer_rates(loglik) is None
    assert loglik["right_but_last_token"] is None and "last token" not in lc.format_table(loglik)
    # wrong from the first token: said to be so; every answer right: no line
    wrong = lc.run_long_context_eval(ScriptedLM(cases, lambda p: length_of[p] == 300), byt5, "passkey", lengths,
                                     depths, samples=2, seed=3, log=lambda s: None)  # fmt: skip
    assert lc.format_table(wrong).endswith("every wrong answer was wrong before its last token, and none ended inside "
                                           "itself (its right start, then end-of-text).")  # fmt: skip
    right = lc.run_long_context_eval(ScriptedLM(cases, lambda p: True), byt5, "passkey", lengths, depths, samples=2,
                                     seed=3, log=lambda s: None)  # fmt: skip
    assert "last" not in lc.format_table(right) and "ended inside" not in lc.format_table(right)
    # a wrong last token, then the end of the text: counted as right but perhaps the last, not as ended inside;
    # at the training length the line says why
    last = lc.run_long_context_eval(ScriptedLM(cases, lambda p: length_of[p] == 300, stops=lambda p: "wrong-last"),
                                    byt5, "passkey", lengths, depths, samples=2, seed=3, training_len=420,
                                    log=lambda s: None)  # fmt: skip
    assert last["right_but_last_token"] == [[1.0, 1.0], [1.0, 1.0]] and last["ended_inside_answer"] == [[0, 0], [0, 0]]
    assert all(x["prediction"].endswith("y") and x["stopped"] for c in last["cells"] if c["length"] == 420
               for x in c["cases"])  # fmt: skip
    summary = lc.format_table(last).split("\n\n")[-1]
    assert summary.startswith("right in every answer token but perhaps the last") and "420: 100" in summary
    assert "ended inside" not in summary and "At 420 tokens, the training length" in summary


def test_one_token_answers_have_no_right_but_last_share(byt5, monkeypatch):
    """An answer of one token has nothing before its last: no share (it would only repeat the accuracy), and the
    line under the table does not claim that wrong answers went wrong before their last token."""
    real = lc._item_texts

    def one_digit_answers(task, rng):
        header, item, question, answer = real(task, rng)
        return header, item.replace(answer, answer[0]), question, answer[0]

    monkeypatch.setattr(lc, "_item_texts", one_digit_answers)
    cases, _ = lc.build_cases(byt5, "passkey", [300], [0.0, 1.0], samples=2, seed=3)
    assert all(len(c.answer_ids) == 2 for c in cases)  # ByT5: the leading space and the digit
    cases = [dataclasses.replace(c, answer_ids=c.answer_ids[1:]) for c in cases]  # one token: the digit alone
    scored = lc.score_generate(ScriptedLM(cases, lambda p: True), byt5, cases, torch.device("cpu"), pad_id=0)
    assert [s["correct"] for s in scored] == [True] * 4 and [s["right_but_last_token"] for s in scored] == [None] * 4
    monkeypatch.setattr(lc, "_answer_ids", lambda tokenizer, question, answer, vocab: [ord(answer) + 3])
    model = ScriptedLM(lc.build_cases(byt5, "passkey", [300], [0.0, 1.0], samples=2, seed=3)[0], lambda p: False)
    result = lc.run_long_context_eval(model, byt5, "passkey", [300], [0.0, 1.0], samples=2, seed=3,
                                      log=lambda s: None)  # fmt: skip
    assert result["accuracy"] == [[0.0, 0.0]] and result["right_but_last_token"] is None
    assert lc.format_table(result).endswith("no answer ended inside itself (its right start, then end-of-text).")


def test_ends_inside_answer_rule():
    assert lc.ends_inside_answer("7008", "70087")
    assert not lc.ends_inside_answer("70087", "70087")  # right
    assert not lc.ends_inside_answer("", "70087")  # nothing said: not the answer's start
    assert not lc.ends_inside_answer("7008 and", "70087")  # went on: a wrong answer
    assert not lc.ends_inside_answer("7009", "70087")
    assert lc.ends_inside_answer("'viol", "violet")  # the punctuation first_word strips
    assert not lc.ends_inside_answer(" . ", "70087")


def test_first_word_rule():
    assert lc.first_word(" 12345. And") == "12345"
    assert lc.first_word("\n'violet', said") == "violet"
    assert lc.first_word("   ") == ""


# ----------------------------------------------------------------------------- real models, the CLI


def test_cli_on_an_nsa_run_flags_extrapolation_and_writes_outputs(nsa_run, tmp_path):
    out = tmp_path / "out"
    result = lc.main([str(nsa_run / "final"), "--task", "passkey", "--lengths", "240", "320", "--depths", "0", "0.5",
                      "1", "--samples", "2", "--batch-size", "3", "--out", str(out)])  # fmt: skip
    assert result["training_len"] == 256 and "run.json" in result["training_len_source"]
    assert result["extrapolated_lengths"] == [320]
    assert result["attention_mode"] == "nsa"
    saved = json.loads((out / "passkey_generate.json").read_text())
    assert saved["accuracy"] == result["accuracy"] and len(saved["cells"]) == 6
    assert all(len(cell["cases"]) == 2 for cell in saved["cells"])
    assert (out / "passkey_generate.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("scoring", ["generate", "loglik"])
def test_cli_on_a_hf_llama_needle(llama_dir, tmp_path, scoring):
    out = tmp_path / "out"
    result = lc.main([str(llama_dir), "--task", "needle", "--lengths", "300", "400", "--depths", "0.25", "0.75",
                      "--samples", "2", "--scoring", scoring, "--haystack", "python-docs", "--out", str(out)])  # fmt: skip
    assert result["model_class"] == "LlamaForCausalLM" and result["training_len"] == 512
    assert result["extrapolated_lengths"] == []
    assert (out / f"needle_{scoring}.json").is_file() and (out / f"needle_{scoring}.png").is_file()
    assert len(result["accuracy"]) == 2 and all(len(row) == 2 for row in result["accuracy"])


def test_loglik_matches_a_direct_computation_on_a_real_model(llama_dir, byt5):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(llama_dir).eval()
    cases, _ = lc.build_cases(byt5, "needle", [320], [0.5], samples=3, seed=2, haystack="python-docs")
    scored = lc.score_loglik(model, cases, torch.device("cpu"), pad_id=0)
    for case, score in zip(cases, scored):  # one case alone, no padding, every logit kept
        ids = torch.tensor([case.prompt_ids + case.answer_ids])
        with torch.no_grad():
            log_probs = torch.log_softmax(model(ids).logits[0].float(), -1)
        n = len(case.answer_ids)
        picked = [log_probs[len(case.prompt_ids) - 1 + j, t] for j, t in enumerate(case.answer_ids)]
        argmax = [int(log_probs[len(case.prompt_ids) - 1 + j].argmax()) for j in range(n)]
        assert score["answer_logprob"] == pytest.approx(float(sum(picked) / n), abs=1e-4)
        assert score["correct"] == (argmax == case.answer_ids)


# ----------------------------------------------------------------------------- errors


def test_a_length_that_does_not_fit_in_memory_is_named_with_the_way_out(byt5, llama_dir, monkeypatch):
    from transformers import AutoModelForCausalLM

    llama = AutoModelForCausalLM.from_pretrained(llama_dir)
    real_score = lc.score_loglik

    def out_of_memory_at_600(model, batch, *args, **kwargs):  # CPU torch's error for a 100k x 100k score matrix
        if any(case.length == 600 for case in batch):
            raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] data. DefaultCPUAllocator: not enough memory: "
                               "you tried to allocate 39995200144 bytes.")
        return real_score(model, batch, *args, **kwargs)

    monkeypatch.setattr(lc, "score_loglik", out_of_memory_at_600)
    # 3 cases per length in batches of 2: the second batch holds one case of 300 and one of 600
    with pytest.raises(RuntimeError, match=r"^length 600: out of memory on cpu with 2 case\(s\) per batch\. Use a "
                                           r"smaller batch, shorter lengths or a GPU .*tried to allocate 39995200144"):
        lc.run_long_context_eval(llama, byt5, "passkey", [300, 600], [0.5], samples=3, batch_size=2,
                                 scoring="loglik", log=lambda s: None)  # fmt: skip

    def cuda_out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 40.00 GiB")

    monkeypatch.setattr(lc, "score_loglik", cuda_out_of_memory)
    with pytest.raises(RuntimeError, match=r"^length 300: out of memory .*CUDA out of memory"):
        lc.run_long_context_eval(llama, byt5, "passkey", [300], [0.5], samples=1, scoring="loglik", log=lambda s: None)

    def another_error(*args, **kwargs):
        raise RuntimeError("shape mismatch")

    monkeypatch.setattr(lc, "score_loglik", another_error)  # not memory: passed on as it is
    with pytest.raises(RuntimeError, match="^shape mismatch$"):
        lc.run_long_context_eval(llama, byt5, "passkey", [300], [0.5], samples=1, scoring="loglik", log=lambda s: None)


def test_extrapolation_starts_past_the_training_length(byt5, llama_dir):
    from transformers import AutoModelForCausalLM

    llama = AutoModelForCausalLM.from_pretrained(llama_dir)
    result = lc.run_long_context_eval(llama, byt5, "passkey", [300, 301], [0.5], samples=1, scoring="loglik",
                                      training_len=300, log=lambda s: None)  # fmt: skip
    assert [(cell["length"], cell["extrapolation"]) for cell in result["cells"]] == [(300, False), (301, True)]
    assert result["extrapolated_lengths"] == [301]
    assert "* beyond the training length 300 (given by the caller): extrapolation" in lc.format_table(result)
    # rotary positions run past max_position_embeddings (512 here); the table says which lengths went there
    logged = []
    past = lc.run_long_context_eval(llama, byt5, "passkey", [300, 520], [0.5], samples=1, scoring="loglik",
                                    training_len=300, training_len_source="--training-len", log=logged.append)
    assert past["beyond_max_positions"] == [520] and past["max_position_embeddings"] == 512
    # ... and says so before the evaluation, not only in the table at its end
    assert logged[0].startswith("520 tokens: beyond the config's max_position_embeddings (512)"), logged[0]
    table = lc.format_table(past)
    assert "beyond the training length 300 (--training-len)" in table
    assert "520: beyond the config's max_position_embeddings (512)" in table
    assert "max_position_embeddings" not in lc.format_table(result)


def test_bad_inputs_are_named_with_the_fix(byt5, llama_dir):
    from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

    llama = AutoModelForCausalLM.from_pretrained(llama_dir)
    quiet = dict(log=lambda s: None, samples=1)
    with pytest.raises(ValueError, match=r"--task 'retrieve': unknown task; choose one of passkey, needle"):
        lc.run_long_context_eval(llama, byt5, "retrieve", [300], [0.5], **quiet)
    with pytest.raises(ValueError, match=r"--scoring 'sample'"):
        lc.run_long_context_eval(llama, byt5, "passkey", [300], [0.5], scoring="sample", **quiet)
    for depths, needle in (([1.5], r"--depths 1.5: .* in \[0, 1\]"), ([-0.1], r"--depths -0.1"),
                           ([], r"at least one depth"), ([0.5, 0.5], r"repeated")):  # fmt: skip
        with pytest.raises(ValueError, match=needle):
            lc.run_long_context_eval(llama, byt5, "passkey", [300], depths, **quiet)
    with pytest.raises(ValueError, match=r"--lengths 20: too short for the passkey task's fixed text \(\d+ tokens.*use --lengths >= \d+") as short:
        lc.run_long_context_eval(llama, byt5, "passkey", [20], [0.5], **quiet)
    # the fields a caller reads instead of the message (the trainer's note on a skipped default length)
    assert isinstance(short.value, lc.CaseTooShortError) and (short.value.length, short.value.task) == (20, "passkey")
    assert f"use --lengths >= {short.value.needed}." in str(short.value) and short.value.needed > 20
    with pytest.raises(ValueError, match=r"--samples 0"):
        lc.run_long_context_eval(llama, byt5, "passkey", [300], [0.5], log=lambda s: None, samples=0)
    with pytest.raises(ValueError, match=r"--haystack 'hf://x/y': a streamed Hub dataset"):
        lc.run_long_context_eval(llama, byt5, "needle", [300], [0.5], haystack="hf://x/y", **quiet)
    with pytest.raises(FileNotFoundError, match=r"^--haystack '/no/such.parquet': no such file"):  # (not the trainer's flag)
        lc.run_long_context_eval(llama, byt5, "needle", [300], [0.5], haystack="/no/such.parquet", **quiet)
    # a learned position table (GPT-2's n_positions) cannot take longer prompts
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=384, n_positions=128, n_embd=16, n_layer=1, n_head=2))
    with pytest.raises(ValueError, match=r"--lengths 256: above what the model's positions allow \(128 positions, "
                                         r"config n_positions.*use lengths <= 128"):  # fmt: skip
        lc.run_long_context_eval(gpt2, byt5, "passkey", [100, 256], [0.5], **quiet)
    # a tokenizer without the needed tokens: a word-level vocabulary that has no digits
    small = word_level_tokenizer()
    with pytest.raises(ValueError, match=r"cannot represent the .* pass --tokenizer"):
        lc.run_long_context_eval(llama, small, "passkey", [300], [0.5], **quiet)
    # token ids beyond the model's vocabulary
    tiny_vocab = GPT2LMHeadModel(GPT2Config(vocab_size=100, n_positions=512, n_embd=16, n_layer=1, n_head=2))
    with pytest.raises(ValueError, match=r"outside the model's vocabulary of 100; pass --tokenizer"):
        lc.run_long_context_eval(tiny_vocab, byt5, "passkey", [300], [0.5], **quiet)


def word_level_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = "[UNK] the pass key is there a hidden somewhere in text below".split()
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")


def test_cli_errors_exit_2_before_loading(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "nsa_train.long_context", str(tmp_path / "missing"), "--task", "qa"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 2 and "error: --task 'qa': unknown task" in proc.stderr
    with pytest.raises(ValueError, match=r"MODEL '.*missing': no such directory; pass a run's final/"):
        lc.main([str(tmp_path / "missing"), "--lengths", "100"])
    # a missing --tokenizer path is named as one (not as a malformed Hub id), before any model loads
    with pytest.raises(ValueError, match=r"^--tokenizer '.*no/tok': no such directory\. Pass --tokenizer PATH .* Or "
                                         r"leave --tokenizer out to use MODEL's\.$"):
        lc.load_model_and_tokenizer(str(tmp_path), str(tmp_path / "no" / "tok"))


def test_a_model_saved_without_a_tokenizer_takes_the_trainers_tokenizer_names(llama_dir, tmp_path):
    """--tokenizer goes through the trainer's loader: `byt5` (what a run trained with --tokenizer byt5 names) loads
    by name, as in train_accelerate.py; a model directory without tokenizer files, and no --tokenizer, is named with
    that fix."""
    bare = tmp_path / "weights-only"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(llama_dir / name, bare / name)
    with pytest.raises(ValueError, match=r"^MODEL '.*weights-only': cannot load its tokenizer .* pass --tokenizer .* "
                                         r"or byt5\.$"):
        lc.load_model_and_tokenizer(str(bare))
    model, tokenizer = lc.load_model_and_tokenizer(str(bare), "byt5")
    assert type(tokenizer).__name__ == "ByT5Tokenizer" and model.config.vocab_size == len(tokenizer)


def test_a_hub_id_fails_in_seconds_where_the_hub_cannot_be_reached(monkeypatch, tmp_path):
    """A Hub id that is not in the local cache, offline: one error naming it, not a minute of retries."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    started = time.time()
    with pytest.raises(ValueError, match=r"^MODEL 'someorg/nomodel': HF_HUB_OFFLINE is set.*Pass a run's final/"):
        lc.load_model_and_tokenizer("someorg/nomodel")
    # --tokenizer through the trainer's loader: its ConnectionError is bad input here, one line (not a traceback)
    with pytest.raises(ValueError, match=r"^--tokenizer 'someorg/notok': HF_HUB_OFFLINE is set.* Or leave --tokenizer "
                                         r"out to use MODEL's\.$"):
        lc.load_model_and_tokenizer(str(tmp_path), "someorg/notok")
    assert time.time() - started < 10


def test_the_cli_does_not_replace_an_evaluation_made_with_other_settings(tmp_path):
    """<out>/<task>_<scoring>.json of a run is the trainer's --eval-long-context result, which the model card,
    ab_compare and seed_groups read: another evaluation (other lengths, depths, samples or seed) refuses to replace
    it, before a model loads, unless --overwrite; the same settings again (an identical measurement) may."""
    out = tmp_path / "long_context"
    out.mkdir()
    trainer = {"task": "passkey", "scoring": "generate", "lengths": [128, 256], "depths": [0.0, 0.5, 1.0],
               "samples": 10, "seed": 0}
    (out / "passkey_generate.json").write_text(json.dumps(trainer))
    with pytest.raises(ValueError, match=r"passkey_generate.json holds an evaluation with other settings \(lengths "
                                         r"\[128, 256\] -> \[128, 512\]; samples 10 -> 4\).*--out DIR.*--overwrite"):
        lc.main([str(tmp_path / "missing"), "--lengths", "512", "128", "--depths", "0", "0.5", "1", "--samples", "4",
                 "--out", str(out)])  # fmt: skip
    lc.check_not_replacing(out, "passkey", "generate", {k: trainer[k] for k in lc.SAME_EVALUATION})
    lc.check_not_replacing(out, "passkey", "loglik", {"lengths": [512], "depths": [0.5], "samples": 1, "seed": 0})
    # with --overwrite the check is skipped: the missing model is what fails next
    with pytest.raises(ValueError, match=r"MODEL '.*missing': no such directory"):
        lc.main([str(tmp_path / "missing"), "--lengths", "512", "--out", str(out), "--overwrite"])
    # a needle evaluation on other documents is another evaluation too (its haystack, as the result records it)
    from nsa_train.data import make_source

    docs = tmp_path / "docs.jsonl"
    docs.write_text(json.dumps({"text": "A document. " * 50}) + "\n")
    described = make_source("python-docs").describe()
    (out / "needle_generate.json").write_text(json.dumps({**trainer, "task": "needle", "haystack": described}))
    same = ["--task", "needle", "--lengths", "128", "256", "--depths", "0", "0.5", "1", "--samples", "10", "--out", str(out)]
    with pytest.raises(ValueError, match=r"needle_generate.json holds an evaluation with other settings \(haystack "):
        lc.main([str(tmp_path / "missing"), *same, "--haystack", str(docs)])
    with pytest.raises(ValueError, match=r"MODEL '.*missing': no such directory"):  # its own documents: not refused
        lc.main([str(tmp_path / "missing"), *same, "--haystack", "python-docs"])


def test_a_cuda_device_without_a_gpu_is_named(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"^--device cuda:0: this machine has no CUDA GPU .* pass --device cpu"):
        lc.load_model_and_tokenizer("never-loaded", device="cuda:0")
    # from the CLI, before the check of an earlier result in --out (a refusal there would hide it until a second try)
    monkeypatch.setattr(lc, "check_not_replacing", lambda *a: pytest.fail("the earlier result came first"))
    with pytest.raises(ValueError, match=r"^--device cuda: this machine has no CUDA GPU"):
        lc.main(["never-loaded", "--device", "cuda"])
    lc.check_device("cpu")
    lc.check_device(None)


def test_an_out_that_cannot_hold_the_results_is_named_before_the_model_loads(tmp_path, monkeypatch, capsys):
    """--out is a folder: a file there fails first, naming it, not after the evaluation with FileExistsError."""
    (tmp_path / "results.py").write_text("")
    monkeypatch.setattr(lc, "load_model_and_tokenizer", lambda *a, **k: pytest.fail("the model loaded first"))
    with pytest.raises(ValueError, match=r"^--out '.*results.py' is a file; this output is a folder"):
        lc.main(["never-loaded", "--lengths", "256", "--out", str(tmp_path / "results.py")])
    with pytest.raises(ValueError, match=r"^--out '.*' is a folder; this output is one file: pass a file's path"):
        lc.check_output_path(tmp_path, "file")
    lc.check_output_path(tmp_path / "new", "folder")
    with pytest.raises(SystemExit):  # the trainer's spelling of the flag: the tool's own is named
        lc.main(["never-loaded", "--long-context-lengths", "256"])
    assert "unrecognized arguments: --long-context-lengths 256 (did you mean --lengths?)" in capsys.readouterr().err
    for bad in ("0", "-5"):
        with pytest.raises(ValueError, match=rf"^--training-len {bad}: the model's training length is a positive"):
            lc.main(["never-loaded", "--lengths", "256", "--training-len", bad, "--out", str(tmp_path / "new")])
    lc.check_output_path(tmp_path / "new.json", "file")


def test_a_run_directory_is_told_to_pass_its_final(nsa_run, monkeypatch):
    with pytest.raises(ValueError, match=r"^MODEL '.*' is a training run's directory, not a saved model; pass its "
                                         r"final/ \(.*final\)\.$"):
        lc.load_model_and_tokenizer(str(nsa_run))
    # from the CLI, before an earlier result in --out (./long_context for a MODEL that is not a run's final/)
    monkeypatch.setattr(lc, "check_not_replacing", lambda *a: pytest.fail("the earlier result came first"))
    with pytest.raises(ValueError, match=r"is a training run's directory, not a saved model; pass its final/"):
        lc.main([str(nsa_run), "--lengths", "512"])


def test_a_missing_model_path_is_told_from_a_hub_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "smoke" / "final").mkdir(parents=True)
    for spec in ("runs/smoke/final", str(tmp_path), "gpt2", "org/name", "HuggingFaceTB/SmolLM2-135M"):
        assert Path(spec).exists() or not looks_like_a_path(spec), spec  # there, or a Hub id
    for spec in ("runs/nope", "runs/smoke/nope", str(tmp_path / "nope"), "./nope", "~/no/such/model", "a\\b"):
        assert looks_like_a_path(spec), spec
    with pytest.raises(ValueError, match=r"^MODEL 'runs/nope': no such directory; pass a run's final/"):
        lc.resolve_source("runs/nope", "MODEL", "config.json", "pass a run's final/ directory.", "")


@pytest.mark.parametrize("world", [2, 3])
def test_processes_split_the_batches_and_every_one_gets_the_whole_result(byt5, world):
    """shard=(rank, world) (the trainer under DDP): process r scores batches r, r + world, ... and, with every
    process's items gathered, returns what one process scoring every case returns; a gather that loses a process's
    items fails, naming the batches."""
    lengths, depths = [300, 420], [0.0, 0.5, 1.0]
    kw = dict(samples=3, seed=1, haystack="python-docs", training_len=300, log=lambda s: None, batch_size=2)
    cases, _ = lc.build_cases(byt5, "passkey", lengths, depths, samples=3, seed=1, haystack="python-docs")
    depth_of = {tuple(c.prompt_ids): c.depth for c in cases}
    length_of = {tuple(c.prompt_ids): c.length for c in cases}
    model = ScriptedLM(cases, lambda p: depth_of[p] == 0.0 or (depth_of[p] == 0.5 and length_of[p] == 420))
    whole = lc.run_long_context_eval(model, byt5, "passkey", lengths, depths, **kw)

    class Collected(Exception):
        pass

    local = {}

    def collect(rank):
        def gather(mine):
            local[rank] = mine
            raise Collected

        return gather

    for rank in range(world):  # what each process contributes
        with pytest.raises(Collected):
            lc.run_long_context_eval(model, byt5, "passkey", lengths, depths, shard=(rank, world), gather=collect(rank),
                                     **kw)
    n_batches = -(-len(cases) // 2)
    assert [[k for k, _ in local[r]] for r in range(world)] == [list(range(r, n_batches, world)) for r in range(world)]
    every = [item for r in range(world) for item in local[r]]  # gather_object: concatenated in rank order
    result = lc.run_long_context_eval(model, byt5, "passkey", lengths, depths, shard=(1, world),
                                      gather=lambda mine: every, **kw)
    assert result["accuracy"] == whole["accuracy"] and result["processes"] == world
    assert [c["cases"] for c in result["cells"]] == [c["cases"] for c in whole["cells"]]
    with pytest.raises(RuntimeError, match=r"batches \[1.* were scored by no process"):
        lc.run_long_context_eval(model, byt5, "passkey", lengths, depths, shard=(0, world), gather=lambda mine: mine,
                                 **kw)
    with pytest.raises(ValueError, match=r"shard=\(2, 2\): give \(rank, world\)"):
        lc.run_long_context_eval(model, byt5, "passkey", lengths, depths, shard=(2, 2), gather=lambda mine: mine, **kw)


# ----------------------------------------------------------------------------- where NSA's selection looks


def test_answer_blocks_are_where_the_key_is_written(byt5):
    """The blocks _answer_span_blocks names hold the passkey's digits (both mentions in the item), found here from
    the decoded prompt's text, byte by byte (ByT5: one token per byte after the special prefix)."""
    cases, _ = lc.build_cases(byt5, "passkey", [300], [0.0, 0.5, 1.0], samples=2, seed=3)
    for case in cases:
        prefix = len(lc._special_prefix(byt5))
        text = bytes(i - 3 for i in case.prompt_ids[prefix:]).decode()  # ByT5: id = byte + 3
        item_text = text[case.needle_start - prefix : case.needle_start - prefix + case.needle_len]
        digits = [prefix + case.needle_start - prefix + i + j for i in range(len(item_text))
                  if item_text.startswith(case.answer, i) for j in range(len(case.answer))]  # fmt: skip
        assert len(digits) == 2 * len(case.answer)  # the item names the key twice
        for block_size in (16, 64):
            assert lc._answer_span_blocks(case, block_size) == sorted({p // block_size for p in digits})


def test_block_regions_follow_the_prompt_s_parts(byt5):
    """_block_regions labels each block by the first part it holds, in the order answer, rest of the item, question,
    instruction, haystack: checked against the parts' token positions, found in the decoded prompt."""
    cases, _ = lc.build_cases(byt5, "passkey", [300], [0.0, 0.5, 1.0], samples=1, seed=4)
    for case in cases:
        text = bytes(i - 3 for i in case.prompt_ids).decode(errors="replace")  # ByT5: one token per byte, id = byte + 3
        question = text.rindex(lc.PASSKEY_QUESTION.strip())
        digits = {case.needle_start + i + j for i in range(case.needle_len)
                  if text.startswith(case.answer, case.needle_start + i) for j in range(len(case.answer))}  # fmt: skip
        parts = [("answer", digits), ("item", set(range(case.needle_start, case.needle_start + case.needle_len))),
                 ("question", set(range(question - 2, len(case.prompt_ids)))),  # (its two leading newlines)
                 ("instruction", set(range(case.haystack_start))), ("haystack", set(range(len(case.prompt_ids))))]
        n_blocks = -(-len(case.prompt_ids) // 16)
        want = [next(name for name, tokens in parts if tokens & set(range(16 * b, 16 * b + 16))) for b in range(n_blocks)]
        assert lc._block_regions(case, n_blocks, 16) == want
        assert set(want) == set(lc.REGIONS)


def test_chance_of_selecting_counts_every_draw():
    import itertools

    for eligible, picks, targets in [(13, 3, 2), (13, 3, 5), (7, 7, 1), (9, 2, 0), (6, 4, 6), (10, 1, 3)]:
        draws = list(itertools.combinations(range(eligible), min(picks, eligible)))
        hits = sum(any(b < targets for b in draw) for draw in draws)
        assert lc._chance_of_selecting(targets, eligible, picks) == pytest.approx(hits / len(draws))


def test_needle_selection_reads_the_last_tokens_selection(byt5, monkeypatch):
    """needle_selection on hand-made selections: per layer and KV group, a hit where the last prompt token's list
    holds an answer block (in-document indices: the left padding of the shorter prompt does not shift them), none
    where it holds only other blocks; the chance from the document's free blocks; the forced and window flags."""
    from modeling_nsa.nsa_layout import NSAParams
    from nsa_train import selection_stats

    params = NSAParams(cmp_block_size=16, cmp_stride=8, sel_block_size=16, sel_num_blocks=5, sel_init_blocks=1,
                       sel_local_blocks=2, window_size=32)  # fmt: skip
    cases, _ = lc.build_cases(byt5, "passkey", [300, 420], [0.5], samples=1, seed=2)
    short, long_ = cases
    answer_short, answer_long = (lc._answer_span_blocks(c, 16) for c in cases)
    width = len(long_.prompt_ids)
    indices = torch.full((2, 2, 2, width, 5), -1)  # (layers, B, Hkv, T, n')
    indices[0, 0, 0, -1, :2] = torch.tensor([0, answer_short[0]])  # layer 0, short prompt, group 0: a hit
    indices[0, 0, 1, -1, :2] = torch.tensor([0, 1])  # group 1: no answer block
    indices[1, 1, 1, -1, 0] = answer_long[-1]  # layer 1, long prompt, group 1: a hit
    indices[0, 0, 0, -2, :] = torch.tensor(answer_long[:1] * 5)  # another query's list is not read
    fake = [selection_stats.LayerSelection(layer, torch.zeros(2, width, 4, 3), indices[layer], torch.zeros(2, width),
                                           params) for layer in range(2)]  # fmt: skip
    seen = {}

    def capture(model, batch, max_rows, max_len, last):
        seen.update(batch=batch, max_rows=max_rows, max_len=max_len, last=last)
        return fake

    monkeypatch.setattr(selection_stats, "capture_selections", capture)
    got = lc.needle_selection(object(), cases, "cpu", pad_id=0)
    assert seen["max_rows"] == 2 and seen["max_len"] == width and seen["last"] == 1
    # left padding: the short prompt ends the row
    assert int(seen["batch"]["attention_mask"][0].sum()) == len(short.prompt_ids)
    assert got[0]["needle_selected"] == [[True, False], [False, False]]
    assert got[1]["needle_selected"] == [[False, False], [False, True]]
    # free picks by region: block 0 is forced (not a pick); blocks 1 and the answer's are
    region = lc._block_regions(short, (len(short.prompt_ids) - 1) // 16 + 1, 16)
    assert got[0]["free_picks_by_region"][0] == {name: [region[1], "answer"].count(name) for name in lc.REGIONS}
    assert got[0]["free_picks_by_region"][1] == {name: 0 for name in lc.REGIONS}
    assert got[1]["free_picks_by_region"][1] == {**{name: 0 for name in lc.REGIONS}, "answer": 1}
    own = (len(short.prompt_ids) - 1) // 16
    free_regions = [region[b] for b in range(1, own - 1)]  # without block 0 and the two local blocks
    assert got[0]["free_blocks_by_region"] == {name: free_regions.count(name) for name in lc.REGIONS}
    for case, res in zip(cases, got):
        own = (len(case.prompt_ids) - 1) // 16
        free = own + 1 - 3  # block 0 and the two local blocks are forced
        targets = len(lc._answer_span_blocks(case, 16))
        assert res["needle_chance"] == pytest.approx(lc._chance_of_selecting(targets, free, 5 - 3))
        assert not res["needle_forced"] and not res["needle_in_window"]  # depth 0.5: far behind the last token


@pytest.mark.parametrize("window", [16, 48, 64, 200])
def test_needle_visibility_counts_the_answer_s_tokens(byt5, monkeypatch, window):
    """needle_in_window: an answer token (its digits, found here in the decoded prompt) lies among the last prompt
    token's `window` keys, not merely a block of the answer; needle_visible_anyway: in the window or in a forced
    block; answer_tokens_found: the answer's tokens were found inside the item."""
    from modeling_nsa.nsa_layout import NSAParams
    from nsa_train import selection_stats

    params = NSAParams(cmp_block_size=16, cmp_stride=8, sel_block_size=64, sel_num_blocks=4, sel_init_blocks=1,
                       sel_local_blocks=2, window_size=window)  # fmt: skip
    cases, _ = lc.build_cases(byt5, "passkey", [300], [0.5, 1.0], samples=2, seed=5)
    width = max(len(c.prompt_ids) for c in cases)
    fake = [selection_stats.LayerSelection(0, torch.zeros(len(cases), width, 4, 3),
                                           torch.full((len(cases), 1, width, 4), -1), torch.zeros(len(cases), width),
                                           params)]  # fmt: skip
    monkeypatch.setattr(selection_stats, "capture_selections", lambda *a, **k: fake)
    got = lc.needle_selection(object(), cases, "cpu", pad_id=0)
    for case, res in zip(cases, got):
        text = bytes(i - 3 for i in case.prompt_ids).decode(errors="replace")  # ByT5: id = byte + 3
        digits = [case.needle_start + i for i in range(case.needle_len) if text[case.needle_start + i].isdigit()]
        query = len(case.prompt_ids) - 1
        assert res["needle_in_window"] == (max(digits) > query - window), (window, case.depth)
        own = query // 64
        forced = any(b == 0 or own - 2 < b <= own for b in {p // 64 for p in digits})
        assert res["needle_forced"] == forced
        assert res["needle_visible_anyway"] == (res["needle_in_window"] or forced)
        assert res["answer_tokens_found"]
    if window == 64:  # the second mention of the key ends ~56 tokens before the last one at depth 1
        assert any(r["needle_in_window"] for r in got) and not all(r["needle_in_window"] for r in got)


def test_needle_selection_in_the_evaluation_of_an_nsa_run(byt5, tmp_path):
    """The CLI on a tiny NSA model with free picks (6 selected blocks, 3 forced) records, per case, the selection of
    every layer and KV group and the rates per cell; the flags equal those of the same prompt alone (no padding)
    read from capture_selections directly."""
    from modeling_nsa import NSAForCausalLM
    from nsa_train.selection_stats import capture_selections

    save_tiny_nsa(tmp_path / "model", byt5, sel_num_blocks=6, seed=1)
    out = tmp_path / "out"
    result = lc.main([str(tmp_path / "model"), "--task", "passkey", "--lengths", "240", "320", "--depths", "0", "1",
                      "--samples", "2", "--batch-size", "3", "--out", str(out)])  # fmt: skip
    assert result["needle_selected"] is not None and len(result["needle_selected"]) == 2
    model = NSAForCausalLM.from_pretrained(tmp_path / "model")
    for cell in result["cells"]:
        assert 0.0 <= cell["needle_selected_rate"] <= 1.0 and 0.0 < cell["needle_chance_rate"] <= 1.0
        assert len(cell["needle_selected_rate_by_layer"]) == 1
        for case in cell["cases"]:
            assert len(case["needle_selected"]) == 1 and len(case["needle_selected"][0]) == 1  # 1 layer x 1 group
    cases, _ = lc.build_cases(byt5, "passkey", [240, 320], [0.0, 1.0], samples=2)
    flat = [c for cell in result["cells"] for c in cell["cases"]]
    by_start = {(c["needle_start"], c["answer"]): c for c in flat}
    assert {hit for c in flat for hit in c["needle_selected"][0]} == {True, False}  # both outcomes are compared
    for case in cases:
        layers = capture_selections(model, {"input_ids": torch.tensor([case.prompt_ids])}, max_len=len(case.prompt_ids))
        chosen = layers[0].block_indices[0, 0, -1]
        alone = bool(torch.isin(chosen, torch.tensor(lc._answer_span_blocks(case, 16))).any())
        assert by_start[(case.needle_start, case.answer)]["needle_selected"] == [[alone]]
    assert "answer's block in the last prompt token's selection" in lc.format_table(result)


def test_needle_selection_needs_an_nsa_model(llama_dir, byt5):
    from transformers import AutoModelForCausalLM

    llama = AutoModelForCausalLM.from_pretrained(llama_dir)
    quiet = dict(log=lambda s: None, samples=1)
    result = lc.run_long_context_eval(llama, byt5, "passkey", [300], [0.5], **quiet)
    assert result["needle_selected"] is None and "needle_selected" not in result["cells"][0]["cases"][0]
    with pytest.raises(ValueError, match=r"--needle-selection: LlamaForCausalLM .* needs an NSA model in "
                                         r"attention_mode 'nsa'"):  # fmt: skip
        lc.run_long_context_eval(llama, byt5, "passkey", [300], [0.5], selection=True, **quiet)


def test_needle_visibility_at_the_window_s_edge(byt5, monkeypatch):
    """The window of query t holds keys t - w + 1 .. t (NSA_SPEC): an answer whose last token is w keys back is
    outside it, one key nearer inside."""
    from modeling_nsa.nsa_layout import NSAParams
    from nsa_train import selection_stats

    cases, _ = lc.build_cases(byt5, "passkey", [300], [1.0], samples=1, seed=5)
    case = cases[0]
    text = bytes(i - 3 for i in case.prompt_ids).decode(errors="replace")  # ByT5: id = byte + 3
    last_digit = max(case.needle_start + i for i in range(case.needle_len) if text[case.needle_start + i].isdigit())
    query = len(case.prompt_ids) - 1
    for window, inside in ((query - last_digit, False), (query - last_digit + 1, True)):
        params = NSAParams(cmp_block_size=16, cmp_stride=8, sel_block_size=64, sel_num_blocks=4, sel_init_blocks=1,
                           sel_local_blocks=2, window_size=window)  # fmt: skip
        width = len(case.prompt_ids)
        fake = [selection_stats.LayerSelection(0, torch.zeros(1, width, 4, 3), torch.full((1, 1, width, 4), -1),
                                               torch.zeros(1, width), params)]  # fmt: skip
        monkeypatch.setattr(selection_stats, "capture_selections", lambda *a, fake=fake, **k: fake)
        assert lc.needle_selection(object(), cases, "cpu", pad_id=0)[0]["needle_in_window"] is inside, window


def test_the_heatmap_says_where_extrapolation_starts():
    assert lc.heatmap_length_note(None, 256) == ""  # every length trained
    assert lc.heatmap_length_note(2, 256) == "; dashed: training length"  # a line between columns 1 and 2
    # every length beyond: a line at the plot's edge would not show, so the label says it
    assert lc.heatmap_length_note(0, 8192) == "; all beyond the training length 8,192"


def test_a_learned_position_model_is_scored_at_its_own_positions_and_within_its_table(byt5):
    """GPT-2's learned position table: loglik scoring gives each left-padded row its own positions (a batch of two
    lengths scores as each case alone, as generate() does), and generate scoring of a case as long as the table
    stops the answer's extra tokens at its end instead of indexing past it."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=384, n_positions=320, n_embd=16, n_layer=1, n_head=2)).eval()
    cases, _ = lc.build_cases(byt5, "passkey", [300, 320], [0.5], 2)
    together = lc.score_loglik(gpt2, cases, "cpu", 0)
    alone = [lc.score_loglik(gpt2, [case], "cpu", 0)[0] for case in cases]
    assert [r["answer_logprob"] for r in together] == pytest.approx([r["answer_logprob"] for r in alone], abs=1e-5)
    longest = [c for c in cases if c.length == 320]
    results = lc.score_generate(gpt2, byt5, longest, "cpu", 0)  # (before: IndexError past position 319)
    assert len(results) == 2 and all(isinstance(r["correct"], bool) for r in results)


def test_a_generated_answer_ends_at_its_first_stop_token(byt5):
    """A model whose generation config names no end-of-text may write one inside its answer and go on: the answer
    is what came before it (decoding would drop it and join both sides into the right number)."""
    from types import SimpleNamespace

    (case,), _ = lc.build_cases(byt5, "passkey", [300], [0.5], 1)
    first, rest = case.answer_ids[:2], case.answer_ids[2:]

    class Scripted:  # generate() writes two digits, </s>, then the rest of the answer
        config, generation_config = SimpleNamespace(), SimpleNamespace(eos_token_id=None)

        def generate(self, input_ids, **kwargs):
            tail = torch.tensor([first + [byt5.eos_token_id] + rest])
            return torch.cat([input_ids, tail], 1)

    (result,) = lc.score_generate(Scripted(), byt5, [case], "cpu", 0)
    assert not result["correct"] and result["prediction"] == byt5.decode(first).strip() and result["stopped"]
    assert result["ended_inside_answer"]
