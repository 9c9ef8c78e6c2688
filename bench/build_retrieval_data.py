"""Build training rows for long-context retrieval: passkey or needle prompts with their answers, one or several
per row.

    python bench/build_retrieval_data.py --task passkey --tokenizer byt5 --seq-len 512 --rows 20000 \\
        --out runs/data/passkey-byt5-512.parquet
    python train_accelerate.py --dataset runs/data/passkey-byt5-512.parquet --tokenizer byt5 --seq-len 512 ...
    python -m nsa_train.long_context runs/X/final --task passkey --lengths 256 512 1024

Each document is what `nsa_train.long_context` asks at evaluation (instruction, haystack, the hidden item at a
depth drawn uniformly from [0, 1], the question) followed by the answer, sized so that with the end-of-text
token the trainer appends it fills one `--seq-len` row exactly: the packer never splits one across rows, so
every row teaches the full retrieval. The generators are seeded apart from the evaluation's, so a model is not
evaluated on the prompts it trained on. Use it to train or fine-tune (`--init-from`) a model for retrieval
beyond its window, e.g. rows at 4-8x NSA's `window_size`, then evaluate NSA and its dense twin side by side.

`--doc-len N` (a divisor of `--seq-len`) packs `--seq-len / N` shorter documents into each row instead (the
trainer's document masking keeps them apart): as many retrievals per row, so more of the loss is the answer.
`--min-doc-len M` varies where each answer ends: each case (prompt and answer) takes a length drawn from [M, N]
and haystack text after its answer (a blank line, then filler) completes the document. Without it every answer
ends its document, at the same position, which a small model can learn instead of the lookup (bench/QUALITY.md, "Retrieval
twins that retrieve"); with it an evaluation at any length from M to N is laid out as training was. (The text
after the answer stays in the same document: the trainer shuffles documents, so a separate filler document would
not stay beside its case.)
One answer of a few tokens per 4,096-token row gave a 125M model too little signal to learn passkey retrieval in
4.9M tokens (bench/QUALITY.md, "Retrieval twins"); documents of 1,024 tokens (2x NSA's window) give four per row.

The script checks that the tokenizer gives each text back at the length it was built for (a BPE tokenizer can
merge differently when re-reading decoded text), replaces those it does not with others, and says how many;
nothing here is committed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from nsa_train.long_context import TASKS, run_command, training_documents  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)  # fmt: skip
    p.add_argument("--task", default="passkey", help=f"one of {', '.join(TASKS)}")
    p.add_argument("--tokenizer", required=True, help="the tokenizer the model trains with: a path, a Hub id or 'byt5'")
    p.add_argument("--seq-len", type=int, required=True, help="the trainer's --seq-len: the tokens of one row")
    p.add_argument("--rows", type=int, default=10000, help="training rows to fill (--seq-len tokens each)")
    p.add_argument("--doc-len", type=int, default=None,
                   help="tokens per document, end-of-text included (default: --seq-len, one per row); a divisor of "
                        "--seq-len: each row then holds --seq-len / --doc-len documents")
    p.add_argument("--min-doc-len", type=int, default=None,
                   help="vary where each answer ends: each case (prompt and answer) takes a length drawn uniformly "
                        "from [--min-doc-len, --doc-len] and haystack text after the answer completes its document; "
                        "without it every answer ends its document, at the same position")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--haystack", default=None, help="needle: a parquet/jsonl/txt file of documents or 'python-docs' "
                   "(default: the shared wiki parquet beside the checkout when present, else python-docs)")
    p.add_argument("--text-column", default="text", help="the --haystack file's text column")
    p.add_argument("--out", required=True, help="the parquet file to write (column 'text')")
    return p


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    if args.seq_len < 2:
        raise ValueError(f"--seq-len {args.seq_len}: give the trainer's row length (at least 2).")
    from nsa_train.data import load_tokenizer

    doc_len = args.seq_len if args.doc_len is None else args.doc_len
    if not 2 <= doc_len <= args.seq_len or args.seq_len % doc_len:
        raise ValueError(f"--doc-len {doc_len}: give a divisor of --seq-len {args.seq_len} (at least 2), so that "
                         f"whole documents fill each row, e.g. --doc-len {args.seq_len // 4}.")
    if args.rows < 1:
        raise ValueError(f"--rows {args.rows}: give at least 1 row.")
    per_row = args.seq_len // doc_len
    tokenizer = load_tokenizer(args.tokenizer)
    # texts (documents, the haystack) are tokenized whole to count their tokens, never fed to a model: its limit
    # (GPT-2's 1,024) would only print a warning about sequences longer than it
    tokenizer.model_max_length = 10**9
    wanted = args.rows * per_row
    # Every document must fill its share of a row exactly: the trainer's packer splits a document that does not
    # across rows, which shifts every row after it (shuffled, wherever it lands), so a case's item and its question
    # can end up in different rows. A BPE tokenizer can read decoded text back a token longer or shorter: those
    # documents are dropped and replaced by others drawn with further seeds.
    texts, dropped, haystack = [], 0, ""
    for attempt in range(8):
        more, lengths, haystack = training_documents(
            tokenizer, args.task, doc_len, wanted - len(texts) + (wanted - len(texts)) // 8 + 1,
            args.seed + attempt * 1_000_003, args.haystack, args.text_column,
            "--seq-len" if args.doc_len is None else "--doc-len", args.min_doc_len,
        )  # fmt: skip
        texts += [text for text, n in zip(more, lengths) if n == doc_len]
        dropped += sum(n != doc_len for n in lengths)
        if len(texts) >= wanted:
            break
    if len(texts) < wanted:
        raise ValueError(f"--tokenizer {args.tokenizer!r}: only {len(texts)} of {wanted} documents re-tokenize to "
                         f"--doc-len {doc_len} tokens ({dropped} did not); try another --doc-len or --min-doc-len.")
    texts = texts[:wanted]

    import pyarrow as pa
    import pyarrow.parquet as pq

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"text": texts}), out)
    summary = {"out": str(out), "task": args.task, "rows": args.rows, "documents": len(texts),
               "seq_len": args.seq_len, "doc_len": doc_len, "documents_per_row": per_row, "haystack": haystack,
               "min_doc_len": args.min_doc_len, "documents_replaced": dropped}  # fmt: skip
    what = f"{len(texts):,} {args.task} documents of {doc_len} tokens with end-of-text"
    if args.min_doc_len is not None:
        what += f" (cases of {args.min_doc_len}-{doc_len} tokens, haystack text after the answer)"
    print(f"wrote {out}: {what}, {per_row} per {args.seq_len}-token row ({haystack}); {dropped} that re-tokenized "
          "to another length were replaced, so every row holds whole documents")
    return summary


if __name__ == "__main__":
    run_command(main)
