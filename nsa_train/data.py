"""Data pipeline: document sources -> tokenize -> pack into rows -> micro-batches, resumable.

A *source* yields document texts in a fixed base order (files sorted by name, rows in order; the Hub
stream in its order). Document i of that order is held out for validation when ``i % val_every == 0``;
the other documents are dealt round-robin to ranks, shuffled per epoch with a seeded buffer, tokenized,
followed by EOS, and packed into rows of ``seq_len`` tokens.

With document masking (the default) each row carries ``position_ids`` that restart at 0 at every document
start (transformers' packed-sequence convention; NSA then never attends across documents) and the label of a
document's first token is -100 (it cannot be predicted from another document). With ``cross_doc=True`` rows
are GPT-2 style: positions 0..T-1 and every label kept.

The position in the stream is three integers, ``DataState(epoch, doc, offset)``: the next token to read is
token ``offset`` of document ``doc`` of this rank's shuffled order in ``epoch``. Every batch carries the state
after it, so a checkpoint records exactly what the loop consumed (prefetching included) and resume continues
with the same rows. Local files are read with pyarrow/json only; `datasets` is imported only to stream (from the
Hub, or local parquet shards given as ``parquet:PATH`` through the same streaming call).
"""

from __future__ import annotations

import ast
import difflib
import glob
import hashlib
import itertools
import json
import os
import queue
import random
import socket
import sysconfig
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator
from urllib.parse import urlparse

import torch

LOCAL_SUFFIXES = (".parquet", ".jsonl", ".json", ".txt")
FINEWEB_EDU = "HuggingFaceFW/fineweb-edu"
FINEWEB_EDU_CONFIG = "sample-10BT"  # --dataset-config for fineweb-edu when none is given
PARQUET_STREAM = "parquet:"  # --dataset parquet:PATH streams local parquet shards the way the Hub is streamed


# ----------------------------------------------------------------------------- sources


class LocalFiles:
    """Parquet / JSON-lines / txt files: a file, a directory (recursive) or a glob. A .txt file is one document."""

    def __init__(self, spec: str, text_column: str = "text", flag: str = "--dataset"):
        self.spec, self.text_column, self.flag = spec, text_column, flag  # flag: the option its errors name
        path = Path(spec).expanduser()
        if any(ch in spec for ch in "*?["):
            files = [Path(p) for p in sorted(glob.glob(spec, recursive=True))]
        elif path.is_dir():
            if (path / "dataset_dict.json").is_file() or ((path / "state.json").is_file() and any(path.glob("*.arrow"))):
                raise ValueError(
                    f"{self.flag} {spec!r} is a `datasets` save_to_disk folder (Arrow files), which is not supported. "
                    f"Write it as parquet, e.g. `datasets.load_from_disk({spec!r}).to_parquet('data.parquet')` (for "
                    f"a DatasetDict, pick a split: `load_from_disk(...)['train']`), and pass {self.flag} data.parquet."
                )
            files = sorted(p for p in path.rglob("*") if p.is_file())
        elif path.exists():
            files = [path]
        else:
            raise FileNotFoundError(f"{self.flag} {spec!r}: no such file, directory or glob match.")
        self.files = [f for f in files if f.suffix in LOCAL_SUFFIXES]
        if not self.files:
            raise FileNotFoundError(
                f"{self.flag} {spec!r}: no data files found (looked for {', '.join(LOCAL_SUFFIXES)})."
            )
        for f in self.files:
            if f.stat().st_size == 0:
                raise ValueError(f"{self.flag}: data file {str(f)!r} is empty (0 bytes).")
        self.check_columns()

    def check_columns(self):
        """Fail before training when a file lacks the text column (parquet schema / first JSON line)."""
        try:
            import pyarrow as pa
            import pyarrow.parquet as pq
        except ImportError as e:
            if any(f.suffix == ".parquet" for f in self.files):
                raise ImportError("reading parquet files needs pyarrow: pip install pyarrow") from e

        for f in self.files:
            if f.suffix == ".parquet":
                try:
                    names = pq.read_schema(f).names
                except Exception as e:  # noqa: BLE001 - pyarrow raises several types for corrupt files
                    raise ValueError(f"{self.flag}: cannot read parquet file {str(f)!r}: {e}") from e
            elif f.suffix in (".jsonl", ".json"):
                first = next(_json_records(f, self.flag), None)
                if first is None:
                    raise ValueError(f"{self.flag}: data file {str(f)!r} has no records.")
                names = list(first.keys())
            else:
                continue
            if self.text_column not in names:
                raise ValueError(
                    f"--text-column {self.text_column!r} not found in {str(f)!r}; its columns are {names}. "
                    "Pass --text-column NAME."
                )
            if f.suffix == ".parquet":  # (a JSON file's values are checked as they are read: it has no schema)
                kind = pq.read_schema(f).field(self.text_column).type
                if pa.types.is_dictionary(kind):  # (dictionary-encoded strings, e.g. pandas' categoricals, read as text)
                    kind = kind.value_type
                string_view = getattr(pa.types, "is_string_view", lambda _: False)(kind)  # (pyarrow >= 16)
                if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or string_view):
                    raise ValueError(f"--text-column {self.text_column!r} of {str(f)!r} holds {kind}, not text; its "
                                     f"columns are {names}. Pass --text-column NAME of a string column.")

    def __iter__(self) -> Iterator[str]:
        for f in self.files:
            if f.suffix == ".parquet":
                import pyarrow.parquet as pq

                for batch in pq.ParquetFile(f).iter_batches(batch_size=1024, columns=[self.text_column]):
                    yield from (t for t in batch.column(0).to_pylist() if t)
            elif f.suffix in (".jsonl", ".json"):
                for number, record in enumerate(_json_records(f, self.flag), 1):
                    text = record.get(self.text_column)
                    if text:
                        yield document_text(text, self.text_column, f"record {number} of {str(f)!r}")
            else:
                text = f.read_text(encoding="utf-8", errors="replace")
                if text.strip():
                    yield text

    def describe(self) -> str:
        return f"local files {self.spec} ({len(self.files)} file(s), column {self.text_column!r})"


def document_text(value, text_column: str, where: str) -> str:
    """A document's text as a source read it: a string, else an error naming the record and the fix (the tokenizer
    would fail on it later with a TypeError that names neither)."""
    if not isinstance(value, str):
        raise ValueError(f"--text-column {text_column!r}: {where} holds a {type(value).__name__} ({str(value)[:60]!r}), "
                         "not text. Pass --text-column NAME of the column holding each document's text.")
    return value


def _json_records(path: Path, flag: str = "--dataset") -> Iterator[dict]:
    """The objects of a JSON Lines file (one per line, streamed) or of a .json file holding one array of them
    (read whole). Anything else is an error naming the file and the two forms."""
    forms = "use JSON Lines (one object per line) or a .json file holding one array of objects"
    with open(path, encoding="utf-8") as fh:
        whole_array = path.suffix == ".json" and fh.read(4096).lstrip().startswith("[")
        fh.seek(0)
        try:
            records = json.load(fh) if whole_array else (json.loads(line) for line in fh if line.strip())
            for record in records:
                if not isinstance(record, dict):
                    raise ValueError(f"{flag}: {str(path)!r} holds a {type(record).__name__}, not an object; {forms}.")
                yield record
        except json.JSONDecodeError as e:
            raise ValueError(f"{flag}: {str(path)!r} is not valid JSON Lines ({e}); {forms}.") from None


class StreamedDataset:
    """A dataset streamed by `datasets.load_dataset(..., streaming=True)` (`datasets` is imported here only).

    The Hub (`from_hub`: FineWeb-Edu, hf://NAME) and local parquet shards (`from_parquet`: --dataset parquet:PATH,
    e.g. a downloaded copy of FineWeb-Edu) go through the same call, the second with the "parquet" builder and
    `data_files`, so the streaming path the Hub runs on is also what runs offline. Files stream in name order.
    """

    def __init__(self, path: str, config: str | None = None, *, split: str = "train", text_column: str = "text",
                 data_files: list[str] | None = None, flag: str | None = None):  # fmt: skip
        self.path, self.config, self.split, self.text_column, self.data_files = path, config, split, text_column, data_files
        self.flag = flag or f"--dataset {path}"  # how the user named it, for error messages
        try:
            import datasets  # noqa: F401
        except ImportError as e:
            raise ImportError(f"{self.flag} is streamed with `datasets`: pip install datasets") from e

    @classmethod
    def from_hub(cls, name: str, config: str | None, text_column: str = "text") -> StreamedDataset:
        source = cls(name, config, text_column=text_column)
        check_hub_reachable(source.flag, hint=LOCAL_HINT)
        return source

    @classmethod
    def from_parquet(cls, spec: str, text_column: str = "text") -> StreamedDataset:
        """`spec` as for local files (a file, a directory or a glob); its parquet files, checked before training."""
        if not spec.strip():  # an empty path would read the working directory's files, whatever they are
            raise ValueError(f"--dataset '{PARQUET_STREAM}': no path after '{PARQUET_STREAM}'; give the shards' "
                             f"directory, file or glob, e.g. --dataset {PARQUET_STREAM}data/fineweb-edu/sample/10BT.")
        files = [f for f in LocalFiles(spec, text_column).files if f.suffix == ".parquet"]
        if not files:
            raise FileNotFoundError(f"--dataset {PARQUET_STREAM}{spec}: no .parquet files there.")
        return cls("parquet", text_column=text_column, data_files=[str(f) for f in files],
                   flag=f"--dataset {PARQUET_STREAM}{spec}")  # fmt: skip

    def __iter__(self) -> Iterator[str]:
        import datasets

        try:
            ds = datasets.load_dataset(self.path, name=self.config, split=self.split, data_files=self.data_files,
                                       streaming=True)  # fmt: skip
            for number, example in enumerate(ds, 1):
                if example.get(self.text_column):
                    yield document_text(example[self.text_column], self.text_column, f"example {number} of {self.flag}")
        except ValueError as e:  # e.g. "BuilderConfig 'x' not found. Available: [...]", "Config name is missing"
            if "config" not in str(e).lower() or self.data_files is not None:
                raise
            given = repr(self.config) if self.config else "not given (the dataset's default)"
            raise ValueError(f"{self.flag}: --dataset-config {given} does not fit this dataset: {e} "
                             "Pass --dataset-config NAME with one of its configs.") from None
        except Exception as e:
            clear = hub_access_error(self.flag, e) if self.data_files is None else None
            if clear is None:
                raise
            raise clear from e

    def describe(self) -> str:
        if self.data_files is not None:  # file names only: this text also goes into the model card
            return f"local parquet shards {file_names(self.data_files)} (column {self.text_column!r}, streamed)"
        return f"{self.path} ({self.config or 'default'}, split {self.split}, streamed)"


def file_names(paths) -> str:
    """Local files by their names, without their directories (a model card holds no local paths): the first five,
    then how many there are."""
    names = [Path(p).name for p in paths]
    return ", ".join(names[:5]) + (f", ... ({len(names)} files)" if len(names) > 5 else "")


FINGERPRINT_MAX_BYTES = 2 * 1024**3  # sha256 runs at about 1 GB/s: at most a few seconds at start-up


def file_fingerprints(paths, max_bytes: int = FINGERPRINT_MAX_BYTES) -> dict:
    """Which bytes a run read (run.json's data_files): each local file's size and sha256, so that two runs of one
    --dataset path that read different files (a corpus rebuilt from a newer package: bench/build_corpus.py) can be
    told apart. Above max_bytes in all, sizes only ("sha256": null), since hashing would hold up the start."""
    sizes = {Path(p): Path(p).stat().st_size for p in paths}
    hashed = sum(sizes.values()) <= max_bytes
    files = []
    for path, size in sizes.items():
        digest = None
        if hashed:
            h = hashlib.sha256()
            with open(path, "rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 20), b""):
                    h.update(chunk)
            digest = h.hexdigest()
        files.append({"path": str(path), "bytes": size, "sha256": digest})
    return {"files": files, "hashed": hashed, "max_bytes_hashed": max_bytes}


LOCAL_HINT = ("Pass --dataset parquet:DIR with local parquet shards (e.g. a downloaded copy of FineWeb-Edu) or "
              "--dataset PATH with parquet/jsonl/txt files.")


def hub_access_error(what: str, error: BaseException) -> Exception | None:
    """The clear error for a failure to reach the Hub or to be let in (network down, offline mode, gated or
    private dataset, bad token), or None when `error` is none of these. Network errors become ConnectionError,
    refusals ValueError: the trainer prints either as one line before step 1."""
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        from datasets.exceptions import DatasetNotFoundError
    except ImportError:  # an older `datasets`
        DatasetNotFoundError = RepositoryNotFoundError  # noqa: N806
    reason = f"{type(error).__name__}: {' '.join(str(error).split())[:300]}"
    status = getattr(getattr(error, "response", None), "status_code", None)
    if isinstance(error, GatedRepoError) or status in (401, 403):
        return ValueError(
            f"{what}: the Hub refused access ({reason}). A gated or private dataset needs its terms accepted on its "
            f"Hub page and a token: `hf auth login` or HF_TOKEN=... {LOCAL_HINT}"
        )
    if isinstance(error, (RepositoryNotFoundError, DatasetNotFoundError)):
        return ValueError(f"{what}: no such dataset on the Hub, or not one your token may read ({reason}). Check the "
                          f"name and `hf auth whoami`. {LOCAL_HINT}")  # fmt: skip
    http_client = ("httpx", "httpx2", "requests", "urllib3", "aiohttp")  # transport errors of the HTTP clients
    if isinstance(error, (ConnectionError, TimeoutError, LocalEntryNotFoundError, HfHubHTTPError)) or any(
        c.__module__.split(".")[0] in http_client for c in type(error).__mro__
    ):
        return ConnectionError(f"{what}: cannot stream it from the Hub ({reason}). Check the network and that "
                               f"HF_HUB_OFFLINE / HF_DATASETS_OFFLINE are unset. {LOCAL_HINT}")  # fmt: skip
    return None


class PythonDocs:
    """Text that ships with Python: the language reference topics (pydoc_data) and stdlib docstrings (the standard
    library's modules and packages, not what is installed into its site-packages)."""

    def __iter__(self) -> Iterator[str]:
        from pydoc_data.topics import topics

        for key in sorted(topics):
            yield topics[key]
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        # the standard library's own packages only: site-packages (and Debian's dist-packages) hold what is installed
        # there, which differs from machine to machine and would shift every later document's index
        packages = [f for f in sorted(stdlib.glob("*/*.py")) if f.parent.name not in ("site-packages", "dist-packages")]
        for f in sorted(stdlib.glob("*.py")) + packages:
            try:
                tree = ast.parse(f.read_text(encoding="utf-8"))
            except (SyntaxError, UnicodeDecodeError, OSError):
                continue
            for node in ast.walk(tree):
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    doc = ast.get_docstring(node)
                    if doc and len(doc) >= 200:
                        yield doc

    def describe(self) -> str:
        return "Python's own documentation (pydoc_data topics + standard library docstrings)"


def check_hub_reachable(what: str, hint: str, timeout: float = 3.0):
    """Fail in seconds (not after minutes of retries) when the Hub endpoint cannot be reached."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        raise ConnectionError(f"{what}: HF_HUB_OFFLINE is set, so the Hub cannot be used (unset it where the Hub "
                              f"can be reached). {hint}")
    url = urlparse(constants.ENDPOINT)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname, port), timeout=timeout).close()
    except OSError as e:
        raise ConnectionError(f"{what}: cannot reach {constants.ENDPOINT} ({e}). {hint}") from e


def streams_from_hub(dataset: str) -> bool:
    """Whether --dataset names a Hub dataset, streamed from the Hub: fineweb-edu or hf://NAME."""
    return dataset == "fineweb-edu" or dataset.startswith("hf://")


def names_local_files(dataset) -> bool:
    """Whether --dataset names files on this machine (PATH, a glob, or parquet:PATH), not python-docs (shipped with
    Python) or a Hub dataset."""
    return isinstance(dataset, str) and dataset != "python-docs" and not streams_from_hub(dataset)


def hub_config(dataset: str, dataset_config: str | None) -> str | None:
    """The Hub config a run reads: --dataset-config if given, else sample-10BT for fineweb-edu and the dataset's
    own default for hf://NAME (None); None for local data and python-docs, which have no config."""
    if dataset == "fineweb-edu":
        return dataset_config or FINEWEB_EDU_CONFIG
    return dataset_config if dataset.startswith("hf://") else None


def make_source(dataset: str, text_column: str = "text", dataset_config: str | None = None, flag: str = "--dataset"):
    """--dataset: python-docs | fineweb-edu | hf://NAME | parquet:PATH (streamed with `datasets`) | PATH (pyarrow).
    flag: the option a local path's errors name (another tool's, e.g. long_context's --haystack)."""
    if dataset == "python-docs":
        return PythonDocs()
    if dataset == "fineweb-edu":
        return StreamedDataset.from_hub(FINEWEB_EDU, hub_config(dataset, dataset_config), text_column)
    if dataset.startswith("hf://"):
        return StreamedDataset.from_hub(dataset[len("hf://") :], hub_config(dataset, dataset_config), text_column)
    if dataset.startswith(PARQUET_STREAM):
        return StreamedDataset.from_parquet(dataset[len(PARQUET_STREAM) :], text_column)
    return LocalFiles(dataset, text_column, flag)


# ----------------------------------------------------------------------------- tokenizer


def looks_like_a_path(name: str) -> bool:
    """A --tokenizer or MODEL value that means a local directory, not a Hub id (name or owner/name): relative or
    absolute path syntax, more folders than owner/name, or an owner/name whose owner is a folder here (runs/tok).
    A directory that exists is the caller's first test; this names the ones that do not as mistyped paths."""
    return (name.startswith((".", "/", "~")) or name.endswith("/") or name.count("/") > 1 or "\\" in name
            or ("/" in name and Path(name).parent.is_dir()))


def _subdirs(folder: Path) -> list[Path]:
    try:
        return [d for d in folder.iterdir() if d.is_dir()]
    except OSError:
        return []


def load_tokenizer(name: str, require_eos: bool = True, trust_remote_code: bool = False, other_fix: str = ""):
    """`byt5` (byte-level, no files) or any AutoTokenizer name/path; clear error when it cannot be had.

    require_eos: packing puts the EOS token between documents (the trainer, the corpus builder); an evaluation
    that packs nothing passes False. other_fix: a further remedy the caller's command offers, appended to the
    not-found errors (e.g. the long-context tool's "leave --tokenizer out")."""
    from transformers import AutoTokenizer, ByT5Tokenizer

    # registers model_type "nsa": AutoTokenizer reads a model folder's config.json (a run's final/ holds the run's
    # tokenizer), and warns that an unknown type instantiates "a model of type ``"
    import modeling_nsa  # noqa: F401

    if name in ("byt5", "bytes"):
        tok = ByT5Tokenizer()
    else:
        name = os.path.expanduser(name)  # ~/tok quoted, or --tokenizer=~/tok, reaches here unexpanded
        hint = (
            f"--tokenizer {name!r} is not a local directory and is not in the Hugging Face cache. Pass "
            "--tokenizer PATH to a tokenizer directory (e.g. ../shared/data/gpt2-tokenizer), or --tokenizer byt5 "
            f"(byte-level, needs no files).{other_fix}"
        )
        try:
            tok = AutoTokenizer.from_pretrained(name, local_files_only=True, trust_remote_code=trust_remote_code)
        except (OSError, ValueError) as e:
            if Path(name).exists():  # transformers' reason (an unknown class, remote code, a missing package) kept
                raise ValueError(f"--tokenizer {name!r}: the directory holds no loadable tokenizer "
                                 f"({' '.join(str(e).split())[:300]}).{other_fix}") from None
            if looks_like_a_path(name):  # not a Hub id (owner/name): asking the Hub would only blur the typo
                near = difflib.get_close_matches(Path(name).name, [d.name for d in _subdirs(Path(name).parent)], 3)
                close = f" (did you mean {' or '.join(str(Path(name).parent / n) for n in near)}?)" if near else ""
                raise ValueError(f"--tokenizer {name!r}: no such directory{close}. Pass --tokenizer PATH to a "
                                 f"tokenizer directory, a Hub id, or byt5 (byte-level, needs no files).{other_fix}") from None
            check_hub_reachable(f"--tokenizer {name!r}", hint)
            try:
                tok = AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code)
            except (OSError, ValueError) as e:
                raise ValueError(f"--tokenizer {name!r} could not be loaded: {e}\n{hint}") from None
    tok.init_kwargs.pop("local_files_only", None)  # not a property of the tokenizer: keep it out of exports
    if require_eos and tok.eos_token_id is None:
        raise ValueError(f"--tokenizer {name!r} has no EOS token; packing needs one between documents.")
    return tok


# ----------------------------------------------------------------------------- packing


@dataclass
class DataState:
    epoch: int = 0
    doc: int = 0  # documents of this rank's shuffled order fully consumed in this epoch
    offset: int = 0  # tokens already consumed of document `doc`

    def to_dict(self):
        return asdict(self)


def shuffled(items: Iterator, buffer_size: int, rng: random.Random) -> Iterator:
    """Buffer shuffle (what streaming datasets do): deterministic for a given rng."""
    if buffer_size <= 1:
        yield from items
        return
    buf = []
    for item in items:
        if len(buf) < buffer_size:
            buf.append(item)
            continue
        i = rng.randrange(buffer_size)
        yield buf[i]
        buf[i] = item
    rng.shuffle(buf)
    yield from buf


class Packer:
    """Packs this rank's training documents into rows; iterate to get (input_ids, position_ids, labels, state)."""

    def __init__(self, source, tokenizer, seq_len: int, *, rank: int = 0, world_size: int = 1, seed: int = 0,
                 shuffle_buffer: int = 10_000, val_every: int = 100, cross_doc: bool = False,
                 state: DataState | None = None, tokenize_batch: int = 64, shard: str = "docs"):  # fmt: skip
        if shard not in ("docs", "rows"):
            raise ValueError(f"--data-shard must be 'docs' or 'rows', got {shard!r}.")
        self.source, self.tokenizer, self.seq_len = source, tokenizer, seq_len
        self.rank, self.world_size, self.seed, self.shard = rank, world_size, seed, shard
        # "docs": each rank reads only its documents (scales); "rows": every rank packs the global row stream and
        # keeps rows rank, rank+W, ...: the batches, losses and DataState do not depend on the number of processes.
        self.doc_rank, self.doc_world = (rank, world_size) if shard == "docs" else (0, 1)
        self.shuffle_buffer, self.val_every, self.cross_doc = shuffle_buffer, val_every, cross_doc
        self.state = state or DataState()
        self.tokenize_batch = tokenize_batch

    def rank_documents(self, epoch: int) -> Iterator[str]:
        train_docs = (t for i, t in enumerate(self.source) if self.val_every <= 0 or i % self.val_every != 0)
        mine = itertools.islice(train_docs, self.doc_rank, None, self.doc_world)
        rng = random.Random(f"{self.seed}-{epoch}-{self.doc_rank}")
        return shuffled(mine, self.shuffle_buffer, rng)

    def tokenized(self, texts: Iterator[str]) -> Iterator[list[int]]:
        eos = self.tokenizer.eos_token_id
        while chunk := list(itertools.islice(texts, self.tokenize_batch)):
            # split_special_tokens: a document's literal "<|endoftext|>" (or "</s>") is text, not an EOS that would
            # end it mid-way without a position restart
            for ids in self.tokenizer(chunk, add_special_tokens=False, split_special_tokens=True,
                                      verbose=False)["input_ids"]:  # fmt: skip
                yield ids + [eos]

    def __iter__(self):
        if self.shard == "docs" or self.world_size == 1:
            yield from self._rows()
            return
        mine = None  # rows mode: keep row `rank` of every round of W rows, with the state after the round
        for g, row in enumerate(self._rows()):
            if g % self.world_size == self.rank:
                mine = row
            if g % self.world_size == self.world_size - 1:
                yield (*mine[:3], row[3])

    def _rows(self):
        T, st = self.seq_len, self.state
        epoch, doc, offset = st.epoch, st.doc, st.offset
        ids, pos, lab = [], [], []
        while True:
            docs = self.rank_documents(epoch)
            for _ in itertools.islice(docs, doc):  # resume: skip consumed documents without tokenizing them
                pass
            seen = False
            for k, toks in enumerate(self.tokenized(docs), start=doc):
                seen = True
                p = offset
                while p < len(toks):
                    take = min(T - len(ids), len(toks) - p)
                    ids += toks[p : p + take]
                    lab += toks[p : p + take]
                    if not self.cross_doc:
                        if len(pos) > 0 and p == 0:
                            lab[len(pos)] = -100  # first token of a document: no prediction across documents
                        pos += range(take)
                    p += take
                    if len(ids) == T:
                        nxt = DataState(epoch, k, p) if p < len(toks) else DataState(epoch, k + 1, 0)
                        yield ids, (pos if not self.cross_doc else list(range(T))), lab, nxt
                        ids, pos, lab = [], [], []
                offset = 0
            if not seen and doc == 0:
                raise ValueError(
                    f"rank {self.rank} of {self.world_size} got no training documents from "
                    f"{self.source.describe()}: every --val-every-doc {self.val_every}-th document, the first one "
                    "included, is held out for validation, and a .txt file is one document. Give more documents "
                    "(rows of a parquet/jsonl file, or more files) or --val-every-doc 0 (no validation)."
                )
            epoch, doc, offset = epoch + 1, 0, 0


def validation_rows(source, tokenizer, seq_len: int, val_every: int, val_tokens: int, cross_doc: bool = False,
                    skip_tokens: int = 0):  # fmt: skip
    """The held-out rows: documents i % val_every == 0, packed like training, the last row padded (label -100).
    `skip_tokens` drops that many tokens from the start of the first held-out document, which moves every row's
    start as far through the text (`bench/position_shift.py`: is a position's loss the position's or its text's)."""
    if val_every <= 0 or val_tokens <= 0:
        return []
    eos = tokenizer.eos_token_id
    rows, ids, pos, lab = [], [], [], []
    for i, text in enumerate(source):
        if i % val_every != 0:
            continue
        toks = tokenizer(text, add_special_tokens=False, split_special_tokens=True, verbose=False)["input_ids"] + [eos]
        if i == 0 and skip_tokens:
            if not 0 < skip_tokens <= len(toks) - 2:  # keep two tokens: one to predict from, one to predict
                raise ValueError(f"skip_tokens {skip_tokens} (bench/position_shift.py --shifts): the first held-out "
                                 f"document has {len(toks)} tokens with its EOS; skip from 0 to {len(toks) - 2}.")  # fmt: skip
            toks = toks[skip_tokens:]
        frag = 0  # position inside the document fragment of this row (restarts at a row start, like training)
        for p, t in enumerate(toks):
            lab.append(-100 if (p == 0 and ids and not cross_doc) else t)
            ids.append(t)
            pos.append(len(pos) if cross_doc else frag)
            frag += 1
            if len(ids) == seq_len:
                rows.append((ids, pos, lab))
                ids, pos, lab, frag = [], [], [], 0
                if len(rows) * seq_len >= val_tokens:
                    return rows
    if ids:  # pad the last row: each pad token is its own one-token document with no label
        n = seq_len - len(ids)
        rows.append((ids + [eos] * n, pos + ([0] * n if not cross_doc else list(range(len(pos), seq_len))), lab + [-100] * n))
    return rows


def validation_text_tokens(rows, eos_token_id: int) -> int:
    """Tokens of text in validation_rows' rows: all but the padding at the end of the last row (EOS tokens without
    a label; a document's own EOS has one)."""
    if not rows:
        return 0
    ids, _, labels = rows[-1]
    padding = 0
    while padding < len(ids) and ids[-1 - padding] == eos_token_id and labels[-1 - padding] == -100:
        padding += 1
    return len(rows) * len(ids) - padding


def to_batch(rows, device=None) -> dict[str, torch.Tensor]:
    ids, pos, lab = (torch.tensor([r[j] for r in rows], dtype=torch.long) for j in range(3))
    batch = {"input_ids": ids, "position_ids": pos, "labels": lab}
    return {k: v.to(device) for k, v in batch.items()} if device is not None else batch


def num_label_tokens(labels: torch.Tensor) -> torch.Tensor:
    """Tokens that carry a loss after the model's internal shift."""
    return (labels[:, 1:] != -100).sum()


class BatchLoader:
    """Micro-batches of `micro_batch_size` rows from a Packer, prefetched on a background thread.

    Yields (batch dict of CPU tensors, DataState after the batch). Errors raised while reading or tokenizing
    surface in the training thread.
    """

    _END = object()

    def __init__(self, packer: Packer, micro_batch_size: int, prefetch: int = 8):
        self.packer, self.micro_batch_size = packer, micro_batch_size
        self.queue: queue.Queue = queue.Queue(maxsize=prefetch)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._produce, name="nsa-data", daemon=True)
        self.thread.start()

    def _produce(self):
        try:
            rows = iter(self.packer)
            while not self.stop.is_set():
                chunk = list(itertools.islice(rows, self.micro_batch_size))
                self._put((to_batch([r[:3] for r in chunk]), chunk[-1][3]))
        except BaseException as e:  # noqa: BLE001 - forwarded to the consumer
            self._put(e)

    def _put(self, item):
        while not self.stop.is_set():
            try:
                self.queue.put(item, timeout=0.5)
                return
            except queue.Full:
                continue

    def __iter__(self):
        return self

    def __next__(self):
        item = self.queue.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self):
        self.stop.set()
        self.thread.join(timeout=10)
