"""Long-context retrieval evaluation of any causal LM: passkey and needle-in-a-haystack, length x depth.

    python -m nsa_train.long_context runs/nsa/final --task passkey --lengths 1024 4096 16384 \\
        --depths 0 0.25 0.5 0.75 1.0 --samples 20 --batch-size 4 --out runs/nsa/long_context

Each case is exactly `length` tokens, its prompt and its answer: a short instruction, a haystack, a hidden item
placed so that a fraction `depth` of the haystack comes before it (0: at the start, 1: just before the
question), a question whose answer is the hidden item, and the answer's tokens, so that its last answer token
sits at position length - 1: at the training length the answer lies inside the positions the model trained (a
prompt of `length` tokens, as until 2026-11-27, put it just past them), and a case one token shorter is laid out
exactly as a row of bench/build_retrieval_data.py before its end-of-text token (bench/QUALITY.md, "Retrieval twins that
retrieve": models trained on such rows can depend on that exact layout):

- passkey: a random 5-digit number hidden in repeated filler sentences (Mohtashami & Jaggi, 2023);
- needle: a sentence giving a secret word, hidden in real text: documents of a local parquet/jsonl/txt file
  (`--haystack`, default the shared `wiki-summaries-en.parquet` beside the checkout when present) or, offline,
  Python's own documentation (`--haystack python-docs`).

The hidden item starts at the sentence boundary of the haystack nearest to the asked depth when one lies within
min(32, max(2, haystack tokens / 50)) tokens of it, else at the asked token itself, and the case records the depth
it really got. With a subword tokenizer (GPT-2's) the item lands between sentences or words nearly always; with a
byte-level one (ByT5's) that radius is a few dozen bytes, shorter than most sentences, so at short lengths the
item often splits a sentence, or a word (a review counted 48 of 60 passkey cases off a sentence end at 512 bytes,
none at 4,096). Kept as it is: the published evaluations and the retrieval rows built by
bench/build_retrieval_data.py (which places its items the same way, so training and evaluation agree) depend on
it. Two scorings:

- `generate`: the model's own greedy answer (batched `generate()`, left padding; an NSA model decodes with its
  NSACache); right when its first word is the answer;
- `loglik`: the answer is fed after the prompt; right when every answer token is the model's argmax, and the
  answer tokens' mean log-probability is reported too.

Lengths above the model's training length (a config's `training_seq_len`, which this project's export writes,
else a run's `--seq-len` from the run.json beside its final/, else `max_position_embeddings`) run and are flagged as extrapolation; lengths above what
a learned position table holds are refused. The result is a table (length x depth accuracy), a JSON file and
a heatmap PNG like the NSA paper's Figure 5 (matplotlib: `pip install "nsa-transformers[plot]"`).

From Python (e.g. at the end of a training run) call `run_long_context_eval(model, tokenizer, ...)`.
"""

from __future__ import annotations

import argparse
import difflib
import inspect
import itertools
import json
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

TASKS = ("passkey", "needle")
SCORINGS = ("generate", "loglik")
DEFAULT_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
SHARED_HAYSTACK = Path(__file__).resolve().parents[2] / "shared" / "data" / "wiki-summaries-en.parquet"

# Filler for the passkey task: plain sentences, reshuffled per repetition so the haystack is not one period.
FILLER_SENTENCES = (
    "The morning train left the station on time.",
    "A light rain fell over the quiet fields.",
    "The baker opened the shop before sunrise.",
    "Children walked to school along the river.",
    "The old clock in the square struck nine.",
    "Boats rocked gently in the small harbour.",
    "A farmer repaired the fence beside the road.",
    "The library was warm and nearly empty.",
    "Clouds drifted slowly over the distant hills.",
    "The market filled with voices by midday.",
)
PASSKEY_HEADER = ("There is a pass key hidden somewhere in the text below. Find it and remember it: you will be "
                  "asked for it at the end.\n\n")  # fmt: skip
PASSKEY_NEEDLE = " The pass key is {answer}. Remember it. {answer} is the pass key."
PASSKEY_QUESTION = "\n\nWhat is the pass key? The pass key is"

NEEDLE_HEADER = ("A sentence about a secret word is hidden somewhere in the text below. Find it: you will be asked "
                 "for the word at the end.\n\n")  # fmt: skip
NEEDLE_SENTENCE = " The secret word of the {place} is {answer}."
NEEDLE_QUESTION = "\n\nWhat is the secret word of the {place}? The secret word of the {place} is"
NEEDLE_PLACES = ("harbour", "castle", "garden", "museum", "bakery", "lighthouse", "library", "orchard", "observatory",
                 "monastery", "market", "bridge")  # fmt: skip
NEEDLE_WORDS = ("apple", "river", "candle", "silver", "thunder", "violet", "marble", "lantern", "copper", "meadow",
                "falcon", "harvest", "anchor", "velvet", "glacier", "pepper", "compass", "ember", "willow", "saddle")  # fmt: skip

SENTENCE_ENDS = (".", "!", "?", "\n")


@dataclass
class RetrievalCase:
    """One case: `prompt_ids` and `answer_ids`, together exactly `length` tokens, with the hidden item at token
    `needle_start`."""

    length: int
    depth: float  # asked
    actual_depth: float  # haystack tokens before the item / haystack tokens
    answer: str
    prompt_ids: list[int]
    answer_ids: list[int]
    needle_start: int
    needle_len: int
    haystack_start: int  # first haystack token (after special tokens and the header)
    haystack_len: int


# ----------------------------------------------------------------------------- checks


def check_task(task: str) -> str:
    if task not in TASKS:
        raise ValueError(f"--task {task!r}: unknown task; choose one of {', '.join(TASKS)}.")
    return task


def check_scoring(scoring: str) -> str:
    if scoring not in SCORINGS:
        raise ValueError(f"--scoring {scoring!r}: unknown scoring; choose one of {', '.join(SCORINGS)}.")
    return scoring


def check_depths(depths) -> list[float]:
    depths = [float(d) for d in depths]
    if not depths:
        raise ValueError("--depths: give at least one depth in [0, 1], e.g. --depths 0 0.25 0.5 0.75 1.0.")
    for d in depths:
        if not (0.0 <= d <= 1.0) or math.isnan(d):
            raise ValueError(f"--depths {d:g}: a depth is the fraction of the haystack before the hidden item, in "
                             "[0, 1] (0: at the start, 1: just before the question); e.g. --depths 0 0.5 1.")
    if len(set(depths)) != len(depths):
        raise ValueError(f"--depths {' '.join(f'{d:g}' for d in depths)}: a depth is repeated; give each once.")
    return depths


def check_lengths(lengths, position_limit: int | None, limit_source: str = "") -> list[int]:
    lengths = [int(n) for n in lengths]
    if not lengths:
        raise ValueError("--lengths: give at least one case length in tokens, e.g. --lengths 1024 4096.")
    if len(set(lengths)) != len(lengths):
        raise ValueError(f"--lengths {' '.join(map(str, lengths))}: a length is repeated; give each once.")
    for n in lengths:
        if n < 1:
            raise ValueError(f"--lengths {n}: a case length (prompt and answer) is a positive number of tokens.")
        if position_limit is not None and n > position_limit:
            raise ValueError(
                f"--lengths {n}: above what the model's positions allow ({position_limit} positions, {limit_source}); "
                f"use lengths <= {position_limit}. A model with rotary positions (NSA, Llama) takes longer prompts "
                "(flagged as extrapolation beyond its training length)."
            )
    return sorted(lengths)


def position_limit(config) -> tuple[int | None, str]:
    """The most positions the model can embed: a learned position table's size, None for rotary positions
    (RoPE extrapolates: longer prompts run, flagged against the training length instead)."""
    if getattr(config, "n_positions", None):  # GPT-2 family: a learned table
        return int(config.n_positions), "config n_positions: a learned position table"
    rotary = getattr(config, "model_type", None) == "nsa" or any(
        getattr(config, name, None) is not None for name in ("rope_theta", "rope_parameters", "rope_scaling", "rotary_dim")
    )
    if rotary:
        return None, "rotary positions"
    if getattr(config, "max_position_embeddings", None):  # OPT, BERT-like: a learned table of that size
        return int(config.max_position_embeddings), "config max_position_embeddings: a learned position table"
    return None, "no position limit known"


def training_length(config, model_path: str | Path | None = None) -> tuple[int | None, str]:
    """The row length the model was trained at: a config's `training_seq_len`, the `--seq-len` a run of this
    project recorded (run.json beside a run's final/), else max_position_embeddings (what HF checkpoints set
    to their training context)."""
    if getattr(config, "training_seq_len", None):
        return int(config.training_seq_len), "config training_seq_len"
    if model_path is not None:
        run_json = Path(model_path) / ".." / "run.json"
        if run_json.is_file():
            try:
                seq_len = json.loads(run_json.read_text()).get("config", {}).get("seq_len")
            except (json.JSONDecodeError, AttributeError):
                seq_len = None
            if seq_len:
                return int(seq_len), f"the run's --seq-len ({run_json.resolve().parent.name}/run.json)"
    for name in ("max_position_embeddings", "n_positions"):
        if getattr(config, name, None):
            return int(getattr(config, name)), f"config {name}"
    return None, "unknown"


def _special_prefix(tokenizer) -> list[int]:
    """The special tokens the tokenizer puts before a text (Llama's BOS; none for GPT-2 and ByT5)."""
    plain = tokenizer("a b", add_special_tokens=False).input_ids
    full = tokenizer("a b").input_ids
    for start in range(len(full) - len(plain) + 1):
        if full[start : start + len(plain)] == plain:
            return list(full[:start])
    return []


def _encode_exact(tokenizer, text: str, what: str, vocab_size: int | None) -> list[int]:
    """Token ids of a text the task needs verbatim: every character must survive the round trip (no unknown
    token) and every id must fit the model's vocabulary."""
    ids = tokenizer(text, add_special_tokens=False).input_ids
    unk = getattr(tokenizer, "unk_token_id", None)
    decoded = tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    if (unk is not None and unk in ids) or decoded.split() != text.split():
        raise ValueError(f"the tokenizer ({type(tokenizer).__name__}) cannot represent the {what} {text.strip()!r} "
                         f"(it reads back as {decoded.strip()!r}); the task needs a tokenizer that covers plain "
                         "English text and digits (e.g. GPT-2 BPE, a SentencePiece model, or byte-level ByT5): "
                         "pass --tokenizer with one.")  # fmt: skip
    if vocab_size is not None and ids and max(ids) >= vocab_size:
        raise ValueError(f"the tokenizer gives token id {max(ids)} for the {what} {text.strip()!r}, outside the model's "
                         f"vocabulary of {vocab_size}; pass --tokenizer the model was trained with.")
    return ids


# ----------------------------------------------------------------------------- haystacks


class Haystack:
    """A pool of haystack tokens with the sentence boundaries in it; a case takes a slice of it."""

    def __init__(self, tokenizer, token_ids: list[int], description: str, cycle_sentences: list[list[int]] | None = None):
        self.tokenizer, self.ids, self.description = tokenizer, token_ids, description
        self.cycle_sentences = cycle_sentences  # passkey filler: sentences reshuffled per repetition
        self._ends_sentence: dict[int, bool] = {}

    def ends_sentence(self, token_id: int) -> bool:
        if token_id not in self._ends_sentence:
            text = self.tokenizer.decode([token_id], clean_up_tokenization_spaces=False).rstrip(" ")
            self._ends_sentence[token_id] = text.endswith(SENTENCE_ENDS)
        return self._ends_sentence[token_id]

    def take(self, num_tokens: int, rng: random.Random) -> list[int]:
        """`num_tokens` haystack tokens starting at a sentence boundary (random for real text)."""
        if self.cycle_sentences is not None:
            out: list[int] = []
            while len(out) < num_tokens:
                order = list(range(len(self.cycle_sentences)))
                rng.shuffle(order)
                for i in order:
                    out += self.cycle_sentences[i]
            return out[:num_tokens]
        pool = self.ids
        while len(pool) < num_tokens + 1:  # a short source repeats (the description says so)
            pool = pool + self.ids
        start = rng.randrange(0, len(pool) - num_tokens)
        limit = min(len(pool) - num_tokens, start + 256)
        while start < limit and not (start == 0 or self.ends_sentence(pool[start - 1])):
            start += 1
        return pool[start : start + num_tokens]

    def snap_to_boundary(self, tokens: list[int], index: int, radius: int) -> int:
        """The sentence boundary nearest to `index` within `radius` tokens (index itself if none: then the hidden
        item may split a sentence, or with a byte-level tokenizer a word; see the module's docstring)."""
        for offset in range(radius + 1):
            for candidate in (index - offset, index + offset):
                if 0 <= candidate <= len(tokens) and (
                    candidate in (0, len(tokens)) or self.ends_sentence(tokens[candidate - 1])
                ):
                    return candidate
        return index


def filler_haystack(tokenizer) -> Haystack:
    sentences = [tokenizer(" " + s, add_special_tokens=False).input_ids for s in FILLER_SENTENCES]
    return Haystack(tokenizer, list(itertools.chain(*sentences)), "filler sentences", cycle_sentences=sentences)


def default_haystack() -> str:
    """The needle task's documents when none are named: the shared wiki parquet if present, else Python's docs."""
    return str(SHARED_HAYSTACK) if SHARED_HAYSTACK.is_file() else "python-docs"


def text_haystack(tokenizer, source: str | None, num_tokens: int, text_column: str = "text",
                  flag: str = "--haystack") -> Haystack:
    """Documents of `source` (a parquet/jsonl/txt path, or "python-docs"), tokenized until `num_tokens` (at
    least) are pooled, separated by blank lines. None: the shared wiki parquet if present, else Python's docs.
    flag: the option its errors name (the trainer's --eval-long-context reads its --dataset)."""
    from . import data

    if source is None:
        source = default_haystack()
    if data.streams_from_hub(source):
        raise ValueError(f"--haystack {source!r}: a streamed Hub dataset is not supported here; pass a local "
                         "parquet/jsonl/txt file or 'python-docs'.")
    documents = data.make_source(source, text_column, flag=flag)
    pool: list[int] = []
    separator = tokenizer("\n\n", add_special_tokens=False).input_ids
    texts = iter(documents)
    while len(pool) < num_tokens:
        chunk = list(itertools.islice(texts, 64))
        if not chunk:
            break
        for ids in tokenizer(chunk, add_special_tokens=False, verbose=False).input_ids:
            pool += ids + separator
    if not pool:
        raise ValueError(f"--haystack {source!r}: no text in it.")
    description = documents.describe()
    if len(pool) < num_tokens:
        description += f" (only {len(pool):,} tokens: repeated to fill the longest prompt)"
    return Haystack(tokenizer, pool, description)


# ----------------------------------------------------------------------------- cases


def _item_texts(task: str, rng: random.Random) -> tuple[str, str, str, str]:
    """(header, hidden item, question, answer) of one case."""
    if task == "passkey":
        answer = str(rng.randint(10000, 99999))
        return PASSKEY_HEADER, PASSKEY_NEEDLE.format(answer=answer), PASSKEY_QUESTION, answer
    place, answer = rng.choice(NEEDLE_PLACES), rng.choice(NEEDLE_WORDS)
    return NEEDLE_HEADER, NEEDLE_SENTENCE.format(place=place, answer=answer), NEEDLE_QUESTION.format(place=place), answer


def _answer_ids(tokenizer, question: str, answer: str, vocab_size: int | None) -> list[int]:
    """The answer's tokens as they follow the question (tokenized together, so that a tokenizer that merges
    across the boundary gives the ids the model would produce)."""
    question_ids = tokenizer(question, add_special_tokens=False).input_ids
    joint = _encode_exact(tokenizer, question + " " + answer, "answer", vocab_size)
    if joint[: len(question_ids)] == question_ids and len(joint) > len(question_ids):
        return joint[len(question_ids) :]
    return _encode_exact(tokenizer, " " + answer, "answer", vocab_size)


class CaseTooShortError(ValueError):
    """A case length below what the task's fixed text takes, with its parts as fields (so that a caller, the
    trainer's default lengths, can say why it skips a length without parsing the message): `length` as the user
    gave it under `length_flag`, `needed` the least that works, `parts` what the fixed text holds."""

    def __init__(self, length_flag: str, length: int, needed: int, task: str, parts: str):
        self.length_flag, self.length, self.needed, self.task, self.parts = length_flag, length, needed, task, parts
        super().__init__(f"{length_flag} {length}: {self.reason}; use {length_flag} >= {needed}.")

    @property
    def reason(self) -> str:
        return f"too short for the {self.task} task's fixed text ({self.needed} tokens with this tokenizer: {self.parts})"


def build_case(tokenizer, task: str, length: int, depth: float, haystack: Haystack, rng: random.Random,
               vocab_size: int | None = None, prefix: list[int] | None = None, length_flag: str = "--lengths",
               flag_offset: int = 0, in_document: bool = False) -> RetrievalCase:  # fmt: skip
    """One case of `length` tokens (prompt and answer). A too short length is named in the error as
    `length_flag` length + flag_offset (what the user gave: training_documents' rows hold the case without the
    tokenizer's special prefix, plus the end-of-text token; in_document says so in the error)."""
    header, item, question, answer = _item_texts(task, rng)
    prefix = _special_prefix(tokenizer) if prefix is None else prefix
    header_ids = _encode_exact(tokenizer, header, "instruction", vocab_size)
    item_ids = _encode_exact(tokenizer, item, "hidden item", vocab_size)
    question_ids = _encode_exact(tokenizer, question, "question", vocab_size)
    answer_ids = _answer_ids(tokenizer, question, answer, vocab_size)
    fixed = len(prefix) + len(header_ids) + len(item_ids) + len(question_ids) + len(answer_ids)
    budget = length - fixed  # the haystack's tokens: the case (prompt and answer) is `length` tokens
    if budget < 0:
        # what the count holds: a training row's document its end-of-text (its special prefix is the row's); an
        # evaluation case the tokenizer's special prefix
        extra = "the document's end-of-text" if in_document else "the tokenizer's special tokens" if prefix else ""
        parts = (f"instruction, hidden item, question, answer and {extra}" if extra
                 else "instruction, hidden item, question and answer")
        raise CaseTooShortError(length_flag, length + flag_offset, fixed + flag_offset, task, parts)
    hay = haystack.take(budget, rng)
    cut = round(depth * budget)
    cut = haystack.snap_to_boundary(hay, cut, radius=min(32, max(2, budget // 50)))
    haystack_start = len(prefix) + len(header_ids)
    prompt = prefix + header_ids + hay[:cut] + item_ids + hay[cut:] + question_ids
    return RetrievalCase(
        length=length, depth=depth, actual_depth=cut / budget if budget else depth, answer=answer,
        prompt_ids=prompt, answer_ids=answer_ids,
        needle_start=haystack_start + cut, needle_len=len(item_ids), haystack_start=haystack_start, haystack_len=budget,
    )  # fmt: skip


def build_cases(tokenizer, task: str, lengths, depths, samples: int, seed: int = 0, haystack: str | None = None,
                text_column: str = "text", vocab_size: int | None = None,
                length_flag: str = "--lengths") -> tuple[list[RetrievalCase], str]:  # fmt: skip
    """`samples` cases per (length, depth), each from its own seeded generator (so a cell's cases do not depend on
    the other lengths or depths asked). Returns the cases and the haystack's description; a length too short for
    the task raises CaseTooShortError naming `length_flag` (the caller's flag for the lengths)."""
    check_task(task)
    if samples < 1:
        raise ValueError(f"--samples {samples}: give at least 1 case per (length, depth).")
    hay = filler_haystack(tokenizer) if task == "passkey" else text_haystack(
        tokenizer, haystack, 2 * max(lengths), text_column)  # fmt: skip
    prefix = _special_prefix(tokenizer)
    cases = [
        build_case(tokenizer, task, length, depth, hay, random.Random(f"{seed}-{task}-{length}-{depth:g}-{i}"),
                   vocab_size, prefix, length_flag=length_flag)  # fmt: skip
        for length in lengths for depth in depths for i in range(samples)
    ]
    return cases, hay.description


_AFTER_ANSWER = "\n\n"  # training_documents' min_len: between a case's answer and the haystack text after it


def training_documents(tokenizer, task: str, row_len: int, count: int, seed: int = 0, haystack: str | None = None,
                       text_column: str = "text", length_flag: str = "--seq-len",
                       min_len: int | None = None) -> tuple[list[str], list[int], str]:  # fmt: skip
    """`count` training documents for the task, each a case's prompt followed by its answer, sized so that with
    the end-of-text token the trainer appends it fills `row_len` tokens exactly (a row, or a divisor of the row
    the trainer fills with several: no document split across rows, whatever order the trainer's shuffle puts
    them in); length_flag names row_len in errors. The depth of each is uniform in [0, 1]. Their generators are
    seeded apart from build_cases' (a different seed string), so the evaluation's prompts are not the training
    ones.

    min_len: each case then takes a length drawn uniformly from [min_len, row_len], and haystack text after its
    answer (a blank line, then filler) completes the document, so the answers end at varied positions. Every case
    ending at the same position teaches a model that position as much as the lookup (bench/QUALITY.md, "Retrieval twins
    that retrieve": a dense twin answered every case laid out as its rows and none one position later).

    Returns the texts, the tokens each fills as the trainer reads it (its tokens + the end-of-text token:
    row_len unless a BPE tokenizer's re-reading never settled) and the haystack's description."""
    check_task(task)
    if count < 1:
        raise ValueError(f"--rows {count}: give at least 1 document.")
    hay = filler_haystack(tokenizer) if task == "passkey" else text_haystack(tokenizer, haystack, 4 * row_len, text_column)
    prefix = _special_prefix(tokenizer)
    if min_len is not None:
        if min_len > row_len:
            raise ValueError(f"--min-doc-len {min_len}: give a length up to {length_flag} {row_len}, or leave it out "
                             f"for answers that all end the document.")  # fmt: skip
        length_flag = "--min-doc-len"  # the shortest case must hold the task's fixed text: checked here, named so
        # (any length below it, zero or negative too, gets the error that names the task's least length)
        build_case(tokenizer, task, min_len - 1 + len(prefix), 0.0, hay, random.Random(0), prefix=prefix,
                   length_flag=length_flag, flag_offset=1 - len(prefix), in_document=True)
    blank_line = tokenizer(_AFTER_ANSWER, add_special_tokens=False).input_ids  # between an answer and the text after it
    texts, filled = [], []
    for i in range(count):
        rng = random.Random(f"train-{seed}-{task}-{row_len}-{i}")
        depth = rng.random()
        case_len = row_len if min_len is None else rng.randint(min_len, row_len)
        if row_len - case_len < len(blank_line) + 1:  # no room for a blank line and filler: the case fills the row
            case_len = row_len
        state = rng.getstate()

        def case_text(length):
            # the case is prompt and answer of `length` tokens; the document holds them without the tokenizer's
            # special prefix (the trainer appends the end-of-text token)
            rng.setstate(state)
            case = build_case(tokenizer, task, length, depth, hay, rng, prefix=prefix, length_flag=length_flag,
                              flag_offset=1 - len(prefix), in_document=True)
            return tokenizer.decode(case.prompt_ids[len(prefix) :] + case.answer_ids, clean_up_tokenization_spaces=False)

        text, excess = _fitted(tokenizer, case_text, case_len - 1 + len(prefix), case_len)
        if case_len < row_len:
            case_doc, after = text, rng.getstate()

            def with_filler(take):
                rng.setstate(after)
                filler = tokenizer.decode(hay.take(max(1, take), rng), clean_up_tokenization_spaces=False)
                return case_doc + _AFTER_ANSWER + filler.lstrip()

            n_text = case_len - 1 + excess
            text, excess = _fitted(tokenizer, with_filler, row_len - 1 - n_text - len(blank_line), row_len)
        texts.append(text)
        filled.append(row_len + excess)
    return texts, filled, hay.description


def _fitted(tokenizer, build, start: int, target: int) -> tuple[str, int]:
    """build(n), with n corrected by the difference until the text re-tokenizes, with the end-of-text token the
    trainer appends, to `target` tokens: a BPE tokenizer may read decoded text back as a few more or fewer tokens
    (at most 4 tries; start: n's first guess). Returns (the text, its tokens - target)."""
    n = start
    for _ in range(4):
        text = build(n)
        excess = len(tokenizer(text, add_special_tokens=False).input_ids) + 1 - target
        if excess == 0:
            break
        n -= excess
    return text, excess


# ----------------------------------------------------------------------------- scoring


ANSWER_PUNCTUATION = ".,;:!?\"'()[]"  # stripped from an answer's first word before it is compared


def first_word(text: str) -> str:
    words = text.split()
    return words[0].strip(ANSWER_PUNCTUATION) if words else ""


def _left_padded(sequences: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, seq in enumerate(sequences):
        ids[row, width - len(seq) :] = torch.tensor(seq, dtype=torch.long)
        mask[row, width - len(seq) :] = 1
    return ids.to(device), mask.to(device)


def _pad_id(tokenizer, model) -> int:
    for value in (getattr(tokenizer, "pad_token_id", None), getattr(tokenizer, "eos_token_id", None),
                  getattr(getattr(model, "config", None), "pad_token_id", None)):  # fmt: skip
        if value is not None:
            return int(value)
    return 0  # the attention mask hides padding: its id is never read


@torch.no_grad()
def score_generate(model, tokenizer, cases: list[RetrievalCase], device, pad_id: int) -> list[dict]:
    """Greedy answers for a batch of cases (left padding): right when the first generated word is the answer."""
    ids, mask = _left_padded([c.prompt_ids for c in cases], pad_id, device)
    # room for the whole answer and three more tokens, within what the model's positions allow (a case of exactly
    # that many tokens holds the answer and nothing after it: check_lengths' limit)
    max_new = max(len(c.answer_ids) for c in cases) + 3
    if (limit := position_limit(getattr(model, "config", None))[0]) is not None:
        max_new = max(min(max_new, limit - max(len(c.prompt_ids) for c in cases)), 1)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False,
                         pad_token_id=pad_id)  # fmt: skip
    # a row stops at an end-of-text (the generation config's, or any special token, which decoding drops); a
    # finished row of the batch is padded after it
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    stop_ids = set(getattr(tokenizer, "all_special_ids", None) or ()) | set(eos if isinstance(eos, list) else [eos])
    results = []
    for row, case in enumerate(cases):
        generated = out[row, ids.shape[1] :].tolist()
        # the answer ends at the first stop token (decoding would drop one inside the text and join its two sides)
        cut = next((i for i, token in enumerate(generated) if token in stop_ids), len(generated))
        text = tokenizer.decode(generated[:cut], skip_special_tokens=True)
        prediction = text.strip()
        stopped = cut < len(generated)
        correct = first_word(text) == case.answer
        # the lookup without the answer's last token (right answers included): in a case one token longer than a
        # training row of one document, that token sits where every row put its end-of-text. None for a one-token
        # answer, which has nothing before its last token
        but_last = len(case.answer_ids) - 1
        right_but_last = (correct or generated[:but_last] == case.answer_ids[:but_last]) if but_last else None
        results.append({"correct": correct, "prediction": prediction, "stopped": stopped,
                        "ended_inside_answer": stopped and ends_inside_answer(prediction, case.answer),
                        "right_but_last_token": right_but_last})  # fmt: skip
    return results


def ends_inside_answer(prediction: str, answer: str) -> bool:
    """Whether a greedy answer's whole text (stripped, less the punctuation first_word strips) is a right start of
    the answer and not all of it: e.g. '7008' for '70087'. score_generate also requires that the text stopped there
    (an end-of-text; it leaves room for the whole answer and three more tokens, so the stop is the model's own).
    Scored wrong; told apart because a model trained on rows of one length can learn to end its text where they
    ended, so a case whose answer runs to that position fails on the ending, not the lookup."""
    prediction = prediction.strip().strip(ANSWER_PUNCTUATION)
    return bool(prediction) and prediction != answer and answer.startswith(prediction)


def tells_more_than_accuracy(accuracy: float, right_but_last: float | None = None, ended: float | None = None) -> bool:
    """Whether a length's last-token shares tell more than its accuracy: some answer ended inside itself, or the
    cases right in every answer token but perhaps the last outnumber the right ones (one rule for every table)."""
    return bool(ended) or (right_but_last is not None and abs(right_but_last - accuracy) > 1e-9)


def ending_summary(result: dict) -> str:
    """One line under a generate evaluation's table: per length, the cases right in every answer token but perhaps
    the last (right answers included; where that differs from the accuracy) and the answers that ended inside
    themselves, or that none did; empty where every answer was right."""
    def by_length(matrix):
        return {n: sum(row) / len(row) for n, row in zip(result["lengths"], matrix or ())}

    accuracy, ended = by_length(result["accuracy"]), by_length(ended_inside_answer_rates(result))
    but_last = by_length(result.get("right_but_last_token"))  # (none for one-token answers)
    if all(a == 1 for a in accuracy.values()):
        return ""
    differs = [n for n in but_last if tells_more_than_accuracy(accuracy[n], right_but_last=but_last[n])]
    stopped = [n for n in ended if tells_more_than_accuracy(accuracy[n], ended=ended[n])]
    if not differs and not stopped:
        return ("every wrong answer was wrong before its last token, and none ended inside itself (its right start, "
                "then end-of-text)." if but_last else "no answer ended inside itself (its right start, then "
                "end-of-text).")  # fmt: skip
    parts = []
    if differs:
        parts.append("right in every answer token but perhaps the last (the accuracy plus the answers wrong at that "
                     "token alone), % of cases: " + ", ".join(f"{n:,}: {100 * but_last[n]:.0f}" for n in differs))
    if stopped:
        parts.append("ended inside the answer (its right start, then end-of-text; scored wrong), % of cases: "
                     + ", ".join(f"{n:,}: {100 * ended[n]:.0f}" for n in stopped))
    training_len = result.get("training_len")
    if training_len in differs or training_len in stopped:
        why = (f"At {training_len:,} tokens, the training length, a case's last answer token sits where rows of one "
               "document put their end-of-text: a model that learned to end its text there fails at that token "
               "alone, on the ending, not on the lookup.")
    else:
        why = ("A model trained on rows of one length can learn to end its text where they ended; a failure at the "
               "answer's last token alone may be that, not the lookup.")
    return "; ".join(parts) + ". " + why


def ended_inside_answer_rates(result: dict) -> list[list[float]] | None:
    """(lengths, depths) share of cases that ended inside the answer, from an evaluation's JSON: its own matrix, or
    for a file written before the matrix existed its cases' predictions (which do not record the stop: an answer's
    start followed by whitespace alone counts there too); None for loglik scoring (no text ends) and for a file
    that holds neither."""
    if result.get("ended_inside_answer") is not None:
        return result["ended_inside_answer"]
    cells, lengths, depths = result.get("cells") or [], result.get("lengths"), result.get("depths")
    if result.get("scoring") != "generate" or not cells or not lengths or not depths or not all(
            isinstance(cell, dict) and cell.get("cases") and all("prediction" in x and "answer" in x for x in cell["cases"])
            for cell in cells):  # fmt: skip
        return None
    share = {(c.get("length"), c.get("depth")): sum(ends_inside_answer(x["prediction"], x["answer"])
                                                    for x in c["cases"]) / len(c["cases"]) for c in cells}  # fmt: skip
    if set(share) != {(n, d) for n in lengths for d in depths}:
        return None
    return [[share[n, d] for d in depths] for n in lengths]


@torch.no_grad()
def score_loglik(model, cases: list[RetrievalCase], device, pad_id: int) -> list[dict]:
    """Teacher-forced answers: right when every answer token is the argmax; the answer's mean log-prob."""
    sequences = [c.prompt_ids + c.answer_ids for c in cases]
    ids, mask = _left_padded(sequences, pad_id, device)
    keep = max(len(c.answer_ids) for c in cases) + 1  # the logits that predict answer tokens, at most
    accepts = inspect.signature(model.forward).parameters
    kwargs = {"logits_to_keep": keep} if "logits_to_keep" in accepts else {}
    if "position_ids" in accepts:  # each row's own positions, as generate() gives them: a model with a learned
        # position table (GPT-2, OPT) otherwise reads a left-padded row at positions shifted by its padding
        kwargs["position_ids"] = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=mask, **kwargs).logits[:, -keep:].float()  # (B, keep, V)
    log_probs = torch.log_softmax(logits, dim=-1)
    results = []
    for row, case in enumerate(cases):
        n = len(case.answer_ids)
        # answer token j sits at position S - n + j; the logits predicting it at S - n - 1 + j, kept index keep - n - 1 + j
        rows = log_probs[row, keep - n - 1 : keep - 1]  # (n, V)
        target = torch.tensor(case.answer_ids, device=rows.device)
        token_lp = rows.gather(-1, target[:, None])[:, 0]
        results.append({"correct": bool((rows.argmax(-1) == target).all()), "answer_logprob": float(token_lp.mean())})
    return results


def takes_needle_selection(model) -> bool:
    """Whether `model` has NSA layers whose selection the evaluation can read (this project's NSA in nsa mode)."""
    config = getattr(model, "config", None)
    return getattr(config, "model_type", None) == "nsa" and getattr(config, "attention_mode", "nsa") == "nsa"


def answer_mentions(case: RetrievalCase) -> list[int]:
    """The prompt positions where the answer's tokens, as they follow the question, start inside the hidden item (a
    passkey's item names its key twice); none where a tokenizer merges them with their neighbours there."""
    item = case.prompt_ids[case.needle_start : case.needle_start + case.needle_len]
    answer, n = case.answer_ids, len(case.answer_ids)
    return [case.needle_start + i for i in range(len(item) - n + 1) if item[i : i + n] == answer]


def _answer_positions(case: RetrievalCase) -> tuple[list[int], bool]:
    """The prompt positions of the answer's tokens where they occur inside the hidden item (answer_mentions), and
    True; or, where the item's tokens do not hold the answer's as they follow the question (a tokenizer that merges
    across the boundary), every position of the item, and False."""
    starts, n = answer_mentions(case), len(case.answer_ids)
    if not starts:
        return list(range(case.needle_start, case.needle_start + case.needle_len)), False
    return sorted({start + j for start in starts for j in range(n)}), True


def _answer_span_blocks(case: RetrievalCase, block_size: int) -> list[int]:
    """The selection blocks (in-document indices) holding _answer_positions."""
    return sorted({p // block_size for p in _answer_positions(case)[0]})


REGIONS = ("answer", "item", "question", "instruction", "haystack")  # a block's region, first that applies


def _block_regions(case: RetrievalCase, num_blocks: int, block_size: int) -> list[str]:
    """Each of a prompt's first num_blocks selection blocks by what it holds, the first of REGIONS that applies: the
    answer's tokens inside the item (_answer_span_blocks), the rest of the item, the question at the end, the
    instruction before the haystack (with the special prefix), else the haystack."""
    answer = set(_answer_span_blocks(case, block_size))
    question_start = case.haystack_start + case.haystack_len + case.needle_len
    item_end = case.needle_start + case.needle_len
    regions = []
    for block in range(num_blocks):
        first, last = block * block_size, block * block_size + block_size - 1
        if block in answer:
            regions.append("answer")
        elif first < item_end and last >= case.needle_start:
            regions.append("item")
        elif last >= question_start:
            regions.append("question")
        elif first < case.haystack_start:
            regions.append("instruction")
        else:
            regions.append("haystack")
    return regions


def _chance_of_selecting(targets: int, eligible: int, picks: int) -> float:
    """The chance that `picks` blocks drawn uniformly from `eligible` free blocks include one of `targets` of them."""
    if targets <= 0:
        return 0.0
    if picks >= eligible:
        return 1.0
    return 1.0 - math.comb(eligible - targets, picks) / math.comb(eligible, picks)


@torch.no_grad()
def needle_selection(model, cases: list[RetrievalCase], device, pad_id: int) -> list[dict]:
    """Where NSA looks for the answer, for a batch of cases: whether the top-n selection of the last prompt token (the
    query that predicts the answer's first token) holds a selection block with the answer's tokens inside the hidden
    item (_answer_span_blocks), per layer and KV group, as the model's layers select (the kernels' top-n where they
    run, else the reference's; one forward over the prompts). Beside it the chance that the free picks (n minus the
    forced blocks, drawn uniformly from the other blocks of the document) would hold one, and whether the answer lies
    where the query sees it without choosing it: inside its sliding window or in a forced block; and where the free
    picks go by region (_block_regions). A retrieval that fails while the answer's block is selected well above
    chance points past the selection (to the selected branch, its gate or later layers); one that fails with it
    selected at or below chance points at the compressed scores that choose the blocks."""
    from .selection_stats import capture_selections, forced_blocks

    ids, mask = _left_padded([c.prompt_ids for c in cases], pad_id, device)
    layers = capture_selections(model, {"input_ids": ids, "attention_mask": mask}, max_rows=len(cases),
                                max_len=ids.shape[1], last=1)  # whole prompts; the last token is the one asked about
    if not layers:
        raise ValueError(f"needle selection: {type(model).__name__} ran no NSA layer (attention_mode "
                         f"{getattr(model.config, 'attention_mode', None)!r}); it needs an NSA model in attention_mode "
                         "'nsa'.")  # fmt: skip
    params = layers[0].params
    results = []
    for row, case in enumerate(cases):
        query = len(case.prompt_ids) - 1  # the last prompt token's position in its document (left padding: 0 first)
        own = query // params.sel_block_size
        blocks = torch.arange(own + 1)
        forced = forced_blocks(blocks, torch.tensor(own), params)  # (own + 1,)
        targets = torch.tensor(_answer_span_blocks(case, params.sel_block_size))
        target_forced = bool(forced[targets].any())
        free_targets = 0 if target_forced else len(targets)
        eligible = int((~forced).sum())
        chance = 1.0 if target_forced else _chance_of_selecting(
            free_targets, eligible, max(0, min(params.sel_num_blocks, own + 1) - int(forced.sum())))
        region = _block_regions(case, own + 1, params.sel_block_size)
        selected, picks = [], []
        for layer in layers:
            chosen = layer.block_indices[row, :, -1]  # (Hkv, n') in-document blocks, -1 unused
            selected.append([bool(torch.isin(kv, targets).any()) for kv in chosen])
            free = [b for b in chosen.flatten().tolist() if b >= 0 and not forced[b]]
            picks.append({name: sum(region[b] == name for b in free) for name in REGIONS})
        positions, found = _answer_positions(case)
        in_window = max(positions) > query - params.window_size  # an answer token among the window's keys
        results.append({"needle_selected": selected, "needle_chance": chance, "needle_in_window": in_window,
                        "needle_forced": target_forced, "needle_visible_anyway": in_window or target_forced,
                        "answer_tokens_found": found,
                        "free_picks_by_region": picks,
                        "free_blocks_by_region": {name: sum(region[b] == name for b in range(own + 1) if not forced[b])
                                                  for name in REGIONS}})  # fmt: skip
    return results


def _shares(counts: list[dict]) -> dict:
    """Counts per region summed over cases, as shares of their total (0 where there are none)."""
    total = {name: sum(c[name] for c in counts) for name in REGIONS}
    whole = sum(total.values())
    return {name: (total[name] / whole if whole else 0.0) for name in REGIONS}


def _selection_rate(scored: list[dict]) -> float:
    """The share of (case, layer, KV group) whose last-token selection holds one of the answer's blocks."""
    flags = [hit for s in scored for layer in s["needle_selected"] for hit in layer]
    return sum(flags) / len(flags)


# ----------------------------------------------------------------------------- the evaluation


def run_long_context_eval(model, tokenizer, task: str = "passkey", lengths=(1024, 4096), depths=DEFAULT_DEPTHS, *,
                          samples: int = 10, batch_size: int = 4, scoring: str = "generate", seed: int = 0,
                          haystack: str | None = None, text_column: str = "text", training_len: int | None = None,
                          model_path: str | Path | None = None, out_dir: str | Path | None = None,
                          model_name: str | None = None, log=print, shard: tuple[int, int] = (0, 1),
                          gather=None, selection: bool | None = None,
                          training_len_source: str = "given by the caller") -> dict:  # fmt: skip
    """Evaluate `model` on `samples` cases per (length, depth); returns (and with `out_dir` writes as JSON and
    PNG) the accuracy per cell. `training_len` (default: from the config, or `model_path`'s run.json) marks
    longer lengths as extrapolation; `training_len_source` says where a given one came from (the tables' footnote).
    The model is put in eval mode and back in its mode after.

    shard=(rank, world) with `gather` (a list of this process's items -> every process's, concatenated in rank
    order: accelerate's gather_object) splits the batches between data-parallel processes, batch k to rank
    k % world, each holding the whole model (DDP); every process returns the whole result. Not under FSDP, where
    every forward needs all processes: there each evaluates every case.

    selection (default None: on for this project's NSA models in nsa mode, off for others): also record where the
    last prompt token's top-n selection looks (needle_selection), per case and as a rate per cell and layer."""
    check_task(task)
    if selection is None:
        selection = takes_needle_selection(model)
    elif selection and not takes_needle_selection(model):
        raise ValueError(f"--needle-selection: {type(model).__name__} (attention_mode "
                         f"{getattr(getattr(model, 'config', None), 'attention_mode', None)!r}) has no NSA selection to "
                         "read; it needs an NSA model in attention_mode 'nsa' (drop the flag for other models).")  # fmt: skip
    check_scoring(scoring)
    depths = check_depths(depths)
    if batch_size < 1:
        raise ValueError(f"--batch-size {batch_size}: give at least 1.")
    rank, world = shard
    if not 0 <= rank < world or (world > 1 and gather is None):
        raise ValueError(f"shard={shard}: give (rank, world) with 0 <= rank < world, and gather when world > 1.")
    config = getattr(model, "config", None)
    limit, limit_source = position_limit(config)
    lengths = check_lengths(lengths, limit, limit_source)
    if training_len is None:
        training_len, train_source = training_length(config, model_path)
    else:
        train_source = training_len_source
    vocab_size = getattr(config, "vocab_size", None)
    max_positions = getattr(config, "max_position_embeddings", None)
    # rotary positions run past max_position_embeddings (position_limit refuses only learned tables): say so before
    # the evaluation's minutes, not only in its table
    beyond_max_positions = [n for n in lengths if limit is None and max_positions is not None and n > max_positions]
    if beyond_max_positions:
        log(f"{', '.join(f'{n:,}' for n in beyond_max_positions)} tokens: beyond the config's max_position_embeddings "
            f"({max_positions:,}); rotary positions run there, but the model was not built for them (the results are "
            "marked so)")  # fmt: skip
    cases, haystack_description = build_cases(tokenizer, task, lengths, depths, samples, seed, haystack, text_column,
                                              vocab_size)  # fmt: skip
    device = next(model.parameters()).device
    pad_id = _pad_id(tokenizer, model)
    was_training = model.training
    model.eval()
    started = time.time()
    batches = [cases[i : i + batch_size] for i in range(0, len(cases), batch_size)]  # ordered by length: one each
    mine: list[tuple[int, list[dict]]] = []
    try:
        for k in range(rank, len(batches), world):
            try:
                if scoring == "generate":
                    scores = score_generate(model, tokenizer, batches[k], device, pad_id)
                else:
                    scores = score_loglik(model, batches[k], device, pad_id)
                if selection:
                    scores = [{**s, **where} for s, where in zip(scores, needle_selection(model, batches[k], device,
                                                                                           pad_id))]  # fmt: skip
            except (torch.OutOfMemoryError, MemoryError, RuntimeError) as error:
                if not isinstance(error, (torch.OutOfMemoryError, MemoryError)) and "allocate" not in str(error):
                    raise
                longest = max(case.length for case in batches[k])  # (a batch may hold two lengths)
                raise RuntimeError(
                    f"length {longest}: out of memory on {device} with {len(batches[k])} case(s) per batch. Use a "
                    "smaller batch, shorter lengths or a GPU (on CPU this project's NSA models run the PyTorch "
                    f"reference, which holds length x length scores per head). The error: {error}"
                ) from error
            mine.append((k, scores))
    finally:
        model.train(was_training)
    by_batch = dict(gather(mine) if world > 1 else mine)
    if sorted(by_batch) != list(range(len(batches))):
        raise RuntimeError(f"long-context evaluation: batches {sorted(set(range(len(batches))) - set(by_batch))} "
                           f"were scored by no process (shard={shard}); gather must return every process's items.")
    scored = [s for k in range(len(batches)) for s in by_batch[k]]
    cells = []
    for length in lengths:
        for depth in depths:
            mine = [(c, s) for c, s in zip(cases, scored) if c.length == length and c.depth == depth]
            cell = {"length": length, "depth": depth, "samples": len(mine),
                    "accuracy": sum(s["correct"] for _, s in mine) / len(mine),
                    "actual_depth_mean": sum(c.actual_depth for c, _ in mine) / len(mine),
                    "extrapolation": training_len is not None and length > training_len}  # fmt: skip
            if scoring == "loglik":
                cell["answer_logprob_mean"] = sum(s["answer_logprob"] for _, s in mine) / len(mine)
            else:
                cell["ended_inside_answer"] = sum(s["ended_inside_answer"] for _, s in mine) / len(mine)
                but_last = [s["right_but_last_token"] for _, s in mine]
                cell["right_but_last_token"] = None if None in but_last else sum(but_last) / len(but_last)
            if selection:
                chosen = [s for _, s in mine]
                cell["needle_selected_rate"] = _selection_rate(chosen)
                cell["needle_selected_rate_by_layer"] = [
                    sum(hit for s in chosen for hit in s["needle_selected"][i]) / sum(len(s["needle_selected"][i]) for s in chosen)
                    for i in range(len(chosen[0]["needle_selected"]))]  # fmt: skip
                cell["needle_chance_rate"] = sum(s["needle_chance"] for s in chosen) / len(chosen)
                cell["free_pick_shares_by_layer"] = [_shares([s["free_picks_by_region"][i] for s in chosen])
                                                     for i in range(len(chosen[0]["free_picks_by_region"]))]
                cell["free_block_shares"] = _shares([s["free_blocks_by_region"] for s in chosen])
                cell["needle_in_window_share"] = sum(s["needle_in_window"] for s in chosen) / len(chosen)
                cell["needle_forced_share"] = sum(s["needle_forced"] for s in chosen) / len(chosen)
                cell["needle_visible_anyway_share"] = sum(s["needle_visible_anyway"] for s in chosen) / len(chosen)
            cell["cases"] = [{"answer": c.answer, "needle_start": c.needle_start, **s} for c, s in mine]
            cells.append(cell)
    result = {
        "model": model_name or (str(model_path) if model_path else type(model).__name__),
        "model_class": type(model).__name__,
        "attention_mode": getattr(config, "attention_mode", None),
        "task": task, "scoring": scoring, "lengths": lengths, "depths": depths, "samples": samples, "seed": seed,
        "haystack": haystack_description if task == "needle" else "filler sentences",
        "training_len": training_len, "training_len_source": train_source,
        "extrapolated_lengths": [n for n in lengths if training_len is not None and n > training_len],
        "max_position_embeddings": max_positions,
        "beyond_max_positions": beyond_max_positions,
        "device": str(device), "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "date": time.strftime("%Y-%m-%d"), "wall_s": round(time.time() - started, 2), "processes": world,
        "accuracy": [[cell["accuracy"] for cell in cells if cell["length"] == n] for n in lengths],
        "ended_inside_answer": ([[cell["ended_inside_answer"] for cell in cells if cell["length"] == n]
                                 for n in lengths] if scoring == "generate" else None),
        "right_but_last_token": ([[cell["right_but_last_token"] for cell in cells if cell["length"] == n]
                                  for n in lengths] if scoring == "generate" and all(
                                      cell["right_but_last_token"] is not None for cell in cells) else None),
        "needle_selected": ([[cell["needle_selected_rate"] for cell in cells if cell["length"] == n] for n in lengths]
                            if selection else None),
        "cells": cells,
    }  # fmt: skip
    log(format_table(result))
    if out_dir is not None:
        paths = write_outputs(result, out_dir)
        log("wrote " + ", ".join(str(p) for p in paths))
    return result


def format_table(result: dict) -> str:
    """Markdown tables: one row per length, one column per depth, accuracy in percent ('*' marks extrapolation); with
    the needle selection, the rate at which the answer's block was selected per cell beside its chance, and where
    the free picks went per layer."""
    depths = result["depths"]
    head = f"{result['task']} ({result['scoring']}), {result['samples']} case(s) per cell, accuracy %"
    lines = [head, "", "| length | " + " | ".join(f"depth {d:g}" for d in depths) + " | mean |",
             "|---|" + "---|" * (len(depths) + 1)]  # fmt: skip
    for length, row in zip(result["lengths"], result["accuracy"]):
        mark = "*" if length in result["extrapolated_lengths"] else ""
        cells = " | ".join(f"{100 * a:.0f}" for a in row)
        lines.append(f"| {length:,}{mark} | {cells} | {100 * sum(row) / len(row):.0f} |")
    summary = ending_summary(result) if result["scoring"] == "generate" else ""
    if summary:
        lines += ["", summary]
    if result.get("needle_selected"):
        lines += ["", "the answer's block in the last prompt token's selection, % of (case, layer, KV group); chance: "
                  "uniform free picks:", "",
                  "| length | " + " | ".join(f"depth {d:g}" for d in depths) + " | mean | chance | answer in window "
                  "or forced |", "|---|" + "---|" * (len(depths) + 3)]  # fmt: skip
        for length, row in zip(result["lengths"], result["needle_selected"]):
            mark = "*" if length in result["extrapolated_lengths"] else ""
            seen = [c for c in result["cells"] if c["length"] == length]
            chance = sum(c["needle_chance_rate"] for c in seen) / len(seen)
            free = sum(c["needle_visible_anyway_share"] for c in seen) / len(seen)
            cells = " | ".join(f"{100 * a:.0f}" for a in row)
            lines.append(f"| {length:,}{mark} | {cells} | {100 * sum(row) / len(row):.0f} | {100 * chance:.0f} | "
                         f"{100 * free:.0f}% |")
        cells = result["cells"]
        lines += ["", "where the last prompt token's free picks (not the forced blocks) go, % of picks (mean of the cells' "
                  "shares); uniform: the regions' shares of the free blocks:", "",
                  "| layer | " + " | ".join(REGIONS) + " |", "|---|" + "---|" * len(REGIONS)]  # fmt: skip
        for i in range(len(cells[0]["free_pick_shares_by_layer"])):
            shares = _mean_shares([c["free_pick_shares_by_layer"][i] for c in cells])
            lines.append(f"| {i} | " + " | ".join(f"{100 * shares[n]:.0f}" for n in REGIONS) + " |")
        uniform = _mean_shares([c["free_block_shares"] for c in cells])
        lines.append("| uniform | " + " | ".join(f"{100 * uniform[n]:.0f}" for n in REGIONS) + " |")
    if result["extrapolated_lengths"]:
        lines.append(f"\n* beyond the training length {result['training_len']:,} ({result['training_len_source']}): "
                     "extrapolation")  # fmt: skip
    if result.get("beyond_max_positions"):
        lines.append(f"\n{', '.join(f'{n:,}' for n in result['beyond_max_positions'])}: beyond the config's "
                     f"max_position_embeddings ({result['max_position_embeddings']:,}); rotary positions run there, "
                     "but the model was not built for them")  # fmt: skip
    return "\n".join(lines)


def _mean_shares(shares: list[dict]) -> dict:
    return {name: sum(s[name] for s in shares) / len(shares) for name in REGIONS}


def heatmap_length_note(first_beyond: int | None, training_len: int | None) -> str:
    """The heatmap's x-label addition: where the dashed line between trained and extrapolated lengths is, or that
    every length is beyond the training length (no line at the plot's edge)."""
    if first_beyond is None:
        return ""
    if first_beyond == 0:
        return f"; all beyond the training length {training_len:,}"
    return "; dashed: training length"


def write_outputs(result: dict, out_dir: str | Path) -> list[Path]:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"{result['task']}_{result['scoring']}"
    json_path = out_dir / f"{stem}.json"
    json_path.write_text(json.dumps(result, indent=2))
    paths = [json_path]
    try:
        paths.append(plot_heatmap(result, out_dir / f"{stem}.png"))
    except ImportError:
        print('matplotlib is not installed: no heatmap PNG (pip install "nsa-transformers[plot]")', file=sys.stderr)
    return paths


def plot_heatmap(result: dict, path: str | Path) -> Path:
    """Accuracy heatmap, depth (rows, 0 at the top) x length (columns), as in the NSA paper's Figure 5."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths, depths = result["lengths"], result["depths"]
    grid = [[result["accuracy"][i][j] for i in range(len(lengths))] for j in range(len(depths))]  # (depth, length)
    fig, ax = plt.subplots(figsize=(1.1 * len(lengths) + 2.5, 0.5 * len(depths) + 2.0))
    image = ax.imshow(grid, cmap="RdYlGn", vmin=0.0, vmax=1.0, aspect="auto")
    for j in range(len(depths)):
        for i in range(len(lengths)):
            ax.text(i, j, f"{100 * grid[j][i]:.0f}", ha="center", va="center", fontsize=8)
    ax.set_xticks(range(len(lengths)), [f"{n // 1024}k" if n % 1024 == 0 else str(n) for n in lengths])
    ax.set_yticks(range(len(depths)), [f"{100 * d:g}%" for d in depths])
    first_beyond = lengths.index(result["extrapolated_lengths"][0]) if result["extrapolated_lengths"] else None
    ax.set_xlabel("context length (tokens)" + heatmap_length_note(first_beyond, result["training_len"]))
    ax.set_ylabel("depth of the hidden item")
    if first_beyond:  # a line between the trained lengths and the ones beyond (none at the plot's edge)
        ax.axvline(first_beyond - 0.5, color="black", linestyle="--", linewidth=1)
    name = "/".join(Path(str(result["model"])).parts[-2:])  # runs/<run>/final -> <run>/final
    ax.set_title(f"{name}: {result['task']} ({result['scoring']})", fontsize=9)
    fig.colorbar(image, ax=ax, label="accuracy")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)


def card_section(result: dict) -> str:
    """A model card's summary of one result: the table and how it was measured."""
    return (f"### Long-context retrieval: {result['task']}\n\n{format_table(result)}\n\n"
            f"Haystack: {result['haystack']}; {result['device']}, {result['dtype']}, {result['date']}.\n")  # fmt: skip


# ----------------------------------------------------------------------------- command line


def check_device(device: str | None, flag: str = "--device") -> None:
    """A CUDA device asked for where there is none: one line naming the flag (torch's own error comes from deep
    inside the first .to())."""
    if device is not None and str(device).startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"{flag} {device}: this machine has no CUDA GPU (torch.cuda.is_available() is False); pass "
                         f"{flag} cpu, or leave it out.")


def check_output_path(path, kind: str, flag: str = "--out") -> None:
    """An output path that cannot be written as `kind` ("folder" or "file"): an error naming the flag before any
    model is evaluated (the write fails after the evaluation otherwise, its result lost)."""
    path = Path(path)
    if kind == "folder" and path.exists() and not path.is_dir():
        raise ValueError(f"{flag} {str(path)!r} is a file; this output is a folder: pass a folder's path (new or "
                         "existing).")
    if kind == "file" and path.is_dir():
        raise ValueError(f"{flag} {str(path)!r} is a folder; this output is one file: pass a file's path, e.g. "
                         f"{str(path / 'result.json')!r}.")


def check_hub_id_reachable(repo_id: str, filename: str, what: str, hint: str) -> None:
    """A Hub id whose `filename` is not in the local cache must come from the Hub: fail in seconds where it cannot
    be reached (offline mode, no network), not after transformers' minute of retries."""
    from huggingface_hub import try_to_load_from_cache

    from .data import check_hub_reachable

    try:
        cached = try_to_load_from_cache(repo_id, filename)
    except ValueError:  # not a valid repo id: from_pretrained names it
        return
    if isinstance(cached, str):
        return
    try:
        check_hub_reachable(what, hint)
    except ConnectionError as e:
        raise ValueError(str(e)) from None


def resolve_source(spec: str, flag: str, filename: str, missing_fix: str, offline_fix: str) -> str:
    """A local directory (returned with ~ expanded), else a Hub id: a path that names no directory fails as one
    (not as a malformed Hub id), and an uncached Hub id fails in seconds where the Hub cannot be reached."""
    from .data import looks_like_a_path

    local = Path(spec).expanduser()
    if local.exists():
        return str(local)
    if looks_like_a_path(spec):
        raise ValueError(f"{flag} {spec!r}: no such directory; {missing_fix}")
    check_hub_id_reachable(spec, filename, f"{flag} {spec!r}", offline_fix)
    return spec


def check_not_a_run_directory(spec: str) -> None:
    """MODEL given as a training run's directory (its saved model is in final/): said with the path to pass."""
    path = Path(spec).expanduser()
    if not (path / "config.json").exists() and (path / "final" / "config.json").is_file():
        raise ValueError(f"MODEL {spec!r} is a training run's directory, not a saved model; pass its final/ "
                         f"({path / 'final'}).")


def load_model_and_tokenizer(spec: str, tokenizer_spec: str | None = None, device: str | None = None,
                             dtype: str = "auto", nsa_backend: str = "auto", trust_remote_code: bool = False,
                             check_config=None):  # fmt: skip
    """A run's final/, a saved directory or a Hub id: this project's NSA models through the installed code (with
    `nsa_backend`), any other causal LM through AutoModelForCausalLM. check_config(config), where given, is called
    on the model's config before the weights and the tokenizer load (a tool refusing a model it cannot use says
    so first)."""
    import modeling_nsa  # noqa: F401  (registers model_type "nsa" with the Auto classes)
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from .data import load_tokenizer

    check_device(device)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if dtype == "auto":
        dtype = "bfloat16" if str(device).startswith("cuda") else "float32"
    spec = resolve_source(spec, "MODEL", "config.json",
                          "pass a run's final/ directory, a saved model directory or a Hub id (name or org/name).",
                          "Pass a run's final/ directory or a saved model directory, or run where the Hub can be "
                          "reached.")  # fmt: skip
    check_not_a_run_directory(spec)
    tokenizer = None
    if tokenizer_spec is not None:  # the trainer's loader: byt5 by name, a mistyped path named with its near folders
        try:
            tokenizer = load_tokenizer(tokenizer_spec, require_eos=False, trust_remote_code=trust_remote_code,
                                       other_fix=" Or leave --tokenizer out to use MODEL's.")  # fmt: skip
        except ConnectionError as e:  # the Hub cannot be reached: bad input here, one line as the others
            raise ValueError(str(e)) from None
    try:
        config = AutoConfig.from_pretrained(spec, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise ValueError(f"MODEL {spec!r}: cannot load a model config from it ({' '.join(str(e).split())[:300]}); pass "
                         "a run's final/ directory, a saved model directory or a Hub id.") from None  # fmt: skip
    if check_config is not None:
        check_config(config)
    extra = {"nsa_backend": nsa_backend} if config.model_type == "nsa" else {}
    model = AutoModelForCausalLM.from_pretrained(spec, dtype=getattr(torch, dtype), trust_remote_code=trust_remote_code,
                                                 **extra)  # fmt: skip
    if tokenizer is None:
        try:
            tokenizer = AutoTokenizer.from_pretrained(spec, trust_remote_code=trust_remote_code)
        except (OSError, ValueError) as e:
            raise ValueError(f"MODEL {spec!r}: cannot load its tokenizer ({' '.join(str(e).split())[:300]}); pass "
                             "--tokenizer with the model's tokenizer directory, a Hub id or byt5.") from None  # fmt: skip
    return model.to(device), tokenizer


class _DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: X)" except where X is None: those flags' help says what no value means."""

    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


class _FlagHintingParser(argparse.ArgumentParser):
    """An unknown flag's error names the flag meant: the trainer's spelling (--long-context-lengths) or a typo."""

    def error(self, message):
        prefix = "unrecognized arguments: "
        if message.startswith(prefix):
            flags = [flag for action in self._actions for flag in action.option_strings]
            close = [match for given in message[len(prefix) :].split() if given.startswith("-")
                     for match in difflib.get_close_matches(given.split("=")[0].replace("--long-context-", "--"),
                                                            flags, 1)]  # fmt: skip
            message += f" (did you mean {' or '.join(dict.fromkeys(close))}?)" if close else ""
        super().error(message)


def build_parser() -> argparse.ArgumentParser:
    p = _FlagHintingParser(prog="python -m nsa_train.long_context", description=__doc__.split("\n\n")[0],
                           formatter_class=_DefaultsHelpFormatter)  # fmt: skip
    p.add_argument("model", metavar="MODEL", help="a run's final/ directory, a saved model directory or a Hub id")
    p.add_argument("--task", default="passkey", help=f"one of {', '.join(TASKS)}")
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096], help="case lengths in tokens (prompt and answer)")
    p.add_argument("--depths", type=float, nargs="+", default=list(DEFAULT_DEPTHS),
                   help="fractions of the haystack before the hidden item, in [0, 1]")
    p.add_argument("--samples", type=int, default=10, help="cases per (length, depth)")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--scoring", default="generate", help=f"one of {', '.join(SCORINGS)}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--haystack", default=None, help="needle: a parquet/jsonl/txt file of documents or 'python-docs' "
                   f"(default: {SHARED_HAYSTACK.name} beside the checkout when present, else python-docs)")
    p.add_argument("--text-column", default="text")
    p.add_argument("--tokenizer", default=None, help="a tokenizer directory, a Hub id or byt5, as the trainer's "
                   "--tokenizer (default: MODEL's)")
    p.add_argument("--training-len", type=int, default=None,
                   help="the model's training length (default: the config's training_seq_len, else the run's "
                        "run.json, else max_position_embeddings)")
    p.add_argument("--out", default=None, help="output directory (default: <run>/long_context for a run's final/, "
                   "else ./long_context)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace <out>/<task>_<scoring>.json even where it holds an evaluation with other lengths, "
                   "depths, samples or seed (for a run: the trainer's, which its model card quotes)")
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto: bfloat16 on a GPU, float32 on CPU")
    p.add_argument("--nsa-backend", default="auto", choices=["auto", "reference", "triton"])
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--needle-selection", action=argparse.BooleanOptionalAction, default=None,
                   help="record whether the last prompt token's top-n selection holds the item's block (default: on "
                   "for this project's NSA models in nsa mode, off for others)")
    return p


# what makes two evaluations of one task and scoring the same measurement (a second run may replace the first)
SAME_EVALUATION = ("lengths", "depths", "samples", "seed")


def check_not_replacing(out_dir: Path, task: str, scoring: str, settings: dict) -> None:
    """Refuse to overwrite `<out>/<task>_<scoring>.json` holding an evaluation with other settings: for a run's
    final/ that file is the trainer's --eval-long-context result, which the model card, bench/ab_compare.py and
    bench/seed_groups.py read, and a silent swap would mix two measurements there."""
    path = Path(out_dir) / f"{task}_{scoring}.json"
    if not path.is_file():
        return
    try:
        old = json.loads(path.read_text())
    except json.JSONDecodeError:
        old = {}
    recorded_haystack = old.get("haystack")
    old = {k: old.get(k) for k in SAME_EVALUATION}  # (its lengths sorted, as check_lengths leaves them)
    differ = [f"{k} {old[k]} -> {settings[k]}" for k in SAME_EVALUATION if old[k] != settings[k]]
    # the needle's documents (recorded as their description, which a short pool extends with a note)
    haystack = settings.get("haystack")
    if haystack and recorded_haystack and not str(recorded_haystack).startswith(haystack):
        differ.append(f"haystack {recorded_haystack!r} -> {haystack!r}")
    if differ:
        raise ValueError(f"{path} holds an evaluation with other settings ({'; '.join(differ)}): for a run it is the "
                         "trainer's --eval-long-context result, which the model card, ab_compare and seed_groups "
                         "read. Pass --out DIR to write this one elsewhere, or --overwrite to replace it.")


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    # cheap checks first: a typo fails before a model is loaded
    check_task(args.task)
    check_scoring(args.scoring)
    depths = check_depths(args.depths)
    check_device(args.device)  # before the check of an earlier result: each mistake named at the first try
    check_not_a_run_directory(args.model)
    out = args.out
    if out is None:
        run_dir = Path(args.model).resolve().parent  # a run's final/ sits in the run's directory
        out = run_dir / "long_context" if (run_dir / "run.json").is_file() else Path("long_context")
    check_output_path(out, "folder")
    if args.training_len is not None and args.training_len < 1:
        raise ValueError(f"--training-len {args.training_len}: the model's training length is a positive number of "
                         "tokens (the --seq-len it trained at); leave it out to read it from the model or its run.")
    if not args.overwrite:
        settings = {"lengths": check_lengths(args.lengths, None), "depths": depths, "samples": args.samples,
                    "seed": args.seed}  # fmt: skip
        if args.task == "needle":  # (described as the evaluation will record it; not read here)
            from .data import make_source

            settings["haystack"] = make_source(args.haystack or default_haystack(), args.text_column,
                                               flag="--haystack").describe()  # fmt: skip
        check_not_replacing(Path(out), args.task, args.scoring, settings)
    from .step_log import transformers_bars_on_a_terminal_only  # (here: step_log imports this module's users)

    transformers_bars_on_a_terminal_only()
    model, tokenizer = load_model_and_tokenizer(args.model, args.tokenizer, args.device, args.dtype, args.nsa_backend,
                                                args.trust_remote_code)  # fmt: skip
    return run_long_context_eval(
        model, tokenizer, args.task, args.lengths, args.depths, samples=args.samples, batch_size=args.batch_size,
        scoring=args.scoring, seed=args.seed, haystack=args.haystack, text_column=args.text_column,
        training_len=args.training_len, training_len_source="--training-len", model_path=args.model, out_dir=out,
        model_name=args.model, selection=args.needle_selection,
    )  # fmt: skip


def run_command(main_function, errors=(ValueError, FileNotFoundError, RuntimeError)) -> None:
    """Run a command's main(): an error from bad input (the message names the value and the fix) prints as one
    line `error: ...` and exits with status 2, not as a traceback. Shared by the quality tools' scripts."""
    try:
        main_function()
    except errors as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    run_command(main)


__all__ = ["RetrievalCase", "answer_mentions", "build_case", "build_cases", "card_section", "ended_inside_answer_rates",
           "ending_summary", "ends_inside_answer", "format_table", "needle_selection",
           "plot_heatmap", "run_command", "run_long_context_eval", "score_generate", "score_loglik",
           "takes_needle_selection", "tells_more_than_accuracy"]  # fmt: skip
