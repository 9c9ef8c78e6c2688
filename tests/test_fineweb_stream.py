"""The FineWeb-Edu streaming path, offline: `--dataset parquet:DIR` streams local parquet shards with FineWeb-Edu's
schema through the same `datasets.load_dataset(..., streaming=True)` call, per-rank sharding, shuffle buffer,
packing and resume as `--dataset fineweb-edu`; a Hub that cannot be reached or refuses access is a clear error
before the first step.
"""

import itertools
from collections import Counter

import pytest
from train_helpers import GPT2, PARQUET, needs_shared, run_main, tiny_args, train_losses

from nsa_train import data

pytestmark = needs_shared
N_DOCS, N_SHARDS = 90, 3  # FineWeb-Edu is many shards; 30 documents each keep the test fast


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """Three parquet shards with FineWeb-Edu's columns, cut from the shared wiki summaries (one empty text, which
    every source skips)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    wiki = pq.read_table(PARQUET).slice(0, N_DOCS).to_pydict()
    wiki["text"][7] = ""
    root = tmp_path_factory.mktemp("fineweb-edu") / "sample" / "10BT"
    root.mkdir(parents=True)
    per = N_DOCS // N_SHARDS
    for s in range(N_SHARDS):
        rows = slice(s * per, (s + 1) * per)
        n = per
        pq.write_table(pa.table({
            "text": wiki["text"][rows], "id": wiki["id"][rows], "dump": ["CC-MAIN-2024-10"] * n,
            "url": wiki["url"][rows], "file_path": [f"s3://commoncrawl/{s}.warc.gz"] * n, "language": ["en"] * n,
            "language_score": [0.95] * n, "token_count": [len(t.split()) for t in wiki["text"][rows]],
            "score": [3.1] * n, "int_score": [3] * n,
        }), root / f"{s:03d}_00000.parquet")  # fmt: skip
    texts = [t for t in wiki["text"] if t]
    return root, texts


@pytest.fixture(scope="module")
def gpt2():
    return data.load_tokenizer(str(GPT2))


def test_streams_local_shards_through_load_dataset(shards, monkeypatch):
    """One call for the Hub and local shards: load_dataset(..., streaming=True), the files in name order."""
    import datasets

    root, texts = shards
    calls = []
    real = datasets.load_dataset
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **kw: calls.append((a, kw)) or real(*a, **kw))
    source = data.make_source(f"parquet:{root}")
    assert isinstance(source, data.StreamedDataset)
    assert list(source) == texts
    (args, kwargs), = calls
    assert args == ("parquet",) and kwargs["streaming"] is True
    assert [p.rsplit("/", 1)[1] for p in kwargs["data_files"]] == ["000_00000.parquet", "001_00000.parquet",
                                                                   "002_00000.parquet"]  # fmt: skip
    # the same documents as the pyarrow reader gives for the same files, and a glob picks the same shards
    assert list(data.make_source(str(root))) == texts
    assert list(data.make_source(f"parquet:{root}/*.parquet")) == texts
    assert str(root) not in source.describe() and "000_00000.parquet" in source.describe()  # the card's text


def test_parquet_without_a_path_is_refused(tmp_path, monkeypatch):
    """`--dataset parquet:` with nothing after it names the missing path instead of reading the working directory."""
    (tmp_path / "notes.txt").write_text("not training data")
    monkeypatch.chdir(tmp_path)
    for spec in ("parquet:", "parquet: "):
        with pytest.raises(ValueError, match="no path after 'parquet:'"):
            data.make_source(spec)


def test_two_ranks_see_disjoint_documents(shards):
    root, texts = shards
    source = data.make_source(f"parquet:{root}")
    val_every = 10
    held_out = texts[::val_every]
    per_rank = []
    for rank in range(2):
        packer = data.Packer(source, None, 64, rank=rank, world_size=2, seed=5, shuffle_buffer=8, val_every=val_every)
        per_rank.append(list(packer.rank_documents(epoch=0)))
    r0, r1 = Counter(per_rank[0]), Counter(per_rank[1])
    assert not (r0 & r1), "a document went to both ranks"
    assert r0 + r1 + Counter(held_out) == Counter(texts)  # every training document once; validation apart
    assert abs(len(per_rank[0]) - len(per_rank[1])) <= 1
    assert per_rank[0] != [t for t in texts if t in r0]  # the shuffle buffer reordered the rank's documents


def test_resume_mid_stream_continues_exactly(shards, gpt2):
    """Rows after a resume from any saved state (inside the first epoch, in the second) are the rows of the run
    that never stopped."""
    root, _ = shards
    source = data.make_source(f"parquet:{root}")
    packer_args = dict(rank=1, world_size=2, seed=3, shuffle_buffer=16, val_every=10)
    uninterrupted = list(itertools.islice(data.Packer(source, gpt2, 64, **packer_args), 120))
    epochs = {row[3].epoch for row in uninterrupted}
    assert {0, 1, 2} <= epochs, epochs  # long enough to cross epoch boundaries
    for stop in (5, 41, next(i for i, r in enumerate(uninterrupted) if r[3].epoch == 1) + 3):
        state = uninterrupted[stop][3]
        resumed = data.Packer(source, gpt2, 64, state=data.DataState(**state.to_dict()), **packer_args)
        assert list(itertools.islice(resumed, 30)) == uninterrupted[stop + 1 : stop + 31], stop


def test_trainer_resumes_a_parquet_stream(shards, tmp_path):
    """Through the trainer: a run on --dataset parquet:DIR saved at step 2 and resumed trains step 3 on the same
    rows as the run that never stopped (same loss)."""
    root, _ = shards
    args = dict(dataset=f"parquet:{root}", max_steps=3, micro_batch_size=2, val_tokens=256, val_every_doc=10,
                shuffle_buffer=16)  # fmt: skip
    run_main(tiny_args(tmp_path / "whole", **args))
    run_main(tiny_args(tmp_path / "stopped", save_every=2, **{**args, "max_steps": 2}))
    run_main(tiny_args(tmp_path / "stopped", save_every=2, resume="latest", **args))
    whole, resumed = train_losses(tmp_path / "whole"), train_losses(tmp_path / "stopped")
    assert list(resumed) == [1, 2, 3] and resumed[3] == pytest.approx(whole[3], rel=1e-5), (whole, resumed)
    assert "local parquet shards" in (tmp_path / "whole" / "final" / "README.md").read_text()


def _http_error(cls, status: int, message: str):
    import httpx2

    request = httpx2.Request("GET", "https://huggingface.co/api/datasets/HuggingFaceFW/fineweb-edu")
    return cls(message, response=httpx2.Response(status, request=request))


def _hub_failures():
    """The errors `datasets` and huggingface_hub raise when the Hub is out of reach or refuses: (error, where it is
    raised: the load_dataset call or the first read of the stream, the clear error's type, its message)."""
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError

    gated = "Access to dataset HuggingFaceFW/fineweb-edu is restricted. You must have access to it and be authenticated"
    return [  # fmt: skip
        (ConnectionError("Couldn't reach 'HuggingFaceFW/fineweb-edu' on the Hub (ConnectError)"), "load",
         ConnectionError, "cannot stream it from the Hub"),
        (LocalEntryNotFoundError("Cannot find the requested files in the disk cache"), "load", ConnectionError,
         "cannot stream it from the Hub"),
        (_http_error(GatedRepoError, 401, gated), "load", ValueError, "refused access.*hf auth login"),
        (_http_error(HfHubHTTPError, 403, "403 Forbidden"), "read", ValueError, "refused access"),
        (_http_error(HfHubHTTPError, 503, "503 Service Unavailable"), "read", ConnectionError, "cannot stream"),
    ]


@pytest.mark.parametrize("case", range(5))
def test_hub_failure_before_step_1_is_a_clear_error(case, monkeypatch, tmp_path):
    import datasets

    error, where, clear, message = _hub_failures()[case]

    def fail(*args, **kwargs):
        if where == "load":
            raise error
        return failing_stream()

    def failing_stream():  # a stream fails on its first read
        raise error
        yield

    monkeypatch.setattr(data, "check_hub_reachable", lambda what, hint: None)  # the socket probe would already fail
    monkeypatch.setattr(datasets, "load_dataset", fail)
    with pytest.raises(clear, match=message) as info:
        run_main(tiny_args(tmp_path, dataset="fineweb-edu", max_steps=2))
    text = str(info.value)
    assert text.startswith("--dataset HuggingFaceFW/fineweb-edu:") and type(error).__name__ in text
    assert "--dataset parquet:DIR" in text  # the way out: local shards
    assert info.value.__cause__ is error
    assert not (tmp_path / "metrics.jsonl").exists()  # nothing trained


def test_other_stream_errors_pass_through(monkeypatch):
    import datasets

    monkeypatch.setattr(data, "check_hub_reachable", lambda what, hint: None)
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **kw: (_ for _ in ()).throw(KeyError("bug")))
    with pytest.raises(KeyError, match="bug"):
        list(data.make_source("fineweb-edu"))
