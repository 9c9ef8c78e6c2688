"""Data pipeline: sources, packing with document boundaries, validation split, resumable state, bad input."""

import itertools
import json
import shutil
import time

import pytest
import torch
from train_helpers import GPT2, PARQUET, needs_shared

from nsa_train import data


class ListSource:
    def __init__(self, texts):
        self.texts = texts

    def __iter__(self):
        return iter(self.texts)

    def describe(self):
        return "list"


@pytest.fixture(scope="module")
def byt5():
    return data.load_tokenizer("byt5")


def docs(n, seed=0):
    """Distinct documents of varying length (a few bytes to a few rows)."""
    return [f"doc{i:03d}:" + "abcdefghij"[i % 10] * (3 + (i * 7 + seed) % 41) for i in range(n)]


def test_packing_marks_document_boundaries(byt5):
    texts = docs(30)
    rows = list(itertools.islice(data.Packer(ListSource(texts), byt5, 32, val_every=0, shuffle_buffer=0), 20))
    stream_ids = [t for r in rows for t in r[0]]
    # the token stream is the documents in order, each followed by EOS
    expected = [t for text in texts for t in byt5(text, add_special_tokens=False)["input_ids"] + [byt5.eos_token_id]]
    assert stream_ids == expected[: len(stream_ids)]
    for ids, pos, lab, _ in rows:
        assert len(ids) == len(pos) == len(lab) == 32
        assert pos[0] == 0
        for j in range(1, 32):
            starts_doc = ids[j - 1] == byt5.eos_token_id
            # positions restart exactly where a document starts; its first token gets no label
            assert (pos[j] == 0) == starts_doc
            assert (lab[j] == -100) == starts_doc
            if not starts_doc:
                assert pos[j] == pos[j - 1] + 1 and lab[j] == ids[j]


def test_a_literal_eos_string_in_a_document_is_text(byt5):
    """A document that contains the EOS token's text ("</s>" for ByT5, "<|endoftext|>" for GPT-2) keeps it as
    text: the only EOS ids are the ones that end documents, so positions restart only there (training and
    validation rows alike)."""
    texts = ["a </s> b " * 5, "c </s>", "plain"]
    rows = list(itertools.islice(data.Packer(ListSource(texts * 4), byt5, 16, val_every=0, shuffle_buffer=0), 6))
    stream = [t for r in rows for t in r[0]]
    as_bytes = [t for text in texts * 4 for t in [b + 3 for b in text.encode()] + [byt5.eos_token_id]]  # ByT5: byte + 3
    assert stream == as_bytes[: len(stream)]
    val = data.validation_rows(ListSource(texts), byt5, 16, val_every=1, val_tokens=10**6)
    val_stream = [t for ids, pos, lab in val for t, l in zip(ids, lab) if l != -100 or t != byt5.eos_token_id]
    assert val_stream == [t for text in texts for t in [b + 3 for b in text.encode()] + [byt5.eos_token_id]]
    # --val-tokens caps the rows at whole rows: exactly two rows' worth is two rows, one token more a third
    for val_tokens, expected in ((32, 2), (33, 3), (16, 1)):
        assert len(data.validation_rows(ListSource(texts), byt5, 16, val_every=1, val_tokens=val_tokens)) == expected


def test_cross_doc_rows_are_gpt2_style(byt5):
    rows = list(itertools.islice(data.Packer(ListSource(docs(30)), byt5, 32, val_every=0, shuffle_buffer=0,
                                             cross_doc=True), 5))  # fmt: skip
    for ids, pos, lab, _ in rows:
        assert pos == list(range(32)) and lab == ids


def test_model_sees_documents_through_position_ids(byt5):
    """The rows' position_ids make the model's document layout restart where the packer put a document start."""
    from modeling_nsa.nsa_layout import document_positions

    ids, pos, lab, _ = next(iter(data.Packer(ListSource(docs(30)), byt5, 64, val_every=0, shuffle_buffer=0)))
    doc_pos = document_positions(torch.tensor([pos]), None, 1, 64, torch.device("cpu"))
    assert doc_pos[0].tolist() == pos


def test_resume_state_reproduces_the_rest_of_the_stream(byt5):
    src = ListSource(docs(60))
    kw = dict(val_every=7, shuffle_buffer=16, seed=3)
    full = list(itertools.islice(data.Packer(src, byt5, 48, **kw), 40))  # crosses into epoch 1
    assert full[-1][3].epoch >= 1
    for cut in (0, 5, 17, 33):
        resumed = list(itertools.islice(data.Packer(src, byt5, 48, state=full[cut][3], **kw), 40 - cut - 1))
        assert [r[:3] for r in resumed] == [r[:3] for r in full[cut + 1 :]], f"resume after row {cut}"


def test_validation_documents_never_reach_training(byt5):
    texts = docs(100)
    val = data.validation_rows(ListSource(texts), byt5, 32, val_every=10, val_tokens=10**6)
    train = list(itertools.islice(data.Packer(ListSource(texts), byt5, 32, val_every=10, shuffle_buffer=8), 60))

    def decoded_docs(rows):
        stream = bytes(t - 3 for r in rows for t, lab in zip(r[0], r[2]) if t >= 3).decode("utf-8", "replace")
        return {d for d in stream.split("doc") if d}

    val_docs, train_docs = decoded_docs(val), decoded_docs(train)
    assert {f"{i:03d}" for i in range(0, 100, 10)} == {d[:3] for d in val_docs}
    assert not {d[:3] for d in val_docs} & {d[:3] for d in train_docs}
    assert val[-1][2][-1] == -100  # the padded tail of the last row carries no loss


def test_skipped_tokens_move_every_validation_row_through_the_text(byt5):
    """skip_tokens s drops the first held-out document's first s tokens: the held-out stream is the unskipped one
    less its first s tokens, so the text at offset p of a row moves to position p - s; positions still restart at
    each row and each document, the first token of a later document still has no label."""
    texts = [("first " * 40).strip(), "second doc " * 6, "third " * 12]
    stream = [t for text in texts for t in [b + 3 for b in text.encode()] + [byt5.eos_token_id]]  # ByT5: byte + 3
    for skip in (1, 7, 32, 50):
        moved = data.validation_rows(ListSource(texts), byt5, 32, val_every=1, val_tokens=10**6, skip_tokens=skip)
        assert [t for ids, _, _ in moved for t in ids][: len(stream) - skip] == stream[skip:]
        assert moved[0][0][0] == stream[skip] and moved[0][2][0] == stream[skip]  # a row's first token keeps its label
        for ids, pos, lab in moved:
            assert pos[0] == 0
            for j in range(1, 32):
                starts_doc = ids[j - 1] == byt5.eos_token_id  # (the padding: EOS tokens, each its own document)
                assert (pos[j] == 0) == starts_doc and (lab[j] == -100) == starts_doc
    # the first document has 240 tokens with its EOS: 238 leaves two (one to predict from, one to predict)
    last = data.validation_rows(ListSource(texts), byt5, 32, val_every=1, val_tokens=10**6, skip_tokens=238)
    assert last[0][0][:2] == stream[238:240] and last[0][0][2] == stream[240]
    for too_many in (239, 240):
        with pytest.raises(ValueError, match=rf"skip_tokens {too_many} .*has 240 tokens with its EOS; skip from 0 to 238"):
            data.validation_rows(ListSource(texts), byt5, 32, val_every=1, val_tokens=10**6, skip_tokens=too_many)
    with pytest.raises(ValueError, match="skip_tokens -3"):
        data.validation_rows(ListSource(texts), byt5, 32, val_every=1, val_tokens=10**6, skip_tokens=-3)


def test_row_sharding_is_independent_of_process_count(byt5):
    src = ListSource(docs(80))
    kw = dict(val_every=0, shuffle_buffer=10, seed=5, shard="rows")
    one = list(itertools.islice(data.Packer(src, byt5, 32, **kw), 12))
    r0 = list(itertools.islice(data.Packer(src, byt5, 32, rank=0, world_size=2, **kw), 6))
    r1 = list(itertools.islice(data.Packer(src, byt5, 32, rank=1, world_size=2, **kw), 6))
    assert [r[:3] for r in one[0::2]] == [r[:3] for r in r0]
    assert [r[:3] for r in one[1::2]] == [r[:3] for r in r1]
    assert [r[3] for r in r0] == [r[3] for r in r1] == [r[3] for r in one[1::2]]  # same resumable state on both


def test_doc_sharding_splits_documents_between_ranks(byt5):
    src = ListSource(docs(40))
    kw = dict(val_every=0, shuffle_buffer=0, world_size=2)
    r0 = [r for r in itertools.islice(data.Packer(src, byt5, 16, rank=0, **kw), 30)]
    stream0 = bytes(t - 3 for r in r0 for t in r[0] if t >= 3).decode()
    assert "doc000" in stream0 and "doc002" in stream0 and "doc001" not in stream0


def test_batch_loader_carries_state_and_label_count(byt5):
    loader = data.BatchLoader(data.Packer(ListSource(docs(50)), byt5, 32, val_every=0, shuffle_buffer=0), 3)
    batch, state = next(loader)
    loader.close()
    assert batch["input_ids"].shape == batch["position_ids"].shape == batch["labels"].shape == (3, 32)
    assert isinstance(state, data.DataState) and state.doc > 0
    n = int(data.num_label_tokens(batch["labels"]))
    assert n == int((batch["labels"][:, 1:] != -100).sum()) and 0 < n < 3 * 31


def test_batch_loader_surfaces_reader_errors(byt5):
    class Broken(ListSource):
        def __iter__(self):
            yield "one document"
            raise OSError("disk vanished")

    loader = data.BatchLoader(data.Packer(Broken([]), byt5, 64, val_every=0, shuffle_buffer=0), 2)
    with pytest.raises(OSError, match="disk vanished"):
        next(loader)


def test_local_jsonl_txt_dir_and_glob(tmp_path):
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps({"body": f"text {i}"}) for i in range(3)) + "\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.txt").write_text("a whole file is one document\nwith two lines")
    (tmp_path / "notes.md").write_text("ignored")
    assert list(data.LocalFiles(str(tmp_path / "a.jsonl"), "body")) == ["text 0", "text 1", "text 2"]
    assert len(list(data.LocalFiles(str(tmp_path), "body"))) == 4
    assert list(data.LocalFiles(str(tmp_path / "**" / "*.txt"), "body")) == ["a whole file is one document\nwith two lines"]


def test_json_array_and_json_lines_files(tmp_path):
    records = [{"body": f"text {i}", "n": i} for i in range(3)]
    (tmp_path / "array.json").write_text(json.dumps(records, indent=2))  # one array, pretty-printed
    (tmp_path / "lines.json").write_text("\n".join(map(json.dumps, records)))  # JSON Lines named .json
    for name in ("array.json", "lines.json"):
        assert list(data.make_source(str(tmp_path / name), text_column="body")) == ["text 0", "text 1", "text 2"]
    (tmp_path / "object.json").write_text(json.dumps({"body": ["a", "b"]}, indent=2))  # neither form
    with pytest.raises(ValueError, match=r"object.json' is not valid JSON Lines.*one array of objects"):
        data.make_source(str(tmp_path / "object.json"), text_column="body")
    (tmp_path / "strings.json").write_text(json.dumps(["a", "b"]))
    with pytest.raises(ValueError, match=r"holds a str, not an object"):
        data.make_source(str(tmp_path / "strings.json"), text_column="body")


@needs_shared
def test_shared_parquet_reads_without_datasets(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "datasets", None)  # the GPU machine has no `datasets`
    src = data.make_source(str(PARQUET))
    first = list(itertools.islice(src, 3))
    assert len(first) == 3 and all(isinstance(t, str) and len(t) > 50 for t in first)


def test_hub_dataset_config_defaults(tmp_path, monkeypatch):
    """--dataset-config defaults to sample-10BT for fineweb-edu only: hf://NAME gets the dataset's own default, and a
    config the dataset lacks is an error naming --dataset-config. A local dataset repository stands in for the Hub."""
    import train_accelerate

    monkeypatch.setattr(data, "check_hub_reachable", lambda what, hint: None)
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "README.md").write_text("---\nconfigs:\n- config_name: default\n  data_files: '*.jsonl'\n---\n")
    (repo / "a.jsonl").write_text(json.dumps({"text": "first document"}) + "\n" + json.dumps({"text": "second"}) + "\n")
    cfg = train_accelerate.parse_args(["--dataset", f"hf://{repo}"])
    source = data.make_source(cfg.dataset, cfg.text_column, cfg.dataset_config)
    assert source.config is None and list(source) == ["first document", "second"]
    assert data.make_source("fineweb-edu", dataset_config=cfg.dataset_config).config == "sample-10BT"
    assert data.make_source("fineweb-edu", dataset_config="sample-100BT").config == "sample-100BT"
    with pytest.raises(ValueError, match=r"--dataset-config 'sample-10BT' does not fit.*'default'.*Pass --dataset-config"):
        list(data.make_source(f"hf://{repo}", dataset_config="sample-10BT"))


def test_python_docs_source_ships_with_python(tmp_path, monkeypatch):
    texts = list(itertools.islice(data.PythonDocs(), 200))
    assert len(texts) == 200 and sum(map(len, texts)) > 100_000
    # a module installed into the interpreter's site-packages is not Python's documentation: the documents (and
    # which of them are held out) are the same whatever is installed there
    stdlib = tmp_path / "lib"
    for folder, name in ((stdlib, "mod"), (stdlib / "pkg", "inner"), (stdlib / "site-packages", "installed"),
                         (stdlib / "dist-packages", "debian")):  # fmt: skip
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{name}.py").write_text(f'"""{name}: {"documentation text " * 20}"""\n')
    monkeypatch.setattr(data.sysconfig, "get_paths", lambda: {"stdlib": str(stdlib)})
    from pydoc_data import topics

    monkeypatch.setattr(topics, "topics", {})
    assert [doc.split(":")[0] for doc in data.PythonDocs()] == ["mod", "inner"]


# ---------------------------------------------------------------- bad input: clear errors


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file"):
        data.make_source(str(tmp_path / "nope.parquet"))
    with pytest.raises(FileNotFoundError, match="no data files"):
        data.make_source(str(tmp_path))
    (tmp_path / "empty.parquet").write_bytes(b"")
    with pytest.raises(ValueError, match="empty"):
        data.make_source(str(tmp_path / "empty.parquet"))
    (tmp_path / "blank.jsonl").write_text("\n\n")
    with pytest.raises(ValueError, match="no records"):
        data.make_source(str(tmp_path / "blank.jsonl"))


def test_save_to_disk_folder_is_refused_with_advice(tmp_path):
    import datasets

    datasets.Dataset.from_dict({"text": ["a document", "another"]}).save_to_disk(str(tmp_path / "saved"))
    with pytest.raises(ValueError, match=r"save_to_disk folder.*not supported.*to_parquet\('data.parquet'\).*--dataset data.parquet"):
        data.make_source(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["x"]})}).save_to_disk(str(tmp_path / "dict"))
    with pytest.raises(ValueError, match=r"save_to_disk folder.*\['train'\]"):
        data.make_source(str(tmp_path / "dict"))


@needs_shared
def test_missing_text_column():
    with pytest.raises(ValueError, match=r"--text-column 'body' not found.*\['text', 'id', 'url', 'topic'\]"):
        data.make_source(str(PARQUET), text_column="body")


def test_a_text_column_that_holds_no_text_is_named(tmp_path):
    """--text-column naming a column of numbers (or lists) fails naming the column, where and the fix: a parquet
    file's before training (its schema), a JSON record's when it is read, and a streamed example's too, instead of
    the tokenizer's TypeError deep in the data thread."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["a document"], "n": pa.array([7], pa.int64())}), tmp_path / "numbers.parquet")
    with pytest.raises(ValueError, match=r"--text-column 'n' of '.*numbers.parquet' holds int64, not text.*\['text', "
                                         r"'n'\]. Pass --text-column NAME of a string column"):
        data.make_source(str(tmp_path / "numbers.parquet"), text_column="n")
    with pytest.raises(ValueError, match=r"--text-column 'n' of .* holds int64, not text"):
        data.make_source(f"parquet:{tmp_path / 'numbers.parquet'}", text_column="n")
    assert list(data.make_source(str(tmp_path / "numbers.parquet"))) == ["a document"]
    categories = pa.array(["one", "two", "one"]).dictionary_encode()  # (pandas' categoricals: read as text)
    pq.write_table(pa.table({"text": categories}), tmp_path / "categories.parquet")
    assert list(data.make_source(str(tmp_path / "categories.parquet"))) == ["one", "two", "one"]
    (tmp_path / "mixed.jsonl").write_text("\n".join(json.dumps(r) for r in ({"text": "fine"}, {"text": ["a", "b"]})))
    documents = iter(data.make_source(str(tmp_path / "mixed.jsonl")))
    assert next(documents) == "fine"
    with pytest.raises(ValueError, match=r"--text-column 'text': record 2 of '.*mixed.jsonl' holds a list \(\"\['a', "
                                         r"'b'\]\"\), not text. Pass --text-column NAME"):
        next(documents)
    # a streamed dataset (the Hub's path: load_dataset(..., streaming=True)) names the example
    streamed = iter(data.StreamedDataset("json", data_files=[str(tmp_path / "mixed.jsonl")], flag="--dataset hf://x"))
    assert next(streamed) == "fine"
    with pytest.raises(ValueError, match=r"--text-column 'text': example 2 of --dataset hf://x holds a list"):
        next(streamed)


def test_dataset_with_no_documents(byt5, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": pa.array([], pa.string())}), tmp_path / "zero.parquet")
    packer = data.Packer(data.make_source(str(tmp_path / "zero.parquet")), byt5, 32, val_every=0)
    with pytest.raises(ValueError, match="no training documents"):
        next(iter(packer))


def test_unknown_tokenizer_fails_fast_with_advice(monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    t0 = time.time()
    with pytest.raises((ValueError, ConnectionError), match="--tokenizer byt5") as info:
        data.load_tokenizer("no-such-org/no-such-tokenizer")
    assert time.time() - t0 < 30
    assert "HF_HUB_OFFLINE is set" in str(info.value) and "unset it where the Hub can be reached" in str(info.value)


def test_a_mistyped_tokenizer_path_is_named_as_a_path_not_a_hub_failure(tmp_path, monkeypatch):
    """A --tokenizer value in path syntax that does not exist is a typo, not a Hub id: the error says so at once,
    with the near folder names, and never asks the Hub (which would only report the network)."""
    (tmp_path / "gpt2-tokenizer").mkdir()
    monkeypatch.setattr(data, "check_hub_reachable", lambda *a: pytest.fail("a local path was tried on the Hub"))
    with pytest.raises(ValueError, match=r"gpt2-tokeniser': no such directory \(did you mean .*gpt2-tokenizer\?\)"):
        data.load_tokenizer(str(tmp_path / "gpt2-tokeniser"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"'\./elsewhere/tok': no such directory\. Pass --tokenizer PATH"):
        data.load_tokenizer("./elsewhere/tok")
    (tmp_path / "runs").mkdir()  # owner/name where the owner is a folder here: a path too
    with pytest.raises(ValueError, match=r"'runs/tok': no such directory"):
        data.load_tokenizer("runs/tok")
    monkeypatch.setenv("HOME", str(tmp_path))  # ~ left unexpanded by the shell (quoted, or --tokenizer=~/...)
    with pytest.raises(ValueError, match=r"gpt2-tokeniser': no such directory \(did you mean .*/gpt2-tokenizer\?\)"):
        data.load_tokenizer("~/gpt2-tokeniser")
    assert not data.looks_like_a_path("gpt2") and not data.looks_like_a_path("openai-community/gpt2")


def test_a_directory_without_a_loadable_tokenizer_says_why(tmp_path):
    """transformers' reason (here: a config naming an unknown class and no tokenizer files) is kept in the error,
    not only "no tokenizer"."""
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "NoSuchTokenizerFast"}))
    with pytest.raises(ValueError, match=r"the directory holds no loadable tokenizer \(\S.+\)\. Or x$"):
        data.load_tokenizer(str(tmp_path), other_fix=" Or x")


@needs_shared
def test_a_tokenizer_under_the_home_folder_loads_as_tilde(tmp_path, monkeypatch):
    shutil.copytree(GPT2, tmp_path / "tok")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert len(data.load_tokenizer("~/tok")) == 50257


@needs_shared
def test_local_tokenizer_directory():
    tok = data.load_tokenizer(str(GPT2))
    assert len(tok) == 50257 and tok.eos_token_id == 50256
    assert "local_files_only" not in tok.init_kwargs


def test_a_model_folders_tokenizer_loads_without_transformers_unknown_model_warning(tmp_path):
    """A run's final/ as --tokenizer (the trainer's own advice with --init-from): AutoTokenizer reads its config.json,
    and in a process that has not imported modeling_nsa an unregistered model_type "nsa" made transformers warn about
    instantiating "a model of type ``"; load_tokenizer registers it first."""
    import subprocess
    import sys

    from transformers import ByT5Tokenizer

    from modeling_nsa import NSAConfig, NSAForCausalLM
    from nsa_train.checkpoint import export_hf_checkpoint

    config = NSAConfig(vocab_size=384, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=16, cmp_block_size=4, cmp_stride=2, sel_block_size=4,
                       sel_num_blocks=3, window_size=8)  # fmt: skip
    export_hf_checkpoint(NSAForCausalLM(config), ByT5Tokenizer(), tmp_path / "final")
    code = f"from nsa_train.data import load_tokenizer; print(type(load_tokenizer({str(tmp_path / 'final')!r})).__name__)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ByT5Tokenizer", done.stderr
    assert "a model of type" not in done.stderr


def test_one_txt_file_is_one_document_held_out_and_the_error_says_so(byt5, tmp_path):
    """A .txt file is one document, and document 0 is held out for validation: a lone .txt file leaves nothing to
    train on, and the error names --val-every-doc and the ways out; with --val-every-doc 0 it trains."""
    text = tmp_path / "book.txt"
    text.write_text("A line of the book.\n" * 200)
    source = data.make_source(str(text))
    with pytest.raises(ValueError, match=r"rank 0 of 1 got no training documents from local files .*book.txt.*every "
                                         r"--val-every-doc 100-th document, the first one included, is held out.*a "
                                         r"\.txt file is one document.*--val-every-doc 0"):  # fmt: skip
        next(iter(data.Packer(source, byt5, 32, val_every=100, shuffle_buffer=0)))
    ids, _, _, _ = next(iter(data.Packer(source, byt5, 32, val_every=0, shuffle_buffer=0)))
    assert len(ids) == 32


def test_each_epoch_shuffles_the_documents_anew(byt5):
    packer = data.Packer(ListSource(docs(60)), byt5, 48, val_every=7, shuffle_buffer=16, seed=3)
    epoch0, epoch1 = list(packer.rank_documents(0)), list(packer.rank_documents(1))
    assert sorted(epoch0) == sorted(epoch1) and epoch0 != epoch1


def test_a_rows_checkpoint_resumes_on_more_processes_from_the_one_global_position(tmp_path):
    """--data-shard rows: every rank holds the same position in the global row stream, so a checkpoint written by
    one process resumes on two (each rank reads rank 0's state); under docs that is refused."""
    from types import SimpleNamespace

    from nsa_train import checkpoint

    ckpt = tmp_path / "step_00000002"
    ckpt.mkdir()
    (ckpt / checkpoint.STATE_FILE).write_text(json.dumps({"step": 2, "world_size": 1,
                                                         "config": {"data_shard": "rows"}}))  # fmt: skip
    (ckpt / "data_state_rank0.json").write_text(json.dumps({"epoch": 0, "doc_index": 5}))
    second_rank = SimpleNamespace(process_index=1, num_processes=2, distributed_type="MULTI_CPU",
                                  load_state=lambda path: None)
    _, data_state = checkpoint.load_checkpoint(second_rank, ckpt)
    assert data_state == {"epoch": 0, "doc_index": 5}
    (ckpt / checkpoint.STATE_FILE).write_text(json.dumps({"step": 2, "world_size": 1,
                                                         "config": {"data_shard": "docs"}}))  # fmt: skip
    with pytest.raises(ValueError, match="written by 1 process"):
        checkpoint.load_checkpoint(second_rank, ckpt)


def test_file_fingerprints_name_the_bytes_read_and_skip_hashing_large_data(tmp_path):
    """run.json's data_files: each local file's size and sha256, equal for equal bytes and different for a file
    changed in one byte; above the size limit, sizes only (hashing would hold up the start)."""
    import hashlib

    first, second = tmp_path / "a.txt", tmp_path / "b.txt"
    first.write_text("one document\n")
    second.write_text("another document\n")
    record = data.file_fingerprints([first, second])
    assert record["hashed"] and [f["sha256"] for f in record["files"]] == [
        hashlib.sha256(first.read_bytes()).hexdigest(), hashlib.sha256(second.read_bytes()).hexdigest()]
    assert [f["bytes"] for f in record["files"]] == [13, 17]
    second.write_text("another documenT\n")
    assert data.file_fingerprints([first, second])["files"][1]["sha256"] != record["files"][1]["sha256"]
    large = data.file_fingerprints([first, second], max_bytes=20)
    assert not large["hashed"] and [f["sha256"] for f in large["files"]] == [None, None]
    assert [f["bytes"] for f in large["files"]] == [13, 17]


def test_a_runs_dataset_names_the_files_it_read_from_the_directory_it_was_launched_in(tmp_path):
    """checkpoint.dataset_as_launched, which a resume's data check and the held-out tools (bench/held_out.py) read a
    run's recorded --dataset through: local paths as the launch meant them, other sources as given."""
    from nsa_train import checkpoint

    launched_in = tmp_path / "launch"
    (launched_in / "data").mkdir(parents=True)
    (launched_in / "data" / "a.parquet").write_bytes(b"")
    link = tmp_path / "link.parquet"
    link.symlink_to(launched_in / "data" / "a.parquet")
    real = str((launched_in / "data" / "a.parquet").resolve())
    assert checkpoint.dataset_as_launched("data/a.parquet", str(launched_in)) == real
    assert checkpoint.dataset_as_launched(f"parquet:{link}", None) == f"parquet:{real}"  # through a symlink
    # a relative path gone since, and a glob: joined to the launch's directory (not read from this process's)
    assert checkpoint.dataset_as_launched("gone.jsonl", "/runs/x") == "/runs/x/gone.jsonl"
    assert checkpoint.dataset_as_launched("data/*.parquet", str(launched_in)) == f"{launched_in}/data/*.parquet"
    assert checkpoint.dataset_as_launched("/abs/gone.jsonl", "/runs/x") == "/abs/gone.jsonl"
    for named in ("python-docs", "fineweb-edu", "hf://me/corpus", None):
        assert not data.names_local_files(named)
        assert checkpoint.dataset_as_launched(named, str(launched_in)) == named
    assert data.names_local_files("parquet:shards/") and data.names_local_files("x.txt")
